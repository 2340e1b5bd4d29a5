"""Training-curve plot (PNG) from metrics.jsonl."""
from __future__ import annotations

import pathlib
from typing import Any, Sequence

CURVES = (("success_rate", "train success"), ("reward_mean", "reward"), ("entropy", "entropy"),
          ("approx_kl", "approx KL"), ("format_error_rate", "format errors"), ("grad_norm", "grad norm"),
          ("env_busy_fraction", "environments busy"), ("staleness_mean", "staleness (updates)"))


def plot_curves(records: Sequence[dict[str, Any]], path: str | pathlib.Path) -> pathlib.Path | None:
    records = [r for r in records if "iteration" in r]
    if not records:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    present = [(k, label) for k, label in CURVES if any(k in r for r in records)]
    fig, axes = plt.subplots(1, len(present), figsize=(3.2 * len(present), 2.8), squeeze=False)
    for ax, (key, label) in zip(axes[0], present):
        xs = [r["iteration"] for r in records if key in r]
        ax.plot(xs, [r[key] for r in records if key in r], marker="o", markersize=3)
        ax.set_title(label)
        ax.set_xlabel("iteration")
    fig.tight_layout()
    path = pathlib.Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
