"""The offline skill extractor on the synthetic desk: SGCD's four skill fields from ground truth the desk has and
an LLM would infer from references.

- Continuation Plans: the task's expert subgoals as sentences (the desk's ground-truth good path).
- Critical Targets: the elements those subgoals act on, described as the accessibility tree names them.
- Failure Traps: evidence from the failed references only. Each is replayed on a desk with its episode seed and
  every step is read against the accessibility tree of the screen it acted on: clicks on elements that are
  not critical targets (nor a pop-up, banner or dialog being cleared), the same action repeated on an unchanged
  screen (fixation), DONE before the verifier accepts (early done), FAIL on a feasible task, unparsable answers.
- Success Criteria: the validator's expected state in words, then when to report the task done.

`step_verdicts` is the same replay, step by step; `first_off_track_step` reads from it where a failed episode
first left the task's path (the failure-step histogram of the paper's Fig. 1a).
"""
from __future__ import annotations

import dataclasses
from typing import Iterator, Sequence

import numpy as np

from envs.actions import ActionParseError
from envs.actions.grammar import parse_response
from envs.actions.model import Action, ActionType
from envs.api import Observation, Task
from envs.desk.a11y import BANNER, CONFIRM, describe, parse_tree
from envs.desk.env import DeskEnv
from envs.desk.expert import expert_subgoals, plan_text
from envs.desk.scene import inside
from guijax.rollout.trajectory import Status, Trajectory
from guijax.sgcd.skills import Skill

_POINTER = {ActionType.CLICK, ActionType.LEFT_DOUBLE, ActionType.LEFT_TRIPLE, ActionType.RIGHT_SINGLE,
            ActionType.MIDDLE_SINGLE, ActionType.LONG_PRESS, ActionType.DRAG, ActionType.SCROLL}
_ROLE = {"click": "button", "check": "checkbox", "type": "field", "select": "dropdown", "slider": "slider",
         "list_select": "list"}


def critical_targets(task: Task) -> list[tuple[str, str, str | None]]:
    """(role, name, window) of every element the task's expert subgoals act on."""
    out = []
    for goal in expert_subgoals(task):
        op = goal["op"]
        if op in _ROLE:
            out.append((_ROLE[op], goal["target"], goal.get("window")))
            if op == "select":
                out.append(("option", goal["option"], goal.get("window")))
        elif op == "focus_window":
            out.append(("window", goal["target"], goal["target"]))
        elif op == "confirm":
            out.append(("button", "OK", CONFIRM))
    return list(dict.fromkeys(out))


def _target_text(role: str, name: str, window: str | None) -> str:
    if role == "window":
        return f'the "{name}" window (its title bar brings it to the front)'
    return describe(role, name, window)


def _widget_kinds(task: Task) -> dict[tuple[str, str], str]:
    kinds = {}
    for step in task.config:
        if step.get("type") == "desk_scene":
            for w in step.get("parameters", {}).get("windows", []):
                for spec in w.get("widgets", []):
                    kinds[(w["title"], spec.get("name", ""))] = spec.get("kind", "")
    return kinds


def success_criteria(task: Task) -> list[str]:
    """The validator's expected state in words, then when DONE (or FAIL) is justified."""
    if task.infeasible:
        return ["The requested change is impossible on this desk: the task is complete only once it is reported "
                "infeasible (FAIL)"]
    kinds = _widget_kinds(task)
    out = []
    expected = task.evaluator.get("expected")
    for want in (expected if isinstance(expected, list) else [expected]):
        for title, spec in (want or {}).items():
            if title == "front":
                out.append(f'The "{spec}" window is in front')
                continue
            if "saved" in spec:
                out.append(f'The "{title}" window is {"saved" if spec["saved"] else "not saved"}')
            for name, props in spec.get("widgets", {}).items():
                kind = kinds.get((title, name), "control")
                for key, value in props.items():
                    if key == "clicks_at_least":
                        out.append(f'The "{name}" {kind} in the "{title}" window has been pressed')
                    elif key == "checked":
                        out.append(f'The "{name}" {kind} in the "{title}" window is {"on" if value else "off"}')
                    elif key == "text":
                        out.append(f'The "{name}" {kind} in the "{title}" window reads "{value}"')
                    elif key == "value":
                        shown = f"{value}%" if kind == "slider" else f'"{value}"'
                        out.append(f'The "{name}" {kind} in the "{title}" window shows {shown}')
    return out + ["Report the task done only once all of the above hold on the screen"]


@dataclasses.dataclass(frozen=True)
class StepVerdict:
    """One replayed step of a reference: what it did and, if it left the task's path, why (`trap`)."""

    index: int  # 1-based step number
    kind: str  # the action kind, "unparsable", or "unreplayable"
    element: tuple[str, str, str | None] | None  # (role, name, window) the pointer hit
    trap: str | None


def node_at(a11y: str, point: tuple[int, int]):
    """The innermost accessibility node under `point`, front-most layer first."""
    for node in parse_tree(a11y):
        if node.role in ("dialog", "alertdialog", "banner", "window"):
            continue
        if inside(node.rect, point):
            return node
    return None


@dataclasses.dataclass(frozen=True)
class ReplayedStep:
    """One step of an episode replayed on the desk: the screen it acted on, its parsed actions and the screen
    after them. `actions` is None for a response that does not parse and `replayable` False where the screen
    no longer equals the one the episode saw; either is the replay's last step, with no `after`."""

    index: int  # 1-based step number
    before: Observation
    actions: tuple[Action, ...] | None
    after: Observation | None
    env: DeskEnv  # the desk after the step (evaluate() reads the state the step left)
    state_before: dict  # the desk's ground-truth state (Scene.state) the step acted on
    replayable: bool = True


def replay(task: Task, trajectory: Trajectory, screen_hw: tuple[int, int], popups: bool,
           coordinate_model: str = "uitars-1.5", step_limit: int = 15,
           grammar: str = "uitars") -> Iterator[ReplayedStep]:
    """Replay `trajectory` on a fresh desk with its episode seed, step by step. Responses are read in
    `grammar`, the one the policy wrote (envs.actions.grammar)."""
    env = DeskEnv(screen_hw, step_limit, popups=popups)
    obs = env.reset(task, trajectory.meta.get("seed"))
    for j, step in enumerate(trajectory.steps, 1):
        state = env.scene.state()
        if not np.array_equal(obs.screenshot, step.screenshot):
            yield ReplayedStep(j, obs, None, None, env, state, replayable=False)
            return
        try:
            actions = parse_response(step.response, grammar=grammar, screen_hw=screen_hw,
                                     coordinate_model=coordinate_model)
        except (ActionParseError, ValueError):
            yield ReplayedStep(j, obs, None, None, env, state)
            return
        after = env.step(actions).observation
        yield ReplayedStep(j, obs, tuple(actions), after, env, state)
        obs = after


def step_verdicts(task: Task, trajectory: Trajectory, screen_hw: tuple[int, int], popups: bool,
                  coordinate_model: str = "uitars-1.5", step_limit: int = 15,
                  grammar: str = "uitars") -> list[StepVerdict]:
    """A verdict per step of `trajectory` replayed (`replay`); replay stops (one 'unreplayable' verdict) where
    the screen no longer equals the one the episode saw."""
    targets = set(critical_targets(task))
    verdicts: list[StepVerdict] = []
    previous: tuple[tuple[Action, ...], bytes] | None = None
    for r in replay(task, trajectory, screen_hw, popups, coordinate_model, step_limit, grammar):
        j, obs, actions = r.index, r.before, r.actions
        if not r.replayable:
            verdicts.append(StepVerdict(j, "unreplayable", None, None))
            break
        if actions is None:
            verdicts.append(StepVerdict(j, "unparsable", None, "Write exactly one action of the action space per "
                                                               "step; an unparsable answer ends the episode"))
            break
        kind = actions[0].kind if actions else ActionType.WAIT
        element, trap = None, None
        # the parsed actions, not their text: a computer_use step words the same call in free text
        signature = (actions, obs.screenshot.tobytes())
        if kind in _POINTER and actions[0].point is not None:
            node = node_at(obs.a11y_tree or "", actions[0].point)
            if node is not None:
                element = (node.role, node.name, node.window)
                clearing = node.window in ("", CONFIRM, BANNER) and (node.role, node.name, node.window) not in targets
                if element not in targets and not clearing and node.role != "label":
                    trap = f"Do not click {_target_text(*element)}: it is not part of this task"
                elif node.window == CONFIRM and node.name == "Cancel":
                    trap = "Do not cancel the confirmation dialog: confirm it with OK"
        # a DONE step changes nothing, so the state it left is the one it claimed done
        if kind == ActionType.FINISHED and r.env.evaluate() < 1.0 and not task.infeasible:
            trap = "Do not report the task done while the success criteria do not hold yet"
        elif kind == ActionType.FAIL and not task.infeasible:
            trap = "Do not give up as infeasible: this task can be completed"
        elif kind == ActionType.FINISHED and task.infeasible:
            trap = "Do not report an impossible task as done: report it as infeasible"
        if trap is None and previous == signature:
            trap = "Do not repeat an action that left the screen unchanged: switch to another way"
        previous = signature
        verdicts.append(StepVerdict(j, kind.value, element, trap))
    return verdicts


def first_off_track_step(task: Task, trajectory: Trajectory, screen_hw: tuple[int, int], popups: bool,
                         coordinate_model: str = "uitars-1.5", grammar: str = "uitars") -> int | None:
    """The first step of a failed episode that left the task's path (a trap), or None if none is seen."""
    for v in step_verdicts(task, trajectory, screen_hw, popups, coordinate_model, grammar=grammar):
        if v.trap is not None:
            return v.index
    return None


class DeskSkillExtractor:
    """G without a model, from the desk's ground truth and the failed references' replays (read in `grammar`,
    the one the policy wrote)."""

    def __init__(self, screen_hw: tuple[int, int], popups: bool, coordinate_model: str = "uitars-1.5",
                 max_traps: int = 6, grammar: str = "uitars"):
        self.screen_hw, self.popups, self.coordinate_model = tuple(screen_hw), popups, coordinate_model
        self.max_traps, self.grammar = max_traps, grammar

    def extract(self, task: Task, successes: Sequence[Trajectory], failures: Sequence[Trajectory]) -> Skill:
        traps: dict[str, None] = {}
        for t in failures:
            if t.status == Status.ENV_ERROR:
                continue
            for v in step_verdicts(task, t, self.screen_hw, self.popups, self.coordinate_model, grammar=self.grammar):
                if v.trap is not None:
                    traps.setdefault(v.trap)
        plans = [plan_text(g) for g in expert_subgoals(task)]
        targets = [_target_text(*t) for t in critical_targets(task)]
        return Skill(tuple(plans), tuple(targets), tuple(list(traps)[:self.max_traps]), tuple(success_criteria(task)))

