"""Stages that compare methods from one base policy:

    methods   train every method of `compare.methods` from the same base policy with the same budget and
              seeds, each in WORKDIR/methods/NAME, and evaluate it on every split
    table     BEPA-Table-1-style success table (expert-only / train / held-out / overall) of the base policy
              and every method, as table.md and table.json
"""
from __future__ import annotations

import json
import pathlib
import time
from typing import Any

from envs.atomic import write_text_atomic
from guijax import progress
from guijax.pipeline.base_stages import BASE_POLICY, EVAL_READS, SPLITS, TRAIN_READS, evaluate_into, train_with
from guijax.pipeline.run import Run
from guijax.pipeline.stage import stage


def compared_methods(run: Run) -> list[Any]:
    """Every method of compare.methods on the run's config, validated (unknown names fail naming the key)."""
    from guijax.methods import get_method

    return [get_method(name, run.config, key="compare.methods") for name in run.config.compare.methods]


def train_method(run: Run, method: Any) -> pathlib.Path:
    """Train one method from the base policy in WORKDIR/methods/NAME; returns its trained model directory."""
    workdir = run.workdir / "methods" / method.name
    final = workdir / "trained_model"
    if (final / "config.json").exists():
        return final
    workdir.mkdir(parents=True, exist_ok=True)
    policy, _ = train_with(run, method, workdir, method.name)
    run.save_trained(policy, final)
    return final


def _verdict(run: Run, key: str, path: str) -> tuple[bool, str]:
    """(reuse, why) of a method's training or evaluation: its file exists and (when the run keeps records)
    was made from the current config."""
    complete = (run.workdir / path).exists()
    return run.records.verdict(key, complete) if run.records is not None else (complete, "")


def _trained(run: Run, name: str) -> tuple[bool, str]:
    return _verdict(run, f"methods/{name}", f"methods/{name}/trained_model/config.json")


def _evaluated(run: Run, name: str) -> tuple[bool, str]:
    return _verdict(run, f"methods/{name}/eval", f"methods/{name}/eval.json")


def _begin(run: Run, tag: str, key: str, outputs: tuple[str, ...], why: str, action: str) -> None:
    if run.records is None:
        return
    note = run.records.restart(key, outputs, why, action)
    if note:
        progress.echo(f"{tag}: {note}")


@stage("methods", lambda run: f"train and evaluate {', '.join(run.config.compare.methods)} from the same base policy",
       done=lambda run: all(_trained(run, m)[0] and _evaluated(run, m)[0] for m in run.config.compare.methods),
       reads=TRAIN_READS, needs=BASE_POLICY + ("tasks", "bepa_splits"), trains="compare.methods",
       eval_reads=EVAL_READS, eval_needs=SPLITS)
def methods(run: Run) -> str:
    chosen = compared_methods(run)
    results = {}
    for i, method in enumerate(chosen, 1):
        tag = f"  method {i}/{len(chosen)} {method.name}"
        key = f"methods/{method.name}"
        (trained, why_trained), (evaluated, why_evaluated) = _trained(run, method.name), _evaluated(run, method.name)
        if trained and evaluated:
            progress.echo(f"{tag}: already done, skipped")
            continue
        if not trained:
            _begin(run, tag, key, (key,), why_trained, "training it")
        _begin(run, tag, f"{key}/eval", (f"{key}/eval.json", f"{key}/eval.html", f"{key}/eval_trajectories"), why_evaluated if trained else "", "evaluating it")
        progress.echo(f"{tag}: {method.describe()}; then evaluation")
        start = time.perf_counter()
        report_path = run.workdir / "methods" / method.name / "eval.json"
        model = train_method(run, method)
        if run.records is not None:
            run.records.end(key)
        results[method.name] = evaluate_into(run, model, report_path)
        if run.records is not None:
            run.records.end(f"{key}/eval")
        progress.echo(f"{tag}: done in {progress.format_duration(time.perf_counter() - start)}; {results[method.name]}")
    return f"{len(results)} trained" + (f" ({', '.join(results)})" if results else "")


def overall(report: dict[str, Any], splits: dict[str, list]) -> float | None:
    """Success over every task once (train ∪ held-out), weighting each split by its task count."""
    parts = [(report["splits"][s]["success_rate"], len(splits[s])) for s in ("train", "held_out")
             if s in report["splits"] and report["splits"][s].get("tasks")]
    n = sum(w for _, w in parts)
    return sum(r * w for r, w in parts) / n if n else None


@stage("table", lambda run: "success per split of the base policy and every method (table.md, table.json)")
def table(run: Run) -> str:
    rows: dict[str, dict[str, Any]] = {}
    base = run.workdir / "eval_base.json"
    if base.exists():
        rows["base policy"] = json.loads(base.read_text())
    for name in run.config.compare.methods:
        path = run.workdir / "methods" / name / "eval.json"
        if path.exists():
            rows[name] = json.loads(path.read_text())
    splits = run.tasks()
    columns = [s for s in ("expert_only", "train", "held_out") if s in splits]
    header = "| policy | " + " | ".join(f"{c} ({len(splits[c])})" for c in columns) + " | overall |"
    lines = [header, "|---" * (len(columns) + 2) + "|"]
    data = {}
    for name, report in rows.items():
        cells, values = [], {}
        for c in columns:
            r = report["splits"].get(c, {})
            values[c] = r.get("success_rate") if r.get("tasks") else None
            cells.append("–" if values[c] is None else f"{100 * values[c]:.1f}%")
        values["overall"] = overall(report, splits)
        cells.append("–" if values["overall"] is None else f"{100 * values['overall']:.1f}%")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
        data[name] = values
    text = "\n".join(lines)
    (run.workdir / "table.md").write_text(text + "\n")
    write_text_atomic(run.workdir / "table.json", json.dumps(data, indent=1))
    progress.echo(f"\n{run.config.name}: success rate by split (tasks in parentheses)\n\n{text}\n")
    return f"{len(rows)} policies in {run.workdir / 'table.md'}"
