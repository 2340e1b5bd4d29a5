"""EvoCUA's cold start (§5.1) on the local desktop's office apps, beyond the synthetic desk:

    python -m guijax.evocua.office_coldstart --tasks=DIR --out=OUT [--grammar=computer_use]
        [--hindsight=rule | --hindsight=chat --chat_url=URL --chat_model=NAME]

Each task under DIR that carries a reference solution (the ones `guijax.evocua.office_synthesis` keeps) is
set up on a real Xvfb desktop and its reference replayed, the screen recorded before every action; the
validator must score the end state 1, and the trace then ends with terminate(success) on the final screen.
Every step gets a hindsight thought: by rule from the reference's own `why` notes (what the architect meant
each action to do, so the thought is ground truth, not a guess), or by a VLM shown the screens
(`guijax.evocua.hindsight.ChatHindsight`). A step without a usable thought stays in the history and carries
no loss, as in the desk's cold start.

OUT/coldstart_trajectories and OUT/coldstart.json are what a recipe's coldstart stage reads with
`coldstart.traces_dir=OUT`; `sft.data='coldstart'` then trains on them. OUT/coldstart.html shows every trace
step by step in the trajectory inspector (screenshots downscaled to 640 pixels).
"""
from __future__ import annotations

import dataclasses
import pathlib
import sys
import time
from typing import Any, Protocol, Sequence

import numpy as np

from envs.actions.grammar import GRAMMARS, RELATIVE, render_response as render_in
from envs.actions.model import Action, ActionType
from envs.api import TaskError
from envs.osworld.env import EvaluationError
from envs.osworld.loader import OSWorldTask, load_osworld
from envs.osworld.local import solution_actions
from guijax.evocua.hindsight import HindsightStep, Thought, ThoughtError, check_thought
from guijax.rollout.trajectory import Source, Status, Step, Trajectory

DONE_THOUGHT = ("The document now holds the change the task asked for and it is saved, so the task is complete.")


class Desktop(Protocol):
    """What recording needs of envs.desktop.env.DesktopEnv."""

    def reset(self, task: OSWorldTask): ...
    def step(self, action): ...
    def evaluate(self) -> float: ...


@dataclasses.dataclass(frozen=True)
class ReferenceStep:
    screenshot: np.ndarray  # the screen before the action
    action: Action
    why: str  # the reference's note of the action's purpose; "" when it gave none


@dataclasses.dataclass
class RecordedReference:
    task: OSWorldTask
    steps: list[ReferenceStep]
    final_screenshot: np.ndarray
    score: float  # the validator on the state the reference reached


def record_reference(env: Desktop, task: OSWorldTask) -> RecordedReference:
    """Set `task` up on `env`, replay its reference solution recording the screen before each action, and
    score the end state (TaskError when the task has no solution)."""
    actions = solution_actions(task)
    notes = task.task.extra["solution"]
    screen = env.reset(task).screenshot
    steps = []
    for action, note in zip(actions, notes):
        why = note.get("why", "") if isinstance(note, dict) else ""
        steps.append(ReferenceStep(screen, action, why if isinstance(why, str) else ""))
        screen = env.step(action).observation.screenshot
    return RecordedReference(task, steps, screen, float(env.evaluate()))


def keyboard_semantic(action: Action) -> str:
    """The action in words, the computer_use grammar's `Action:` line (and the history of later steps)."""
    if action.kind == ActionType.PRESS:
        return "Press " + ", then ".join(k.capitalize() for k in action.keys) + "."
    if action.kind == ActionType.HOTKEY:
        return "Press " + "+".join(k.capitalize() for k in action.keys) + "."
    if action.kind == ActionType.TYPE:
        return f"Type {action.text!r}."
    if action.kind == ActionType.WAIT:
        return "Wait for the application."
    if action.kind == ActionType.FINISHED:
        return "Report that the task is done."
    raise ValueError(f"a reference action {action.kind.value!r} is not a keyboard action; office references are "
                     "keyboard-only")


def _task_text(instruction: str) -> str:
    """The instruction without its persona sentence ("I'm a teacher. ...")."""
    head, _, rest = instruction.partition(". ")
    return rest.strip() if head.startswith("I'm ") and rest.strip() else instruction.strip()


class NoteHindsight:
    """Thoughts from the reference's `why` notes: step 0 states the goal and the first purpose, later steps
    their own, the terminating step the evidence the validator confirmed. A step without a note, or whose
    thought fails `check_thought`, is skipped with the reason."""

    def thoughts(self, instruction: str, whys: Sequence[str]) -> list[Thought]:
        out: list[Thought] = []
        for i, why in enumerate(whys):
            if i == len(whys) - 1:
                text = DONE_THOUGHT
            elif not why:
                out.append(Thought(None, f"step {i}: the reference gave no 'why' for its action"))
                continue
            elif i == 0:
                text = f"The task: {_task_text(instruction)} First I need to {why}."
            elif why == whys[i - 1]:
                text = f"I need to {why} once more."
            else:
                text = f"Next I need to {why}."
            try:
                out.append(Thought(check_thought(text)))
            except ThoughtError as err:
                out.append(Thought(None, f"step {i}: {err}"))
        return out


def _steps_with_terminate(recorded: RecordedReference) -> list[ReferenceStep]:
    return recorded.steps + [ReferenceStep(recorded.final_screenshot, Action(ActionType.FINISHED), "")]


def hindsight_steps(recorded: RecordedReference) -> list[HindsightStep]:
    """The recorded steps, terminate included, as a VLM writer reads them."""
    from envs.actions.computer_use import render_response

    return [HindsightStep(s.screenshot, (s.action,), keyboard_semantic(s.action),
                          render_response("", "", [s.action], image_hw=RELATIVE, screen_hw=s.screenshot.shape[:2]))
            for s in _steps_with_terminate(recorded)]


def write_thoughts(recorded: RecordedReference, writer: Any) -> list[Thought]:
    """One thought per step and for the terminating step: `writer` is a NoteHindsight or a ChatHindsight."""
    instruction = recorded.task.task.instruction
    if isinstance(writer, NoteHindsight):
        return writer.thoughts(instruction, [s.why for s in _steps_with_terminate(recorded)])
    return writer.thoughts(instruction, hindsight_steps(recorded))


def office_trajectory(recorded: RecordedReference, thoughts: Sequence[Thought],
                      grammar: str = "computer_use") -> Trajectory:
    """The recorded reference, ended by terminate(success), each response written in `grammar` with its
    thought; steps without one are listed in `meta['coldstart_skipped']`."""
    steps = _steps_with_terminate(recorded)
    if len(thoughts) != len(steps):
        raise ValueError(f"task {recorded.task.id}: {len(thoughts)} thoughts for {len(steps)} steps")
    out = [Step.text(s.screenshot, render_in(t.text or "", keyboard_semantic(s.action), [s.action], grammar=grammar,
                                             screen_hw=tuple(s.screenshot.shape[:2])), [])
           for s, t in zip(steps, thoughts)]
    return Trajectory(recorded.task.id, recorded.task.task.instruction, out, recorded.score, Status.DONE,
                      Source.EXPERT, meta={"coldstart_skipped": [i for i, t in enumerate(thoughts) if t.text is None],
                                           "grammar": grammar, "recorded_on": "desktop"})


@dataclasses.dataclass
class ColdstartRecord:
    trajectories: list[Trajectory]
    dropped: dict[str, str]  # task id -> why no trace was kept
    skipped_steps: list[str]


def record_coldstart(env: Desktop, tasks: Sequence[OSWorldTask], writer: Any, grammar: str = "computer_use",
                     progress=None) -> ColdstartRecord:
    """A cold-start trace from every task whose reference the desktop confirms."""
    record = ColdstartRecord([], {}, [])
    for task in tasks:
        try:
            recorded = record_reference(env, task)
        except (TaskError, EvaluationError, OSError, ValueError) as e:
            record.dropped[task.id] = f"the reference cannot be replayed: {e}"
        else:
            if recorded.score != 1.0:
                record.dropped[task.id] = f"the validator scores the reference's end state {recorded.score}, not 1"
            else:
                thoughts = write_thoughts(recorded, writer)
                record.skipped_steps += [f"task {task.id} {t.skipped}" for t in thoughts if t.text is None]
                record.trajectories.append(office_trajectory(recorded, thoughts, grammar))
        if progress:
            progress(task, record)
    return record


def save(record: ColdstartRecord, out: pathlib.Path, grammar: str = "computer_use", **about: Any) -> dict[str, Any]:
    """OUT/coldstart_trajectories (one shard) and OUT/coldstart.json, the layout `coldstart.traces_dir` reads,
    and OUT/coldstart.html, the traces in the inspector."""
    from guijax.inspector import write_page
    from guijax.pipeline.coldstart_stages import write_coldstart

    summary = write_coldstart(out, record.trajectories, skipped_steps=record.skipped_steps,
                              dropped_tasks=record.dropped, grammar=grammar, **about)
    largest = max((max(t.steps[0].screenshot.shape[:2]) for t in record.trajectories), default=640)
    write_page(record.trajectories, out / "coldstart.html", "office cold-start traces", grammar=grammar,
               max_side=640, scale=min(1.0, 640 / largest))
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m guijax.evocua.office_coldstart", description=__doc__.split("\n\n")[0])
    p.add_argument("--tasks", required=True, help="a folder of task files with reference solutions "
                                                  "(office_synthesis's --out)")
    p.add_argument("--out", required=True, help="folder for coldstart_trajectories/ and coldstart.json")
    p.add_argument("--grammar", default="computer_use", choices=GRAMMARS, help="the grammar the policy writes")
    p.add_argument("--screen", default="1280x720", help="the desktop's WIDTHxHEIGHT")
    p.add_argument("--hindsight", default="rule", choices=("rule", "chat"),
                   help="thoughts from the references' notes, or from a VLM at --chat_url")
    p.add_argument("--chat_url", default="")
    p.add_argument("--chat_model", default="")
    p.add_argument("--chat_api_key_env", default="OPENAI_API_KEY", help="the variable holding the key ('' for none)")
    p.add_argument("--chat_retries", type=int, default=2)
    args = p.parse_args(argv)
    from envs.desktop.checks import desktop_missing

    missing = desktop_missing(apps=True)
    if missing is not None:
        print(f"office cold start needs the local desktop: {missing}", file=sys.stderr)
        return 2
    try:
        width, height = (int(x) for x in args.screen.lower().split("x"))
        tasks = load_osworld(args.tasks)
    except (ValueError, TaskError) as e:
        print(f"office cold start: {e}", file=sys.stderr)
        return 2
    with_reference = [t for t in tasks if "solution" in t.task.extra]
    if not with_reference:
        print(f"office cold start: none of the {len(tasks)} tasks under {args.tasks} has a reference solution "
              "(a 'solution' list, as office_synthesis writes)", file=sys.stderr)
        return 2
    writer: Any = NoteHindsight()
    if args.hindsight == "chat":
        from guijax.evocua.hindsight import make_writer

        try:
            writer = make_writer("chat", args.chat_url, args.chat_model, args.chat_api_key_env, args.chat_retries)
        except ValueError as e:
            print(f"office cold start: {e}", file=sys.stderr)
            return 2
    from envs.desktop.env import DesktopEnv

    start = time.time()

    def progress(task: OSWorldTask, record: ColdstartRecord) -> None:
        what = f"dropped: {record.dropped[task.id]}" if task.id in record.dropped else (
            f"{len(record.trajectories[-1].steps)} steps")
        print(f"[{time.time() - start:6.0f}s] {task.id}: {what}", flush=True)

    out = pathlib.Path(args.out)
    env = DesktopEnv((width, height), settle_s=0.3, step_limit=200)
    try:
        record = record_coldstart(env, with_reference, writer, args.grammar, progress)
    finally:
        env.close()
    if not record.trajectories:
        print(f"office cold start: no reference was confirmed on the desktop: {record.dropped}", file=sys.stderr)
        return 1
    summary = save(record, out, hindsight=args.hindsight, grammar=args.grammar, source=str(args.tasks),
                   seconds=round(time.time() - start, 1), tasks_without_reference=len(tasks) - len(with_reference))
    print(f"{summary['traces']} cold-start traces ({summary['trained_steps']} steps with a thought, "
          f"{len(record.skipped_steps)} without) from {len(with_reference)} tasks with a reference; "
          f"{len(record.dropped)} dropped; written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
