#!/usr/bin/env bash
# System packages for the real-desktop environment (envs/desktop) and its tests (pytest -m desktop):
# an X server without a screen (Xvfb), a small EWMH window manager (openbox) and wmctrl, so windows can be
# found, activated and closed by title, a terminal (xterm running tmux, whose pane text is the
# terminal-output getter), a text editor (mousepad), LibreOffice Calc and Writer, fonts, and Chromium, whose
# headless screenshots check that the trajectory inspector's pages (guijax/inspector.py) render their markers
# on the right pixels.
# Idempotent: does nothing when every package is already there; otherwise `apt-get update` first.
set -euo pipefail
PACKAGES=(
  xvfb
  openbox
  wmctrl
  xterm tmux
  mousepad
  libreoffice-calc libreoffice-writer
  fonts-dejavu-core
  chromium
)
missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "setup_desktop: all ${#PACKAGES[@]} packages present"
  exit 0
fi
SUDO=""
if [ "$(id -u)" != "0" ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
$SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
echo "setup_desktop: installed ${missing[*]}"
