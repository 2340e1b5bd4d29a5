"""Pallas GPU kernels (Triton backend) for fused token log-probs + entropy.

Triton programs of one grid run in parallel, so a reduction cannot be carried across grid steps
the way the TPU kernels do. Instead:

  forward   grid (token blocks, vocab splits): each program loops over its contiguous range of
            vocab blocks (`fori_loop`), and for each vocab block over hidden chunks of block_k,
            keeping only a [block_t, block_v] fp32 logits tile and the four running statistics of
            `_tile.py`; the per-split statistics ([splits, N] each) are merged in XLA
            (`_tile.combine_stats`). Splitting the vocabulary keeps the GPU busy when there are
            few token blocks.
  backward  grid (token blocks, vocab blocks): each program recomputes its logits tile, forms
            dlogits, and atomically adds dlogits @ w_tile^T into an fp32 dh buffer and
            h^T @ dlogits into an fp32 dw buffer, chunk by chunk over the hidden axis.

Triton wants power-of-two tile sizes and dot tiles of at least 16, and the hidden size must be
a multiple of block_k (3584 = 7 * 512 is). The vocabulary is not padded in HBM: lm_head tiles are
loaded with a column mask (`other=0`), and the fp32 dw accumulator has ceil(V / block_v) * block_v
columns so the atomic adds need no mask; it is sliced back to V at the end.

Selected by `impl="pallas"` on a CUDA backend; `interpret=True` runs the same kernels on CPU
(tests), where jax's interpreter evaluates the masked loads and unmasked atomics.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from guijax.kernels import _tile

DEFAULT_BLOCK_T = 64
DEFAULT_BLOCK_V = 128
DEFAULT_BLOCK_K = 64
_TARGET_PROGRAMS = 264  # 2 x the 132 SMs of an H100


def _pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def check_blocks(block_t: int, block_v: int, block_k: int, d: int) -> None:
    for name, val in (("block_t", block_t), ("block_v", block_v), ("block_k", block_k)):
        if not _pow2(val) or val < 16:
            raise ValueError(f"pallas_gpu: {name} must be a power of two >= 16, got {val}")
    if d % block_k:
        raise ValueError(f"pallas_gpu: hidden size {d} is not a multiple of block_k={block_k}")


def _logits_tile(h_ref, w_ref, rows, v0, valid, *, d, block_t, block_v, block_k):
    """fp32 [block_t, block_v] logits of token rows `rows` and vocab columns v0.. (masked load)."""

    def body(k, acc):
        ks = pl.ds(pl.multiple_of(k * block_k, block_k), block_k)
        hk = h_ref[rows, ks]
        wk = plgpu.load(w_ref.at[ks, pl.ds(v0, block_v)], mask=valid, other=0)
        return acc + _tile.tile_dot(hk, wk)

    return lax.fori_loop(0, d // block_k, body, jnp.zeros((block_t, block_v), jnp.float32))


def _fwd_kernel(h_ref, w_ref, t_ref, m_ref, s_ref, a_ref, tl_ref, *, vocab, d, block_t, block_v,
                block_k, blocks_per_split):
    """Statistics of one token block over one contiguous range of vocab blocks (one split)."""
    rows = pl.ds(pl.multiple_of(pl.program_id(0) * block_t, block_t), block_t)
    split = pl.program_id(1)
    t = t_ref[rows, :]
    cols = lax.broadcasted_iota(jnp.int32, (1, block_v), 1)

    def body(j, st):
        v0 = pl.multiple_of(j * block_v, block_v)
        valid = cols < vocab - v0
        logits = _logits_tile(h_ref, w_ref, rows, v0, valid, d=d, block_t=block_t,
                              block_v=block_v, block_k=block_k)
        return _tile.update_stats(st, logits, t - v0, cols, valid)

    first = split * blocks_per_split
    last = jnp.minimum(first + blocks_per_split, pl.cdiv(vocab, block_v))
    st = lax.fori_loop(first, last, body, _tile.init_stats(block_t))
    for ref, val in zip((m_ref, s_ref, a_ref, tl_ref), st):
        ref[split, rows, :] = val


def _bwd_kernel(h_ref, w_ref, t_ref, lse_ref, ent_ref, glp_ref, gent_ref, dh_in, dw_in,
                dh_ref, dw_ref, *, vocab, d, block_t, block_v, block_k):
    del dh_in, dw_in  # aliased to dh_ref / dw_ref (zero-initialised accumulators)
    rows = pl.ds(pl.multiple_of(pl.program_id(0) * block_t, block_t), block_t)
    v0 = pl.multiple_of(pl.program_id(1) * block_v, block_v)
    cols = lax.broadcasted_iota(jnp.int32, (1, block_v), 1)
    valid = cols < vocab - v0
    logits = _logits_tile(h_ref, w_ref, rows, v0, valid, d=d, block_t=block_t, block_v=block_v,
                          block_k=block_k)
    dl = _tile.dlogits(logits, t_ref[rows, :] - v0, cols, valid, lse_ref[rows, :],
                       ent_ref[rows, :], glp_ref[rows, :], gent_ref[rows, :])
    dl = dl.astype(w_ref.dtype)

    def body(k, carry):
        k0 = pl.multiple_of(k * block_k, block_k)
        ks = pl.ds(k0, block_k)
        hk = h_ref[rows, ks].astype(dl.dtype)
        wk = plgpu.load(w_ref.at[ks, pl.ds(v0, block_v)], mask=valid, other=0)
        dh_part = lax.dot_general(dl, wk, (((1,), (1,)), ((), ())),
                                  preferred_element_type=jnp.float32,
                                  precision=lax.Precision.HIGHEST)
        dw_part = lax.dot_general(hk, dl, (((0,), (0,)), ((), ())),
                                  preferred_element_type=jnp.float32,
                                  precision=lax.Precision.HIGHEST)
        plgpu.atomic_add(dh_ref, (rows, ks), dh_part)
        plgpu.atomic_add(dw_ref, (ks, pl.ds(v0, block_v)), dw_part)
        return carry

    lax.fori_loop(0, d // block_k, body, 0)


def _params(interpret: bool) -> dict:
    return {} if interpret else {"compiler_params": plgpu.CompilerParams(num_warps=4, num_stages=2)}


def _pad_rows(x: jax.Array, multiple: int) -> jax.Array:
    pad = (-x.shape[0]) % multiple
    return x if pad == 0 else jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def token_logprobs_pallas_gpu(h: jax.Array, w: jax.Array, t: jax.Array,
                              block_t: int = DEFAULT_BLOCK_T, block_v: int = DEFAULT_BLOCK_V,
                              block_k: int = DEFAULT_BLOCK_K, interpret: bool = False
                              ) -> tuple[jax.Array, jax.Array]:
    """h [N, d], w [d, V], t [N] int32 -> (log p(t) [N], entropy [N]), fp32, via Triton kernels."""
    (logp, ent), _ = _fwd(h, w, t, block_t, block_v, block_k, interpret)
    return logp, ent


def _num_splits(n_t: int, n_v: int) -> int:
    """Enough vocab splits that (token blocks x splits) fills a large GPU (~2 programs per SM)."""
    return max(1, min(n_v, -(-_TARGET_PROGRAMS // n_t)))


def _fwd(h, w, t, block_t, block_v, block_k, interpret):
    n, d = h.shape
    vocab = w.shape[1]
    check_blocks(block_t, block_v, block_k, d)
    hp = _pad_rows(h, block_t)
    tp = _pad_rows(t.astype(jnp.int32)[:, None], block_t)
    n_t, n_v = hp.shape[0] // block_t, pl.cdiv(vocab, block_v)
    n_split = _num_splits(n_t, n_v)
    per = pl.cdiv(n_v, n_split)
    n_split = pl.cdiv(n_v, per)
    part = jax.ShapeDtypeStruct((n_split, hp.shape[0], 1), jnp.float32)
    kernel = functools.partial(_fwd_kernel, vocab=vocab, d=d, block_t=block_t, block_v=block_v,
                               block_k=block_k, blocks_per_split=per)
    parts = pl.pallas_call(
        kernel, grid=(n_t, n_split), out_shape=[part] * 4,
        interpret=interpret, name="token_logprobs_fwd", **_params(interpret),
    )(hp, w, tp)
    logp, ent, lse = _tile.finalize(_tile.combine_stats(_tile.OnlineStats(*parts)))
    return (logp[:n, 0], ent[:n, 0]), (h, w, t, lse, ent)


def _bwd(block_t, block_v, block_k, interpret, res, cot):
    h, w, t, lse, ent = res
    n, d = h.shape
    vocab = w.shape[1]
    n_v = pl.cdiv(vocab, block_v)
    hp = _pad_rows(h, block_t)
    tp = _pad_rows(t.astype(jnp.int32)[:, None], block_t)
    g_lp, g_ent = (_pad_rows(c.astype(jnp.float32)[:, None], block_t) for c in cot)
    dh0 = jnp.zeros(hp.shape, jnp.float32)
    dw0 = jnp.zeros((d, n_v * block_v), jnp.float32)
    kernel = functools.partial(_bwd_kernel, vocab=vocab, d=d, block_t=block_t, block_v=block_v,
                               block_k=block_k)
    dh, dw = pl.pallas_call(
        kernel, grid=(hp.shape[0] // block_t, n_v),
        out_shape=[jax.ShapeDtypeStruct(dh0.shape, dh0.dtype),
                   jax.ShapeDtypeStruct(dw0.shape, dw0.dtype)],
        input_output_aliases={7: 0, 8: 1},
        interpret=interpret, name="token_logprobs_bwd", **_params(interpret),
    )(hp, w, tp, lse, ent, g_lp, g_ent, dh0, dw0)
    return dh[:n].astype(h.dtype), dw[:, :vocab].astype(w.dtype), None


token_logprobs_pallas_gpu.defvjp(_fwd, _bwd)
