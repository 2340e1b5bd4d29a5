"""Group-relative advantages (GRPO; BEPA Eq. 4, ARPO §3.4) and EvoCUA's STEP0 per-step split.

Groups are given as integer ids per trajectory, so groups of different sizes (e.g. after dropping an
episode whose environment failed) need no padding.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class GroupStats(NamedTuple):
    advantages: jax.Array  # [n] per trajectory
    group_mean: jax.Array  # [num_groups]
    group_std: jax.Array  # [num_groups]
    zero_variance_groups: jax.Array  # scalar int: groups whose rewards are all equal (no learning signal)


def group_advantages(rewards: jax.Array, group_ids: jax.Array, num_groups: int, eps: float = 1e-6,
                     valid: jax.Array | None = None) -> GroupStats:
    """Â_i = (r_i − mean_g) / (std_g + eps) within each group g (population std, as GRPO/BEPA).

    With one success among N trajectories (rewards 1, 0, ..., 0): mean 1/N, std √(N−1)/N, so the success
    gets +√(N−1) and each failure −1/√(N−1) (BEPA Appendix B). `valid` masks out dropped trajectories
    (their advantage is 0 and they do not count in the statistics)."""
    rewards = rewards.astype(jnp.float32)
    valid = jnp.ones_like(rewards, dtype=bool) if valid is None else valid.astype(bool)
    weight = valid.astype(jnp.float32)
    count = jax.ops.segment_sum(weight, group_ids, num_groups)
    mean = jax.ops.segment_sum(rewards * weight, group_ids, num_groups) / jnp.maximum(count, 1.0)
    centered = rewards - mean[group_ids]
    var = jax.ops.segment_sum(centered ** 2 * weight, group_ids, num_groups) / jnp.maximum(count, 1.0)
    std = jnp.sqrt(var)
    advantages = jnp.where(valid, centered / (std[group_ids] + eps), 0.0)
    zero_var = jnp.sum((count > 0) & (std < 1e-8))
    return GroupStats(advantages, mean, std, zero_var)


def step0_step_advantages(trajectory_advantages: jax.Array, num_steps: jax.Array) -> jax.Array:
    """EvoCUA STEP0 (Eq. 6): a trajectory's advantage divided evenly over its T_i steps, Â_i / T_i, so long
    trajectories do not receive T times the gradient of short ones."""
    return trajectory_advantages / jnp.maximum(num_steps.astype(jnp.float32), 1.0)
