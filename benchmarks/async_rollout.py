"""Benchmark: synchronous against asynchronous rollouts, the same GRPO recipe with environments that take time.

Why: a real OSWorld VM step takes seconds (the action, the UI settling, the screenshot). Synchronously the
learner waits for every episode of an iteration and the environments wait for every update; asynchronously
(`rollout.mode=async`) a rollout thread keeps every environment busy and the learner trains on groups as
they complete. This measures what that buys, on the recipe's own model, tasks and workers.

For each seed: one base policy (fresh checkpoint, desk tasks, the recipe's SFT warm start), then GRPO from it
twice, `rollout.mode=sync` and `rollout.mode=async`, with every environment reset and step waiting
`--latency` seconds (`env.step_latency_s`) and the same `env.num_workers`. Both modes train on the same
number of episodes (iterations x tasks_per_iteration x group_size; the asynchronous mode also drops groups
sampled more than `rollout.max_staleness` updates ago, counted apart).

  episodes_per_hour   trained episodes x 3600 / the iterations' wall time, the first iteration (which
                      compiles the sampler and the update) left out
  speedup             async / sync episodes per hour, per seed, then mean and std over seeds
  success_last        the training success rate over the last `--last` iterations: what each mode reached
                      after the same number of episodes
  mean_staleness      updates between the parameters that sampled a trained group and the learner's
  env_busy_fraction   slot-seconds inside environment calls / (workers x wall time)
  learner_busy_fraction  old log-probs + update time / wall time
  compile_seconds     seconds of XLA compilation inside the timed iterations (the `time_compile_s` metric):
                      each mode compiles its own batch shapes, with the persistent compilation cache off so
                      that what one mode (or an earlier run) compiled never speeds the other (unless
                      --compilation_cache names one: a second run then measures the steady state)

  python benchmarks/async_rollout.py --json benchmarks/results/async_rollout_cpu.json \
      --markdown benchmarks/results/async_rollout_cpu.md --seeds 0,1,2 --latency 1.0 --iterations 8
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402

MODES = ("sync", "async")


def _records(workdir: pathlib.Path) -> list[dict[str, Any]]:
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(x) for x in lines if '"iteration"' in x]


def _mean(xs: list[float]) -> float:
    return float(statistics.fmean(xs)) if xs else float("nan")


def _std(xs: list[float]) -> float:
    return float(statistics.stdev(xs)) if len(xs) > 1 else 0.0


def summarize(records: list[dict[str, Any]], last: int) -> dict[str, Any]:
    timed = records[1:] or records
    seconds = sum(r["time_iteration_s"] for r in timed)
    episodes = sum(r["episodes"] for r in timed)
    out = {
        "iterations": len(records), "episodes_trained": sum(r["episodes"] for r in records),
        "episodes_per_hour": episodes * 3600 / max(seconds, 1e-9), "timed_seconds": seconds,
        "success_last": _mean([r["success_rate"] for r in records[-last:]]),
        "env_busy_fraction": _mean([r["env_busy_fraction"] for r in timed]),
        "learner_busy_fraction": _mean([r["learner_busy_fraction"] for r in timed]),
        "env_wait_fraction": _mean([r["env_wait_fraction"] for r in timed]),
        "compile_seconds": sum(r.get("time_compile_s", 0.0) for r in timed),
        "success_rate": [r["success_rate"] for r in records],
        "iteration_seconds": [r["time_iteration_s"] for r in records],
    }
    if "staleness_mean" in records[0]:
        out["mean_staleness"] = _mean([r["staleness_mean"] for r in records])
        out["stale_dropped"] = sum(r["stale_dropped"] for r in records)
    return out


def run_seed(recipe: str, overrides: list[str], seed: int, workdir: pathlib.Path, latency: float,
             last: int, compilation_cache: str = "") -> dict[str, Any]:
    from guijax import launch
    from guijax.methods import get_method
    from guijax.pipeline import base_stages
    from guijax.pipeline.registry import run_stages
    from guijax.pipeline.run import Run

    config = launch.resolve(recipe, [*overrides, f"seed={seed}", f"env.step_latency_s={latency}",
                                     f"compilation_cache_dir={compilation_cache}",
                                     "stages=('base_model', 'tasks', 'sft')"])
    run_stages(config, workdir)
    run = Run(config, workdir)
    wall = {}
    try:
        for mode in MODES:
            mode_config = copy.deepcopy(config)
            with mode_config.unlocked():
                mode_config.rollout.mode = mode
            t0 = time.perf_counter()
            base_stages.train_with(run, get_method("grpo", mode_config), workdir / f"rl_{mode}", f"grpo {mode}")
            wall[mode] = time.perf_counter() - t0
    finally:
        run.close()
    out = finished_seed(workdir, config.train.iterations, last)
    for mode in MODES:
        out[mode]["wall_seconds"] = wall[mode]
    return out


def finished_seed(workdir: pathlib.Path, iterations: int, last: int) -> dict[str, Any] | None:
    """A seed's result read back from its workdir when both modes ran all `iterations` (an interrupted
    benchmark keeps the seeds it finished); None otherwise."""
    out = {}
    for mode in MODES:
        path = workdir / f"rl_{mode}"
        records = _records(path) if (path / "metrics.jsonl").exists() else []
        if len(records) < iterations:
            return None
        out[mode] = summarize(records[:iterations], last)
    out["speedup"] = out["async"]["episodes_per_hour"] / out["sync"]["episodes_per_hour"]
    return out


def aggregate(per_seed: dict[int, dict[str, Any]]) -> dict[str, Any]:
    seeds = list(per_seed.values())

    def stat(get) -> dict[str, float]:
        xs = [get(s) for s in seeds]
        return {"mean": _mean(xs), "std": _std(xs)}

    return {
        "sync_episodes_per_hour": stat(lambda s: s["sync"]["episodes_per_hour"]),
        "async_episodes_per_hour": stat(lambda s: s["async"]["episodes_per_hour"]),
        "speedup": stat(lambda s: s["speedup"]),
        "mean_staleness": stat(lambda s: s["async"]["mean_staleness"]),
        "stale_dropped": stat(lambda s: s["async"]["stale_dropped"]),
        **{f"{mode}_{key}": stat(lambda s, m=mode, k=key: s[m][k]) for mode in MODES
           for key in ("env_busy_fraction", "learner_busy_fraction", "success_last", "compile_seconds")},
    }


def markdown(payload: dict[str, Any]) -> str:
    a = payload["aggregate"]

    def ms(key: str, fmt: str = "{:.2f}") -> str:
        return f"{fmt.format(a[key]['mean'])} ± {fmt.format(a[key]['std'])}"

    rows = [
        "| | sync | async |", "|---|---|---|",
        f"| trained episodes / hour | {ms('sync_episodes_per_hour', '{:.0f}')} | {ms('async_episodes_per_hour', '{:.0f}')} |",
        f"| environment busy fraction | {ms('sync_env_busy_fraction')} | {ms('async_env_busy_fraction')} |",
        f"| learner busy fraction | {ms('sync_learner_busy_fraction')} | {ms('async_learner_busy_fraction')} |",
        f"| training success, last {payload['last']} iterations | {ms('sync_success_last')} | {ms('async_success_last')} |",
        f"| XLA compilation in the timed iterations (s) | {ms('sync_compile_seconds', '{:.0f}')} | "
        f"{ms('async_compile_seconds', '{:.0f}')} |",
        f"| mean staleness (updates) | 0 | {ms('mean_staleness')} |",
        f"| episodes dropped as too stale | 0 | {ms('stale_dropped', '{:.1f}')} |",
    ]
    return "\n".join([
        f"# Synchronous vs asynchronous rollouts ({payload['recipe']}, {payload['latency_s']} s per environment "
        f"step, seeds {', '.join(map(str, payload['seeds']))})", "",
        f"`{payload['command']}`", "", bc.machine_line(payload["machine"]), "",
        f"Speedup (async / sync trained episodes per hour, mean ± std over seeds): **{ms('speedup')}**", "",
        *rows, "",
        "Per seed: " + "; ".join(f"seed {s}: {r['speedup']:.2f}x" for s, r in payload["per_seed"].items()), ""])


def plot(payload: dict[str, Any], path: pathlib.Path) -> None:
    """Trained episodes against wall-clock seconds, both modes, every seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for n, (seed, result) in enumerate(payload["per_seed"].items()):
        for mode, style in zip(MODES, ("-", "--")):
            r = result[mode]
            per_iteration = r["episodes_trained"] / r["iterations"]
            xs, ys, t = [0.0], [0.0], 0.0
            for i, s in enumerate(r["iteration_seconds"]):
                t += s
                xs.append(t)
                ys.append(per_iteration * (i + 1))
            ax.plot(xs, ys, style, color=f"C{n}", label=f"{mode}, seed {seed}")
    ax.set_xlabel("wall-clock seconds (first iteration compiles)")
    ax.set_ylabel("trained episodes")
    ax.set_title(f"{payload['recipe']}: environments with {payload['latency_s']} s per step")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--recipe", default="grpo_cpu")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--latency", type=float, default=1.0, help="seconds every environment reset and step waits")
    p.add_argument("--iterations", type=int, default=8)
    p.add_argument("--last", type=int, default=3, help="iterations averaged for success_last")
    p.add_argument("--override", action="append", default=[], help="KEY=VALUE on the recipe (repeatable)")
    p.add_argument("--workdir", default="", help="default: a temporary directory, removed afterwards")
    p.add_argument("--compilation_cache", default="",
                   help="a persistent compilation cache directory; '' (default) leaves it off, so each mode pays "
                        "for its own compilations. A second run on a filled cache measures the steady state")
    p.add_argument("--json", default=None)
    p.add_argument("--markdown", default=None)
    p.add_argument("--plot", default=None, help="PNG of trained episodes against wall-clock time")
    p.add_argument("--replot", default=None, help="a JSON this script wrote: draw --plot from it, run nothing")
    p.add_argument("--from_workdir", action="store_true",
                   help="run nothing: read the seeds of --workdir that finished both modes (an interrupted run's) "
                        "and write the outputs from them")
    args = p.parse_args(argv)
    if args.from_workdir and not args.workdir:
        p.error("--from_workdir reads --workdir: name it")
    if args.replot:
        payload = json.loads(pathlib.Path(args.replot).read_text())
        plot(payload, pathlib.Path(args.plot or pathlib.Path(args.replot).with_suffix(".png")))
        return payload
    seeds = [int(s) for s in args.seeds.split(",")]
    overrides = [*args.override, f"train.iterations={args.iterations}", f"train.checkpoint_every={args.iterations}"]
    payload: dict[str, Any] = {"command": bc.command_line("async_rollout.py", argv), "recipe": args.recipe,
                               "latency_s": args.latency, "seeds": seeds, "last": args.last,
                               "compilation_cache": args.compilation_cache,
                               "overrides": overrides, "machine": bc.machine_info(), "per_seed": {}}
    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(args.workdir or tmp)
        for seed in seeds:
            if args.from_workdir:
                result = finished_seed(root / f"seed-{seed}", args.iterations, args.last)
                if result is None:
                    print(f"seed {seed}: not finished in {root / f'seed-{seed}'}; left out")
                    continue
                payload["per_seed"][seed] = result
            else:
                payload["per_seed"][seed] = run_seed(args.recipe, overrides, seed, root / f"seed-{seed}",
                                                     args.latency, args.last, args.compilation_cache)
    if not payload["per_seed"]:
        raise SystemExit(f"no finished seed in {args.workdir}")
    payload["seeds"] = list(payload["per_seed"])
    payload["aggregate"] = agg = aggregate(payload["per_seed"])
    payload.update({k: agg[k]["mean"] for k in ("sync_episodes_per_hour", "async_episodes_per_hour", "speedup",
                                                "mean_staleness")})
    payload["env_busy_fraction"] = {m: agg[f"{m}_env_busy_fraction"]["mean"] for m in MODES}
    payload["learner_busy_fraction"] = {m: agg[f"{m}_learner_busy_fraction"]["mean"] for m in MODES}
    bc.write_outputs(args.json, args.markdown, payload, markdown(payload))
    if args.plot:
        plot(payload, pathlib.Path(args.plot))
    return payload


if __name__ == "__main__":
    main()
