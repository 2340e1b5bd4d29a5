"""EvoCUA's native `computer_use` tool call (EvoCUA Table 6): JSON in <tool_call> tags,
{"name": "computer_use", "arguments": {"action": ..., ...}}, mapped onto the typed action model.

Coordinates are in the model's coordinate space `image_hw` (height, width), scaled to the screen: pass the
smart-resized image size for a model that writes absolute pixels of the image it saw (Qwen2.5-VL style), or
(1000, 1000) for one that writes 0-1000 relative coordinates (Qwen3-VL style).
`left_click_drag` drags from the current cursor, which is the previous mouse_move/click in the same
response or the `cursor` argument; a mouse_move directly followed by left_click_drag is one DRAG.

A whole EvoCUA response (its trajectory figures) is the reasoning, a one-line semantic action and the tool
call(s): `render_response` writes it, `split_response` reads the first two back, `parse_computer_use` the
third. `system_prompt` declares the tool to the policy; the paper prints no prompt, so it is written here
from Table 6's definitions.
"""
from __future__ import annotations

import json
import re
from typing import Any, Sequence

from envs.actions.model import Action, ActionParseError, ActionType, only_parse_errors

_CLICKS = {"left_click": ActionType.CLICK, "right_click": ActionType.RIGHT_SINGLE,
           "middle_click": ActionType.MIDDLE_SINGLE, "double_click": ActionType.LEFT_DOUBLE,
           "triple_click": ActionType.LEFT_TRIPLE, "mouse_move": ActionType.HOVER}
_KEYS = {"key": ActionType.HOTKEY, "key_down": ActionType.KEYDOWN, "key_up": ActionType.KEYUP}
ACTIONS = tuple(_CLICKS) + tuple(_KEYS) + ("type", "left_click_drag", "scroll", "hscroll", "wait", "terminate")
_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def _scale(coord: Any, image_hw, screen_hw, text: str) -> tuple[tuple[int, int], bool]:
    if not (isinstance(coord, (list, tuple)) and len(coord) == 2
            and all(isinstance(v, (int, float)) and not isinstance(v, bool) and abs(v) < 1e9 for v in coord)):
        raise ActionParseError(f"coordinate must be [x, y], got {coord!r}", text)
    x = round(coord[0] / image_hw[1] * screen_hw[1])
    y = round(coord[1] / image_hw[0] * screen_hw[0])
    cx, cy = min(max(x, 0), screen_hw[1] - 1), min(max(y, 0), screen_hw[0] - 1)
    return (cx, cy), (cx, cy) != (x, y)


@only_parse_errors
def parse_computer_use(text: str, *, image_hw: tuple[int, int], screen_hw: tuple[int, int],
                       cursor: tuple[int, int] | None = None) -> list[Action]:
    """Every computer_use call of a response, in screen pixels. Raises ActionParseError on malformed text."""
    bodies = _TOOL_CALL.findall(text)
    if not bodies and text.strip().startswith("{"):  # a bare JSON call, as some serving stacks return it
        bodies = [text.strip()]
    if not bodies:
        raise ActionParseError("no <tool_call> in the response", text)
    actions: list[Action] = []
    for body in bodies:
        try:
            call = json.loads(body)
        except json.JSONDecodeError as e:
            raise ActionParseError(f"tool call is not valid JSON ({e.msg})", text) from None
        if not isinstance(call, dict) or call.get("name") != "computer_use":
            raise ActionParseError(f"unknown tool {call.get('name') if isinstance(call, dict) else call!r}", text)
        args = call.get("arguments") or {}
        if isinstance(args, str):  # some serving stacks send the arguments as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                raise ActionParseError("tool call arguments are a string that is not JSON", text) from None
        if not isinstance(args, dict):
            raise ActionParseError(f"tool call arguments must be an object, got {type(args).__name__}", text)
        name = args.get("action")
        if name not in ACTIONS:
            raise ActionParseError(f"unknown computer_use action {name!r}", text)
        if name in _CLICKS:
            point, clipped = _scale(args.get("coordinate"), image_hw, screen_hw, text)
            actions.append(Action(_CLICKS[name], point=point, clipped=clipped))
            cursor = point
        elif name in _KEYS:
            keys = args.get("keys")
            if not keys:
                raise ActionParseError(f"{name} needs 'keys'", text)
            keys = [keys] if isinstance(keys, str) else keys
            if not (isinstance(keys, list) and all(isinstance(k, str) and k for k in keys)):
                raise ActionParseError(f"{name} 'keys' must be a key name or a list of them", text)
            keys = tuple(k.lower() for k in keys)
            if name == "key":
                actions.append(Action(ActionType.PRESS if len(keys) == 1 else ActionType.HOTKEY, keys=keys))
            else:
                ordered = keys if name == "key_down" else tuple(reversed(keys))
                actions += [Action(_KEYS[name], keys=(k,)) for k in ordered]
        elif name == "type":
            if not isinstance(args.get("text"), str):
                raise ActionParseError("type needs a string 'text'", text)
            actions.append(Action(ActionType.TYPE, text=args["text"]))
        elif name == "left_click_drag":
            end, clipped = _scale(args.get("coordinate"), image_hw, screen_hw, text)
            if cursor is None:
                raise ActionParseError("left_click_drag needs a known cursor position (mouse_move first)", text)
            if actions and actions[-1].kind == ActionType.HOVER and actions[-1].point == cursor:
                clipped |= actions.pop().clipped  # the drag itself moves to its start first
            actions.append(Action(ActionType.DRAG, point=cursor, end_point=end, clipped=clipped))
            cursor = end
        elif name in ("scroll", "hscroll"):
            pixels = args.get("pixels")
            if not isinstance(pixels, (int, float)) or isinstance(pixels, bool) or not abs(pixels) < 1e9:
                raise ActionParseError(f"{name} needs numeric 'pixels'", text)
            point, clipped = cursor, False
            if "coordinate" in args:
                point, clipped = _scale(args["coordinate"], image_hw, screen_hw, text)
                cursor = point
            if name == "scroll":
                direction = "up" if pixels > 0 else "down"
            else:
                direction = "left" if pixels < 0 else "right"
            actions.append(Action(ActionType.SCROLL, point=point, direction=direction, amount=float(abs(pixels)),
                                  clipped=clipped))
        elif name == "wait":
            seconds = args.get("time", 1.0)
            if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or not 0 <= seconds < 1e6:
                raise ActionParseError(f"wait 'time' must be a number of seconds, got {seconds!r}", text)
            actions.append(Action(ActionType.WAIT, amount=float(seconds)))
        else:
            status = args.get("status")
            if status not in ("success", "failure"):
                raise ActionParseError(f"terminate status must be 'success' or 'failure', got {status!r}", text)
            actions.append(Action(ActionType.FINISHED if status == "success" else ActionType.FAIL))
    return actions


def render_computer_use(actions: Sequence[Action], *, image_hw: tuple[int, int], screen_hw: tuple[int, int]) -> str:
    """<tool_call> blocks for the actions (inverse of parse_computer_use up to coordinate rounding)."""
    def coord(p):
        return [round(p[0] / screen_hw[1] * image_hw[1]), round(p[1] / screen_hw[0] * image_hw[0])]

    inverse_clicks = {v: k for k, v in _CLICKS.items()}
    calls = []
    for a in actions:
        if a.kind in inverse_clicks:
            args = {"action": inverse_clicks[a.kind], "coordinate": coord(a.point)}
        elif a.kind == ActionType.HOTKEY:
            args = {"action": "key", "keys": list(a.keys)}
        elif a.kind == ActionType.PRESS:  # keys pressed one after another, each its own key call
            calls += [{"action": "key", "keys": [k]} for k in a.keys[:-1]]
            args = {"action": "key", "keys": [a.keys[-1]]}
        elif a.kind in (ActionType.KEYDOWN, ActionType.KEYUP):
            args = {"action": "key_down" if a.kind == ActionType.KEYDOWN else "key_up", "keys": list(a.keys)}
        elif a.kind == ActionType.TYPE:
            args = {"action": "type", "text": a.text}
        elif a.kind == ActionType.DRAG:
            calls.append({"action": "mouse_move", "coordinate": coord(a.point)})
            args = {"action": "left_click_drag", "coordinate": coord(a.end_point)}
        elif a.kind == ActionType.SCROLL:
            vertical = a.direction in ("up", "down")
            sign = 1 if a.direction in ("up", "right") else -1
            amount = a.amount if a.amount else 5.0  # the parser reads the amount back as a float
            args = {"action": "scroll" if vertical else "hscroll",
                    "pixels": sign * (int(amount) if float(amount).is_integer() else amount)}
            if a.point is not None:
                args["coordinate"] = coord(a.point)
        elif a.kind == ActionType.WAIT:
            args = {"action": "wait", "time": a.amount or 1.0}
        elif a.kind in (ActionType.FINISHED, ActionType.FAIL):
            args = {"action": "terminate", "status": "success" if a.kind == ActionType.FINISHED else "failure"}
        else:
            raise ValueError(f"action {a.kind.value!r} has no computer_use equivalent")
        calls.append(args)
    return "\n".join(f"<tool_call>\n{json.dumps({'name': 'computer_use', 'arguments': c})}\n</tool_call>"
                     for c in calls)


# ------------------------------------------------------------------------------------------ the tool and prompt
_COORDINATE = {"type": "array", "items": {"type": "number"}, "minItems": 2, "maxItems": 2}
_KEY_LIST = {"type": "array", "items": {"type": "string"}}
TOOL = {
    "type": "function",
    "function": {
        "name": "computer_use",
        "description": "Use a mouse and keyboard to interact with the computer shown in the screenshots.",
        "parameters": {
            "type": "object",
            "required": ["action"],
            "properties": {
                "action": {"type": "string", "enum": list(ACTIONS), "description": (
                    "key: press and release the keys together (a key combination). "
                    "key_down: press and hold the keys (e.g. shift for a multi-selection). "
                    "key_up: release held keys, in reverse order. "
                    "type: type a string of text. "
                    "mouse_move: move the cursor to a coordinate. "
                    "left_click / right_click / middle_click / double_click / triple_click: click there "
                    "(triple_click selects a whole line of text). "
                    "left_click_drag: press the left button at the cursor and drag to a coordinate. "
                    "scroll / hscroll: scroll vertically (positive pixels: up) or horizontally (positive: "
                    "right), at the coordinate if given. "
                    "wait: pause so the screen can finish changing. "
                    "terminate: end the task, reporting success or failure.")},
                "keys": dict(_KEY_LIST, description="Required by key, key_down and key_up."),
                "text": {"type": "string", "description": "Required by type."},
                "coordinate": dict(_COORDINATE, description="(x, y): required by the clicks, mouse_move and "
                                                            "left_click_drag; optional for scroll / hscroll."),
                "pixels": {"type": "number", "description": "Required by scroll and hscroll."},
                "time": {"type": "number", "description": "Seconds to wait; required by wait."},
                "status": {"type": "string", "enum": ["success", "failure"], "description": "Required by terminate."},
            },
        },
    },
}


def coordinate_note(image_hw: tuple[int, int]) -> str:
    """How the prompt states the coordinate space: 0-1000 relative (Qwen3-VL, EvoCUA) or screenshot pixels."""
    if tuple(image_hw) == (1000, 1000):
        return "Coordinates are relative: (0, 0) is the top-left corner of the screenshot and (1000, 1000) the bottom-right."
    return (f"Coordinates are pixels of the screenshot, which is {image_hw[1]} wide and {image_hw[0]} high; "
            "(0, 0) is its top-left corner.")


def system_prompt(image_hw: tuple[int, int], compact: bool = False) -> str:
    """The policy's prompt for this grammar, with one slot, {instruction}, as guijax.rollout.prompt's templates
    have (the tool's JSON braces are doubled so that str.format leaves them alone). `compact` lists the
    actions in one line instead of the tool's JSON schema, for small CPU models where prompt tokens cost."""
    if compact:
        return ("You are a GUI agent. Reason, then write 'Action: ...' and <tool_call> JSON calls of computer_use "
                f"with an action of {', '.join(ACTIONS)}. {coordinate_note(image_hw)}\nTask: {{instruction}}\n")
    tool = json.dumps(TOOL).replace("{", "{{").replace("}", "}}")
    return ("You are a GUI agent operating a computer. You are given a task, your earlier steps and screenshots. "
            "Perform the next action to complete the task.\n\n"
            "# Tools\n\nYou may call the function described within <tools></tools>:\n"
            f"<tools>\n{tool}\n</tools>\n\n{coordinate_note(image_hw)}\n\n"
            "# Response format\n\n"
            "First reason about the screen and the task in plain words, without pixel coordinates. Then write "
            "one line 'Action: ...' that names the action and its target element, then the call(s), each as\n"
            "<tool_call>\n{{\"name\": \"computer_use\", \"arguments\": {{...}}}}\n</tool_call>\n"
            "End the task with the terminate action once the screen shows it done (or impossible).\n\n"
            "# Task\n\n{instruction}\n")


def render_response(thought: str, semantic: str, actions: Sequence[Action], *, image_hw: tuple[int, int],
                    screen_hw: tuple[int, int]) -> str:
    """One EvoCUA step's text: reasoning, `Action: <semantic action>`, the tool call(s). Empty parts are left
    out (a step without reasoning; history compressed to its semantic action alone)."""
    action = f"Action: {semantic.strip()}" if semantic.strip() else ""
    calls = render_computer_use(actions, image_hw=image_hw, screen_hw=screen_hw) if actions else ""
    tail = "\n".join(x for x in (action, calls) if x)
    return "\n\n".join(x for x in (thought.strip(), tail) if x)


def split_response(text: str) -> tuple[str, str]:
    """(reasoning, semantic action) of a response `render_response` wrote or a model answered in its form."""
    before = text.split("<tool_call>", 1)[0]
    m = re.search(r"(?:^|\n)[ \t]*Action:[ \t]*(.*?)[ \t]*(?:\n|$)", before)
    if m is None:
        return before.strip(), ""
    return before[:m.start()].strip(), m.group(1).strip()
