"""AdamW with warmup + cosine/constant schedules, global-norm clipping, gradient accumulation and a choice
of float32 or bfloat16 moment storage (bf16 halves optimiser memory, the largest per-device cost of a 7B
FSDP run after the parameters). ARPO's setup trains with AdamW and gradient accumulation 4.

Config (ml_collections.ConfigDict or any object with these attributes, e.g. configs/_common.py `optim`):
learning_rate, warmup_steps, total_steps, schedule ('cosine' | 'constant'), weight_decay, b1, b2, eps,
max_grad_norm (0: off), grad_accum_steps (1: off), state_dtype ('float32' | 'bfloat16'),
optional final_fraction (cosine floor as a fraction of learning_rate, default 0).
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

REQUIRED_KEYS = ("learning_rate", "warmup_steps", "total_steps", "schedule", "weight_decay", "b1", "b2", "eps",
                 "max_grad_norm", "grad_accum_steps", "state_dtype")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def resolve_dtype(name: str | Any, what: str = "dtype") -> Any:
    """'float32' | 'bfloat16' (or a jnp dtype) -> jnp dtype, with an error naming the config key."""
    if not isinstance(name, str):
        if jnp.dtype(name) in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
            return jnp.dtype(name).type
        raise ValueError(f"{what} must be 'float32' or 'bfloat16', got {name!r}")
    if name not in DTYPES:
        raise ValueError(f"{what} must be 'float32' or 'bfloat16', got {name!r}")
    return DTYPES[name]


def make_schedule(learning_rate: float, warmup_steps: int, total_steps: int, schedule: str = "cosine",
                  final_fraction: float = 0.0) -> optax.Schedule:
    """Linear warmup 0 → lr over `warmup_steps`, then constant, or cosine decay to final_fraction·lr at
    `total_steps` (counted from step 0, warmup included). Step k is the (k+1)-th optimiser update."""
    if warmup_steps < 0:
        raise ValueError(f"optim.warmup_steps must be >= 0, got {warmup_steps}")
    if schedule == "constant":
        if not warmup_steps:
            return optax.constant_schedule(learning_rate)
        return optax.join_schedules([optax.linear_schedule(0.0, learning_rate, warmup_steps),
                                     optax.constant_schedule(learning_rate)], [warmup_steps])
    if schedule == "cosine":
        if total_steps <= warmup_steps:
            raise ValueError(f"cosine schedule needs optim.total_steps ({total_steps}) > optim.warmup_steps "
                             f"({warmup_steps})")
        return optax.warmup_cosine_decay_schedule(0.0 if warmup_steps else learning_rate, learning_rate,
                                                  warmup_steps, total_steps, learning_rate * final_fraction)
    raise ValueError(f"optim.schedule must be 'cosine' or 'constant', got {schedule!r}")


def adamw(schedule: optax.Schedule, b1: float, b2: float, eps: float, weight_decay: float,
          state_dtype: Any = jnp.float32) -> optax.GradientTransformation:
    """Decoupled-weight-decay Adam (Loshchilov & Hutter), numerically optax.adamw in float32.

    optax.adamw stores mu in `mu_dtype` but nu always in the gradient dtype; this keeps BOTH moments in
    `state_dtype` and does the update arithmetic in float32 (moments are upcast, updated, rounded back).
    The returned update has each parameter's dtype."""

    def init(params):
        zeros = lambda p: jnp.zeros(p.shape, state_dtype)  # noqa: E731
        return {"count": jnp.zeros((), jnp.int32), "mu": jax.tree.map(zeros, params),
                "nu": jax.tree.map(zeros, params)}

    def update(grads, state, params=None):
        if params is None:
            raise ValueError("adamw with weight decay needs params in tx.update(grads, state, params)")
        count = state["count"] + 1
        f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
        mu = jax.tree.map(lambda m, g: b1 * f32(m) + (1 - b1) * f32(g), state["mu"], grads)
        nu = jax.tree.map(lambda v, g: b2 * f32(v) + (1 - b2) * jnp.square(f32(g)), state["nu"], grads)
        c1, c2 = 1 - b1 ** count.astype(jnp.float32), 1 - b2 ** count.astype(jnp.float32)
        lr = schedule(state["count"])
        updates = jax.tree.map(
            lambda m, v, p: (-lr * (m / c1 / (jnp.sqrt(v / c2) + eps) + weight_decay * f32(p))).astype(p.dtype),
            mu, nu, params)
        cast = lambda t: jax.tree.map(lambda x: x.astype(state_dtype), t)  # noqa: E731
        return updates, {"count": count, "mu": cast(mu), "nu": cast(nu)}

    return optax.GradientTransformation(init, update)


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    try:
        return cfg[key] if isinstance(cfg, dict) else getattr(cfg, key)
    except (KeyError, AttributeError):
        if default is None:
            raise ValueError(f"optim config is missing {key!r} (needs {', '.join(REQUIRED_KEYS)})") from None
        return default


def make_optimizer(cfg: Any) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """(tx, schedule): clip_by_global_norm → AdamW(schedule), wrapped in optax.MultiSteps when
    grad_accum_steps > 1 (the mean of k micro-batch gradients makes one update; the schedule then counts
    real updates, not micro-batches)."""
    v = {k: _get(cfg, k) for k in REQUIRED_KEYS}
    if int(v["grad_accum_steps"]) < 1:
        raise ValueError(f"optim.grad_accum_steps must be >= 1, got {v['grad_accum_steps']}")
    if v["max_grad_norm"] < 0:
        raise ValueError(f"optim.max_grad_norm must be >= 0 (0: off), got {v['max_grad_norm']}")
    schedule = make_schedule(v["learning_rate"], int(v["warmup_steps"]), int(v["total_steps"]), v["schedule"],
                             float(_get(cfg, "final_fraction", 0.0)))
    state_dtype = resolve_dtype(v["state_dtype"], "optim.state_dtype")
    chain = []
    if v["max_grad_norm"]:
        chain.append(optax.clip_by_global_norm(v["max_grad_norm"]))
    chain.append(adamw(schedule, v["b1"], v["b2"], v["eps"], v["weight_decay"], state_dtype))
    tx = optax.chain(*chain)
    if int(v["grad_accum_steps"]) > 1:
        tx = optax.MultiSteps(tx, every_k_schedule=int(v["grad_accum_steps"]))
    return tx, schedule


def cast_params(params: Any, dtype: str | Any) -> Any:
    """Cast floating-point leaves to 'float32' | 'bfloat16' (e.g. config model.param_dtype); integer leaves
    are left alone. bf16 parameters halve memory but round each update to 8 mantissa bits."""
    target = resolve_dtype(dtype, "param dtype")
    return jax.tree.map(lambda x: x.astype(target) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)
