"""Agent S2-style framework actions (element descriptions instead of coordinates) and their conversion to
UI-TARS primitives through a grounding function, as BEPA's trace conversion (D_conv) needs.

Conversions follow what Agent S2's grounding agent executes for each call. Some framework actions have no
UI-TARS equivalent (BEPA Fig. 2 calls them non-convertible): `set_cell_values` runs a LibreOffice UNO script and
`switch_applications` on Linux runs wmctrl; converting them raises `S2ConversionError` naming the action. On
macOS/Windows `switch_applications` is a launcher hotkey plus typing, which converts.
"""
from __future__ import annotations

import ast
import dataclasses
import json
from typing import Any, Callable

from envs.actions.model import Action, ActionParseError, ActionType, only_parse_errors
from envs.actions.uitars import render_uitars

Box = tuple[int, int, int, int]
Grounder = Callable[[str], Box]

# name -> ordered (parameter, default); a parameter without default is required (marked by _REQUIRED).
_REQUIRED = object()
SIGNATURES: dict[str, tuple[tuple[str, Any], ...]] = {
    "click": (("element_description", _REQUIRED), ("num_clicks", 1), ("button_type", "left"), ("hold_keys", [])),
    "type": (("element_description", None), ("text", ""), ("overwrite", False), ("enter", False)),
    "scroll": (("element_description", _REQUIRED), ("clicks", _REQUIRED), ("shift", False)),
    "hotkey": (("keys", _REQUIRED),),
    "hold_and_press": (("hold_keys", _REQUIRED), ("press_keys", _REQUIRED)),
    "drag_and_drop": (("starting_description", _REQUIRED), ("ending_description", _REQUIRED), ("hold_keys", [])),
    "switch_applications": (("app_code", _REQUIRED),),
    "set_cell_values": (("cell_values", _REQUIRED), ("app_name", _REQUIRED), ("sheet_name", _REQUIRED)),
    "wait": (("time", _REQUIRED),),
    "highlight_text_span": (("starting_phrase", _REQUIRED), ("ending_phrase", _REQUIRED), ("button", "left")),
    "save_to_knowledge": (("text", _REQUIRED),),
    "done": (("return_value", None),),
    "fail": (),
}


class S2ConversionError(ValueError):
    """A framework action with no faithful UI-TARS equivalent."""


@dataclasses.dataclass(frozen=True)
class S2Action:
    name: str
    args: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if self.name not in SIGNATURES:
            raise ValueError(f"unknown S2 action {self.name!r}; known: {sorted(SIGNATURES)}")
        known = {p for p, _ in SIGNATURES[self.name]}
        extra = set(self.args) - known
        if extra:
            raise ValueError(f"S2 action {self.name!r} got unknown arguments {sorted(extra)}")
        missing = [p for p, d in SIGNATURES[self.name] if d is _REQUIRED and p not in self.args]
        if missing:
            raise ValueError(f"S2 action {self.name!r} is missing arguments {missing}")

    def get(self, key: str) -> Any:
        default = dict(SIGNATURES[self.name])[key]
        return self.args.get(key, None if default is _REQUIRED else default)

    def render(self) -> str:
        """Agent S2's python-call surface form, e.g. agent.click("the OK button", 1, "left")."""
        values = [_literal(self.get(p)) for p, _ in SIGNATURES[self.name] if p in self.args or _trailing(self, p)]
        return f"agent.{self.name}({', '.join(values)})"


def _literal(value: Any) -> str:
    """A python literal with double-quoted strings, as Agent S2's prompts write them."""
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # a JSON string is also a valid python string literal
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_literal(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_literal(k)}: {_literal(v)}" for k, v in value.items()) + "}"
    return repr(value)


_STR, _INT, _BOOL, _NUM = (str,), (int,), (bool,), (int, float)
_KEYS = "keys"  # a key name or a list of key names
# Types accepted by parse_s2, so a malformed call fails at parse time, not in the middle of a conversion.
ARG_TYPES: dict[str, Any] = {
    "element_description": _STR, "num_clicks": _INT, "button_type": _STR, "hold_keys": _KEYS, "text": _STR,
    "overwrite": _BOOL, "enter": _BOOL, "clicks": _INT, "shift": _BOOL, "keys": _KEYS, "press_keys": _KEYS,
    "starting_description": _STR, "ending_description": _STR, "app_code": _STR, "cell_values": (dict,),
    "app_name": _STR, "sheet_name": _STR, "time": _NUM, "starting_phrase": _STR, "ending_phrase": _STR,
    "button": _STR,
}
# parameter -> the action whose `text` is a list of strings (save_to_knowledge) rather than one string
_TEXT_LISTS = {"save_to_knowledge"}
PLATFORMS = ("linux", "darwin", "windows")


def _type_error(name: str, key: str, value: Any) -> str | None:
    want = ARG_TYPES.get(key)
    if name in _TEXT_LISTS and key == "text":
        ok = isinstance(value, list) and all(isinstance(t, str) for t in value)
        return None if ok else f"argument 'text' of {name!r} must be a list of strings, got {value!r}"
    if want is None or (value is None and dict(SIGNATURES[name])[key] is None):
        return None
    if want == _KEYS:
        ok = isinstance(value, str) or (isinstance(value, list) and all(isinstance(k, str) for k in value))
        return None if ok else f"argument {key!r} of {name!r} must be a key name or a list of them, got {value!r}"
    if isinstance(value, bool) and bool not in want:
        return f"argument {key!r} of {name!r} must be {'/'.join(t.__name__ for t in want)}, got {value!r}"
    if not isinstance(value, want):
        return f"argument {key!r} of {name!r} must be {'/'.join(t.__name__ for t in want)}, got {value!r}"
    if key in ("button_type", "button") and value not in ("left", "right", "middle"):
        return f"{key} of {name!r} must be left/right/middle, got {value!r}"
    return None


def _trailing(action: S2Action, param: str) -> bool:
    """Positional rendering needs every parameter before the last one given."""
    names = [p for p, _ in SIGNATURES[action.name]]
    given = [i for i, p in enumerate(names) if p in action.args]
    return bool(given) and names.index(param) < max(given)


@only_parse_errors
def parse_s2(text: str) -> S2Action:
    """`agent.click("Save button", 1, "left")` (positional or keyword arguments) -> S2Action."""
    source = text.strip().strip("`").strip()
    try:
        node = ast.parse(source, mode="eval").body
    except SyntaxError as e:
        raise ActionParseError(f"not a python call ({e.msg})", text) from None
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "agent"):
        raise ActionParseError("expected agent.<action>(...)", text)
    name = node.func.attr
    if name not in SIGNATURES:
        raise ActionParseError(f"unknown S2 action {name!r}", text)
    params = [p for p, _ in SIGNATURES[name]]
    if len(node.args) > len(params):
        raise ActionParseError(f"too many arguments for {name!r}", text)
    try:
        args = {params[i]: ast.literal_eval(a) for i, a in enumerate(node.args)}
        if any(k.arg is None for k in node.keywords):
            raise ValueError(f"**kwargs are not allowed in {name!r}")
        args.update({k.arg: ast.literal_eval(k.value) for k in node.keywords})
        action = S2Action(name, args)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError) as e:
        raise ActionParseError(str(e), text) from None
    for key, value in args.items():
        problem = _type_error(name, key, value)
        if problem:
            raise ActionParseError(problem, text)
    return action


def _center(box: Box) -> tuple[int, int]:
    return (box[0] + box[2]) // 2, (box[1] + box[3]) // 2


def _keys(value: Any) -> tuple[str, ...]:
    keys = [value] if isinstance(value, str) else list(value)
    return tuple(str(k).lower() for k in keys)


def _held(holds: tuple[str, ...], actions: list[Action]) -> list[Action]:
    """actions wrapped in keyDown(each hold key) ... keyUp(in reverse)."""
    return ([Action(ActionType.KEYDOWN, keys=(k,)) for k in holds] + actions
            + [Action(ActionType.KEYUP, keys=(k,)) for k in reversed(holds)])


def s2_to_actions(action: S2Action, ground: Grounder, *, platform: str = "linux") -> list[Action]:
    """UI-TARS primitives for one framework action; element descriptions are grounded to screen boxes.

    `platform` picks the OS-specific keys Agent S2 uses (select-all modifier, application switcher)."""
    if platform not in PLATFORMS:
        raise ValueError(f"unknown platform {platform!r}; choose one of {PLATFORMS}")
    name = action.name
    mod = "command" if platform == "darwin" else "ctrl"
    if name == "click":
        point = _center(ground(action.get("element_description")))
        button, clicks = action.get("button_type"), int(action.get("num_clicks"))
        kinds = {("left", 1): ActionType.CLICK, ("left", 2): ActionType.LEFT_DOUBLE,
                 ("left", 3): ActionType.LEFT_TRIPLE, ("right", 1): ActionType.RIGHT_SINGLE,
                 ("middle", 1): ActionType.MIDDLE_SINGLE}
        if (button, clicks) not in kinds:
            raise S2ConversionError(f"click with button_type={button!r}, num_clicks={clicks} has no UI-TARS "
                                    f"equivalent ({action.render()})")
        return _held(_keys(action.get("hold_keys")), [Action(kinds[button, clicks], point=point)])
    if name == "type":
        out = []
        if action.get("element_description"):
            out.append(Action(ActionType.CLICK, point=_center(ground(action.get("element_description")))))
        if action.get("overwrite"):
            out += [Action(ActionType.HOTKEY, keys=(mod, "a")), Action(ActionType.PRESS, keys=("backspace",))]
        out.append(Action(ActionType.TYPE, text=str(action.get("text")) + ("\n" if action.get("enter") else "")))
        return out
    if name == "scroll":
        clicks = int(action.get("clicks"))
        if clicks == 0:
            raise S2ConversionError(f"scroll by 0 clicks does nothing ({action.render()})")
        # Agent S2 runs pyautogui.vscroll(clicks) (+ is up) or, with shift, hscroll(clicks) (+ is right).
        horizontal = bool(action.get("shift"))
        direction = ("right" if clicks > 0 else "left") if horizontal else ("up" if clicks > 0 else "down")
        return [Action(ActionType.SCROLL, point=_center(ground(action.get("element_description"))),
                       direction=direction, amount=float(abs(clicks)))]
    if name == "hotkey":
        return [Action(ActionType.HOTKEY, keys=_keys(action.get("keys")))]
    if name == "hold_and_press":
        return _held(_keys(action.get("hold_keys")),
                     [Action(ActionType.PRESS, keys=(k,)) for k in _keys(action.get("press_keys"))])
    if name == "drag_and_drop":
        drag = Action(ActionType.DRAG, point=_center(ground(action.get("starting_description"))),
                      end_point=_center(ground(action.get("ending_description"))))
        return _held(_keys(action.get("hold_keys")), [drag])
    if name == "highlight_text_span":
        if action.get("button") != "left":
            raise S2ConversionError(f"highlight_text_span with button={action.get('button')!r} has no UI-TARS "
                                    f"equivalent (UI-TARS drags with the left button)")
        # Agent S2 drags from the first word's left edge to the last word's right edge, at mid height.
        start, end = ground(action.get("starting_phrase")), ground(action.get("ending_phrase"))
        return [Action(ActionType.DRAG, point=(start[0], (start[1] + start[3]) // 2),
                       end_point=(end[2], (end[1] + end[3]) // 2))]
    if name == "switch_applications" and platform != "linux":
        # Agent S2: the launcher hotkey (Spotlight / Windows' win+d), then the app name and Enter.
        launcher = ("command", "space") if platform == "darwin" else ("win", "d")
        return [Action(ActionType.HOTKEY, keys=launcher), Action(ActionType.TYPE, text=action.get("app_code") + "\n")]
    if name == "save_to_knowledge":
        return [Action(ActionType.WAIT)]  # Agent S2 stores the notes in its memory and the environment waits
    if name == "wait":
        return [Action(ActionType.WAIT, amount=float(action.get("time")))]
    if name == "done":
        return [Action(ActionType.FINISHED, text=str(action.get("return_value") or ""))]
    if name == "fail":
        return [Action(ActionType.FAIL)]
    why = {"switch_applications": "on linux Agent S2 switches windows with wmctrl, not with GUI input",
           "set_cell_values": "Agent S2 writes the cells through LibreOffice's UNO API, not with GUI input"}
    raise S2ConversionError(f"S2 action {name!r} ({action.render()}) has no UI-TARS equivalent: "
                            f"{why.get(name, 'not supported')}")


def s2_to_uitars_text(action: S2Action, ground: Grounder, *, image_hw: tuple[int, int], screen_hw: tuple[int, int],
                      thought: str, model: str = "uitars-1.5", platform: str = "linux") -> str:
    """A converted UI-TARS response `Thought: ... Action: ...` for one framework step (BEPA's D_conv).

    Raises S2ConversionError when the action, or a primitive it becomes (a triple click), has no UI-TARS form."""
    actions = s2_to_actions(action, ground, platform=platform)
    try:
        return render_uitars(actions, image_hw=image_hw, screen_hw=screen_hw, model=model, thought=thought)
    except ValueError as e:
        raise S2ConversionError(f"S2 action {action.render()} cannot be written as UI-TARS text: {e}") from None
