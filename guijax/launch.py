"""Entry point: `python -m guijax.launch --config=NAME [--config.key=value ...] [--workdir=DIR] [--dry_run]`.

Resolves the recipe, writes it to the workdir, initialises multi-host JAX when launched on a pod or under
SLURM, and runs the recipe's stages in order. `--dry_run` builds the mesh and the model abstractly and
prints parameter count and bytes per device without allocating weights, so a TPU or GPU recipe can be
checked on a laptop.
"""
from __future__ import annotations

import math
import pathlib
import sys
import time
from typing import Any

import ml_collections
from absl import app, flags, logging

from envs.atomic import write_text_atomic
from guijax import config as config_lib
from guijax.progress import format_duration

FLAGS = flags.FLAGS
flags.DEFINE_string("config", "bepa_cpu", "recipe name in configs/ (or a path to a .py file with get_config()); "
                    "the default is the most complete CPU recipe")
flags.DEFINE_string("workdir", None, "run directory (default: runs/<config name>); an existing run is resumed")
flags.DEFINE_bool("dry_run", False, "build mesh and model abstractly, print sizes, and compile the recipe's real "
                  "train step at its real shapes for its target (see guijax/aot.py); allocate nothing")
flags.DEFINE_bool("dry_run_compile", True, "with --dry_run: also compile the train step (--nodry_run_compile: sizes only)")
flags.DEFINE_string("dry_run_json", None, "with --dry_run: write the report as JSON to this path")
flags.DEFINE_bool("dry_run_sampler", True, "with --dry_run: also compile the sampler and plan how many prompts one "
                  "sampler program holds (rollout.max_sampler_rows)")


def split_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    """Separate `--config.a.b=value` overrides (ours) from the flags absl parses."""
    rest, overrides = [], []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("--config."):
            body = arg[len("--config."):]
            if "=" not in body:
                if i + 1 >= len(argv):
                    raise config_lib.ConfigError(f"override {arg} has no value")
                body, i = f"{body}={argv[i + 1]}", i + 1
            overrides.append(body)
        else:
            rest.append(arg)
        i += 1
    return rest, overrides


def resolve(name: str, overrides: list[str]) -> ml_collections.ConfigDict:
    config = config_lib.load_config(name)
    config = config_lib.apply_overrides(config, overrides)
    config.lock()
    return config


def model_config_for(config: ml_collections.ConfigDict):
    """The architecture a recipe trains: the checkpoint's config.json when `model.path` exists, else the preset."""
    from guijax.models.config import ModelConfig, get_preset

    path = pathlib.Path(config.model.path) if config.model.path else None
    if path is not None and (path / "config.json").exists():
        return ModelConfig.from_json_file(path / "config.json")
    return get_preset(config.model.preset)


def dry_run(config: ml_collections.ConfigDict) -> dict[str, Any]:
    """Abstract model on an abstract mesh of the recipe's shape: sizes only, nothing allocated."""
    import jax
    import numpy as np
    from jax.sharding import AbstractMesh

    from guijax import sharding
    from guijax.models import weights
    from guijax.models.lora import from_run_config, split
    from guijax.models.policy import resolve_dtype
    from guijax.models.trained import TrainedPart

    cfg = model_config_for(config)
    mesh_cfg = sharding.MeshConfig.from_run_config(config)
    num_devices = config.mesh.num_devices or jax.device_count()
    shape = mesh_cfg.shape(num_devices)
    mesh = AbstractMesh(shape, sharding.MESH_AXES)
    param_dtype = resolve_dtype(config.model.param_dtype or config.model.dtype)
    lora = from_run_config(config) if "lora" in config else None
    part = TrainedPart(lora, tuple(config.model.get("frozen", ())))
    module = weights.build_module(cfg, dtype=resolve_dtype(config.model.dtype), param_dtype=param_dtype, lora=lora)
    boxed = weights.abstract_params(module)
    shardings = sharding.param_shardings(boxed, mesh)
    import flax.linen as nn

    leaves = nn.unbox(boxed)
    _, base = split(leaves)
    total = weights.count_params(base)
    vision = weights.count_params(base["visual"])
    shard_values = lambda tree, shards: sum(  # noqa: E731
        math.prod(s.shard_shape(x.shape)) for x, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shards)))
    # the frozen weights in param_dtype and, under LoRA, the float32 adapters beside them
    per_device = sum(math.prod(s.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize
                     for x, s in zip(jax.tree.leaves(leaves), jax.tree.leaves(shardings)))
    opt_bytes_per_value = np.dtype(resolve_dtype(config.optim.state_dtype)).itemsize if "optim" in config else 4
    # AdamW keeps two moments of each trained value: every parameter, or under LoRA the adapters alone, less
    # the groups model.frozen holds fixed
    trained_tree, trained_shards = part.trainable(leaves), part.trainable(shardings)
    trained = weights.count_params(trained_tree)
    per_device_opt = shard_values(trained_tree, trained_shards) * 2 * opt_bytes_per_value
    report = {
        "model": config.model.path or config.model.preset,
        "mesh": dict(zip(sharding.MESH_AXES, shape)),
        "params": total,
        "vision_params": vision,
        "language_params": total - vision,
        "param_dtype": np.dtype(param_dtype).name,
        "param_bytes_per_device": per_device,
        "adam_state_bytes_per_device": per_device_opt,
        "trained_params": trained,  # under LoRA the adapters (rank lora.rank), else every parameter; less model.frozen
    }
    return report


def print_compiled(r: dict[str, Any]) -> None:
    b = r["batch"]
    if not r["compiled"]:
        _print_refused(r, f"train step for {r['compile_target']}", "train step")
        return
    _print_budget_refusal(r, "train step")
    print(f"  train step compiled for {r['compile_target']} in {r['compile_s']:.0f}s ({r['note']})")
    size = f"{b['screenshot_hw'][1]}x{b['screenshot_hw'][0]} ({b['patches_per_screenshot']} patches each)"
    if "packed" in r:  # steps packed into rows, their screenshots in one vision layout per block
        p, images = r["packed"], r.get("vision_images")
        shown = (f"{images} screenshots of {size} per vision layout" if images else
                 f"up to {b['screenshots_per_row']} screenshots of {size} per step")
        print(f"  batch: up to {b['rows']} steps packed into {p['rows']} row(s) x {p['length']} tokens, {shown}"
              f", {p['response']} loss positions per step")
    else:
        print(f"  batch: {b['rows']} rows x {b['tokens_per_row']} tokens, {b['screenshots_per_row']} screenshots of "
              f"{size} per row")
    if r.get("vision_blocks", 1) > 1:
        print(f"  vision inputs in {r['vision_blocks']} per-device blocks")
    fits = {None: "no capacity known for this target", True: "fits", False: "does NOT fit"}[r.get("train_step_fits",
                                                                                                   r["fits"])]
    capacity = f" of {format_bytes(r['capacity_bytes_per_device'])}" if r["capacity_bytes_per_device"] else ""
    scaled = r.get("proxy_factor", 1.0)
    if scaled != 1.0:
        capacity = f" (x{scaled} for the real target: {format_bytes(int(r['peak_bytes_per_device'] * scaled))}){capacity}"
    print(f"  peak bytes per device: {format_bytes(r['peak_bytes_per_device'])}{capacity} ({fits}); "
          f"parameters {format_bytes(r['param_bytes_per_device'])}, optimizer {format_bytes(r['opt_bytes_per_device'])}, "
          f"temporaries {format_bytes(r['temp_bytes_per_device'])}")
    micro = r.get("empty_microstep")
    if micro is not None:
        k = "completing a short gradient-accumulation group (zero gradients, no forward pass)"
        if not micro["compiled"]:
            _print_refused(micro, f"micro-step {k}", "micro-step")
        else:
            fit = {None: "no capacity known", True: "fits", False: "does NOT fit"}[micro["fits"]]
            peak = micro["peak_bytes_per_device"]
            shown = format_bytes(peak) + (f" (x{scaled}: {format_bytes(int(peak * scaled))})" if scaled != 1.0 else "")
            print(f"  micro-step {k}: peak {shown} per device, frozen parameters included ({fit}), compiled in "
                  f"{micro['compile_s']:.0f}s")
            _print_budget_refusal(micro, "micro-step")
    sites = r.get("tpu_kernel_sites", 0)
    if r.get("flops_per_device"):
        print(f"  compiled FLOPs per device per step: {r['flops_per_device']:.3g}"
              + (" (not counting the Pallas kernels')" if sites else ""))
    if "attention_traced_for" in r:
        traced = r.get("attention_traced", r["attention"])
        as_what = f" (as {traced}: {r['attention']} cannot be traced for it)" if traced != r["attention"] else ""
        print(f"  attention: {r['attention']} traced for {r['attention_traced_for']}{as_what}"
              + (f"; Pallas TPU kernels at {sites} call sites of the program" if sites else ""))


def print_rollout_plan(plan: dict[str, Any], config: ml_collections.ConfigDict) -> None:
    one = plan["at_one_row_per_device"]
    where = f"{one['prompt_tokens']}-token prompts + {one['new_tokens']} new tokens"
    if not one["compiled"]:
        print(f"  sampler: one prompt per device ({where}) does NOT fit: {one['error']}")
        _print_budget_refusal(one, "sampler")
        return
    _print_budget_refusal(one, "sampler at one prompt per device")
    fit = {None: "", True: " (fits)", False: " (does NOT fit)"}[one.get("fits")]
    print(f"  sampler: one prompt per device ({where}): peak {format_bytes(one['peak_bytes_per_device'])}{fit}; "
          f"KV cache {format_bytes(one['kv_cache_bytes_per_row'])} per prompt")
    if plan["rows"]:
        now = config.rollout.max_sampler_rows or "all live episodes"
        passes = plan["checked"].get("prefill_chunks", 1)
        prefill = f", their prefill in {passes} passes (rollout.prefill_rows)" if passes > 1 else ""
        if plan["rows"] == plan.get("rows_cap"):
            prefill += " (as many as one sampler call can hold; more might fit)"
        print(f"  sampler: {plan['rows']} prompts per program fit{prefill} (checked: peak "
              f"{format_bytes(plan['checked']['peak_bytes_per_device'])}); rollout.max_sampler_rows is {now}")


def _print_refused(r: dict[str, Any], label: str, program: str) -> None:
    """A program the compiler refused: its error, the refusal's figures and the budget it was refused under."""
    print(f"  {label}: does NOT fit; the compiler refused it: {r['error']}")
    _print_refusal_figures(r)
    _print_budget_refusal(r, program)


def _print_budget_refusal(r: dict[str, Any], program: str) -> None:
    """A program refused under the compiler's budget: say so, and under what its figures (if any) were
    compiled, since they are then a roomier compile's."""
    refused = r.get("refused_under_budget")
    if not refused:
        return
    named = (f", naming {format_bytes(refused['required_bytes_per_device'])} in all"
             if "required_bytes_per_device" in refused else "")
    first = f"    the {program} was refused under the compiler's budget of {format_bytes(r['compiler_budget_bytes'])}{named}"
    if not r.get("compiled", True):
        print(f"{first}, and again with more memory, up to the chip's own")
        return
    under = r.get("compiled_under_budget_bytes")
    print(f"{first}; its figures are from a compile under "
          + (f"a budget of {format_bytes(under)}" if under else "the chip's own memory"))


def _print_refusal_figures(r: dict[str, Any]) -> None:
    """The refusal's figures in plain words: the compiler says "temporaries", but its figure counts the
    arguments too, and it is where the compiler gave up under its budget, not the least the program needs."""
    if "required_bytes_per_device" not in r:
        return
    hint = "" if "compiler_budget_bytes" in r else " (--config.dry_run.compiler_memory_gib sets a budget)"
    print(f"    the compiler named {format_bytes(r['required_bytes_per_device'])} per device in all (arguments "
          f"included) against {format_bytes(r['compiler_available_bytes'])} available{hint}")


def format_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.2f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return str(n)


def main(argv: list[str]) -> None:
    del argv
    if not _USER_VERBOSITY:
        logging.set_verbosity(logging.WARNING)  # orbax logs every write at INFO; progress is printed instead
    config = resolve(FLAGS.config, _OVERRIDES)
    from guijax import distributed

    distributed.maybe_initialize(config.distributed)
    from guijax.pipeline import registry

    try:  # the recipe as a whole: every value in range, stage and method names, each method's loss and reads
        registry.check_recipe(config)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    if FLAGS.dry_run:
        report = dry_run(config)
        print(f"dry run of {FLAGS.config}: model {report['model']} on mesh {report['mesh']}")
        print(f"  parameters: {report['params']:,} ({report['params'] / 1e9:.2f}B; vision {report['vision_params']:,}, "
              f"language {report['language_params']:,})")
        print(f"  parameter bytes per device ({report['param_dtype']}): {format_bytes(report['param_bytes_per_device'])}")
        if report["trained_params"] != report["params"]:
            what = [f"the LoRA adapters (rank {config.lora.rank})"] if config.lora.rank else []
            what += [f"{', '.join(config.model.frozen)} frozen"] if config.model.frozen else []
            print(f"  {report['trained_params']:,} trained parameters ({'; '.join(what)})")
        print(f"  AdamW state bytes per device: {format_bytes(report['adam_state_bytes_per_device'])}")
        if FLAGS.dry_run_compile:
            from guijax import aot

            compiled = aot.compile_train_step(config, model_config_for(config))
            print_compiled(compiled)
            report = {**report, **compiled}
            if FLAGS.dry_run_sampler:
                report["rollout"] = aot.plan_sampler_rows(config, model_config_for(config))
                print_rollout_plan(report["rollout"], config)
        if FLAGS.dry_run_json:
            import json

            pathlib.Path(FLAGS.dry_run_json).write_text(json.dumps(report, indent=1))
            print(f"  report written to {FLAGS.dry_run_json}")
        if report.get("fits") is False:
            sys.exit(1)  # the recipe's step does not fit its target: scripts and CI must see it
        return
    from guijax import preflight

    unmet = preflight.problems(config)
    if unmet:
        for line in unmet:
            print(f"error: {line}", file=sys.stderr)
        sys.exit(2)
    workdir = pathlib.Path(FLAGS.workdir or f"runs/{config.name}")
    workdir.mkdir(parents=True, exist_ok=True)
    import jax

    if jax.process_index() == 0:
        write_text_atomic(workdir / "config.json", config_lib.to_json(config))
    print(f"{config.name}: {len(config.stages)} stages ({', '.join(config.stages)}) in {workdir}", flush=True)
    start = time.time()
    registry.run_stages(config, workdir)
    print(f"{config.name}: all stages done in {format_duration(time.time() - start)}; outputs in {workdir}")


_OVERRIDES: list[str] = []
_USER_VERBOSITY = False


def run(argv: list[str] | None = None) -> None:
    argv = list(sys.argv if argv is None else argv)
    rest, overrides = split_overrides(argv)
    _OVERRIDES[:] = overrides
    global _USER_VERBOSITY
    _USER_VERBOSITY = any(a.startswith(("--verbosity", "--v=", "-v")) for a in rest[1:])
    try:
        app.run(main, argv=rest)
    except config_lib.ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    run()
