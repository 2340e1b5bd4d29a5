"""Group-relative advantages (GRPO; BEPA Eq. 4, ARPO §3.4, SEAgent Eq. 3, EvoCUA Eq. 3) and EvoCUA's
STEP0 per-step split (EvoCUA Eq. 4).

Two layouts: integer group ids per trajectory (`group_advantages`), so groups of different sizes (after
dropping an episode whose environment failed) need no padding; or a dense [groups, G] array
(`group_advantages_dense`) with an optional validity mask. Both use the population std (ddof 0), which is
what gives the BEPA Appendix B values +√(N−1) / −1/√(N−1) for one success among N.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class GroupStats(NamedTuple):
    advantages: jax.Array  # per trajectory, same layout as the rewards
    group_mean: jax.Array  # [num_groups]
    group_std: jax.Array  # [num_groups]
    zero_variance_groups: jax.Array  # scalar int: non-empty groups whose rewards are all equal (no signal)


def _check_concrete_ids(group_ids: jax.Array, num_groups: int, n: int) -> None:
    """segment_sum drops out-of-range ids silently; catch that where the ids are concrete (not traced)."""
    if isinstance(group_ids, jax.core.Tracer):
        return
    ids = np.asarray(group_ids)
    if ids.shape != (n,):
        raise ValueError(f"group_ids must be [{n}] like the rewards, got {ids.shape}")
    if n and (ids.min() < 0 or ids.max() >= num_groups):
        raise ValueError(f"group_ids must lie in [0, {num_groups}); got min {ids.min()}, max {ids.max()}")


def group_advantages(rewards: jax.Array, group_ids: jax.Array, num_groups: int, eps: float = 1e-6,
                     valid: jax.Array | None = None) -> GroupStats:
    """Â_i = (r_i − mean_g) / (std_g + ε) within each group g (BEPA Eq. 4, population std).

    With one success among N (rewards 1, 0, ..., 0): mean 1/N, std √(N−1)/N, so the success gets +√(N−1)
    and each failure −1/√(N−1) (BEPA Appendix B remark). `valid` masks out dropped trajectories: their
    advantage is 0 and they do not count in the statistics. A zero-variance group gives all zeros."""
    rewards = jnp.asarray(rewards, jnp.float32)
    if rewards.ndim != 1:
        raise ValueError(f"rewards must be [n] per trajectory, got shape {rewards.shape}; "
                         f"use group_advantages_dense for [groups, G]")
    _check_concrete_ids(group_ids, num_groups, rewards.shape[0])
    group_ids = jnp.asarray(group_ids, jnp.int32)
    valid = jnp.ones(rewards.shape, bool) if valid is None else jnp.asarray(valid).astype(bool)
    weight = valid.astype(jnp.float32)
    count = jax.ops.segment_sum(weight, group_ids, num_groups)
    mean = jax.ops.segment_sum(rewards * weight, group_ids, num_groups) / jnp.maximum(count, 1.0)
    centered = rewards - mean[group_ids]
    var = jax.ops.segment_sum(centered ** 2 * weight, group_ids, num_groups) / jnp.maximum(count, 1.0)
    std = jnp.sqrt(var)
    advantages = jnp.where(valid, centered / (std[group_ids] + eps), 0.0)
    zero_var = jnp.sum((count > 0) & (std < 1e-8))
    return GroupStats(advantages, mean, std, zero_var)


def group_advantages_dense(rewards: jax.Array, eps: float = 1e-6, valid: jax.Array | None = None) -> GroupStats:
    """BEPA Eq. 4 on a dense [groups, G] reward array (row = one task's rollout group); `valid` [groups, G]
    marks real entries. Same numbers as `group_advantages` with ids = row index."""
    rewards = jnp.asarray(rewards, jnp.float32)
    if rewards.ndim != 2:
        raise ValueError(f"rewards must be [groups, G], got shape {rewards.shape}")
    valid = jnp.ones(rewards.shape, bool) if valid is None else jnp.asarray(valid).astype(bool)
    if valid.shape != rewards.shape:
        raise ValueError(f"valid has shape {valid.shape} but rewards has {rewards.shape}")
    weight = valid.astype(jnp.float32)
    count = jnp.sum(weight, axis=1)
    mean = jnp.sum(rewards * weight, axis=1) / jnp.maximum(count, 1.0)
    centered = rewards - mean[:, None]
    std = jnp.sqrt(jnp.sum(centered ** 2 * weight, axis=1) / jnp.maximum(count, 1.0))
    advantages = jnp.where(valid, centered / (std[:, None] + eps), 0.0)
    zero_var = jnp.sum((count > 0) & (std < 1e-8))
    return GroupStats(advantages, mean, std, zero_var)


def step0_step_advantages(trajectory_advantages: jax.Array, num_steps: jax.Array) -> jax.Array:
    """EvoCUA STEP0 Eq. 4: Â_{i,t} = Â_i / T_i for every step t of trajectory i, so a long trajectory does not
    get T times the push of a short one (success is pushed to be shorter, failure to explore longer)."""
    return jnp.asarray(trajectory_advantages, jnp.float32) / jnp.maximum(jnp.asarray(num_steps, jnp.float32), 1.0)


def step0_row_advantages(trajectory_advantages: jax.Array, row_trajectory: jax.Array,
                         row_valid: jax.Array | None = None) -> jax.Array:
    """STEP0 Eq. 4 for a batch whose rows are single steps: row k belongs to trajectory row_trajectory[k];
    T_i is counted from the (valid) rows, and each row gets Â_i / T_i (0 for invalid rows). The per-step
    token mean 1/K_t and the 1/G of Eq. 5 are `losses.aggregate(..., 'sequence', normalizer=G)`."""
    traj_adv = jnp.asarray(trajectory_advantages, jnp.float32)
    n = traj_adv.shape[0]
    _check_concrete_ids(row_trajectory, n, np.shape(row_trajectory)[0])
    row_trajectory = jnp.asarray(row_trajectory, jnp.int32)
    row_valid = jnp.ones(row_trajectory.shape, bool) if row_valid is None else jnp.asarray(row_valid).astype(bool)
    steps = jax.ops.segment_sum(row_valid.astype(jnp.float32), row_trajectory, n)
    per_traj = step0_step_advantages(traj_adv, steps)
    return jnp.where(row_valid, per_traj[row_trajectory], 0.0)
