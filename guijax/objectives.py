"""Losses and advantage estimators registered by name: what a method trains with, as objects the jitted step
calls without knowing which method it runs.

A `Loss` maps the batch's per-token log-probs and entropy (computed once by the step) and the batch itself to
(loss, metrics). Losses are frozen dataclasses: hashable, so a jitted step closes over one and compiles once
per distinct loss. An `Objective` pairs a loss with the advantage estimator that feeds it and says whether
the trainer must compute reference log-probs (a KL term to the initial policy).
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Any, Callable, Mapping, Protocol, Sequence

import jax
import jax.numpy as jnp
import numpy as np

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


def sampled_rows(batch: Batch) -> jax.Array:
    """[b] bool: the rows whose ids a sampler produced, so that their `behaviour_logprobs` mean something: not
    injected (`off_policy`: replay, cache, expert) and not text written without sampled ids (`expert`)."""
    sampled = ~jnp.asarray(batch["off_policy"], bool)
    if "expert" in batch:
        sampled &= jnp.asarray(batch["expert"]) == 0
    return sampled


@dataclasses.dataclass(frozen=True)
class BehaviourCorrected:
    """`inner` on rows sampled by another policy than θ_old's exact copy (older parameters in asynchronous
    rollouts; a sampler whose log-probs differ from the learner's, with `train.behaviour_correction`): the
    decoupled PPO objective, whose clipped ratio is π_θ/π_old (the trust region around the parameters the
    update starts from, old_logp recomputed by the learner) and whose every sampled token is weighted by the
    importance weight π_old/π_behaviour of the policy that actually sampled it (the batch's
    `behaviour_logprobs`), detached and truncated at `cap`. Other rows (`sampled_rows`: injected replay, cache
    and expert rows, text rows with no sampled ids) keep weight 1.

    The weight multiplies the token's advantage: for a positive weight w, w·(−min(r·A, clip(r)·A)) equals
    −min(r·wA, clip(r)·wA), dual clip included, so `inner` needs no change."""

    inner: Any
    cap: float = 5.0

    def __call__(self, logp: jax.Array, entropy: jax.Array, batch: Batch) -> tuple[jax.Array, dict]:
        mask = batch["loss_mask"]
        valid = (mask > 0) & sampled_rows(batch)[:, None]
        log_w = jnp.where(valid, batch["old_logp"] - batch["behaviour_logprobs"], 0.0)
        raw = jnp.exp(log_w)
        weight = jax.lax.stop_gradient(jnp.minimum(raw, self.cap))
        advantages = losses.token_advantages(jnp.asarray(batch["advantages"]), logp) * weight
        loss, metrics = self.inner(logp, entropy, dict(batch, advantages=advantages))
        on = mask * valid
        metrics["behaviour_weight_mean"] = losses.masked_mean(weight, on)
        metrics["behaviour_weight_capped_frac"] = losses.masked_mean((raw > self.cap).astype(jnp.float32), on)
        return loss, metrics


def behaviour_mismatch(old_logp: jax.Array, behaviour_logprobs: jax.Array, loss_mask: jax.Array,
                       sampled: jax.Array) -> dict[str, jax.Array]:
    """How far the log-probs the sampler recorded are from the learner's θ_old log-probs of the same tokens,
    over the loss tokens of `sampled` rows ([b] bool, `sampled_rows`): the sums of |Δ log p| and of the k3
    estimate of KL(π_behaviour ‖ π_old) (r − 1 − log r with r = π_old/π_behaviour: never negative, unbiased for
    tokens the behaviour policy sampled), and the token count. Sums, so a run's batches add up. A sampler in
    another precision or another engine shows here; so does staleness, in asynchronous runs."""
    on = loss_mask * jnp.asarray(sampled, jnp.float32)[:, None]
    delta = jnp.where(on > 0, old_logp - behaviour_logprobs, 0.0)
    r_log = jnp.minimum(delta, 30.0)  # a broken sampler stays a loud finite number, not an inf in the metrics
    return {"abs_sum": jnp.sum(jnp.abs(delta) * on), "kl_sum": jnp.sum((jnp.expm1(r_log) - r_log) * on),
            "tokens": jnp.sum(on)}


FAILURE_FORMS = ("log_ratio", "bounded")


@dataclasses.dataclass(frozen=True)
class WithAdversarialImitation:
    """SEAgent's L = L_GRPO + γ·L_AI (§3.2): `inner` (the clipped surrogate and its KL term) on every row that
    is not a failure step, plus γ times adversarial imitation on the batch's `failure` rows (judged a_F steps,
    their text as the episode wrote it), on each row's summed response log-prob against the reference
    policy's (`ref_logp`):

    * "log_ratio": log π_θ(a_F|s) − log π_ref(a_F|s), minimised, so the policy moves away from a_F. Eq. 2 prints
      −log π_θ(a|s)/π_ref(a_F|s); read with a = a_F that would raise π_θ(a_F), against the purpose §3.2 gives
      it ("penalize them using negative KL divergence"), so the log-ratio is pushed down; like the printed
      form it is unbounded below.
    * "bounded": −log σ(−(log π_θ(a_F) − log π_ref(a_F))) (`losses.failure_step_loss`), which saturates once
      π_θ(a_F) is well below π_ref(a_F)."""

    inner: Any
    gamma: float = 0.2
    form: str = "log_ratio"
    reads_ref_logp = True  # whatever train.kl_coef says: the batches carry the reference log-probs

    def __post_init__(self):
        if self.form not in FAILURE_FORMS:
            raise ValueError(f"adversarial imitation form must be one of {FAILURE_FORMS}, got {self.form!r}")

    def __call__(self, logp: jax.Array, entropy: jax.Array, batch: Batch) -> tuple[jax.Array, dict]:
        if "ref_logp" not in batch:
            raise ValueError("adversarial imitation needs the batch's ref_logp (the reference policy's log-probs "
                             "of the failure steps)")
        failure = jnp.asarray(batch["failure"], bool)
        mask = batch["loss_mask"]
        loss, metrics = self.inner(logp, entropy, dict(batch, loss_mask=mask * (~failure)[:, None]))
        row_logp = jnp.sum(jnp.where(mask > 0, logp, 0.0), -1)
        row_ref = jnp.sum(jnp.where(mask > 0, batch["ref_logp"], 0.0), -1)
        if self.form == "bounded":
            ai, extra = losses.failure_step_loss(row_logp, row_ref, self.gamma, valid=failure)
        else:
            delta = row_logp - row_ref
            ai = self.gamma * losses.masked_mean(delta, failure)
            extra = {"failure_logratio": losses.masked_mean(delta, failure)}
        return loss + ai, dict(metrics, **extra, ai_loss=ai, failure_rows=jnp.sum(failure.astype(jnp.float32)))


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


STEP_WEIGHTINGS = ("trajectory", "step0", "final")


@dataclasses.dataclass(frozen=True)
class Objective:
    """A loss, the advantage estimator that feeds it, and how a trajectory's advantage reaches its step rows
    (`steps`):

    * "trajectory": every step row carries the trajectory's Â_i (GRPO on every step, as BEPA and ARPO train);
    * "step0": EvoCUA's STEP0 (Eq. 4-5): each step row carries Â_i / T_i, and each batch's loss is divided by
      the number of trajectories its rows stand for (the batch's share of the iteration's on-policy
      trajectories, Eq. 5's 1/G over the groups), so with a per-step token mean (`sequence` aggregation) a
      trajectory pushes as much in total whatever its length;
    * "final": only each trajectory's last step is trained, with Â_i (the trajectory-level baseline STEP0 is
      compared with: one sample per trajectory, the final step's context)."""

    loss: Any
    advantages: AdvantageFn = ADVANTAGES["group"]
    steps: str = "trajectory"

    def __post_init__(self):
        if self.steps not in STEP_WEIGHTINGS:
            raise ValueError(f"Objective.steps must be one of {STEP_WEIGHTINGS}, got {self.steps!r}")

    def step_rows(self, refs: Sequence[Any]) -> list[Any]:
        """The step rows (`guijax.data.pipeline.StepRef`, one per step of each trained trajectory, carrying
        the trajectory's advantage) this objective trains on, with their advantages."""
        refs = list(refs)
        if self.steps == "trajectory":
            return refs
        if self.steps == "step0":
            counts = collections.Counter(r.trajectory for r in refs)
            split = adv_lib.step0_step_advantages(np.asarray([r.advantage for r in refs], np.float32),
                                                  np.asarray([counts[r.trajectory] for r in refs]))
            return [dataclasses.replace(r, advantage=float(a)) for r, a in zip(refs, np.asarray(split))]
        last: dict[int, int] = {}
        for r in refs:
            last[r.trajectory] = max(last.get(r.trajectory, -1), r.step)
        return [r for r in refs if r.step == last[r.trajectory]]

    @property
    def trajectory_normalized(self) -> bool:
        """Whether each batch's loss is divided by the trajectories its rows stand for (`batch['normalizer']`)."""
        return self.steps == "step0"

    @property
    def reference_kl(self) -> bool:
        """Whether the loss has a KL term to a frozen reference policy (the trainer then scores every batch
        under the initial parameters as well)."""
        inner = self.loss
        while hasattr(inner, "inner"):
            inner = inner.inner
        clip = getattr(inner, "clip", None)
        return bool(clip is not None and clip.kl_coef)


def trajectory_normalizers(rows: Sequence[int], trajectories: int) -> list[float]:
    """Each batch's share of `trajectories` (the on-policy trajectories the iteration's objective averages
    over), in proportion to its step rows with loss (`rows`, per batch): each batch's loss is then an estimate
    of Eq. 5's (1/G)·Σ over every row, and their mean weighted by rows is exactly it; a batch with no such row
    gets 1 (its loss is 0 either way)."""
    total = sum(rows)
    return [trajectories * n / total if n else 1.0 for n in rows]
