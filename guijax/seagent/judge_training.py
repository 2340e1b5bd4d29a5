"""The World State Model's stage of a SEAgent run on the synthetic desk: collect episodes, judge them from ground
truth, LoRA-tune a judge on them (A.2; or tune every parameter), and score it against the verifier on episodes
it never saw (Table 1's precision and NPV) beside the untrained model it started from.

The training episodes are the base policy's rollouts on fresh desk tasks of the run's families (none of the
run's own tasks), the evaluation episodes its rollouts on another fresh set. Everything lands in the method's
`world_state_model/` folder: the tuned judge as a plain checkpoint (`model/`, adapters merged), `training.json`
(its losses and data), and `judge_eval.json` / `judge_eval.md`; a rerun that finds them all loads the judge, one
that finds the model and `training.json` without the evaluation evaluates it, neither trains it again.
"""
from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any, Sequence

import jax
import ml_collections

from envs.atomic import write_text_atomic
from guijax.data.chat_examples import EncodeChat
from guijax.data.pipeline import StepRef
from guijax.seagent.judge_model import TrainedWorldStateJudge, judge_examples
from guijax.seagent.world_state import Judgment, desk_oracle, score_judge

FOLDER = "world_state_model"


def judge_config(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """The run's config for the judge: LoRA of `seagent.judge_lora_rank` on the decoder (rank 0: every parameter
    trains), nothing else frozen, and the judge's own answer length and length buckets."""
    o = config.seagent
    c = ml_collections.ConfigDict(config.to_dict())
    c.lora.rank, c.lora.alpha = int(o.judge_lora_rank), float(o.judge_lora_alpha)
    c.model.frozen = ()
    c.rollout.max_new_tokens = int(o.judge_max_new_tokens)
    c.pipeline.length_buckets = tuple(o.judge_length_buckets)
    return c


def collect(ctx: Any, policy: Any, tasks: Sequence[Any], episodes: int, seed: int, desc: str) -> list[tuple]:
    """(task, trajectory, oracle judgment, ground-truth record) of the policy's episodes on `tasks`."""
    from guijax.rollout.trajectory import Status
    from guijax.seagent.captions import desk_episode_record

    config = ctx.config
    engine = ctx.rollout_engine(policy, config.rollout.temperature)
    rollouts, _ = engine.run(policy.params, list(tasks), episodes, jax.random.PRNGKey(seed), seed=seed + 1, desc=desc)
    by_id = {t.id: t for t in tasks}
    oracle = desk_oracle(config)
    out = []
    for t in rollouts:
        if t.status == Status.ENV_ERROR or not t.steps:
            continue
        task = by_id[t.task_id]
        record = desk_episode_record(task, t, tuple(config.env.screen), config.env.popups,
                                     config.rollout.coordinate_model, oracle.grammar)
        out.append((task, t, oracle.judge(task, t), record))
    return out


def score_row(judgments: Sequence[Judgment], episodes: Sequence[tuple]) -> dict[str, Any]:
    """Table 1's columns for `judgments` of `episodes` against the verifier, and how many were unreadable."""
    score = score_judge(judgments, [t.success for _, t, _, _ in episodes]).as_dict()
    return {**score, "unreadable": sum(not j.readable for j in judgments)}


def evaluate(judge: TrainedWorldStateJudge, episodes: Sequence[tuple]) -> tuple[dict[str, Any], list[Judgment]]:
    """`judge`'s judgments of `episodes` (keyframes and final screen) and their row."""
    judgments = judge.judge_all([(task, t, record.final_screenshot) for task, t, _, record in episodes])
    return score_row(judgments, episodes), judgments


def eval_markdown(rows: Sequence[dict[str, Any]], episodes: int, successes: int) -> str:
    pct = lambda v: "–" if v is None else f"{100 * v:.1f}"  # noqa: E731
    lines = [f"World State Model against the verifier on {episodes} held-out episodes ({successes} verified "
             "successes); precision: verified successes among episodes judged correct; NPV: verified failures "
             "among those judged incorrect.", "",
             "| judge | judged correct | precision | NPV | accuracy | unreadable |", "|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['judge']} | {r['judged_correct']} | {pct(r['precision'])} | {pct(r['npv'])} | "
              f"{pct(r['accuracy'])} | {r['unreadable']} |" for r in rows]
    return "\n".join(lines) + "\n"


def world_state_model(ctx: Any, policy: Any, pipeline: Any, log: Any = None) -> TrainedWorldStateJudge:
    """The run's trained judge: loaded from `world_state_model/` when an earlier run finished it, else trained
    and evaluated there (see the module docstring). The tuned model and `training.json` (its losses and data)
    are written before the evaluation, so a run stopped during the evaluation evaluates again without
    retraining."""
    from envs.tasks import generate_desk_tasks
    from guijax.models.policy import save_pretrained
    from guijax.sft import sft_steps
    from guijax.trainer import sampling_config

    config, o = ctx.config, ctx.config.seagent
    folder = pathlib.Path(ctx.workdir) / FOLDER
    model_dir, report, training = folder / "model", folder / "judge_eval.json", folder / "training.json"
    cfg = judge_config(config)
    make = lambda p, retries=o.judge_retries: TrainedWorldStateJudge(  # noqa: E731
        p.module, p.params, p.processor, sampling_config(cfg, p.processor, 0.0, p.mesh), mesh=p.mesh,
        retries=retries, seed=ctx.streams.seed_for("judge_samples"), max_rows=o.sampler_rows)
    saved = (model_dir / "config.json").exists()
    if saved and report.exists():
        return make(ctx.load_policy(model_dir, None))
    tuned = saved and training.exists()
    cd = "w/ CD" if o.judge_change_descriptions else "w/o CD"
    tuning = f"LoRA r{o.judge_lora_rank}" if o.judge_lora_rank else "full fine-tuning"
    name = f"World State Model ({cd}, {tuning}, {o.judge_steps} steps)"
    families = tuple(config.env.families) or None
    eval_tasks = generate_desk_tasks(o.judge_eval_tasks, seed=ctx.streams.seed_for("judge_eval_tasks"),
                                     families=families, screen_hw=tuple(config.env.screen))
    if tuned:
        print(f"  world state model: tuned in an earlier run ({model_dir}); evaluating it", flush=True)
        trained, facts = make(ctx.load_policy(model_dir, None)), json.loads(training.read_text())
    else:
        train_tasks = generate_desk_tasks(o.judge_tasks, seed=ctx.streams.seed_for("judge_tasks"),
                                          families=families, screen_hw=tuple(config.env.screen))
        train_eps = collect(ctx, policy, train_tasks, o.judge_episodes_per_task,
                            ctx.streams.seed_for("judge_rollouts"), "world state model: training episodes")
        examples = judge_examples(train_eps, o.judge_change_descriptions)
        judge_policy = ctx.load_policy(policy.path, cfg)
        judge_pipeline = dataclasses.replace(pipeline, length_buckets=tuple(o.judge_length_buckets), pack=False)
        params, losses = sft_steps(
            judge_policy, [], judge_policy.processor, cfg, judge_pipeline, o.judge_steps, o.judge_batch_size,
            ctx.streams.seed_for("judge_batches"), log=log, checkpoint_dir=folder / "checkpoints",
            desc="world state model", learning_rate=o.judge_learning_rate,
            refs=[StepRef(i, 0, 1.0) for i in range(len(examples))],
            encode=EncodeChat(examples, judge_policy.processor, max(o.judge_length_buckets)))
        judge_policy.params = params
        save_pretrained(judge_policy, model_dir)
        facts = {"judge": name, "training_examples": len(examples), "training_episodes": len(train_eps),
                 "training_successes": sum(t.success for _, t, _, _ in train_eps), "losses": losses}
        write_text_atomic(training, json.dumps(facts, indent=1))
        trained = make(judge_policy)
    eval_eps = collect(ctx, policy, eval_tasks, o.judge_episodes_per_task, ctx.streams.seed_for("judge_eval_rollouts"),
                       "world state model: evaluation episodes")
    # an untrained model rarely writes a res_dict; one greedy answer says so
    base_row, _ = evaluate(make(ctx.load_policy(policy.path, None), retries=0), eval_eps)
    trained_row, judgments = evaluate(trained, eval_eps)
    oracle_row = score_row([j for _, _, j, _ in eval_eps], eval_eps)
    rows = [{"judge": "base model, untrained (one greedy answer)", **base_row},
            {"judge": facts.get("judge", name), **trained_row},  # as tuned, when a rerun only evaluates
            {"judge": "desk oracle (ground truth)", **oracle_row}]
    successes = sum(t.success for _, t, _, _ in eval_eps)
    write_text_atomic(folder / "judge_eval.md", eval_markdown(rows, len(eval_eps), successes))
    write_text_atomic(report, json.dumps({
        "rows": rows, **{k: v for k, v in facts.items() if k not in ("judge", "losses")},
        "evaluation_episodes": len(eval_eps), "evaluation_successes": successes, "losses": facts["losses"],
        "judgments": [{"task": t.task_id, "verified": t.success, **j.as_dict(), "readable": j.readable}
                      for (_, t, _, _), j in zip(eval_eps, judgments)]}, indent=1))
    return trained
