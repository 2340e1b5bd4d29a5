"""Evaluation: success rate over named task splits, pass@k (and its whole curve over k), success under
smaller step limits, a per-domain table, and the differential between two checkpoints' reports; written as
eval.json and a markdown table. Eval sampling uses temperature 0.6 by default (ARPO's setting)."""
from __future__ import annotations

import json
import math
import pathlib
from collections import defaultdict
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np

from envs.api import Task
from envs.atomic import write_text_atomic
from guijax.rollout.engine import RolloutEngine
from guijax.rollout.trajectory import Status, Trajectory

# score_at(trajectory, L): the verifier's score of the state the episode had reached after its first L steps.
StepScorer = Callable[[Trajectory, int], float]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c successes (Chen et al. 2021). With fewer samples than k (episodes
    lost to environment errors) it is pass@n: 1 when any sample succeeded, else 0."""
    if c == 0:
        return 0.0
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def outcomes_by_task(trajectories: Sequence[Trajectory]) -> tuple[dict[str, list[bool]], dict[str, str], int]:
    """({task id: successes of its scored episodes}, {task id: domain}, environment errors). ENV_ERROR episodes
    are dropped: the environment failed, the policy was never scored."""
    per_task: dict[str, list[bool]] = defaultdict(list)
    domains: dict[str, str] = {}
    errors = 0
    for t in trajectories:
        if t.status == Status.ENV_ERROR:
            errors += 1
            continue
        per_task[t.task_id].append(t.success)
        domains[t.task_id] = t.meta.get("domain", "")
    return dict(per_task), domains, errors


def mean_pass_at_k(per_task: Mapping[str, Sequence[bool]], k: int) -> float:
    """pass@k averaged over tasks (each task weighs the same whatever its number of scored episodes)."""
    if not per_task:
        return 0.0
    return sum(pass_at_k(len(o), sum(o), k) for o in per_task.values()) / len(per_task)


def pass_curve(per_task: Mapping[str, Sequence[bool]], max_k: int) -> dict[str, float]:
    """{str(k): mean pass@k} for k = 1..max_k; keys are strings, as the report's JSON keeps them."""
    return {str(k): mean_pass_at_k(per_task, k) for k in range(1, max_k + 1)}


def success_at_step_limits(trajectories: Sequence[Trajectory], limits: Sequence[int],
                           score_at: StepScorer | None = None) -> dict[str, float | None]:
    """{str(L): success rate had every episode been cut after L steps}, from trajectories run under a larger
    limit; the rate is `evaluate`'s success_rate (per-task success fraction averaged over tasks).

    Why this is what a run with max_steps=L would give: the policy's first L steps do not depend on the limit.
    The prompt never mentions a step budget (guijax.rollout.prompt.build_messages: instruction, history,
    screenshots), observations do not depend on it (the environment's limit only sets `done`), and the engine
    draws one key per round of episodes and splits it once per step, with the same episodes live at every step
    up to L in both runs. So an episode that ended within L steps ends the same way, and one that ran past L
    would have stopped after step L (status STEP_LIMIT) and been scored on the state it had reached then.

    That state is not in the trajectory. With `score_at` (e.g. `desk_replay_scorer`) it is rebuilt and scored,
    and the result is exact. Without it an episode that ran past L counts as a failure at L: a lower bound,
    exact unless the task's checker already passed on that unfinished state. A limit above an episode that
    was itself cut short (status STEP_LIMIT with fewer than L steps) cannot be extrapolated: that limit's
    entry is None. ENV_ERROR episodes are dropped where the error happened within the first L steps (they
    would have failed the same way) and scored at L where it came later."""
    out: dict[str, float | None] = {}
    for limit in limits:
        if limit < 1:
            raise ValueError(f"step limit {limit} must be >= 1")
        per_task: dict[str, list[bool]] = defaultdict(list)
        known = True
        for t in trajectories:
            n = len(t.steps)
            if n > limit:
                per_task[t.task_id].append(score_at(t, limit) > 0.5 if score_at is not None else False)
            elif t.status == Status.ENV_ERROR:
                continue
            elif t.status == Status.STEP_LIMIT and n < limit:
                known = False
                break
            else:
                per_task[t.task_id].append(t.success)
        scores = [sum(o) / len(o) for o in per_task.values()]
        out[str(limit)] = (sum(scores) / len(scores) if scores else 0.0) if known else None
    return out


def desk_replay_scorer(tasks: Sequence[Task], screen_hw: Sequence[int], popups: bool,
                       coordinate_model: str = "uitars-1.5", grammar: str = "uitars") -> StepScorer:
    """score_at for synthetic-desk trajectories: replay the first L steps' responses on a fresh desk with the
    episode's seed (`meta['seed']`; the desk is deterministic for it) and evaluate. Every replayed screenshot
    must equal the recorded one, so a desk set up differently from the evaluation's is an error, not a wrong
    number. Responses are parsed as the engine parses them (coordinates in screenshot pixels)."""
    from envs.actions.grammar import parse_response
    from envs.desk import DeskEnv

    by_id = {t.id: t for t in tasks}

    def score_at(traj: Trajectory, limit: int) -> float:
        where = f"task {traj.task_id} (episode seed {traj.meta.get('seed')})"
        if traj.task_id not in by_id:
            raise KeyError(f"{where}: not among the {len(by_id)} tasks given to the desk replay")
        if "seed" not in traj.meta:
            raise ValueError(f"{where}: the trajectory records no meta['seed'], so its desk cannot be replayed")
        env = DeskEnv(tuple(screen_hw), step_limit=limit, popups=popups)
        screenshot = env.reset(by_id[traj.task_id], episode_seed=traj.meta["seed"]).screenshot
        for i, step in enumerate(traj.steps[:limit], 1):
            if not np.array_equal(screenshot, step.screenshot):
                raise ValueError(f"{where}: replayed screenshot before step {i} differs from the recorded one; the "
                                 f"desk (screen {tuple(screen_hw)}, popups={popups}) is not the evaluation's")
            hw = step.screenshot.shape[:2]
            actions = parse_response(step.response, grammar=grammar, screen_hw=hw, coordinate_model=coordinate_model)
            screenshot = env.step(actions).observation.screenshot
        return float(env.evaluate())

    return score_at


def split_report(trajectories: Sequence[Trajectory], episodes_per_task: int, ks: Sequence[int] = (1,),
                 step_limits: Sequence[int] = (), score_at: StepScorer | None = None) -> dict[str, Any]:
    """One split's entry of the report, from its trajectories."""
    per_task, domains, errors = outcomes_by_task(trajectories)
    by_domain: dict[str, list[float]] = defaultdict(list)
    for task_id, outcomes in per_task.items():
        by_domain[domains[task_id]].append(sum(outcomes) / len(outcomes))
    scores = [sum(o) / len(o) for o in per_task.values()]
    entry: dict[str, Any] = {
        "tasks": len(per_task), "env_errors": errors,
        "success_rate": sum(scores) / len(scores) if scores else 0.0,
        **{f"pass@{k}": (mean_pass_at_k(per_task, k) if per_task and k <= episodes_per_task else None) for k in ks},
        "per_domain": {d: sum(v) / len(v) for d, v in sorted(by_domain.items())},
        "per_task": {tid: sum(o) / len(o) for tid, o in sorted(per_task.items())},
        "pass_curve": pass_curve(per_task, episodes_per_task) if per_task else {},
    }
    if step_limits:
        entry["success_at_step_limit"] = success_at_step_limits(trajectories, step_limits, score_at)
        entry["step_limit_scoring"] = "replayed" if score_at is not None else "recorded (lower bound)"
    return entry


def evaluate_with_trajectories(engine: RolloutEngine, params: Any, splits: dict[str, Sequence[Task]],
                               episodes_per_task: int, seed: int, ks: Sequence[int] = (1,),
                               step_limits: Sequence[int] = (), score_at: StepScorer | None = None
                               ) -> tuple[dict[str, Any], dict[str, list[Trajectory]]]:
    """`evaluate`'s report and the trajectories behind it, by split, so the inspector page and later analyses
    read the same episodes instead of rolling out again. The report's `sampling` says which sampler ran and
    where the time went (seconds sampling and in environments, tokens sampled, weight pushes to a serving
    engine)."""
    report: dict[str, Any] = {"episodes_per_task": episodes_per_task, "splits": {}}
    kept: dict[str, list[Trajectory]] = {}
    spent = {key: 0.0 if key.endswith("_s") else 0 for key in SAMPLING_TIMINGS}  # seconds, or counts
    for name, tasks in splits.items():
        if not tasks:
            report["splits"][name] = {"tasks": 0}
            continue
        trajectories, timings = engine.run(params, list(tasks), episodes_per_task, jax.random.PRNGKey(seed),
                                           seed=seed, desc=f"eval {name}")
        for key in SAMPLING_TIMINGS:
            spent[key] += type(spent[key])(timings.get(key, 0))
        kept[name] = trajectories
        report["splits"][name] = split_report(trajectories, episodes_per_task, ks, step_limits, score_at)
    sampler = getattr(engine, "sampler", None)
    if sampler is not None:
        served_by = getattr(sampler, "engine", None)  # a serving engine behind the sampler
        report["sampling"] = {"sampler": getattr(sampler, "name", type(sampler).__name__),
                              **({"engine": type(served_by).__name__} if served_by is not None else {}), **spent}
    return report, kept


# what an evaluation's report keeps of its rollouts' timings
SAMPLING_TIMINGS = ("sample_s", "env_s", "sampled_tokens", "weight_sync_s", "weight_sync_bytes", "parse_redraws")


def evaluate(engine: RolloutEngine, params: Any, splits: dict[str, Sequence[Task]], episodes_per_task: int,
             seed: int, ks: Sequence[int] = (1,), step_limits: Sequence[int] = (),
             score_at: StepScorer | None = None) -> dict[str, Any]:
    """The report alone ({"episodes_per_task", "splits": {split: split_report(...)}}), episodes discarded."""
    return evaluate_with_trajectories(engine, params, splits, episodes_per_task, seed, ks, step_limits, score_at)[0]


def checkpoint_diff(a: dict[str, Any], b: dict[str, Any]) -> dict[str, dict[str, list[str]]]:
    """Per split held by both reports: tasks gained (unsolved in `a`, solved in `b`), lost, both solved, both
    failed, and those only one report scored. "Solved" means at least one of the task's episodes succeeded
    (per-task success rate > 0, i.e. pass@n > 0 over its n episodes), so a gain is a task the later checkpoint
    can do at all, not a shift in how often."""
    out: dict[str, dict[str, list[str]]] = {}
    for split in sorted(set(a.get("splits", {})) & set(b.get("splits", {}))):
        ta = a["splits"][split].get("per_task", {})
        tb = b["splits"][split].get("per_task", {})
        both = set(ta) & set(tb)
        out[split] = {
            "gained": sorted(t for t in both if ta[t] <= 0 < tb[t]),
            "lost": sorted(t for t in both if tb[t] <= 0 < ta[t]),
            "both_solved": sorted(t for t in both if ta[t] > 0 and tb[t] > 0),
            "both_failed": sorted(t for t in both if ta[t] <= 0 and tb[t] <= 0),
            "only_in_a": sorted(set(ta) - both),
            "only_in_b": sorted(set(tb) - both),
        }
    return out


def diff_markdown(diff: dict[str, dict[str, list[str]]], name_a: str = "A", name_b: str = "B") -> str:
    """A count table (one row per split) and the gained / lost task ids under it."""
    lines = [f"| split | gained ({name_a} → {name_b}) | lost | both solved | both failed |", "|---|---|---|---|---|"]
    for split, d in diff.items():
        lines.append(f"| {split} | {len(d['gained'])} | {len(d['lost'])} | {len(d['both_solved'])} | "
                     f"{len(d['both_failed'])} |")
    for split, d in diff.items():
        for kind in ("gained", "lost"):
            if d[kind]:
                lines.append(f"\n**{split}, {kind}:** " + ", ".join(f"`{t}`" for t in d[kind]))
        for kind, name in (("only_in_a", name_a), ("only_in_b", name_b)):
            if d[kind]:
                lines.append(f"\n**{split}, scored only in {name}:** " + ", ".join(f"`{t}`" for t in d[kind]))
    return "\n".join(lines)


def plot_curves(reports: dict[str, dict[str, Any]], path: str | pathlib.Path, key: str = "pass_curve",
                xlabel: str = "k", ylabel: str = "pass@k") -> pathlib.Path:
    """A PNG with one panel per split and one line per report of `reports[name]['splits'][split][key]`
    ({x as string: y}); `key="success_at_step_limit"` plots success against the step limit. Splits no report
    holds `key` for are left out; None points (limits that could not be scored) are skipped."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    splits = sorted({s for r in reports.values() for s, e in r.get("splits", {}).items() if e.get(key)})
    if not splits:
        raise ValueError(f"no split of reports {', '.join(reports) or '(none)'} holds {key!r} to plot")
    fig, axes = plt.subplots(1, len(splits), figsize=(4.5 * len(splits), 3.6), squeeze=False)
    for ax, split in zip(axes[0], splits):
        for name, r in reports.items():
            curve = r.get("splits", {}).get(split, {}).get(key) or {}
            points = sorted((int(x), y) for x, y in curve.items() if y is not None)
            if points:
                ax.plot([x for x, _ in points], [y for _, y in points], marker="o", label=name)
        ax.set(title=split, xlabel=xlabel, ylabel=ylabel, ylim=(0, 1.02))
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path = pathlib.Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


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
