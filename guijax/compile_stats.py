"""How much of a run goes into XLA compilation, counted as it happens.

Every jitted program compiles once per distinct input shape; batches whose shapes vary from one iteration to the
next (row counts, screenshot counts) compile the train step again and again, which can cost more than the
step itself. jax reports each backend compilation (or persistent-cache fetch) as a timed monitoring event; this
module adds them up so an iteration's metrics can say how many there were and how long they took.
"""
from __future__ import annotations

import threading

import jax

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"

_lock = threading.Lock()
_totals = {"compiles": 0, "compile_s": 0.0}
_installed = False


def _listen(event: str, duration_s: float, **_: object) -> None:
    if event == BACKEND_COMPILE_EVENT:
        with _lock:
            _totals["compiles"] += 1
            _totals["compile_s"] += duration_s


def install() -> None:
    """Start counting (once per process; every thread's compilations count)."""
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
    jax.monitoring.register_event_duration_secs_listener(_listen)


def totals() -> dict[str, float]:
    """Compilations and their seconds since `install()`."""
    with _lock:
        return dict(_totals)


class Window:
    """Compilations between its creation and `read()`: `{"compiles": n, "time_compile_s": s}`."""

    def __init__(self) -> None:
        install()
        self._start = totals()

    def read(self) -> dict[str, float]:
        now = totals()
        return {"compiles": int(now["compiles"] - self._start["compiles"]),
                "time_compile_s": now["compile_s"] - self._start["compile_s"]}
