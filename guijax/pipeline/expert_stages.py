"""Stages of the expert-guided recipes (BEPA's expert, splits and LEVEL-1; ARPO's task selection; BEPA's
diagnostics):

    expert       run the framework expert on every task; keep successes as D_E, extract plans φ(τ^E), convert
                 them to UI-TARS trajectories (D_conv)
    bepa_splits  BEPA §5.1's train / held-out split of the pool solvable by the expert or base pass@k
    level1       BEPA LEVEL-1: the base policy k times per task plain (its pass@k) and k times conditioned on
                 the plan; verified plan-conditioned successes are D_self (the cache seeds); the expert-only
                 split is D_self minus the tasks the base policy solves (bepa.txt §5.1)
    select       ARPO's valuable-task selection: keep training tasks the base policy solves at least once in k
                 (its rollouts are kept for the offline methods)
    diagnostics  BEPA §5.4: token-probability histograms, tail mass and JS divergence of D_conv, D_self and
                 on-policy traces under the base policy; the methods' training curves
"""
from __future__ import annotations

import json
import pathlib
from typing import Any

from envs.atomic import write_text_atomic
from guijax import progress
from guijax.data.store import write_named_shard as _write_shard  # each stage's single named shard
from guijax.pipeline.base_stages import BASE_POLICY, ROLLOUT_READS, SPLITS, policy_dir
from guijax.pipeline.run import Run
from guijax.pipeline.stage import output_exists, stage


def _write_json(path: pathlib.Path, data: Any) -> None:
    write_text_atomic(path, json.dumps(data, indent=1))


def plans(run: Run) -> dict[str, list[str]]:
    data = json.loads((run.workdir / "expert.json").read_text())
    return {k: v["plan"] for k, v in data["tasks"].items() if v["success"]}


def _describe_expert(run: Run) -> str:
    b = run.config.bepa
    source = f"recorded traces in {b.expert_dir}" if b.expert_dir else f"the scripted expert (noise {b.expert_noise})"
    return (f"{source} on every task; plans by the {b.plan_extractor} extractor; converted to the "
            f"{run.grammar} grammar with {b.conversion_thoughts} thoughts")


@stage("expert", _describe_expert, done=output_exists("expert.json"),
       reads=("seed", "env", "bepa.expert_dir", "bepa.expert_noise", "bepa.plan_extractor", "bepa.plan_url",
              "bepa.plan_model", "bepa.conversion_thoughts", "rollout.prompt"), needs=("tasks",),
       outputs=("expert.json", "expert_traces"))
def expert(run: Run) -> str:
    from envs.desk import DeskEnv, ScriptedExpert, run_expert
    from guijax.plans import make_extractor
    from guijax.rollout.conversion import THOUGHT_STYLES, convert_trace
    out = run.workdir / "expert.json"
    b, e = run.config.bepa, run.config.env
    if b.conversion_thoughts not in THOUGHT_STYLES:
        raise ValueError(f"bepa.conversion_thoughts={b.conversion_thoughts!r} is not one of {THOUGHT_STYLES}")
    extractor = make_extractor(b.plan_extractor, b.plan_url, b.plan_model, b.plan_api_key_env)
    grammar = run.grammar
    results, converted = {}, []
    tasks = run.all_tasks()
    recorded = load_recorded_traces(b.expert_dir) if b.expert_dir else None
    env = None if recorded is not None else DeskEnv(tuple(e.screen), e.step_limit,
                                                     seed=run.streams.seed_for("expert", "env"), popups=e.popups)
    bar = progress.Progress(len(tasks), "expert", "task")
    for i, task in enumerate(tasks):
        bar.update(1)
        if recorded is not None:
            trace = recorded.get(task.id)
            if trace is None:
                results[task.id] = {"success": False, "steps": 0, "plan": []}
                continue
        else:
            trace = run_expert(env, task, ScriptedExpert(noise=b.expert_noise,
                                                             seed=run.streams.seed_for("expert", task.id)))
        ok = trace.reward >= 1.0
        results[task.id] = {"success": ok, "steps": len(trace.steps), "plan": extractor(trace) if ok else []}
        if ok:
            converted.append(convert_trace(trace, run.config.rollout.coordinate_model, thought_style=b.conversion_thoughts,
                                           grammar=grammar))
    bar.close()
    _write_shard(run.workdir / "expert_traces", "expert", converted)
    _write_json(out, {"expert_noise": b.expert_noise, "conversion_thoughts": b.conversion_thoughts,
                      "tasks": results})
    source = f"recorded traces in {b.expert_dir}" if recorded is not None else f"scripted expert, noise {b.expert_noise}"
    return f"{len(converted)}/{len(tasks)} tasks solved ({source}); plans by the {b.plan_extractor} extractor"


def load_recorded_traces(directory: str) -> dict[str, Any]:
    """{task id: ExpertTrace} from folders holding trace.json + step PNGs (ExpertTrace.save's layout)."""
    from envs.desk.expert import ExpertTrace

    root = pathlib.Path(directory)
    if not root.is_dir():
        raise FileNotFoundError(f"bepa.expert_dir {root} is not a directory")
    traces = {}
    for path in sorted(root.rglob("trace.json")):
        try:
            trace = ExpertTrace.load(path.parent)
        except (ValueError, KeyError, OSError) as err:
            raise ValueError(f"expert trace {path}: {err}") from err
        traces.setdefault(trace.task_id, trace)
    if not traces:
        raise FileNotFoundError(f"no expert traces (*/trace.json) under bepa.expert_dir {root}")
    return traces


def _successes_by_task(rollouts) -> dict[str, int]:
    out: dict[str, int] = {}
    for t in rollouts:
        out[t.task_id] = out.get(t.task_id, 0) + int(t.success)
    return out


@stage("bepa_splits", lambda run: f"base pass@{run.config.bepa.base_pass_k} on every task; BEPA's train / held-out "
       "split of the solvable pool", done=output_exists("bepa_splits.json"),
       reads=ROLLOUT_READS + ("bepa.base_pass_k", "bepa.train_fraction", "bepa.extra_train_tasks"),
       needs=BASE_POLICY + ("tasks", "expert"), outputs=("bepa_splits.json",))
def bepa_splits(run: Run) -> str:
    """BEPA §5.1's splits: the pool of tasks solved by the expert or by the base policy (pass@k over
    `bepa.base_pass_k` rollouts); train = `bepa.train_fraction` of the pool plus `bepa.extra_train_tasks`
    others; held-out = the rest. Replaces splits.json (the first split is kept as splits_initial.json)."""
    out = run.workdir / "bepa_splits.json"
    b = run.config.bepa
    expert_ok = {k: v["success"] for k, v in json.loads((run.workdir / "expert.json").read_text())["tasks"].items()}
    policy = run.load_policy(policy_dir(run))
    tasks = run.all_tasks()
    rollouts, _ = run.engine(policy, run.config.rollout.temperature).run(
        policy.params, tasks, b.base_pass_k, run.streams.key("bepa_splits", "sampling"),
        seed=run.streams.seed_for("bepa_splits", "episodes"), desc="base pass@k")
    base_ok = _successes_by_task(rollouts)
    pool = [t.id for t in tasks if expert_ok.get(t.id) or base_ok.get(t.id, 0) > 0]
    others = [t.id for t in tasks if t.id not in set(pool)]
    rng = run.streams.python("bepa_splits", "split")
    rng.shuffle(pool)
    n_train = round(b.train_fraction * len(pool))
    train = pool[:n_train] + rng.sample(others, min(b.extra_train_tasks, len(others)))
    held_out = [t.id for t in tasks if t.id not in set(train)]
    initial = run.workdir / "splits_initial.json"
    if not initial.exists():
        initial.write_text((run.workdir / "splits.json").read_text())
    _write_json(run.workdir / "splits.json", {"train": train, "held_out": held_out})
    run.forget_tasks()
    _write_json(out, {"base_pass_k": b.base_pass_k, "base_successes": base_ok, "expert_success": expert_ok,
                      "solvable_pool": sorted(pool), "train": train, "held_out": held_out})
    return (f"{len(pool)} of {len(tasks)} tasks solvable by the expert or base pass@{b.base_pass_k}; "
            f"train {len(train)}, held-out {len(held_out)}")


def _describe_level1(run: Run) -> str:
    b = run.config.bepa
    return (f"{b.base_pass_k} plain and {b.level1_rollouts} plan-conditioned base-policy rollouts per training "
            "task: pass@k, D_self and the expert-only split")


@stage("level1", _describe_level1, done=output_exists("level1.json"),
       reads=ROLLOUT_READS + ("bepa.base_pass_k", "bepa.level1_rollouts"),
       needs=BASE_POLICY + ("tasks", "bepa_splits", "expert"),
       outputs=("level1.json", "level1_base_rollouts", "level1_trajectories"))
def level1(run: Run) -> str:
    out = run.workdir / "level1.json"
    b = run.config.bepa
    policy = run.load_policy(policy_dir(run))
    engine = run.engine(policy, run.config.rollout.temperature)
    train = run.tasks()["train"]
    plain, _ = engine.run(policy.params, train, b.base_pass_k, run.streams.key("level1", "plain", "sampling"),
                          seed=run.streams.seed_for("level1", "plain", "episodes"), desc="plain")
    task_plans = plans(run)
    with_plan = [t for t in train if t.id in task_plans]
    guided, _ = engine.run(policy.params, with_plan, b.level1_rollouts, run.streams.key("level1", "guided", "sampling"),
                           plans=task_plans, seed=run.streams.seed_for("level1", "guided", "episodes"),
                           desc="plan-conditioned")
    base_ok, guided_ok = _successes_by_task(plain), _successes_by_task(guided)
    d_self = [t for t in guided if t.success]
    _write_shard(run.workdir / "level1_base_rollouts", "plain", plain)  # the diagnostics' on-policy reference
    _write_shard(run.workdir / "level1_trajectories", "d_self", d_self)
    expert_only = sorted(k for k, n in guided_ok.items() if n > 0 and base_ok.get(k, 0) == 0)
    splits = json.loads((run.workdir / "splits.json").read_text())
    splits["expert_only"] = expert_only
    _write_json(run.workdir / "splits.json", splits)
    run.forget_tasks()
    _write_json(out, {"base_pass_k": b.base_pass_k, "level1_rollouts": b.level1_rollouts,
                      "base_successes": base_ok, "plan_conditioned_successes": guided_ok,
                      "d_self": len(d_self), "expert_only": expert_only})
    return (f"base pass@{b.base_pass_k} solves {sum(n > 0 for n in base_ok.values())}/{len(train)} train "
            f"tasks; plan-conditioned solves {sum(n > 0 for n in guided_ok.values())}/{len(with_plan)}; "
            f"|D_self| = {len(d_self)}; expert-only tasks: {len(expert_only)}")


@stage("select", lambda run: f"{run.config.arpo.selection_rollouts} base-policy rollouts per training task: ARPO's "
       "valuable tasks", done=output_exists("valuable_tasks.json"), reads=ROLLOUT_READS + ("arpo.selection_rollouts",),
       needs=BASE_POLICY + ("tasks", "bepa_splits"), outputs=("valuable_tasks.json", "selection_rollouts"))
def select(run: Run) -> str:
    """ARPO §3.4: keep the training tasks the base policy solves at least once in k rollouts."""
    out = run.workdir / "valuable_tasks.json"
    policy = run.load_policy(policy_dir(run))
    engine = run.engine(policy, run.config.rollout.temperature)
    train = run.tasks()["train"]
    k = run.config.arpo.selection_rollouts
    rollouts, _ = engine.run(policy.params, train, k, run.streams.key("select", "sampling"),
                             seed=run.streams.seed_for("select", "episodes"), desc="selection")
    ok = _successes_by_task(rollouts)
    keep = [t.id for t in train if ok.get(t.id, 0) > 0]
    _write_shard(run.workdir / "selection_rollouts", "rollouts", rollouts)  # the offline stage's fixed data
    _write_json(out, {"rollouts_per_task": k, "successes": ok, "valuable": keep})
    return f"{len(keep)}/{len(train)} training tasks solved at least once in {k} rollouts"


@stage("diagnostics", lambda run: "token-probability histograms, tail mass and JS divergence of D_conv, D_self and "
       "on-policy traces; the methods' training curves", done=output_exists("diagnostics.json"),
       reads=ROLLOUT_READS + ("train.logprob_impl", "compare.methods"),
       needs=BASE_POLICY + SPLITS + ("expert", "methods"),
       outputs=("diagnostics.json", "diagnostics.png", "curves_methods.png"))
def diagnostics(run: Run) -> str:
    """BEPA §5.4 under the base policy: token-probability histograms, tail mass Pr(p < 0.2) and JS divergence
    to the on-policy reference for D_conv, D_self and the base policy's own rollouts (diagnostics.json/.png),
    and the methods' training curves: entropy, log-prob of on-policy successes and of injected traces,
    cache update frequency, success (curves_methods.png)."""
    from guijax import diagnostics as diag
    from guijax.data.store import TrajectoryStore
    from guijax.metrics import read_metrics
    from guijax.train_step import make_logprob_fn
    from guijax.trainer import pipeline_config

    out = run.workdir / "diagnostics.json"
    policy = run.load_policy(policy_dir(run))
    logprob_fn = make_logprob_fn(policy.module, run.config.rollout.temperature, run.config.train.logprob_impl,
                                 policy.mesh)
    train_ids = {t.id for t in run.tasks()["train"]}
    plain = list(TrajectoryStore(run.workdir / "level1_base_rollouts"))
    successes = [t for t in plain if t.success]
    sets = {"on_policy": successes or [t for t in plain if t.steps],
            "D_self": [t.without_plan() for t in TrajectoryStore(run.workdir / "level1_trajectories")],
            "D_conv": [t for k, t in run.expert_traces().items() if k in train_ids]}
    pipeline = pipeline_config(run.config, run.system_prompt, policy.mesh)
    probs = {k: diag.token_probabilities(logprob_fn, policy.params, v, policy.processor, policy.module.cfg, pipeline)
             for k, v in sets.items() if v}
    summary = diag.summarize(probs, "on_policy")
    summary["_reference"] = {"on_policy": "successful plain rollouts of the base policy" if successes
                             else "all plain rollouts of the base policy (it had no success)"}
    summary["_D_self_vs_D_conv"] = diag.same_responses(sets["D_self"], {t.task_id: t for t in sets["D_conv"]})
    diag.plot_histograms({k: v for k, v in summary.items() if not k.startswith("_")},
                         run.workdir / "diagnostics.png", "token probabilities under the base policy")
    expert_only = {t.id for t in run.tasks().get("expert_only", [])}
    summary["_expert_only_on_policy_during_training"] = {
        name: diag.on_policy_successes(TrajectoryStore(path), expert_only)
        for name in run.config.compare.methods if (path := run.workdir / "methods" / name / "trajectories").exists()}
    curves = {}
    for name in run.config.compare.methods:
        path = run.workdir / "methods" / name / "metrics.jsonl"
        if path.exists():
            curves[name] = [r for r in read_metrics(path) if "iteration" in r]
    if curves:
        _plot_method_curves(curves, run.workdir / "curves_methods.png")
    _write_json(out, summary)  # last: its presence marks the stage done
    for name, s in summary.items():
        if not name.startswith("_"):
            js = s.get("js_to_on_policy")
            progress.echo(f"  {name}: {s['tokens']} tokens, tail mass {100 * s['tail_mass_p_lt_0.2']:.1f}%, "
                          f"JS to on-policy {js if js is None else round(js, 4)}")
    for name, n in summary["_expert_only_on_policy_during_training"].items():
        progress.echo(f"  {name}: {n['successes']} of {n['episodes']} sampled episodes on expert-only tasks succeeded")
    same = summary["_D_self_vs_D_conv"]
    return (f"{same['same_as_reference']} of {same['trajectories']} D_self trajectories repeat the D_conv trace of "
            f"their task response for response; {run.workdir / 'diagnostics.png'}")


def _plot_method_curves(curves: dict[str, list[dict[str, Any]]], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [("success_rate", "training success"), ("entropy", "policy entropy"),
            ("logp_success_on_policy", "log-prob of on-policy successes"),
            ("logp_injected", "log-prob of injected traces (θ_old)"),
            ("cache_update_frequency", "cache update frequency")]
    fig, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 3.2))
    for ax, (key, title) in zip(axes, keys):
        for i, (name, records) in enumerate(curves.items()):
            pts = [(r["iteration"], r[key]) for r in records if r.get(key) is not None]
            if pts:  # one colour per method in every panel, also where other methods have no points
                ax.plot(*zip(*pts), marker="o", label=name, color=f"C{i}")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("iteration")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
