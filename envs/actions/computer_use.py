"""EvoCUA's native `computer_use` tool call (EvoCUA Table 6): JSON in <tool_call> tags,
{"name": "computer_use", "arguments": {"action": ..., ...}}, mapped onto the typed action model.

Coordinates are in the model's coordinate space `image_hw` (height, width), scaled to the screen: pass the
smart-resized image size for a model that writes absolute pixels of the image it saw (Qwen2.5-VL style), or
(1000, 1000) for one that writes 0-1000 relative coordinates (Qwen3-VL style).
`left_click_drag` drags from the current cursor, which is the previous mouse_move/click in the same
response or the `cursor` argument; a mouse_move directly followed by left_click_drag is one DRAG.
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
            args = {"action": "scroll" if vertical else "hscroll", "pixels": sign * int(a.amount or 5)}
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
