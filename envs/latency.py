"""An environment that takes time: every reset and step of the wrapped one waits a fixed number of seconds.

A real OSWorld VM needs seconds per step (the action, the UI settling, the screenshot); the synthetic desk
answers in milliseconds. Benchmarks of how rollouts overlap with training wrap the desk in this to stand in
for the VM. The wait is a sleep: it costs the worker time, not CPU.
"""
from __future__ import annotations

import time
from typing import Any

from envs.api import Env


class Slowed:
    def __init__(self, env: Env, seconds: float):
        if seconds < 0:
            raise ValueError(f"latency must be >= 0 seconds, got {seconds}")
        self.env, self.seconds = env, seconds

    def reset(self, *args: Any, **kwargs: Any) -> Any:
        time.sleep(self.seconds)
        return self.env.reset(*args, **kwargs)

    def step(self, *args: Any, **kwargs: Any) -> Any:
        time.sleep(self.seconds)
        return self.env.step(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:  # evaluate, observe, close: as the wrapped environment
        return getattr(self.env, name)
