"""The action grammars a policy can write, by name, behind one parser call: UI-TARS text (`Thought: ...
Action: click(...)`), EvoCUA's computer_use tool calls (reasoning, `Action: <semantic action>`, then
<tool_call> JSON) and SGCD's pyautogui code (`## Thought:`, `## Action:`, `## Code:` with a fenced block; as
`pyautogui_think`, its variant for thinking backbones, the thought in a `[think] ... [/think]` segment), the
last two in 0-1000 relative coordinates, Qwen3-VL's convention.

Also how a past step is shown once its screenshot has left the prompt: UI-TARS keeps the whole response,
computer_use keeps only its semantic action (EvoCUA §5.1: older steps as text-only semantic actions), the
pyautogui grammars their thought and action without the code (SGCD: the planning chain is kept as text)."""
from __future__ import annotations

from typing import Sequence

from envs.actions import computer_use, pyautogui_code
from envs.actions.computer_use import parse_computer_use, split_response
from envs.actions.model import Action, ActionParseError, ActionType
from envs.actions.uitars import parse_thought, parse_uitars, render_uitars

GRAMMARS = ("uitars", "computer_use", "pyautogui", "pyautogui_think")
PYAUTOGUI_GRAMMARS = ("pyautogui", "pyautogui_think")
RELATIVE = (1000, 1000)  # computer_use and pyautogui coordinates: (0, 0) top-left, (1000, 1000) bottom-right of the screenshot


def _check(grammar: str) -> None:
    if grammar not in GRAMMARS:
        raise ValueError(f"unknown action grammar {grammar!r}; choose one of {GRAMMARS}")


def parse_response(text: str, *, grammar: str, screen_hw: tuple[int, int],
                   coordinate_model: str = "uitars-1.5") -> list[Action]:
    """Every action of one response, in pixels of a screenshot of `screen_hw` (the one the policy saw).
    `coordinate_model` is UI-TARS's coordinate convention; computer_use and pyautogui are always relative."""
    _check(grammar)
    if grammar == "computer_use":
        return parse_computer_use(text, image_hw=RELATIVE, screen_hw=screen_hw)
    if grammar in PYAUTOGUI_GRAMMARS:
        return pyautogui_code.parse_pyautogui(text, image_hw=RELATIVE, screen_hw=screen_hw,
                                              think=grammar == "pyautogui_think")
    return parse_uitars(text, image_hw=screen_hw, screen_hw=screen_hw, model=coordinate_model)


def render_response(thought: str, semantic: str, actions: Sequence[Action], *, grammar: str,
                    screen_hw: tuple[int, int], coordinate_model: str = "uitars-1.5") -> str:
    """A step's text in `grammar`: UI-TARS's `Thought: ...` and `Action: ...` lines, or computer_use's reasoning,
    `Action: <semantic action>` and tool call(s), or pyautogui's three sections (the first a `[think]` segment
    in `pyautogui_think`). `semantic` (the action in words) is not part of UI-TARS text."""
    _check(grammar)
    if grammar == "computer_use":
        return computer_use.render_response(thought, semantic, actions, image_hw=RELATIVE, screen_hw=screen_hw)
    if grammar in PYAUTOGUI_GRAMMARS:
        return pyautogui_code.render_response(thought, semantic, actions, image_hw=RELATIVE, screen_hw=screen_hw,
                                              think=grammar == "pyautogui_think")
    return render_uitars(actions, image_hw=screen_hw, screen_hw=screen_hw, model=coordinate_model, thought=thought)


def reasoning(response: str, grammar: str) -> str:
    """The reasoning part of a response in `grammar` (UI-TARS's Thought, computer_use's text before `Action:`,
    pyautogui's `## Thought:` section or `[think]` segment)."""
    _check(grammar)
    if grammar in PYAUTOGUI_GRAMMARS:
        return pyautogui_code.split_response(response)[0]
    return split_response(response)[0] if grammar == "computer_use" else parse_thought(response)


def history_text(response: str, grammar: str) -> str:
    """A past step's text once its screenshot is no longer shown."""
    _check(grammar)
    if grammar == "computer_use":
        _, semantic = split_response(response)
        return f"Action: {semantic}" if semantic else response
    if grammar in PYAUTOGUI_GRAMMARS:
        thought, semantic = pyautogui_code.split_response(response)
        return pyautogui_code.render_response(thought, semantic, [], image_hw=RELATIVE, screen_hw=RELATIVE,
                                              think=grammar == "pyautogui_think") if semantic else response
    return response


_WORDS = {ActionType.CLICK: "Click", ActionType.LEFT_DOUBLE: "Double-click", ActionType.LEFT_TRIPLE: "Triple-click",
          ActionType.RIGHT_SINGLE: "Right-click", ActionType.MIDDLE_SINGLE: "Middle-click",
          ActionType.HOVER: "Move the pointer", ActionType.DRAG: "Drag", ActionType.WAIT: "Wait",
          ActionType.FINISHED: "Report that the task is complete", ActionType.FAIL: "Report that the task cannot be done",
          ActionType.CALL_USER: "Ask the user for help"}


def action_words(actions: Sequence[Action]) -> str:
    """The actions as a short imperative without positions, for a response whose grammar states none (UI-TARS
    text) shown in one that does."""
    def one(a: Action) -> str:
        if a.kind == ActionType.TYPE:
            return f"Type {a.text!r}"
        if a.kind in (ActionType.HOTKEY, ActionType.PRESS, ActionType.KEYDOWN, ActionType.KEYUP):
            verb = {ActionType.KEYDOWN: "Hold", ActionType.KEYUP: "Release"}.get(a.kind, "Press")
            return f"{verb} {'+'.join(a.keys)}"
        if a.kind == ActionType.SCROLL:
            return f"Scroll {a.direction}"
        return _WORDS.get(a.kind, a.kind.value.replace("_", " ").capitalize())
    return "; ".join(one(a) for a in actions) + "." if actions else ""


def _semantic(response: str, grammar: str) -> str:
    if grammar == "computer_use":
        return split_response(response)[1]
    if grammar in PYAUTOGUI_GRAMMARS:
        return pyautogui_code.split_response(response)[1]
    return ""


def convert_response(response: str, *, source: str, target: str, screen_hw: tuple[int, int],
                     coordinate_model: str = "uitars-1.5", target_coordinate_model: str | None = None) -> str:
    """A response written in `source` (UI-TARS coordinates by `coordinate_model`) shown as `target` would have
    written it (by `target_coordinate_model`, default the same): the same thought, action in words (or
    `action_words` where `source` has none) and actions, in `target`'s form and coordinates. Used when one
    policy continues another's episode in another grammar (SGCD's handoffs to a baseline prompted otherwise).
    A response that does not parse in `source` is kept as it is."""
    _check(source)
    _check(target)
    target_coordinate_model = target_coordinate_model or coordinate_model
    if source == target and (source != "uitars" or target_coordinate_model == coordinate_model):
        return response
    try:
        actions = parse_response(response, grammar=source, screen_hw=screen_hw, coordinate_model=coordinate_model)
    except ActionParseError:
        return response
    semantic = _semantic(response, source) or action_words(actions)
    try:
        return render_response(reasoning(response, source), semantic, actions, grammar=target, screen_hw=screen_hw,
                               coordinate_model=target_coordinate_model)
    except ValueError:  # an action `target` cannot write (e.g. a triple click in UI-TARS text)
        return response
