"""Gradient accumulation over a list of batches (`optim.grad_accum_steps` = k > 1).

`optax.MultiSteps` applies one update per k micro-batches, the mean of their gradients. Fed a stream of
batches, its groups run on past the end of the list: a PPO epoch's last batches would be averaged with the
next epoch's, or the next iteration's, whose old log-probs come from other parameters. And each batch's
loss is normalised over its own tokens, so the mean of k such losses weighs a token of a short batch more
than a token of a long one.

Here a list is cut into groups of k consecutive batches, and:

* a short last group is completed with empty micro-steps (zero gradients, no forward or backward pass:
  `train_step.make_empty_microstep`), so the list's updates are applied before it returns;
* each batch's loss is scaled by k · w_b / Σ_group w (`loss_scale`), w_b being the batch's own denominator:
  its `normalizer` when it carries one, else its loss tokens. A group's update is then the weighted mean
  of its batches' losses, which for the default token normalisation is exactly the update of one batch
  holding all the group's rows (tested); with per-sequence normalisation it is the token-weighted mean of
  the batches' sequence means.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator, Sequence

import numpy as np

from guijax.train_step import TrainState, pending_microsteps


def batch_weight(batch: dict[str, Any]) -> float:
    """The batch's own loss denominator: its `normalizer`, or the count of its loss tokens."""
    if batch.get("normalizer") is not None:
        return float(np.asarray(batch["normalizer"]))
    return float(np.sum(np.asarray(batch["loss_mask"]) > 0))


def scaled_groups(batches: Sequence[dict[str, Any]], k: int) -> Iterator[tuple[dict[str, Any], bool]]:
    """(batch with its `loss_scale`, whether it ends its group) for each batch in order, in groups of k; with
    k = 1 the batches as they are (every one its own update)."""
    if k < 1:
        raise ValueError(f"accumulation groups need k >= 1, got {k}")
    if k == 1:
        yield from ((batch, True) for batch in batches)
        return
    for start in range(0, len(batches), k):
        group = batches[start:start + k]
        weights = [batch_weight(b) for b in group]
        total = sum(weights)
        for i, (batch, w) in enumerate(zip(group, weights)):
            scale = k * w / total if total > 0 else 1.0
            yield dict(batch, loss_scale=np.float32(scale)), i == len(group) - 1


def flush(state: TrainState, empty_microstep: Callable[[TrainState], TrainState]) -> tuple[TrainState, int]:
    """Complete the open accumulation group with empty micro-steps; returns the state and how many ran."""
    pending, ran = pending_microsteps(state.opt_state), 0
    while pending:
        state = empty_microstep(state)
        ran += 1
        pending = pending_microsteps(state.opt_state)
    return state, ran
