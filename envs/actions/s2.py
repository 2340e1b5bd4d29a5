"""Agent S2-style framework actions (element descriptions instead of coordinates) and their conversion to
UI-TARS primitives through a grounding function, as BEPA's trace conversion (D_conv) needs.

Some framework actions have no UI-TARS equivalent (`switch_applications`, `set_cell_values`: BEPA Fig. 2
calls them non-convertible); converting them raises `S2ConversionError` naming the action.
"""
from __future__ import annotations

import ast
import dataclasses
import json
from typing import Any, Callable

from envs.actions.model import Action, ActionParseError, ActionType
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
    "app_name": _STR, "sheet_name": _STR, "time": _NUM,
}


def _type_error(name: str, key: str, value: Any) -> str | None:
    want = ARG_TYPES.get(key)
    if want is None or (value is None and dict(SIGNATURES[name])[key] is None):
        return None
    if want == _KEYS:
        ok = isinstance(value, str) or (isinstance(value, list) and all(isinstance(k, str) for k in value))
        return None if ok else f"argument {key!r} of {name!r} must be a key name or a list of them, got {value!r}"
    if isinstance(value, bool) and bool not in want:
        return f"argument {key!r} of {name!r} must be {'/'.join(t.__name__ for t in want)}, got {value!r}"
    if not isinstance(value, want):
        return f"argument {key!r} of {name!r} must be {'/'.join(t.__name__ for t in want)}, got {value!r}"
    if key == "button_type" and value not in ("left", "right", "middle"):
        return f"button_type of {name!r} must be left/right/middle, got {value!r}"
    return None


def _trailing(action: S2Action, param: str) -> bool:
    """Positional rendering needs every parameter before the last one given."""
    names = [p for p, _ in SIGNATURES[action.name]]
    given = [i for i, p in enumerate(names) if p in action.args]
    return bool(given) and names.index(param) < max(given)


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


def s2_to_actions(action: S2Action, ground: Grounder) -> list[Action]:
    """UI-TARS primitives for one framework action; element descriptions are grounded to screen boxes."""
    name = action.name
    if name == "click":
        point = _center(ground(action.get("element_description")))
        button, clicks = action.get("button_type"), int(action.get("num_clicks"))
        if button == "right":
            kind = ActionType.RIGHT_SINGLE
        elif button == "middle":
            kind = ActionType.MIDDLE_SINGLE
        else:
            kind = {1: ActionType.CLICK, 2: ActionType.LEFT_DOUBLE, 3: ActionType.LEFT_TRIPLE}.get(clicks)
            if kind is None:
                raise S2ConversionError(f"click with num_clicks={clicks} has no UI-TARS equivalent")
        holds = _keys(action.get("hold_keys"))
        return ([Action(ActionType.KEYDOWN, keys=(k,)) for k in holds] + [Action(kind, point=point)]
                + [Action(ActionType.KEYUP, keys=(k,)) for k in reversed(holds)])
    if name == "type":
        out = []
        if action.get("element_description"):
            out.append(Action(ActionType.CLICK, point=_center(ground(action.get("element_description")))))
        if action.get("overwrite"):
            out += [Action(ActionType.HOTKEY, keys=("ctrl", "a")), Action(ActionType.PRESS, keys=("backspace",))]
        out.append(Action(ActionType.TYPE, text=str(action.get("text")) + ("\n" if action.get("enter") else "")))
        return out
    if name == "scroll":
        clicks = int(action.get("clicks"))
        horizontal = bool(action.get("shift"))
        direction = ("left" if clicks > 0 else "right") if horizontal else ("up" if clicks > 0 else "down")
        return [Action(ActionType.SCROLL, point=_center(ground(action.get("element_description"))),
                       direction=direction, amount=float(abs(clicks)))]
    if name == "hotkey":
        return [Action(ActionType.HOTKEY, keys=_keys(action.get("keys")))]
    if name == "hold_and_press":
        holds = _keys(action.get("hold_keys"))
        return ([Action(ActionType.KEYDOWN, keys=(k,)) for k in holds]
                + [Action(ActionType.PRESS, keys=(k,)) for k in _keys(action.get("press_keys"))]
                + [Action(ActionType.KEYUP, keys=(k,)) for k in reversed(holds)])
    if name == "drag_and_drop":
        holds = _keys(action.get("hold_keys"))
        drag = Action(ActionType.DRAG, point=_center(ground(action.get("starting_description"))),
                      end_point=_center(ground(action.get("ending_description"))))
        return ([Action(ActionType.KEYDOWN, keys=(k,)) for k in holds] + [drag]
                + [Action(ActionType.KEYUP, keys=(k,)) for k in reversed(holds)])
    if name == "wait":
        return [Action(ActionType.WAIT, amount=float(action.get("time")))]
    if name == "done":
        return [Action(ActionType.FINISHED, text=str(action.get("return_value") or ""))]
    if name == "fail":
        return [Action(ActionType.FAIL)]
    raise S2ConversionError(f"S2 action {name!r} ({action.render()}) has no UI-TARS equivalent")


def s2_to_uitars_text(action: S2Action, ground: Grounder, *, image_hw: tuple[int, int], screen_hw: tuple[int, int],
                      thought: str, model: str = "uitars-1.5") -> str:
    """A converted UI-TARS response `Thought: ... Action: ...` for one framework step (BEPA's D_conv)."""
    return render_uitars(s2_to_actions(action, ground), image_hw=image_hw, screen_hw=screen_hw, model=model,
                         thought=thought)
