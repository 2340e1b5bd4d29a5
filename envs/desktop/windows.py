"""Window lookup, activation and closing on an EWMH window manager through wmctrl.

Matching follows OSWorld's server (which calls `wmctrl -a/-c`): by default a case-insensitive substring of
the title; `strict` compares the whole title case-sensitively; `by_class` matches the WM_CLASS instead.
"""
from __future__ import annotations

import dataclasses
import shutil
import subprocess
import time


@dataclasses.dataclass(frozen=True)
class Window:
    id: str
    wm_class: str
    title: str


def list_windows(env: dict[str, str]) -> list[Window]:
    if shutil.which("wmctrl") is None:
        raise FileNotFoundError("wmctrl is not installed (run .ci/setup_desktop.sh)")
    out = subprocess.run(["wmctrl", "-l", "-x"], env=env, capture_output=True, text=True, timeout=10)
    windows = []
    for line in out.stdout.splitlines():
        parts = line.split(None, 4)
        if len(parts) >= 4:
            # id, desktop, class, host, title (title may be empty)
            windows.append(Window(parts[0], parts[2], parts[4] if len(parts) == 5 else ""))
    return windows


def find_windows(env: dict[str, str], name: str, strict: bool = False, by_class: bool = False) -> list[Window]:
    found = []
    for w in list_windows(env):
        field = w.wm_class if by_class else w.title
        if (field == name) if strict else (name.lower() in field.lower()):
            found.append(w)
    return found


def _act(env: dict[str, str], flag: str, name: str, strict: bool, by_class: bool) -> bool:
    matches = find_windows(env, name, strict, by_class)
    if not matches:
        return False
    wid = matches[0].id
    subprocess.run(["wmctrl", "-i", flag, wid], env=env, capture_output=True, timeout=10)
    return True


def activate_window(env: dict[str, str], name: str, strict: bool = False, by_class: bool = False) -> bool:
    """Raise and focus the first matching window; False when none matches."""
    return _act(env, "-a", name, strict, by_class)


def close_window(env: dict[str, str], name: str, strict: bool = False, by_class: bool = False) -> bool:
    return _act(env, "-c", name, strict, by_class)


def wait_window(env: dict[str, str], names: list[str], timeout_s: float, activate: bool = True) -> Window | None:
    """Poll until a window whose title contains one of `names` appears (OSWorld's open_file wait)."""
    deadline = time.monotonic() + timeout_s
    while True:
        for name in names:
            matches = find_windows(env, name)
            if matches:
                if activate:
                    subprocess.run(["wmctrl", "-i", "-a", matches[0].id], env=env, capture_output=True, timeout=10)
                return matches[0]
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.25)
