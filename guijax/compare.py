"""Every method of an expert-guided recipe over several seeds, as mean ± std per split:

    python -m guijax.compare --config=bepa_cpu --seeds=0,1,2 --methods=all --workdir=runs/compare

Each seed is a full run of the recipe (its own base policy, expert stage, LEVEL-1, and every method trained
from that base policy with the same budget) in WORKDIR/seed_N, resumable like any run. The aggregate goes to
WORKDIR/compare.md and compare.json. `--config.key=value` overrides apply to every seed. `--aggregate_only`
runs nothing: it aggregates the `table.json` (and `csr.json`) each WORKDIR/seed_N already holds, e.g. seeds
run on different machines or by `python -m guijax.launch --config.seed=N` and gathered there.
"""
from __future__ import annotations

import json
import pathlib
import sys
from typing import Any, Mapping, Sequence

import numpy as np
from absl import app, flags, logging

from guijax import launch

FLAGS = flags.FLAGS  # --config and --workdir are guijax.launch's flags
flags.DEFINE_string("seeds", "0,1,2", "comma-separated seeds")
flags.DEFINE_string("methods", "all", "comma-separated methods of guijax.methods.REGISTRY, or 'all' (every method the "
                    "recipe's stages can feed: those reading the select stage need a recipe that runs it)")

flags.DEFINE_bool("aggregate_only", False, "run nothing; aggregate the tables WORKDIR/seed_N already holds")

COLUMNS = ("expert_only", "train", "held_out", "overall")


def aggregate(tables: Sequence[dict[str, dict[str, float | None]]]) -> dict[str, dict[str, dict[str, float]]]:
    """[{row: {column: value}}] per seed -> {row: {column: {"mean", "std", "n"}}} over the seeds that have it."""
    rows: list[str] = []
    for t in tables:
        rows += [r for r in t if r not in rows]
    out: dict[str, dict[str, dict[str, float]]] = {}
    for row in rows:
        out[row] = {}
        for col in COLUMNS:
            values = [t[row][col] for t in tables if row in t and t[row].get(col) is not None]
            if values:
                out[row][col] = {"mean": float(np.mean(values)), "std": float(np.std(values)), "n": len(values)}
    return out


def markdown(result: dict[str, dict[str, dict[str, float]]], seeds: Sequence[int]) -> str:
    lines = [f"Success rate (%), mean ± std over seeds {list(seeds)}", "",
             "| policy | " + " | ".join(COLUMNS) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
    for row, cols in result.items():
        cells = [f"{100 * c['mean']:.1f} ± {100 * c['std']:.1f}" if (c := cols.get(col)) else "–" for col in COLUMNS]
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def aggregate_csr(reports: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The csr stage's reports of every seed -> {policy: {"csr": mean/std/n, "tasks": per-seed pool sizes}}."""
    out: dict[str, dict[str, Any]] = {}
    for report in reports:
        for name, r in report.get("results", {}).items():
            entry = out.setdefault(name, {"values": [], "tasks": []})
            entry["tasks"].append(len(report["tasks"]))
            if r.get("csr") is not None:
                entry["values"].append(r["csr"])
    return {name: {"csr": {"mean": float(np.mean(e["values"])), "std": float(np.std(e["values"])),
                           "n": len(e["values"])} if e["values"] else None, "tasks": e["tasks"]}
            for name, e in out.items()}


def csr_markdown(result: dict[str, dict[str, Any]], seeds: Sequence[int]) -> str:
    lines = [f"Continuation Success Rate (%), mean ± std over seeds {list(seeds)} (on each seed's tasks the base "
             "policy fails)", "", "| policy | CSR | tasks per seed |", "|---|---|---|"]
    for name, r in result.items():
        c = r["csr"]
        cell = f"{100 * c['mean']:.1f} ± {100 * c['std']:.1f}" if c else "–"
        lines.append(f"| {name} | {cell} | {', '.join(map(str, r['tasks']))} |")
    return "\n".join(lines)


def run(config_name: str, overrides: list[str], seeds: Sequence[int], methods: Sequence[str],
        workdir: pathlib.Path, aggregate_only: bool = False) -> dict[str, Any]:
    from guijax.methods import REGISTRY
    from guijax.pipeline.registry import run_stages

    unknown = [m for m in methods if m not in REGISTRY]
    if unknown:
        raise ValueError(f"unknown methods {unknown}; available: {sorted(REGISTRY)}")
    tables, continuation = [], []
    for seed in seeds:
        seed_dir = workdir / f"seed_{seed}"
        if aggregate_only:
            _run_table(workdir, seed)
        else:
            config = launch.resolve(config_name, overrides + [f"seed={seed}", f"compare.methods={tuple(methods)!r}"])
            if "table" not in config.stages or "methods" not in config.stages:
                raise ValueError(f"recipe {config_name} has no 'methods' and 'table' stages to compare")
            print(f"compare: seed {seed} -> {seed_dir}")
            run_stages(config, seed_dir)
        table = json.loads((seed_dir / "table.json").read_text())
        missing = [m for m in methods if m not in table]
        if aggregate_only and missing:  # a run of other methods: the means would silently cover fewer seeds
            raise ValueError(f"{seed_dir / 'table.json'} has no row for {missing} (its rows: {sorted(table)})")
        tables.append(table)
        if (seed_dir / "csr.json").exists():
            continuation.append(json.loads((seed_dir / "csr.json").read_text()))
    result = aggregate(tables)
    text = markdown(result, seeds)
    summary = {"seeds": list(seeds), "methods": list(methods), "result": result}
    if continuation:
        summary["continuation_success"] = aggregate_csr(continuation)
        text += "\n\n" + csr_markdown(summary["continuation_success"], seeds)
    (workdir / "compare.md").write_text(text + "\n")
    (workdir / "compare.json").write_text(json.dumps(summary, indent=1))
    print("\n" + text)
    return result


def tabled_methods(workdir: pathlib.Path, seeds: Sequence[int]) -> list[str]:
    """The methods with a row in every seed's WORKDIR/seed_N/table.json (a missing table is named)."""
    rows = [set(json.loads(_run_table(workdir, seed).read_text())) - {"base policy"} for seed in seeds]
    return sorted(set.intersection(*rows)) if rows else []


def _run_table(workdir: pathlib.Path, seed: int) -> pathlib.Path:
    """WORKDIR/seed_N/table.json of a seed already run; `--aggregate_only` names one that is missing."""
    path = workdir / f"seed_{seed}" / "table.json"
    if not path.exists():
        raise ValueError(f"--aggregate_only: no {path} (seed {seed} has not been run there)")
    return path


def feedable_methods(stages: Sequence[str], registry: Mapping[str, Any]) -> list[str]:
    """'all': every registered method whose input stages the recipe runs (with the command's overrides), so
    adding the `select` stage brings in ARPO and the offline methods."""
    return sorted(m for m, cls in registry.items() if set(cls.requires) <= set(stages))


def main(argv: list[str]) -> None:
    del argv
    from guijax.methods import REGISTRY

    seeds = [int(s) for s in FLAGS.seeds.split(",") if s.strip()]
    workdir = pathlib.Path(FLAGS.workdir or f"runs/compare_{FLAGS.config}")
    if FLAGS.aggregate_only and FLAGS.methods == "all":  # the methods the seeds' tables all hold
        methods = tabled_methods(workdir, seeds)
    elif FLAGS.methods == "all":
        methods = feedable_methods(launch.resolve(FLAGS.config, _OVERRIDES).stages, REGISTRY)
    else:
        methods = [m.strip() for m in FLAGS.methods.split(",") if m.strip()]
    workdir.mkdir(parents=True, exist_ok=True)
    logging.set_verbosity(logging.WARNING)
    run(FLAGS.config, _OVERRIDES, seeds, methods, workdir, aggregate_only=FLAGS.aggregate_only)


_OVERRIDES: list[str] = []

if __name__ == "__main__":
    rest, overrides = launch.split_overrides(sys.argv)
    _OVERRIDES[:] = overrides
    try:
        app.run(main, argv=rest)
    except (ValueError, launch.config_lib.ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
