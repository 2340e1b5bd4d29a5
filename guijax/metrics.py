"""Metrics: one JSON line per record in `metrics.jsonl` (flushed each time, so a crash loses nothing
written), TensorBoard scalars when tensorboardX is installed, and a one-line console summary.

A crash can tear the last line in half. Readers skip such a tail and the writer cuts it off before appending,
so a resume neither fails on it nor glues the next record to it; a broken line anywhere else is an error
naming the file and line."""
from __future__ import annotations

import json
import math
import pathlib
from typing import Any

from envs.atomic import write_text_atomic

CONSOLE_KEYS = ("iteration", "success_rate", "reward_mean", "format_error_rate", "zero_variance_groups", "loss",
                "entropy", "clip_frac_high", "approx_kl", "grad_norm", "tokens_per_s", "time_iteration_s")


class MetricsWriter:
    def __init__(self, workdir: str | pathlib.Path, filename: str = "metrics.jsonl", console: bool = True):
        self.path = pathlib.Path(workdir) / filename
        self.path.parent.mkdir(parents=True, exist_ok=True)
        _cut_torn_tail(self.path)
        self._file = open(self.path, "a", buffering=1)
        self.console = console
        try:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(str(pathlib.Path(workdir) / "tensorboard"))
        except ImportError:
            self._tb = None

    def write(self, record: dict[str, Any]) -> None:
        clean = {k: (v if not isinstance(v, float) or math.isfinite(v) else str(v)) for k, v in record.items()}
        self._file.write(json.dumps(clean) + "\n")
        step = int(record.get("iteration", record.get("sft_step", 0)))
        if self._tb is not None:
            for k, v in record.items():
                if isinstance(v, (int, float)) and k not in ("iteration", "sft_step"):
                    self._tb.add_scalar(k, v, step)
        if self.console and "iteration" in record:
            from guijax.progress import echo

            echo(" ".join(f"{k}={record[k]:.4g}" if isinstance(record[k], float) else f"{k}={record[k]}"
                          for k in CONSOLE_KEYS if k in record))

    def drop_from(self, iteration: int) -> None:
        """Remove iteration records at or after `iteration`: a run resumed from the checkpoint before them redoes
        those iterations and writes them again, so the file reads as one run instead of listing them twice."""
        self._file.close()
        kept = [r for r in read_metrics(self.path) if int(r.get("iteration", -1)) < iteration]
        write_text_atomic(self.path, "".join(json.dumps(r) + "\n" for r in kept))
        self._file = open(self.path, "a", buffering=1)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def _cut_torn_tail(path: pathlib.Path) -> None:
    """Truncate a last line that a crash left without its newline (the record was never complete)."""
    if not path.exists() or path.stat().st_size == 0:
        return
    with open(path, "rb+") as f:
        f.seek(-1, 2)
        if f.read(1) == b"\n":  # the common case: reads one byte, not the whole file
            return
        f.seek(0)
        f.truncate(f.read().rfind(b"\n") + 1)


def read_metrics(path: str | pathlib.Path) -> list[dict[str, Any]]:
    path = pathlib.Path(path)
    if not path.exists():
        return []
    lines = path.read_text(errors="replace").splitlines()
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as err:
            if number == len(lines):  # torn by a crash mid-write
                break
            raise ValueError(f"{path}: line {number} is not a JSON record ({err.msg}); fix or delete that line") from err
    return records
