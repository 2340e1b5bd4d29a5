"""A dense product as one 2-D matmul: shared by the layers and the LoRA adapters."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rows_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """`x [..., in] @ w [in, out]` as one 2-D matmul over the flattened leading axes.

    Why not `einsum("...i,io->...o")`: its weight gradient contracts two axes (batch and sequence), which
    XLA:CPU lowers by transposing the incoming gradient inside an elementwise fusion that reads it strided
    (the SiLU backward's fusion was the update's largest single operation in `benchmarks/profile_step.py`).
    The flattened form is the same arithmetic; the leading axes merge in order, so rows split over devices
    stay where they are."""
    lead = x.shape[:-1]
    return jnp.matmul(x.reshape(-1, x.shape[-1]), w).reshape(*lead, w.shape[-1])
