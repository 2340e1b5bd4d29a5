"""The scripted expert: the framework agent of BEPA (Agent S2's role) on the synthetic desk.

It writes a global plan of subgoals, reads the accessibility tree at every step, acts in the S2-style
action space with element descriptions, and grounds them on the tree. Pop-ups are closed first. With
`noise` > 0 each action is, with that probability, replaced by a click on a random element (a wrong
action) or by a wait (a missed one), so traces are imperfect.
"""
from __future__ import annotations

import dataclasses
import json
import pathlib
import random
import re
from typing import Any

import numpy as np
from PIL import Image

from envs.actions.model import Action
from envs.actions.s2 import S2Action, s2_to_actions
from envs.api import Task, TaskError, read_json
from envs.atomic import write_text_atomic
from envs.desk.a11y import BANNER, CONFIRM, GroundingError, describe, ground, parse_tree
from envs.desk.scene import inside


def plan_text(subgoal: dict[str, Any]) -> str:
    op = subgoal["op"]
    if op == "click":
        return f'Click the "{subgoal["target"]}" button'
    if op == "check":
        return f'{"Turn on" if subgoal["value"] else "Turn off"} the "{subgoal["target"]}" checkbox'
    if op == "type":
        return f'Type "{subgoal["text"]}" into the {subgoal["target"]} field'
    if op == "select":
        return f'Open the {subgoal["target"]} menu and choose {subgoal["option"]}'
    if op == "slider":
        return f'Drag the {subgoal["target"]} slider to {subgoal["value"]}%'
    if op == "list_select":
        return f'Scroll the {subgoal["target"]} list to "{subgoal["item"]}" and select it'
    if op == "focus_window":
        return f'Bring the {subgoal["target"]} window to the front'
    if op == "confirm":
        return "Confirm the dialog with OK"
    if op == "hotkey":
        return f'Press {"+".join(k.capitalize() for k in subgoal["keys"])}'
    if op == "done":
        return "Report that the task is done"
    if op == "fail":
        return "Report that the task is infeasible"
    raise ValueError(f"unknown expert subgoal op {op!r}")


def expert_subgoals(task: Task) -> list[dict[str, Any]]:
    subgoals = task.extra.get("expert")
    if not subgoals:
        raise ValueError(f"task {task.id} has no expert subgoals (key 'expert')")
    return subgoals


class ScriptedExpert:
    def __init__(self, noise: float = 0.0, seed: int = 0):
        self.noise = noise
        self.rng = random.Random(seed)
        self.injected = False  # whether the last next_action was the noise's, not the expert's

    def plan(self, task: Task) -> list[str]:
        return [plan_text(s) for s in expert_subgoals(task)]

    def _node(self, nodes, window: str | None, role: str, name: str):
        for n in nodes:
            if n.role == role and n.name == name and (window is None or n.window == window):
                return n
        return None

    def next_action(self, task: Task, a11y: str, progress: int) -> tuple[S2Action, int]:
        """The next S2 action and the index of the subgoal it serves (subgoals already satisfied are skipped).

        Like a framework agent re-reading the screen, it first clears what blocks its way: a pop-up, a
        confirmation dialog it did not mean to open (Cancel), a banner over its target (Dismiss)."""
        nodes = parse_tree(a11y)
        self.injected = False
        if any(n.role == "dialog" for n in nodes):
            return S2Action("click", {"element_description": describe("button", "Close", "")}), progress
        if self.noise and self.rng.random() < self.noise:
            self.injected = True
            if self.rng.random() < 0.5:  # a missed action: the step passes without effect
                return S2Action("wait", {"time": 1.0}), progress
            target = self.rng.choice([n for n in nodes if n.role in ("button", "checkbox", "field", "dropdown")])
            return S2Action("click", {"element_description": describe(target.role, target.name, target.window)}), progress
        subgoals = expert_subgoals(task)
        confirm_open = any(n.role == "alertdialog" for n in nodes)
        while progress < len(subgoals):
            goal = subgoals[progress]
            action = self._act(goal, nodes)
            if action is None:
                progress += 1
                continue
            if confirm_open and goal["op"] != "confirm":
                goal.pop("_sent", None)  # not sent after all
                return S2Action("click", {"element_description": describe("button", "Cancel", CONFIRM)}), progress
            if goal["op"] != "confirm" and self._banner_blocks(action, a11y, nodes):  # the dialog is above it
                goal.pop("_sent", None)
                return S2Action("click", {"element_description": describe("button", "Dismiss", BANNER)}), progress
            return action, progress
        return S2Action("done"), progress

    @staticmethod
    def _banner_blocks(action: S2Action, a11y: str, nodes) -> bool:
        """Whether the banner lies where `action` would press (element centre, drag start), or hides it."""
        banner = next((n for n in nodes if n.role == "banner"), None)
        if banner is None:
            return False
        for key in ("element_description", "starting_description"):
            desc = action.args.get(key)
            if not desc:
                continue
            try:
                x1, y1, x2, y2 = ground(a11y, desc)
            except GroundingError:
                return True  # e.g. a title bar wholly under the banner
            if inside(banner.rect, ((x1 + x2) // 2, (y1 + y2) // 2)):
                return True
        return False

    def _act(self, goal: dict[str, Any], nodes) -> S2Action | None:
        """The action that advances `goal`, or None when the goal already holds in the tree."""
        op, win = goal["op"], goal.get("window")
        front = next((n.name for n in nodes if n.role == "window" and "front" in n.attrs), None)
        if win is not None and front != win and op not in ("focus_window", "hotkey", "confirm"):
            return S2Action("click", {"element_description": f'the title bar of the "{win}" window'})
        if op == "focus_window":
            if front == goal["target"]:
                return None
            return S2Action("click", {"element_description": f'the title bar of the "{goal["target"]}" window'})
        if op == "done":
            return S2Action("done")
        if op == "fail":
            return S2Action("fail")
        if op == "hotkey":
            if goal.get("_sent"):
                return None
            goal["_sent"] = True
            return S2Action("hotkey", {"keys": list(goal["keys"])})
        if op == "confirm":
            if goal.get("_sent") or not any(n.role == "alertdialog" for n in nodes):
                return None
            goal["_sent"] = True
            return S2Action("click", {"element_description": describe("button", "OK", CONFIRM)})
        node = self._node(nodes, win, {"click": "button", "check": "checkbox", "type": "field", "select": "dropdown",
                                       "slider": "slider", "list_select": "list"}[op], goal["target"])
        if node is None:
            return S2Action("fail")
        desc = describe(node.role, node.name, node.window)
        if op == "click":
            if goal.get("_sent"):
                return None
            goal["_sent"] = True
            return S2Action("click", {"element_description": desc, "num_clicks": 1, "button_type": "left"})
        if op == "check":
            return None if (node.attr("checked") == "True") == goal["value"] else S2Action(
                "click", {"element_description": desc})
        if op == "type":
            if node.attr("text") == goal["text"]:
                return None
            return S2Action("type", {"element_description": desc, "text": goal["text"], "overwrite": True})
        if op == "select":
            if node.attr("value") == goal["option"]:
                return None
            if node.attr("open") == "True":
                return S2Action("click", {"element_description": describe("option", goal["option"], node.window)})
            return S2Action("click", {"element_description": desc})
        if op == "slider":
            if abs(int(node.attr("value") or 0) - goal["value"]) <= 2:
                return None
            return S2Action("drag_and_drop", {"starting_description": f'the "{node.name}" slider knob',
                                              "ending_description": f'the "{node.name}" slider at {goal["value"]}%'})
        if op == "list_select":
            if node.attr("selected") == goal["item"]:
                return None
            visible = re.findall(r"'([^']*)'", node.attr("visible") or "")
            if goal["item"] in visible:
                return S2Action("click", {"element_description": f'the "{goal["item"]}" row of the "{node.name}" list'})
            items = re.findall(r"'([^']*)'", node.attr("items") or "")
            if goal["item"] not in items:
                return S2Action("fail")
            first = items.index(visible[0]) if visible else 0
            rows = items.index(goal["item"]) - first - (len(visible) - 1 if items.index(goal["item"]) > first else 0)
            return S2Action("scroll", {"element_description": desc, "clicks": -rows})
        raise ValueError(f"unknown expert subgoal op {op!r}")


@dataclasses.dataclass
class ExpertStep:
    screenshot: np.ndarray
    a11y: str
    s2: str  # rendered S2 action
    element_descriptions: list[str]
    boxes: list[list[int]]  # grounded box per description
    actions: list[Action]
    injected: bool = False  # the noise replaced the expert's action here (a wrong click or a missed step)


@dataclasses.dataclass
class ExpertTrace:
    task_id: str
    instruction: str
    plan: list[str]
    steps: list[ExpertStep]
    reward: float

    def save(self, directory: str | pathlib.Path) -> pathlib.Path:
        """trace.json (plan, S2 actions, descriptions, boxes) + one PNG per step."""
        directory = pathlib.Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        steps = []
        for i, s in enumerate(self.steps):
            name = f"step_{i:02d}.png"
            Image.fromarray(s.screenshot).save(directory / name)
            steps.append({"screenshot": name, "a11y": s.a11y, "s2": s.s2, "element_descriptions": s.element_descriptions,
                          "boxes": s.boxes, "injected": s.injected})
        data = {"task_id": self.task_id, "instruction": self.instruction, "plan": self.plan, "reward": self.reward,
                "steps": steps}
        write_text_atomic(directory / "trace.json", json.dumps(data, indent=1))
        return directory

    @classmethod
    def load(cls, directory: str | pathlib.Path) -> "ExpertTrace":
        from envs.actions.s2 import parse_s2

        directory = pathlib.Path(directory)
        path = directory / "trace.json"
        if not path.exists():
            raise FileNotFoundError(f"no trace.json in {directory}")
        data = read_json(path, "expert trace")
        top = _fields(data, {"task_id": str, "instruction": str, "plan": list, "steps": list, "reward": (int, float)},
                      f"{path}")
        steps = []
        for i, s in enumerate(top["steps"]):
            where = f"{path} step {i}"
            s = _fields(s, {"screenshot": str, "a11y": str, "s2": str, "element_descriptions": list, "boxes": list},
                        where)
            image = directory / s["screenshot"]
            try:
                screenshot = np.asarray(Image.open(image).convert("RGB"))
            except (OSError, ValueError) as err:  # missing, unreadable, or not an image
                raise TaskError(f"{where}: cannot read screenshot {image}: {err}") from None
            try:
                boxes = {d: tuple(b) for d, b in zip(s["element_descriptions"], s["boxes"])}
                actions = s2_to_actions(parse_s2(s["s2"]), boxes.__getitem__)
            except (ValueError, KeyError, TypeError, GroundingError) as err:
                raise TaskError(f"{where}: action {s['s2'][:120]!r} cannot be replayed: {err}") from None
            injected = s.get("injected", False)  # absent in traces recorded without noise
            if not isinstance(injected, bool):
                raise TaskError(f"{where}: key 'injected' must be true or false, got {injected!r}")
            steps.append(ExpertStep(screenshot, s["a11y"], s["s2"], s["element_descriptions"], s["boxes"], actions,
                                    injected))
        return cls(top["task_id"], top["instruction"], top["plan"], steps, float(top["reward"]))


def _fields(data: Any, types: dict[str, Any], where: str) -> dict[str, Any]:
    """`data` as an object with every key of `types`, each of its type; a TaskError naming `where` and the key."""
    if not isinstance(data, dict):
        raise TaskError(f"{where}: expected a JSON object, got {type(data).__name__}")
    for key, typ in types.items():
        if key not in data:
            raise TaskError(f"{where}: missing key {key!r}")
        if not isinstance(data[key], typ) or isinstance(data[key], bool):
            raise TaskError(f"{where}: key {key!r} has type {type(data[key]).__name__}")
    return data


def _descriptions(action: S2Action) -> list[str]:
    return [v for k, v in action.args.items() if k.endswith("description") and isinstance(v, str)]


def run_expert(env, task: Task, expert: ScriptedExpert, max_steps: int | None = None) -> ExpertTrace:
    """Roll the expert out on `env` (a DeskEnv), recording every step."""
    obs = env.reset(task)
    task_copy = Task.from_dict(json.loads(json.dumps(task.to_dict())), domain=task.domain, source=task.source)
    plan = expert.plan(task_copy)
    steps, progress = [], 0
    limit = max_steps or env.step_limit
    for _ in range(limit):
        action, progress = expert.next_action(task_copy, obs.a11y_tree, progress)
        descs = _descriptions(action)
        boxes = [list(ground(obs.a11y_tree, d)) for d in descs]
        lookup = {d: tuple(b) for d, b in zip(descs, boxes)}
        actions = s2_to_actions(action, lookup.__getitem__)
        steps.append(ExpertStep(obs.screenshot, obs.a11y_tree, action.render(), descs, boxes, actions,
                                getattr(expert, "injected", False)))
        result = env.step(actions)
        obs = result.observation
        if result.done:
            break
    return ExpertTrace(task.id, task.instruction, plan, steps, env.evaluate())
