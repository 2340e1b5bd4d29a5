"""AdamW with warmup + cosine/constant schedules, global-norm clipping, gradient accumulation and a choice
of float32 or bfloat16 moment storage (bf16 halves optimiser memory, the largest per-device cost of a 7B
FSDP run after the parameters)."""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax


def make_schedule(learning_rate: float, warmup_steps: int, total_steps: int, schedule: str = "cosine",
                  final_fraction: float = 0.0) -> optax.Schedule:
    if schedule == "constant":
        return optax.join_schedules([optax.linear_schedule(0.0, learning_rate, max(warmup_steps, 1)),
                                     optax.constant_schedule(learning_rate)], [warmup_steps]) if warmup_steps \
            else optax.constant_schedule(learning_rate)
    if schedule == "cosine":
        if total_steps <= warmup_steps:
            raise ValueError(f"cosine schedule needs total_steps ({total_steps}) > warmup_steps ({warmup_steps})")
        return optax.warmup_cosine_decay_schedule(0.0 if warmup_steps else learning_rate, learning_rate,
                                                  warmup_steps, total_steps, learning_rate * final_fraction)
    raise ValueError(f"schedule must be 'cosine' or 'constant', got {schedule!r}")


def _state_dtype(name: str) -> Any:
    if name not in ("float32", "bfloat16"):
        raise ValueError(f"optimizer state_dtype must be 'float32' or 'bfloat16', got {name!r}")
    return jnp.float32 if name == "float32" else jnp.bfloat16


def _adamw(schedule: optax.Schedule, b1: float, b2: float, eps: float, weight_decay: float,
           state_dtype: Any) -> optax.GradientTransformation:
    """optax's adamw stores mu in `mu_dtype` but nu always in the gradient dtype; this keeps both moments in
    `state_dtype` and does the update arithmetic in float32."""

    def init(params):
        zeros = lambda p: jnp.zeros(p.shape, state_dtype)  # noqa: E731
        return {"count": jnp.zeros((), jnp.int32), "mu": jax.tree.map(zeros, params), "nu": jax.tree.map(zeros, params)}

    def update(grads, state, params=None):
        count = state["count"] + 1
        f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
        mu = jax.tree.map(lambda m, g: b1 * f32(m) + (1 - b1) * f32(g), state["mu"], grads)
        nu = jax.tree.map(lambda v, g: b2 * f32(v) + (1 - b2) * jnp.square(f32(g)), state["nu"], grads)
        c1, c2 = 1 - b1 ** count.astype(jnp.float32), 1 - b2 ** count.astype(jnp.float32)
        lr = schedule(state["count"])
        updates = jax.tree.map(lambda m, v, p: (-lr * (m / c1 / (jnp.sqrt(v / c2) + eps) + weight_decay * f32(p))
                                                ).astype(p.dtype), mu, nu, params)
        cast = lambda t: jax.tree.map(lambda x: x.astype(state_dtype), t)  # noqa: E731
        return updates, {"count": count, "mu": cast(mu), "nu": cast(nu)}

    return optax.GradientTransformation(init, update)


def make_optimizer(cfg: Any) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """cfg fields: learning_rate, warmup_steps, total_steps, schedule, weight_decay, b1, b2, eps,
    max_grad_norm (0: off), grad_accum_steps (1: off), state_dtype ('float32' | 'bfloat16')."""
    schedule = make_schedule(cfg.learning_rate, cfg.warmup_steps, cfg.total_steps, cfg.schedule)
    chain = []
    if cfg.max_grad_norm:
        chain.append(optax.clip_by_global_norm(cfg.max_grad_norm))
    chain.append(_adamw(schedule, cfg.b1, cfg.b2, cfg.eps, cfg.weight_decay, _state_dtype(cfg.state_dtype)))
    tx = optax.chain(*chain)
    if cfg.grad_accum_steps > 1:
        tx = optax.MultiSteps(tx, every_k_schedule=cfg.grad_accum_steps)
    return tx, schedule


def cast_params(params: Any, dtype: Any) -> Any:
    """Cast floating-point leaves (parameters in bf16 or fp32 by config)."""
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)

