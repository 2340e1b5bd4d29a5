"""Parameters of the Flax Qwen2.5-VL <-> Hugging Face checkpoint tensors.

Each Flax leaf maps to exactly one checkpoint tensor through a name rule and a layout transform
(Flax kernels are [in, out], torch Linear weights [out, in]; the vision patch Conv3d is a flattened
linear map). Loading builds every device's shard from a memmapped slice, so no host ever holds a full
copy of the model per device.
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import traverse_util

from guijax.models.config import ModelConfig
from guijax.models.qwen2_5_vl import Qwen2_5_VL
from guijax.models.safetensors_io import CheckpointError, SafetensorsReader, write_safetensors
from guijax.sharding import param_shardings

LEGACY = "legacy"  # model.layers.*, visual.*: released checkpoints and what transformers saves
NESTED = "nested"  # model.language_model.*, model.visual.*: transformers 5's in-memory names


def build_module(cfg: ModelConfig, dtype: Any = jnp.float32, param_dtype: Any = jnp.float32,
                 remat_policy: str = "none", attention_impl: str = "auto") -> Qwen2_5_VL:
    """The Flax module; attention_impl is the attention backend (see guijax.models.attention)."""
    return Qwen2_5_VL(cfg, dtype=dtype, param_dtype=param_dtype, remat_policy=remat_policy,
                      attention_impl=attention_impl)


def _dummy_inputs(cfg: ModelConfig) -> tuple:
    """Smallest inputs that touch every parameter: one 1x2x2 image grid (one merged token) plus text."""
    from guijax.models.positions import vision_layout

    merge = cfg.vision.spatial_merge_size
    layout = vision_layout(np.array([[1, merge, merge]]), cfg.vision)
    vision = layout.inputs(np.zeros((merge * merge, cfg.vision.patch_dim), np.float32))
    ids = jnp.array([[cfg.image_token_id, 0]], jnp.int32)
    return ids, jnp.zeros((3, 1, 2), jnp.int32), jnp.ones((1, 2), jnp.int32), vision


def abstract_params(module: Qwen2_5_VL) -> Any:
    """Boxed (logically partitioned) ShapeDtypeStructs of every parameter, without allocating."""
    ids, pos, mask, vision = _dummy_inputs(module.cfg)
    return jax.eval_shape(lambda: module.init(jax.random.PRNGKey(0), ids, pos, mask, vision))["params"]


def init_params(module: Qwen2_5_VL, rng: jax.Array, mesh=None) -> Any:
    """Random parameters, created directly in their shards when a mesh is given."""
    ids, pos, mask, vision = _dummy_inputs(module.cfg)

    def init():
        return nn.unbox(module.init(rng, ids, pos, mask, vision)["params"])

    if mesh is None:
        return jax.jit(init)()
    shardings = param_shardings(abstract_params(module), mesh)
    return jax.jit(init, out_shardings=shardings)()


def count_params(tree: Any) -> int:
    return sum(math.prod(x.shape) for x in jax.tree.leaves(nn.unbox(tree)))


# ---------------------------------------------------------------------------- names and layouts
@dataclasses.dataclass(frozen=True)
class TensorRule:
    """How one Flax leaf relates to one checkpoint tensor."""

    hf_name: str
    layout: str  # "same" | "transpose" | "patch"


def flax_to_hf(path: tuple[str, ...], cfg: ModelConfig, style: str = LEGACY) -> TensorRule:
    text_prefix = "model." if style == LEGACY else "model.language_model."
    vision_prefix = "visual." if style == LEGACY else "model.visual."
    parts = [re.sub(r"^(layers|blocks|mlp)_(\d+)$", r"\1.\2", p) for p in path]
    leaf = parts[-1]
    if path == ("embed_tokens",):
        return TensorRule(text_prefix + "embed_tokens.weight", "same")
    if path == ("lm_head",):
        return TensorRule("lm_head.weight", "transpose")
    if path[0] == "visual":
        if path[1:] == ("patch_embed", "kernel"):
            return TensorRule(vision_prefix + "patch_embed.proj.weight", "patch")
        prefix, parts = vision_prefix, parts[1:]
    else:
        prefix = text_prefix
    if leaf == "kernel":
        return TensorRule(prefix + ".".join(parts[:-1] + ["weight"]), "transpose")
    return TensorRule(prefix + ".".join(parts), "same")


def detect_style(keys: list[str]) -> str:
    return NESTED if any(k.startswith("model.language_model.") for k in keys) else LEGACY


def _hf_shape(shape: tuple[int, ...], layout: str, cfg: ModelConfig) -> tuple[int, ...]:
    if layout == "transpose":
        return tuple(reversed(shape))
    if layout == "patch":
        v = cfg.vision
        return (shape[1], v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size)
    return tuple(shape)


def _read_slice(src: np.ndarray, layout: str, index: tuple[slice, ...]) -> np.ndarray:
    """The part of the Flax-layout tensor at `index`, read from the checkpoint-layout memmap."""
    if layout == "same":
        return np.asarray(src[index])
    if layout == "transpose":
        return np.asarray(src[tuple(reversed(index))]).T
    rows, cols = index  # patch: kernel [patch_dim, E] = weight[E, C, T, P, P].reshape(E, -1).T
    return np.asarray(src[cols]).reshape(-1, math.prod(src.shape[1:]))[:, rows].T


def _to_checkpoint_layout(array: np.ndarray, layout: str, cfg: ModelConfig) -> np.ndarray:
    if layout == "transpose":
        return array.T
    if layout == "patch":
        return array.T.reshape(_hf_shape(array.shape, layout, cfg))
    return array


def _numpy_dtype(dtype: Any) -> np.dtype:
    return np.dtype(ml_dtypes.bfloat16) if jnp.dtype(dtype) == jnp.bfloat16 else np.dtype(jnp.dtype(dtype).name)


def load_params(directory: str, module: Qwen2_5_VL, mesh=None) -> Any:
    """Read a Hugging Face Qwen2.5-VL safetensors checkpoint into (sharded) Flax parameters.

    Fails with the full lists of missing keys, unexpected keys and shape mismatches, so a wrong checkpoint
    is diagnosed in one go.
    """
    cfg = module.cfg
    reader = SafetensorsReader(directory)
    keys = reader.keys()
    style = detect_style(keys)
    boxed = abstract_params(module)
    flat = traverse_util.flatten_dict(nn.unbox(boxed))
    if mesh is not None:
        flat_shardings = traverse_util.flatten_dict(param_shardings(boxed, mesh))
    else:
        device = jax.devices()[0]
        flat_shardings = {p: jax.sharding.SingleDeviceSharding(device) for p in flat}
    rules = {path: flax_to_hf(path, cfg, style) for path in flat}
    wanted = {r.hf_name for r in rules.values()}
    ignorable = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    missing = sorted(wanted - set(keys))
    unexpected = sorted(set(keys) - wanted - ignorable)
    mismatched = [
        f"{r.hf_name}: checkpoint {reader.shape(r.hf_name)} vs model {_hf_shape(flat[p].shape, r.layout, cfg)}"
        for p, r in rules.items()
        if r.hf_name in keys and reader.shape(r.hf_name) != _hf_shape(flat[p].shape, r.layout, cfg)
    ]
    problems = []
    if missing:
        problems.append(f"missing keys ({len(missing)}): {missing}")
    if unexpected:
        problems.append(f"unexpected keys ({len(unexpected)}): {unexpected}")
    if mismatched:
        problems.append(f"shape mismatches ({len(mismatched)}): {mismatched}")
    if problems:
        raise CheckpointError(f"checkpoint {directory} does not match the model config:\n  " + "\n  ".join(problems))
    loaded = {}
    for path, leaf in flat.items():
        rule = rules[path]
        src = reader.get(rule.hf_name)
        target = _numpy_dtype(leaf.dtype)

        def fetch(index, src=src, layout=rule.layout, target=target):
            return _read_slice(src, layout, index).astype(target)

        loaded[path] = jax.make_array_from_callback(leaf.shape, flat_shardings[path], fetch)
    return traverse_util.unflatten_dict(loaded)


def _host_value(x: jax.Array) -> np.ndarray:
    if x.is_fully_addressable:
        return np.asarray(jax.device_get(x))
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def save_params(directory: str, params: Any, cfg: ModelConfig, dtype: Any | None = None) -> list[str]:
    """Write parameters as Hugging Face safetensors in the released checkpoints' layout, one tensor at a
    time. In multi-host runs every process must call this (it gathers); only process 0 writes."""
    flat = traverse_util.flatten_dict(nn.unbox(params))
    entries: list[tuple[str, tuple[int, ...], np.dtype, Callable[[], np.ndarray]]] = []
    for path, value in sorted(flat.items(), key=lambda kv: flax_to_hf(kv[0], cfg).hf_name):
        rule = flax_to_hf(path, cfg)
        out_dtype = _numpy_dtype(dtype if dtype is not None else value.dtype)

        def fetch(value=value, layout=rule.layout, out_dtype=out_dtype):
            return _to_checkpoint_layout(_host_value(value), layout, cfg).astype(out_dtype)

        entries.append((rule.hf_name, _hf_shape(value.shape, rule.layout, cfg), out_dtype, fetch))
    if jax.process_index() != 0:
        for *_, fetch in entries:  # participate in the gathers, write nothing
            fetch()
        return []
    return write_safetensors(directory, entries)
