"""Benchmark: a recipe's real train step at its real shapes, run on this machine's devices.

Why: `--dry_run` compiles a recipe's step for its target and reads the compiler's figures; this runs the
same step, so its time and the memory the device really held are measured, not predicted. Everything is
the recipe's own: model architecture (`model.preset`, or `model.path`'s config.json), dtypes, remat, layer
scan, attention backend, LoRA, the optimiser with its moment dtype, the method's loss, the mesh (over the
first `mesh.num_devices` local devices, or all) and the step shape of `guijax.aot.batch_shape`:
`train.minibatch_size` rows of `rollout.max_images` screenshots of `dry_run.screenshot_hw` with their image
tokens, text, and a `rollout.max_new_tokens` response, padded to the length bucket that holds them, with
`response_positions` when the pipeline sends them. Parameters are random (normal, std 0.02; norms 1) and
created in their shards by a jitted init; pixels and tokens are random.

The step is compiled once ahead of time (its compile time and the compiled program's memory analysis for
this backend are reported), then run `--steps` times; the figure is the median of the calls after the
first. On a GPU the device's own peak bytes in use (`memory_stats`) after the steps is reported too.

Model FLOPs (the convention of `train_step.py`: matmuls only, forward + backward = 3 x forward,
attention over the full square, recomputation not counted): 6 x non-embedding parameters and the attention
term per token of every row, the LM head only at loss positions (the step computes it nowhere else), and
the vision tower per patch; a weight that does not train costs 4 per token instead of 6 when something
trained lies below it (LoRA's base, a frozen head) and 2 when nothing does (a frozen vision tower). The
compiler's own count (`cost_analysis`, recomputation included) is beside it.

  python benchmarks/recipe_step.py --config=grpo_gpu --steps=3
  python benchmarks/recipe_step.py --config=grpo_cpu --config.dry_run.screenshot_hw=112,112 --steps=2
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402
import train_step as step_bench  # noqa: E402  (benchmarks/train_step.py: the GUI batch and the FLOPs rules)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import flax.linen as nn  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

from guijax import aot, launch, sharding  # noqa: E402
from guijax import train_step as guijax_step  # noqa: E402
from guijax.data.pipeline import response_positions  # noqa: E402
from guijax.models import weights  # noqa: E402
from guijax.models.trained import TrainedPart  # noqa: E402
from guijax.models.vision_blocks import stack_blocks  # noqa: E402

GIB = 2 ** 30


def local_mesh(config) -> Mesh:
    """The recipe's mesh over the first `mesh.num_devices` local devices (all when 0)."""
    mesh_cfg = sharding.MeshConfig.from_run_config(config)
    n = config.mesh.num_devices or jax.device_count()
    if n > jax.device_count():
        raise SystemExit(f"the recipe's mesh needs {n} devices (mesh.num_devices) and this machine has "
                         f"{jax.device_count()}: set --config.mesh.num_devices")
    return Mesh(np.asarray(jax.devices()[:n]).reshape(mesh_cfg.shape(n)), sharding.MESH_AXES)


def random_params(module, shards: Any, seed: int = 0) -> Any:
    """Random parameters, each created in its shards. One small jitted program per distinct (shape, dtype,
    sharding, kind) makes the first leaf of its kind, and later leaves of that kind are device copies of it
    (layers of an unrolled model share values; timing does not care). Neither the model's own init nor one
    program with a random op per leaf is compiled: on XLA:GPU either costs minutes for a 7B model."""
    abstract = nn.unbox(weights.abstract_params(module))
    leaves, tree = jax.tree_util.tree_flatten_with_path(abstract)
    made: dict[tuple, jax.Array] = {}
    out = []
    for (path, leaf), sh in zip(leaves, jax.tree_util.tree_leaves(shards)):
        ones = "norm" in "/".join(str(getattr(k, "key", k)) for k in path).lower()
        kind = (leaf.shape, jnp.dtype(leaf.dtype).name, sh, ones)
        if kind in made:
            out.append(jnp.copy(made[kind]))  # its own buffer: the step donates every leaf
            continue

        def make(key, shape=leaf.shape, dtype=leaf.dtype, ones=ones):
            if ones:
                return jnp.ones(shape, dtype)
            return (0.02 * jax.random.normal(key, shape, jnp.float32)).astype(dtype)

        made[kind] = jax.jit(make, out_shardings=sh)(jax.random.fold_in(jax.random.PRNGKey(seed), len(made)))
        out.append(made[kind])
    return jax.tree_util.tree_unflatten(tree, out)


def say(message: str) -> None:
    print(f"[recipe_step] {message}", file=sys.stderr, flush=True)


def step_batch(config, model_cfg, shape: aot.BatchShape, blocks: int, seed: int = 0) -> tuple[dict, dict]:
    """A host batch of the step shape with every key the recipe's step reads (per-device vision blocks when
    the mesh asks for them) and facts about it."""
    if shape.rows % blocks:
        raise SystemExit(f"{shape.rows} rows per step (train.minibatch_size) cannot be split into the mesh's "
                         f"{blocks} per-device vision blocks")
    per_block = shape.rows // blocks
    parts = [step_bench.screenshot_batch(model_cfg, per_block, shape.screenshots_per_row, shape.screenshot_hw,
                                         config.rollout.max_new_tokens, shape.tokens_per_row, seed + i)
             for i in range(blocks)]
    batch = {k: np.concatenate([p[0][k] for p in parts], axis=1 if k == "positions" else 0)
             for k in parts[0][0] if k != "vision"}
    batch["vision"] = parts[0][0]["vision"] if blocks == 1 else stack_blocks([p[0]["vision"] for p in parts])
    b = shape.rows
    batch["off_policy"] = np.zeros((b,), bool)
    batch["expert"] = np.zeros((b,), np.float32)
    batch["failure"] = np.zeros((b,), bool)
    if config.train.kl_coef:
        batch["ref_logp"] = batch["old_logp"].copy()
    if shape.response_width:
        batch["response_positions"] = response_positions(batch["loss_mask"], budget=shape.response_width)
    return batch, parts[0][1]


def model_flops(model_cfg, params: Any, rows: int, seq: int, loss_tokens: int, gui: dict,
                part: TrainedPart | None = None) -> dict[str, float]:
    """Model FLOPs of one step. A weight that trains costs 6 FLOPs per token (forward, input gradient,
    weight gradient); a frozen one with something trained below it 4 (no weight gradient); a frozen part with
    nothing trained below it 2 (forward only). So under LoRA the base decoder and head count 4 and the
    adapters 6, and a frozen vision tower (frozen under LoRA too) counts its forward alone."""
    part = part or TrainedPart()
    counts = step_bench.param_counts(nn.unbox(params), model_cfg)
    adapters = counts["adapters"]
    per_token = step_bench.flops_per_token(model_cfg, counts["non_embedding"] - adapters, seq)
    base = 1.0 if part.lora is None else 4.0 / 6.0
    head_weight = "embed_tokens" if model_cfg.tie_word_embeddings else "lm_head"  # the matrix the head reads
    head_trained = part.lora is None and head_weight not in part.frozen
    text = rows * seq * (base * per_token["dense"] + 6.0 * adapters + per_token["attention"])
    head = loss_tokens * per_token["lm_head"] * (1.0 if head_trained else 4.0 / 6.0)
    images = rows * gui["screenshots"]
    vision = step_bench.vision_flops(model_cfg, counts["vision"], gui["patches"] // max(images, 1), images)
    vision_trained = part.lora is None and "visual" not in part.frozen
    vision *= 1.0 if vision_trained else 1.0 / 3.0
    return {"text": text, "lm_head": head, "vision": vision, "total": text + head + vision,
            "params": counts}


def run(config, steps: int, seed: int = 0) -> dict[str, Any]:
    model_cfg = launch.model_config_for(config)
    mesh = local_mesh(config)
    built = aot.recipe_step(config, model_cfg, mesh)
    shape = aot.batch_shape(config, model_cfg)
    blocks = sharding.local_vision_blocks(config, mesh)
    t0 = time.perf_counter()
    params = random_params(built.module, built.shards.params, seed)
    state = guijax_step.init_state(built.module, params, built.tx, mesh)
    jax.block_until_ready(state)
    init_s = time.perf_counter() - t0
    say(f"parameters and optimiser state made in {init_s:.1f}s")
    host, gui = step_batch(config, model_cfg, shape, blocks, seed)
    gui["screenshots"] = shape.screenshots_per_row
    gui["patches"] *= blocks
    loss_tokens = int(host["loss_mask"].sum())
    part = TrainedPart.of(built.module)
    flops = model_flops(model_cfg, params, shape.rows, shape.tokens_per_row, loss_tokens, gui, part)
    del params  # the state holds them; the step donates its state
    t0 = time.perf_counter()
    compiled = built.step.compile(state, host)
    compile_s = time.perf_counter() - t0
    memory = aot.compiled_bytes(compiled.compiled)
    say(f"compiled in {compile_s:.1f}s: {memory}")
    batch = built.step.place(host)
    holder = {"state": state, "metrics": None}

    def call():
        t = time.perf_counter()
        holder["state"], holder["metrics"] = compiled(holder["state"], batch)
        jax.block_until_ready(holder["metrics"])
        say(f"step {int(holder['state'].step)}: {time.perf_counter() - t:.3f}s, peak in use "
            f"{(jax.devices()[0].memory_stats() or {}).get('peak_bytes_in_use')}")
        return holder["metrics"]

    times = bc.time_calls(call, steps, warmup=0)
    metrics = {k: float(v) for k, v in jax.device_get(holder["metrics"]).items() if np.ndim(v) == 0}
    step_s = bc.median(times[1:] or times)
    device = jax.devices()[0]
    stats = device.memory_stats() or {}
    peak = bc.peak_flops()
    tokens = shape.rows * shape.tokens_per_row
    return {
        "config": config.name, "model": config.model.preset, "devices": int(mesh.devices.size),
        "mesh": dict(zip(sharding.MESH_AXES, mesh.devices.shape)), "device_kind": device.device_kind,
        "batch": shape.as_dict(), "response_width": shape.response_width, "loss_tokens": loss_tokens,
        "vision_blocks": blocks, "dtype": config.model.dtype, "param_dtype": config.model.param_dtype,
        "moment_dtype": config.optim.get("state_dtype", ""), "remat": config.model.remat,
        "scan_layers": bool(config.model.scan_layers), "attention": config.model.attention,
        "logprob_impl": built.step_cfg.impl, "params": flops.pop("params"), "trains": trains_label(part),
        "init_s": round(init_s, 3), "compile_s": round(compile_s, 3), "times_s": [round(x, 4) for x in times],
        "step_s": round(step_s, 4), "tokens_per_s": tokens / step_s,
        "model_flops": flops, "model_flops_per_s": flops["total"] / step_s,
        "mfu": flops["total"] / step_s / peak["flops_per_s"] / mesh.devices.size, "peak": peak,
        "compiled_flops_per_device": aot.compiled_flops(compiled.compiled),
        **memory,
        "device_peak_bytes_in_use": stats.get("peak_bytes_in_use"), "device_bytes_limit": stats.get("bytes_limit"),
        "last_metrics": metrics,
    }


def trains_label(part: TrainedPart) -> str:
    """What the step trains, in words: every parameter, LoRA adapters, and which groups are frozen."""
    what = "every parameter" if part.lora is None else f"LoRA r{part.lora.rank} adapters"
    return what + (f" but {', '.join(part.frozen)}" if part.frozen else "")


def markdown(r: dict[str, Any], machine: dict[str, Any], command: str) -> str:
    gib = lambda x: "n/a" if x is None else f"{x / GIB:.2f}"  # noqa: E731
    b = r["batch"]
    return "\n".join([
        f"Machine: {bc.machine_line(machine)}.", f"Command: `{command}`.", "",
        "| recipe | model | trains | rows x tokens | screenshots per row | dtype / moments | remat, scan | compile (s) | "
        "step (s) | tokens/s | MFU | compiled peak (GiB) | device peak in use (GiB) |",
        "|---|---|---|---:|---|---|---|---:|---:|---:|---:|---:|---:|",
        f"| {r['config']} | {r['model']} ({r['params']['total'] / 1e9:.2f}B) | {r.get('trains', 'every parameter')} | {b['rows']} x {b['tokens_per_row']} | "
        f"{b['screenshots_per_row']} x {b['screenshot_hw'][1]}x{b['screenshot_hw'][0]} | {r['dtype']} / "
        f"{r['moment_dtype'] or 'float32'} | {r['remat']}, {'scan' if r['scan_layers'] else 'unrolled'} | "
        f"{r['compile_s']:.1f} | {r['step_s']:.3f} | {r['tokens_per_s']:,.0f} | {100 * r['mfu']:.1f}% | "
        f"{gib(r['peak_bytes_per_device'])} | {gib(r['device_peak_bytes_in_use'])} |"])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    rest, overrides = launch.split_overrides(argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="recipe name in configs/ (or a .py path); add "
                                                   "--config.key=value overrides")
    p.add_argument("--steps", type=int, default=3, help="timed steps (the median excludes the first)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="default: results/recipe_step_CONFIG_BACKEND.json")
    p.add_argument("--markdown", default=None, help="default: results/recipe_step_CONFIG_BACKEND.md")
    a = p.parse_args(rest)
    config = launch.resolve(a.config, overrides)
    stem = f"recipe_step_{config.name}_{jax.default_backend()}"
    r = run(config, a.steps, a.seed)
    machine = bc.machine_info()
    command = bc.command_line("recipe_step.py", argv)
    table = markdown(r, machine, command)
    print(table)
    bc.write_outputs(a.json or str(bc.RESULTS / f"{stem}.json"), a.markdown or str(bc.RESULTS / f"{stem}.md"),
                     {"meta": {"machine": machine, "command": command}, "row": r}, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
