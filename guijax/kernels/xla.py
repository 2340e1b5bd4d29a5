"""Plain-JAX paths: the naive reference and the chunked (vocab-tiled) implementation.

`naive_flat` materialises the `[tokens, vocab]` logits and lets autodiff do the rest: it is the
reference every other path is tested against. `chunked_flat` walks the vocabulary in blocks with
`lax.scan` (online log-sum-exp, see `_tile.py`) and has a custom VJP that recomputes each block's
logits in the backward pass, so memory is O(tokens * block_v) instead of O(tokens * vocab).
It is the fast CPU path and the fallback everywhere; it uses ordinary XLA ops, so it partitions
under `jit` with sharded inputs like any other JAX code.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from guijax.kernels import _tile


def naive_flat(h: jax.Array, w: jax.Array, t: jax.Array) -> tuple[jax.Array, jax.Array]:
    """log_softmax + gather over the full logits. h [N, d], w [d, V], t [N] -> ([N], [N]) fp32."""
    logits = _tile.tile_dot(h, w)
    logp_all = jax.nn.log_softmax(logits, axis=-1)
    logp = jnp.take_along_axis(logp_all, t[:, None], axis=-1)[:, 0]
    ent = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
    return logp, ent


def _block_stats(h, w_blk, t_col, v0, st):
    """Fold the block of columns starting at v0 into `st` (every column of w_blk is real vocab)."""
    logits = _tile.tile_dot(h, w_blk)
    cols = lax.broadcasted_iota(jnp.int32, (1, w_blk.shape[1]), 1)
    return _tile.update_stats(st, logits, t_col - v0, cols, None)


def _block_grads(h, w_blk, t_col, v0, lse, ent, g_lp, g_ent):
    """(dh contribution [N, d] fp32, dw block [d, cols] fp32) of one block of columns."""
    logits = _tile.tile_dot(h, w_blk)
    cols = lax.broadcasted_iota(jnp.int32, (1, w_blk.shape[1]), 1)
    dl = _tile.dlogits(logits, t_col - v0, cols, None, lse, ent, g_lp, g_ent)
    dl = dl.astype(w_blk.dtype) if w_blk.dtype != jnp.float32 else dl
    dh = lax.dot_general(dl, w_blk, (((1,), (1,)), ((), ())),
                         preferred_element_type=jnp.float32, precision=lax.Precision.HIGHEST)
    dw = lax.dot_general(h, dl, (((0,), (0,)), ((), ())),
                         preferred_element_type=jnp.float32, precision=lax.Precision.HIGHEST)
    return dh, dw


def _split(vocab: int, block_v: int) -> tuple[int, int]:
    """(number of full blocks, width of the tail block); the tail is sliced statically, not padded."""
    block_v = min(block_v, vocab)
    return vocab // block_v, vocab % block_v


def _forward(h, w, t, block_v):
    n, vocab = h.shape[0], w.shape[1]
    bv = min(block_v, vocab)
    n_full, tail = _split(vocab, block_v)
    t_col = t[:, None].astype(jnp.int32)

    def body(st, j):
        v0 = j * bv
        w_blk = lax.dynamic_slice_in_dim(w, v0, bv, axis=1)
        return _block_stats(h, w_blk, t_col, v0, st), None

    st, _ = lax.scan(body, _tile.init_stats(n), jnp.arange(n_full, dtype=jnp.int32))
    if tail:
        v0 = n_full * bv
        st = _block_stats(h, w[:, v0:], t_col, v0, st)
    logp, ent, lse = _tile.finalize(st)
    return logp[:, 0], ent[:, 0], lse[:, 0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def chunked_flat(h: jax.Array, w: jax.Array, t: jax.Array, block_v: int) -> tuple[jax.Array, jax.Array]:
    """Vocab-chunked log p(target) and entropy. h [N, d], w [d, V], t [N] int32 -> ([N], [N]) fp32."""
    logp, ent, _ = _forward(h, w, t, block_v)
    return logp, ent


def _chunked_fwd(h, w, t, block_v):
    logp, ent, lse = _forward(h, w, t, block_v)
    return (logp, ent), (h, w, t, lse, ent)


def _chunked_bwd(block_v, res, cot):
    h, w, t, lse, ent = res
    g_lp, g_ent = (c.astype(jnp.float32)[:, None] for c in cot)
    n, d = h.shape
    vocab = w.shape[1]
    bv = min(block_v, vocab)
    n_full, tail = _split(vocab, block_v)
    t_col = t[:, None].astype(jnp.int32)
    lse, ent = lse[:, None], ent[:, None]

    def body(carry, j):
        dh, dw = carry
        v0 = j * bv
        w_blk = lax.dynamic_slice_in_dim(w, v0, bv, axis=1)
        dh_j, dw_j = _block_grads(h, w_blk, t_col, v0, lse, ent, g_lp, g_ent)
        # Each block's columns of dw are written exactly once, in place (no stacked scan output
        # that would need a [d, V] transpose copy afterwards).
        dw = lax.dynamic_update_slice_in_dim(dw, dw_j.astype(dw.dtype), v0, axis=1)
        return (dh + dh_j, dw), None

    init = (jnp.zeros((n, d), jnp.float32), jnp.zeros(w.shape, w.dtype))
    (dh, dw), _ = lax.scan(body, init, jnp.arange(n_full, dtype=jnp.int32))
    if tail:
        v0 = n_full * bv
        dh_j, dw_j = _block_grads(h, w[:, v0:], t_col, v0, lse, ent, g_lp, g_ent)
        dh = dh + dh_j
        dw = lax.dynamic_update_slice_in_dim(dw, dw_j.astype(dw.dtype), v0, axis=1)
    return dh.astype(h.dtype), dw, None


chunked_flat.defvjp(_chunked_fwd, _chunked_bwd)
