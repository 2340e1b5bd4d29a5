"""UI-TARS text grammar: `Thought: ...` (or `Reflection:` / `Action_Summary:`) then `Action: call(...)`.

Coordinates: UI-TARS-1.5 writes absolute pixels on the smart-resized screenshot it was shown; UI-TARS-1.0
writes 0-1000 relative coordinates. Both are mapped to screen pixels here, so the typed `Action`s are
always in screen space. `to_pyautogui` renders actions as the pyautogui code OSWorld executes.
"""
from __future__ import annotations

import math
import re
from typing import Sequence

from envs.actions.model import Action, ActionParseError, ActionType, only_parse_errors
from envs.actions.resize import smart_resize  # noqa: F401  (re-exported: the grammar's coordinate space)

MODELS = ("uitars-1.5", "uitars-1.0")

_TYPES = {
    "click": ActionType.CLICK, "left_single": ActionType.CLICK, "left_double": ActionType.LEFT_DOUBLE,
    "right_single": ActionType.RIGHT_SINGLE, "hover": ActionType.HOVER, "drag": ActionType.DRAG,
    "select": ActionType.DRAG, "hotkey": ActionType.HOTKEY, "press": ActionType.PRESS,
    "keydown": ActionType.KEYDOWN, "keyup": ActionType.KEYUP, "release": ActionType.KEYUP,
    "type": ActionType.TYPE, "scroll": ActionType.SCROLL, "wait": ActionType.WAIT,
    "finished": ActionType.FINISHED, "call_user": ActionType.CALL_USER, "long_press": ActionType.LONG_PRESS,
    "press_back": ActionType.PRESS_BACK, "press_home": ActionType.PRESS_HOME, "press_enter": ActionType.PRESS_ENTER,
}
_CONTROL_WORDS = {"WAIT": ActionType.WAIT, "DONE": ActionType.FINISHED, "FAIL": ActionType.FAIL}
_KEY_ALIASES = {"arrowleft": "left", "arrowright": "right", "arrowup": "up", "arrowdown": "down",
                "space": "space", "escape": "esc", "return": "enter", "control": "ctrl"}
_POINT_KEYS = {"start_box": "start", "start_point": "start", "point": "start", "end_box": "end", "end_point": "end"}


# ------------------------------------------------------------------------------------------ scanning
def _decode(value: str) -> str:
    out, i = [], 0
    while i < len(value):
        c = value[i]
        if c == "\\" and i + 1 < len(value):
            nxt = value[i + 1]
            out.append({"n": "\n", "t": "\t", "'": "'", '"': '"', "\\": "\\"}.get(nxt, "\\" + nxt))
            i += 2
        else:
            out.append(c)
            i += 1
    return "".join(out)


def _scan_calls(segment: str, text: str) -> list[tuple[str, dict[str, str]]]:
    """`name(key='value', key2=(1,2)) name2()` -> [(name, {key: raw value})], quotes and escapes honoured."""
    calls, i, n = [], 0, len(segment)
    while True:
        while i < n and (segment[i].isspace() or segment[i] in ",;`"):
            i += 1
        if segment.startswith("Action:", i):
            i += len("Action:")
            continue
        if i >= n:
            return calls
        m = re.match(r"[A-Za-z_][A-Za-z_0-9.]*", segment[i:])
        if not m:
            raise ActionParseError(f"expected an action call at {segment[i:i + 30]!r}", text)
        name = m.group(0).split(".")[-1]
        i += m.end()
        if name in _CONTROL_WORDS and (i >= n or segment[i] != "("):
            calls.append((name, {}))
            continue
        while i < n and segment[i] == " ":
            i += 1
        if i >= n or segment[i] != "(":
            raise ActionParseError(f"action {name!r} is missing its argument list", text)
        i += 1
        args: dict[str, str] = {}
        while True:
            while i < n and segment[i] in " \n\t,":
                i += 1
            if i >= n:
                raise ActionParseError(f"unterminated argument list of {name!r}", text)
            if segment[i] == ")":
                i += 1
                break
            m = re.match(r"([A-Za-z_][A-Za-z_0-9]*)\s*=\s*", segment[i:])
            if not m:
                raise ActionParseError(f"malformed argument of {name!r} at {segment[i:i + 30]!r}", text)
            key = m.group(1)
            i += m.end()
            if i < n and segment[i] in "'\"":
                quote, j, buf = segment[i], i + 1, []
                while j < n and segment[j] != quote:
                    if segment[j] == "\\" and j + 1 < n:
                        buf.append(segment[j:j + 2])
                        j += 2
                    else:
                        buf.append(segment[j])
                        j += 1
                if j >= n:
                    raise ActionParseError(f"unterminated string in argument {key!r} of {name!r}", text)
                args[key] = _decode("".join(buf))
                i = j + 1
            else:
                m = re.match(r"(\([^)]*\)|\[[^\]]*\]|[^,)]*)", segment[i:])
                args[key] = m.group(0).strip()
                i += m.end()
        calls.append((name, args))


def parse_thought(text: str) -> str:
    """The Thought (or Action_Summary) part of a response, '' when absent."""
    m = re.search(r"(?:Thought|Action_Summary):\s*(.*?)(?=\s*Action:|$)", text, re.DOTALL)
    return m.group(1).strip() if m else ""


def _numbers(raw: str, key: str, text: str) -> list[float]:
    raw = raw.replace("<|box_start|>", "").replace("<|box_end|>", "")
    num = r"-?\d+(?:\.\d+)?"
    point = re.fullmatch(rf"\s*<point>\s*({num})[\s,]+({num})\s*</point>\s*", raw)
    values = [point.group(1), point.group(2)] if point else re.findall(num, raw)
    if len(values) not in (2, 4):
        raise ActionParseError(f"argument {key!r} must hold 2 or 4 numbers, got {raw[:100]!r}", text)
    numbers = [float(v) for v in values]
    if not all(math.isfinite(v) for v in numbers):
        raise ActionParseError(f"argument {key!r} holds a number too large to be a coordinate", text)
    return numbers


class _Mapper:
    """Model-space coordinates -> screen pixels (and back, for rendering)."""

    def __init__(self, image_hw: tuple[int, int], screen_hw: tuple[int, int], model: str):
        if model not in MODELS:
            raise ValueError(f"unknown UI-TARS model {model!r}; choose one of {MODELS}")
        self.screen_h, self.screen_w = screen_hw
        if model == "uitars-1.5":
            self.space_h, self.space_w = smart_resize(*image_hw)
        else:
            self.space_h = self.space_w = 1000

    def to_screen(self, values: list[float]) -> tuple[tuple[int, int], bool]:
        if len(values) == 4:
            values = [(values[0] + values[2]) / 2, (values[1] + values[3]) / 2]
        x = round(values[0] / self.space_w * self.screen_w)
        y = round(values[1] / self.space_h * self.screen_h)
        cx, cy = min(max(x, 0), self.screen_w - 1), min(max(y, 0), self.screen_h - 1)
        return (cx, cy), (cx, cy) != (x, y)

    def to_model(self, point: tuple[int, int]) -> tuple[int, int]:
        return round(point[0] / self.screen_w * self.space_w), round(point[1] / self.screen_h * self.space_h)


def _keys(raw: str) -> tuple[str, ...]:
    """'ctrl shift a', 'ctrl+a', 'ctrl +' and 'ctrl++' -> pyautogui key names ('+' itself is a key)."""
    keys: list[str] = []
    for token in raw.lower().split():
        if token == "+":
            keys.append("+")
            continue
        tail = token.endswith("++")
        keys += [k for k in (token[:-2] if tail else token).split("+") if k] + (["+"] if tail else [])
    return tuple(_KEY_ALIASES.get(k, k) for k in keys)


@only_parse_errors
def parse_uitars(text: str, *, image_hw: tuple[int, int], screen_hw: tuple[int, int],
                 model: str = "uitars-1.5") -> list[Action]:
    """All actions of one UI-TARS response, in screen pixels. Raises ActionParseError on malformed text."""
    if "Action:" not in text:
        stripped = text.strip()
        if stripped in _CONTROL_WORDS:
            return [Action(_CONTROL_WORDS[stripped])]
        raise ActionParseError("no 'Action:' in the response", text)
    mapper = _Mapper(image_hw, screen_hw, model)
    # The actions start at the first 'Action:' that opens a line (a Thought may mention the word mid-line);
    # further 'Action:' lines add actions, and a typed text may contain 'Action:' without ending anything.
    marker = re.search(r"(?:^|\n)[ \t]*Action:", text) or re.search(r"Action:", text)
    calls = _scan_calls(text[marker.end():], text)
    if not calls:
        raise ActionParseError("'Action:' is followed by no action", text)
    actions = []
    for name, args in calls:
        if name in _CONTROL_WORDS and not args:
            actions.append(Action(_CONTROL_WORDS[name]))
            continue
        if name not in _TYPES:
            raise ActionParseError(f"unknown action {name!r}", text)
        kind = _TYPES[name]
        points: dict[str, tuple[int, int]] = {}
        clipped = False
        for key, raw in args.items():
            if key in _POINT_KEYS and raw:
                points[_POINT_KEYS[key]], c = mapper.to_screen(_numbers(raw, key, text))
                clipped |= c
        fields: dict = {"point": points.get("start"), "clipped": clipped}
        if kind in (ActionType.CLICK, ActionType.LEFT_DOUBLE, ActionType.RIGHT_SINGLE, ActionType.HOVER,
                    ActionType.LONG_PRESS) and fields["point"] is None:
            raise ActionParseError(f"action {name!r} needs start_box", text)
        if kind == ActionType.DRAG:
            if "start" not in points or "end" not in points:
                raise ActionParseError(f"action {name!r} needs start_box and end_box", text)
            fields["end_point"] = points["end"]
        elif kind in (ActionType.HOTKEY, ActionType.PRESS, ActionType.KEYDOWN, ActionType.KEYUP):
            keys = _keys(args.get("key", args.get("hotkey", args.get("press", ""))))
            if not keys:
                raise ActionParseError(f"action {name!r} needs a key", text)
            fields["keys"] = keys
        elif kind == ActionType.TYPE:
            fields["text"] = args.get("content", "")
        elif kind == ActionType.SCROLL:
            direction = args.get("direction", "").strip().lower()
            if direction not in ("up", "down", "left", "right"):
                raise ActionParseError(f"scroll direction must be up/down/left/right, got {direction!r}", text)
            fields["direction"], fields["amount"] = direction, 5.0
        elif kind in (ActionType.FINISHED, ActionType.CALL_USER):
            fields["text"] = args.get("content", "")
        elif kind == ActionType.WAIT:
            fields["amount"] = 5.0
        actions.append(Action(kind, **fields))
    return actions


# ------------------------------------------------------------------------------------------ rendering
def _quote(s: str) -> str:
    return "'" + s.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n") + "'"


def _box(point: tuple[int, int]) -> str:
    return f"'<|box_start|>({point[0]},{point[1]})<|box_end|>'"


_NAMES = {v: k for k, v in _TYPES.items() if k not in ("left_single", "select", "release")}


def render_uitars(actions: Sequence[Action], *, image_hw: tuple[int, int], screen_hw: tuple[int, int],
                  model: str = "uitars-1.5", thought: str = "") -> str:
    """UI-TARS response text for actions (inverse of parse_uitars up to coordinate rounding)."""
    mapper = _Mapper(image_hw, screen_hw, model)
    calls = []
    for a in actions:
        if a.kind == ActionType.FAIL:
            calls.append("FAIL")
            continue
        if a.kind not in _NAMES:
            raise ValueError(f"action {a.kind.value!r} has no UI-TARS equivalent (UI-TARS has no triple or "
                             f"middle click)")
        name = _NAMES[a.kind]
        args = []
        if a.point is not None:
            args.append(f"start_box={_box(mapper.to_model(a.point))}")
        if a.kind == ActionType.DRAG:
            args.append(f"end_box={_box(mapper.to_model(a.end_point))}")
        if a.kind in (ActionType.HOTKEY, ActionType.PRESS, ActionType.KEYDOWN, ActionType.KEYUP):
            args.append(f"key={_quote(' '.join(a.keys))}")
        if a.kind == ActionType.TYPE or (a.kind in (ActionType.FINISHED, ActionType.CALL_USER) and a.text):
            args.append(f"content={_quote(a.text)}")
        if a.kind == ActionType.SCROLL:
            args.append(f"direction={_quote(a.direction or 'down')}")
        calls.append(f"{name}({', '.join(args)})")
    return f"Thought: {thought}\nAction: " + "\n\n".join(calls)


def _key(key: str) -> str:
    """pyautogui's name for a key: the space bar is ' ' (as the reference writes it)."""
    return repr(" " if key == "space" else key)


def to_pyautogui(actions: Sequence[Action]) -> str:
    """pyautogui code for the actions, or OSWorld's control words WAIT / DONE / FAIL when an action is one
    (a control action ends the step, so what follows it is not executed)."""
    lines = ["import pyautogui", "import time"]
    for i, a in enumerate(actions):
        if a.kind == ActionType.WAIT:
            return "WAIT"
        if a.kind == ActionType.FINISHED:
            return "DONE"
        if a.kind in (ActionType.FAIL, ActionType.CALL_USER):
            return "FAIL"
        if i:
            lines.append("time.sleep(1)")
        p = a.point
        k = a.kind
        if k == ActionType.CLICK:
            lines.append(f"pyautogui.click({p[0]}, {p[1]}, button='left')")
        elif k == ActionType.LEFT_DOUBLE:
            lines.append(f"pyautogui.doubleClick({p[0]}, {p[1]}, button='left')")
        elif k == ActionType.LEFT_TRIPLE:
            lines.append(f"pyautogui.tripleClick({p[0]}, {p[1]}, button='left')")
        elif k == ActionType.RIGHT_SINGLE:
            lines.append(f"pyautogui.click({p[0]}, {p[1]}, button='right')")
        elif k == ActionType.MIDDLE_SINGLE:
            lines.append(f"pyautogui.click({p[0]}, {p[1]}, button='middle')")
        elif k == ActionType.HOVER:
            lines.append(f"pyautogui.moveTo({p[0]}, {p[1]})")
        elif k == ActionType.LONG_PRESS:
            lines += [f"pyautogui.mouseDown({p[0]}, {p[1]})", "time.sleep(1)", "pyautogui.mouseUp()"]
        elif k == ActionType.DRAG:
            e = a.end_point
            lines += [f"pyautogui.moveTo({p[0]}, {p[1]})", f"pyautogui.dragTo({e[0]}, {e[1]}, duration=1.0)"]
        elif k == ActionType.HOTKEY:
            lines.append(f"pyautogui.hotkey({', '.join(_key(key) for key in a.keys)})")
        elif k == ActionType.PRESS:  # several keys are pressed one after another
            lines += [f"pyautogui.press({_key(key)})" for key in a.keys]
        elif k == ActionType.KEYDOWN:
            lines += [f"pyautogui.keyDown({_key(key)})" for key in a.keys]
        elif k == ActionType.KEYUP:  # released in reverse order of holding
            lines += [f"pyautogui.keyUp({_key(key)})" for key in reversed(a.keys)]
        elif k == ActionType.PRESS_ENTER:
            lines.append("pyautogui.press('enter')")
        elif k == ActionType.TYPE:
            body = a.text[:-1] if a.text.endswith("\n") else a.text
            if body:
                lines.append(f"pyautogui.write({body!r}, interval=0.02)")
            if a.text.endswith("\n"):
                lines.append("pyautogui.press('enter')")
        elif k == ActionType.SCROLL:
            clicks = int(a.amount if a.amount is not None else 5)
            sign = 1 if a.direction in ("up", "right") else -1  # pyautogui: scroll(+) is up, hscroll(+) is right
            func = "scroll" if a.direction in ("up", "down") else "hscroll"
            where = f", x={p[0]}, y={p[1]}" if p is not None else ""
            lines.append(f"pyautogui.{func}({sign * clicks}{where})")
        else:
            raise ValueError(f"action {k.value!r} has no desktop pyautogui equivalent (mobile-only)")
    return "\n".join(lines)
