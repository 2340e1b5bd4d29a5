"""Stages of the expert-guided recipes (BEPA and its baselines, ARPO task selection), on guijax.stages' Run.

    expert    run the framework expert on every task; keep successes as D_E, extract plans φ(τ^E), convert
              them to UI-TARS trajectories (D_conv)
    level1    BEPA LEVEL-1: the base policy k times per task plain (its pass@k) and k times conditioned on the
              plan; verified plan-conditioned successes are D_self (the cache seeds); the expert-only split is
              D_self minus the tasks the base policy solves (bepa.txt §5.1)
    select    ARPO's valuable-task selection: keep training tasks the base policy solves at least once in k
              (its rollouts are kept for the offline stage)
    offline   ARPO's offline baselines on those rollouts: rft (SFT on successes), dpo, kto
    methods   train every method of `config.compare.methods` from the same base policy with the same budget
              and seeds, each in WORKDIR/methods/NAME, and evaluate it on every split
    table     BEPA-Table-1-style success table (expert-only / train / held-out / overall) of the base policy
              and every method, as table.md and table.json
    diagnostics  BEPA §5.4: token-probability histograms, tail mass and JS divergence of D_conv, D_self and
              on-policy traces under the base policy; the methods' training curves
"""
from __future__ import annotations

import dataclasses
import json
import pathlib
import random
import time
from typing import Any

import jax
import numpy as np
from absl import logging

from envs.atomic import write_text_atomic
from guijax import progress
from guijax.stages import (Run, describe_eval, describe_rl, evaluate_into, output_exists, policy_dir,
                           rl_headline, stage)

# Each method: the algorithm hook, its options, and what it changes in the train section. `seed_cache`:
# "level1" (D_self) or "conv" (converted expert traces). `pre_sft`: SFT epochs on D_conv before RL;
# `rl`: False for the SFT-only baseline.
METHODS: dict[str, dict[str, Any]] = {
    "grpo": {"algorithm": "grpo"},
    "bepa": {"algorithm": "bepa", "seed_cache": "level1"},
    "level1_only": {"algorithm": "bepa", "seed_cache": "level1", "options": {"refresh": False}},
    "level2_only": {"algorithm": "bepa", "seed_cache": "conv"},
    "arpo": {"algorithm": "arpo"},
    "trace_replacement": {"algorithm": "trace_replacement"},
    "luffy": {"algorithm": "luffy", "train": {"loss": "luffy"}},
    "rl_sft": {"algorithm": "rl_sft", "train": {"sft_coef": 1.0}},
    "sft": {"algorithm": "grpo", "pre_sft": True, "rl": False},
    "sft_rl": {"algorithm": "grpo", "pre_sft": True},
}


def _write_shard(directory: pathlib.Path, name: str, trajectories) -> None:
    """A stage's single named shard, replacing one a crashed earlier attempt left behind (shards are
    immutable, and the stage's own marker file is written only after this)."""
    from guijax.data.store import TrajectoryStore

    for stale in directory.glob(f"{name}.*"):
        stale.unlink()
    TrajectoryStore(directory).append(trajectories, name=name)


def _write_json(path: pathlib.Path, data: Any) -> None:
    write_text_atomic(path, json.dumps(data, indent=1))


def all_tasks(run: Run) -> list:
    seen, out = set(), []
    for tasks in run.tasks().values():
        for t in tasks:
            if t.id not in seen:
                seen.add(t.id)
                out.append(t)
    return out


def expert_traces(run: Run) -> dict[str, Any]:
    """{task id: converted expert trajectory (D_conv)} written by the expert stage."""
    from guijax.data.store import TrajectoryStore

    if "expert_traces" not in run._cache:
        directory = run.workdir / "expert_traces"
        if not (run.workdir / "expert.json").exists():
            raise FileNotFoundError(f"{run.workdir}/expert.json missing: add the 'expert' stage before this one")
        run._cache["expert_traces"] = {t.task_id: t for t in TrajectoryStore(directory)}
    return run._cache["expert_traces"]


def plans(run: Run) -> dict[str, list[str]]:
    data = json.loads((run.workdir / "expert.json").read_text())
    return {k: v["plan"] for k, v in data["tasks"].items() if v["success"]}


def _describe_expert(run: Run) -> str:
    b = run.config.bepa
    source = f"recorded traces in {b.expert_dir}" if b.expert_dir else f"the scripted expert (noise {b.expert_noise})"
    return (f"{source} on every task; plans by the {b.plan_extractor} extractor; UI-TARS conversion with "
            f"{b.conversion_thoughts} thoughts")


@stage("expert", _describe_expert, done=output_exists("expert.json"))
def expert(run: Run) -> str:
    from envs.desk import DeskEnv, ScriptedExpert, run_expert
    from guijax.plans import make_extractor
    from guijax.rollout.conversion import THOUGHT_STYLES, convert_trace

    out = run.workdir / "expert.json"
    b, e = run.config.bepa, run.config.env
    if b.conversion_thoughts not in THOUGHT_STYLES:
        raise ValueError(f"bepa.conversion_thoughts={b.conversion_thoughts!r} is not one of {THOUGHT_STYLES}")
    extractor = make_extractor(b.plan_extractor, b.plan_url, b.plan_model, b.plan_api_key_env)
    results, converted = {}, []
    tasks = all_tasks(run)
    recorded = load_recorded_traces(b.expert_dir) if b.expert_dir else None
    env = None if recorded is not None else DeskEnv(tuple(e.screen), e.step_limit, seed=run.config.seed,
                                                     popups=e.popups)
    bar = progress.Progress(len(tasks), "expert", "task")
    for i, task in enumerate(tasks):
        bar.update(1)
        if recorded is not None:
            trace = recorded.get(task.id)
            if trace is None:
                results[task.id] = {"success": False, "steps": 0, "plan": []}
                continue
        else:
            trace = run_expert(env, task, ScriptedExpert(noise=b.expert_noise, seed=run.config.seed * 7 + i))
        ok = trace.reward >= 1.0
        results[task.id] = {"success": ok, "steps": len(trace.steps), "plan": extractor(trace) if ok else []}
        if ok:
            converted.append(convert_trace(trace, thought_style=b.conversion_thoughts))
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
       "split of the solvable pool", done=output_exists("bepa_splits.json"))
def bepa_splits(run: Run) -> str:
    """BEPA §5.1's splits: the pool of tasks solved by the expert or by the base policy (pass@k over
    `bepa.base_pass_k` rollouts); train = `bepa.train_fraction` of the pool plus `bepa.extra_train_tasks`
    others; held-out = the rest. Replaces splits.json (the first split is kept as splits_initial.json)."""
    out = run.workdir / "bepa_splits.json"
    b = run.config.bepa
    expert_ok = {k: v["success"] for k, v in json.loads((run.workdir / "expert.json").read_text())["tasks"].items()}
    policy = run.load_policy(policy_dir(run))
    tasks = all_tasks(run)
    rollouts, _ = run.engine(policy, run.config.rollout.temperature).run(
        policy.params, tasks, b.base_pass_k, jax.random.PRNGKey(run.config.seed + 99), seed=run.config.seed + 4,
        desc="base pass@k")
    base_ok = _successes_by_task(rollouts)
    pool = [t.id for t in tasks if expert_ok.get(t.id) or base_ok.get(t.id, 0) > 0]
    others = [t.id for t in tasks if t.id not in set(pool)]
    rng = random.Random(run.config.seed)
    rng.shuffle(pool)
    n_train = round(b.train_fraction * len(pool))
    train = pool[:n_train] + rng.sample(others, min(b.extra_train_tasks, len(others)))
    held_out = [t.id for t in tasks if t.id not in set(train)]
    initial = run.workdir / "splits_initial.json"
    if not initial.exists():
        initial.write_text((run.workdir / "splits.json").read_text())
    _write_json(run.workdir / "splits.json", {"train": train, "held_out": held_out})
    run._cache.pop("tasks", None)
    _write_json(out, {"base_pass_k": b.base_pass_k, "base_successes": base_ok, "expert_success": expert_ok,
                      "solvable_pool": sorted(pool), "train": train, "held_out": held_out})
    return (f"{len(pool)} of {len(tasks)} tasks solvable by the expert or base pass@{b.base_pass_k}; "
            f"train {len(train)}, held-out {len(held_out)}")


def _describe_level1(run: Run) -> str:
    b = run.config.bepa
    return (f"{b.base_pass_k} plain and {b.level1_rollouts} plan-conditioned base-policy rollouts per training "
            "task: pass@k, D_self and the expert-only split")


@stage("level1", _describe_level1, done=output_exists("level1.json"))
def level1(run: Run) -> str:
    out = run.workdir / "level1.json"
    b = run.config.bepa
    policy = run.load_policy(policy_dir(run))
    engine = run.engine(policy, run.config.rollout.temperature)
    train = run.tasks()["train"]
    key = jax.random.PRNGKey(run.config.seed + 4242)
    plain, _ = engine.run(policy.params, train, b.base_pass_k, key, seed=run.config.seed + 1, desc="plain")
    task_plans = plans(run)
    with_plan = [t for t in train if t.id in task_plans]
    guided, _ = engine.run(policy.params, with_plan, b.level1_rollouts, jax.random.fold_in(key, 1),
                           plans=task_plans, seed=run.config.seed + 2, desc="plan-conditioned")
    base_ok, guided_ok = _successes_by_task(plain), _successes_by_task(guided)
    d_self = [t for t in guided if t.success]
    _write_shard(run.workdir / "level1_base_rollouts", "plain", plain)  # the diagnostics' on-policy reference
    _write_shard(run.workdir / "level1_trajectories", "d_self", d_self)
    expert_only = sorted(k for k, n in guided_ok.items() if n > 0 and base_ok.get(k, 0) == 0)
    splits = json.loads((run.workdir / "splits.json").read_text())
    splits["expert_only"] = expert_only
    _write_json(run.workdir / "splits.json", splits)
    run._cache.pop("tasks", None)
    _write_json(out, {"base_pass_k": b.base_pass_k, "level1_rollouts": b.level1_rollouts,
                      "base_successes": base_ok, "plan_conditioned_successes": guided_ok,
                      "d_self": len(d_self), "expert_only": expert_only})
    return (f"base pass@{b.base_pass_k} solves {sum(n > 0 for n in base_ok.values())}/{len(train)} train "
            f"tasks; plan-conditioned solves {sum(n > 0 for n in guided_ok.values())}/{len(with_plan)}; "
            f"|D_self| = {len(d_self)}; expert-only tasks: {len(expert_only)}")


@stage("select", lambda run: f"{run.config.arpo.selection_rollouts} base-policy rollouts per training task: ARPO's "
       "valuable tasks", done=output_exists("valuable_tasks.json"))
def select(run: Run) -> str:
    """ARPO §3.4: keep the training tasks the base policy solves at least once in k rollouts."""
    out = run.workdir / "valuable_tasks.json"
    policy = run.load_policy(policy_dir(run))
    engine = run.engine(policy, run.config.rollout.temperature)
    train = run.tasks()["train"]
    k = run.config.arpo.selection_rollouts
    rollouts, _ = engine.run(policy.params, train, k, jax.random.PRNGKey(run.config.seed + 77), seed=run.config.seed + 3,
                             desc="selection")
    ok = _successes_by_task(rollouts)
    keep = [t.id for t in train if ok.get(t.id, 0) > 0]
    _write_shard(run.workdir / "selection_rollouts", "rollouts", rollouts)  # the offline stage's fixed data
    _write_json(out, {"rollouts_per_task": k, "successes": ok, "valuable": keep})
    return f"{len(keep)}/{len(train)} training tasks solved at least once in {k} rollouts"


def training_tasks(run: Run, config) -> list:
    """The train split, or with `train.task_filter = "valuable"` the part of it the select stage kept."""
    tasks = run.tasks()["train"]
    if config.train.task_filter == "valuable":
        selected = run.workdir / "valuable_tasks.json"
        if not selected.exists():
            raise FileNotFoundError(f"train.task_filter='valuable' needs {selected}: add the 'select' stage first")
        keep = set(json.loads(selected.read_text())["valuable"])
        tasks = [t for t in tasks if t.id in keep]
        if not tasks:
            raise ValueError("the select stage kept no training task (the base policy solved none); "
                             "nothing to train on with train.task_filter='valuable'")
    elif config.train.task_filter:
        raise ValueError(f"unknown train.task_filter {config.train.task_filter!r}; choose '' or 'valuable'")
    return tasks


def method_config(run: Run, name: str):
    """The run's config with a method's algorithm and train overrides applied."""
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r} in compare.methods; available: {sorted(METHODS)}")
    spec = METHODS[name]
    config = run.config.copy_and_resolve_references()
    config.algorithm.name = spec["algorithm"]
    for k, v in spec.get("train", {}).items():
        config.train[k] = v
    return config, spec


def make_hook(run: Run, workdir: pathlib.Path, spec: dict[str, Any], config):
    from guijax.algorithms import make_algorithm
    from guijax.data.store import TrajectoryStore

    hook_options = dict(spec.get("options", {}))
    if spec["algorithm"] == "bepa":
        hook_options["update_rule"] = config.bepa.update_rule
    if spec["algorithm"] == "arpo":
        hook_options["buffer_size"] = config.arpo.buffer_size
    traces = expert_traces(run) if (run.workdir / "expert.json").exists() else {}
    hook = make_algorithm(spec["algorithm"], store=TrajectoryStore(workdir / "algorithm_trajectories"),
                          expert_traces=traces, seed=config.seed, **hook_options)
    seed = spec.get("seed_cache") or ""
    if seed and spec["algorithm"] != "bepa":
        raise ValueError(f"seed_cache={seed!r} is for the bepa algorithm, not {spec['algorithm']!r}")
    if seed == "level1":
        hook.seed_cache(TrajectoryStore(run.workdir / "level1_trajectories"))
    elif seed == "conv":
        hook.seed_cache(traces.values())
    elif seed:
        raise ValueError(f"unknown algorithm.seed_cache {seed!r}; choose 'level1', 'conv' or ''")
    return hook


def train_method(run: Run, name: str) -> pathlib.Path:
    """Train one method from the base policy in WORKDIR/methods/NAME; returns its trained model directory."""
    from guijax.metrics import MetricsWriter
    from guijax.models.policy import save_pretrained
    from guijax.trainer import Components, Trainer, pipeline_config, sft_steps

    config, spec = method_config(run, name)
    workdir = run.workdir / "methods" / name
    final = workdir / "trained_model"
    if (final / "config.json").exists():
        return final
    workdir.mkdir(parents=True, exist_ok=True)
    policy = run.load_policy(policy_dir(run))
    if spec.get("pre_sft"):
        traces = [t for t in expert_traces(run).values() if t.task_id in {x.id for x in run.tasks()["train"]}]
        writer = MetricsWriter(workdir, "sft_metrics.jsonl", console=False)
        steps = max(1, config.compare.sft_epochs * sum(len(t.steps) for t in traces) // config.sft.batch_size)
        config.sft.learning_rate = config.compare.sft_learning_rate  # fine-tuning, not the fresh model's warm start
        policy.params, _ = sft_steps(policy, traces, policy.processor, config, pipeline_config(config, run.system_prompt),
                                     steps, config.sft.batch_size, seed=config.seed, log=writer.write,
                                     checkpoint_dir=workdir / "sft_checkpoints", desc=f"{name} sft")
        writer.close()
    if spec.get("rl", True):
        parts = Components(policy, run.pool(), policy.processor, training_tasks(run, config),
                           make_hook(run, workdir, spec, config),
                           run.system_prompt, run.mesh())
        trainer = Trainer(config, workdir, parts)
        trainer.maybe_restore()
        trainer.fit(desc=name)
        trainer.close()
        policy.params = trainer.state.params
    save_pretrained(policy, final)
    return final


def _method_done(run: Run, name: str) -> bool:
    return (run.workdir / "methods" / name / "eval.json").exists()


def _describe_method(run: Run, name: str) -> str:
    config, spec = method_config(run, name)
    parts = []
    if spec.get("pre_sft"):
        parts.append(f"{config.compare.sft_epochs} SFT epochs on D_conv")
    if spec.get("rl", True):
        parts.append(f"RL ({spec['algorithm']}): {describe_rl(config)}")
    return "; ".join(parts) + "; then evaluation"


@stage("methods", lambda run: f"train and evaluate {', '.join(run.config.compare.methods)} from the same base policy",
       done=lambda run: all(_method_done(run, m) for m in run.config.compare.methods))
def methods(run: Run) -> str:
    names = list(run.config.compare.methods)
    results = {}
    for i, name in enumerate(names, 1):
        tag = f"  method {i}/{len(names)} {name}"
        if _method_done(run, name):
            progress.echo(f"{tag}: already done, skipped")
            continue
        progress.echo(f"{tag}: {_describe_method(run, name)}")
        start = time.perf_counter()
        report_path = run.workdir / "methods" / name / "eval.json"
        results[name] = evaluate_into(run, train_method(run, name), report_path)
        progress.echo(f"{tag}: done in {progress.format_duration(time.perf_counter() - start)}; {results[name]}")
    return f"{len(results)} trained" + (f" ({', '.join(results)})" if results else "")


def overall(report: dict[str, Any], splits: dict[str, list]) -> float | None:
    """Success over every task once (train ∪ held-out), weighting each split by its task count."""
    parts = [(report["splits"][s]["success_rate"], len(splits[s])) for s in ("train", "held_out")
             if s in report["splits"] and report["splits"][s].get("tasks")]
    n = sum(w for _, w in parts)
    return sum(r * w for r, w in parts) / n if n else None


def _offline_done(run: Run) -> bool:
    return all((run.workdir / "methods" / m / "eval.json").exists() for m in run.config.arpo.offline_methods)


@stage("offline", lambda run: f"ARPO's offline baselines {', '.join(run.config.arpo.offline_methods) or '(none)'}: "
       f"{run.config.arpo.offline_steps} steps each on the select stage's rollouts, then evaluation",
       done=_offline_done)
def offline(run: Run) -> str:
    """ARPO's offline baselines on the select stage's rollouts: rft (SFT on successes), dpo, kto."""
    from guijax.data.store import TrajectoryStore
    from guijax.metrics import MetricsWriter
    from guijax.models.policy import save_pretrained
    from guijax.offline import preference_train
    from guijax.trainer import pipeline_config, sft_steps

    a = run.config.arpo
    source = run.workdir / "selection_rollouts"
    if not any(source.glob("*.array_record")):
        raise FileNotFoundError(f"{source} is empty: the offline stage trains on the select stage's rollouts")
    rollouts = list(TrajectoryStore(source))
    pipeline = pipeline_config(run.config, run.system_prompt)
    results = {}
    for name in a.offline_methods:
        workdir = run.workdir / "methods" / name
        report_path = workdir / "eval.json"
        if report_path.exists():
            continue
        model_dir = workdir / "trained_model"
        if not (model_dir / "config.json").exists():
            workdir.mkdir(parents=True, exist_ok=True)
            policy = run.load_policy(policy_dir(run))
            writer = MetricsWriter(workdir, "offline_metrics.jsonl", console=False)
            if name == "rft":
                wins = [t for t in rollouts if t.success]
                if not wins:
                    raise ValueError("rft: the select stage's rollouts hold no success to fine-tune on")
                policy.params, hist = sft_steps(policy, wins, policy.processor, run.config, pipeline, a.offline_steps,
                                                run.config.sft.batch_size, seed=run.config.seed, log=writer.write)
            elif name in ("dpo", "kto"):
                policy.params, hist = preference_train(policy, name, rollouts, run.config, pipeline, a.offline_steps,
                                                       a.offline_batch_trajectories, seed=run.config.seed,
                                                       beta=a.offline_beta, log=writer.write)
            else:
                raise ValueError(f"unknown offline method {name!r}; choose rft, dpo or kto")
            writer.close()
            progress.echo(f"  offline {name}: loss {hist[0]:.4f} -> {hist[-1]:.4f} over {len(hist)} steps")
            save_pretrained(policy, model_dir)
        results[name] = evaluate_into(run, model_dir, report_path)
        progress.echo(f"  offline {name}: {results[name]}")
    return f"{len(results)} evaluated"


@stage("table", lambda run: "success per split of the base policy and every method (table.md, table.json)")
def table(run: Run) -> str:
    rows: dict[str, dict[str, Any]] = {}
    base = run.workdir / "eval_base.json"
    if base.exists():
        rows["base policy"] = json.loads(base.read_text())
    for name in tuple(run.config.compare.methods) + tuple(run.config.arpo.offline_methods):
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
    _write_json(run.workdir / "table.json", data)
    progress.echo(f"\n{run.config.name}: success rate by split (tasks in parentheses)\n\n{text}\n")
    return f"{len(rows)} policies in {run.workdir / 'table.md'}"


@stage("diagnostics", lambda run: "token-probability histograms, tail mass and JS divergence of D_conv, D_self and "
       "on-policy traces; the methods' training curves", done=output_exists("diagnostics.json"))
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
            "D_conv": [t for k, t in expert_traces(run).items() if k in train_ids]}
    pipeline = pipeline_config(run.config, run.system_prompt)
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
