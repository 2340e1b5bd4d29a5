"""Benchmark: how often a recipe's RL iterations recompile, with padded minibatches against packed ones (of
one fixed shape, or of fixed-length rows as many as each minibatch needs), and what the packed ones gain
from a smaller attention tile (`model.attention_block`); and what the sampler's screenshot buckets save
(`packed_fixed` against `packed_fixed_exact_images`: the same episodes, so only the sampler's compilations differ).

Why: every distinct batch shape compiles the train step and the log-prob function again. Padded minibatches
take their shape from the batch (row count of the last minibatch, length bucket, patch bucket, the vision
tower's window and frame counts, response bucket), so on a short run the compiler, not the step, can take
most of the update time. Packed minibatches (`pipeline.pack` with `pack_rows`, `pack_length`,
`max_response_tokens` and `vision_images` fixed) have one shape for the whole run, sized for the fullest
minibatch, so the others fill it less; with `pack_rows` left free only the row count varies. Token-budget
minibatches (`packed_fill`: `pipeline.pack_fill`) keep the one shape and fill it from the whole update's steps,
so the number of minibatches follows the tokens.

Each mode runs the recipe's `base_model`, `tasks`, `sft` (the warm start, so groups succeed and fail and
the update has rows to train on) and `rl` stages in a subprocess of its own, with the
persistent compilation cache off (neither mode profits from the other's programs), and reads each
iteration's metrics: `compiles` and `time_compile_s` (XLA compilations the iteration paid for), the update's
time, the real-token share of the model's input rows (`token_fill`), the loss. Iteration 0 compiles the
sampler too, so the summary reports iterations 1 onward.

  python benchmarks/recompiles.py --iterations 6 --workdir /tmp/recompiles \\
      --json benchmarks/results/recompiles_cpu.json --markdown benchmarks/results/recompiles_cpu.md
  python benchmarks/recompiles.py --iterations 5 --modes packed_one_row,packed_fill --workdir /tmp/rcfill \
      --json benchmarks/results/recompiles_cpu_pack_fill.json --markdown benchmarks/results/recompiles_cpu_pack_fill.md
  python benchmarks/recompiles.py --iterations 4 --modes packed_fill_768 --override env.num_tasks=48 \
      --override rollout.tasks_per_iteration=32 --workdir /tmp/rcfill32_768 \
      --json benchmarks/results/recompiles_cpu_pack_fill_768_32tasks.json \
      --markdown benchmarks/results/recompiles_cpu_pack_fill_768_32tasks.md
  python benchmarks/recompiles.py --iterations 8 --modes packed_fixed,packed_fixed_exact_images \
      --workdir /tmp/image_buckets --json benchmarks/results/sampler_image_buckets_cpu.json \
      --markdown benchmarks/results/sampler_image_buckets_cpu.md
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402

# grpo_cpu's minibatches: 8 steps of one 112x112 screenshot (max_images 1) and a response of at most 64
# sampled tokens (+ the closing token); prompts of 150-500 tokens
FIXED_RESPONSE_AND_VISION = ("pipeline.max_response_tokens=72", "pipeline.vision_images=8")
MODES = {
    "padded": (),
    # one shape for the run: 4 rows of 1,024 hold any minibatch (fill = its tokens / 4,096)
    "packed_fixed": ("pipeline.pack=True", "pipeline.pack_length=1024", "pipeline.pack_rows=4",
                     *FIXED_RESPONSE_AND_VISION),
    # rows of 512 tokens, as many as a minibatch needs: one shape per row count
    "packed_rows": ("pipeline.pack=True", "pipeline.pack_length=512", *FIXED_RESPONSE_AND_VISION),
    # rows as many as needed, each minibatch's row length a length bucket: the smallest holding it in one row, else
    # the largest ("one_row"), or the one holding it in the fewest token slots: one shape per (rows, bucket)
    "packed_one_row": ("pipeline.pack=True", *FIXED_RESPONSE_AND_VISION),
    "packed_fewest_slots": ("pipeline.pack=True", "pipeline.pack_length_rule=fewest_slots", *FIXED_RESPONSE_AND_VISION),
    # token-budget minibatches: one shape for the run, 1 row of 1,024 tokens, filled from the whole
    # update's steps (at most 8 a minibatch), so the number of minibatches follows the tokens
    "packed_fill": ("pipeline.pack=True", "pipeline.pack_length=1024", "pipeline.pack_rows=1", "pipeline.pack_fill=True",
                    *FIXED_RESPONSE_AND_VISION),
    # the same in rows of 768 tokens, which grpo_cpu's steps fill with less left over (README)
    "packed_fill_768": ("pipeline.pack=True", "pipeline.pack_length=768", "pipeline.pack_rows=1",
                        "pipeline.pack_fill=True", *FIXED_RESPONSE_AND_VISION),
}
# the packed modes with 128-token attention tiles (512 above): tiles that hold only other examples' pairs
# are skipped, so smaller tiles skip more of a packed row
MODES.update({f"{name}_tile128": (*MODES[name], "model.attention_block=128") for name in ("packed_fixed", "packed_rows")})
# the sampler's screenshots padded to exactly their count (one program per count) instead of the rows x 1, 2, 3,
# 4, 6, ... per row it pads them to by default: same episodes, so the difference is the sampler's compilations
MODES["packed_fixed_exact_images"] = (*MODES["packed_fixed"], "rollout.sampler_image_buckets=exact")
METRICS = ("compiles", "time_compile_s", "time_update_s", "time_old_logprobs_s", "time_iteration_s", "token_fill",
           "trained_tokens", "loss", "success_rate")


def run_mode(name: str, recipe: str, overrides: list[str], iterations: int, workdir: pathlib.Path,
             timeout_s: float, rerun: bool = True) -> list[dict[str, Any]]:
    """The recipe's RL iterations in a subprocess (`rerun` False: read back a finished run's); each iteration's
    metrics."""
    out = workdir / name
    if not rerun:
        return read_mode(out)
    command = [sys.executable, "-m", "guijax.launch", f"--config={recipe}", f"--workdir={out}",
               "--config.stages=('base_model', 'tasks', 'sft', 'rl')", f"--config.train.iterations={iterations}",
               "--config.compilation_cache_dir=", *[f"--config.{o}" for o in overrides]]
    t0 = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode:
        raise SystemExit(f"{name}: the recipe failed ({done.returncode}):\n{done.stderr[-4000:]}")
    records = read_mode(out)
    print(f"{name}: {len(records)} iterations in {time.perf_counter() - t0:.0f} s", flush=True)
    return records


def read_mode(out: pathlib.Path) -> list[dict[str, Any]]:
    path = out / "metrics.jsonl"
    if not path.exists():
        raise SystemExit(f"{path} does not exist: run without --from_workdir first")
    records = [json.loads(line) for line in path.read_text().splitlines() if '"iteration"' in line]
    return [{k: r.get(k) for k in ("iteration", *METRICS)} for r in records]


def summary(records: list[dict[str, Any]]) -> dict[str, float]:
    later = records[1:]
    total = lambda k: float(sum(r[k] or 0.0 for r in later))  # noqa: E731  (an iteration with nothing to train: None)
    return {"iterations": len(later), "compiles": int(total("compiles")), "compile_s": total("time_compile_s"),
            "update_s": total("time_update_s") + total("time_old_logprobs_s"), "iteration_s": total("time_iteration_s"),
            "trained_tokens": int(total("trained_tokens")),
            "token_fill": float(np.mean([r["token_fill"] for r in later if r["token_fill"] is not None] or [np.nan]))}


def markdown(payload: dict[str, Any]) -> str:
    lines = [f"# Recompilation by minibatch and sampler shapes ({payload['recipe']}: {', '.join(payload['summary'])})", "",
             f"`{payload['command']}`", "", bc.machine_line(payload["machine"]), "",
             f"Iterations 1-{payload['iterations'] - 1} (iteration 0 also compiles the sampler):", "",
             "| minibatches | compilations | compile s | update + old log-probs s | trained tokens | "
             "update s per 1k trained tokens | the same, compiling subtracted | iteration s | token fill |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, s in payload["summary"].items():
        per_k = s["update_s"] / max(s["trained_tokens"], 1) * 1000
        # compile s also counts the sampler's compilations (new prompt shapes), so this is a lower bound
        net_k = (s["update_s"] - s["compile_s"]) / max(s["trained_tokens"], 1) * 1000
        lines.append(f"| {name} | {s['compiles']} | {s['compile_s']:.1f} | {s['update_s']:.1f} | "
                     f"{s['trained_tokens']} | {per_k:.2f} | {net_k:.2f} | {s['iteration_s']:.1f} | "
                     f"{s['token_fill']:.3f} |")
    lines += ["", "The modes' runs part ways after the warm start (packing changes the summation order), so they "
              "train on different episodes: compare time per trained token, not totals. Compile s counts every "
              "compilation of the iteration, the sampler's included, so the column with it subtracted is a lower "
              "bound of the update's own time."]
    lines += ["", "Per iteration (compilations, compile s, token fill):", "",
              "| iteration | " + " | ".join(payload["modes"]) + " |", "|---|" + "---|" * len(payload["modes"])]
    for i in range(payload["iterations"]):
        cells = []
        for name in payload["modes"]:
            r = payload["modes"][name][i] if i < len(payload["modes"][name]) else None
            fill = "-" if r is None or r["token_fill"] is None else f"{r['token_fill']:.3f}"
            cells.append("" if r is None else f"{r['compiles']}, {r['time_compile_s']:.1f}, {fill}")
        lines.append(f"| {i} | " + " | ".join(cells) + " |")
    lines += ["", "Overrides:", ""] + [f"- {n}: `{' '.join(o) or '(the recipe as it is)'}`"
                                        for n, o in payload["overrides"].items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="grpo_cpu", help="the recipe")
    p.add_argument("--iterations", type=int, default=6)
    p.add_argument("--workdir", required=True)
    p.add_argument("--override", action="append", default=[], help="KEY=VALUE for both modes (repeatable)")
    p.add_argument("--modes", default="padded,packed_fixed,packed_rows",
                   help=f"comma-separated, of {', '.join(MODES)}")
    p.add_argument("--from_workdir", action="store_true",
                   help="write the outputs from the runs already in --workdir instead of running them")
    p.add_argument("--timeout_s", type=float, default=3600.0, help="per mode")
    p.add_argument("--json")
    p.add_argument("--markdown", "--md", dest="md")
    args = p.parse_args(argv)
    if args.iterations < 2:
        raise SystemExit("--iterations must be at least 2 (iteration 0 is reported apart)")
    workdir = pathlib.Path(args.workdir)
    names = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(names) - set(MODES))
    if unknown:
        raise SystemExit(f"--modes: unknown {unknown}; choose from {sorted(MODES)}")
    modes = {name: run_mode(name, args.config, [*args.override, *MODES[name]], args.iterations, workdir,
                            args.timeout_s, rerun=not args.from_workdir) for name in names}
    payload = {"recipe": args.config, "iterations": args.iterations, "overrides": {n: list(MODES[n]) for n in names},
               "command": bc.command_line("recompiles.py", argv), "machine": bc.machine_info(),
               "modes": modes, "summary": {k: summary(v) for k, v in modes.items()}}
    bc.write_outputs(args.json, args.md, payload, markdown(payload))
    print(markdown(payload))
    return payload


if __name__ == "__main__":
    main()
