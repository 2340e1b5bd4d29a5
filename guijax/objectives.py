"""Losses and advantage estimators registered by name: what a method trains with, as objects the jitted step
calls without knowing which method it runs.

A `Loss` maps the batch's per-token log-probs and entropy (computed once by the step) and the batch itself to
(loss, metrics). Losses are frozen dataclasses: hashable, so a jitted step closes over one and compiles once
per distinct loss. An `Objective` pairs a loss with the advantage estimator that feeds it and says whether
the trainer must compute reference log-probs (a KL term to the initial policy).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Protocol

import jax
import jax.numpy as jnp

from guijax import advantages as adv_lib
from guijax import losses

Batch = Mapping[str, Any]


class Loss(Protocol):
    def __call__(self, logp: jax.Array, entropy: jax.Array, batch: Batch) -> tuple[jax.Array, dict]: ...


@dataclasses.dataclass(frozen=True)
class ClippedPolicyLoss:
    """Clipped GRPO/PPO surrogate over all rows (`losses.clipped_policy_loss`); with `clip.kl_coef` > 0 the
    batch must carry `ref_logp`."""

    clip: losses.ClipConfig = losses.ClipConfig()

    def __call__(self, logp: jax.Array, entropy: jax.Array, batch: Batch) -> tuple[jax.Array, dict]:
        return losses.clipped_policy_loss(logp, batch["old_logp"], batch["advantages"], batch["loss_mask"], self.clip,
                                          ref_logp=_reference(batch, self.clip), entropy=entropy,
                                          normalizer=batch.get("normalizer"))


@dataclasses.dataclass(frozen=True)
class LuffyLoss:
    """LUFFY: clipped surrogate on on-policy rows, shaped π/(π+γ) on the batch's `off_policy` rows."""

    clip: losses.ClipConfig = losses.ClipConfig()
    gamma: float = 0.1

    def __call__(self, logp: jax.Array, entropy: jax.Array, batch: Batch) -> tuple[jax.Array, dict]:
        return losses.luffy_loss(logp, batch["old_logp"], batch["advantages"], batch["loss_mask"], batch["off_policy"],
                                 self.clip, gamma=self.gamma, normalizer=batch.get("normalizer"),
                                 ref_logp=_reference(batch, self.clip), entropy=entropy)


@dataclasses.dataclass(frozen=True)
class CrossEntropyLoss:
    """Token cross-entropy on the responses (SFT warm start, rejection-sampling fine-tuning)."""

    normalization: str = "token"

    def __call__(self, logp: jax.Array, entropy: jax.Array, batch: Batch) -> tuple[jax.Array, dict]:
        loss, metrics = losses.sft_loss(logp, batch["loss_mask"], batch.get("normalizer"),
                                        normalization=self.normalization)
        metrics["entropy"] = losses.masked_mean(entropy, batch["loss_mask"])
        return loss, metrics


@dataclasses.dataclass(frozen=True)
class WithCrossEntropy:
    """`inner` plus coef · cross-entropy on the batch's text rows (`expert`: steps with no sampled ids), the
    λ·CE term of RL+SFT. Those rows ride along with zero advantage, so `inner` gives them no policy gradient."""

    inner: Any
    coef: float

    def __call__(self, logp: jax.Array, entropy: jax.Array, batch: Batch) -> tuple[jax.Array, dict]:
        loss, metrics = self.inner(logp, entropy, batch)
        ce, _ = losses.sft_loss(logp, batch["loss_mask"] * batch["expert"][:, None])
        return loss + self.coef * ce, dict(metrics, sft_ce=ce)


@dataclasses.dataclass(frozen=True)
class BehaviourCorrected:
    """`inner` on rows sampled by older parameters than θ_old (asynchronous rollouts): the decoupled PPO
    objective, whose clipped ratio is π_θ/π_old (the trust region around the parameters the update starts
    from, old_logp recomputed by the learner) and whose every on-policy token is weighted by the importance
    weight π_old/π_behaviour of the policy that actually sampled it (the batch's `behaviour_logprobs`),
    detached and truncated at `cap`. Injected rows (`off_policy`: replay, cache, expert text) keep weight 1.

    The weight multiplies the token's advantage: for a positive weight w, w·(−min(r·A, clip(r)·A)) equals
    −min(r·wA, clip(r)·wA), dual clip included, so `inner` needs no change."""

    inner: Any
    cap: float = 5.0

    def __call__(self, logp: jax.Array, entropy: jax.Array, batch: Batch) -> tuple[jax.Array, dict]:
        mask = batch["loss_mask"]
        valid = (mask > 0) & ~jnp.asarray(batch["off_policy"], bool)[:, None]
        log_w = jnp.where(valid, batch["old_logp"] - batch["behaviour_logprobs"], 0.0)
        raw = jnp.exp(log_w)
        weight = jax.lax.stop_gradient(jnp.minimum(raw, self.cap))
        advantages = losses.token_advantages(jnp.asarray(batch["advantages"]), logp) * weight
        loss, metrics = self.inner(logp, entropy, dict(batch, advantages=advantages))
        on = mask * valid
        metrics["behaviour_weight_mean"] = losses.masked_mean(weight, on)
        metrics["behaviour_weight_capped_frac"] = losses.masked_mean((raw > self.cap).astype(jnp.float32), on)
        return loss, metrics


def _reference(batch: Batch, clip: losses.ClipConfig) -> jax.Array | None:
    if clip.kl_coef and "ref_logp" not in batch:
        raise ValueError(f"kl_coef={clip.kl_coef} needs the batch's ref_logp (reference-policy log-probs); the "
                         "trainer adds them when its objective has reference_kl")
    return batch.get("ref_logp")


def clip_config(train: Any) -> losses.ClipConfig:
    """The clip settings of a config's `train` section (ConfigDict or dataclass)."""
    return losses.ClipConfig(train.eps_low, train.eps_high, train.dual_clip, train.kl_coef, train.normalization)


LOSSES: dict[str, Callable[[Any], Loss]] = {
    "grpo": lambda train: ClippedPolicyLoss(clip_config(train)),
    "luffy": lambda train: LuffyLoss(clip_config(train)),
    "sft": lambda train: CrossEntropyLoss(train.normalization),
}

AdvantageFn = Callable[[jax.Array, jax.Array, int], adv_lib.GroupStats]

ADVANTAGES: dict[str, AdvantageFn] = {
    "group": lambda rewards, group_ids, num_groups: adv_lib.group_advantages(rewards, group_ids, num_groups, eps=1e-6),
}


def make_loss(name: str, train: Any) -> Loss:
    if name not in LOSSES:
        raise ValueError(f"unknown loss {name!r}; registered: {sorted(LOSSES)}")
    loss = LOSSES[name](train)
    clip = getattr(loss, "clip", None)
    if clip is not None:
        losses.check_clip_config(clip)
    return loss


@dataclasses.dataclass(frozen=True)
class Objective:
    loss: Any
    advantages: AdvantageFn = ADVANTAGES["group"]

    @property
    def reference_kl(self) -> bool:
        """Whether the loss has a KL term to a frozen reference policy (the trainer then scores every batch
        under the initial parameters as well)."""
        inner = self.loss
        while hasattr(inner, "inner"):
            inner = inner.inner
        clip = getattr(inner, "clip", None)
        return bool(clip is not None and clip.kl_coef)
