"""DesktopEnv: OSWorld tasks on a local Xvfb desktop with Debian apps, no VM.

One DesktopEnv owns one display for its whole life; `reset` closes the apps of the previous episode (not
the X server), so consecutive episodes pay only for the apps they start.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from envs.api import DEFAULT_STEP_LIMIT
from envs.desktop.controller import LocalController
from envs.desktop.display import Display
from envs.osworld.env import OSWorldEnv


class DesktopEnv(OSWorldEnv):
    def __init__(self, screen_size: tuple[int, int] = (1920, 1080), *, window_manager: str | None = "openbox",
                 step_limit: int = DEFAULT_STEP_LIMIT, command_timeout_s: float = 90.0,
                 cache_dirs: Sequence[str] = (), allow_network: bool = False, home: str | None = None,
                 wait_s: float = 2.0, settle_s: float = 0.5):
        """`screen_size` is (width, height) like OSWorld's; `cache_dirs` hold files for `download` steps."""
        self.display = Display(screen_size, window_manager=window_manager, home=home)
        try:
            controller = LocalController(self.display, command_timeout_s, cache_dirs, allow_network)
            super().__init__(controller, step_limit=step_limit, cache_dirs=cache_dirs, allow_network=allow_network,
                             wait_s=wait_s, settle_s=settle_s)
        except BaseException:
            self.display.close()
            raise

    def close(self) -> None:
        try:
            super().close()
        finally:
            self.display.close()


@dataclasses.dataclass(frozen=True)
class DesktopFactory:
    """Picklable factory for EnvPool workers: each worker gets its own display."""

    screen_size: tuple[int, int] = (1920, 1080)
    step_limit: int = DEFAULT_STEP_LIMIT
    window_manager: str | None = "openbox"
    command_timeout_s: float = 90.0
    cache_dirs: tuple[str, ...] = ()

    def __call__(self) -> DesktopEnv:
        return DesktopEnv(self.screen_size, window_manager=self.window_manager, step_limit=self.step_limit,
                          command_timeout_s=self.command_timeout_s, cache_dirs=self.cache_dirs)
