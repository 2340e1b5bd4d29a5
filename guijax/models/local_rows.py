"""Attention run on each device's own rows under `shard_map`, where XLA's partitioner should not decide.

A kernel XLA cannot partition (a Pallas call), or a run-time branch between two backends (`lax.cond` in the
`auto` attention on a GPU), is partitioned badly or not at all by sharding propagation: inside a branch,
cuDNN's custom partitioning saw its rows gathered from every device, so each device computed and kept every
row's attention. Under `shard_map` each device runs the function on its rows alone (split as the logical axis
the caller names maps under the rules in context), and on its share of the heads where `tensor` divides them.
"""
from __future__ import annotations

from typing import Callable

import flax.linen as nn
import jax
from jax.sharding import PartitionSpec as P

from guijax.sharding import DATA_AXES, fit_spec, logical_spec

TENSOR_AXIS = "tensor"


def on_local_rows(fn: Callable[..., jax.Array], q: jax.Array, k: jax.Array, v: jax.Array,
                  ids: tuple[jax.Array, ...], row_axis: str) -> jax.Array:
    """fn(q, k, v, *ids) -> [b, sq, h, d] on each device's rows (q [b, sq, h, d], k / v [b, sk, kvh, d], ids
    [b, s]); called as is without a mesh in context. Rows that do not divide over the data-parallel devices are
    not split: every device then runs all of them (correct, at that many times the memory)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return fn(q, k, v, *ids)
    b, _, h, _ = q.shape
    kvh = k.shape[2]
    rules = nn.get_logical_axis_rules()
    axes = logical_spec((row_axis,), rules)[0] if rules else tuple(a for a in DATA_AXES if a in mesh.axis_names)
    rows = fit_spec((b,), P(axes), mesh)[0]
    split_heads = TENSOR_AXIS in mesh.axis_names and h % mesh.shape[TENSOR_AXIS] == 0 \
        and kvh % mesh.shape[TENSOR_AXIS] == 0
    spec = P(rows, None, TENSOR_AXIS if split_heads else None, None)
    id_spec = P(rows, None)
    return jax.shard_map(fn, mesh=mesh, in_specs=(spec, spec, spec) + (id_spec,) * len(ids), out_specs=spec,
                         check_vma=False)(q, k, v, *ids)  # kernels declare no varying axes
