"""SEAgent's state-change captions C (§3.1, Alg. 1 line 11): what each step of an episode changed on the
screen, the World State Model's second output beside its judgment, and what the curriculum generator reads
to learn the software ("the agent has provided the following feedback on its operations").

On the synthetic desk the captions come from ground truth: the episode is replayed with its seed
(`guijax.sgcd.desk_skills.replay`) and the accessibility trees before and after each step are compared:
windows and dialogs that opened, closed or came to the front, and every control whose state changed
(a checkbox ticked, a field's text, a dropdown's value, a list's selection, a slider's value).
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from envs.actions.model import Action, ActionType
from envs.api import Task
from envs.desk.a11y import Node, describe, parse_tree
from guijax.rollout.trajectory import Trajectory

_LAYERS = {"dialog": "pop-up", "alertdialog": "confirmation dialog", "banner": "notification banner"}
_STATES = {"checkbox": ("checked",), "field": ("text",), "dropdown": ("value", "open"), "list": ("selected", "visible"),
           "slider": ("value",), "label": ("text",)}
_UNCHANGED = "The screen did not change."


def _key(node: Node) -> tuple[str, str, str | None]:
    return node.role, node.name, node.window


def _state_change(role: str, name: str, window: str | None, key: str, new: str | None) -> str:
    where = f'in the "{window}" window' if window else ""
    control = f'the "{name}" {role} {where}'.strip()
    if key == "checked":
        return f"{control} is now {'checked' if new == 'True' else 'unchecked'}"
    if key == "open":
        return f"{control} {'opened its options' if new == 'True' else 'closed its options'}"
    if key == "text":
        return f'{control} now reads "{new}"'
    if key == "visible":
        return f"{control} scrolled to show {new}"
    shown = f"{new}%" if role == "slider" else f'"{new}"'
    return f"{control} now {'selects' if key == 'selected' else 'shows'} {shown}"


def change_caption(before: str, after: str, recorded: Sequence[str] = ()) -> str:
    """What changed between two accessibility trees of the desk, then the `recorded` changes the trees do not
    show, as one sentence (`_UNCHANGED` when nothing)."""
    old, new = parse_tree(before), parse_tree(after)
    old_by, new_by = {_key(n): n for n in old}, {_key(n): n for n in new}
    changes: list[str] = []
    for layer_role, word in _LAYERS.items():
        was = [n for n in old if n.role == layer_role]
        now = [n for n in new if n.role == layer_role]
        for n in now:
            if _key(n) not in old_by:
                message = n.attr("message")
                changes.append(f'a {word} appeared' + (f' saying "{message}"' if message else ""))
        changes += [f"the {word} closed" for n in was if _key(n) not in new_by]
    old_windows = [n.name for n in old if n.role == "window"]
    new_windows = [n.name for n in new if n.role == "window"]
    changes += [f'the "{w}" window opened' for w in new_windows if w not in old_windows]
    changes += [f'the "{w}" window closed' for w in old_windows if w not in new_windows]
    was_front, front = (next((n.name for n in nodes if n.role == "window" and "front" in n.attrs.split()), None)
                        for nodes in (old, new))
    if front is not None and front != was_front and front in old_windows:
        changes.append(f'the "{front}" window came to the front')
    for key, node in new_by.items():
        previous = old_by.get(key)
        if previous is None or node.role not in _STATES:
            continue
        for state in _STATES[node.role]:
            if node.attr(state) != previous.attr(state):
                changes.append(_state_change(node.role, node.name, node.window, state, node.attr(state)))
    text = "; ".join([*changes, *recorded])
    return text[0].upper() + text[1:] + "." if text else _UNCHANGED


def _state_words(node: Node) -> str:
    """A control's state as a caption says it ("checked", 'showing "French"', "at 30%", "empty")."""
    value = {k: node.attr(k) for k in _STATES.get(node.role, ())}
    if node.role == "checkbox":
        return "checked" if value["checked"] == "True" else "unchecked"
    if node.role in ("field", "label"):
        return f'reads "{value["text"]}"' if value["text"] else "empty"
    if node.role == "dropdown":
        return f'showing "{value["value"]}"' + (", options open" if value["open"] == "True" else "")
    if node.role == "list":
        return f'"{value["selected"]}" selected' if value["selected"] else "nothing selected"
    if node.role == "slider":
        return f"at {value['value']}%"
    return ""


def screen_captions(a11y: str) -> list[str]:
    """Dense captions of one screen (Alg. 1 line 3, CaptionGUI(S_0)): a sentence per window or dialog naming
    its controls and their states, front-most first."""
    out: list[str] = []
    for node in parse_tree(a11y):
        if node.role in _LAYERS or node.role == "window":
            message = node.attr("message")
            head = (f'A {_LAYERS[node.role]}' + (f' says "{message}"' if message else "")) if node.role in _LAYERS \
                else f'The "{node.name}" window' + (" (in front)" if "front" in node.attrs.split() else "")
            out.append(head + " holds:")
        elif node.role == "option":
            continue
        else:
            state = _state_words(node)
            out[-1] += f' {node.role} "{node.name}"' + (f" ({state})" if state else "") + ";"
    return [line[:-len(" holds:")] + " is empty." if line.endswith(" holds:") else line.rstrip(";") + "."
            for line in out]


def recorded_changes(before: dict, after: dict) -> list[str]:
    """What the desk's state records that its accessibility tree does not show: button clicks and saves."""
    out = []
    for title, window in after.get("windows", {}).items():
        old = before.get("windows", {}).get(title, {})
        if window.get("saved") and not old.get("saved"):
            out.append(f'the "{title}" window was saved')
        for name, widget in window.get("widgets", {}).items():
            clicks = widget.get("clicks", 0) - old.get("widgets", {}).get(name, {}).get("clicks", 0)
            if clicks > 0:
                out.append(f'the "{name}" button in the "{title}" window registered '
                           f'{"a click" if clicks == 1 else f"{clicks} clicks"}')
    return out


def action_phrase(actions: Sequence[Action], a11y: str) -> str:
    """The step's action in words, naming the element a pointer action hit on the screen it acted on."""
    if not actions:
        return "did nothing"
    first = actions[0]
    if first.kind == ActionType.FINISHED:
        return "reported the task done"
    if first.kind in (ActionType.FAIL, ActionType.CALL_USER):
        return "gave the task up as infeasible"
    if first.kind == ActionType.TYPE:
        return f'typed "{first.text}"'
    if first.kind in (ActionType.HOTKEY, ActionType.PRESS, ActionType.KEYDOWN, ActionType.KEYUP):
        return f"pressed {'+'.join(first.keys)}"
    if first.kind == ActionType.WAIT:
        return "waited"
    verb = {ActionType.CLICK: "clicked", ActionType.LEFT_DOUBLE: "double-clicked",
            ActionType.LEFT_TRIPLE: "triple-clicked", ActionType.RIGHT_SINGLE: "right-clicked",
            ActionType.MIDDLE_SINGLE: "middle-clicked", ActionType.DRAG: "dragged from",
            ActionType.SCROLL: f"scrolled {first.direction or ''}".rstrip() + " over"}.get(
                first.kind, first.kind.value.replace("_", " ") + " on")
    if first.point is None:
        return verb
    from guijax.sgcd.desk_skills import node_at

    node = node_at(a11y, first.point)
    target = describe(node.role, node.name, node.window) if node is not None else "an empty spot"
    return f"{verb} {target}"


@dataclasses.dataclass(frozen=True)
class StepChange:
    """One replayed step's screens and what changed between them (the change-description pair)."""

    index: int  # 1-based step number
    before: np.ndarray
    after: np.ndarray
    change: str


@dataclasses.dataclass(frozen=True)
class EpisodeRecord:
    """What the desk's ground truth says of an episode, step by step: the captions ("Step k: <action>. <what
    changed>"), each replayed step's before/after screens, and the screen the last step left (None when the
    replay stopped early)."""

    captions: list[str]
    changes: list[StepChange]
    final_screenshot: np.ndarray | None


def desk_episode_record(task: Task, trajectory: Trajectory, screen_hw: tuple[int, int], popups: bool = False,
                        coordinate_model: str = "uitars-1.5", grammar: str = "uitars") -> EpisodeRecord:
    """The episode replayed with its seed (see EpisodeRecord); replay ends at a response that does not parse or
    a screen that differs from the episode's, and so do the captions."""
    from guijax.sgcd.desk_skills import replay

    captions: list[str] = []
    changes: list[StepChange] = []
    final = None
    for r in replay(task, trajectory, screen_hw, popups, coordinate_model, grammar=grammar):
        if not r.replayable:
            captions.append(f"Step {r.index}: the screen differs from the episode's; not replayed.")
            final = None
            break
        if r.actions is None:
            captions.append(f"Step {r.index}: the answer did not parse; the episode ended.")
            final = r.before.screenshot
            break
        change = change_caption(r.before.a11y_tree or "", r.after.a11y_tree or "",
                                recorded_changes(r.state_before, r.env.scene.state()))
        captions.append(f"Step {r.index}: {action_phrase(r.actions, r.before.a11y_tree or '')}. {change}")
        changes.append(StepChange(r.index, r.before.screenshot, r.after.screenshot, change))
        final = r.after.screenshot
    return EpisodeRecord(captions, changes, final)
