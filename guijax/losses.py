"""Policy-optimisation and preference losses on per-token log-probs [batch, seq] with a response mask.

Pure functions of arrays (no model inside), so they jit, shard on the batch axis (every reduction is a
plain jnp sum/mean that GSPMD turns into a cross-device reduction), and are tested against numpy
references in tests/guijax/test_losses.py (values, and gradients against finite differences).
Every loss returns (loss, metrics). Papers: ../shared/papers/{bepa,arpo,evocua,seagent}.txt.

Masked positions may hold any finite or infinite garbage (padding): they are replaced before any exp, so
neither the loss nor its gradient can turn NaN because of padding.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

Metrics = dict[str, jax.Array]

NORMALIZATIONS = ("token", "sequence")


class ClipConfig(NamedTuple):
    eps_low: float = 0.2  # DAPO-style asymmetric clip (ARPO's setup, EvoCUA Eq. 5's ε_low/ε_high); 0.2/0.3 per issue 4
    eps_high: float = 0.3
    dual_clip: float = 0.0  # c > 1 enables dual clip for negative advantages (Ye et al. 2020); 0: off
    kl_coef: float = 0.0  # β of the k3 KL to the reference policy (off in BEPA and ARPO)
    normalization: str = "token"  # "token": 1/Z, Z = Σ|τ| (BEPA Eq. 5); "sequence": mean per sequence


def check_clip_config(cfg: ClipConfig) -> None:
    """Reject settings that would silently give a wrong objective (checked at trace time)."""
    if not (0.0 <= cfg.eps_low < 1.0) or cfg.eps_high < 0.0:
        raise ValueError(f"ClipConfig needs 0 <= eps_low < 1 and eps_high >= 0, got eps_low={cfg.eps_low}, "
                         f"eps_high={cfg.eps_high}")
    if cfg.dual_clip and cfg.dual_clip <= 1.0:
        raise ValueError(f"ClipConfig.dual_clip must be 0 (off) or > 1, got {cfg.dual_clip}")
    if cfg.kl_coef < 0.0:
        raise ValueError(f"ClipConfig.kl_coef must be >= 0, got {cfg.kl_coef}")
    if cfg.normalization not in NORMALIZATIONS:
        raise ValueError(f"ClipConfig.normalization must be 'token' or 'sequence', got {cfg.normalization!r}")


def _check_like(reference_name: str, reference: jax.Array, **arrays: jax.Array | None) -> None:
    for name, x in arrays.items():
        if x is not None and tuple(x.shape) != tuple(reference.shape):
            raise ValueError(f"{name} has shape {tuple(x.shape)} but {reference_name} has {tuple(reference.shape)}; "
                             f"per-token inputs must all be [batch, seq]")


def token_advantages(advantages: jax.Array, logp: jax.Array) -> jax.Array:
    """[b] per trajectory (broadcast over its tokens, BEPA Eq. 5's Â_τ) or [b, s] per token (STEP0 Eq. 4)."""
    if advantages.ndim == 1 and advantages.shape[0] == logp.shape[0]:
        return advantages[:, None]
    if tuple(advantages.shape) == tuple(logp.shape):
        return advantages
    raise ValueError(f"advantages must be [batch] or [batch, seq] = {tuple(logp.shape)}, got {tuple(advantages.shape)}")


def masked_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
    """Mean of x over positions where mask > 0 (0 when the mask is empty)."""
    m = (mask > 0).astype(jnp.float32)
    return jnp.sum(jnp.where(m > 0, x, 0.0)) / jnp.maximum(jnp.sum(m), 1.0)


def aggregate(per_token: jax.Array, mask: jax.Array, normalization: str = "token",
              normalizer: jax.Array | float | None = None) -> jax.Array:
    """Reduce per-token losses to a scalar.

    "token" (BEPA Eq. 5): Σ over all response tokens of the batch / Z with Z = Σ_τ |τ|.
    "sequence" (SEAgent Eq. 5, EvoCUA Eq. 5 with one step per row): mean over each row's tokens, then mean
    over the non-empty rows. `normalizer` overrides the denominator (the global token count, or the global
    number of sequences) so that micro-batches of one large batch sum to the large-batch loss.
    """
    valid = mask > 0
    if normalization == "token":
        z = jnp.maximum(jnp.sum(valid.astype(jnp.float32)), 1.0) if normalizer is None else normalizer
        return jnp.sum(jnp.where(valid, per_token, 0.0)) / z
    if normalization == "sequence":
        lengths = jnp.sum(valid.astype(jnp.float32), axis=-1)
        per_seq = jnp.sum(jnp.where(valid, per_token, 0.0), axis=-1) / jnp.maximum(lengths, 1.0)
        n = jnp.maximum(jnp.sum((lengths > 0).astype(jnp.float32)), 1.0) if normalizer is None else normalizer
        return jnp.sum(per_seq) / n
    raise ValueError(f"normalization must be 'token' or 'sequence', got {normalization!r}")


def k3_kl(logp: jax.Array, ref_logp: jax.Array) -> jax.Array:
    """Per-token k3 estimator of KL(π_θ‖π_ref) on samples of π_θ: exp(ref − logp) − (ref − logp) − 1 ≥ 0
    (SEAgent Eq. 5's D_KL, EvoCUA Eq. 5's β·D_KL term)."""
    d = ref_logp - logp
    return jnp.exp(d) - d - 1.0


def _ratio(logp: jax.Array, old_logp: jax.Array, valid: jax.Array) -> tuple[jax.Array, jax.Array]:
    """log r and r = π_θ/π_old (BEPA Eq. 5, EvoCUA Eq. 6), with padding forced to log r = 0."""
    log_ratio = jnp.where(valid, logp - jnp.where(valid, old_logp, 0.0), 0.0)
    return log_ratio, jnp.exp(log_ratio)


def _surrogate(ratio: jax.Array, adv: jax.Array, cfg: ClipConfig) -> jax.Array:
    """−L^CLIP per token: −min(r·A, clip(r, 1−ε_low, 1+ε_high)·A), with the dual clip capping the loss of a
    negative-advantage token at −c·A (c·|A|) when its ratio has exploded."""
    clipped = jnp.clip(ratio, 1.0 - cfg.eps_low, 1.0 + cfg.eps_high)
    per_token = -jnp.minimum(ratio * adv, clipped * adv)
    if cfg.dual_clip:
        per_token = jnp.where(adv < 0, jnp.minimum(per_token, -cfg.dual_clip * adv), per_token)
    return per_token


def _policy_metrics(log_ratio: jax.Array, ratio: jax.Array, adv: jax.Array, mask: jax.Array,
                    cfg: ClipConfig) -> Metrics:
    """Fractions of response tokens whose gradient a clip removed, and the drift from the behaviour policy."""
    adv = jnp.broadcast_to(adv, ratio.shape)
    f32 = lambda b: b.astype(jnp.float32)  # noqa: E731
    metrics = {
        "clip_frac_low": masked_mean(f32((ratio < 1.0 - cfg.eps_low) & (adv < 0)), mask),
        "clip_frac_high": masked_mean(f32((ratio > 1.0 + cfg.eps_high) & (adv > 0)), mask),
        # k3 estimate of KL(π_old‖π_θ) on tokens sampled from π_old: (r − 1) − log r ≥ 0
        "approx_kl": masked_mean(ratio - 1.0 - log_ratio, mask),
        "ratio_mean": masked_mean(ratio, mask),
        "ratio_max": jnp.max(jnp.where(mask > 0, ratio, 0.0)),
    }
    if cfg.dual_clip:
        metrics["dual_clip_frac"] = masked_mean(f32((ratio > cfg.dual_clip) & (adv < 0)), mask)
    return metrics


def clipped_policy_loss(logp: jax.Array, old_logp: jax.Array, advantages: jax.Array, mask: jax.Array,
                        cfg: ClipConfig = ClipConfig(), *, ref_logp: jax.Array | None = None,
                        entropy: jax.Array | None = None, normalizer: jax.Array | float | None = None
                        ) -> tuple[jax.Array, Metrics]:
    """Clipped GRPO/PPO surrogate, negated for minimisation: BEPA Eq. 5 (token-level 1/Z), ARPO §3.4 /
    SEAgent Eq. 5 (per-sequence mean), EvoCUA STEP0 Eq. 5-6 (asymmetric ε_low/ε_high, optional β·KL).

    logp, old_logp, mask, ref_logp, entropy: [b, s]; advantages: [b] or [b, s].
    Loss = aggregate(−min(r·A, clip(r)·A) [dual-clipped] + kl_coef·k3(logp, ref_logp)).
    Metrics: clip_frac_low/high (and dual_clip_frac), approx_kl (old vs new), ratio_mean/max, tokens,
    and entropy / ref_kl when those arrays are given.
    """
    check_clip_config(cfg)
    _check_like("logp", logp, old_logp=old_logp, mask=mask, ref_logp=ref_logp, entropy=entropy)
    adv = token_advantages(advantages, logp)
    valid = mask > 0
    logp = jnp.where(valid, logp, 0.0)
    log_ratio, ratio = _ratio(logp, old_logp, valid)
    per_token = _surrogate(ratio, adv, cfg)
    if ref_logp is not None:
        kl = k3_kl(logp, jnp.where(valid, ref_logp, 0.0))
        if cfg.kl_coef:
            per_token = per_token + cfg.kl_coef * kl
    loss = aggregate(per_token, mask, cfg.normalization, normalizer)
    metrics = _policy_metrics(log_ratio, ratio, adv, mask, cfg)
    metrics["tokens"] = jnp.sum(valid.astype(jnp.float32))
    if ref_logp is not None:
        metrics["ref_kl"] = masked_mean(kl, mask)
    if entropy is not None:
        metrics["entropy"] = masked_mean(entropy, mask)
    return loss, metrics


def luffy_loss(logp: jax.Array, old_logp: jax.Array, advantages: jax.Array, mask: jax.Array,
               off_policy: jax.Array, cfg: ClipConfig = ClipConfig(), *, gamma: float = 0.1,
               normalizer: jax.Array | float | None = None, ref_logp: jax.Array | None = None,
               entropy: jax.Array | None = None) -> tuple[jax.Array, Metrics]:
    """LUFFY mixed-policy GRPO with policy shaping (BEPA Appendix E.3; Yan et al. 2025).

    On-policy rows: the clipped surrogate of `clipped_policy_loss`. Off-policy rows (`off_policy` [b] bool):
    the ratio is π_θ/π_φ with π_φ = 1, i.e. w = π_θ(token); it is shaped f(w) = w/(w + γ) and NOT clipped:
    per-token loss −f(π_θ)·A. d f/d log π_θ = γ·π_θ/(π_θ + γ)², which up-weights low-probability tokens of
    the expert trace relative to plain π_θ. old_logp of off-policy rows is ignored (may be garbage).
    """
    check_clip_config(cfg)
    if gamma <= 0.0:
        raise ValueError(f"luffy gamma must be > 0, got {gamma}")
    _check_like("logp", logp, old_logp=old_logp, mask=mask, ref_logp=ref_logp, entropy=entropy)
    if tuple(off_policy.shape) != (logp.shape[0],):
        raise ValueError(f"off_policy must be [batch] = ({logp.shape[0]},), got {tuple(off_policy.shape)}")
    adv = token_advantages(advantages, logp)
    valid = mask > 0
    off = off_policy.astype(bool)[:, None]
    on_valid = valid & ~off
    logp = jnp.where(valid, logp, 0.0)
    log_ratio, ratio = _ratio(logp, old_logp, on_valid)
    on_token = _surrogate(ratio, adv, cfg)
    prob = jnp.exp(logp)
    shaped = prob / (prob + gamma)
    off_token = -shaped * adv
    per_token = jnp.where(off, off_token, on_token)
    if ref_logp is not None and cfg.kl_coef:
        per_token = per_token + cfg.kl_coef * k3_kl(logp, jnp.where(valid, ref_logp, 0.0))
    loss = aggregate(per_token, mask, cfg.normalization, normalizer)
    off_mask = valid & off
    metrics = _policy_metrics(log_ratio, ratio, adv, on_valid, cfg)  # on-policy tokens only
    metrics.update({"tokens": jnp.sum(valid.astype(jnp.float32)),
                    "off_policy_tokens": jnp.sum(off_mask.astype(jnp.float32)),
                    "off_policy_prob": masked_mean(prob, off_mask),
                    "off_policy_shaped_weight": masked_mean(shaped, off_mask)})
    if entropy is not None:
        metrics["entropy"] = masked_mean(entropy, mask)
    return loss, metrics


def sft_loss(logp: jax.Array, mask: jax.Array, normalizer: jax.Array | float | None = None, *,
             normalization: str = "token") -> tuple[jax.Array, Metrics]:
    """Cross-entropy −log π(y_t) over response tokens: the SFT warm start and the λ·CE term of RL+SFT
    (BEPA Appendix E.1-E.2), and EvoCUA's RFT on successful steps."""
    _check_like("logp", logp, mask=mask)
    loss = aggregate(-jnp.where(mask > 0, logp, 0.0), mask, normalization, normalizer)
    return loss, {"nll": loss, "tokens": jnp.sum((mask > 0).astype(jnp.float32))}


def sequence_logp(logp: jax.Array, mask: jax.Array) -> jax.Array:
    """Σ_t log π(y_t) over each row's response tokens: log π(z, a | h, o) of a whole step (EvoCUA Eq. 2)."""
    _check_like("logp", logp, mask=mask)
    return jnp.sum(jnp.where(mask > 0, logp, 0.0), axis=-1)


def dpo_loss(chosen_logp: jax.Array, rejected_logp: jax.Array, ref_chosen_logp: jax.Array,
             ref_rejected_logp: jax.Array, beta: float = 0.1) -> tuple[jax.Array, Metrics]:
    """Step-level DPO (EvoCUA Eq. 2; ARPO's offline DPO baseline):
    −log σ(β[(log π_θ(w) − log π_ref(w)) − (log π_θ(l) − log π_ref(l))]), mean over pairs.
    Inputs are [pairs] summed log-probs of the chosen / rejected (thought, action) of one step."""
    _check_like("chosen_logp", chosen_logp, rejected_logp=rejected_logp, ref_chosen_logp=ref_chosen_logp,
                ref_rejected_logp=ref_rejected_logp)
    chosen_reward = beta * (chosen_logp - ref_chosen_logp)
    rejected_reward = beta * (rejected_logp - ref_rejected_logp)
    margin = chosen_reward - rejected_reward
    loss = -jnp.mean(jax.nn.log_sigmoid(margin))
    return loss, {"dpo_margin": jnp.mean(margin), "dpo_accuracy": jnp.mean((margin > 0).astype(jnp.float32)),
                  "dpo_chosen_reward": jnp.mean(chosen_reward), "dpo_rejected_reward": jnp.mean(rejected_reward)}


def kto_reference_point(kl_policy_logp: jax.Array, kl_ref_logp: jax.Array) -> jax.Array:
    """KTO's reference point z0 (Ethayarajh et al. 2024): max(0, mean_j log π_θ(y'_j|x_j)/π_ref(y'_j|x_j)) over
    MISMATCHED pairs (y'_j is another example's output, e.g. y_{(j+1) mod m} under x_j), with no gradient."""
    _check_like("kl_policy_logp", kl_policy_logp, kl_ref_logp=kl_ref_logp)
    return jax.lax.stop_gradient(jnp.maximum(jnp.mean(kl_policy_logp - kl_ref_logp), 0.0))


def kto_loss(policy_logp: jax.Array, ref_logp: jax.Array, desirable: jax.Array, *, beta: float = 0.1,
             desirable_weight: float = 1.0, undesirable_weight: float = 1.0, z0: jax.Array | None = None,
             kl_policy_logp: jax.Array | None = None, kl_ref_logp: jax.Array | None = None
             ) -> tuple[jax.Array, Metrics]:
    """KTO (Ethayarajh et al. 2024; ARPO's offline baseline with rewards thresholded into desirable or not).

    r = log π_θ(y|x)/π_ref(y|x) per sequence ([m] summed log-probs). Loss = mean(λ_y − v(x, y)) with
    v = λ_D σ(β(r − z0)) for desirable and λ_U σ(β(z0 − r)) for undesirable outputs. z0: given, else from
    mismatched pairs (`kl_policy_logp`, `kl_ref_logp`, see `kto_reference_point`) as in the paper, else
    (fallback, documented approximation) max(0, mean r) over the batch, without gradient."""
    _check_like("policy_logp", policy_logp, ref_logp=ref_logp, desirable=desirable)
    r = policy_logp - ref_logp
    if z0 is None:
        if (kl_policy_logp is None) != (kl_ref_logp is None):
            raise ValueError("kto_loss needs both kl_policy_logp and kl_ref_logp (mismatched pairs) or neither")
        z0 = (kto_reference_point(kl_policy_logp, kl_ref_logp) if kl_policy_logp is not None
              else jax.lax.stop_gradient(jnp.maximum(jnp.mean(r), 0.0)))
    desirable = desirable.astype(bool)
    value = jnp.where(desirable, desirable_weight * (1.0 - jax.nn.sigmoid(beta * (r - z0))),
                      undesirable_weight * (1.0 - jax.nn.sigmoid(beta * (z0 - r))))
    return jnp.mean(value), {"kto_z0": z0, "kto_reward_mean": jnp.mean(r)}


def failure_step_loss(logp: jax.Array, ref_logp: jax.Array, gamma: float = 0.2, valid: jax.Array | None = None
                      ) -> tuple[jax.Array, Metrics]:
    """SEAgent's adversarial imitation of failure steps (SEAgent §3.2 Eq. 2, weighted by γ as in
    L = L_GRPO + γ·L_AI, γ = 0.2). Eq. 2 as printed, −log π_θ(a)/π_ref(a_F), is unbounded below when
    pushing π_θ(a_F) → 0; this is the bounded contrastive form the issue specifies:
    γ·(−log σ(−(log π_θ(a_F) − log π_ref(a_F)))), which decreases π_θ(a_F) below π_ref(a_F) and saturates.
    Inputs are summed step log-probs [steps]; `valid` [steps] masks padded rows."""
    _check_like("logp", logp, ref_logp=ref_logp, valid=valid)
    delta = logp - ref_logp
    per_step = -jax.nn.log_sigmoid(-delta)
    if valid is None:
        return gamma * jnp.mean(per_step), {"failure_logratio": jnp.mean(delta)}
    return gamma * masked_mean(per_step, valid), {"failure_logratio": masked_mean(delta, valid)}
