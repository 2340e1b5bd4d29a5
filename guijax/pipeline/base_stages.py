"""The stages every recipe draws on:

    base_model   fresh preset checkpoint (random init + local tokenizer), unless model.path is given
    tasks        synthetic-desk tasks (generation-as-validation) or OSWorld tasks, and their splits
    sft          short supervised warm start on scripted-expert traces -> the base policy (sft_model/)
    eval_base    success of the base policy per split (eval_base.json)
    rl           the RL loop with the recipe's method (`config.method`): checkpoints/, metrics.jsonl
    eval_final   success of the trained policy (eval_final.json)
    report       report.md with the results table and curves.png
"""
from __future__ import annotations

import dataclasses
import json
import logging
import pathlib
from typing import Any

import ml_collections

from envs.atomic import write_text_atomic
from guijax.pipeline.run import Run
from guijax.pipeline.stage import output_exists, stage

# What results depend on (guijax.pipeline.records): config read by stages that run the policy, train it or
# evaluate it, and the stages whose files they read (the splits, the base policy).
ROLLOUT_READS = ("seed", "model", "env", "rollout", "pipeline")
TRAIN_READS = ROLLOUT_READS + ("train", "optim", "sft", "lora")
EVAL_READS = ROLLOUT_READS + ("eval",)
SPLITS = ("tasks", "bepa_splits", "level1")  # each rewrites splits.json
BASE_POLICY = ("base_model", "sft")
RL_OUTPUTS = ("trained_model", "trained_model_adapter", "checkpoints", "metrics.jsonl", "trajectories",
              "algorithm_trajectories", "expert_sft_checkpoints", "expert_sft_metrics.jsonl", "offline_metrics.jsonl",
              "step_dpo_pairs.json", "rounds", "sgcd_metrics.jsonl", "phases", "seagent_metrics.jsonl",
              "engine_adapters")


def _describe_base_model(run: Run) -> str:
    if run.config.model.path:
        return f"check the checkpoint at model.path {run.config.model.path}"
    return f"a fresh {run.config.model.preset} checkpoint with a locally trained tokenizer"


@stage("base_model", _describe_base_model,
       done=lambda run: not run.config.model.path and (run.base_model_dir / "config.json").exists(),
       reads=("seed", "model.path", "model.preset", "model.tokenizer_vocab"), outputs=("base_model",))
def base_model(run: Run) -> str:
    from guijax.models.fresh import create_checkpoint

    if run.config.model.path:
        if not (run.base_model_dir / "config.json").exists():
            raise FileNotFoundError(f"model.path {run.base_model_dir} has no config.json")
        return f"{run.base_model_dir} has a config.json"
    create_checkpoint(run.base_model_dir, run.config.model.preset, seed=run.streams.seed_for("base_model"),
                      tokenizer_vocab=run.config.model.tokenizer_vocab, mesh=run.mesh())
    return f"written to {run.base_model_dir}"


def _describe_tasks(run: Run) -> str:
    e = run.config.env
    if e.kind == "osworld":
        return f"load the OSWorld tasks of {e.osworld_split or e.osworld_dir} and split them"
    families = ", ".join(e.families) if e.families else "every family"
    return f"generate {e.num_tasks} synthetic-desk tasks ({families}) and split them train / held-out"


@stage("tasks", _describe_tasks, done=output_exists("splits.json"), reads=("seed", "env"),
       outputs=("tasks.json", "splits.json", "splits_initial.json"))
def tasks(run: Run) -> str:
    from envs.tasks import generate_desk_tasks, save_tasks, split_tasks

    e = run.config.env
    if e.kind == "osworld":
        from envs.osworld.loader import load_osworld, load_split

        if not e.osworld_dir:
            raise ValueError("env.kind='osworld' needs env.osworld_dir (OSWorld's evaluation_examples folder)")
        loaded = load_split(e.osworld_split, e.osworld_dir) if e.osworld_split else load_osworld(e.osworld_dir)
        generated = [t.task for t in loaded]
    else:
        generated = generate_desk_tasks(e.num_tasks, seed=run.streams.seed_for("tasks", "generate"), families=list(e.families) or None,
                                        screen_hw=tuple(e.screen))
    splits = split_tasks(generated, held_out_families=list(e.held_out_families), held_out_fraction=e.held_out_fraction,
                         seed=run.streams.seed_for("tasks", "split"))
    save_tasks(generated, run.workdir / "tasks.json")
    write_text_atomic(run.workdir / "splits.json", json.dumps({k: [t.id for t in v] for k, v in splits.items()}, indent=1))
    return f"{len(splits['train'])} train, {len(splits['held_out'])} held-out"


def expert_trajectories(run: Run, task_list) -> list:
    """Converted successful scripted-expert traces (`sft.traces_per_task` per task); each carries the plan
    φ(τ) of the rule-based extractor in meta["phi_plan"] for plan-conditioned SFT examples."""
    from envs.desk import DeskEnv, ScriptedExpert, run_expert
    from guijax.plans import RulePlanExtractor
    from guijax.rollout.conversion import convert_trace
    e = run.config.env
    env = DeskEnv(tuple(e.screen), e.step_limit, seed=run.streams.seed_for("sft", "env"), popups=e.popups)
    grammar = run.grammar
    extractor = RulePlanExtractor()
    out = []
    for i, task in enumerate(task_list):
        for k in range(run.config.sft.traces_per_task):
            trace = run_expert(env, task, ScriptedExpert(noise=run.config.sft.expert_noise,
                                                         seed=run.streams.seed_for("sft", "expert", task.id, k)))
            if trace.reward >= 1.0:
                converted = convert_trace(trace, run.config.rollout.coordinate_model, grammar=grammar)
                converted.meta["phi_plan"] = extractor(trace)
                out.append(converted)
    return out


def sft_trajectories(run: Run) -> list:
    """The warm start's data: expert traces of the training tasks (of `sft.families` when set), plus a
    `sft.plan_fraction` share repeated with the plan appended to the instruction, so the base policy knows
    what a plan is (a released UI-TARS model reads one as ordinary instruction text). Families in
    `sft.plan_only_families` appear only with their plan: the base policy can follow a plan there but
    has never solved the bare instruction, the situation BEPA's LEVEL-1 is built for. With
    `sft.conditioning='skill'` the repeated traces carry the task's SGCD skill instead (SGCD's skill-guided
    policy, the same situation)."""
    s = run.config.sft
    unknown = sorted(set(s.plan_only_families) - set(run.config.env.families)) if run.config.env.families else []
    if unknown:
        raise ValueError(f"sft.plan_only_families {unknown} are not in env.families {list(run.config.env.families)}")
    tasks = [t for t in run.tasks()["train"]
             if not s.families or t.domain in s.families or t.domain in s.plan_only_families]
    trajectories = expert_trajectories(run, tasks)
    domain = {t.id: t.domain for t in tasks}
    rng = run.streams.python("sft", "plan_fraction")
    conditioned = _skill_conditioned(run, tasks) if s.conditioning == "skill" else None
    plain, planned = [], []
    for t in trajectories:
        plan_only = domain[t.task_id] in s.plan_only_families
        if not plan_only:
            plain.append(t)
        if plan_only or rng.random() < s.plan_fraction:
            planned.append(dataclasses.replace(t, plan=tuple(t.meta["phi_plan"])) if conditioned is None else
                           dataclasses.replace(t, meta=t.meta | {"guidance": conditioned[t.task_id]}))
    return plain + planned


def _skill_conditioned(run: Run, tasks) -> dict[str, str]:
    """{task id: its SGCD skill as the skill-guided policy reads it}, from the desk's ground truth alone."""
    from guijax.sgcd.desk_skills import DeskSkillExtractor

    e = run.config.env
    if e.kind != "desk":
        raise ValueError(f"sft.conditioning='skill' writes skills from the synthetic desk's ground truth; env.kind is "
                         f"{e.kind!r}")
    extractor = DeskSkillExtractor(tuple(e.screen), e.popups, grammar=run.grammar)
    return {t.id: extractor.extract(t, [], []).render() for t in tasks}


def _describe_sft(run: Run) -> str:
    s = run.config.sft
    if s.data == "coldstart":
        return (f"cold start: {s.steps} steps of {s.batch_size} steps of the coldstart stage's hindsight-annotated "
                f"traces at lr {s.learning_rate:g}")
    extra = (f"; {s.conditioning}-conditioned copies of {list(s.plan_only_families) + ['a share of the rest']}"
             if s.plan_fraction or s.plan_only_families else "")
    noise = (f", noise {s.expert_noise:g} ({'its actions without loss' if s.noisy_steps == 'mask' else 'trained'})"
             if s.expert_noise else "")
    return (f"warm start: {s.steps} steps of {s.batch_size} expert-trace steps at lr {s.learning_rate:g} "
            f"({s.traces_per_task} scripted-expert traces per training task{noise}{extra})")


@stage("sft", _describe_sft,
       done=lambda run: run.config.sft.steps == 0 or (run.workdir / "sft_model" / "config.json").exists(),
       reads=("seed", "model", "lora", "env", "sft", "optim", "pipeline", "rollout.prompt", "rollout.max_images",
              "train.minibatch_size", "train.logprob_impl"),
       needs=("base_model", "tasks", "bepa_splits", "coldstart"),
       outputs=("sft_model", "sft_model_adapter", "sft_metrics.jsonl", "sft_checkpoints"))
def sft(run: Run) -> str:
    from guijax.metrics import MetricsWriter
    from guijax.sft import sft_steps
    from guijax.trainer import pipeline_config

    out = run.workdir / "sft_model"
    policy = run.load_policy(run.base_model_dir, trains=run.config)
    refs = None
    if run.config.sft.data == "coldstart":
        from guijax.methods.base import stage_rollouts
        from guijax.pipeline.coldstart_stages import coldstart_refs

        trajectories = stage_rollouts(run.workdir, "coldstart_trajectories", "coldstart", "sft.data='coldstart'")
        refs = coldstart_refs(trajectories)
    else:
        trajectories = sft_trajectories(run)
        if run.config.sft.noisy_steps == "mask":
            refs = clean_step_refs(trajectories)
    too_long = answers_beyond_budget(trajectories, refs, policy.processor.tokenizer, run.config.rollout.max_new_tokens)
    if too_long:
        logging.warning("sft: %s", too_long)
    writer = MetricsWriter(run.workdir, "sft_metrics.jsonl", console=False)
    params, losses_seen = sft_steps(policy, trajectories, policy.processor, run.config,
                                    pipeline_config(run.config, run.system_prompt, policy.mesh), run.config.sft.steps,
                                    run.config.sft.batch_size, seed=run.streams.seed_for("sft", "data"),
                                    log=writer.write,
                                    checkpoint_dir=run.workdir / "sft_checkpoints",
                                    checkpoint_every=run.config.sft.checkpoint_every, refs=refs)
    writer.close()
    policy.params = params
    run.save_trained(policy, out)
    kind = "cold-start" if run.config.sft.data == "coldstart" else "expert"
    masked = "" if refs is None or kind == "cold-start" else (
        f" ({sum(len(t.steps) for t in trajectories) - len(refs)} injected noise steps without loss)")
    return (f"{len(trajectories)} {kind} trajectories{masked}, loss {losses_seen[0]:.3f} -> {losses_seen[-1]:.3f}"
            + (f"; {too_long}" if too_long else ""))


def answers_beyond_budget(trajectories, refs, tokenizer, max_new_tokens: int) -> str:
    """What to warn of when the trained answers are longer than the rollouts let the policy write: every one
    it then samples is cut off before its action (an hour of training spent on a policy that cannot act)."""
    from guijax.data.pipeline import response_length, step_refs

    lengths = [response_length(trajectories[r.trajectory].steps[r.step], tokenizer)
               for r in (refs if refs is not None else step_refs(trajectories))]
    over = [n for n in lengths if n > max_new_tokens]
    if not over:
        return ""
    return (f"{len(over)} of {len(lengths)} trained answers are longer than rollout.max_new_tokens={max_new_tokens} "
            f"(up to {max(over)} tokens): the policy's own answers will be cut off before their action")


def clean_step_refs(trajectories) -> list:
    """Every step but the ones the expert's noise chose: those stay in the later steps' history, so the
    recovery is learned from the state the mistake made, without learning the mistake."""
    from guijax.data.pipeline import StepRef

    refs = []
    for i, t in enumerate(trajectories):
        injected = set(t.meta.get("injected_steps", ()))
        refs += [StepRef(i, j, 1.0) for j in range(len(t.steps)) if j not in injected]
    return refs


def policy_dir(run: Run) -> pathlib.Path:
    sft_dir = run.workdir / "sft_model"
    return sft_dir if (sft_dir / "config.json").exists() else run.base_model_dir


def evaluate_into(run: Run, model_dir: pathlib.Path, report_path: pathlib.Path) -> str:
    """Evaluate the policy in `model_dir` on the recipe's eval splits; write the report, its episodes (a
    TrajectoryStore folder `<stem>_trajectories/`, one shard per split) and an inspector page of up to
    `eval.inspector_episodes` of them (`<stem>.html`) beside it; return its headline. On the desk,
    `eval.step_limits` are scored exactly by replaying each episode's first L steps; elsewhere from the recorded
    episodes (a lower bound)."""
    import shutil

    from guijax.data.store import TrajectoryStore
    from guijax.evaluation import desk_replay_scorer, evaluate_with_trajectories, write_report
    from guijax.inspector import spread, write_page

    ev = run.config.eval
    policy = run.load_policy(model_dir)
    splits = {k: v for k, v in run.tasks().items() if k in ev.splits}
    with run.evaluation_engine(policy, ev.temperature) as engine:
        score_at = None
        if ev.step_limits and run.config.env.kind == "desk":
            score_at = desk_replay_scorer([t for ts in splits.values() for t in ts], run.config.env.screen,
                                          run.config.env.popups, engine.config.coordinate_model, engine.config.grammar)
        report, trajectories = evaluate_with_trajectories(engine, policy.params, splits, ev.episodes_per_task,
                                                          seed=run.streams.seed_for("eval"), ks=tuple(ev.pass_k),
                                                          step_limits=tuple(ev.step_limits), score_at=score_at)
    store_dir = report_path.parent / f"{report_path.stem}_trajectories"
    if store_dir.exists():  # a rerun's episodes replace the last run's
        shutil.rmtree(store_dir)
    store = TrajectoryStore(store_dir)
    for split, trajs in trajectories.items():
        store.append([dataclasses.replace(t, meta={**t.meta, "eval_split": split}) for t in trajs], name=split)
    report["trajectories"] = store_dir.name
    episodes = [(split, t) for split, trajs in trajectories.items() for t in trajs]
    page_path = report_path.with_suffix(".html")
    page_path.unlink(missing_ok=True)
    if ev.inspector_episodes:
        shown = spread(episodes, ev.inspector_episodes)
        title = f"{run.config.name} {report_path.stem}" + (
            f" ({len(shown)} of {len(episodes)} episodes)" if len(shown) < len(episodes) else "")
        report["inspector"] = write_page(shown, page_path, title=title, coordinate_model=engine.config.coordinate_model,
                                         grammar=engine.config.grammar, max_side=1280).name
    write_report(report_path.parent, report_path.stem, report)
    return ", ".join(f"{s} {100 * r.get('success_rate', 0):.1f}%" for s, r in report["splits"].items())


def describe_eval(run: Run) -> str:
    ev = run.config.eval
    try:
        sizes = {k: len(v) for k, v in run.tasks().items() if k in ev.splits}
    except FileNotFoundError:
        sizes = {k: "?" for k in ev.splits}
    return (f"{ev.episodes_per_task} episode(s) per task at temperature {ev.temperature} on "
            + ", ".join(f"{k} ({n} tasks)" for k, n in sizes.items()))


@stage("eval_base", describe_eval, done=output_exists("eval_base.json"), reads=EVAL_READS,
       needs=BASE_POLICY + SPLITS, outputs=("eval_base.json", "eval_base.html", "eval_base_trajectories"))
def eval_base(run: Run) -> str:
    return evaluate_into(run, policy_dir(run), run.workdir / "eval_base.json")


def method_context(run: Run, config: ml_collections.ConfigDict, workdir: pathlib.Path, name: str):
    """The Context a method reads its run through (guijax.methods.base.Context)."""
    from guijax.methods import Context

    return Context(config=config, run_dir=run.workdir, workdir=workdir, streams=run.streams.child("method", name),
                   expert_traces=run.expert_traces, train_tasks=tuple(run.tasks()["train"]),
                   rollout_engine=run.engine, load_policy=run.load_policy)


def train_with(run: Run, method: Any, workdir: pathlib.Path, desc: str) -> tuple[Any, list[dict[str, Any]]]:
    """Train `method` from the base policy in `workdir`: its training before RL, then (if it has one) the RL
    loop, resumed from the newest checkpoint there. Returns the trained policy and the RL history."""
    from guijax.trainer import Components, Trainer, pipeline_config

    ctx = method_context(run, method.config, workdir, method.name)
    policy = run.load_policy(policy_dir(run), trains=method.config)
    method.before_rl(ctx, policy, pipeline_config(method.config, run.system_prompt, policy.mesh))
    if not method.rl:
        return policy, []
    parts = Components(policy, run.pool(), policy.processor, method.training_tasks(ctx, run.tasks()["train"]),
                       lambda score: method.hook(dataclasses.replace(ctx, score=score)), method.objective(),
                       run.system_prompt, run.mesh(), streams=ctx.streams, sampler_mesh=run.sampler_mesh())
    trainer = Trainer(method.config, workdir, parts)
    try:
        trainer.maybe_restore()
        history = trainer.fit(desc=desc)
    finally:  # a crash too gives back a serving engine's memory and its adapter directory, and flushes metrics
        trainer.close()
    policy.params = trainer.state.params
    return policy, history


def _describe_rl(run: Run) -> str:
    from guijax.methods import get_method

    return get_method(run.config.method, run.config).describe()


@stage("rl", _describe_rl, done=output_exists("trained_model/config.json"), reads=TRAIN_READS,
       needs=BASE_POLICY + ("tasks", "bepa_splits"), outputs=RL_OUTPUTS, trains="method")
def rl(run: Run) -> str:
    from guijax.methods import get_method

    method = get_method(run.config.method, run.config)
    policy, history = train_with(run, method, run.workdir, method.name)
    run.save_trained(policy, run.workdir / "trained_model")
    return rl_headline(history)


def rl_headline(history: list[dict[str, Any]]) -> str:
    if not history:
        return "no iteration left to run (resumed at the last one)"
    first, last = history[0], history[-1]
    return (f"training success {100 * first['success_rate']:.1f}% (iteration {first['iteration']}) -> "
            f"{100 * last['success_rate']:.1f}% (iteration {last['iteration']})")


@stage("eval_final", describe_eval, done=output_exists("eval_final.json"), reads=EVAL_READS,
       needs=("rl",) + SPLITS, outputs=("eval_final.json", "eval_final.html", "eval_final_trajectories"))
def eval_final(run: Run) -> str:
    return evaluate_into(run, run.workdir / "trained_model", run.workdir / "eval_final.json")


@stage("report", lambda run: "report.md with the results table and training curves")
def report(run: Run) -> str:
    from guijax.evaluation import markdown_table
    from guijax.metrics import read_metrics
    from guijax.report import plot_curves

    text = f"# {run.config.name}\n"
    reports = {}
    for label, name in (("base policy", "eval_base"), ("after RL", "eval_final")):
        path = run.workdir / f"{name}.json"
        if path.exists():
            reports[label] = json.loads(path.read_text())
    methods_table = run.workdir / "table.md"  # an expert-guided recipe's methods, base policy included
    if methods_table.exists():
        text += f"\nSuccess rate by split, every method from the same base policy:\n\n{methods_table.read_text()}"
    elif reports:
        text += f"\nSuccess rate (tasks per split in parentheses):\n\n{markdown_table(reports)}\n"
    else:
        text += "\n(no evaluations)\n"
    plot = plot_curves(read_metrics(run.workdir / "metrics.jsonl"), run.workdir / "curves.png")
    if plot:
        text += f"\n![training curves]({plot.name})\n"
    for name, caption in (("curves_methods.png", "the methods' training curves"),
                          ("diagnostics.png", "token probabilities under the base policy")):
        if (run.workdir / name).exists():
            text += f"\n![{caption}]({name})\n"
    write_text_atomic(run.workdir / "report.md", text)
    return f"{run.workdir / 'report.md'}"


