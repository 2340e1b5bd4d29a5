"""cuDNN flash attention over packed rows: segment ids given to cuDNN as runs (offsets and lengths).

cuDNN's fused attention reads padding as per-row lengths, which cannot say "two examples side by side in one
row". Its packed (THD) layout can: each row lists the start and length of up to `max_runs` sequences, and
cuDNN attends inside each one as if it were a row of its own, causal from the sequence's own start. Packed
training rows (`guijax.data.packing`: ids 1, 2, ... end to end, 0 after them) map onto it directly.

Every token is put into some run, padding runs included: cuDNN leaves the outputs and gradients of tokens
outside every run unwritten, and an unwritten gradient slot would reach the projections' weight gradients.
A padding run attends only itself; its outputs are then set to 0 and get a zero cotangent, so its gradients
are exactly 0, as on the other paths. The layout holds (`fits`) when queries and keys carry the same ids,
each non-padding id lies in one run, and a row has at most `max_runs` runs; rows that break it are for the
caller to route elsewhere (`guijax.models.attention` checks and falls back to the blockwise path).

The packed layout is JAX's own cuDNN binding (`jax._src.cudnn.fused_attention_stablehlo`), which
`jax.nn.dot_product_attention` uses without exposing its offsets; JAX requires a Hopper GPU or newer for it
and checks that while tracing, so a program with this path is traced where such a GPU is the default device.
Before jax 0.11 that binding turned the keys' and values' token offsets into element offsets with the
queries' head count, wrong for grouped heads (every Qwen model here): where the installed JAX does so
(`kv_offsets_follow_kv_heads`), keys and values are repeated to the queries' heads before the call.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

PAD_SEGMENT = 0
# Runs per row cuDNN is given room for. Its saved softmax statistics are [rows * max_runs, heads, tokens] fp32
# per layer (28 heads x 16k tokens: 1.8 MiB per run), so the room is kept small: a packed row of up to 7
# examples and its padding. Rows with more runs take the blockwise path.
DEFAULT_MAX_RUNS = 8


def _fused() -> Callable[..., jax.Array] | None:
    """JAX's cuDNN attention binding with packed-layout arguments, or None where this JAX lacks it."""
    try:
        from jax._src.cudnn import fused_attention_stablehlo as fused
    except ImportError:
        return None
    return fused.dot_product_attention if hasattr(fused, "MaskType") else None


def _mask_type(causal: bool) -> Any:
    from jax._src.cudnn.fused_attention_stablehlo import MaskType

    return MaskType.PADDING_CAUSAL if causal else MaskType.PADDING


@functools.cache
def kv_offsets_follow_kv_heads() -> bool:
    """Whether JAX's binding scales the keys' run offsets by the keys' own head count (jax >= 0.11), read off
    its offset fix-up on a tiny grouped-heads example; False where that cannot be read (then guijax repeats
    the keys' heads, which is right either way)."""
    try:
        from jax._src.cudnn.fused_attention_stablehlo import _fix_seqlen_offsets
        with jax.ensure_compile_time_eval():
            q, k = jnp.zeros((1, 2, 4, 8), jnp.bfloat16), jnp.zeros((1, 2, 1, 8), jnp.bfloat16)
            lengths, starts = jnp.asarray([[1, 1]], jnp.int32), jnp.asarray([[0, 1, -1]], jnp.int32)
            kv_offsets = _fix_seqlen_offsets(lengths, lengths, starts, starts, q, k)[3]
            return int(kv_offsets.reshape(-1)[1]) == 1 * 1 * 8  # token 1 at 1 kv head x 8 dims
    except Exception:  # noqa: BLE001 (a private function: any change to it means "cannot tell")
        return False


def unavailable() -> str:
    """Why the packed kernel cannot be traced here ('' when it can): JAX's binding and a Hopper-or-newer GPU
    as the default device, which JAX's own check reads while tracing."""
    if _fused() is None:
        return "this JAX has no cuDNN packed-layout binding (jax._src.cudnn.fused_attention_stablehlo)"
    if jax.default_backend() != "gpu":
        return f"the default device is {jax.default_backend()!r}: JAX traces cuDNN's packed layout on a GPU only"
    capability = getattr(jax.devices()[0], "compute_capability", "0.0")
    if tuple(int(x) for x in str(capability).split(".")[:2]) < (9, 0):
        return f"cuDNN's packed layout needs a Hopper GPU or newer (compute capability 9.0); this one is {capability}"
    return ""


def segment_runs(seg: jax.Array, max_runs: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Runs of equal ids along each row of seg [b, s] (padding runs too), in cuDNN's packed form.

    Returns (starts [b, max_runs + 1] int32, lengths [b, max_runs] int32, fits bool [b]): each row's run
    starts in order then -1, their lengths then -1; fits is False where the row has more than max_runs runs
    or a non-padding id in two runs (whose tokens must attend each other, which separate runs would forbid).
    """
    b, s = seg.shape
    seg = seg.astype(jnp.int32)
    new_run = jnp.concatenate([jnp.ones((b, 1), bool), seg[:, 1:] != seg[:, :-1]], axis=1)
    run_index = jnp.cumsum(new_run, axis=1) - 1  # [b, s]: which run each token is in
    runs = run_index[:, -1] + 1
    slots = jnp.arange(max_runs)
    positions = jnp.arange(s, dtype=jnp.int32)
    # a token's run index names its slot; tokens of runs past max_runs are dropped (the row does not fit)
    in_slot = run_index[:, :, None] == slots[None, None, :]  # [b, s, max_runs]
    lengths = jnp.sum(in_slot, axis=1).astype(jnp.int32)
    starts = jnp.min(jnp.where(in_slot, positions[None, :, None], s), axis=1).astype(jnp.int32)
    used = slots[None, :] < runs[:, None]
    lengths = jnp.where(used, lengths, -1)
    starts = jnp.concatenate([jnp.where(used, starts, -1), jnp.full((b, 1), -1, jnp.int32)], axis=1)
    run_ids = jnp.max(jnp.where(in_slot, seg[:, :, None], jnp.iinfo(jnp.int32).min), axis=1)  # [b, max_runs]
    real = used & (run_ids != PAD_SEGMENT)
    same_id = (run_ids[:, :, None] == run_ids[:, None, :]) & real[:, :, None] & real[:, None, :]
    repeated = jnp.any(same_id & ~jnp.eye(max_runs, dtype=bool)[None], axis=(1, 2))
    return starts, lengths, (runs <= max_runs) & ~repeated


class Runs(NamedTuple):
    """A call's rows in cuDNN's packed form (segment_runs), and whether each row fits it."""

    starts: jax.Array  # int32 [b, max_runs + 1]
    lengths: jax.Array  # int32 [b, max_runs]
    fits: jax.Array  # bool [b]


def layout(q_seg: jax.Array, kv_seg: jax.Array, max_runs: int = DEFAULT_MAX_RUNS) -> Runs:
    """The runs of the queries' ids; a row fits when its queries and keys carry the same ids and segment_runs
    can give them to cuDNN. Computed once per call, for the check and the kernel alike."""
    starts, lengths, ok = segment_runs(q_seg, max_runs)
    if q_seg.shape != kv_seg.shape:
        return Runs(starts, lengths, jnp.zeros((q_seg.shape[0],), bool))
    return Runs(starts, lengths, ok & jnp.all(q_seg == kv_seg, axis=1))


def fits(q_seg: jax.Array, kv_seg: jax.Array, max_runs: int = DEFAULT_MAX_RUNS) -> jax.Array:
    """bool [b]: the row's queries and keys carry the same ids, laid out as segment_runs can give cuDNN."""
    return layout(q_seg, kv_seg, max_runs).fits


def attention(q: jax.Array, k: jax.Array, v: jax.Array, seg: jax.Array, *, causal: bool, scale: float,
              runs: Runs | None = None, max_runs: int = DEFAULT_MAX_RUNS) -> jax.Array:
    """q [b, s, h, d], k, v [b, s, kvh, d], seg [b, s] (the same ids for queries and keys) -> [b, s, h, d],
    each run of one id attending only itself (causally from its own start when causal); padding queries give
    0. `runs`: `layout(seg, seg)` where the caller has it already. Rows whose `fits` is False come back wrong:
    the caller checks."""
    runs = layout(seg, seg, max_runs) if runs is None else runs
    if runs.lengths.shape[1] < 2:  # JAX's binding reads one run per row as plain per-row lengths
        raise ValueError(f"max_runs must be at least 2, got {runs.lengths.shape[1]}")
    starts, lengths = runs.starts, runs.lengths
    heads, kv_heads = q.shape[2], k.shape[2]
    if kv_heads != heads and not kv_offsets_follow_kv_heads():
        k, v = (jnp.repeat(x, heads // kv_heads, axis=2) for x in (k, v))
    out = _fused()(q, k, v, q_seqlen=lengths, kv_seqlen=lengths, q_offsets=starts, kv_offsets=starts,
                   scale=scale, mask_type=_mask_type(causal), qkv_layout="BTNH")
    return jnp.where((seg != PAD_SEGMENT)[:, :, None, None], out, 0).astype(q.dtype)
