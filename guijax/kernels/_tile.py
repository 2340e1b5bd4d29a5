"""Per-tile math shared by every tiled backend (chunked XLA, Pallas TPU, Pallas GPU).

One vocabulary tile at a time we see `logits[rows, cols]` (fp32) and fold it into four running
per-row statistics, so the full `[tokens, vocab]` matrix never exists:

    m   running max of the logits seen so far
    s   sum_j exp(l_j - m)
    a   sum_j exp(l_j - m) * (l_j - m)     (shifted by m so the entropy does not cancel badly)
    tl  the target's logit (0 until the tile holding the target is seen)

From them: lse = m + log s, log p(target) = tl - lse, entropy = log s - a / s.

Backward, for cotangents g_lp (of log p(target)) and g_h (of the entropy), per logit:

    dlogit_j = g_lp * (onehot_j - p_j) - g_h * p_j * (log p_j + H)

which the kernels recompute tile by tile from (lse, H) saved by the forward pass.
All state is kept 2-D with a trailing unit axis (`[rows, 1]`) because TPU (Mosaic) and GPU (Triton)
lowerings both handle that layout; pure-JAX callers use the same shapes.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

# A finite "minus infinity" for the running max: exp(M_INIT - m) underflows to exactly 0 and
# (M_INIT - m) * 0 stays 0, where -inf would give NaN in the rescaling of `a`.
M_INIT = -1e30


class OnlineStats(NamedTuple):
    """Running softmax statistics of one block of rows, each `[rows, 1]` float32."""

    m: jax.Array
    s: jax.Array
    a: jax.Array
    tl: jax.Array


def init_stats(rows: int) -> OnlineStats:
    m = jnp.full((rows, 1), M_INIT, jnp.float32)
    z = jnp.zeros((rows, 1), jnp.float32)
    return OnlineStats(m, z, z, z)


def tile_dot(x: jax.Array, w: jax.Array) -> jax.Array:
    """`x [rows, k] @ w [k, cols]` accumulated in fp32 whatever the input dtype."""
    return lax.dot_general(
        x, w, (((1,), (0,)), ((), ())),
        preferred_element_type=jnp.float32,
        precision=lax.Precision.HIGHEST,
    )


def update_stats(
    st: OnlineStats,
    logits: jax.Array,
    target_local: jax.Array,
    col_ids: jax.Array,
    valid: jax.Array | None,
) -> OnlineStats:
    """Fold one tile of fp32 `logits [rows, cols]` into the running statistics.

    target_local: `[rows, 1]` target index minus the tile's first column.
    col_ids: `[1, cols]` (or `[rows, cols]`) int32 column index within the tile.
    valid: same shape as col_ids, False for columns past the vocabulary end (None: all valid).
    """
    if valid is not None:
        logits = jnp.where(valid, logits, M_INIT)
    m_new = jnp.maximum(st.m, jnp.max(logits, axis=1, keepdims=True))
    shifted = logits - m_new
    e = jnp.exp(shifted)
    if valid is not None:
        e = jnp.where(valid, e, 0.0)
    scale = jnp.exp(st.m - m_new)
    s_new = st.s * scale + jnp.sum(e, axis=1, keepdims=True)
    # sum e^(l-m_new)(l-m_new) = scale * (a_old + (m_old - m_new) * s_old) + this tile's part.
    a_new = scale * (st.a + (st.m - m_new) * st.s) + jnp.sum(e * shifted, axis=1, keepdims=True)
    hit = col_ids == target_local
    tl_new = st.tl + jnp.sum(jnp.where(hit, logits, 0.0), axis=1, keepdims=True)
    return OnlineStats(m_new, s_new, a_new, tl_new)


def finalize(st: OnlineStats) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(log p(target), entropy, lse), each `[rows, 1]` float32."""
    log_s = jnp.log(st.s)
    lse = st.m + log_s
    return st.tl - lse, log_s - st.a / st.s, lse


def dlogits(
    logits: jax.Array,
    target_local: jax.Array,
    col_ids: jax.Array,
    valid: jax.Array | None,
    lse: jax.Array,
    ent: jax.Array,
    g_lp: jax.Array,
    g_ent: jax.Array,
) -> jax.Array:
    """Gradient w.r.t. one tile of fp32 logits; zero on columns past the vocabulary end."""
    logp = logits - lse
    p = jnp.exp(logp)
    onehot = (col_ids == target_local).astype(jnp.float32)
    d = g_lp * (onehot - p) - g_ent * (p * (logp + ent))
    if valid is not None:
        d = jnp.where(valid, d, 0.0)
    return d


def combine_stats(parts: OnlineStats) -> OnlineStats:
    """Merge statistics computed over disjoint vocab ranges, stacked on a leading axis.

    Used when a forward pass splits the vocabulary across parallel programs (GPU) or devices.
    """
    m = jnp.max(parts.m, axis=0)
    scale = jnp.exp(parts.m - m)
    s = jnp.sum(parts.s * scale, axis=0)
    a = jnp.sum(scale * (parts.a + (parts.m - m) * parts.s), axis=0)
    return OnlineStats(m, s, a, jnp.sum(parts.tl, axis=0))
