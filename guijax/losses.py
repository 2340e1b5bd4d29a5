"""Policy-optimisation and preference losses on per-token log-probs [batch, seq] with a response mask.

Pure functions of arrays (no model inside), so they jit, shard on the batch axis, and are tested against
numpy references in tests/guijax/test_losses.py. Every function returns (loss, metrics).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

Metrics = dict[str, jax.Array]


class ClipConfig(NamedTuple):
    eps_low: float = 0.2  # DAPO-style asymmetric clipping (BEPA/ARPO defaults: 0.2 / 0.3)
    eps_high: float = 0.3
    dual_clip: float = 0.0  # > 1 enables dual clip c for negative advantages (0: off)
    kl_coef: float = 0.0  # k3 KL to the reference policy (off in the papers)
    normalization: str = "token"  # "token": 1/Z with Z = Σ|τ| (BEPA Eq. 5); "sequence": mean per sequence


def _masked_sum(x: jax.Array, mask: jax.Array) -> jax.Array:
    return jnp.sum(jnp.where(mask > 0, x, 0.0))


def _normalise(per_token: jax.Array, mask: jax.Array, normalization: str, normalizer: jax.Array | None) -> jax.Array:
    """Token level: Σ over all response tokens / Z (Z may be given, e.g. the global token count when a batch
    is split into accumulation micro-batches). Sequence level: per-sequence mean, then mean over sequences."""
    mask = mask.astype(jnp.float32)
    if normalization == "token":
        z = jnp.maximum(jnp.sum(mask), 1.0) if normalizer is None else normalizer
        return _masked_sum(per_token, mask) / z
    if normalization == "sequence":
        lengths = jnp.sum(mask, axis=-1)
        per_seq = jnp.sum(jnp.where(mask > 0, per_token, 0.0), axis=-1) / jnp.maximum(lengths, 1.0)
        n = jnp.maximum(jnp.sum(lengths > 0), 1.0) if normalizer is None else normalizer
        return jnp.sum(per_seq) / n
    raise ValueError(f"normalization must be 'token' or 'sequence', got {normalization!r}")


def k3_kl(logp: jax.Array, ref_logp: jax.Array) -> jax.Array:
    """Per-token k3 estimator of KL(π_θ || π_ref): exp(ref − logp) − (ref − logp) − 1 (≥ 0, unbiased)."""
    d = ref_logp - logp
    return jnp.exp(d) - d - 1.0


def clipped_policy_loss(logp: jax.Array, old_logp: jax.Array, advantages: jax.Array, mask: jax.Array,
                        cfg: ClipConfig = ClipConfig(), *, ref_logp: jax.Array | None = None,
                        entropy: jax.Array | None = None, normalizer: jax.Array | None = None
                        ) -> tuple[jax.Array, Metrics]:
    """Clipped GRPO/PPO surrogate (BEPA Eq. 5, ARPO §3.4): −min(r·A, clip(r, 1−ε_low, 1+ε_high)·A).

    advantages: [b, s] per token (a trajectory's Â broadcast over its response tokens) or [b].
    Dual clip (c > 1): for A < 0 the loss is additionally capped at −c·A, bounding updates from
    stale tokens whose ratio exploded.
    """
    mask = mask.astype(jnp.float32)
    adv = advantages if advantages.ndim == logp.ndim else advantages[:, None]
    log_ratio = logp - old_logp
    ratio = jnp.exp(log_ratio)
    clipped = jnp.clip(ratio, 1.0 - cfg.eps_low, 1.0 + cfg.eps_high)
    per_token = -jnp.minimum(ratio * adv, clipped * adv)
    if cfg.dual_clip > 1.0:
        per_token = jnp.where(adv < 0, jnp.minimum(per_token, -cfg.dual_clip * adv), per_token)
    if ref_logp is not None and cfg.kl_coef:
        per_token = per_token + cfg.kl_coef * k3_kl(logp, ref_logp)
    loss = _normalise(per_token, mask, cfg.normalization, normalizer)
    count = jnp.maximum(jnp.sum(mask), 1.0)
    metrics = {
        "clip_frac_low": _masked_sum(((ratio < 1.0 - cfg.eps_low) & (adv < 0)).astype(jnp.float32), mask) / count,
        "clip_frac_high": _masked_sum(((ratio > 1.0 + cfg.eps_high) & (adv > 0)).astype(jnp.float32), mask) / count,
        "approx_kl": _masked_sum(0.5 * log_ratio ** 2, mask) / count,  # k2 estimate of KL(old || new)
        "ratio_mean": _masked_sum(ratio, mask) / count,
    }
    if ref_logp is not None:
        metrics["ref_kl"] = _masked_sum(k3_kl(logp, ref_logp), mask) / count
    if entropy is not None:
        metrics["entropy"] = _masked_sum(entropy, mask) / count
    return loss, metrics


def luffy_loss(logp: jax.Array, old_logp: jax.Array, advantages: jax.Array, mask: jax.Array,
               off_policy: jax.Array, cfg: ClipConfig = ClipConfig(), *, gamma: float = 0.1,
               normalizer: jax.Array | None = None) -> tuple[jax.Array, Metrics]:
    """LUFFY mixed-policy GRPO (BEPA Appendix E.3). On-policy rows: the clipped surrogate. Off-policy rows
    (`off_policy` [b] bool): π_φ = 1, so the weight is w = π_θ(token); shaped f(w) = w / (w + γ) and not
    clipped: −f(π_θ)·A. The gradient of f(π_θ) is γ/(π_θ+γ)² · ∇π_θ, which up-weights low-probability
    tokens of the expert trace."""
    mask = mask.astype(jnp.float32)
    adv = advantages if advantages.ndim == logp.ndim else advantages[:, None]
    off = off_policy.astype(bool)[:, None]
    ratio = jnp.exp(logp - old_logp)
    on_token = -jnp.minimum(ratio * adv, jnp.clip(ratio, 1.0 - cfg.eps_low, 1.0 + cfg.eps_high) * adv)
    prob = jnp.exp(logp)
    off_token = -(prob / (prob + gamma)) * adv
    per_token = jnp.where(off, off_token, on_token)
    loss = _normalise(per_token, mask, cfg.normalization, normalizer)
    off_mask = mask * off
    metrics = {"off_policy_tokens": jnp.sum(off_mask),
               "off_policy_prob": _masked_sum(prob, off_mask) / jnp.maximum(jnp.sum(off_mask), 1.0)}
    return loss, metrics


def sft_loss(logp: jax.Array, mask: jax.Array, normalizer: jax.Array | None = None) -> tuple[jax.Array, Metrics]:
    """Token-level cross-entropy −log π(y_t) averaged over response tokens (SFT warm start, RL+SFT's λ term)."""
    mask = mask.astype(jnp.float32)
    loss = _normalise(-logp, mask, "token", normalizer)
    return loss, {"nll": loss}


def sequence_logp(logp: jax.Array, mask: jax.Array) -> jax.Array:
    """Σ_t log π(y_t) over the response tokens of each row: log π(z, a | h, o) of a whole step."""
    return jnp.sum(jnp.where(mask > 0, logp, 0.0), axis=-1)


def dpo_loss(chosen_logp: jax.Array, rejected_logp: jax.Array, ref_chosen_logp: jax.Array,
             ref_rejected_logp: jax.Array, beta: float = 0.1) -> tuple[jax.Array, Metrics]:
    """DPO on summed step log-probs (EvoCUA Eq. 2 at step level; ARPO §4 offline comparison):
    −log σ(β[(log π_w − log π_ref,w) − (log π_l − log π_ref,l)]). Inputs are [pairs]."""
    margin = beta * ((chosen_logp - ref_chosen_logp) - (rejected_logp - ref_rejected_logp))
    loss = -jnp.mean(jax.nn.log_sigmoid(margin))
    return loss, {"dpo_margin": jnp.mean(margin), "dpo_accuracy": jnp.mean((margin > 0).astype(jnp.float32))}


def kto_loss(policy_logp: jax.Array, ref_logp: jax.Array, desirable: jax.Array, *, beta: float = 0.1,
             desirable_weight: float = 1.0, undesirable_weight: float = 1.0,
             z0: jax.Array | None = None) -> tuple[jax.Array, Metrics]:
    """KTO (Ethayarajh et al. 2024), ARPO's offline baseline with rewards thresholded at 0.5.

    r = log π/π_ref per sequence; the reference point z0 is the batch KL estimate max(0, mean r) with no
    gradient (the paper estimates it from mismatched pairs; the batch mean is the common implementation).
    Desirable: λ_D(1 − σ(β(r − z0))); undesirable: λ_U(1 − σ(β(z0 − r)))."""
    r = policy_logp - ref_logp
    if z0 is None:
        z0 = jax.lax.stop_gradient(jnp.maximum(jnp.mean(r), 0.0))
    desirable = desirable.astype(bool)
    value = jnp.where(desirable, desirable_weight * (1.0 - jax.nn.sigmoid(beta * (r - z0))),
                      undesirable_weight * (1.0 - jax.nn.sigmoid(beta * (z0 - r))))
    return jnp.mean(value), {"kto_z0": z0, "kto_reward_mean": jnp.mean(r)}


def failure_step_loss(logp: jax.Array, ref_logp: jax.Array, gamma: float = 0.2) -> tuple[jax.Array, Metrics]:
    """SEAgent's adversarial imitation of failure steps (SEAgent §3.2, Eq. 2, in the bounded form
    γ·(−log σ(−(log π(a_F) − log π_ref(a_F))))): pushes the policy's likelihood of a judged-wrong step a_F
    below the reference's. Inputs are summed step log-probs [steps]; γ = 0.2 as in the paper."""
    delta = logp - ref_logp
    loss = gamma * jnp.mean(-jax.nn.log_sigmoid(-delta))
    return loss, {"failure_logratio": jnp.mean(delta)}
