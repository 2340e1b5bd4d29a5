"""Distribution diagnostics of BEPA §5.4 (Fig. 3 and 5): how a set of traces looks to a policy.

For each trace set (converted expert traces D_conv, self-rolled D_self, the policy's own successes) the
per-token probabilities of its responses under a policy give a histogram over [0, 1], the tail mass
Pr(p < 0.2) (the band LUFFY's shaping acts on), and the Jensen-Shannon divergence of the histogram to the
on-policy reference (a coarse shape comparison, as in the paper, not a test).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np

from guijax.data.pipeline import PipelineConfig, make_dataset, step_refs
from guijax.rollout.trajectory import Trajectory

BINS = np.linspace(0.0, 1.0, 21)


def step_logprobs(logprob_fn: Callable[[Any, dict], Any], params: Any, trajectories: Sequence[Trajectory],
                  processor: Any, model_cfg: Any, pipeline: PipelineConfig) -> Iterator[tuple[dict, np.ndarray]]:
    """(batch, per-token log-probs) over every step of `trajectories`, in order, under `params`; the batch's
    `loss_mask` marks response tokens and `meta["trajectory"]` each row's trajectory."""
    data = make_dataset(list(trajectories), step_refs(list(trajectories)), processor, model_cfg,
                        dataclasses.replace(pipeline, shuffle=False))
    for batch in data:
        logp, _ = logprob_fn(params, {k: v for k, v in batch.items() if k != "meta"})
        yield batch, np.asarray(logp, np.float64)


def token_probabilities(logprob_fn: Callable[[Any, dict], Any], params: Any, trajectories: Sequence[Trajectory],
                        processor: Any, model_cfg: Any, pipeline: PipelineConfig) -> np.ndarray:
    """Probabilities under `params` of every response token of `trajectories` (flattened)."""
    if not trajectories:
        return np.zeros((0,), np.float32)
    out = [np.exp(logp[np.asarray(batch["loss_mask"]) > 0])
           for batch, logp in step_logprobs(logprob_fn, params, trajectories, processor, model_cfg, pipeline)]
    return np.concatenate(out).astype(np.float32)


def mean_trajectory_logps(logprob_fn: Callable[[Any, dict], Any], params: Any, trajectories: Sequence[Trajectory],
                          processor: Any, model_cfg: Any, pipeline: PipelineConfig) -> list[float]:
    """Mean response-token log-prob of each trajectory (BEPA's cache update rule U = logprob)."""
    totals, counts = np.zeros(len(trajectories)), np.zeros(len(trajectories))
    for batch, logp in step_logprobs(logprob_fn, params, trajectories, processor, model_cfg, pipeline):
        mask = np.asarray(batch["loss_mask"])
        per_row = (logp * mask).sum(axis=1)
        for row, traj in enumerate(batch["meta"]["trajectory"]):
            if traj < 0:  # a blank example holding a packing block's place
                continue
            totals[traj] += per_row[row]
            counts[traj] += mask[row].sum()
    return list(totals / np.maximum(counts, 1.0))


def histogram(probs: np.ndarray) -> np.ndarray:
    """Share of tokens per 0.05-wide probability bin (sums to 1; all zeros for no tokens)."""
    counts, _ = np.histogram(np.clip(probs, 0.0, 1.0), bins=BINS)
    return counts / max(counts.sum(), 1)


def tail_mass(probs: np.ndarray, threshold: float = 0.2) -> float:
    return float(np.mean(probs < threshold)) if len(probs) else float("nan")


def js_divergence(p: np.ndarray, q: np.ndarray) -> float:
    """Jensen-Shannon divergence (natural log, in [0, ln 2]) of two histograms."""
    p, q = np.asarray(p, np.float64), np.asarray(q, np.float64)
    if p.sum() == 0 or q.sum() == 0:
        return float("nan")
    p, q = p / p.sum(), q / q.sum()
    m = (p + q) / 2

    def kl(a: np.ndarray, b: np.ndarray) -> float:
        keep = a > 0
        return float(np.sum(a[keep] * np.log(a[keep] / b[keep])))

    return 0.5 * kl(p, m) + 0.5 * kl(q, m)


def summarize(sets: dict[str, np.ndarray], reference: str) -> dict[str, dict[str, Any]]:
    """Per trace set: token count, mean probability, tail mass, histogram, JS divergence to `reference`."""
    ref_hist = histogram(sets[reference]) if reference in sets else None
    out = {}
    for name, probs in sets.items():
        hist = histogram(probs)
        out[name] = {"tokens": int(len(probs)), "mean_probability": float(np.mean(probs)) if len(probs) else None,
                     "tail_mass_p_lt_0.2": tail_mass(probs), "histogram": hist.tolist(),
                     "js_to_" + reference: js_divergence(hist, ref_hist) if ref_hist is not None else None}
    return out


def same_responses(trajectories: Sequence[Trajectory], references: dict[str, Trajectory]) -> dict[str, int]:
    """How many `trajectories` repeat, response for response, the reference trace of their task.

    A self-rolled success identical to the converted expert trace is not off-policy guidance that differs
    from D_conv: BEPA, Trace Replacement and LEVEL-2 seeded with D_conv then inject the same tokens."""
    with_reference = [t for t in trajectories if t.task_id in references]
    same = sum([s.response for s in t.steps] == [s.response for s in references[t.task_id].steps]
               for t in with_reference)
    return {"trajectories": len(with_reference), "same_as_reference": int(same)}


def on_policy_successes(trajectories: Iterable[Trajectory], task_ids: set[str]) -> dict[str, int]:
    """Sampled (not injected) episodes on `task_ids` and how many succeeded. On the expert-only split this is
    BEPA's mechanism: GRPO's groups there stay all-failure, a method that assimilates the expert's tasks
    starts solving them on-policy."""
    episodes = [t for t in trajectories if t.task_id in task_ids and t.source.value == "on_policy"]
    return {"episodes": len(episodes), "successes": int(sum(t.success for t in episodes))}


def plot_histograms(summary: dict[str, dict[str, Any]], path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    centers = (BINS[:-1] + BINS[1:]) / 2
    fig, ax = plt.subplots(figsize=(6, 3.5))
    width = 0.05 / max(len(summary), 1)
    for i, (name, s) in enumerate(summary.items()):
        ax.bar(centers - 0.025 + width * (i + 0.5), s["histogram"], width=width,
               label=f"{name} (tail {100 * s['tail_mass_p_lt_0.2']:.1f}%, {s['tokens']} tok)")
    ax.set_xlabel("token probability under the policy")
    ax.set_ylabel("share of tokens")
    ax.set_title(title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
