"""Metrics: one JSON line per record in `metrics.jsonl` (flushed each time, so a crash loses nothing
written), TensorBoard scalars when tensorboardX is installed, and a one-line console summary."""
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


def read_metrics(path: str | pathlib.Path) -> list[dict[str, Any]]:
    path = pathlib.Path(path)
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
