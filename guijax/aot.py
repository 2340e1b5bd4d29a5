"""Ahead-of-time compilation of a recipe's real train step, for its target hardware, from any machine.

A parameter count says nothing about activations, attention scores or rematerialisation; only the compiler
knows what a step needs. This lowers and compiles the recipe's own train step, at the recipe's own shapes
(rows of a minibatch, each with `rollout.max_images` screenshots of `dry_run.screenshot_hw` and the length
bucket that holds them), with parameters, optimiser state and batch laid out on the recipe's mesh, and reads
the compiled program's `memory_analysis()` and `cost_analysis()`.

Targets: a TPU topology (`dry_run.topology`, e.g. "v5p:4x4x4"), compiled by the TPU compiler itself when
`libtpu` is installed (`pip install -e '.[tpu-compile]'`), remat included. GPU recipes are compiled by XLA:GPU
itself for compile-only H100s where JAX's CUDA plugin is installed (`pip install -e '.[gpu-compile]'`, no GPU
needed; `guijax.gpu_target`); elsewhere, or with `dry_run.compiler='tpu_proxy'`, for one TPU v5p chip per GPU
as a proxy, and the report says so; the proxy's compiler is given the GPU's memory as its budget, since it
spends whatever memory it is told it has. Without either the fallback is this machine's CPU devices, whose
figures are upper bounds: XLA:CPU's memory analysis does not account for rematerialisation.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import math
import re
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from jax.sharding import Mesh

from guijax import gpu_target, sharding

# UI-TARS-1.5's preprocessor keeps screenshots up to 16384 merged 28x28 patches: a 1920x1080 screen is
# encoded at 1932x1092 (10,764 patches, 2,691 image tokens) instead of being downscaled.
UITARS_MAX_PIXELS = 16384 * 28 * 28
TEXT_TOKENS_PER_SCREENSHOT = 64  # the turn's thought/action history and chat markup around each image
# Per-chip memory of the targets the recipes name (bytes): what a compiled step must fit in.
CAPACITY = {"v5p": 95 * 1024 ** 3, "v5e": 16 * 1024 ** 3, "v4": 32 * 1024 ** 3, "v6e": 32 * 1024 ** 3,
            "h100": 80 * 1000 ** 3}


# Measured: `grpo_gpu`'s unrolled step compiled for one v5p chip peaks at 73.23 GiB; run on an H200 with XLA:GPU
# (benchmarks/recipe_step.py) the device held 84.43 GiB. GPU recipes' proxy figures are scaled by the ratio.
GPU_PROXY_FACTOR = 1.153
# With the layers under scan the two compilers agree: the same step compiles to 68.68 GiB for the proxy and
# 68.69 GiB by XLA:GPU for an H100 (whose figures were within 1.15 GiB of what cards held for three steps); no
# card has run a scanned 7B step, so this ratio is XLA:GPU's, not a card's, and it was found on grpo_gpu's train
# step alone (the sampler's program and other scanned recipes take it untested).
GPU_PROXY_FACTOR_SCANNED = 1.0
# A program the TPU compiler refuses under a budget is compiled again under this much more (then with the chip's
# own memory): the compiler is not monotone in its budget, and a roomier compile may still peak under the first.
BUDGET_RETRY_GROWTH = 1.25
# v5p topologies standing in for a GPU recipe's devices (one chip per GPU, as many chips as GPUs)
GPU_PROXY_TOPOLOGIES = {1: "v5p:1x1x1", 2: "v5p:1x2x1", 4: "v5p:2x2x1", 8: "v5p:2x2x2"}
# the GPU the GPU recipes are compiled for by XLA:GPU (guijax.gpu_target); CAPACITY holds its memory
GPU_TARGET = "h100"


@dataclasses.dataclass(frozen=True)
class BatchShape:
    rows: int
    tokens_per_row: int
    screenshots_per_row: int
    screenshot_hw: tuple[int, int]
    patch_grid: tuple[int, int]  # patches per screenshot along height and width, after the processor's resize
    response_width: int = 0  # `response_positions` columns (the pipeline's bucketed response budget); 0: none

    def as_dict(self) -> dict[str, Any]:
        return {"rows": self.rows, "tokens_per_row": self.tokens_per_row,
                "screenshots_per_row": self.screenshots_per_row, "screenshot_hw": list(self.screenshot_hw),
                "patches_per_screenshot": self.patch_grid[0] * self.patch_grid[1]}


def step_tokens_per_screenshot(patch_grid: tuple[int, int], vision_cfg: Any) -> int:
    """Tokens one screenshot of `patch_grid` patches takes in a step: its merged image tokens and the text the
    dry run counts around each (`TEXT_TOKENS_PER_SCREENSHOT`)."""
    return patch_grid[0] * patch_grid[1] // vision_cfg.spatial_merge_size ** 2 + TEXT_TOKENS_PER_SCREENSHOT


def batch_shape(config: ml_collections.ConfigDict, model_cfg: Any) -> BatchShape:
    """The recipe's real step shape: `train.minibatch_size` rows, each holding `rollout.max_images`
    screenshots, their text and a full response, padded to the smallest length bucket that holds them."""
    from guijax.models.processor import smart_resize
    from guijax.sampling import bucket_for

    v = model_cfg.vision
    h, w = (int(x) for x in config.dry_run.screenshot_hw)
    rh, rw = smart_resize(h, w, factor=v.patch_size * v.spatial_merge_size,
                          max_pixels=config.model.image_max_pixels or UITARS_MAX_PIXELS)
    grid = (rh // v.patch_size, rw // v.patch_size)
    k = config.rollout.max_images
    tokens = k * step_tokens_per_screenshot(grid, v) + config.rollout.max_new_tokens
    length = bucket_for(tokens, tuple(config.pipeline.length_buckets))
    bucket = config.pipeline.get("response_bucket", 64)
    width = min(-(-config.rollout.max_new_tokens // bucket) * bucket, length) if bucket else 0
    return BatchShape(config.train.minibatch_size, length, k, (h, w), grid, width)


@dataclasses.dataclass(frozen=True)
class PackedShape:
    """A packed minibatch (guijax.data.packing): `rows` of `length` tokens in `blocks` per-device blocks, the
    steps' loss positions `response` wide."""

    rows: int
    length: int
    blocks: int
    response: int

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


def packed_shape(config: ml_collections.ConfigDict, shape: BatchShape, blocks: int) -> PackedShape | None:
    """The recipe's packed shape under `pipeline.pack` (None without it): its fixed `pack_rows` /
    `pack_length` / `max_response_tokens`, or where they are left to the batch, the padded step's rows, row
    length and response width (a batch of the longest steps packs one to a row)."""
    pipe = config.pipeline
    if not pipe.get("pack", False):
        return None
    bucket = pipe.get("response_bucket", 64) or 64
    response = (pipe.get("max_response_tokens", 0) or shape.response_width
                or -(-config.rollout.max_new_tokens // bucket) * bucket)
    return PackedShape(pipe.get("pack_rows", 0) or shape.rows, pipe.get("pack_length", 0) or shape.tokens_per_row,
                       blocks, response)


def host_batch(shape: BatchShape, model_cfg: Any, vision_blocks: int = 1,
               packed: PackedShape | None = None, image_bucket: Callable[[int, int], int] | None = None,
               vision_images: int = 0) -> dict[str, Any]:
    """A batch with the pipeline's keys and shapes. The vision layout's index arrays are computed for real on
    the host (cheap, and their shapes follow the image grids); every other input stays abstract. Every
    screenshot is distinct (no deduplication: the largest vision batch a step can meet). With
    `vision_blocks` > 1 the vision inputs are per-device blocks of rows / vision_blocks rows each. `packed`:
    the packed model inputs and response-space training arrays instead of padded rows. `image_bucket`: the
    screenshots each layout is padded to (with blank ones, as the sampler pads), from their count and rows.
    `vision_images` > 0: each layout holds that many (`pipeline.vision_images`, the pipeline's one vision
    shape), or the pipeline's doubling of it that holds the most screenshots a layout can meet: every row's
    distinct ones, or in packed rows as many as their tokens can show."""
    from guijax.data.packing import doubled
    from guijax.models.positions import vision_layout
    from guijax.models.vision_blocks import stack_blocks

    b, s = shape.rows, shape.tokens_per_row
    if b % vision_blocks:
        raise ValueError(f"{b} rows per step cannot be split into {vision_blocks} per-device vision blocks")
    per_block = b // vision_blocks * shape.screenshots_per_row
    per_block = image_bucket(per_block, b // vision_blocks) if image_bucket else per_block
    if vision_images:
        if packed is not None:  # a packed row shows at most as many screenshots as its tokens can hold
            per_block = min(per_block, packed.rows // vision_blocks * (
                packed.length // step_tokens_per_screenshot(shape.patch_grid, model_cfg.vision)))
        per_block = doubled(vision_images, per_block)
    grids = np.tile(np.asarray([[1, *shape.patch_grid]], np.int64), (per_block, 1))
    layout = vision_layout(grids, model_cfg.vision)
    pixels = (layout.num_patches, model_cfg.vision.patch_dim)
    if vision_blocks == 1:
        vision = layout.inputs(jax.ShapeDtypeStruct(pixels, jnp.float32))
    else:
        vision = stack_blocks([layout.inputs(np.zeros((pixels[0], 0), np.float32))] * vision_blocks)
        vision["pixel_values"] = jax.ShapeDtypeStruct((vision_blocks, *pixels), jnp.float32)
    f32 = lambda *dims: jax.ShapeDtypeStruct(dims, jnp.float32)  # noqa: E731
    i32 = lambda *dims: jax.ShapeDtypeStruct(dims, jnp.int32)  # noqa: E731
    flags = {"off_policy": jax.ShapeDtypeStruct((b,), jnp.bool_), "expert": f32(b),
             "failure": jax.ShapeDtypeStruct((b,), jnp.bool_)}
    if packed is not None:
        if b % packed.blocks or packed.rows % packed.blocks:
            raise ValueError(f"{b} steps and {packed.rows} packed rows cannot be split into {packed.blocks} blocks")
        p, n, r = packed.rows, packed.length, packed.response
        return {"input_ids": i32(p, n), "attention_mask": i32(p, n), "positions": i32(3, p, n), "vision": vision,
                "targets": i32(b, r), "loss_mask": f32(b, r), "advantages": f32(b, r), "old_logp": f32(b, r),
                "token_index": i32(packed.blocks, b // packed.blocks, r), **flags}
    return {"input_ids": i32(b, s), "attention_mask": i32(b, s), "positions": i32(3, b, s), "vision": vision,
            "targets": i32(b, s), "loss_mask": f32(b, s), "advantages": f32(b, s), "old_logp": f32(b, s), **flags,
            **({"response_positions": i32(b, shape.response_width)} if shape.response_width else {})}


@dataclasses.dataclass(frozen=True)
class Target:
    """Where the step is compiled: the devices of a mesh, what they are, and whether the figures are the
    target compiler's own (`exact`) or an upper bound."""

    name: str
    devices: list[Any]
    capacity_bytes: int | None
    exact: bool
    note: str
    # the target's peak over this compile's, where a proxy is known to under-count (1: taken as is)
    proxy_factor: float = 1.0
    # the platform attention is traced for (its "auto" backend: splash on a TPU); None: this machine's
    attention_platform: str | None = None
    # the memory per chip the TPU compiler is told to schedule and rematerialise against; None: its chip's own
    memory_budget_bytes: int | None = None
    # the compiling chip's own memory (a budget's retries stop there); None: unknown
    chip_memory_bytes: int | None = None

    def compiler_options(self, reserved: int = 0) -> dict[str, Any] | None:
        """The options each program is compiled with: the budget, less `reserved` bytes that the program does
        not hold as arguments but that stay on the device (frozen parameters beside the micro-step). None (the
        chip's own memory) without a budget, or when the reserve leaves less than 1 MiB of it."""
        if self.memory_budget_bytes is None or self.memory_budget_bytes - reserved < 2 ** 20:
            return None
        return compiler_memory_budget(self.memory_budget_bytes - reserved)

    def retry_options(self, options: dict[str, Any]) -> list[dict[str, Any] | None]:
        """The budgets a program refused under `options` is compiled again with: 1.25 times as much while that is
        under the chip's memory, then the chip's own (None)."""
        grown = int(options["xla_tpu_max_hbm_size_mib"] * BUDGET_RETRY_GROWTH) * 2 ** 20
        under_chip = self.chip_memory_bytes is None or grown < self.chip_memory_bytes
        return ([compiler_memory_budget(grown)] if under_chip else []) + [None]

    def tracing(self) -> contextlib.AbstractContextManager:
        """The context to lower the step in, so its kernels are the target's own, not this machine's."""
        from guijax.models import attention

        if self.attention_platform is None:
            return contextlib.nullcontext()
        return attention.compiling_for(self.attention_platform)

    def fits(self, peak_bytes: int) -> bool | None:
        if self.capacity_bytes is None:
            return None
        return bool(peak_bytes * self.proxy_factor <= self.capacity_bytes)


def traceable(config: ml_collections.ConfigDict, target: Target) -> ml_collections.ConfigDict:
    """The recipe as the dry run traces it for `target`: a kernel it names (`model.attention`) that the target
    cannot trace (cuDNN on the v5p proxy or XLA:CPU, splash off a TPU) is traced as the blockwise path, as `auto`
    is there; cuDNN's packed layout for a GPU target, which JAX traces only with a Hopper GPU as the default
    device, is traced as `auto` without it (cuDNN with lengths, else the blockwise path); the report's
    `attention_traced` says which."""
    from guijax.models import cudnn_packed
    from guijax.models.attention import KERNEL_PLATFORMS

    named = traced = config.model.attention
    platform = target.attention_platform or jax.default_backend()
    if KERNEL_PLATFORMS.get(named, platform) != platform:
        traced = "xla"
    elif named == "cudnn_packed" and cudnn_packed.unavailable():
        traced = "auto"
    if traced == named:
        return config
    config = ml_collections.ConfigDict(config.to_dict())
    config.model.attention = traced
    return config


def compiler_memory_budget(budget_bytes: float) -> dict[str, Any]:
    """The TPU compiler's option for the memory per chip it schedules and rematerialises against, in whole MiB
    (rounded down, at least 1). Left at the chip's own HBM, the compiler keeps rematerialised activations of
    many layers alive whenever they fit there, so a step meant for a smaller device (a GPU it stands in for)
    looks bigger than it need be."""
    return {"xla_tpu_max_hbm_size_mib": max(1, int(budget_bytes // 2 ** 20))}


def _budget_bytes(gib: float) -> int | None:
    """`dry_run.compiler_memory_gib` in the bytes the compiler is handed (whole MiB); None for 0, the target's
    own budget."""
    if not gib:
        return None
    mib = int(gib * 2 ** 10)
    if mib < 1:
        raise ValueError(f"dry_run.compiler_memory_gib={gib} is under 1 MiB, the compiler's unit; 0 leaves the "
                         "target's own budget")
    return mib * 2 ** 20


def has_libtpu() -> bool:
    return importlib.util.find_spec("libtpu") is not None


def compile_target(config: ml_collections.ConfigDict, num_devices: int) -> Target:
    """The recipe's compile target: its TPU topology; for a GPU recipe XLA:GPU itself where JAX's CUDA plugin
    is installed, else one v5p chip standing in for each GPU; or this CPU."""
    accelerator = config.get("accelerator", "")
    topology = config.dry_run.topology
    compiler = config.dry_run.get("compiler", "target")
    if (not topology and accelerator == "gpu" and compiler == "target" and num_devices <= gpu_target.GPUS_PER_HOST
            and gpu_target.plugin_installed()):
        if config.dry_run.compiler_memory_gib:
            raise ValueError("dry_run.compiler_memory_gib is the TPU compiler's budget, and this dry run compiles "
                             "with XLA:GPU (JAX's CUDA plugin is installed); leave it at 0, or set "
                             "dry_run.compiler='tpu_proxy' to compile for the v5p proxy under that budget")
        devices = gpu_target.devices(GPU_TARGET, num_devices)
        gpus = "one H100" if num_devices == 1 else f"{num_devices} H100s"
        return Target(f"xla:gpu for {gpus} (compile-only devices)", devices, CAPACITY[GPU_TARGET], True,
                      "XLA:GPU's own figures, compiled for a described H100 without one (no autotuning); they "
                      "depend on the jax version, which should be the GPU machine's",
                      attention_platform="gpu")
    if not topology and accelerator == "gpu":
        if num_devices not in GPU_PROXY_TOPOLOGIES:
            raise ValueError(f"no v5p proxy for {num_devices} GPUs (mesh.num_devices); the proxies are for "
                             f"{sorted(GPU_PROXY_TOPOLOGIES)} GPUs, or set dry_run.topology")
        topology = GPU_PROXY_TOPOLOGIES[num_devices]
    on_cpu = compiler == "cpu"
    if topology and has_libtpu() and not on_cpu:
        from jax.experimental import topologies

        devices = list(topologies.get_topology_desc(topology, "tpu").devices)
        if len(devices) != num_devices:
            raise ValueError(f"dry_run.topology {topology} has {len(devices)} chips but the recipe's mesh needs "
                             f"{num_devices} (mesh.num_devices)")
        chip = topology.split(":")[0]
        own = _budget_bytes(config.dry_run.compiler_memory_gib)
        if accelerator == "gpu":
            gpus = "one H100" if len(devices) == 1 else f"{len(devices)} H100s"
            factor, measured = ((GPU_PROXY_FACTOR_SCANNED, "XLA:GPU's compile of grpo_gpu's scanned step agreed "
                                 "with the proxy's") if config.model.scan_layers else
                                (GPU_PROXY_FACTOR, "XLA:GPU held that much more than the proxy's figure for "
                                 "grpo_gpu's unrolled step"))
            budget = own or int(CAPACITY["h100"] / factor) // 2 ** 20 * 2 ** 20
            return Target(f"tpu {topology} (proxy for {gpus})", devices, CAPACITY["h100"], True,
                          "compiled for one TPU v5p chip per GPU as a proxy (XLA:GPU compiles here with JAX's "
                          "CUDA plugin installed, for one host of up to 8 GPUs, unless dry_run.compiler='tpu_proxy'), "
                          f"with the compiler's memory budget set to {budget // 2 ** 20} MiB, and checked "
                          f"against the H100's 80 GB after scaling by {factor} ({measured}, neither compiler "
                          "pressed for memory; that the ratio holds under a budget is assumed)", factor,
                          memory_budget_bytes=budget, chip_memory_bytes=CAPACITY["v5p"])
        return Target(f"tpu {topology}", devices, CAPACITY.get(chip), True, "the TPU compiler's own figures"
                      + (f", its memory budget set to {own // 2 ** 20} MiB" if own else ""),
                      attention_platform="tpu", memory_budget_bytes=own, chip_memory_bytes=CAPACITY.get(chip))
    cpus = jax.devices("cpu")
    if len(cpus) < num_devices:
        raise ValueError(f"the dry run needs {num_devices} devices: install libtpu (pip install -e '.[tpu-compile]') "
                         f"to compile for {topology or 'a TPU topology'}, or set "
                         f"XLA_FLAGS=--xla_force_host_platform_device_count={num_devices} for a CPU upper bound")
    why = ("dry_run.compiler='cpu'" if on_cpu else "libtpu is not installed" if topology
           else "the recipe names no TPU topology")
    if config.dry_run.compiler_memory_gib:
        raise ValueError(f"dry_run.compiler_memory_gib is the TPU compiler's budget, and this dry run compiles with "
                         f"XLA:CPU ({why}); leave it at 0")
    return Target("cpu", cpus[:num_devices], None, False,
                  f"CPU fallback ({why}): an upper bound, XLA:CPU's memory analysis ignores rematerialisation")


def _abstract(tree: Any, shardings: Any) -> Any:
    return jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), tree, shardings)


@dataclasses.dataclass(frozen=True)
class RecipeStep:
    """A recipe's train step on a mesh, as the trainer builds it: module (dtype, remat, scan, attention, LoRA),
    optimiser (moment dtype included), the method's loss and the state's shardings."""

    module: Any
    tx: Any
    mesh: Mesh
    shards: Any  # train_step.TrainState of NamedShardings
    step_cfg: Any
    step: Any  # train_step.make_train_step(...)


def recipe_step(config: ml_collections.ConfigDict, model_cfg: Any, mesh: Mesh) -> RecipeStep:
    """The recipe's own train step on `mesh` (the target's devices for the dry run, local ones to run it)."""
    from guijax import optim, train_step
    from guijax.methods import get_method
    from guijax.models import weights
    from guijax.models.lora import from_run_config
    from guijax.models.policy import resolve_dtype

    param_dtype = resolve_dtype(config.model.param_dtype or config.model.dtype)
    module = weights.build_module(model_cfg, dtype=resolve_dtype(config.model.dtype), param_dtype=param_dtype,
                                  remat_policy=config.model.remat, attention_impl=config.model.attention,
                                  scan_layers=config.model.scan_layers, lora=from_run_config(config),
                                  expert_capacity_factor=config.model.expert_capacity_factor,
                                  frozen=tuple(config.model.frozen), attention_block=config.model.attention_block)
    tx, _ = optim.make_optimizer(config.optim)
    t = config.train
    step_cfg = train_step.StepConfig(get_method(config.method, config).loss(), config.rollout.temperature,
                                     impl="chunked" if t.logprob_impl == "auto" else t.logprob_impl,
                                     router_aux_loss_coef=t.router_aux_loss_coef)
    return RecipeStep(module, tx, mesh, train_step.state_shardings(module, tx, mesh), step_cfg,
                      train_step.make_train_step(module, tx, step_cfg, mesh))


def abstract_state(built: RecipeStep) -> Any:
    """The train state of `built` as ShapeDtypeStructs carrying their shardings: what compiling needs, with
    nothing allocated."""
    import flax.linen as nn

    from guijax import train_step
    from guijax.models import weights
    from guijax.models.trained import TrainedPart

    params = nn.unbox(weights.abstract_params(built.module))
    opt = jax.eval_shape(built.tx.init, TrainedPart.of(built.module).trainable(params))
    return train_step.TrainState(_abstract(params, built.shards.params), _abstract(opt, built.shards.opt_state),
                                 jax.ShapeDtypeStruct((), jnp.int32, sharding=built.shards.step))


def needs_ref_logp(config: ml_collections.ConfigDict, loss: Any) -> bool:
    """Whether the recipe's batches carry the reference policy's log-probs: for the KL term, or for a loss that
    reads them itself (SEAgent's adversarial imitation)."""
    return bool(config.train.kl_coef) or bool(getattr(loss, "reads_ref_logp", False))


def compile_train_step(config: ml_collections.ConfigDict, model_cfg: Any) -> dict[str, Any]:
    """Lower and compile the recipe's train step for its target (and, with gradient accumulation, the micro-step
    that completes a short group); the report `--dry_run_json` writes. Its figures are the train step's; `fits`
    is whether both programs fit, `train_step_fits` the train step's alone."""
    mesh_cfg = sharding.MeshConfig.from_run_config(config)
    num_devices = config.mesh.num_devices or jax.device_count()
    target = compile_target(config, num_devices)
    named_attention = config.model.attention
    config = traceable(config, target)
    mesh = Mesh(np.asarray(target.devices).reshape(mesh_cfg.shape(num_devices)), sharding.MESH_AXES)
    built = recipe_step(config, model_cfg, mesh)
    shards, step_cfg, step = built.shards, built.step_cfg, built.step
    state = abstract_state(built)
    params = state.params
    shape = batch_shape(config, model_cfg)
    blocks = sharding.local_vision_blocks(config, mesh)
    packed = packed_shape(config, shape, sharding.local_data_blocks(mesh))
    batch = host_batch(shape, model_cfg, blocks, packed, vision_images=config.pipeline.get("vision_images", 0))
    if needs_ref_logp(config, step_cfg.loss):
        batch["ref_logp"] = batch["old_logp"]
    batch = _abstract(batch, sharding.batch_shardings(batch, mesh))
    start = time.perf_counter()
    report = {"compile_target": target.name, "exact": target.exact, "note": target.note, "jax": jax.__version__,
              "devices": num_devices,
              "mesh": dict(zip(sharding.MESH_AXES, mesh.devices.shape)), "batch": shape.as_dict(),
              "remat": config.model.remat, "scan_layers": bool(config.model.scan_layers),
              "attention": named_attention, "attention_traced": config.model.attention,
              "attention_traced_for": target.attention_platform or jax.default_backend(), "logprob_impl": step_cfg.impl,
              "vision_blocks": blocks, **({"packed": packed.as_dict()} if packed else {}),
              # screenshots per vision layout as compiled: the setting, or its doubling that holds a layout's most
              **({"vision_images": batch["vision"]["pixel_values"].shape[-2] // math.prod(shape.patch_grid)}
                 if config.pipeline.get("vision_images") else {}),
              "param_bytes_per_device": int(sharding.bytes_per_device(params, shards.params)),
              "opt_bytes_per_device": int(sharding.bytes_per_device(state.opt_state, shards.opt_state)),
              "capacity_bytes_per_device": target.capacity_bytes}
    lowered, compiled, compiler = _compile(target, lambda: step.lower_abstract(state, batch))
    report.update(compiler)
    if compiled is None:
        return {**report, "compile_s": time.perf_counter() - start}
    compile_s = time.perf_counter() - start
    figures = compiled_bytes(compiled)
    peak = figures["peak_bytes_per_device"]
    fits = step_fits = target.fits(peak)
    extra = {}
    if int(config.optim.grad_accum_steps) > 1:
        extra["empty_microstep"] = compile_empty_microstep(built, state, target)
        if extra["empty_microstep"]["fits"] is False:
            fits = False
    return {
        **report, "compiled": True, "compile_s": compile_s, **figures,
        "tpu_kernel_sites": tpu_kernel_sites(lowered),
        "activation_bytes_per_device": figures["temp_bytes_per_device"],
        "fits": fits, "train_step_fits": step_fits, "proxy_factor": target.proxy_factor,
        "flops_per_device": compiled_flops(compiled), **extra,
    }


def compile_empty_microstep(built: RecipeStep, state: Any, target: Target) -> dict[str, Any]:
    """Compile the zero-gradient micro-step that completes a short accumulation group
    (`train_step.make_empty_microstep`) for the abstract `state`: the step the trainer runs at the end of every
    epoch whose minibatches are not a multiple of `optim.grad_accum_steps`, so it must fit as well. The frozen
    parameters (LoRA's base, a frozen tower) are not its arguments but stay on the device: they are added to
    its peak."""
    from guijax import train_step
    from guijax.models.trained import TrainedPart

    part = TrainedPart.of(built.module)
    frozen = sharding.bytes_per_device(part.partition(state.params)[1], part.partition(built.shards.params)[1])
    micro = train_step.make_empty_microstep(built.module, built.tx, built.mesh)
    start = time.perf_counter()
    _, compiled, compiler = _compile(target, lambda: micro.lower(state), reserved=frozen)
    if compiled is None:
        return {**compiler, "compile_s": time.perf_counter() - start}
    figures = compiled_bytes(compiled)
    figures["peak_bytes_per_device"] += frozen
    return {"compiled": True, "compile_s": time.perf_counter() - start, **compiler, **figures,
            "frozen_param_bytes_per_device": frozen, "fits": target.fits(figures["peak_bytes_per_device"])}


def _compile(target: Target, lower: Callable[[], Any], reserved: int = 0
             ) -> tuple[Any, Any, dict[str, Any]]:
    """(lowered, compiled, report entries): `lower()` traced for the target's kernels, then compiled under the
    target's memory budget, less `reserved`. The TPU compiler refuses a program it cannot fit in its budget,
    and its figure then is where it gave up, not the least the program needs: it is not monotone in its budget
    (the small preset's FSDP-8 step was refused under 307 MiB and peaked at 260 MiB under 409). So a refusal
    for HBM under a budget is compiled again under the target's retry budgets; the entries keep the first
    refusal (`refused_under_budget`) and the budget that compiled (`compiled_under_budget_bytes`, None: the
    chip's own), whose figures the caller checks against the capacity. The last refusal is the answer:
    (None, None, not compiled, not fitting, the error line and the figures it names)."""
    with target.tracing():
        lowered = lower()
    options = target.compiler_options(reserved)
    entries: dict[str, Any] = {"compiler_budget_bytes": _budget_of(options)} if options else {}
    ladder = [options] + (target.retry_options(options) if options else [])
    refusal: dict[str, Any] = {}
    for tried in ladder:
        try:
            compiled = lowered.compile(compiler_options=tried)
        except jax.errors.JaxRuntimeError as err:
            if "RESOURCE_EXHAUSTED" not in str(err):
                raise
            refusal = _refusal(err)
            if tried is options and options:
                entries["refused_under_budget"] = {k: v for k, v in refusal.items() if k not in ("compiled", "fits")}
            if "hbm" not in str(err).lower():  # refused for something a larger budget does not give
                break
            continue
        if "refused_under_budget" in entries:
            entries["compiled_under_budget_bytes"] = _budget_of(tried) if tried else None
        return lowered, compiled, entries
    return None, None, {**entries, **refusal}


def _budget_of(options: dict[str, Any]) -> int:
    return options["xla_tpu_max_hbm_size_mib"] * 2 ** 20


def _refusal(err: Exception) -> dict[str, Any]:
    return {"compiled": False, "fits": False, "error": str(err).splitlines()[0], **_compiler_oom_figures(str(err))}


def tpu_kernel_sites(lowered: Any) -> int:
    """Pallas (Mosaic) kernel call sites in the program handed to the compiler, splash attention's included:
    the evidence that a kernel, not its fallback, is what the figures describe. A site inside a function that
    several layers call counts once, so this is not the number of calls. Kernel FLOPs are not in
    `compiled_flops`."""
    return lowered.as_text().count("@tpu_custom_call")


def compiled_flops(compiled: Any) -> float | None:
    """FLOPs per device the compiler counts for a compiled program (rematerialised work included)."""
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float(cost.get("flops", math.nan)) if cost else None


def compiled_bytes(compiled: Any) -> dict[str, int]:
    """Per-device bytes of a compiled program from its `memory_analysis()`: the peak (arguments, outputs and
    temporaries, donated inputs counted once), temporaries and arguments."""
    mem = compiled.memory_analysis()
    peak = mem.temp_size_in_bytes + mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
    return {"peak_bytes_per_device": int(peak), "temp_bytes_per_device": int(mem.temp_size_in_bytes),
            "argument_bytes_per_device": int(mem.argument_size_in_bytes)}


def _compiler_oom_figures(message: str) -> dict[str, int]:
    """The byte counts in XLA:TPU's out-of-memory refusal ('... required for HLO temporaries (142.96G) exceeds
    available HBM (95.73G)', or '... Used 361.54M of 307.00M hbm'), as numbers for the report. Despite the
    first form's wording, its first figure is the whole footprint, arguments included: a program of 256 MiB of
    arguments and 272 MiB of temporaries is refused with 528 MiB named."""
    found = (re.search(r"temporaries \(([\d.]+)([KMGT]?)\).*?available HBM \(([\d.]+)([KMGT]?)\)", message, re.S)
             or re.search(r"Used ([\d.]+)([KMGT]?) of ([\d.]+)([KMGT]?) hbm", message, re.S))
    if not found:
        return {}
    scale = {"": 1, "K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30, "T": 2 ** 40}
    return {"required_bytes_per_device": int(float(found.group(1)) * scale[found.group(2)]),
            "compiler_available_bytes": int(float(found.group(3)) * scale[found.group(4)])}


def _target_mesh(config: ml_collections.ConfigDict) -> tuple[Target, Mesh, int]:
    mesh_cfg = sharding.MeshConfig.from_run_config(config)
    num_devices = config.mesh.num_devices or jax.device_count()
    target = compile_target(config, num_devices)
    return target, Mesh(np.asarray(target.devices).reshape(mesh_cfg.shape(num_devices)), sharding.MESH_AXES), num_devices


def prompt_tokens(config: ml_collections.ConfigDict, model_cfg: Any) -> int:
    """The prompt bucket of a rollout step: `rollout.max_images` screenshots and their text, no response."""
    from guijax.sampling import bucket_for

    shape = batch_shape(config, model_cfg)
    used = shape.screenshots_per_row * step_tokens_per_screenshot(shape.patch_grid, model_cfg.vision)
    return bucket_for(used, tuple(config.pipeline.length_buckets))


def compile_sampler(config: ml_collections.ConfigDict, model_cfg: Any, rows: int,
                    target_mesh: tuple[Target, Mesh, int] | None = None) -> dict[str, Any]:
    """Compile the sampler's generation program (prefill with every screenshot, then the decode loop) for
    `rows` prompts at the recipe's shapes; its peak bytes per device, or the compiler's refusal."""
    import flax.linen as nn

    from guijax.models import weights
    from guijax.models.policy import resolve_dtype
    from guijax.sampling import Sampler, SamplingConfig, images_padded_with_rows, image_bucket

    target, mesh, _ = target_mesh or _target_mesh(config)
    config = traceable(config, target)
    param_dtype = resolve_dtype(config.model.param_dtype or config.model.dtype)
    module = weights.build_module(model_cfg, dtype=resolve_dtype(config.model.dtype), param_dtype=param_dtype,
                                  attention_impl=config.model.attention, scan_layers=config.model.scan_layers,
                                  expert_capacity_factor=config.model.expert_capacity_factor,
                                  attention_block=config.model.attention_block)
    split = rows % sharding.data_parallel_size(mesh) == 0
    blocks = sharding.data_parallel_size(mesh) if split and config.pipeline.get("vision_per_device", False) else 1
    sampler = Sampler(module, SamplingConfig(max_new_tokens=config.rollout.max_new_tokens,
                                             prompt_buckets=tuple(config.pipeline.length_buckets),
                                             patch_bucket=config.pipeline.patch_bucket, vision_blocks=blocks,
                                             pad_images_with_rows=images_padded_with_rows(config),
                                             prefill_rows=config.rollout.get("prefill_rows", 0)), mesh=mesh)
    boxed = weights.abstract_params(module)
    params = _abstract(nn.unbox(boxed), sharding.param_shardings(boxed, mesh))
    shape = batch_shape(config, model_cfg)
    length = prompt_tokens(config, model_cfg)
    # the screenshots as the sampler lays them out: one layout, or per-device blocks of rows / blocks rows each;
    # with prefill in chunks, one such layout per chunk (the dry run's screenshots are all alike)
    bucket = image_bucket if sampler.config.pad_images_with_rows else None
    chunks = sampler.prefill_passes(rows)
    vision = host_batch(dataclasses.replace(shape, rows=rows // chunks), model_cfg, blocks,
                        image_bucket=bucket)["vision"]
    if chunks > 1:
        vision = jax.tree.map(lambda v: jax.ShapeDtypeStruct((chunks, *np.shape(v)), v.dtype), vision)
    i32 = lambda *dims: jax.ShapeDtypeStruct(dims, jnp.int32)  # noqa: E731
    args = (params, i32(rows, length), i32(rows, length), i32(3, rows, length), i32(rows), vision,
            jax.eval_shape(lambda: jax.random.PRNGKey(0)))
    program = sampler.program(rows)
    in_shardings, _ = program.shardings(*args)
    args = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), args, in_shardings,
                        is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))
    start = time.perf_counter()
    out = {"rows": rows, "prompt_tokens": length, "new_tokens": config.rollout.max_new_tokens, "vision_blocks": blocks,
           "prefill_chunks": chunks,
           "kv_cache_bytes_per_row": 2 * model_cfg.num_hidden_layers * (length + config.rollout.max_new_tokens)
           * model_cfg.num_key_value_heads * model_cfg.head_dim * jnp.dtype(sampler.cache_dtype).itemsize}
    _, compiled, compiler = _compile(target, lambda: program.lower(*args))
    if compiled is None:
        return {**out, **compiler, "compile_s": time.perf_counter() - start}
    figures = compiled_bytes(compiled)
    return {**out, "compiled": True, "compile_s": time.perf_counter() - start, **compiler,
            "peak_bytes_per_device": figures["peak_bytes_per_device"],
            "temp_bytes_per_device": figures["temp_bytes_per_device"],
            "fits": target.fits(figures["peak_bytes_per_device"])}


def plan_sampler_rows(config: ml_collections.ConfigDict, model_cfg: Any) -> dict[str, Any]:
    """The most prompts one sampler program holds beside the parameters on the target: compiled at one and
    two rows per data-parallel device, the difference is what a row costs (KV cache and activations); the
    estimate, rounded down to a power of two (the sampler pads batches to one), is compiled to confirm, and
    halved while it does not fit. When the second row costs nothing the compiler shows, the estimate is the
    prompts one sampler call holds. With `rollout.prefill_rows` a row past those costs less (its prefill
    activations are a chunk's), so from there the rows double while the compiled program fits, up to the
    prompts one call holds."""
    target_mesh = _target_mesh(config)
    target, mesh, _ = target_mesh
    ways = sharding.data_parallel_size(mesh)
    one = compile_sampler(config, model_cfg, ways, target_mesh)
    plan = {"at_one_row_per_device": one}
    if target.capacity_bytes is None:
        return {**plan, "rows": None if one["compiled"] else 0}
    if not one["fits"]:
        return {**plan, "rows": 0}
    two = compile_sampler(config, model_cfg, 2 * ways, target_mesh)
    plan["at_two_rows_per_device"] = two
    # two rows that do not fit, or that fitted only a roomier compile (whose peak is not comparable with the
    # first's): one row per device is the plan
    if not two["fits"] or "refused_under_budget" in two:
        return {**plan, "rows": ways, "checked": one}
    from guijax.pipeline.run import env_workers

    # the prompts one sampler call holds: an iteration's episodes, in rounds of the environment pool's workers
    prompts = min(config.rollout.group_size * config.rollout.tasks_per_iteration, env_workers(config.env))
    most = ways * (1 << max(0, -(-prompts // ways) - 1).bit_length())
    plan["rows_cap"] = most
    per_row = two["peak_bytes_per_device"] - one["peak_bytes_per_device"]
    plan["bytes_per_row_per_device"] = int(per_row)
    if per_row > 0:
        rows_per_device = max(1, 1 + (target.capacity_bytes / target.proxy_factor - one["peak_bytes_per_device"])
                              // per_row)
        rows = ways * (1 << (int(rows_per_device).bit_length() - 1))
    else:  # the second row cost nothing the compiler shows (it rematerialised, or reused a buffer): no estimate
        rows = most
    checked = (compile_sampler(config, model_cfg, rows, target_mesh) if rows > 2 * ways
               else two if rows == 2 * ways else one)
    while rows > ways and (not checked["compiled"] or not checked["fits"]):
        rows //= 2
        checked = two if rows == 2 * ways else compile_sampler(config, model_cfg, rows, target_mesh)
    if config.rollout.get("prefill_rows", 0) and checked["compiled"] and checked["fits"]:
        # with the prefill in passes a row past them adds its KV cache alone, less than the one- and
        # two-row compiles counted: double while the program still fits, up to the cap
        while rows < most:
            trial = compile_sampler(config, model_cfg, rows * 2, target_mesh)
            if not (trial["compiled"] and trial["fits"]) or "refused_under_budget" in trial:
                break
            rows, checked = rows * 2, trial
            plan["grown_with_prefill_passes"] = True
    plan["checked"] = checked
    return {**plan, "rows": rows}
