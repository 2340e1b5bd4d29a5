"""Device mesh and the one table that maps logical array axes to mesh axes.

Mesh axes: `data` (pure data parallel, replicated params), `fsdp` (data parallel with parameters and
optimiser state sharded, ZeRO-3 style), `tensor` (Megatron-style split of heads / MLP / vocab).
Every parameter names its dimensions with logical axes (see guijax/models/layers.py); `LOGICAL_RULES`
decides where each goes. A dimension that a mesh axis does not divide is left unsharded rather than
failing, so one rule table serves the tiny test model and the 72B preset alike.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")

LOGICAL_RULES: tuple[tuple[str, Any], ...] = (
    ("batch", ("data", "fsdp")),
    ("seq", None),
    ("activation_embed", None),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("q_heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("norm", None),
    ("vision_patch", None),
    ("vision_embed", "fsdp"),
    ("vision_heads", "tensor"),
    ("vision_mlp", "tensor"),
    ("vision_merge", "fsdp"),
    ("vision_norm", None),
)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Mesh shape; one axis may be -1 to take all remaining devices."""

    data: int = 1
    fsdp: int = -1
    tensor: int = 1

    def shape(self, num_devices: int) -> tuple[int, int, int]:
        sizes = [self.data, self.fsdp, self.tensor]
        if sizes.count(-1) > 1:
            raise ValueError(f"mesh: at most one axis may be -1, got data={self.data} fsdp={self.fsdp} tensor={self.tensor}")
        known = math.prod(s for s in sizes if s != -1)
        if -1 in sizes:
            if num_devices % known:
                raise ValueError(f"mesh: {num_devices} devices not divisible by the fixed axes product {known}")
            sizes[sizes.index(-1)] = num_devices // known
        if math.prod(sizes) != num_devices:
            raise ValueError(f"mesh data={sizes[0]} x fsdp={sizes[1]} x tensor={sizes[2]} = {math.prod(sizes)} "
                             f"does not match the {num_devices} available devices")
        return tuple(sizes)  # type: ignore[return-value]


def make_mesh(cfg: MeshConfig | None = None, devices: Sequence[jax.Device] | None = None) -> Mesh:
    cfg = cfg or MeshConfig()
    devices = list(devices) if devices is not None else jax.devices()
    shape = cfg.shape(len(devices))
    try:
        from jax.experimental import mesh_utils

        grid = mesh_utils.create_device_mesh(shape, devices=devices)
    except Exception:  # CPU / unusual topologies: plain row-major order is fine
        grid = np.asarray(devices).reshape(shape)
    return Mesh(grid, MESH_AXES)


def _axis_size(mesh: Mesh, axes: Any) -> int:
    if axes is None:
        return 1
    if isinstance(axes, str):
        return mesh.shape[axes]
    return math.prod(mesh.shape[a] for a in axes)


def fit_spec(shape: Sequence[int], spec: PartitionSpec, mesh: Mesh) -> PartitionSpec:
    """Drop mesh axes from dimensions they do not divide evenly (e.g. 2 KV heads on tensor=4)."""
    fitted = []
    for dim, axes in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
        fitted.append(axes if axes is not None and dim % _axis_size(mesh, axes) == 0 else None)
    return PartitionSpec(*fitted)


def logical_spec(names: Sequence[str | None], rules=LOGICAL_RULES) -> PartitionSpec:
    return nn.logical_to_mesh_axes(tuple(names), rules)


def param_shardings(abstract_boxed: Any, mesh: Mesh, rules=LOGICAL_RULES) -> Any:
    """NamedSharding for every leaf of a boxed (nn.LogicallyPartitioned) abstract parameter tree."""
    specs = nn.get_partition_spec(abstract_boxed)
    shapes = nn.unbox(abstract_boxed)

    def to_sharding(spec: PartitionSpec, leaf: Any) -> NamedSharding:
        mesh_spec = nn.logical_to_mesh_axes(tuple(spec), rules) if len(spec) else PartitionSpec()
        return NamedSharding(mesh, fit_spec(leaf.shape, mesh_spec, mesh))

    return jax.tree.map(to_sharding, specs, shapes, is_leaf=lambda x: isinstance(x, PartitionSpec))


def batch_sharding(mesh: Mesh, ndim: int, batch_axis: int = 0) -> NamedSharding:
    """Shard dimension `batch_axis` over (data, fsdp); everything else replicated."""
    spec = [None] * ndim
    spec[batch_axis] = ("data", "fsdp")
    return NamedSharding(mesh, PartitionSpec(*spec))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def bytes_per_device(abstract: Any, shardings: Any) -> int:
    """Largest per-device byte count of a sharded tree (what one device must hold)."""
    totals: dict[Any, int] = {}
    for leaf, sharding in zip(jax.tree.leaves(abstract), jax.tree.leaves(shardings)):
        shard_shape = sharding.shard_shape(leaf.shape)
        nbytes = math.prod(shard_shape) * np.dtype(leaf.dtype).itemsize
        for device in sharding.mesh.devices.flat:
            totals[device] = totals.get(device, 0) + nbytes
    return max(totals.values()) if totals else 0
