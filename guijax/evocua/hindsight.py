"""EvoCUA's Hindsight Reasoning Generation (§5.1, Appendix B, Algorithm 1): a successful trajectory's actions
are known, so a reasoning trace z_t is written after the fact for every step, explaining its action from
its state. Step 0 clarifies the goal (or, for a resumed trace, opens with "Reflection:"), intermediate steps
say what changed and why the action is needed, and the terminating step gives the visual evidence for its
verdict. No thought may name pixel coordinates (`check_thought` enforces it), so reasoning stays valid
across resolutions.

Two writers share one interface, `thoughts(instruction, steps, ...) -> list[Thought]`:
  RuleHindsight  the synthetic desk's: from its accessibility tree (the widget the action targets by name,
                 what changed since the last step) and the expert's subgoals (the goal, what remains)
  ChatHindsight  a general VLM behind an OpenAI-compatible endpoint, shown the screenshot(s) as PNG data URLs
                 and the action; answers are validated and retried, then the step is skipped with the reason.
                 The paper describes its prompt templates but prints none; the ones here follow that
                 description (first person, the four phases, no coordinates).
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Sequence

import numpy as np

from envs.actions.model import Action, ActionType
from envs.actions.s2 import S2Action, parse_s2
from envs.desk.a11y import Node, parse_tree

# ------------------------------------------------------------------------------------------ the coordinate check
# What reads as a screen position: a number pair ("(120, 45)", "[120,45]", "120, 45", "120 x 45"), an axis
# value ("x=120", "y: 45"), a pixel measure ("120px", "45 pixels"), a coordinate/point tag. Other numbers
# (a code "8113", "20%", "invoice_4.txt", "3 items") are content and stay.
_COORDINATE_PATTERNS = (
    (re.compile(r"[(\[]\s*-?\d+(?:\.\d+)?\s*[,;]\s*-?\d+(?:\.\d+)?\s*[)\]]"), "a bracketed number pair"),
    (re.compile(r"(?<![\w.])-?\d+(?:\.\d+)?\s*,\s*-?\d+(?:\.\d+)?(?![\w%]|\.\d)"), "a number pair"),
    (re.compile(r"\b\d+\s*[x×]\s*\d+\b"), "a number pair"),
    (re.compile(r"\b[xy]\s*[=:]\s*-?\d+", re.IGNORECASE), "an x / y value"),
    (re.compile(r"\b\d+(?:\.\d+)?\s*(?:px|pixels?)\b", re.IGNORECASE), "a pixel measure"),
    (re.compile(r"<\|?(?:point|box_start|box)\|?>|\bcoordinates?\s*[=:]", re.IGNORECASE), "a coordinate tag"),
)


class ThoughtError(ValueError):
    """A thought that may not enter the cold-start data (empty, naming coordinates, missing its header)."""


def coordinate_leaks(text: str) -> list[str]:
    """The coordinate-like spans of `text`, each with what it looked like ('"(12, 40)": a bracketed number pair')."""
    found = []
    for pattern, what in _COORDINATE_PATTERNS:
        found += [f"{m.group(0)!r}: {what}" for m in pattern.finditer(text)]
    return found


def check_thought(text: str, *, header: str = "") -> str:
    """`text` stripped of a leading 'Thought:' and whitespace, or ThoughtError saying why it is unusable:
    empty, naming pixel coordinates, holding a tool call, or (with `header`) not opening with it."""
    body = re.sub(r"^\s*(?:Thought|Reasoning)\s*:\s*", "", text or "").strip()
    if not body:
        raise ThoughtError("the thought is empty")
    leaks = coordinate_leaks(body)
    if leaks:
        raise ThoughtError(f"the thought names pixel coordinates ({'; '.join(leaks[:3])})")
    if "<tool_call>" in body or re.search(r"(?:^|\n)\s*Action:", body):
        raise ThoughtError("the thought holds the action itself; it must only explain it")
    if header and not body.startswith(header):
        raise ThoughtError(f"the thought must open with {header!r}")
    return body


# ------------------------------------------------------------------------------------------ steps and results
@dataclasses.dataclass(frozen=True)
class HindsightStep:
    """One (observation, action) pair of a successful trajectory, as the writers read it."""

    screenshot: np.ndarray
    actions: tuple[Action, ...]
    semantic: str  # the action in words ("Click the "OK" button in the "Dialog" window.")
    action_text: str = ""  # the action as the policy writes it (computer_use calls), shown to a chat model
    a11y: str = ""  # the desk's accessibility tree at this step ("" elsewhere)
    s2: str = ""  # the expert's framework action, when it came from one


@dataclasses.dataclass(frozen=True)
class Thought:
    """A step's reasoning, or why it has none (`text` None, `skipped` the reason)."""

    text: str | None
    skipped: str | None = None


def phase(index: int, steps: Sequence[HindsightStep], error_context: str = "") -> str:
    """Algorithm 1's branch for step `index`: reflect / goal at t = 0, terminate at a last terminating step,
    observe otherwise."""
    if index == 0:
        return "reflect" if error_context else "goal"
    if index == len(steps) - 1 and any(a.is_terminal for a in steps[index].actions):
        return "terminate"
    return "observe"


# ------------------------------------------------------------------------------------------ semantic actions
_DESC = re.compile(r'the "(?P<name>[^"]+)" (?P<role>\w+) in the "(?P<window>[^"]+)" window')


def _target(description: str) -> str:
    """An element description in the words a semantic action uses."""
    m = _DESC.fullmatch(description)
    if m:
        return f'the "{m["name"]}" {m["role"]} in the "{m["window"]}" window'
    return description


def semantic_action(s2: S2Action | str) -> str:
    """The expert's framework action as a one-line imperative that names its target element, never a position
    (what the paper's trajectories show after 'Action:' and what older history is compressed to)."""
    a = parse_s2(s2) if isinstance(s2, str) else s2
    desc = a.args.get("element_description") or ""
    if a.name == "click":
        clicks = {1: "Click", 2: "Double-click", 3: "Triple-click"}.get(int(a.args.get("num_clicks") or 1), "Click")
        button = a.args.get("button_type") or "left"
        verb = clicks if button == "left" else f"{button.capitalize()}-click"
        return f"{verb} {_target(desc)}."
    if a.name == "type":
        where = f" into {_target(desc)}" if desc else ""
        how = ", replacing its content" if a.args.get("overwrite") else ""
        return f'Type "{a.args.get("text", "")}"{where}{how}.'
    if a.name == "scroll":
        clicks = int(a.args.get("clicks") or 0)
        way = ("right" if clicks > 0 else "left") if a.args.get("shift") else ("up" if clicks > 0 else "down")
        return f"Scroll {_target(desc)} {way}."
    if a.name == "hotkey":
        return f"Press {'+'.join(k.capitalize() for k in a.args.get('keys', []))}."
    if a.name == "hold_and_press":
        return (f"Hold {'+'.join(k.capitalize() for k in a.args.get('hold_keys', []))} and press "
                f"{', '.join(k.capitalize() for k in a.args.get('press_keys', []))}.")
    if a.name == "drag_and_drop":
        return f"Drag {a.args.get('starting_description')} to {a.args.get('ending_description')}."
    if a.name == "wait":
        return "Wait for the screen to settle."
    if a.name == "done":
        return "Report that the task is complete."
    if a.name == "fail":
        return "Report that the task cannot be done."
    return f"Perform {a.name}."


# ------------------------------------------------------------------------------------------ the desk's rule writer
def _key(n: Node) -> tuple[str, str, str]:
    return (n.window or "", n.role, n.name)


def _state(n: Node) -> str:
    """A widget's visible state in words, '' for stateless ones."""
    if n.role == "checkbox":
        return "on" if n.attr("checked") == "True" else "off"
    if n.role in ("field", "label"):
        return f'"{n.attr("text") or ""}"' if n.attr("text") else "empty"
    if n.role == "dropdown":
        value = n.attr("value")
        return (f'set to "{value}"' if value else "unset") + (" and open" if n.attr("open") == "True" else "")
    if n.role == "slider":
        return f"at {n.attr('value')}%"
    if n.role == "list":
        return f'on "{n.attr("selected")}"' if n.attr("selected") else "on no item"
    return ""


def _layers(nodes: Sequence[Node]) -> dict[str, Node]:
    return {n.role: n for n in nodes if n.role in ("dialog", "alertdialog", "banner")}


def _front(nodes: Sequence[Node]) -> str | None:
    return next((n.name for n in nodes if n.role == "window" and "front" in n.attrs), None)


def describe_screen(nodes: Sequence[Node]) -> str:
    """A short summary of what the screen shows: what lies on top, the front window and its widgets."""
    parts = []
    layers = _layers(nodes)
    if "dialog" in layers:
        parts.append(f'A pop-up "{layers["dialog"].name}" covers the screen')
    if "alertdialog" in layers:
        parts.append(f'a confirmation dialog asks "{layers["alertdialog"].attr("message")}"')
    if "banner" in layers:
        parts.append("a notification banner lies across the windows")
    front = _front(nodes)
    if front is not None:
        widgets = [n for n in nodes if n.window == front and n.role not in ("window", "option")]
        listed = ", ".join(f'the "{n.name}" {n.role}' + (f" ({_state(n)})" if _state(n) else "") for n in widgets[:6])
        parts.append(f'the "{front}" window is in front' + (f" with {listed}" if listed else ""))
    text = "; ".join(parts)
    return text[:1].upper() + text[1:] + "." if text else "The screen shows the desk."


def describe_changes(before: Sequence[Node], after: Sequence[Node]) -> list[str]:
    """What the last action visibly changed, widget by widget, in words."""
    changes = []
    old_layers, new_layers = _layers(before), _layers(after)
    for role, what in (("dialog", "the pop-up"), ("alertdialog", "the confirmation dialog"),
                       ("banner", "the notification banner")):
        if role in old_layers and role not in new_layers:
            changes.append(f"{what} is gone")
        elif role in new_layers and role not in old_layers:
            changes.append(f"{what} appeared" if role != "dialog" else f'a pop-up "{new_layers[role].name}" appeared')
    if _front(before) != _front(after) and _front(after) is not None:
        changes.append(f'the "{_front(after)}" window came to the front')
    old = {_key(n): n for n in before if n.role not in ("window", "option", "dialog", "alertdialog", "banner")}
    for n in after:
        prev = old.get(_key(n))
        if prev is not None and _state(prev) != _state(n) and _state(n):
            changes.append(f'the "{n.name}" {n.role} is now {_state(n)}')
        elif prev is not None and n.role == "list" and prev.attr("visible") != n.attr("visible"):
            changes.append(f'the "{n.name}" list shows other rows')
    return changes


def _clause(text: str) -> str:
    return text[:1].lower() + text[1:].rstrip(".") if text else text


def _goal_text(subgoal: dict[str, Any]) -> str:
    from envs.desk.expert import plan_text

    return plan_text(subgoal)


def _serves(subgoal: dict[str, Any], action: S2Action) -> bool:
    """Whether the expert's `action` works towards `subgoal` (names the same target, keys or verdict)."""
    op = subgoal["op"]
    if action.name in ("done", "fail"):
        return op == action.name
    if action.name == "hotkey":
        return op == "hotkey" and list(subgoal["keys"]) == list(action.args.get("keys", []))
    texts = " ".join(str(v) for k, v in action.args.items() if k.endswith("description"))
    if op == "confirm":
        return texts == 'the "OK" button of the confirmation dialog'
    if op == "focus_window":
        return texts == f'the title bar of the "{subgoal["target"]}" window'
    names = [subgoal.get("target"), subgoal.get("option"), subgoal.get("item")]
    return any(name and f'"{name}"' in texts for name in names) and (
        subgoal.get("window") is None or f'"{subgoal["window"]}"' in texts or "open menu" in texts
        or "slider" in texts or " row of " in texts)


def subgoal_progress(subgoals: Sequence[dict[str, Any]], actions: Sequence[S2Action]) -> list[int | None]:
    """For each step, the index of the subgoal its action serves (None for interruptions: closing a pop-up,
    dismissing a banner, cancelling a stray dialog). Subgoals are served in order, as the expert works."""
    out: list[int | None] = []
    current = 0
    for action in actions:
        hit = next((k for k in range(current, len(subgoals)) if _serves(subgoals[k], action)), None)
        if hit is not None:
            current = hit
        out.append(hit)
    return out


def _why(action: S2Action, nodes: Sequence[Node], subgoal: dict[str, Any] | None) -> str:
    """Why the action is needed, from the targeted widget and the subgoal it serves."""
    desc = " ".join(str(v) for k, v in action.args.items() if k.endswith("description"))
    if action.name == "click" and "of the pop-up" in desc:
        return 'The pop-up blocks everything else, so I close it first with its "Close" button'
    if action.name == "click" and "of the notification banner" in desc:
        return 'The notification banner lies over what I need to reach, so I press its "Dismiss" button'
    if action.name == "click" and '"Cancel" button of the confirmation dialog' in desc:
        return 'This confirmation dialog is not part of the task, so I press its "Cancel" button'
    if action.name == "click" and '"OK" button of the confirmation dialog' in desc:
        return 'The dialog asks me to confirm the step the task wants, so I press its "OK" button'
    if action.name == "wait":
        return "The screen may still be changing, so I wait for it to settle"
    goal = _purpose(subgoal)
    m = re.fullmatch(r'the "([^"]+)" option of the open menu', desc)
    if m:
        return f'The menu is open, so I choose "{m[1]}" from it'
    m = re.fullmatch(r'the title bar of the "([^"]+)" window', desc)
    if m:
        return f'The "{m[1]}" window is behind another one, so I click its title bar to bring it to the front{goal}'
    m = _DESC.fullmatch(desc)
    node = next((n for n in nodes if m and (n.window, n.role, n.name) == (m["window"], m["role"], m["name"])), None)
    state = f" (it is {_state(node)})" if node is not None and _state(node) else ""
    if action.name == "type":
        return f'I type "{action.args.get("text", "")}" into {_target(desc)}{state}, replacing what it holds'
    if action.name == "scroll":
        if subgoal is not None and subgoal.get("item"):
            return f'"{subgoal["item"]}" is not among the visible rows, so I scroll {_target(desc)}'
        return f"I scroll {_target(desc)}{goal}"
    if action.name == "drag_and_drop":
        return f"I drag {action.args.get('starting_description')} to {action.args.get('ending_description')}{goal}"
    if action.name == "hotkey":
        return f"I press {'+'.join(k.capitalize() for k in action.args.get('keys', []))}{goal}"
    if action.name == "click":
        if m and m["role"] == "dropdown":
            return f"I open {_target(desc)}{state}{goal}"
        return f"I click {_target(desc)}{state}{goal}"
    return f"I {_clause(semantic_action(action))}{goal}"


def _purpose(subgoal: dict[str, Any] | None) -> str:
    """What the action is for, where the action alone does not say it (a click that toggles a checkbox, one
    that opens a menu); '' where the action is the subgoal itself."""
    if subgoal is None:
        return ""
    if subgoal["op"] == "check":
        return f' to turn it {"on" if subgoal["value"] else "off"}'
    if subgoal["op"] == "select":
        return f' so that I can choose "{subgoal["option"]}"'
    if subgoal["op"] == "list_select":
        return f' to select "{subgoal["item"]}"'
    if subgoal["op"] == "slider":
        return f' to set it to {subgoal["value"]}%'
    return ""


class RuleHindsight:
    """Thoughts for scripted-expert traces on the synthetic desk, written from the accessibility tree and the
    task's expert subgoals, in Algorithm 1's four phases. Deterministic; every thought passes `check_thought`.
    `brief` leaves out the screen descriptions (what is shown, what changed, the final evidence) and keeps the
    action's reason, what remains and the verdict: a fifth of the tokens, for small models on CPU."""

    def __init__(self, brief: bool = False):
        self.brief = brief

    def thoughts(self, instruction: str, steps: Sequence[HindsightStep], *,
                 subgoals: Sequence[dict[str, Any]] = (), error_context: str = "") -> list[Thought]:
        for i, s in enumerate(steps):
            if not s.a11y or not s.s2:
                raise ValueError(f"step {i}: the rule-based writer needs the desk's accessibility tree and the "
                                 "expert's S2 action")
        actions = [parse_s2(s.s2) for s in steps]
        trees = [parse_tree(s.a11y) for s in steps]
        served = subgoal_progress(subgoals, actions)
        last_step = {k: i for i, k in enumerate(served) if k is not None}
        out = []
        for i, (s, action, nodes) in enumerate(zip(steps, actions, trees)):
            goal = subgoals[served[i]] if served[i] is not None else None
            why = _why(action, nodes, goal)
            remaining = [_goal_text(g) for k, g in enumerate(subgoals)
                         if g["op"] not in ("done", "fail") and last_step.get(k, -1) > i
                         and (served[i] is None or k >= served[i])]
            rest = (f" After this, what remains: {'; '.join(_clause(r) for r in remaining)}." if remaining
                    else "")
            kind = phase(i, steps, error_context)
            if kind in ("goal", "reflect"):
                plan = "; ".join(_clause(_goal_text(g)) for g in subgoals if g["op"] not in ("done", "fail"))
                head = (f"Reflection: I realize that {_clause(error_context)}. Now I will try a different approach. "
                        if kind == "reflect" else "")
                screen = "" if self.brief else f"{describe_screen(nodes)} The task is: {instruction.strip()}"
                text = (f"{head}{screen}" + (f" My plan: {plan}." if plan and not self.brief else "")
                        + f" {why}.{rest}").strip()
                if action.name in ("done", "fail"):  # a one-step trace: its first step is also its verdict
                    text = f"{head}The task is: {instruction.strip()} {self._verdict(instruction, action, nodes, subgoals)}"
            elif kind == "terminate":
                text = self._verdict(instruction, action, nodes, subgoals, self.brief)
            else:
                changes = describe_changes(trees[i - 1], nodes)
                seen = (f"Since my last action, {'; '.join(changes)}." if changes
                        else "My last action left the screen as it was.")
                text = f"{why}.{rest}" if self.brief else f"{seen} {why}.{rest}"
            out.append(Thought(check_thought(text, header="Reflection:" if kind == "reflect" else "")))
        return out

    @staticmethod
    def _verdict(instruction: str, action: S2Action, nodes: Sequence[Node],
                 subgoals: Sequence[dict[str, Any]], brief: bool = False) -> str:
        """The terminating step's evidence: the widgets the task set, as the final screen shows them."""
        if brief:
            return ("Nothing here offers what the task asks for, so I report failure." if action.name == "fail"
                    else "Every part of the task is done, so I report success.")
        by_name = {(n.window, n.name): n for n in nodes}
        evidence = []
        for g in subgoals:
            n = by_name.get((g.get("window"), g.get("target")))
            if n is not None and _state(n):
                evidence.append(f'the "{n.name}" {n.role} is {_state(n)}')
        if action.name == "fail":
            return (f"I check the screen against the task. {describe_screen(nodes)} Nothing here offers what the task asks for, so it cannot be done "
                    "and I report failure.")
        seen = f"The final screen shows that {', '.join(evidence)}. " if evidence else f"{describe_screen(nodes)} "
        return f"I check the final screen against the task. {seen}Every part of the task is done, so I report success."


# ------------------------------------------------------------------------------------------ the chat writer
_RULES = ("Write in the first person, as the agent thinking before it acts, in a few sentences. Never mention "
          "pixel coordinates or numbers that locate something on the screen: name the element instead (its "
          "label, its window, its role), e.g. \"click the 'File' menu\", not \"click at (100, 200)\". Answer with "
          "the reasoning only: no 'Action:' line, no tool call.")
GOAL_PROMPT = ("You write the reasoning of a computer-use agent, after the fact. Task: {instruction}\n"
               "The screenshot shows the screen at the first step, where the agent then did:\n{action}\n"
               "Write the reasoning behind this first step: state what the screen shows, restate the task goal in "
               "your own words, give a short plan, then explain why this action is the right first move. " + _RULES)
OBSERVE_PROMPT = ("You write the reasoning of a computer-use agent, after the fact. Task: {instruction}\n"
                  "Its steps so far:\n{history}\nThe first screenshot is the screen before its last step, the "
                  "second the screen now, where the agent then did:\n{action}\n"
                  "Write the reasoning behind this step: what changed on the screen, and why this action is "
                  "needed to advance the task. " + _RULES)
TERMINATE_PROMPT = ("You write the reasoning of a computer-use agent, after the fact. Task: {instruction}\n"
                    "Its steps so far:\n{history}\nThe screenshot is the final screen; the agent now ends the task "
                    "reporting {verdict}.\nWrite the reasoning that checks the final screen against the task and "
                    "names the visual evidence for this verdict. " + _RULES)
REFLECT_PROMPT = ("You write the reasoning of a computer-use agent, after the fact. Task: {instruction}\n"
                  "An earlier attempt failed: {error}\nThe screenshot shows the screen now, where the agent then "
                  "did:\n{action}\nWrite the reasoning behind this step. It must begin with 'Reflection:' and "
                  "analyse why the earlier attempt failed, then turn to the corrected plan (\"Now I will try a "
                  "different approach...\") and explain this action. " + _RULES)


def _history(steps: Sequence[HindsightStep], thoughts: Sequence[Thought]) -> str:
    lines = [f"{i + 1}. {t.text + ' ' if t.text else ''}Action: {s.semantic}" for i, (s, t) in
             enumerate(zip(steps, thoughts))]
    return "\n".join(lines) or "(none)"


class ChatHindsight:
    """Thoughts from a general VLM (`guijax.chat.ChatClient`), one request per step in Algorithm 1's order, the
    history of earlier (thought, action) pairs in each prompt. An answer that fails `check_thought` is asked
    again up to `retries` times; then the step is skipped with the reason. Transport failures (ChatError)
    propagate: a dead endpoint must stop the stage rather than empty the data."""

    def __init__(self, client: Any, retries: int = 2, temperature: float | None = None):
        self.client, self.retries, self.temperature = client, retries, temperature

    def messages(self, instruction: str, steps: Sequence[HindsightStep], index: int,
                 thoughts: Sequence[Thought], error_context: str = "") -> list[dict[str, Any]]:
        """The request for step `index` (Algorithm 1's CONSTRUCT*PROMPT), screenshots as PNG data URLs."""
        from guijax.chat import image_part

        s = steps[index]
        kind = phase(index, steps, error_context)
        action = f"{s.semantic}\n{s.action_text}".strip()
        history = _history(steps[:index], thoughts[:index])
        if kind == "goal":
            text, frames = GOAL_PROMPT.format(instruction=instruction, action=action), [s.screenshot]
        elif kind == "reflect":
            text = REFLECT_PROMPT.format(instruction=instruction, error=error_context, action=action)
            frames = [s.screenshot]
        elif kind == "terminate":
            verdict = "success" if any(a.kind == ActionType.FINISHED for a in s.actions) else "failure"
            text, frames = TERMINATE_PROMPT.format(instruction=instruction, history=history, verdict=verdict), [s.screenshot]
        else:
            text = OBSERVE_PROMPT.format(instruction=instruction, history=history, action=action)
            frames = [steps[index - 1].screenshot, s.screenshot]
        content: list[dict[str, Any]] = [{"type": "text", "text": text}]
        content += [image_part(f) for f in frames]
        return [{"role": "user", "content": content}]

    def thoughts(self, instruction: str, steps: Sequence[HindsightStep], *,
                 subgoals: Sequence[dict[str, Any]] = (), error_context: str = "") -> list[Thought]:
        out: list[Thought] = []
        for i in range(len(steps)):
            header = "Reflection:" if phase(i, steps, error_context) == "reflect" else ""
            request = self.messages(instruction, steps, i, out, error_context)
            reasons = []
            for _ in range(self.retries + 1):
                try:
                    out.append(Thought(check_thought(self.client.complete(request, self.temperature), header=header)))
                    break
                except ThoughtError as err:
                    reasons.append(str(err))
            else:
                out.append(Thought(None, f"step {i}: no usable thought after {len(reasons)} answers: "
                                         + " | ".join(reasons)))
        return out


def make_writer(kind: str, url: str = "", model: str = "", api_key_env: str = "OPENAI_API_KEY",
                retries: int = 2, brief: bool = False) -> RuleHindsight | ChatHindsight:
    """The writer `coldstart.hindsight` names: 'rule' (the desk's; `brief` thoughts) or 'chat' (a VLM at
    `url`)."""
    if kind == "rule":
        return RuleHindsight(brief)
    if kind == "chat":
        from guijax.chat import ChatClient

        if not url or not model:
            raise ValueError("coldstart.hindsight='chat' needs coldstart.hindsight_url and coldstart.hindsight_model")
        return ChatHindsight(ChatClient(url, model, api_key_env=api_key_env), retries=retries)
    raise ValueError(f"coldstart.hindsight={kind!r} is not one of ('rule', 'chat')")
