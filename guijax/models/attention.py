"""Attention for the decoder and the vision tower, with memory linear in sequence length.

One function, `attention`, describes every mask the model needs by two per-token integer arrays instead of
a dense [sq, sk] mask, so no backend has to build a quadratic tensor:

* segment ids [b, s] int: a query attends a key only when both carry the same id. Id 0 (`PAD_SEGMENT`) is
  padding: a padding query attends nothing (its output is exactly 0, and so is its gradient) and a padding
  key is attended by nobody. A decoder row is `attention_mask` itself (1 = token, 0 = pad); packed images
  use 1, 2, ... per image.
* positions [b, s] int, used only when `causal`: a query attends keys whose position is <= its own. They
  default to 0..s-1 on both sides (top-left aligned, as `jax.nn.dot_product_attention`); the KV-cache
  decode passes the query's cache slots (cache_index + i) and the key slots 0..L-1.

Backends (`implementation`):

* "reference": the dense path, [b, h, sq, sk] float32 scores and a mask built from the ids. Quadratic; kept
  as the plain-JAX definition every other backend is tested against.
* "xla": blockwise (flash-attention-2 style) in ordinary JAX ops. Queries and keys are cut into blocks
  (lengths padded internally to a multiple of the block); a `lax.scan` over key blocks keeps a running max
  and sum in float32 (online softmax), and tiles whose mask is empty are skipped with `lax.cond`. A
  `custom_vjp` saves only the output and the per-row logsumexp and recomputes each tile's scores in the
  backward pass, so neither direction holds more than one [b, h, block_q, block_k] score tile per step.
  Fewer queries than block_q (a KV-cache decode step) widen the key tile to keep its area, so a decode
  query reads a cache of up to block_q x block_k keys as one tile: a loop step and its skip test cost more
  than a thin tile's arithmetic. Lengths that fit one tile run the same arithmetic without the scans and
  the skip test. Tiles are laid out as plain batched matmuls (see `_blockwise`), except a decode step's few
  queries against one tile, computed densely where the cache lies. Runs on every platform and partitions
  under `jit` like any other JAX code.
* "cudnn": `jax.nn.dot_product_attention(implementation="cudnn")` (cuDNN flash attention) with the padding
  given as `query_seq_lengths` / `key_value_seq_lengths`, never as a mask. It applies only when
    - the default backend is a GPU and q/k/v are float16 or bfloat16 with head_dim a multiple of 8, <= 128;
    - positions are the defaults, and causal calls are square (sq == sk), where cuDNN's causal mask is the
      same top-left one;
    - every row is right-padded: one non-zero segment id on a prefix of at least one token, the same id for
      the row's queries and keys, zeros after it.
  The first two are static and raise ValueError when unmet. The last depends on values; rows that break it
  come back as NaN rather than silently wrong.
* "cudnn_packed": cuDNN flash attention in its packed layout (`guijax.models.cudnn_packed`): each run of one
  segment id is a sequence of its own, so packed rows (several examples end to end) stay on cuDNN. It applies
  on a Hopper-or-newer GPU under the same static conditions as "cudnn", for self-attention (sq == sk, the
  same ids for queries and keys); rows whose ids are not runs that fit (a non-padding id in two runs, more
  than `cudnn_packed.DEFAULT_MAX_RUNS` runs) come back as NaN, as "cudnn" does with rows it cannot describe.
* "splash": Pallas splash attention on a TPU (`guijax.models.splash_attention`): the kernel skips the tiles
  its causal or full mask leaves empty and takes the segment ids as they are, so packed rows and per-image
  vision segments need no rewriting. It applies when the target is a TPU and positions are the defaults.
* "auto": on a TPU, splash when it applies (a sequence of at least one 128-token tile) and "xla" otherwise;
  on a GPU when the cuDNN static conditions hold, a run-time branch checks the row layout and takes cuDNN
  with lengths for right-padded rows, cuDNN's packed layout for packed rows (where "cudnn_packed" applies)
  and "xla" otherwise, each device for its own rows (`guijax.models.local_rows`). Inside
  a vmap that check would be batched, so both branches would run and their results be selected: callers
  whose rows are right-padded by construction (the vision tower, vmapped over per-device blocks) say so with
  `right_padded=True`, and `auto` takes cuDNN there with no check. Everywhere else "xla".

The target platform is the default backend, or the one `compiling_for` names while tracing: the dry run
compiles a TPU recipe on a machine without TPUs, and tests run the splash kernel in the Pallas interpreter
on CPU.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import Iterator

import jax
import jax.numpy as jnp
from jax import lax

from guijax.models import cudnn_packed, splash_attention
from guijax.models.local_rows import on_local_rows

PAD_SEGMENT = 0
IMPLEMENTATIONS = ("auto", "reference", "xla", "cudnn", "cudnn_packed", "splash")
# the kernels a caller can name, and the one platform each can be traced for ("xla" runs everywhere)
KERNEL_PLATFORMS = {"cudnn": "gpu", "cudnn_packed": "gpu", "splash": "tpu"}
# Finite stand-in for -inf: exp(M_INIT - m) underflows to exactly 0 and M_INIT - M_INIT stays 0, where -inf
# would turn the running-max rescaling of an all-masked row into NaN.
M_INIT = -1e30
_CUDNN_DTYPES = (jnp.float16, jnp.bfloat16)
# (platform, interpret) set by `compiling_for`; None: the default backend, kernels compiled for it
_TARGET: contextvars.ContextVar[tuple[str, bool] | None] = contextvars.ContextVar("attention_target", default=None)


@contextlib.contextmanager
def compiling_for(platform: str, *, interpret: bool = False) -> Iterator[None]:
    """Trace attention for `platform` ("tpu", "gpu", "cpu") instead of the default backend. interpret=True
    runs Pallas kernels in the interpreter, so a TPU kernel's path can be executed on a CPU. It acts at trace
    time: a function jitted and traced outside the context keeps what it traced."""
    token = _TARGET.set((platform, interpret))
    try:
        yield
    finally:
        _TARGET.reset(token)


def target_platform() -> tuple[str, bool]:
    """(platform attention is traced for, whether Pallas kernels run interpreted)."""
    return _TARGET.get() or (jax.default_backend(), False)


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = False,
    q_segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    q_positions: jax.Array | None = None,
    kv_positions: jax.Array | None = None,
    implementation: str = "auto",
    scale: float | None = None,
    block_q: int = 512,
    block_k: int = 512,
    row_axis: str = "batch",
    right_padded: bool = False,
) -> jax.Array:
    """Grouped-query attention. q [b, sq, h, d]; k, v [b, sk, kvh, d] with h a multiple of kvh.

    Segment ids and positions are [b, sq] for queries and [b, sk] for keys (see the module docstring);
    missing segment ids mean "no padding", missing positions 0..s-1. Returns [b, sq, h, d] in q's dtype.
    block_q / block_k are the "xla" tile sizes (clipped to the sequence lengths); "splash" takes the larger,
    rounded up to whole 128-lane tiles. row_axis is the rows' logical axis name, which says how a call run
    under shard_map (splash; `auto` on a GPU) splits them. right_padded=True is the caller's promise that
    every row is right-padded by construction (as the vision tower's window and image rows are): `auto` on a
    GPU then takes cuDNN with no run-time check, which under a vmap would be batched and run both branches,
    and a named "cudnn_packed" takes plain cuDNN too (lengths describe such rows, and JAX's packed binding
    cannot be batched by a vmap); a row that breaks the promise comes back as NaN, as with "cudnn" named.
    """
    b, sq, h, d = q.shape
    sk, kvh = k.shape[1], k.shape[2]
    if k.shape != (b, sk, kvh, d) or v.shape != k.shape:
        raise ValueError(f"k and v must be [b, sk, kv_heads, {d}] matching q {q.shape}; got {k.shape}, {v.shape}")
    if h % kvh:
        raise ValueError(f"query heads ({h}) must be a multiple of key/value heads ({kvh})")
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"unknown attention implementation {implementation!r}; choose one of {IMPLEMENTATIONS}")
    default_positions = q_positions is None and kv_positions is None
    q_seg = _ids(q_segment_ids, b, sq, 1)
    kv_seg = _ids(kv_segment_ids, b, sk, 1)
    q_pos = _ids(q_positions, b, sq, None)
    kv_pos = _ids(kv_positions, b, sk, None)
    scale = d ** -0.5 if scale is None else float(scale)
    if implementation == "reference":
        return _reference(q, k, v, q_seg, kv_seg, q_pos, kv_pos, causal, scale)

    def blockwise() -> jax.Array:
        return _blockwise(q, k, v, q_seg, kv_seg, q_pos, kv_pos, causal, scale, block_q, block_k)

    platform, interpret = target_platform()
    splash_reason = splash_attention.unsupported(platform, default_positions)
    if implementation == "splash" or (implementation == "auto" and not splash_reason
                                      and max(sq, sk) >= splash_attention.LANES):
        if splash_reason:
            raise ValueError(f"splash attention does not apply: {splash_reason}")
        out = splash_attention.splash_attention(q, k, v, q_seg, kv_seg, causal=causal, scale=scale,
                                                block=max(block_q, block_k), row_axis=row_axis,
                                                interpret=interpret)
        return _zero_padding_queries(out, q_seg, q.dtype)
    reason = _cudnn_unsupported(q, k, causal, default_positions, platform)
    if implementation == "cudnn" or (implementation in ("auto", "cudnn_packed") and right_padded and not reason):
        if reason:
            raise ValueError(f"cudnn attention does not apply: {reason}")
        return jnp.where(_right_padded(q_seg, kv_seg), _cudnn(q, k, v, q_seg, kv_seg, causal, scale), jnp.nan)
    packed_reason = reason or _packed_unsupported(sq, sk)
    if implementation == "cudnn_packed":
        if packed_reason:
            raise ValueError(f"cudnn_packed attention does not apply: {packed_reason}")
        runs = cudnn_packed.layout(q_seg, kv_seg)
        out = cudnn_packed.attention(q, k, v, q_seg, causal=causal, scale=scale, runs=runs)
        return jnp.where(runs.fits[:, None, None, None], out, jnp.nan)
    if implementation == "auto" and not reason:
        # each device checks and runs its own rows: under the partitioner, cuDNN's custom partitioning inside
        # the branch gathered every device's rows to each one (no reason given means default positions)
        def local(q, k, v, q_seg, kv_seg):
            q_pos, kv_pos = _ids(None, *q_seg.shape, None), _ids(None, *kv_seg.shape, None)
            branches = [
                lambda: _blockwise(q, k, v, q_seg, kv_seg, q_pos, kv_pos, causal, scale, block_q, block_k),
                lambda: _cudnn(q, k, v, q_seg, kv_seg, causal, scale),
            ]
            branch = jnp.where(jnp.all(_right_padded(q_seg, kv_seg)), 1, 0)
            if not packed_reason:
                runs = cudnn_packed.layout(q_seg, kv_seg)
                branches.append(lambda: cudnn_packed.attention(q, k, v, q_seg, causal=causal, scale=scale, runs=runs))
                branch = jnp.where((branch == 0) & jnp.all(runs.fits), 2, branch)
            return lax.switch(branch, branches)

        return on_local_rows(local, q, k, v, (q_seg, kv_seg), row_axis)
    return blockwise()


def _zero_padding_queries(out: jax.Array, q_seg: jax.Array, dtype) -> jax.Array:
    """A kernel's output with padding queries set to exactly 0, as the blockwise path gives them."""
    return jnp.where((q_seg != PAD_SEGMENT)[:, :, None, None], out, 0).astype(dtype)


def _ids(x: jax.Array | None, b: int, s: int, fill: int | None) -> jax.Array:
    """int32 [b, s]: the given ids, `fill` everywhere, or (fill None) the positions 0..s-1."""
    if x is None:
        row = jnp.arange(s, dtype=jnp.int32) if fill is None else jnp.full((s,), fill, jnp.int32)
        return jnp.broadcast_to(row, (b, s))
    x = jnp.asarray(x)
    if x.shape != (b, s):
        raise ValueError(f"segment ids / positions must be [{b}, {s}], got {x.shape}")
    return x.astype(jnp.int32)


def _tile_mask(q_seg, kv_seg, q_pos, kv_pos, causal: bool) -> jax.Array:
    """bool [b, sq, sk]: same non-padding segment and, if causal, key position <= query position."""
    mask = (q_seg[:, :, None] == kv_seg[:, None, :]) & (q_seg[:, :, None] != PAD_SEGMENT)
    if causal:
        mask &= kv_pos[:, None, :] <= q_pos[:, :, None]
    return mask


def _group(q: jax.Array, kvh: int) -> jax.Array:
    """[b, s, h, d] -> [b, s, kvh, groups, d]: query heads sharing a key/value head side by side."""
    b, s, h, d = q.shape
    return q.reshape(b, s, kvh, h // kvh, d)


# ------------------------------------------------------------------------------------------------ reference
def _reference(q, k, v, q_seg, kv_seg, q_pos, kv_pos, causal: bool, scale: float) -> jax.Array:
    """Dense masked softmax; queries with no visible key give 0."""
    b, sq, h, d = q.shape
    mask = _tile_mask(q_seg, kv_seg, q_pos, kv_pos, causal)
    scores = jnp.einsum("bqkgd,bskd->bkgqs", _group(q, k.shape[2]), k, preferred_element_type=jnp.float32) * scale
    scores = jnp.where(mask[:, None, None], scores, M_INIT)
    probs = jax.nn.softmax(scores, axis=-1) * jnp.any(mask, -1)[:, None, None, :, None]
    out = jnp.einsum("bkgqs,bskd->bqkgd", probs.astype(v.dtype), v)
    return out.reshape(b, sq, h, d).astype(q.dtype)


# ------------------------------------------------------------------------------------------------ blockwise
# Tiles are laid out for the matmuls: a key/value head's grouped query heads become rows of that head, queries
# [b, kvh, bq * g, d] (query-major, each query's g heads side by side) against keys [b, kvh, bk, d], so every
# product is a plain batched matmul over (row, kv head) with contiguous operands. Contracting the interleaved
# [b, q, kvh, g, d] layout directly made XLA:CPU copy or recompute operands for each product (the score
# gradient twice, once per layout; see the README's profile of the CPU update).
#
# Fewer queries than ROW_LAYOUT_MIN_QUERIES against a single tile of keys (a KV-cache decode step, whose keys
# are the cache) take `_few_queries` instead: one tile computed densely, linear in the keys at that size, which
# reads the cache where it is; laying it out anew would copy the whole cache per step.
ROW_LAYOUT_MIN_QUERIES = 16


def _blockwise(q, k, v, q_seg, kv_seg, q_pos, kv_pos, causal: bool, scale: float, block_q: int,
               block_k: int) -> jax.Array:
    """Pad both lengths to whole blocks, lay the blocks out on a leading axis, run the flash kernel."""
    b, sq, h, d = q.shape
    sk, kvh = k.shape[1], k.shape[2]
    g = h // kvh
    bq, bk = max(1, min(block_q, sq)), max(1, min(block_k, sk))
    if bq < block_q:  # few queries (a decode step): wider key tiles, at most the same score-tile area, as
        widest = max(1, block_q * block_k // bq)  # few as that allows, balanced so little is padded
        bk = -(-sk // -(-sk // widest))
    nq, nk = -(-sq // bq), -(-sk // bk)
    if nq == 1 and nk == 1 and bq < ROW_LAYOUT_MIN_QUERIES:
        return _few_queries(q, k, v, q_seg, kv_seg, q_pos, kv_pos, causal, scale)

    def blocks(x: jax.Array, n: int, size: int, axis: int, fill: int = 0) -> jax.Array:
        """x with axis `axis` padded to n * size and cut into n blocks, the block index leading."""
        pad = [(0, 0)] * x.ndim
        pad[axis] = (0, n * size - x.shape[axis])
        x = jnp.pad(x, pad, constant_values=fill)
        return jnp.moveaxis(x.reshape(*x.shape[:axis], n, size, *x.shape[axis + 1:]), axis, 0)

    # Tie the ids to the queries: under a scan over layers the ids are loop-invariant, and JAX's scan partial
    # evaluation hoists everything computed from them alone out of the loop, so every tile's mask (and the
    # masked fill of its scores) would be materialised at once, [nq, nk, b, h, bq, bk]: 10.7 GiB at 14k
    # tokens instead of one tile. After the barrier they count as depending on the layer's input.
    q, q_seg, kv_seg, q_pos, kv_pos = lax.optimization_barrier((q, q_seg, kv_seg, q_pos, kv_pos))
    qb = blocks(jnp.swapaxes(_group(q, kvh), 1, 2), nq, bq, axis=2)  # [nq, b, kvh, bq, g, d]
    qb = qb.reshape(nq, b, kvh, bq * g, d)
    kb, vb = (blocks(jnp.swapaxes(x, 1, 2), nk, bk, axis=2) for x in (k, v))  # [nk, b, kvh, bk, d]
    out = _flash(causal, scale, g, qb, kb, vb, blocks(q_seg, nq, bq, 1, PAD_SEGMENT), blocks(q_pos, nq, bq, 1),
                 blocks(kv_seg, nk, bk, 1, PAD_SEGMENT), blocks(kv_pos, nk, bk, 1))
    out = jnp.moveaxis(out.reshape(nq, b, kvh, bq, g, d), 0, 2).reshape(b, kvh, nq * bq, g, d)
    return jnp.swapaxes(out, 1, 2).reshape(b, nq * bq, h, d)[:, :sq]


def _few_queries(q, k, v, q_seg, kv_seg, q_pos, kv_pos, causal: bool, scale: float) -> jax.Array:
    """A few queries against one tile of keys, in the callers' layout. Differentiated, it saves its inputs alone
    and recomputes the tile (`jax.checkpoint`), as the flash path keeps no score tile between the passes."""
    return jax.checkpoint(functools.partial(_few_queries_dense, causal=causal, scale=scale))(
        q, k, v, q_seg, kv_seg, q_pos, kv_pos)


def _few_queries_dense(q, k, v, q_seg, kv_seg, q_pos, kv_pos, *, causal: bool, scale: float) -> jax.Array:
    b, sq, h, d = q.shape
    mask = _tile_mask(q_seg, kv_seg, q_pos, kv_pos, causal)[:, None, None]
    s = jnp.einsum("bqkgd,bskd->bkgqs", _group(q, k.shape[2]), k, preferred_element_type=jnp.float32) * scale
    s = jnp.where(mask, s, M_INIT)
    m = s.max(-1)
    p = jnp.where(mask, jnp.exp(s - m[..., None]), 0.0)
    acc = jnp.einsum("bkgqs,bskd->bkgqd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    out = _normalise(m, p.sum(-1), acc)[0]
    return jnp.moveaxis(out, 3, 1).reshape(b, sq, h, d).astype(q.dtype)


def _row_mask(qs, ks, qp, kp, causal: bool, g: int) -> jax.Array:
    """bool [b, 1, bq * g, bk]: the tile's mask for each query row of a key/value head."""
    return jnp.repeat(_tile_mask(qs, ks, qp, kp, causal), g, axis=1)[:, None]


def _scores(q_blk, k_blk, scale: float) -> jax.Array:
    """q [b, kvh, r, d], k [b, kvh, bk, d] -> float32 [b, kvh, r, bk]."""
    return jnp.einsum("bkrd,bksd->bkrs", q_blk, k_blk, preferred_element_type=jnp.float32) * scale


def _normalise(m: jax.Array, l: jax.Array, acc: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Running (max, sum, weighted values) -> (output, logsumexp); rows that saw no key give 0 and 0."""
    seen = l > 0
    l_safe = jnp.where(seen, l, 1.0)
    out = jnp.where(seen[..., None], acc / l_safe[..., None], 0.0)
    return out, jnp.where(seen, m + jnp.log(l_safe), 0.0)


def _flash_forward(causal: bool, scale: float, g: int, qb, kb, vb, q_seg, q_pos, kv_seg, kv_pos):
    """Row-laid blocks (qb [nq, b, kvh, r, d], kb / vb [nk, b, kvh, bk, d], ids [n, b, block]) -> (output like
    qb, logsumexp [nq, b, kvh, r] float32).

    A query row with no visible key has l == 0: its output is 0 and its logsumexp is stored as 0 (its
    probabilities are masked to 0 in the backward pass anyway)."""
    _, b, kvh, r, d = qb.shape

    def tile(q_blk, k_blk, v_blk, mask, m, l, acc):
        """Fold one key tile into the running (max, sum, weighted values)."""
        s = jnp.where(mask, _scores(q_blk, k_blk, scale), M_INIT)
        m_new = jnp.maximum(m, s.max(-1))
        p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
        alpha = jnp.exp(m - m_new)
        pv = jnp.einsum("bkrs,bksd->bkrd", p.astype(v_blk.dtype), v_blk, preferred_element_type=jnp.float32)
        return m_new, alpha * l + p.sum(-1), alpha[..., None] * acc + pv

    init = (jnp.full((b, kvh, r), M_INIT, jnp.float32), jnp.zeros((b, kvh, r), jnp.float32),
            jnp.zeros((b, kvh, r, d), jnp.float32))
    if qb.shape[0] == 1 and kb.shape[0] == 1:  # one tile: no loop, no skip test
        mask = _row_mask(q_seg[0], kv_seg[0], q_pos[0], kv_pos[0], causal, g)
        out, lse = _normalise(*tile(qb[0], kb[0], vb[0], mask, *init))
        return out.astype(qb.dtype)[None], lse[None]

    def q_block(_, xs):
        q_blk, qs, qp = xs

        def k_block(carry, ys):
            k_blk, v_blk, ks, kp = ys
            mask = _row_mask(qs, ks, qp, kp, causal, g)
            return lax.cond(jnp.any(mask), lambda c: tile(q_blk, k_blk, v_blk, mask, *c), lambda c: c, carry), None

        (m, l, acc), _ = lax.scan(k_block, init, (kb, vb, kv_seg, kv_pos))
        out, lse = _normalise(m, l, acc)
        return None, (out.astype(qb.dtype), lse)

    _, (out, lse) = lax.scan(q_block, None, (qb, q_seg, q_pos))
    return out, lse


def _tile_grads(mask, scale: float, q_blk, k_blk, v_blk, do_blk, lse_blk, delta_blk):
    """One tile's float32 shares of dq, dk, dv, its probabilities recomputed from the saved logsumexp."""
    f32 = dict(preferred_element_type=jnp.float32)
    p = jnp.where(mask, jnp.exp(_scores(q_blk, k_blk, scale) - lse_blk[..., None]), 0.0)
    dv = jnp.einsum("bkrs,bkrd->bksd", p.astype(do_blk.dtype), do_blk, **f32)
    dp = jnp.einsum("bkrd,bksd->bkrs", do_blk, v_blk, **f32)
    ds = p * (dp - delta_blk[..., None]) * scale
    dq = jnp.einsum("bkrs,bksd->bkrd", ds.astype(k_blk.dtype), k_blk, **f32)
    dk = jnp.einsum("bkrs,bkrd->bksd", ds.astype(q_blk.dtype), q_blk, **f32)
    return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _flash(causal: bool, scale: float, g: int, qb, kb, vb, q_seg, q_pos, kv_seg, kv_pos):
    return _flash_forward(causal, scale, g, qb, kb, vb, q_seg, q_pos, kv_seg, kv_pos)[0]


def _flash_fwd(causal: bool, scale: float, g: int, qb, kb, vb, q_seg, q_pos, kv_seg, kv_pos):
    out, lse = _flash_forward(causal, scale, g, qb, kb, vb, q_seg, q_pos, kv_seg, kv_pos)
    return out, (qb, kb, vb, q_seg, q_pos, kv_seg, kv_pos, out, lse)


def _flash_bwd(causal: bool, scale: float, g: int, res, d_out):
    """FlashAttention-2 backward: an outer scan over key blocks accumulates that block's dk, dv while an
    inner scan over query blocks recomputes p = exp(s - lse) and adds each query block's dq share."""
    qb, kb, vb, q_seg, q_pos, kv_seg, kv_pos, out, lse = res
    # delta_i = sum_d dO_i * O_i = sum_j p_ij dP_ij, the softmax Jacobian's row term, as [nq, b, kvh, r]
    delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), -1)
    d_out = d_out.astype(qb.dtype)
    if qb.shape[0] == 1 and kb.shape[0] == 1:  # one tile: no loops, no skip test, no zero accumulators
        mask = _row_mask(q_seg[0], kv_seg[0], q_pos[0], kv_pos[0], causal, g)
        dq, dk, dv = _tile_grads(mask, scale, qb[0], kb[0], vb[0], d_out[0], lse[0], delta[0])
        return (dq.astype(qb.dtype)[None], dk.astype(kb.dtype)[None], dv.astype(vb.dtype)[None],
                None, None, None, None)

    def k_block(dq, xs):
        k_blk, v_blk, ks, kp = xs

        def q_block(carry, ys):
            q_blk, do_blk, lse_blk, delta_blk, qs, qp, dq_blk = ys
            mask = _row_mask(qs, ks, qp, kp, causal, g)

            def update(args):
                dk, dv, dq_blk = args
                tile_dq, tile_dk, tile_dv = _tile_grads(mask, scale, q_blk, k_blk, v_blk, do_blk, lse_blk, delta_blk)
                return dk + tile_dk, dv + tile_dv, dq_blk + tile_dq

            dk, dv, dq_blk = lax.cond(jnp.any(mask), update, lambda a: a, (*carry, dq_blk))
            return (dk, dv), dq_blk

        zeros = jnp.zeros(k_blk.shape, jnp.float32)
        (dk, dv), dq = lax.scan(q_block, (zeros, zeros), (qb, d_out, lse, delta, q_seg, q_pos, dq))
        return dq, (dk, dv)

    dq, (dk, dv) = lax.scan(k_block, jnp.zeros(qb.shape, jnp.float32), (kb, vb, kv_seg, kv_pos))
    return dq.astype(qb.dtype), dk.astype(kb.dtype), dv.astype(vb.dtype), None, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


# ------------------------------------------------------------------------------------------------ cuDNN
def _cudnn_unsupported(q: jax.Array, k: jax.Array, causal: bool, default_positions: bool, platform: str) -> str:
    """Why cuDNN flash attention cannot take this call ('' when it can, as far as shapes tell)."""
    d = q.shape[-1]
    if platform != "gpu":
        return f"the target is {platform!r}, not a GPU"
    if q.dtype not in _CUDNN_DTYPES or k.dtype != q.dtype:
        return f"cuDNN needs float16/bfloat16 q, k, v; got {q.dtype}, {k.dtype}"
    if d % 8 or d > 128:
        return f"head_dim {d} is not a multiple of 8 up to 128"
    if not default_positions:
        return "explicit positions (e.g. a KV-cache decode) are not expressible as cuDNN sequence lengths"
    if causal and q.shape[1] != k.shape[1]:
        return f"causal attention with sq ({q.shape[1]}) != sk ({k.shape[1]})"
    return ""


def _packed_unsupported(sq: int, sk: int) -> str:
    """Why cuDNN's packed layout cannot take a call that plain cuDNN can ('' when it can)."""
    if sq != sk:
        return f"packed rows are self-attention (sq == sk); got sq {sq}, sk {sk}"
    return cudnn_packed.unavailable()


def _right_padded(q_seg: jax.Array, kv_seg: jax.Array) -> jax.Array:
    """bool [b, 1, 1, 1]: each row is one non-zero id on a non-empty prefix (the same id for queries and
    keys) followed by padding, i.e. exactly what sequence lengths can describe."""

    def prefix(seg: jax.Array) -> jax.Array:
        real = seg != PAD_SEGMENT
        return real[:, 0] & jnp.all(real[:, 1:] <= real[:, :-1], 1) & jnp.all(~real | (seg == seg[:, :1]), 1)

    ok = prefix(q_seg) & prefix(kv_seg) & (q_seg[:, 0] == kv_seg[:, 0])
    return ok[:, None, None, None]


def _cudnn(q, k, v, q_seg, kv_seg, causal: bool, scale: float) -> jax.Array:
    """cuDNN flash attention with the padding as per-row lengths; padding queries give 0 as elsewhere."""
    q_len = jnp.sum(q_seg != PAD_SEGMENT, 1).astype(jnp.int32)
    kv_len = jnp.sum(kv_seg != PAD_SEGMENT, 1).astype(jnp.int32)
    out = jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=causal, query_seq_lengths=q_len,
                                       key_value_seq_lengths=kv_len, implementation="cudnn")
    return _zero_padding_queries(out, q_seg, q.dtype)
