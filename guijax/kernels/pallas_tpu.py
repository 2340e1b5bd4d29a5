"""Pallas TPU (Mosaic) kernels for fused token log-probs + entropy; also run with `interpret=True`.

Grid layout, following the usual TPU reduction pattern (the reduced grid axis is last and
"arbitrary", its accumulator lives in VMEM scratch, the output block stays resident):

  forward   grid (token blocks, vocab blocks): online log-sum-exp over vocab blocks.
  d hidden  grid (token blocks, vocab blocks): dh[i] = sum_j dlogits[i, j] @ w[:, j]^T.
  d lm_head grid (vocab blocks, token blocks): dw[:, j] = sum_i h[i]^T @ dlogits[i, j].

Both backward kernels recompute their logits tile from (hidden, lm_head, lse, entropy), so no
`[tokens, vocab]` array exists at any point. The whole hidden dimension is one block (it is the
matmul's contraction axis), which bounds VMEM use to roughly
`2 * (block_t * d + d * block_v) * itemsize + 4 * max(block_t, block_v) * d` bytes.

The vocabulary is NOT padded: the last vocab block may run past `vocab`; its out-of-range columns
hold unspecified data, so they are masked with an iota comparison (logits excluded from the
log-sum-exp; the lm_head tile zeroed before the backward matmuls; writes past the end of dw are
dropped by Pallas). Tokens are padded to a multiple of block_t (cheap: `[N, d]`, not `[d, V]`).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from guijax.kernels import _tile

DEFAULT_BLOCK_T = 256
DEFAULT_BLOCK_V = 512


def check_blocks(block_t: int, block_v: int) -> None:
    """Mosaic tiles are (8 sublanes, 128 lanes): say so before the compiler does, less clearly."""
    if block_t <= 0 or block_t % 8:
        raise ValueError(f"pallas_tpu: block_t must be a positive multiple of 8, got {block_t}")
    if block_v <= 0 or block_v % 128:
        raise ValueError(f"pallas_tpu: block_v must be a positive multiple of 128, got {block_v}")


def _cols(j, block_v, vocab):
    """Tile-local column ids [1, bv] and the validity mask (global column < vocab)."""
    cols = lax.broadcasted_iota(jnp.int32, (1, block_v), 1)
    return cols, cols < (vocab - j * block_v)


def _fwd_kernel(h_ref, w_ref, t_ref, logp_ref, ent_ref, lse_ref, m_sc, s_sc, a_sc, tl_sc, *,
                vocab, block_t, block_v):
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _init():
        st = _tile.init_stats(block_t)
        m_sc[...], s_sc[...], a_sc[...], tl_sc[...] = st

    cols, valid = _cols(j, block_v, vocab)
    logits = _tile.tile_dot(h_ref[...], w_ref[...])
    st = _tile.OnlineStats(m_sc[...], s_sc[...], a_sc[...], tl_sc[...])
    st = _tile.update_stats(st, logits, t_ref[...] - j * block_v, cols, valid)
    m_sc[...], s_sc[...], a_sc[...], tl_sc[...] = st

    @pl.when(j == pl.num_programs(1) - 1)
    def _done():
        logp, ent, lse = _tile.finalize(st)
        logp_ref[...], ent_ref[...], lse_ref[...] = logp, ent, lse


def _tile_dlogits(h, w_ref, t_ref, lse_ref, ent_ref, glp_ref, gent_ref, j, *, vocab, block_t,
                  block_v):
    """Recompute one logits tile and return (dlogits in the matmul dtype, lm_head tile zeroed past vocab)."""
    cols, valid = _cols(j, block_v, vocab)
    w = jnp.where(valid, w_ref[...], jnp.zeros((), w_ref.dtype))
    logits = _tile.tile_dot(h, w)
    dl = _tile.dlogits(logits, t_ref[...] - j * block_v, cols, valid, lse_ref[...], ent_ref[...],
                       glp_ref[...], gent_ref[...])
    return dl.astype(w.dtype), w


def _dh_kernel(h_ref, w_ref, t_ref, lse_ref, ent_ref, glp_ref, gent_ref, dh_ref, acc_sc, *,
               vocab, block_t, block_v):
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _init():
        acc_sc[...] = jnp.zeros_like(acc_sc)

    dl, w = _tile_dlogits(h_ref[...], w_ref, t_ref, lse_ref, ent_ref, glp_ref, gent_ref, j,
                          vocab=vocab, block_t=block_t, block_v=block_v)
    acc_sc[...] += lax.dot_general(dl, w, (((1,), (1,)), ((), ())),
                                   preferred_element_type=jnp.float32,
                                   precision=lax.Precision.HIGHEST)

    @pl.when(j == pl.num_programs(1) - 1)
    def _done():
        dh_ref[...] = acc_sc[...].astype(dh_ref.dtype)


def _dw_kernel(h_ref, w_ref, t_ref, lse_ref, ent_ref, glp_ref, gent_ref, dw_ref, acc_sc, *,
               vocab, block_t, block_v):
    j, i = pl.program_id(0), pl.program_id(1)

    @pl.when(i == 0)
    def _init():
        acc_sc[...] = jnp.zeros_like(acc_sc)

    h = h_ref[...]
    dl, _ = _tile_dlogits(h, w_ref, t_ref, lse_ref, ent_ref, glp_ref, gent_ref, j,
                          vocab=vocab, block_t=block_t, block_v=block_v)
    acc_sc[...] += lax.dot_general(h.astype(dl.dtype), dl, (((0,), (0,)), ((), ())),
                                   preferred_element_type=jnp.float32,
                                   precision=lax.Precision.HIGHEST)

    @pl.when(i == pl.num_programs(1) - 1)
    def _done():
        dw_ref[...] = acc_sc[...].astype(dw_ref.dtype)


def _vmem_limit(block_t: int, block_v: int, d: int, itemsize: int) -> int:
    """Double-buffered inputs + fp32 accumulators + fp32 logits tiles, with headroom."""
    need = 2 * (block_t + block_v) * d * itemsize + 4 * max(block_t, block_v) * d
    need += 6 * block_t * block_v * 4
    return int(min(max(2 * need, 32 << 20), 100 << 20))


def _params(block_t, block_v, d, itemsize, interpret):
    if interpret:
        return {}
    return {"compiler_params": pltpu.CompilerParams(
        dimension_semantics=("parallel", "arbitrary"),
        vmem_limit_bytes=_vmem_limit(block_t, block_v, d, itemsize))}


def _row_spec(block_t, tok_axis):
    """BlockSpec for a per-token [N, 1] array, the token block index being grid axis `tok_axis`."""
    return pl.BlockSpec((block_t, 1), lambda *g: (g[tok_axis], 0))


def _pad_rows(x: jax.Array, multiple: int) -> jax.Array:
    pad = (-x.shape[0]) % multiple
    return x if pad == 0 else jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))


def _forward(h, w, t, block_t, block_v, interpret):
    n_pad, d = h.shape
    vocab = w.shape[1]
    grid = (n_pad // block_t, pl.cdiv(vocab, block_v))
    row = jax.ShapeDtypeStruct((n_pad, 1), jnp.float32)
    kernel = functools.partial(_fwd_kernel, vocab=vocab, block_t=block_t, block_v=block_v)
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[pl.BlockSpec((block_t, d), lambda i, j: (i, 0)),
                  pl.BlockSpec((d, block_v), lambda i, j: (0, j)),
                  _row_spec(block_t, 0)],
        out_specs=[_row_spec(block_t, 0)] * 3,
        out_shape=[row, row, row],
        scratch_shapes=[pltpu.VMEM((block_t, 1), jnp.float32)] * 4,
        interpret=interpret,
        name="token_logprobs_fwd",
        **_params(block_t, block_v, d, h.dtype.itemsize, interpret),
    )(h, w, t)


def _backward(h, w, t, lse, ent, g_lp, g_ent, block_t, block_v, interpret):
    n_pad, d = h.shape
    vocab = w.shape[1]
    n_t, n_v = n_pad // block_t, pl.cdiv(vocab, block_v)
    kw = dict(vocab=vocab, block_t=block_t, block_v=block_v)
    params = _params(block_t, block_v, d, h.dtype.itemsize, interpret)
    rows = (t, lse, ent, g_lp, g_ent)

    dh = pl.pallas_call(
        functools.partial(_dh_kernel, **kw),
        grid=(n_t, n_v),
        in_specs=[pl.BlockSpec((block_t, d), lambda i, j: (i, 0)),
                  pl.BlockSpec((d, block_v), lambda i, j: (0, j))]
                 + [_row_spec(block_t, 0)] * 5,
        out_specs=pl.BlockSpec((block_t, d), lambda i, j: (i, 0)),
        out_shape=jax.ShapeDtypeStruct(h.shape, h.dtype),
        scratch_shapes=[pltpu.VMEM((block_t, d), jnp.float32)],
        interpret=interpret,
        name="token_logprobs_dhidden",
        **params,
    )(h, w, *rows)

    dw = pl.pallas_call(
        functools.partial(_dw_kernel, **kw),
        grid=(n_v, n_t),
        in_specs=[pl.BlockSpec((block_t, d), lambda j, i: (i, 0)),
                  pl.BlockSpec((d, block_v), lambda j, i: (0, j))]
                 + [_row_spec(block_t, 1)] * 5,
        out_specs=pl.BlockSpec((d, block_v), lambda j, i: (0, j)),
        out_shape=jax.ShapeDtypeStruct(w.shape, w.dtype),
        scratch_shapes=[pltpu.VMEM((d, block_v), jnp.float32)],
        interpret=interpret,
        name="token_logprobs_dlmhead",
        **params,
    )(h, w, *rows)
    return dh, dw


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def token_logprobs_pallas_tpu(h: jax.Array, w: jax.Array, t: jax.Array, block_t: int = DEFAULT_BLOCK_T,
                              block_v: int = DEFAULT_BLOCK_V, interpret: bool = False
                              ) -> tuple[jax.Array, jax.Array]:
    """h [N, d], w [d, V], t [N] int32 -> (log p(t) [N], entropy [N]), fp32, via Mosaic kernels."""
    (logp, ent), _ = _fwd(h, w, t, block_t, block_v, interpret)
    return logp, ent


def _fwd(h, w, t, block_t, block_v, interpret):
    check_blocks(block_t, block_v)
    n = h.shape[0]
    hp = _pad_rows(h, block_t)
    tp = _pad_rows(t.astype(jnp.int32)[:, None], block_t)
    logp, ent, lse = _forward(hp, w, tp, block_t, block_v, interpret)
    return (logp[:n, 0], ent[:n, 0]), (h, w, t, lse, ent)


def _bwd(block_t, block_v, interpret, res, cot):
    h, w, t, lse, ent = res
    n = h.shape[0]
    g_lp, g_ent = (_pad_rows(c.astype(jnp.float32)[:, None], block_t) for c in cot)
    hp = _pad_rows(h, block_t)
    tp = _pad_rows(t.astype(jnp.int32)[:, None], block_t)
    dh, dw = _backward(hp, w, tp, lse, ent, g_lp, g_ent, block_t, block_v, interpret)
    return dh[:n], dw, None


token_logprobs_pallas_tpu.defvjp(_fwd, _bwd)
