"""EvoCUA's cold start (§5.1) as a stage:

    coldstart    the scripted expert on every training task; each success gets a hindsight thought per step
                 (guijax.evocua.hindsight) and is written in the grammar `rollout.prompt` asks for (EvoCUA's
                 computer_use, or UI-TARS text) (coldstart_trajectories/, coldstart.json); `sft.data='coldstart'`
                 trains on them. With `coldstart.traces_dir` it takes traces recorded elsewhere instead (the
                 desktop's office references, guijax.evocua.office_coldstart), in the same grammar

The paper's single-turn decomposition is what the data pipeline already does with a trajectory: one row per
step, its prompt holding the last `rollout.max_images` - 1 steps whole (screenshot, reasoning, semantic
action, tool call) and older ones as text (in computer_use their semantic action alone:
`envs.actions.grammar.history_text`, the same prompt the rollouts build), the loss on that step's response
only. A step whose thought was skipped
trains nothing (`coldstart_refs` leaves it out) and stays in later steps' history without reasoning.
"""
from __future__ import annotations

import json
from typing import Any, Sequence

from envs.actions.computer_use import render_response
from envs.actions.grammar import RELATIVE, render_response as render_in
from envs.actions.model import ActionType
from envs.atomic import write_text_atomic
from guijax.pipeline.run import Run
from guijax.pipeline.stage import output_exists, stage
from guijax.rollout.trajectory import Source, Status, Step, Trajectory


def options(config: Any) -> Any:
    """The recipe's `coldstart` section, checked (guijax.schema.Coldstart)."""
    from guijax.schema import Coldstart, parse_section

    return parse_section(Coldstart, config.coldstart, "coldstart")


def hindsight_steps(trace: Any, image_hw: tuple[int, int]) -> list:
    """An expert trace's steps as the hindsight writers read them."""
    from guijax.evocua.hindsight import HindsightStep, semantic_action

    out = []
    for s in trace.steps:
        hw = tuple(s.screenshot.shape[:2])
        out.append(HindsightStep(s.screenshot, tuple(s.actions), semantic_action(s.s2),
                                 render_response("", "", s.actions, image_hw=image_hw, screen_hw=hw), s.a11y, s.s2))
    return out


def coldstart_trajectory(trace: Any, thoughts: Sequence[Any], grammar: str = "computer_use") -> Trajectory:
    """The expert trace with every step's response written in `grammar` with its thought (computer_use:
    reasoning, semantic action and tool call(s)); steps without a thought keep the action parts alone and are
    listed in `meta['coldstart_skipped']`."""
    from guijax.evocua.hindsight import semantic_action

    if len(thoughts) != len(trace.steps):
        raise ValueError(f"task {trace.task_id}: {len(thoughts)} thoughts for {len(trace.steps)} steps")
    steps = [Step.text(s.screenshot, render_in(t.text or "", semantic_action(s.s2), s.actions, grammar=grammar,
                                               screen_hw=tuple(s.screenshot.shape[:2])))
             for s, t in zip(trace.steps, thoughts)]
    last = trace.steps[-1].actions
    status = Status.FAIL if any(a.kind == ActionType.FAIL for a in last) else (
        Status.DONE if any(a.kind == ActionType.FINISHED for a in last) else Status.STEP_LIMIT)
    skipped = [i for i, t in enumerate(thoughts) if t.text is None]
    return Trajectory(trace.task_id, trace.instruction, steps, trace.reward, status, Source.EXPERT,
                      meta={"coldstart_skipped": skipped, "grammar": grammar})


def coldstart_refs(trajectories: Sequence[Trajectory]) -> list:
    """The steps that carry loss: every step with a thought."""
    from guijax.data.pipeline import StepRef

    return [StepRef(i, j, 1.0) for i, t in enumerate(trajectories) for j in range(len(t.steps))
            if j not in set(t.meta.get("coldstart_skipped", ()))]


def write_coldstart(folder: Any, traces: Sequence[Trajectory], **about: Any) -> dict[str, Any]:
    """FOLDER/coldstart_trajectories (one shard) and FOLDER/coldstart.json (the counts, then `about`): what the
    stage leaves in a run and what `coldstart.traces_dir` reads; returns the summary written."""
    import pathlib

    from guijax.data.store import write_named_shard

    folder = pathlib.Path(folder)
    write_named_shard(folder / "coldstart_trajectories", "coldstart", traces)
    summary = {"traces": len(traces), "steps": sum(len(t.steps) for t in traces),
               "trained_steps": len(coldstart_refs(traces)), **about}
    write_text_atomic(folder / "coldstart.json", json.dumps(summary, indent=1))
    return summary


def _describe(run: Run) -> str:
    c = run.config.coldstart
    if c.traces_dir:
        return f"the cold-start traces recorded in {c.traces_dir}"
    writer = f"a VLM at {c.hindsight_url}" if c.hindsight == "chat" else "the desk's accessibility-tree rules"
    return (f"{c.traces_per_task} scripted-expert trace(s) per training task in the "
            f"{run.grammar} grammar; hindsight thoughts by {writer}")


def _evaluation_task_ids(run: Run) -> set[str]:
    """Ids of the run's tasks in any split but `train`: traces recorded for them (the desktop's recorder replays
    every synthesized task) must not teach the policy the answers it is evaluated on. Empty before the run has
    splits."""
    if not (run.workdir / "splits.json").exists():
        return set()
    splits = json.loads((run.workdir / "splits.json").read_text())
    return {i for name, ids in splits.items() if name != "train" for i in ids} - set(splits.get("train", ()))


def _take_recorded(run: Run, folder: str) -> str:
    """The stage's outputs from traces recorded elsewhere, checked to be in the grammar the policy writes."""
    import pathlib

    from guijax.data.store import TrajectoryStore

    source = pathlib.Path(folder) / "coldstart_trajectories"
    if not any(source.glob("*.array_record")):
        raise FileNotFoundError(f"coldstart.traces_dir={folder}: {source} holds no trajectories (record them with "
                                "python -m guijax.evocua.office_coldstart --out=...)")
    traces = list(TrajectoryStore(source))
    evaluated_only = _evaluation_task_ids(run)
    withheld = sorted({t.task_id for t in traces} & evaluated_only)
    traces = [t for t in traces if t.task_id not in evaluated_only]
    if not traces:
        raise ValueError(f"coldstart.traces_dir={folder}: every trace is of a task the run holds out for evaluation "
                         f"({', '.join(withheld)}); record traces of its training tasks")
    for t in traces:
        if t.meta.get("grammar") != run.grammar:
            raise ValueError(f"coldstart.traces_dir={folder}: task {t.task_id}'s trace is written in the "
                             f"{t.meta.get('grammar')!r} grammar, but rollout.prompt={run.config.rollout.prompt!r} "
                             f"asks for {run.grammar!r}; record them again with --grammar={run.grammar}")
    trained = len(coldstart_refs(traces))
    if not trained:
        raise RuntimeError(f"coldstart.traces_dir={folder}: no step with a thought among {len(traces)} traces")
    write_coldstart(run.workdir, traces, source=str(folder), grammar=run.grammar, withheld_tasks=withheld)
    note = f"; the traces of {len(withheld)} held-out task(s) left out" if withheld else ""
    return f"{len(traces)} recorded traces from {folder}, {trained} steps with a thought{note}"


@stage("coldstart", _describe, done=output_exists("coldstart.json"), reads=("seed", "env", "coldstart", "rollout.prompt"),
       needs=("tasks", "bepa_splits"), outputs=("coldstart.json", "coldstart_trajectories"))
def coldstart(run: Run) -> str:
    from envs.desk import DeskEnv, ScriptedExpert, run_expert
    from envs.desk.expert import expert_subgoals
    from guijax import progress
    from guijax.evocua.hindsight import make_writer

    c, e = options(run.config), run.config.env
    if c.traces_dir:
        return _take_recorded(run, c.traces_dir)
    if e.kind != "desk":
        raise ValueError(f"the coldstart stage runs the synthetic desk's scripted expert; env.kind is {e.kind!r}")
    writer = make_writer(c.hindsight, c.hindsight_url, c.hindsight_model, c.hindsight_api_key_env, c.hindsight_retries,
                         c.brief)
    screen = tuple(e.screen)
    env = DeskEnv(screen, e.step_limit, seed=run.streams.seed_for("coldstart", "env"), popups=e.popups)
    tasks = run.tasks()["train"]
    traces, skipped = [], []
    bar = progress.Progress(len(tasks) * c.traces_per_task, "coldstart", "trace")
    for task in tasks:
        for k in range(c.traces_per_task):
            bar.update(1)
            trace = run_expert(env, task, ScriptedExpert(noise=c.expert_noise,
                                                         seed=run.streams.seed_for("coldstart", "expert", task.id, k)))
            if trace.reward < 1.0:
                continue
            subgoals = json.loads(json.dumps(expert_subgoals(task)))
            thoughts = writer.thoughts(task.instruction, hindsight_steps(trace, RELATIVE), subgoals=subgoals)
            skipped += [f"task {task.id} trace {k} {t.skipped}" for t in thoughts if t.text is None]
            traces.append(coldstart_trajectory(trace, thoughts, run.grammar))
    bar.close()
    trained = len(coldstart_refs(traces))
    if not trained:
        raise RuntimeError(f"coldstart: no step to train on from {len(tasks)} training tasks ({len(traces)} expert "
                           f"successes, {len(skipped)} steps skipped)")
    write_coldstart(run.workdir, traces, skipped_steps=skipped, hindsight=c.hindsight, brief=c.brief,
                    grammar=run.grammar)
    return f"{len(traces)} successful traces, {trained} steps with a thought; {len(skipped)} steps skipped"
