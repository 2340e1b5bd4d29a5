"""Jitted training steps over a padded batch: log-probs of the response tokens through the fused kernel
(hidden states + LM head, never [tokens, vocab] logits), a loss from guijax.losses, and an optax update.

Batch convention (what guijax.data produces): `targets[b, t]` is the token predicted at position t
(input_ids shifted left by one) and `loss_mask[b, t]` is 1 where that target is a response token.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from guijax import kernels, losses
from guijax.models.qwen2_5_vl import Qwen2_5_VL

Batch = dict[str, Any]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
    params: Any
    opt_state: Any
    step: jax.Array


def lm_head(params: Any, module: Qwen2_5_VL) -> jax.Array:
    head = params["embed_tokens"].T if module.cfg.tie_word_embeddings else params["lm_head"]
    return head.astype(module.dtype)


def batch_logprobs(module: Qwen2_5_VL, params: Any, batch: Batch, temperature: float = 1.0,
                   impl: str = "auto") -> tuple[jax.Array, jax.Array]:
    """Per-token log π(target) and entropy [b, s] at the sampling temperature (so ratios compare like with
    like: the sampler's behaviour log-probs are of softmax(logits / T))."""
    hidden, _ = module.apply({"params": params}, batch["input_ids"], batch["positions"], batch["attention_mask"],
                             batch.get("vision"), return_logits=False)
    head = lm_head(params, module)
    if temperature != 1.0:
        head = head / temperature
    return kernels.token_logprobs(hidden, head, batch["targets"], batch["loss_mask"], impl=impl)


@dataclasses.dataclass(frozen=True)
class StepConfig:
    kind: str = "grpo"  # grpo | luffy | sft
    clip: losses.ClipConfig = losses.ClipConfig()
    temperature: float = 1.0
    luffy_gamma: float = 0.1
    sft_coef: float = 0.0  # RL+SFT: λ · CE on rows flagged `expert` in the batch
    impl: str = "auto"


def loss_fn(params: Any, batch: Batch, module: Qwen2_5_VL, cfg: StepConfig) -> tuple[jax.Array, dict]:
    logp, entropy = batch_logprobs(module, params, batch, cfg.temperature, cfg.impl)
    mask = batch["loss_mask"]
    normalizer = batch.get("normalizer")
    if cfg.kind == "sft":
        loss, metrics = losses.sft_loss(logp, mask, normalizer)
    elif cfg.kind == "luffy":
        loss, metrics = losses.luffy_loss(logp, batch["old_logp"], batch["advantages"], mask, batch["off_policy"],
                                          cfg.clip, gamma=cfg.luffy_gamma, normalizer=normalizer)
    elif cfg.kind == "grpo":
        loss, metrics = losses.clipped_policy_loss(logp, batch["old_logp"], batch["advantages"], mask, cfg.clip,
                                                   ref_logp=batch.get("ref_logp"), entropy=entropy,
                                                   normalizer=normalizer)
    else:
        raise ValueError(f"unknown step kind {cfg.kind!r}; choose grpo, luffy or sft")
    if cfg.sft_coef and "expert" in batch:
        expert_mask = mask * batch["expert"][:, None]
        ce, _ = losses.sft_loss(logp, expert_mask)
        loss = loss + cfg.sft_coef * ce
        metrics["sft_ce"] = ce
    metrics.setdefault("entropy", jnp.sum(entropy * mask) / jnp.maximum(jnp.sum(mask), 1.0))
    metrics["loss"] = loss
    return loss, metrics


def make_train_step(module: Qwen2_5_VL, tx: optax.GradientTransformation, cfg: StepConfig
                    ) -> Callable[[TrainState, Batch], tuple[TrainState, dict]]:
    """One optimiser step. A non-finite loss or gradient leaves parameters and optimiser state untouched
    and reports `skipped = 1`, so one bad batch cannot poison a run (the trainer stops after N in a row)."""

    def step(state: TrainState, batch: Batch) -> tuple[TrainState, dict]:
        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params, batch, module, cfg)
        grad_norm = optax.global_norm(grads)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        updates, new_opt = tx.update(grads, state.opt_state, state.params)
        new_params = optax.apply_updates(state.params, updates)
        keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)  # noqa: E731
        metrics = dict(metrics, grad_norm=grad_norm, skipped=(~finite).astype(jnp.int32))
        return TrainState(keep(new_params, state.params), keep(new_opt, state.opt_state), state.step + 1), metrics

    return jax.jit(step, donate_argnums=(0,))


def make_logprob_fn(module: Qwen2_5_VL, temperature: float = 1.0, impl: str = "auto"):
    """Jitted log-probs of a batch's targets under given parameters: π_θold before the update epochs,
    a reference policy, or a cache trajectory re-scored under the current policy (BEPA LEVEL-2)."""
    return jax.jit(lambda params, batch: batch_logprobs(module, params, batch, temperature, impl))
