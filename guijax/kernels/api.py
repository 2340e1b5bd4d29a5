"""Public entry point: per-token log p(target) and entropy from hidden states and the LM head.

Why a fused op: the policy-gradient losses need log pi(token) (and the entropy, for metrics and
bonuses) for every response token, but the [tokens, vocab] logits at vocab 151,936 are the largest
activation of the whole step (2048 tokens -> 1.2 GB in fp32, plus as much again for their
gradient). Every backend here tiles the vocabulary and recomputes tiles in the backward pass.

`lm_head` is `[d, vocab]`, the layout of `hidden @ lm_head`. A tied head (Qwen2.5-VL's small
models tie the output projection to the token embedding `[vocab, d]`) is passed as
`embedding.T`; gradients flow back to the embedding through the transpose as usual (XLA may
materialise the transposed copy for the Pallas paths: one extra `[d, vocab]` buffer).

impl:
  "auto"              Pallas on TPU, "chunked" elsewhere. On an H100 the Triton kernels measured 8-13x
                      slower than "chunked" (forward + backward, bf16, d 3584, 1k-16k tokens; README),
                      their fp32 atomic dW accumulator costing [d, vocab] of memory, so GPUs get XLA.
  "pallas"            Pallas TPU (Mosaic) kernels on TPU, Pallas GPU (Triton) kernels on GPU.
  "pallas_interpret"  the TPU kernels run by the Pallas interpreter: any backend, slow; for tests.
  "chunked"           pure JAX, lax.scan over vocab blocks with a recomputing custom VJP.
  "naive"             log_softmax + gather over the full logits (the reference).
"""
from __future__ import annotations

from typing import Literal, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from guijax.kernels import pallas_gpu, pallas_tpu, xla

Impl = Literal["auto", "pallas", "pallas_interpret", "chunked", "naive"]
IMPLS: tuple[str, ...] = ("auto", "pallas", "pallas_interpret", "chunked", "naive")

CHUNKED_BLOCK_V = 2048
INTERPRET_BLOCK_T = 128
INTERPRET_BLOCK_V = 512


def resolve_impl(impl: str, backend: str | None = None) -> str:
    """Concrete implementation name for `impl` on `backend` (default: jax's default backend)."""
    if impl not in IMPLS:
        raise ValueError(f"token_logprobs: impl={impl!r} is not one of {IMPLS}")
    backend = backend or jax.default_backend()
    if impl == "auto":
        return "pallas_tpu" if backend == "tpu" else "chunked"
    if impl == "pallas":
        if backend not in ("tpu", "gpu"):
            raise ValueError(
                f"token_logprobs: impl='pallas' needs a TPU or GPU backend, this one is {backend!r};"
                " use impl='pallas_interpret' (slow, for tests) or 'chunked'")
        return "pallas_" + backend
    return impl


def _check_inputs(hidden, lm_head, targets, mask) -> None:
    if hidden.ndim != 3:
        raise ValueError(f"token_logprobs: hidden must be [batch, seq, d], got shape {hidden.shape}")
    b, s, d = hidden.shape
    if lm_head.ndim != 2 or lm_head.shape[0] != d:
        raise ValueError(
            f"token_logprobs: lm_head must be [d={d}, vocab], got shape {lm_head.shape}"
            " (a tied embedding [vocab, d] must be passed transposed)")
    if targets.shape != (b, s):
        raise ValueError(f"token_logprobs: targets must be [batch={b}, seq={s}], got {targets.shape}")
    if mask.shape != (b, s):
        raise ValueError(f"token_logprobs: mask must be [batch={b}, seq={s}], got {mask.shape}")
    if not jnp.issubdtype(targets.dtype, jnp.integer):
        raise ValueError(f"token_logprobs: targets must be integer token ids, got {targets.dtype}")
    for name, x in (("hidden", hidden), ("lm_head", lm_head)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"token_logprobs: {name} must be floating point, got {x.dtype}")


def _flat_call(name: str, h, w, t, block_t, block_v):
    if name == "naive":
        return xla.naive_flat(h, w, t)
    if name == "chunked":
        return xla.chunked_flat(h, w, t, block_v or CHUNKED_BLOCK_V)
    if name == "pallas_interpret":
        return pallas_tpu.token_logprobs_pallas_tpu(
            h, w, t, block_t or INTERPRET_BLOCK_T, block_v or INTERPRET_BLOCK_V, True)
    if name == "pallas_tpu":
        return pallas_tpu.token_logprobs_pallas_tpu(
            h, w, t, block_t or pallas_tpu.DEFAULT_BLOCK_T, block_v or pallas_tpu.DEFAULT_BLOCK_V,
            False)
    if name == "pallas_gpu":
        return pallas_gpu.token_logprobs_pallas_gpu(
            h, w, t, block_t or pallas_gpu.DEFAULT_BLOCK_T, block_v or pallas_gpu.DEFAULT_BLOCK_V,
            pallas_gpu.DEFAULT_BLOCK_K, False)
    raise AssertionError(name)


def _local(hidden, lm_head, targets, mask, name, block_t, block_v):
    b, s, d = hidden.shape
    mask = mask.astype(bool)
    # Masked positions may hold any id (e.g. -100 or padding); point them at a real column so no
    # backend ever indexes outside the vocabulary, then zero their outputs.
    t = jnp.where(mask, targets, 0).astype(jnp.int32).reshape(b * s)
    logp, ent = _flat_call(name, hidden.reshape(b * s, d), lm_head, t, block_t, block_v)
    zero = jnp.zeros((), jnp.float32)
    logp = jnp.where(mask, logp.reshape(b, s).astype(jnp.float32), zero)
    ent = jnp.where(mask, ent.reshape(b, s).astype(jnp.float32), zero)
    return logp, ent


def token_logprobs(
    hidden: jax.Array,
    lm_head: jax.Array,
    targets: jax.Array,
    mask: jax.Array,
    *,
    impl: Impl = "auto",
    block_v: int | None = None,
    block_t: int | None = None,
    mesh: Mesh | None = None,
    batch_axes: str | Sequence[str] | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Per-token log p(target) and entropy of the next-token distribution, both `[batch, seq]` fp32.

    hidden [batch, seq, d] (final-norm outputs), lm_head [d, vocab], targets int [batch, seq],
    mask [batch, seq] (bool or 0/1). Masked positions return 0 in both outputs and get no gradient;
    unmasked targets must lie in [0, vocab). Differentiable w.r.t. hidden and lm_head through both
    outputs. bf16 inputs are multiplied with fp32 accumulation; gradients come back in the input
    dtypes.

    block_v / block_t: vocab and token tile sizes (None: the backend's default). block_t is
    ignored by "chunked" and "naive", which take all tokens at once.

    mesh / batch_axes: with a mesh, the call runs under `shard_map` with the batch split over
    `batch_axes` (default: every mesh axis) and lm_head replicated. Needed for the Pallas paths,
    whose custom calls XLA cannot partition on its own; the chunked path also partitions under a
    plain `jit` with sharded inputs.
    """
    _check_inputs(hidden, lm_head, targets, mask)
    name = resolve_impl(impl)
    if mesh is None:
        return _local(hidden, lm_head, targets, mask, name, block_t, block_v)

    axes = tuple(mesh.axis_names) if batch_axes is None else (
        (batch_axes,) if isinstance(batch_axes, str) else tuple(batch_axes))
    unknown = [a for a in axes if a not in mesh.axis_names]
    if unknown:
        raise ValueError(f"token_logprobs: batch_axes {unknown} not in mesh axes {mesh.axis_names}")
    n_shards = 1
    for a in axes:
        n_shards *= mesh.shape[a]
    if hidden.shape[0] % n_shards:
        raise ValueError(f"token_logprobs: batch {hidden.shape[0]} is not divisible by the "
                         f"{n_shards} shards of mesh axes {axes}")
    spec = P(axes)

    def body(h, w, t, m):
        return _local(h, w, t, m, name, block_t, block_v)

    return jax.shard_map(body, mesh=mesh, in_specs=(spec, P(), spec, spec),
                         out_specs=(spec, spec), check_vma=False)(hidden, lm_head, targets, mask)


def naive_token_logprobs(hidden: jax.Array, lm_head: jax.Array, targets: jax.Array,
                         mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The plain-JAX reference: full logits, log_softmax, gather; same contract as token_logprobs."""
    return token_logprobs(hidden, lm_head, targets, mask, impl="naive")
