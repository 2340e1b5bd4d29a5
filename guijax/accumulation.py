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
  its `normalizer` when it carries one, else its loss tokens (`token` normalisation) or its rows with loss
  tokens (`sequence`); a batch with no loss token weighs 0. A group's update is then the weighted mean of its
  batches' losses: for a loss that is one aggregate (the clipped surrogate, LUFFY, cross-entropy, with their
  KL terms) exactly the update of one batch holding all the group's rows (tested); a second term with a
  denominator of its own (RL+SFT's cross-entropy over expert tokens, SEAgent's mean over failure rows, the
  router's balancing loss) is weighted by the first term's share.

A micro-step skipped as non-finite leaves its weight in the group, whose update is then smaller by that
share. The logged `grad_norm` of a micro-step is that of its scaled gradient.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator, Sequence

import jax.numpy as jnp
import numpy as np

from guijax.losses import NORMALIZATIONS
from guijax.train_step import TrainState, pending_microsteps


def batch_weight(batch: dict[str, Any], normalization: str = "token") -> float:
    """The batch's own loss denominator: 0 without a loss token, else its `normalizer`, else its loss tokens
    (`token`) or its rows with loss tokens (`sequence`). Reduced where the mask lives (a placed global array
    on a mesh), so only a scalar comes to the host."""
    has_loss = jnp.asarray(batch["loss_mask"]) > 0
    tokens = float(jnp.sum(has_loss))
    if not tokens:
        return 0.0
    if batch.get("normalizer") is not None:
        return float(np.asarray(batch["normalizer"]))
    return tokens if normalization == "token" else float(jnp.sum(jnp.any(has_loss, axis=-1)))


def scaled_groups(batches: Sequence[dict[str, Any]], k: int,
                  normalization: str = "token") -> Iterator[tuple[dict[str, Any], bool]]:
    """(batch with its `loss_scale`, whether it ends its group) for each batch in order, in groups of k, the
    weights by the loss's `normalization`; with k = 1 the batches as they are (every one its own update)."""
    if k < 1:
        raise ValueError(f"accumulation groups need k >= 1, got {k}")
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"normalization must be one of {NORMALIZATIONS}, got {normalization!r}")
    if k == 1:
        yield from ((batch, True) for batch in batches)
        return
    for start in range(0, len(batches), k):
        group = batches[start:start + k]
        weights = [batch_weight(b, normalization) for b in group]
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
