"""Pallas splash attention (the TPU flash-attention kernel shipped with JAX) behind `attention`'s interface.

The kernel takes one row at a time as [heads, seq, head_dim] with a static mask (causal or full) and
per-token segment ids, and skips the tiles that mask leaves empty, in both directions. Grouped-query
attention is native (query heads a multiple of key/value heads). This module adapts `attention`'s
conventions to it:

* rows are vmapped; q / k / v are moved from [b, s, h, d] to [b, h, s, d] and back;
* the softmax scale is folded into q (the kernel has none);
* sequences are padded to a multiple of the tile with segment id 0 (`PAD_SEGMENT`): real queries never see
  those keys, and padding queries, which see only padding keys (their own position included, so no row of
  the softmax is empty), are set to 0 afterwards as everywhere else;
* a Pallas call is one custom call XLA cannot partition, so under a mesh (`jax.set_mesh`, as the trainer
  traces) it runs inside `shard_map` (`guijax.models.local_rows`): rows split as the logical axis the caller
  names (`row_axis`) maps under the rules in context ("batch": the data-parallel axes; the vision tower's
  windows inside its per-device vmap: nothing, the vmap's `spmd_axis_name` splitting the blocks), as far as
  they divide; heads over `tensor` when both head counts divide it; everything else whole on each device.

Explicit positions (a KV-cache decode) are not expressible as the kernel's static mask; `unsupported` says
so and `attention` keeps the blockwise path for those calls.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernel_lib
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as mask_lib

from guijax.models.local_rows import on_local_rows

LANES = 128  # a TPU vector register's lane count: the kernel's key tile is a multiple of it


def unsupported(platform: str, default_positions: bool) -> str:
    """Why splash attention cannot take this call ('' when it can)."""
    if platform != "tpu":
        return f"splash attention is a TPU kernel and the target is {platform!r}"
    if not default_positions:
        return "explicit positions (e.g. a KV-cache decode) are not expressible as the kernel's static mask"
    return ""


def tile_size(block: int, sq: int, sk: int) -> int:
    """The kernel's query and key tile: `block` rounded up to whole lanes, no longer than the longer
    sequence needs."""
    whole = lambda n: -(-n // LANES) * LANES  # noqa: E731
    return min(whole(max(block, 1)), whole(max(sq, sk)))


def _kernel(heads: int, sq: int, sk: int, causal: bool, tile: int, interpret: bool):
    """The kernel for one shape. Its mask's tile tables are built in NumPy at trace time (the mask library
    caches them per mask); the kernel object is not cached, since it holds arrays of the trace it was made in."""
    one = mask_lib.CausalMask((sq, sk)) if causal else mask_lib.FullMask((sq, sk))
    sizes = kernel_lib.BlockSizes(block_q=tile, block_kv=tile, block_kv_compute=tile, block_q_dkv=tile,
                                  block_kv_dkv=tile, block_kv_dkv_compute=tile, block_q_dq=tile, block_kv_dq=tile)
    return kernel_lib.make_splash_mha(mask_lib.MultiHeadMask([one] * heads), block_sizes=sizes, head_shards=1,
                                      q_seq_shards=1, interpret=interpret)


def _local(q, k, v, q_seg, kv_seg, *, causal: bool, tile: int, interpret: bool) -> jax.Array:
    """One device's rows: q [b, sq, h, d], k / v [b, sk, kvh, d], ids [b, s] -> [b, sq, h, d]."""
    run = _kernel(q.shape[2], q.shape[1], k.shape[1], causal, tile, interpret)
    heads_major = lambda x: jnp.swapaxes(x, 1, 2)  # noqa: E731
    row = lambda q, k, v, qs, ks: run(q, k, v, segment_ids=kernel_lib.SegmentIds(qs, ks))  # noqa: E731
    return heads_major(jax.vmap(row)(heads_major(q), heads_major(k), heads_major(v), q_seg, kv_seg))


def splash_attention(q, k, v, q_seg, kv_seg, *, causal: bool, scale: float, block: int, row_axis: str = "batch",
                     interpret: bool = False) -> jax.Array:
    """`attention` on the splash kernel; ids int32 [b, s] with 0 for padding. Returns [b, sq, h, d]."""
    sq, sk = q.shape[1], k.shape[1]
    tile = tile_size(block, sq, sk)
    pad_q, pad_k = -sq % tile, -sk % tile
    seq_pad = lambda x, n: jnp.pad(x, ((0, 0), (0, n)) + ((0, 0),) * (x.ndim - 2))  # noqa: E731
    qp, q_ids = seq_pad((q * scale).astype(q.dtype), pad_q), seq_pad(q_seg, pad_q)
    kp, vp, kv_ids = seq_pad(k, pad_k), seq_pad(v, pad_k), seq_pad(kv_seg, pad_k)
    local = functools.partial(_local, causal=causal, tile=tile, interpret=interpret)
    return on_local_rows(local, qp, kp, vp, (q_ids, kv_ids), row_axis)[:, :sq]
