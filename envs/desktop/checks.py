"""What the local desktop needs on this machine, as a reason string (tests skip with it; users read it)."""
from __future__ import annotations

import importlib.util
import shutil

PROGRAMS = ("Xvfb", "openbox", "wmctrl", "xterm", "tmux")
APPS = ("mousepad", "libreoffice")
MODULES = ("Xlib", "pyautogui", "requests", "openpyxl")


def desktop_missing(apps: bool = False) -> str | None:
    """None when the desktop (and, with `apps`, the Debian apps of the local task suite) can run here."""
    progs = [p for p in PROGRAMS + (APPS if apps else ()) if shutil.which(p) is None]
    mods = [m for m in MODULES if importlib.util.find_spec(m) is None]
    if not progs and not mods:
        return None
    parts = []
    if progs:
        parts.append(f"missing programs {progs} (run .ci/setup_desktop.sh)")
    if mods:
        parts.append(f"missing Python modules {mods} (pip install python-xlib pyautogui requests openpyxl)")
    return "; ".join(parts)
