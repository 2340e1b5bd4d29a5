"""What the local desktop needs on this machine, as a reason string (tests skip with it; users read it)."""
from __future__ import annotations

import importlib.util
import shutil

PROGRAMS = ("Xvfb", "openbox", "wmctrl", "xterm", "tmux")
SERVER_PROGRAMS = ("Xvfb", "openbox")  # what `python -m envs.server` starts when it is given no --display
APPS = ("mousepad", "libreoffice")
MODULES = ("Xlib", "pyautogui", "requests", "openpyxl")
PACKAGES = {"Xlib": "python-xlib", "pyautogui": "pyautogui", "requests": "requests", "openpyxl": "openpyxl"}
INSTALL_MODULES = "pip install -e '.[desktop]'"
INSTALL_PROGRAMS = "bash .ci/setup_desktop.sh (apt-get install xvfb openbox wmctrl xterm tmux)"


def _reason(progs: list[str], mods: list[str]) -> str | None:
    parts = []
    if progs:
        parts.append(f"missing programs {progs}: {INSTALL_PROGRAMS}")
    if mods:
        parts.append(f"missing Python packages {[PACKAGES[m] for m in mods]}: {INSTALL_MODULES}")
    return "; ".join(parts) or None


def desktop_missing(apps: bool = False) -> str | None:
    """None when the desktop (and, with `apps`, the Debian apps of the local task suite) can run here."""
    progs = [p for p in PROGRAMS + (APPS if apps else ()) if shutil.which(p) is None]
    mods = [m for m in MODULES if importlib.util.find_spec(m) is None]
    return _reason(progs, mods)


def server_missing(own_display: bool) -> str | None:
    """None when `python -m envs.server` can start here; `own_display`: it starts its own Xvfb."""
    progs = [p for p in (SERVER_PROGRAMS if own_display else ()) if shutil.which(p) is None]
    mods = [m for m in MODULES if importlib.util.find_spec(m) is None]
    return _reason(progs, mods)
