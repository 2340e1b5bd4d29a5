"""The local desktop: Xvfb + a window manager + Debian apps, driven with pyautogui, read through X11.

Heavy imports (python-xlib, numpy image code) happen when a desktop is created, not on `import envs`.
"""
from envs.desktop.display import Display, DesktopError, missing_binaries
from envs.desktop.reaper import Reaper

__all__ = ["Display", "DesktopError", "Reaper", "missing_binaries", "DesktopEnv", "DesktopFactory", "LocalController"]


def __getattr__(name: str):
    if name in ("DesktopEnv", "DesktopFactory"):
        from envs.desktop import env

        return getattr(env, name)
    if name == "LocalController":
        from envs.desktop.controller import LocalController

        return LocalController
    raise AttributeError(name)
