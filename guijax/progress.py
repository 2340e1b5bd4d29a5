"""What a person watching a run sees: one line when a stage starts and one when it ends, and for long loops
(SFT steps, RL iterations, rollouts, evaluation, the methods of a comparison) a progress bar with rate and
ETA on a terminal, or plain periodic lines when the output goes to a file, where a bar's carriage returns
would pile up into one unreadable line.

`GUIJAX_PROGRESS` picks the style: `auto` (default: a bar on a terminal, lines otherwise), `bar`, `lines`
or `off`; `GUIJAX_PROGRESS_INTERVAL_S` is the seconds between plain lines (default 30).
"""
from __future__ import annotations

import os
import sys
import time
from typing import Any, TextIO

_open_bars: list["Progress"] = []


def _style(stream: TextIO) -> str:
    style = os.environ.get("GUIJAX_PROGRESS", "auto")
    if style not in ("auto", "bar", "lines", "off"):
        raise ValueError(f"GUIJAX_PROGRESS={style!r}; choose auto, bar, lines or off")
    if style == "auto":
        return "bar" if getattr(stream, "isatty", lambda: False)() else "lines"
    return style


def _interval_s() -> float:
    return float(os.environ.get("GUIJAX_PROGRESS_INTERVAL_S", "30"))


def format_duration(seconds: float) -> str:
    """3.2 -> '3.2s', 95 -> '1m35s', 7300 -> '2h01m'."""
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(round(seconds)), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


def echo(text: str, stream: TextIO | None = None) -> None:
    """Print a line without tearing an open terminal bar (it is redrawn below the line)."""
    stream = stream or sys.stdout
    if any(p.bar is not None for p in _open_bars):
        from tqdm import tqdm

        tqdm.write(text, file=stream)
    else:
        print(text, file=stream, flush=True)


class Progress:
    """Progress of a loop of `total` units: `update(n, **figures)` after each piece of work.

    On a terminal this is a tqdm bar (rate, ETA and the latest figures); otherwise a line such as
    `  sft: 60/150 steps (40%), 1.3 steps/s, ETA 1m09s, loss=2.31` every `GUIJAX_PROGRESS_INTERVAL_S`
    seconds and once at the end. `transient` bars (the rollouts inside an RL iteration) vanish from the
    terminal when done and print no closing line to a file.
    """

    def __init__(self, total: int, desc: str, unit: str = "it", *, initial: int = 0, transient: bool = False,
                 stream: TextIO | None = None):
        self.total, self.desc, self.unit, self.n = int(total), desc, unit, int(initial)
        self.transient = transient
        self.stream = stream or sys.stdout
        self.style = _style(self.stream)
        self.figures: dict[str, Any] = {}
        self._start = time.perf_counter()
        self._initial = self.n
        self._last_line = self._start
        self.bar = None
        if self.style == "bar":
            from tqdm import tqdm

            self.bar = tqdm(total=self.total, initial=self.n, desc=desc, unit=f" {unit}", file=self.stream,
                            leave=not transient, dynamic_ncols=True)
        _open_bars.append(self)

    def update(self, n: int = 1, **figures: Any) -> None:
        self.n += n
        self.figures.update(figures)
        if self.bar is not None:
            if figures:
                self.bar.set_postfix({k: _short(v) for k, v in self.figures.items()}, refresh=False)
            self.bar.update(n)
        elif self.style == "lines" and time.perf_counter() - self._last_line >= _interval_s() and self.n < self.total:
            self._line()

    def _line(self) -> None:
        self._last_line = time.perf_counter()
        elapsed = self._last_line - self._start
        done = self.n - self._initial
        rate = done / elapsed if elapsed > 0 else 0.0
        parts = [f"  {self.desc}: {self.n}/{self.total} {self.unit}s"
                 + (f" ({100 * self.n / self.total:.0f}%)" if self.total else "")]
        if done and rate:
            parts.append(f"{rate:.3g} {self.unit}s/s" if rate >= 1 else f"{1 / rate:.3g} s/{self.unit}")
            if self.n < self.total:
                parts.append(f"ETA {format_duration((self.total - self.n) / rate)}")
            else:
                parts.append(f"took {format_duration(elapsed)}")
        parts += [f"{k}={_short(v)}" for k, v in self.figures.items()]
        print(", ".join(parts), file=self.stream, flush=True)

    def close(self) -> None:
        if self in _open_bars:
            _open_bars.remove(self)
        if self.bar is not None:
            self.bar.close()
        elif self.style == "lines" and not self.transient and self.n > self._initial:
            self._line()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)
