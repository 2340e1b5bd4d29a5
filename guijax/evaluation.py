"""Evaluation: success rate over named task splits, pass@k, a per-domain table; written as eval.json and
a markdown table. Eval sampling uses temperature 0.6 by default (ARPO's setting)."""
from __future__ import annotations

import json
import math
import pathlib
from collections import defaultdict
from typing import Any, Sequence

import jax

from envs.api import Task
from envs.atomic import write_text_atomic
from guijax.rollout.engine import RolloutEngine
from guijax.rollout.trajectory import Status


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c successes (Chen et al. 2021)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def evaluate(engine: RolloutEngine, params: Any, splits: dict[str, Sequence[Task]], episodes_per_task: int,
             seed: int, ks: Sequence[int] = (1,)) -> dict[str, Any]:
    report: dict[str, Any] = {"episodes_per_task": episodes_per_task, "splits": {}}
    for name, tasks in splits.items():
        if not tasks:
            report["splits"][name] = {"tasks": 0}
            continue
        trajectories, _ = engine.run(params, list(tasks), episodes_per_task, jax.random.PRNGKey(seed), seed=seed,
                                     desc=f"eval {name}")
        per_task: dict[str, list[bool]] = defaultdict(list)
        domains: dict[str, str] = {}
        errors = 0
        for t in trajectories:
            if t.status == Status.ENV_ERROR:
                errors += 1
                continue
            per_task[t.task_id].append(t.success)
            domains[t.task_id] = t.meta.get("domain", "")
        by_domain: dict[str, list[float]] = defaultdict(list)
        for task_id, outcomes in per_task.items():
            by_domain[domains[task_id]].append(sum(outcomes) / len(outcomes))
        scores = [sum(o) / len(o) for o in per_task.values()]
        report["splits"][name] = {
            "tasks": len(per_task), "env_errors": errors,
            "success_rate": sum(scores) / len(scores) if scores else 0.0,
            **{f"pass@{k}": (sum(pass_at_k(len(o), sum(o), k) for o in per_task.values()) / len(per_task)
                            if per_task and k <= episodes_per_task else None) for k in ks},
            "per_domain": {d: sum(v) / len(v) for d, v in sorted(by_domain.items())},
            "per_task": {tid: sum(o) / len(o) for tid, o in sorted(per_task.items())},
        }
    return report


def markdown_table(reports: dict[str, dict[str, Any]]) -> str:
    """Rows: policies (e.g. base / trained); columns: success rate per split."""
    splits = sorted({s for r in reports.values() for s in r["splits"]})
    lines = ["| policy | " + " | ".join(splits) + " |", "|---|" + "---|" * len(splits)]
    for name, r in reports.items():
        cells = []
        for s in splits:
            entry = r["splits"].get(s, {})
            cells.append(f"{100 * entry['success_rate']:.1f}% ({entry['tasks']})" if entry.get("tasks") else "–")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_report(workdir: str | pathlib.Path, name: str, report: dict[str, Any]) -> pathlib.Path:
    path = pathlib.Path(workdir) / f"{name}.json"
    return write_text_atomic(path, json.dumps(report, indent=2))
