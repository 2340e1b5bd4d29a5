"""Device mesh and the one table that maps logical array axes to mesh axes.

Mesh axes: `data` (pure data parallel, replicated params), `fsdp` (data parallel with parameters and
optimiser state sharded, ZeRO-3 style), `tensor` (Megatron-style split of heads / MLP / vocab), `expert`
(expert parallelism: each device holds 1/expert of a MoE layer's routed experts and tokens travel to them by
all-to-all; outside the expert layers it is one more data-parallel axis, with parameters sharded over it
like fsdp, so a dense model on it loses nothing).
Every parameter names its dimensions with logical axes (see guijax/models/layers.py); `LOGICAL_RULES`
decides where each goes. A dimension that a mesh axis does not divide is left unsharded rather than
failing, so one rule table serves the tiny test model and the 72B preset alike.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any, Callable, Iterator, Mapping, Sequence

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor", "expert")
DATA_AXES = ("data", "fsdp", "expert")  # the axes batch rows are split over

LOGICAL_RULES: tuple[tuple[str, Any], ...] = (
    ("layers", None),  # the stacked layer axis of scanned layers: each device holds its share of every layer
    ("layer_groups", None),  # the outer stacked axis of the vision blocks (periods of a BlockPlan)
    ("batch", DATA_AXES),
    ("seq", None),
    ("activation_embed", None),
    ("vocab", "tensor"),
    # routed experts: each device of the expert axis holds its share of them. Rules are matched in order and a
    # mesh axis serves one dimension of an array, so this precedes `embed`, whose dimension in the expert
    # weights then falls back to fsdp alone
    ("experts", "expert"),
    ("embed", ("fsdp", "expert")),
    ("embed", "fsdp"),
    ("q_heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("lora_rank", None),  # LoRA adapters' rank axis: small; their other axis follows the kernel's
    ("norm", None),
    ("vision_patch", None),
    ("vision_embed", ("fsdp", "expert")),
    ("vision_embed", "fsdp"),
    ("vision_heads", "tensor"),
    ("vision_mlp", "tensor"),
    ("vision_merge", ("fsdp", "expert")),
    ("vision_merge", "fsdp"),
    ("vision_norm", None),
    ("vision_positions", None),  # the rows of Qwen3-VL's learned position grid
    # vision activations: patches, and the rows of batched attention windows / image frames, split over the
    # data-parallel devices like batch rows, so the tower's work shrinks with data parallelism
    ("vision_tokens", DATA_AXES),
    ("vision_windows", DATA_AXES),
)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Mesh shape in MESH_AXES order; one axis may be -1 to take all remaining devices."""

    data: int = 1
    fsdp: int = -1
    tensor: int = 1
    expert: int = 1

    @classmethod
    def from_run_config(cls, config: Any) -> "MeshConfig":
        """The run config's `mesh` section."""
        m = config.mesh
        return cls(m.data, m.fsdp, m.tensor, m.get("expert", 1))

    def shape(self, num_devices: int) -> tuple[int, int, int, int]:
        sizes = [self.data, self.fsdp, self.tensor, self.expert]
        if sizes.count(-1) > 1:
            raise ValueError(f"mesh: at most one axis may be -1, got data={self.data} fsdp={self.fsdp} "
                             f"tensor={self.tensor} expert={self.expert}")
        known = math.prod(s for s in sizes if s != -1)
        if -1 in sizes:
            if num_devices % known:
                raise ValueError(f"mesh: {num_devices} devices not divisible by the fixed axes product {known}")
            sizes[sizes.index(-1)] = num_devices // known
        if math.prod(sizes) != num_devices:
            raise ValueError(f"mesh data={sizes[0]} x fsdp={sizes[1]} x tensor={sizes[2]} x expert={sizes[3]} = "
                             f"{math.prod(sizes)} does not match the {num_devices} available devices")
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
    """Drop mesh axes from dimensions they do not divide evenly (e.g. 2 KV heads on tensor=4); of a tuple of axes
    the longest leading run that divides is kept (a width fsdp x expert does not divide may still split over
    fsdp)."""
    fitted = []
    for dim, axes in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
        if isinstance(axes, tuple):
            while axes and dim % _axis_size(mesh, axes):
                axes = axes[:-1]
            fitted.append(_trim(axes, mesh) if axes else None)
        else:
            fitted.append(axes if axes is not None and dim % _axis_size(mesh, axes) == 0 else None)
    return PartitionSpec(*fitted)


def _trim(axes: tuple[str, ...], mesh: Mesh) -> tuple[str, ...] | str | None:
    """A tuple of mesh axes without its trailing size-1 axes: the same split, and without expert parallelism
    the specs read as they would without the expert axis (("data", "fsdp"), "fsdp")."""
    axes = tuple(axes)
    while axes and mesh.shape[axes[-1]] == 1 and len(axes) > 1:
        axes = axes[:-1]
    return axes[0] if len(axes) == 1 else axes


def logical_spec(names: Sequence[str | None], rules=LOGICAL_RULES) -> PartitionSpec:
    return nn.logical_to_mesh_axes(tuple(names), rules)


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """A sharding constraint from logical names under the mesh and rules in context (a no-op outside
    `rules_context`), dropping mesh axes a dimension does not divide, e.g. 2 KV heads on tensor=4."""
    mesh = jax.sharding.get_abstract_mesh()
    rules = nn.get_logical_axis_rules()
    if mesh.empty or not rules:
        return x
    return jax.lax.with_sharding_constraint(x, fit_spec(x.shape, logical_spec(names, rules), mesh))


def param_shardings(abstract_boxed: Any, mesh: Mesh, rules=LOGICAL_RULES) -> Any:
    """NamedSharding for every leaf of a boxed (nn.LogicallyPartitioned) abstract parameter tree."""
    specs = nn.get_partition_spec(abstract_boxed)
    shapes = nn.unbox(abstract_boxed)

    def to_sharding(spec: PartitionSpec, leaf: Any) -> NamedSharding:
        mesh_spec = nn.logical_to_mesh_axes(tuple(spec), rules) if len(spec) else PartitionSpec()
        return NamedSharding(mesh, fit_spec(leaf.shape, mesh_spec, mesh))

    return jax.tree.map(to_sharding, specs, shapes, is_leaf=lambda x: isinstance(x, PartitionSpec))


def batch_sharding(mesh: Mesh, ndim: int, batch_axis: int = 0) -> NamedSharding:
    """Shard dimension `batch_axis` over the data-parallel axes; everything else replicated."""
    spec = [None] * ndim
    spec[batch_axis] = _trim(DATA_AXES, mesh)
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


def data_parallel_size(mesh: Mesh) -> int:
    return _axis_size(mesh, DATA_AXES)


@contextlib.contextmanager
def rules_context(mesh: Mesh, rules=LOGICAL_RULES) -> Iterator[None]:
    """Mesh + logical axis rules in context while tracing, so the model's `nn.with_logical_constraint`
    calls become real sharding constraints (outside both they are no-ops)."""
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        yield


# ---------------------------------------------------------------------------- optimiser state

def like_params(abstract_state: Any, params: Any, param_shards: Any, mesh: Mesh) -> Any:
    """Shardings for a tree derived from the parameters (optimiser moments, accumulated gradients): a leaf
    whose key path ends with a parameter's path and has its shape takes that parameter's sharding; anything
    else (step counts, scalars) is replicated."""
    flat_params = jax.tree_util.tree_flatten_with_path(params)[0]
    flat_shards = jax.tree.leaves(param_shards)
    by_path = {tuple(path): (leaf.shape, shard) for (path, leaf), shard in zip(flat_params, flat_shards)}

    def pick(path: tuple, leaf: Any) -> NamedSharding:
        for i in range(len(path)):
            hit = by_path.get(tuple(path[i:]))
            if hit is not None and tuple(hit[0]) == tuple(leaf.shape):
                return hit[1]
        return replicated(mesh)

    return jax.tree_util.tree_map_with_path(pick, abstract_state)


def opt_state_shardings(tx: Any, params: Any, param_shards: Any, mesh: Mesh) -> Any:
    """NamedShardings of `tx.init(params)` without running it: moments sharded like their parameters."""
    abstract = jax.eval_shape(tx.init, params)
    return like_params(abstract, params, param_shards, mesh)


def init_opt_state(tx: Any, params: Any, mesh: Mesh | None = None, param_shards: Any = None) -> Any:
    """`tx.init(params)` under jit. With a mesh the moments are created directly in their shards
    (`out_shardings`), never whole on one device; `param_shards` default to the parameters' own shardings."""
    if mesh is None:
        return jax.jit(tx.init)(params)
    if param_shards is None:
        param_shards = jax.tree.map(lambda x: x.sharding, params)
    shards = opt_state_shardings(tx, params, param_shards, mesh)
    return jax.jit(tx.init, out_shardings=shards)(params)


# ---------------------------------------------------------------------------- batches

def row_axis(key: str) -> int:
    """Which dimension of a batch array holds rows: `positions` is [3, rows, seq], the rest lead with rows."""
    return 1 if key == "positions" else 0


def array_sharding(mesh: Mesh, key: str, ndim: int) -> NamedSharding:
    return replicated(mesh) if ndim == 0 else batch_sharding(mesh, ndim, row_axis(key))


def batch_shardings(batch: Mapping[str, Any], mesh: Mesh) -> dict[str, Any]:
    """The shardings a batch dict is placed with: rows over the data-parallel axes, scalars and `vision` replicated
    (see `place_vision` for why vision inputs are not split)."""
    out: dict[str, Any] = {}
    for key, value in batch.items():
        if key == "vision":
            out[key] = vision_shardings(value, mesh)
        else:
            out[key] = array_sharding(mesh, key, np.ndim(value))
    return out


def vision_shardings(vision: Mapping[str, Any] | None, mesh: Mesh) -> dict[str, Any] | None:
    """Pixels split over the data-parallel devices along patches (where the patch count divides), so no device
    holds every screenshot of the global batch; the layout's index arrays (a few bytes per patch) replicated.
    Per-device blocks (a leading block axis) are split along it, every array, like the rows."""
    if vision is None:
        return None
    if np.ndim(vision["pixel_values"]) == 3:  # per-device blocks (guijax.models.vision_blocks): split like rows
        return {k: batch_sharding(mesh, np.ndim(v)) for k, v in vision.items()}
    out = {k: replicated(mesh) for k in vision}
    pixels = vision.get("pixel_values")
    if pixels is not None and np.shape(pixels)[0] % data_parallel_size(mesh) == 0:
        out["pixel_values"] = batch_sharding(mesh, len(np.shape(pixels)))
    return out


def pad_rows(batch: Mapping[str, Any], multiple: int) -> dict[str, Any]:
    """Append all-zero rows (no tokens, zero loss mask, no images; no `response_positions`, -1) up to a
    multiple of `multiple`. Every loss and metric is masked, so padded rows change nothing but the shape."""
    rows = np.shape(batch["input_ids"])[0]
    extra = -rows % multiple
    if "token_index" in batch:  # packed (guijax.data.packing): its shape is the pipeline's to choose
        blocks = np.shape(batch["token_index"])[0]
        if extra or blocks % multiple:
            raise ValueError(f"a packed batch of {rows} rows in {blocks} blocks does not divide over {multiple} "
                             "data-parallel devices; set pipeline pack_blocks (and pack_rows) to a multiple of them")
        return dict(batch)
    if not extra:
        return dict(batch)
    out: dict[str, Any] = {}
    for key, value in batch.items():
        if key in ("meta", "vision") or value is None or np.ndim(value) == 0:
            out[key] = value
            continue
        value = np.asarray(value)
        widths = [(0, 0)] * value.ndim
        widths[row_axis(key)] = (0, extra)
        out[key] = np.pad(value, widths, constant_values=-1 if key == "response_positions" else 0)
    return out


def is_placed(value: Any) -> bool:
    """Already a global array on a mesh (a batch that went through `place_batch`, or an output of a step)."""
    return isinstance(value, jax.Array) and not isinstance(value.sharding, jax.sharding.SingleDeviceSharding)


def place_batch(local: Mapping[str, Any], mesh: Mesh, *, pad: bool = False,
                image_token_id: int | None = None) -> dict[str, Any]:
    """Host-local batch -> global jax Arrays with rows split over the data-parallel axes: each process contributes its
    local rows (`jax.make_array_from_process_local_data`), so no device ever receives the whole batch.
    Arrays already placed on the mesh are kept; `meta` stays on the host; None values are dropped.

    pad: append empty rows so the rows divide over the data-parallel devices (else a ValueError).
    image_token_id: needed only with several processes and images (see `place_vision`)."""
    ways, procs = data_parallel_size(mesh), jax.process_count()
    if (pad or "token_index" in local) and not is_placed(local["input_ids"]):  # a packed batch is only checked
        local = pad_rows(local, max(ways // math.gcd(ways, procs), 1))
    rows = np.shape(local["input_ids"])[0] * (1 if is_placed(local["input_ids"]) else procs)
    if rows % ways:
        raise ValueError(f"global batch of {rows} rows does not divide over data x fsdp = {ways} "
                         "devices; choose batch_size accordingly and drop_remainder=True")
    out: dict[str, Any] = {}
    vision = local.get("vision")
    if not _is_placed_tree(vision) and (vision is not None or procs > 1):
        vision = place_vision(vision, mesh, local["input_ids"], local.get("attention_mask"), image_token_id)
    for key, value in local.items():
        if value is None or key == "vision":
            continue
        if key == "meta" or is_placed(value):
            out[key] = value
        else:
            value = np.asarray(value)
            out[key] = jax.make_array_from_process_local_data(array_sharding(mesh, key, value.ndim), value)
    if vision is not None:
        out["vision"] = vision
    return out


def _is_placed_tree(tree: Any) -> bool:
    leaves = jax.tree.leaves(tree)
    return bool(leaves) and all(is_placed(x) for x in leaves)


def local_data_blocks(mesh: Mesh | None) -> int:
    """This process's share of the mesh's data-parallel devices (1 without a mesh): the blocks a packed batch
    is cut into, so each device gathers its own examples' positions."""
    return 1 if mesh is None else max(data_parallel_size(mesh) // jax.process_count(), 1)


def local_vision_blocks(config: Any, mesh: Mesh | None) -> int:
    """How many per-device vision blocks this process's batches hold: its share of the mesh's data-parallel
    devices under `pipeline.vision_per_device`, else 1 (one layout over the whole batch; always without a mesh)."""
    return local_data_blocks(mesh) if config.pipeline.get("vision_per_device", False) else 1


def place_vision(vision: Mapping[str, Any] | None, mesh: Mesh, input_ids: Any = None, attention_mask: Any = None,
                 image_token_id: int | None = None) -> dict[str, jax.Array] | None:
    """Vision inputs on the mesh: pixels split along patches over the data-parallel devices, the layout's
    index arrays replicated (`vision_shardings`).

    Patches are one array for all images of all rows (the window layout indexes across it), so they are not
    split by row; inside the tower the patches and the batched windows and image frames are split over the
    same devices by logical constraints, so its FLOPs and activations shrink with data parallelism. With
    several processes the local patch arrays are all-gathered on the host and merged (`merge_vision`) in
    global row order, and each process places its own shards of the merged arrays."""
    blocked = vision is not None and np.ndim(vision["pixel_values"]) == 3
    if blocked and jax.process_count() > 1:  # each process holds the blocks of its own rows
        shardings = vision_shardings(vision, mesh)
        return {k: jax.make_array_from_process_local_data(shardings[k], np.asarray(v)) for k, v in vision.items()}
    if jax.process_count() > 1:
        vision = _gather_vision(vision, mesh, input_ids, attention_mask, image_token_id)
    if vision is None:
        return None
    shardings = vision_shardings(vision, mesh)
    placed = {}
    for key, value in vision.items():
        value = np.asarray(value)  # the whole batch's on every process: each places only its own shards
        placed[key] = jax.make_array_from_callback(value.shape, shardings[key], lambda index, v=value: v[index])
    return placed


def merge_vision(parts: Sequence[tuple[Mapping[str, np.ndarray], int]], unit: int,
                 window_len: int | None = None) -> dict[str, np.ndarray]:
    """Concatenate the vision inputs of consecutive row blocks into those of the whole batch.

    parts: (vision dict, number of image-pad tokens in the block's rows), in row order. Each block's patches
    end with its own filler image (patch-bucket padding) that no token refers to; the language model takes
    the k-th merged feature for the k-th image-pad token, so the fillers are renumbered after every block's
    real images. A block with `token_features` (each distinct image once, see guijax.data.pipeline) has as
    many real features as its mapping names, and its mapping is shifted to where they land; blocks without
    one map their tokens in order. Window-ordered arrays keep their order; segment ids are offset to stay
    distinct, and the window batch (`window_tokens`, `window_slots`, rows of `window_len`, by default the
    blocks' own width) and the image-frame batch are rebuilt over the merged windows and frames."""
    counts = [_real_features(vision, n) for vision, n in parts]
    real_total = sum(counts)
    per_patch = [k for k in PATCH_ORDERED_KEYS if any(k in v for v, _ in parts)]  # window-ordered, concatenated
    patch_arrays: dict[str, list[np.ndarray]] = {k: [] for k in per_patch}
    pixels_real, pixels_fill, windows, full, win, tokens = [], [], [], [], [], []
    real_off = fill_off = full_off = win_off = 0
    for (vision, n_tokens), n_real in zip(parts, counts):
        v = {k: np.asarray(x) for k, x in vision.items()}
        units = v["pixel_values"].reshape(-1, unit, v["pixel_values"].shape[-1])
        pixels_real.append(units[:n_real])
        pixels_fill.append(units[n_real:])
        index = v["window_index"].astype(np.int64)
        windows.append(np.where(index < n_real, index + real_off, index - n_real + real_total + fill_off))
        for k in per_patch:
            if k in v:
                patch_arrays[k].append(v[k])
            elif len(v["pixel_values"]):
                raise ValueError(f"merge_vision: a block with patches has no {k!r} while another has")
        full.append(v["full_segments"] + full_off)
        win.append(v["window_segments"] + win_off)
        tokens.append(_block_token_features(v, n_tokens) + real_off)
        real_off += n_real
        fill_off += len(units) - n_real
        full_off += int(v["full_segments"].max(initial=-1)) + 1
        win_off += int(v["window_segments"].max(initial=-1)) + 1
    pixels = np.concatenate(pixels_real + pixels_fill)
    from guijax.models.positions import attention_batches  # models import this module

    full_segments, window_segments = np.concatenate(full).astype(np.int32), np.concatenate(win).astype(np.int32)
    width = window_len or next((np.shape(v["window_tokens"])[1] for v, _ in parts if "window_tokens" in v), None)
    if width is None:
        raise ValueError("merge_vision: no block has window_tokens to take the window width from; pass window_len")
    out = {"pixel_values": pixels.reshape(-1, pixels.shape[-1]),
           "window_index": np.concatenate(windows).astype(np.int32),
           **{k: np.concatenate(arrays) for k, arrays in patch_arrays.items()},
           "full_segments": full_segments, "window_segments": window_segments,
           **attention_batches(full_segments, window_segments, int(width))}
    if any("token_features" in v for v, _ in parts):
        length = sum(len(v["token_features"]) if "token_features" in v else n for v, n in parts)
        mapped = np.concatenate(tokens)
        out["token_features"] = np.pad(mapped, (0, length - len(mapped)), constant_values=-1).astype(np.int32)
    return out


# vision inputs with one row per patch in the window-permuted order (learned position blends: Qwen3-VL only)
PATCH_ORDERED_KEYS = ("rotary_positions", "pos_indices", "pos_weights")


def _real_features(vision: Mapping[str, Any], n_tokens: int) -> int:
    """Merged features of a block's real images: one per image-pad token, or as many as its mapping names."""
    if "token_features" in vision:
        return int(np.asarray(vision["token_features"]).max(initial=-1)) + 1
    return n_tokens


def _block_token_features(vision: Mapping[str, np.ndarray], n_tokens: int) -> np.ndarray:
    """The feature (within the block) of each of the block's image-pad tokens."""
    if "token_features" in vision:
        return vision["token_features"][:n_tokens].astype(np.int64)
    return np.arange(n_tokens, dtype=np.int64)


def _process_row_start(mesh: Mesh, local_rows: int) -> int:
    """First global row of this process's rows; refuses layouts where they are not one contiguous block."""
    global_rows = local_rows * jax.process_count()
    indices = batch_sharding(mesh, 1).addressable_devices_indices_map((global_rows,)).values()
    starts = sorted({(s[0].start or 0, s[0].stop or global_rows) for s in indices})
    covered = sum(stop - start for start, stop in starts)
    if covered != local_rows or starts[-1][1] - starts[0][0] != local_rows:
        raise ValueError("place_vision: this process's rows are not one contiguous block of the global batch; "
                         "order the mesh devices by process along the data-parallel axes")
    return starts[0][0]


def _gather_vision(vision: Mapping[str, Any] | None, mesh: Mesh, input_ids: Any, attention_mask: Any,
                   image_token_id: int | None) -> dict[str, np.ndarray] | None:
    """All-gather every process's vision inputs on the host and merge them in global row order (None when no
    process has images). Every process must call this for every batch, with or without images."""
    from jax.experimental import multihost_utils

    ids = np.asarray(input_ids)
    mask = np.ones_like(ids) if attention_mask is None else np.asarray(attention_mask)
    n_real = int(((ids == image_token_id) & (mask > 0)).sum()) if image_token_id is not None else 0
    keys = ("pixel_values", "window_index", "rotary_positions", "full_segments", "window_segments", "token_features",
            "pos_indices", "pos_weights")

    def empty(key: str, dim: int) -> np.ndarray:
        """No rows of `key`: no images here, or a block that maps tokens in order (no token_features) or whose
        tower has no learned positions (no pos_*)."""
        shape = {"pixel_values": (0, dim), "rotary_positions": (0, 2), "pos_indices": (0, 4), "pos_weights": (0, 4)}
        dtype = np.float32 if key in ("pixel_values", "pos_weights") else np.int32
        return np.zeros(shape.get(key, (0,)), dtype)

    local = None
    if vision is not None:
        local = {k: np.asarray(vision[k]) if k in vision else empty(k, 0) for k in keys}
    sizes = [local[k].shape[0] for k in keys] if local else [0] * len(keys)
    dim = local["pixel_values"].shape[1] if local else -1
    width = np.shape(vision["window_tokens"])[1] if vision is not None else 0
    header = np.asarray([_process_row_start(mesh, ids.shape[0]), n_real, *sizes, width, dim], np.int64)
    headers = np.asarray(multihost_utils.process_allgather(header))
    if headers[:, -1].max() < 0:
        return None
    if image_token_id is None:
        raise ValueError("place_batch: several processes with images need image_token_id to merge their patches")
    dim = int(headers[:, -1].max())
    if local is None:
        local = {k: empty(k, dim) for k in keys}
    gathered = {}
    for i, k in enumerate(keys):
        longest = int(headers[:, 2 + i].max())
        padded = np.pad(local[k], [(0, longest - local[k].shape[0])] + [(0, 0)] * (local[k].ndim - 1))
        gathered[k] = np.asarray(multihost_utils.process_allgather(padded))
    with_images = headers[headers[:, 3] > 0]
    unit = int(with_images[0, 2] // with_images[0, 3])
    optional = ("token_features", "pos_indices", "pos_weights")  # dropped where a block has none
    parts = [({k: gathered[k][p][:headers[p, 2 + i]] for i, k in enumerate(keys)
               if k not in optional or headers[p, 2 + i] > 0}, int(headers[p, 1]))
             for p in np.argsort(headers[:, 0], kind="stable")]
    return merge_vision(parts, unit, int(headers[:, -2].max()))


# ---------------------------------------------------------------------------- jit with shardings

class MeshJit:
    """`jax.jit` with explicit in/out shardings computed from the arguments' layout (one jitted wrapper per
    tree structure and shapes, so batch dicts with different keys each get exact shardings), traced under the
    mesh and the logical axis rules.

    shardings(*args) -> (in_shardings, out_shardings)."""

    def __init__(self, fn: Callable[..., Any], mesh: Mesh, shardings: Callable[..., tuple[Any, Any]],
                 donate_argnums: tuple[int, ...] = (), rules=LOGICAL_RULES):
        self.fn, self.mesh, self.shardings, self.donate_argnums, self.rules = fn, mesh, shardings, donate_argnums, rules
        self._cache: dict[Any, Any] = {}

    def jitted(self, *args: Any) -> Any:
        leaves, treedef = jax.tree.flatten(args)
        key = (treedef, tuple(np.shape(x) for x in leaves))
        if key not in self._cache:
            in_shardings, out_shardings = self.shardings(*args)
            self._cache[key] = jax.jit(self.fn, in_shardings=in_shardings, out_shardings=out_shardings,
                                       donate_argnums=self.donate_argnums)
        return self._cache[key]

    def __call__(self, *args: Any) -> Any:
        with rules_context(self.mesh, self.rules):
            return self.jitted(*args)(*self._conform(args))

    def lower(self, *args: Any) -> Any:
        with rules_context(self.mesh, self.rules):
            return self.jitted(*args).lower(*self._conform(args))

    def _conform(self, args: tuple) -> tuple:
        """Move arguments whose placement differs from the declared in_shardings (jit refuses committed
        mismatches), e.g. a reference policy loaded without a mesh; matching arrays pass through untouched."""
        in_shardings, _ = self.shardings(*args)
        move = lambda x, s: x if getattr(x, "sharding", None) == s else jax.device_put(x, s)  # noqa: E731
        return jax.tree.map(lambda s, sub: jax.tree.map(lambda x: move(x, s), sub), in_shardings, args,
                            is_leaf=lambda s: isinstance(s, jax.sharding.Sharding))


def host_rows(x: jax.Array, mesh: Mesh, rows: int) -> jax.Array:
    """This process's first `rows` rows of a row-sharded global array (the inverse of `place_batch` for
    outputs handed back to host code that indexes them with its local rows)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        x = multihost_utils.global_array_to_host_local_array(x, mesh, PartitionSpec(DATA_AXES))
    return x[:rows]
