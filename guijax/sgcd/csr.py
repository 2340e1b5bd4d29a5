"""SGCD's Continuation Success Rate (sgcd.txt §5.1, Table 4, Appendix B): on tasks the plain policy fails, the
plain policy acts k steps, the evaluated model finishes with no skill, the verifier decides. The figure is the
unweighted mean over the depths k = 1..K of each depth's success rate; per-depth rates (Table 6), rates over
depth buckets (Table 5's 1-5, 5-10, ...) and the failure-step histogram (Fig. 1a) come with it.
"""
from __future__ import annotations

import pathlib
from collections import Counter
from typing import Any, Sequence

from guijax.rollout.trajectory import Status, Trajectory

# The paper counts a trial as solved at verifier score >= 0.8 (Appendix B); the desk's verifier gives 0 or 1.
SOLVED = 0.8


def depth_buckets(max_depth: int, width: int = 5) -> list[tuple[int, int]]:
    """Table 5's overlapping windows: (1, 5), (5, 10), (10, 15), ... up to `max_depth`."""
    if max_depth <= width:
        return [(1, max_depth)]
    out, lo = [(1, width)], width
    while lo < max_depth:
        out.append((lo, min(lo + width, max_depth)))
        lo += width
    return out


def continuation_success(trajectories: Sequence[Trajectory], depths: Sequence[int],
                         buckets: Sequence[tuple[int, int]] = ()) -> dict[str, Any]:
    """Per-depth trials and rates, their unweighted mean over the depths that had trials, and bucket rates.
    Episodes that ended in an environment error are not trials (counted apart)."""
    trials: Counter = Counter()
    solved: Counter = Counter()
    errors = 0
    for t in trajectories:
        k = t.meta.get("handoff")
        if k is None:
            raise ValueError(f"trajectory of task {t.task_id} has no handoff depth (meta['handoff'])")
        if t.status == Status.ENV_ERROR:
            errors += 1
            continue
        trials[k] += 1
        solved[k] += int(t.status != Status.PARSE_ERROR and t.reward >= SOLVED)
    per_depth = {int(k): {"trials": trials[k], "success_rate": solved[k] / trials[k]} for k in depths if trials[k]}
    mean = sum(d["success_rate"] for d in per_depth.values()) / len(per_depth) if per_depth else None
    by_bucket = {}
    for lo, hi in buckets:
        n = sum(trials[k] for k in range(lo, hi + 1))
        if n:
            by_bucket[f"{lo}-{hi}"] = sum(solved[k] for k in range(lo, hi + 1)) / n
    return {"csr": mean, "per_depth": per_depth, "buckets": by_bucket, "env_errors": errors,
            "trials": sum(trials.values())}


def failure_histogram(steps: Sequence[int | None]) -> dict[str, int]:
    """Counts of the step at which failed episodes first left the task's path ('none' when no step did)."""
    counts = Counter("none" if s is None else int(s) for s in steps)
    return {str(k): counts[k] for k in sorted((k for k in counts if k != "none"), key=int)} | (
        {"none": counts["none"]} if counts["none"] else {})


def markdown(results: dict[str, dict[str, Any]], depths: Sequence[int]) -> str:
    """Rows: policies; columns: the rate at each depth, the buckets, and the Continuation Success Rate."""
    buckets = list(dict.fromkeys(b for r in results.values() for b in r["buckets"]))
    head = ["policy"] + [f"k={k}" for k in depths] + [f"k {b}" for b in buckets] + ["CSR"]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for name, r in results.items():
        cells = [name]
        for k in depths:
            d = r["per_depth"].get(k) or r["per_depth"].get(str(k))
            cells.append(f"{100 * d['success_rate']:.1f} ({d['trials']})" if d else "–")
        cells += [f"{100 * r['buckets'][b]:.1f}" if b in r["buckets"] else "–" for b in buckets]
        cells.append(f"{100 * r['csr']:.1f}" if r["csr"] is not None else "–")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(results: dict[str, dict[str, Any]], histogram: dict[str, int], path: str | pathlib.Path) -> pathlib.Path:
    """Per-depth success of every policy (left) and the plain policy's failure steps (right), as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = pathlib.Path(path)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    for name, r in results.items():
        ks = sorted(int(k) for k in r["per_depth"])
        rates = [100 * (r["per_depth"].get(k) or r["per_depth"][str(k)])["success_rate"] for k in ks]
        label = f"{name} (CSR {100 * r['csr']:.1f}%)" if r["csr"] is not None else name
        left.plot(ks, rates, marker="o", label=label)
    left.set_xlabel("handoff depth k (plain-policy steps before the handoff)")
    left.set_ylabel("continuation success (%)")
    left.set_ylim(-2, 102)
    left.legend(fontsize=8)
    steps = [k for k in histogram if k != "none"]
    right.bar(steps, [histogram[k] for k in steps], color="tab:red")
    right.set_xlabel("first off-track step of a failed plain episode")
    right.set_ylabel("episodes")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
