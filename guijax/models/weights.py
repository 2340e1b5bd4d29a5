"""Parameters of the Flax Qwen2.5-VL <-> Hugging Face checkpoint tensors.

Each Flax leaf maps to one checkpoint tensor through a name rule and a layout transform (Flax kernels are
[in, out], torch Linear weights [out, in]; the vision patch Conv3d is a flattened linear map), or, for
the scanned layers' stacked leaves (params["layers"] [num_hidden_layers, ...], and
params["visual"]["blocks"]["run_k"] [periods, run length, ...], see `vision.BlockPlan`), to one tensor per
layer: stacked on load, unstacked on save, so the files keep the per-layer names `model.layers.{i}.*`. Loading builds every device's shard from a memmapped slice, so no host ever holds a full
copy of the model per device.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import traverse_util

from guijax.models.attention import KERNEL_PLATFORMS
from guijax.models.config import ModelConfig
from guijax.models.lora import LoraConfig, is_adapter, split
from guijax.models.qwen2_5_vl import Qwen2_5_VL
from guijax.models.vision import block_plan
from guijax.models.safetensors_io import CheckpointError, SafetensorsReader, write_safetensors
from guijax.sharding import param_shardings

LEGACY = "legacy"  # model.layers.*, visual.*: released checkpoints and what transformers saves
NESTED = "nested"  # model.language_model.*, model.visual.*: transformers 5's in-memory names


def build_module(cfg: ModelConfig, dtype: Any = jnp.float32, param_dtype: Any = jnp.float32,
                 remat_policy: str = "none", attention_impl: str = "auto", scan_layers: bool = True,
                 lora: LoraConfig | None = None, expert_capacity_factor: float = 0.0,
                 frozen: tuple[str, ...] = (), attention_block: int = 512) -> Qwen2_5_VL:
    """The Flax module; attention_impl is the attention backend (see guijax.models.attention), scan_layers
    stacks the layers under `nn.scan` (False: one module per layer, the unrolled reference), lora adds
    low-rank adapters to the decoder projections it targets, expert_capacity_factor sizes expert parallelism's
    buffers (guijax.models.moe; 0: dropless), frozen names the parameter groups training holds fixed
    (guijax.models.trained), attention_block is the blockwise attention's tile."""
    return Qwen2_5_VL(cfg, dtype=dtype, param_dtype=param_dtype, remat_policy=remat_policy,
                      attention_impl=attention_impl, scan_layers=scan_layers, lora=lora,
                      expert_capacity_factor=expert_capacity_factor, frozen=tuple(frozen),
                      attention_block=attention_block)


def _dummy_inputs(cfg: ModelConfig) -> tuple:
    """Smallest inputs that touch every parameter: one 1x2x2 image grid (one merged token) plus text."""
    from guijax.models.positions import vision_layout

    merge = cfg.vision.spatial_merge_size
    layout = vision_layout(np.array([[1, merge, merge]]), cfg.vision)
    vision = layout.inputs(np.zeros((merge * merge, cfg.vision.patch_dim), np.float32))
    ids = jnp.array([[cfg.image_token_id, 0]], jnp.int32)
    return ids, jnp.zeros((3, 1, 2), jnp.int32), jnp.ones((1, 2), jnp.int32), vision


def _for_init(module: Qwen2_5_VL) -> Qwen2_5_VL:
    """The module with the blockwise attention, which runs on every platform: parameters do not depend on the
    attention backend, and one that names cuDNN or splash cannot be traced for another machine's devices
    (a dry run compiling for a GPU or TPU from this one)."""
    return module.clone(attention_impl="xla") if module.attention_impl in KERNEL_PLATFORMS else module


def abstract_params(module: Qwen2_5_VL) -> Any:
    """Boxed (logically partitioned) ShapeDtypeStructs of every parameter, without allocating."""
    ids, pos, mask, vision = _dummy_inputs(module.cfg)
    module = _for_init(module)
    return jax.eval_shape(lambda: module.init(jax.random.PRNGKey(0), ids, pos, mask, vision))["params"]


def init_params(module: Qwen2_5_VL, rng: jax.Array, mesh=None) -> Any:
    """Random parameters, created directly in their shards when a mesh is given."""
    ids, pos, mask, vision = _dummy_inputs(module.cfg)
    module = _for_init(module)

    def init():
        return nn.unbox(module.init(rng, ids, pos, mask, vision)["params"])

    if mesh is None:
        return jax.jit(init)()
    shardings = param_shardings(abstract_params(module), mesh)
    return jax.jit(init, out_shardings=shardings)()


def init_adapters(module: Qwen2_5_VL, rng: jax.Array, mesh=None) -> Any:
    """A LoRA module's fresh adapters alone (A random, B zero), created in their shards. The base weights'
    initialisers are dead code in this program, so a 7B module costs only its adapters here."""
    if module.lora is None:
        raise ValueError("init_adapters needs a module built with a LoRA config")
    ids, pos, mask, vision = _dummy_inputs(module.cfg)

    def init():
        return split(nn.unbox(module.init(rng, ids, pos, mask, vision)["params"]))[0]

    if mesh is None:
        return jax.jit(init)()
    shardings = split(param_shardings(abstract_params(module), mesh))[0]
    return jax.jit(init, out_shardings=shardings)()


def count_params(tree: Any) -> int:
    return sum(math.prod(x.shape) for x in jax.tree.leaves(nn.unbox(tree)))


# ---------------------------------------------------------------------------- names and layouts
@dataclasses.dataclass(frozen=True)
class TensorRule:
    """How one Flax leaf relates to checkpoint tensors: one tensor, or, for a leaf of scanned layers, one
    tensor per layer, the leaf's leading `stack` axes indexing `hf_names` in row-major order."""

    hf_names: tuple[str, ...]
    layout: str  # "same" | "transpose" | "patch" | "experts_swapped" (see `_expert_layout`)
    stack: tuple[int, ...] = ()

    @property
    def hf_name(self) -> str:
        if self.stack:
            raise ValueError(f"stacked leaf of {len(self.hf_names)} tensors ({self.hf_names[0]}, ...)")
        return self.hf_names[0]


def _unstacked(path: tuple[str, ...], cfg: ModelConfig) -> tuple[tuple[str, ...], tuple[int, ...], list[int]]:
    """A scanned leaf's path with its layer modules replaced by the per-layer template ("layers_{}"), the
    leading stack shape, and the checkpoint layer number of each stacked entry (row-major)."""
    if path[0] == "layers":
        n = cfg.num_hidden_layers
        return ("layers_{}",) + path[1:], (n,), list(range(n))
    if path[:2] == ("visual", "blocks") and path[2].startswith("run_"):
        plan, run = block_plan(cfg.vision), int(path[2][len("run_"):])
        length = plan.runs[run][1]
        numbers = [plan.block_index(r, run, j) for r in range(plan.repeats) for j in range(length)]
        return ("visual", "blocks_{}") + path[3:], (plan.repeats, length), numbers
    return path, (), []


def default_style(cfg: ModelConfig) -> str:
    """The names a family's released checkpoints use: Qwen3-VL ships transformers 5's nested names."""
    return NESTED if cfg.qwen3 else LEGACY


def flax_to_hf(path: tuple[str, ...], cfg: ModelConfig, style: str | None = None) -> TensorRule:
    path, stack, numbers = _unstacked(path, cfg)
    name, layout = _hf_template(path, style or default_style(cfg), cfg.qwen3)
    names = tuple(name.format(i) for i in numbers) if stack else (name,)
    return TensorRule(names, layout, stack)


# Qwen3-VL's names for the vision modules the families share: block MLP, output and DeepStack mergers
_QWEN3_VISION_NAMES = ((r"\.mlp\.fc(\d)\.", r".mlp.linear_fc\1."), (r"^deepstack_(\d+)\.", r"deepstack_merger_list.\1."),
                       (r"(merger|list\.\d+)\.ln_q\.", r"\1.norm."), (r"(merger|list\.\d+)\.mlp\.0\.", r"\1.linear_fc1."),
                       (r"(merger|list\.\d+)\.mlp\.2\.", r"\1.linear_fc2."))


def _hf_template(path: tuple[str, ...], style: str, qwen3: bool = False) -> tuple[str, str]:
    """(checkpoint name, layout) of one unstacked leaf; "{}" in a layer module's name stays a placeholder."""
    text_prefix = "model." if style == LEGACY else "model.language_model."
    vision_prefix = "visual." if style == LEGACY else "model.visual."
    parts = [re.sub(r"^(layers|blocks|mlp)_(\d+|\{\})$", r"\1.\2", p) for p in path]
    leaf = parts[-1]
    if path == ("embed_tokens",):
        return text_prefix + "embed_tokens.weight", "same"
    if path == ("lm_head",):
        return "lm_head.weight", "transpose"
    if path[0] == "visual":
        if path[1:] == ("patch_embed", "kernel"):
            return vision_prefix + "patch_embed.proj.weight", "patch"
        if path[1:] == ("patch_embed", "bias"):
            return vision_prefix + "patch_embed.proj.bias", "same"
        if path[1:] == ("pos_embed",):
            return vision_prefix + "pos_embed.weight", "same"
        prefix, parts = vision_prefix, parts[1:]
        if qwen3:
            name = ".".join(parts)
            for pattern, repl in _QWEN3_VISION_NAMES:
                name = re.sub(pattern, repl, name)
            parts = name.split(".")
    else:
        prefix = text_prefix
    if leaf == "kernel":
        return prefix + ".".join(parts[:-1] + ["weight"]), "transpose"
    return prefix + ".".join(parts), "same"


def detect_style(keys: list[str]) -> str:
    return NESTED if any(k.startswith("model.language_model.") for k in keys) else LEGACY


def _expert_layout(rule: TensorRule, reader, keys: set[str], shape: tuple[int, ...]) -> TensorRule:
    """Stacked expert matrices are stored [E, in, out] in the released Qwen3-VL-MoE checkpoints (the layout
    guijax saves) and [E, out, in] by transformers 5; a checkpoint in the latter is read swapped."""
    name = rule.hf_names[0]
    if not name.endswith(("experts.gate_up_proj", "experts.down_proj")) or name not in keys:
        return rule
    expert = shape[len(rule.stack):]
    swapped = expert[:-2] + (expert[-1], expert[-2])
    if tuple(reader.shape(name)) == swapped and swapped != expert:
        return dataclasses.replace(rule, layout="experts_swapped")
    return rule


def _hf_shape(shape: tuple[int, ...], layout: str, cfg: ModelConfig) -> tuple[int, ...]:
    if layout == "transpose":
        return tuple(reversed(shape))
    if layout == "experts_swapped":
        return shape[:-2] + (shape[-1], shape[-2])
    if layout == "patch":
        v = cfg.vision
        return (shape[1], v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size)
    return tuple(shape)


def _read_leaf(sources: list[np.ndarray], rule: TensorRule, index: tuple[slice, ...]) -> np.ndarray:
    """The part of a (stacked) Flax leaf at `index`: each layer in the index's leading stack range is read
    from its own checkpoint tensor, so a device shard still touches only the bytes it holds."""
    if not rule.stack:
        return _read_slice(sources[0], rule.layout, index)
    k = len(rule.stack)
    picked = np.arange(len(sources)).reshape(rule.stack)[index[:k]]
    parts = [_read_slice(sources[i], rule.layout, index[k:]) for i in picked.reshape(-1)]
    return np.stack(parts).reshape(picked.shape + parts[0].shape)


def _read_slice(src: np.ndarray, layout: str, index: tuple[slice, ...]) -> np.ndarray:
    """The part of the Flax-layout tensor at `index`, read from the checkpoint-layout memmap."""
    if layout == "same":
        return np.asarray(src[index])
    if layout == "experts_swapped":
        return np.asarray(src[index[:-2] + (index[-1], index[-2])]).swapaxes(-1, -2)
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


class ArrayReader:
    """In-memory tensors (e.g. a torch state dict as numpy) behind `SafetensorsReader`'s interface."""

    def __init__(self, arrays: dict[str, np.ndarray]):
        self.arrays = arrays

    def keys(self) -> list[str]:
        return sorted(self.arrays)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.arrays[name].shape)

    def get(self, name: str) -> np.ndarray:
        return self.arrays[name]


def load_params(directory: str, module: Qwen2_5_VL, mesh=None) -> Any:
    """Read a Hugging Face Qwen2.5-VL safetensors checkpoint into (sharded) Flax parameters.

    Fails with the full lists of missing keys, unexpected keys and shape mismatches, so a wrong checkpoint
    is diagnosed in one go.
    """
    return load_tensors(SafetensorsReader(directory), module, mesh, origin=f"checkpoint {directory}")


def load_tensors(reader: SafetensorsReader | ArrayReader, module: Qwen2_5_VL, mesh=None,
                 origin: str = "tensors") -> Any:
    """Checkpoint-named tensors -> (sharded) Flax parameters; per-layer tensors are stacked into the
    scanned layers' leaves shard by shard. A LoRA module's adapters are not in a base checkpoint: they are
    left out here (see `guijax.models.lora`)."""
    cfg = module.cfg
    keys = reader.keys()
    style = detect_style(keys)
    boxed = abstract_params(module.clone(lora=None))
    flat = traverse_util.flatten_dict(nn.unbox(boxed))
    if mesh is not None:
        flat_shardings = traverse_util.flatten_dict(param_shardings(boxed, mesh))
    else:
        device = jax.devices()[0]
        flat_shardings = {p: jax.sharding.SingleDeviceSharding(device) for p in flat}
    present = set(keys)
    rules = {path: _expert_layout(flax_to_hf(path, cfg, style), reader, present, flat[path].shape) for path in flat}
    _check_tensors(reader, keys, flat, rules, cfg, origin)
    loaded = {}
    for path, leaf in flat.items():
        rule = rules[path]
        sources = [reader.get(name) for name in rule.hf_names]
        target = _numpy_dtype(leaf.dtype)

        def fetch(index, sources=sources, rule=rule, target=target):
            return _read_leaf(sources, rule, index).astype(target)

        loaded[path] = jax.make_array_from_callback(leaf.shape, flat_shardings[path], fetch)
    return traverse_util.unflatten_dict(loaded)


def _check_tensors(reader, keys: list[str], flat: dict, rules: dict, cfg: ModelConfig, origin: str) -> None:
    """Raise one CheckpointError listing every missing, unexpected and mis-shaped tensor."""
    wanted = {name for r in rules.values() for name in r.hf_names}
    ignorable = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    missing = sorted(wanted - set(keys))
    unexpected = sorted(set(keys) - wanted - ignorable)
    mismatched = []
    for p, r in rules.items():
        expected = _hf_shape(flat[p].shape[len(r.stack):], r.layout, cfg)
        mismatched += [f"{name}: checkpoint {reader.shape(name)} vs model {expected}"
                       for name in r.hf_names if name in keys and reader.shape(name) != expected]
    problems = []
    if missing:
        problems.append(f"missing keys ({len(missing)}): {missing}")
    if unexpected:
        problems.append(f"unexpected keys ({len(unexpected)}): {unexpected}")
    if mismatched:
        problems.append(f"shape mismatches ({len(mismatched)}): {mismatched}")
    if problems:
        raise CheckpointError(f"{origin} does not match the model config:\n  " + "\n  ".join(problems))


def _host_value(x: jax.Array) -> np.ndarray:
    if x.is_fully_addressable:
        return np.asarray(jax.device_get(x))
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


@jax.jit
def _take_layer(x: jax.Array, index: jax.Array) -> jax.Array:
    """x[index] for an int32 vector over x's leading stack axes (traced, so one program serves all layers)."""
    k = index.shape[0]
    start = tuple(index) + (0,) * (x.ndim - k)
    return jax.lax.dynamic_slice(x, start, (1,) * k + x.shape[k:]).reshape(x.shape[k:])


def _layer_values(value: jax.Array, rule: TensorRule, fetch: Callable[[jax.Array], Any] = _host_value
                  ) -> list[Callable[[], Any]]:
    """Reads of each checkpoint tensor of a leaf, by `fetch` (to the host by default): the whole leaf, or one
    layer of a stacked one at a time (a stacked 7B MLP kernel is 7.6 GB in float32; one layer is what the
    writer holds)."""
    if not rule.stack:
        return [lambda: fetch(value)]
    return [lambda i=i: fetch(_take_layer(value, np.asarray(np.unravel_index(i, rule.stack), np.int32)))
            for i in range(len(rule.hf_names))]


def hf_entries(params: Any, cfg: ModelConfig, dtype: Any | None = None, device: jax.Device | None = None
               ) -> list[tuple[str, tuple[int, ...], np.dtype, Callable[[], Any]]]:
    """(checkpoint name, shape, dtype, read) of every tensor of plain `params` in the released checkpoints'
    layout, sorted by name; each `read()` fetches one tensor (one layer of a scanned leaf) to the host, or with
    `device` as an array on that one device (for an engine on the same accelerator to take by DLPack, without
    a trip through host memory), so a writer or a serving engine holds one tensor at a time. In multi-host
    runs every process must read them all (they gather)."""
    flat = traverse_util.flatten_dict(nn.unbox(params))
    adapters = [".".join(p) for p in flat if is_adapter(p)]
    if adapters:
        raise ValueError(f"parameters hold LoRA adapters ({adapters[0]}, ...): fold them into the kernels with "
                         "guijax.models.lora.merge before saving a plain checkpoint")
    entries: list[tuple[str, tuple[int, ...], np.dtype, Callable[[], np.ndarray]]] = []
    for path, value in flat.items():
        rule = flax_to_hf(path, cfg)
        out_dtype = _numpy_dtype(dtype if dtype is not None else value.dtype)
        shape = _hf_shape(value.shape[len(rule.stack):], rule.layout, cfg)
        reads = _layer_values(value, rule, _host_value if device is None else functools.partial(_on_device,
                                                                                                device=device))
        for name, read in zip(rule.hf_names, reads):

            def fetch(read=read, layout=rule.layout, out_dtype=out_dtype):  # cast first: a narrower transpose
                return _to_checkpoint_layout(read().astype(out_dtype), layout, cfg)

            entries.append((name, shape, out_dtype, fetch))
    entries.sort(key=lambda entry: entry[0])
    return entries


def _on_device(x: jax.Array, device: jax.Device) -> jax.Array:
    """`x` whole on `device`: gathered there (across hosts through the host, as `_host_value` does: a process
    cannot address other hosts' shards)."""
    if x.sharding.device_set == {device}:
        return x
    return jax.device_put(x if x.is_fully_addressable else _host_value(x), device)


def save_params(directory: str, params: Any, cfg: ModelConfig, dtype: Any | None = None) -> list[str]:
    """Write parameters as Hugging Face safetensors in the released checkpoints' layout (scanned layers
    unstacked into per-layer tensors), one tensor at a time. In multi-host runs every process must call this
    (it gathers); only process 0 writes."""
    entries = hf_entries(params, cfg, dtype)
    if jax.process_index() != 0:
        for *_, fetch in entries:  # participate in the gathers, write nothing
            fetch()
        return []
    return write_safetensors(directory, entries)
