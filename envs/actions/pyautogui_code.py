"""SGCD's evaluation grammar (its Fig. 9): `## Thought:`, `## Action:` and `## Code:` sections, the code one
fenced block of pyautogui calls or one control call, `computer.wait()` / `computer.terminate(status=...,
answer=...)`, with coordinates in the model's coordinate space (0-1000 relative for Qwen3-VL). Its variant for
thinking backbones (`think=True`) writes the thought as a `[think] ... [/think]` segment in place of the
`## Thought:` field, and past steps keep that segment, so the earlier reasoning stays in the context.

The model's code is never executed: it is read with `ast` into the typed action model, call by call, with
literal arguments only (a variable, a loop or any other module is a parse error naming it), and what runs
on a desktop is the project's own pyautogui rendering of those actions. `render_code` writes the inverse.

Cursor-relative calls follow the cursor within one response: `moveTo` then `dragTo` is one DRAG, a
`mouseDown` ... `mouseUp` pair is a DRAG (or a CLICK where it does not move), a `click()` without
coordinates clicks where the cursor is. Relative moves (`drag`, `moveRel`) are refused: the model's offsets
would have to be known in its own coordinate space, which the prompt never tells it.
"""
from __future__ import annotations

import ast
import re
import warnings
from typing import Any, Sequence

from envs.actions.model import Action, ActionParseError, ActionType, only_parse_errors

# SGCD Fig. 9, word for word; {password} is the desktop's, the response fields' braces are doubled for
# str.format. The paper gives its INSTRUCTION_TEMPLATE only in words (Appendix I), so the last two lines
# that carry the task are written here from that sentence.
FIG9_PROMPT = """You are an agent that operates a computer GUI. For each step, you are given the task goal, the latest screenshot, and the history of earlier actions. Choose the single best next move that advances the task based on the current screen. Keep your action consistent with what is visible, and use the action history to avoid repeating mistakes. The password of the computer is {password}.

For each step, provide your response in this format:

```
## Thought: {{thought}}
## Action: {{action}}
## Code: {{code}}
```

Code rules:

- Return exactly one executable code block.
- The code block must contain either:
 - 1) pyautogui code for the next GUI action, or
 - 2) one built-in control call:
- `computer.wait()`: wait 20 seconds if the page, app, or system needs time
- `computer.terminate(status=..., answer=...)`: end the task when it is finished or cannot be completed
- If you use `computer.terminate`, status must be "success" or "failure".
- Include answer only when there is a final result to report.
"""
# Fig. 9's variant for thinking-capable backbones. The paper describes it in one sentence (the Thought field
# replaced by an explicit reasoning segment in [think]/[/think] tags) without printing it, so it is Fig. 9 with
# exactly that one field replaced.
THINK_OPEN, THINK_CLOSE = "[think]", "[/think]"
FIG9_THINK_PROMPT = FIG9_PROMPT.replace("## Thought: {{thought}}", f"{THINK_OPEN}\n{{{{thought}}}}\n{THINK_CLOSE}")
INSTRUCTION_TEMPLATE = ("\nTask instruction: {instruction}\n"
                        "Please generate the next move according to the screenshot, task instruction and previous steps.\n")
WAIT_SECONDS = 20.0  # Fig. 9: computer.wait() waits 20 seconds
MAX_CODE_CHARS = 20_000  # longer than any one step's code; keeps ast away from hostile megabytes

_FENCE = re.compile(r"```[ \t]*(?:python|py|code)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
# the reasoning segment, at the start of a response: Fig. 9's [think] tags, or Qwen3's own <think> tags; a
# thinking model whose chat template opens <think> in the prompt begins with the reasoning and its closing tag
_THINK = re.compile(r"\A\s*(?:\[think\]|<think>)(.*?)(\[/think\]|</think>|\Z)", re.DOTALL | re.IGNORECASE)
_THINK_CLOSE_ONLY = re.compile(r"\A(.*?)(?:\[/think\]|</think>)", re.DOTALL | re.IGNORECASE)
_SECTION = re.compile(r"^[ \t]*#{1,3}[ \t]*(Thought|Action|Code)[ \t]*:[ \t]*", re.IGNORECASE | re.MULTILINE)
_CLICK_NAMES = {"click": None, "leftClick": ActionType.CLICK, "doubleClick": ActionType.LEFT_DOUBLE,
                "tripleClick": ActionType.LEFT_TRIPLE, "rightClick": ActionType.RIGHT_SINGLE,
                "middleClick": ActionType.MIDDLE_SINGLE}
_BUTTON_CLICKS = {("left", 1): ActionType.CLICK, ("left", 2): ActionType.LEFT_DOUBLE,
                  ("left", 3): ActionType.LEFT_TRIPLE, ("right", 1): ActionType.RIGHT_SINGLE,
                  ("middle", 1): ActionType.MIDDLE_SINGLE}
# the pyautogui functions read, by the parameter names pyautogui gives their positional arguments
_SIGNATURES = {
    **{name: ("x", "y", "clicks", "interval", "button", "duration") for name in _CLICK_NAMES},
    "moveTo": ("x", "y", "duration"), "dragTo": ("x", "y", "duration", "button"),
    "mouseDown": ("x", "y", "button", "duration"), "mouseUp": ("x", "y", "button", "duration"),
    "press": ("keys", "presses", "interval"), "keyDown": ("key",), "keyUp": ("key",),
    "write": ("message", "interval"), "typewrite": ("message", "interval"),
    "scroll": ("clicks", "x", "y"), "vscroll": ("clicks", "x", "y"), "hscroll": ("clicks", "x", "y"),
}
_RELATIVE_MOVES = ("drag", "dragRel", "move", "moveRel")


def _literal(node: ast.AST, what: str, text: str) -> Any:
    try:
        return ast.literal_eval(node)
    except ValueError:
        raise ActionParseError(f"{what} must be a literal value, got `{ast.unparse(node)[:80]}`", text) from None


def _number(value: Any, what: str, text: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not abs(value) < 1e9:
        raise ActionParseError(f"{what} must be a number, got {value!r}", text)
    return value


def _keyword_args(call: ast.Call, names: Sequence[str], func: str, text: str) -> dict[str, Any]:
    """A call's arguments by pyautogui's parameter names; a first positional (x, y) tuple counts as both."""
    if any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords):
        raise ActionParseError(f"{func}: *args / **kwargs are not accepted", text)
    positional = [_literal(a, f"{func}'s argument", text) for a in call.args]
    if names[:2] == ("x", "y") and positional and isinstance(positional[0], (tuple, list)):
        positional = list(positional[0]) + positional[1:]
    if len(positional) > len(names):
        raise ActionParseError(f"{func} takes at most {len(names)} positional arguments", text)
    args = dict(zip(names, positional))
    for k in call.keywords:
        if k.arg not in names:
            raise ActionParseError(f"{func} has no argument {k.arg!r}", text)
        if k.arg in args:
            raise ActionParseError(f"{func} got {k.arg!r} twice", text)
        args[k.arg] = _literal(k.value, f"{func}'s {k.arg}", text)
    return args


def _keys(value: Any, func: str, text: str) -> tuple[str, ...]:
    keys = [value] if isinstance(value, str) else value
    if not (isinstance(keys, (list, tuple)) and keys and all(isinstance(k, str) and k for k in keys)):
        raise ActionParseError(f"{func} needs a key name or a list of them, got {value!r}", text)
    return tuple(k.lower() for k in keys)


class _Reader:
    """Reads one code block's calls in order, keeping the cursor and a held mouse button."""

    def __init__(self, text: str, image_hw: tuple[int, int], screen_hw: tuple[int, int]):
        self.text, self.image_hw, self.screen_hw = text, image_hw, screen_hw
        self.actions: list[Action] = []
        self.cursor: tuple[int, int] | None = None
        self.clipped = False  # whether the cursor's point was clipped to the screen
        self.held: tuple[tuple[int, int], bool] | None = None  # where the button went down, and its clipping

    def point(self, args: dict[str, Any], func: str, required: bool) -> tuple[int, int] | None:
        """The call's (x, y) on the screen; the cursor where it names none (and none is required)."""
        if args.get("x") is None and args.get("y") is None:
            if required or self.cursor is None:
                raise ActionParseError(f"pyautogui.{func} needs x and y (no earlier call in the response placed the cursor)",
                                       self.text)
            return self.cursor
        if args.get("x") is None or args.get("y") is None:
            raise ActionParseError(f"pyautogui.{func} needs both x and y", self.text)
        x = round(_number(args["x"], f"{func}'s x", self.text) / self.image_hw[1] * self.screen_hw[1])
        y = round(_number(args["y"], f"{func}'s y", self.text) / self.image_hw[0] * self.screen_hw[0])
        cx, cy = min(max(x, 0), self.screen_hw[1] - 1), min(max(y, 0), self.screen_hw[0] - 1)
        self.cursor, self.clipped = (cx, cy), (cx, cy) != (x, y)
        return self.cursor

    def call(self, call: ast.Call) -> None:
        f = call.func
        if not (isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name)):
            raise ActionParseError(f"`{ast.unparse(f)[:80]}` is not a pyautogui, computer or time call", self.text)
        module, func = f.value.id, f.attr
        if module == "time" and func == "sleep":
            return  # pauses between actions; the environment paces its own steps
        if module == "computer":
            return self.control(call, func)
        if module != "pyautogui":
            raise ActionParseError(f"`{module}.{func}` is not a pyautogui, computer or time call", self.text)
        if func in _RELATIVE_MOVES:
            raise ActionParseError(f"pyautogui.{func} moves relative to the cursor; use moveTo / dragTo with x, y",
                                   self.text)
        if func == "hotkey":
            keys = tuple(k for a in call.args for k in _keys(_literal(a, "hotkey's key", self.text), func, self.text))
            if not keys or call.keywords and any(k.arg != "interval" for k in call.keywords):
                raise ActionParseError("hotkey needs key names as its arguments", self.text)
            return self.add(Action(ActionType.HOTKEY if len(keys) > 1 else ActionType.PRESS, keys=keys))
        if func not in _SIGNATURES:
            raise ActionParseError(f"pyautogui.{func} is not an action this grammar accepts", self.text)
        args = _keyword_args(call, _SIGNATURES[func], f"pyautogui.{func}", self.text)
        getattr(self, "_" + ("click" if func in _CLICK_NAMES else func))(args, func)

    def add(self, action: Action) -> None:
        if self.held is not None:
            raise ActionParseError(f"{action.kind.value} while the mouse button is held (mouseUp first)", self.text)
        self.actions.append(action)

    def _click(self, args: dict[str, Any], func: str) -> None:
        point = self.point(args, func, required=False)
        kind = _CLICK_NAMES[func]
        if kind is None:
            clicks, button = args.get("clicks", 1), args.get("button", "left")
            kind = _BUTTON_CLICKS.get((button, clicks)) if isinstance(clicks, int) else None
            if kind is None:
                raise ActionParseError(f"click with button={button!r}, clicks={clicks!r} is not an action", self.text)
        self.add(Action(kind, point=point, clipped=self.clipped))

    def _moveTo(self, args: dict[str, Any], func: str) -> None:
        point = self.point(args, func, required=True)
        if self.held is None:  # a move while the button is held is part of the drag
            self.add(Action(ActionType.HOVER, point=point, clipped=self.clipped))

    def _moved_to(self, start: tuple[int, int]) -> bool:
        """Drop a move to `start` just before a drag or press there (which moves there itself); whether that
        move was clipped."""
        if not (self.actions and self.actions[-1].kind == ActionType.HOVER and self.actions[-1].point == start):
            return False
        return self.actions.pop().clipped

    def _drag(self, start: tuple[int, int], start_clipped: bool, end: tuple[int, int]) -> None:
        start_clipped |= self._moved_to(start)
        self.add(Action(ActionType.DRAG, point=start, end_point=end, clipped=start_clipped or self.clipped))

    def _dragTo(self, args: dict[str, Any], func: str) -> None:
        if args.get("button", "left") != "left":
            raise ActionParseError("dragTo with a button other than left is not an action", self.text)
        start, start_clipped = self.cursor, self.clipped
        if start is None:
            raise ActionParseError("dragTo needs the cursor placed first (moveTo)", self.text)
        self._drag(start, start_clipped, self.point(args, func, required=True))

    def _mouseDown(self, args: dict[str, Any], func: str) -> None:
        if args.get("button", "left") != "left" or self.held is not None:
            raise ActionParseError("mouseDown: only the left button, and not while it is held", self.text)
        self.held = (self.point(args, func, required=False), self.clipped)

    def _mouseUp(self, args: dict[str, Any], func: str) -> None:
        if self.held is None:
            raise ActionParseError("mouseUp without mouseDown", self.text)
        (start, start_clipped), end = self.held, self.point(args, func, required=False)
        self.held = None
        if end == start:
            self.add(Action(ActionType.CLICK, point=start, clipped=start_clipped | self._moved_to(start)))
        else:
            self._drag(start, start_clipped, end)

    def _press(self, args: dict[str, Any], func: str) -> None:
        presses = args.get("presses", 1)
        if isinstance(presses, bool) or not isinstance(presses, int) or not 1 <= presses <= 100:
            raise ActionParseError(f"press's presses must be a count from 1 to 100, got {presses!r}", self.text)
        self.add(Action(ActionType.PRESS, keys=_keys(args.get("keys"), func, self.text) * presses))

    def _keyDown(self, args: dict[str, Any], func: str) -> None:
        self.add(Action(ActionType.KEYDOWN, keys=self._one_key(args, func)))

    def _keyUp(self, args: dict[str, Any], func: str) -> None:
        self.add(Action(ActionType.KEYUP, keys=self._one_key(args, func)))

    def _one_key(self, args: dict[str, Any], func: str) -> tuple[str]:
        keys = _keys(args.get("key"), func, self.text)
        if len(keys) != 1:
            raise ActionParseError(f"{func} holds or releases one key, got {list(keys)}", self.text)
        return keys

    def _write(self, args: dict[str, Any], func: str) -> None:
        message = args.get("message")
        if isinstance(message, (list, tuple)):  # typewrite(['a', 'enter']) presses keys one after another
            return self.add(Action(ActionType.PRESS, keys=_keys(message, func, self.text)))
        if not isinstance(message, str):
            raise ActionParseError(f"{func} needs the text to type, got {message!r}", self.text)
        self.add(Action(ActionType.TYPE, text=message))

    _typewrite = _write

    def _scroll(self, args: dict[str, Any], func: str) -> None:
        clicks = _number(args.get("clicks"), f"{func}'s clicks", self.text)
        if clicks == 0:
            raise ActionParseError(f"{func}(0) scrolls nothing", self.text)
        point = None if args.get("x") is None and args.get("y") is None else self.point(args, func, required=True)
        vertical = func != "hscroll"
        direction = ("up" if clicks > 0 else "down") if vertical else ("right" if clicks > 0 else "left")
        self.add(Action(ActionType.SCROLL, point=point, direction=direction, amount=float(abs(clicks)),
                        clipped=point is not None and self.clipped))

    _vscroll = _hscroll = _scroll

    def control(self, call: ast.Call, func: str) -> None:
        if func == "wait":
            if call.args or call.keywords:
                raise ActionParseError("computer.wait() takes no arguments", self.text)
            return self.add(Action(ActionType.WAIT, amount=WAIT_SECONDS))
        if func != "terminate":
            raise ActionParseError(f"computer.{func} is not a control call (wait, terminate)", self.text)
        args = _keyword_args(call, ("status", "answer"), "computer.terminate", self.text)
        status, answer = args.get("status"), args.get("answer")
        if status not in ("success", "failure"):
            raise ActionParseError(f'terminate status must be "success" or "failure", got {status!r}', self.text)
        if answer is not None and not isinstance(answer, str):
            answer = str(answer)
        self.add(Action(ActionType.FINISHED, text=answer or "") if status == "success" else Action(ActionType.FAIL))


def think_segment(text: str) -> tuple[str, int, bool] | None:
    """A response's leading reasoning segment: (its text, where the rest begins, whether it was closed); None
    without one. A closing tag with no opening one counts when no `##` section comes before it (the opening tag
    was in the prompt)."""
    m = _THINK.search(text)
    if m:
        return m.group(1).strip(), m.end(), bool(m.group(2))
    m = _THINK_CLOSE_ONLY.search(text)
    if m and not _SECTION.search(m.group(1)):
        return m.group(1).strip(), m.end(), True
    return None


def code_block(text: str, whole: str | None = None) -> str:
    """The response's code: its last fenced block, or else what follows `## Code:`; a refusal quotes `whole`
    (the response `text` is part of), or else `text`."""
    blocks = _FENCE.findall(text)
    if blocks:
        return blocks[-1]
    sections = _sections(text)
    if "code" in sections:  # unfenced, or fenced on one line: ```python pyautogui.click(1, 2)```
        return re.sub(r"^```[ \t]*(?:python|py|code)?|```$", "", sections["code"].strip(), flags=re.IGNORECASE)
    raise ActionParseError("no fenced code block and no '## Code:' section in the response", whole or text)


@only_parse_errors
def parse_pyautogui(text: str, *, image_hw: tuple[int, int], screen_hw: tuple[int, int],
                    think: bool = False) -> list[Action]:
    """Every action of a Fig. 9 response (or a bare code block), in screen pixels. With `think` (the variant
    for thinking backbones) the code is read after the reasoning segment only: code drafted while thinking is
    not run, and a segment never closed (an answer cut off while thinking) holds no action."""
    rest = text
    segment = think_segment(text) if think else None
    if segment is not None:
        if not segment[2]:
            raise ActionParseError("the [think] segment is never closed, so no action follows it", text)
        rest = text[segment[1]:]
    code = code_block(rest, whole=text)
    if len(code) > MAX_CODE_CHARS:
        raise ActionParseError(f"code block of {len(code)} characters (at most {MAX_CODE_CHARS})", text)
    try:
        with warnings.catch_warnings():  # e.g. "invalid decimal literal": the parse error below says it once
            warnings.simplefilter("ignore", SyntaxWarning)
            tree = ast.parse(code.strip())
    except SyntaxError as e:
        raise ActionParseError(f"code is not Python ({e.msg}, line {e.lineno})", text) from None
    reader = _Reader(text, image_hw, screen_hw)
    for statement in tree.body:
        if isinstance(statement, ast.Import) and all(a.name in ("pyautogui", "time") and a.asname is None
                                                     for a in statement.names):
            continue
        if not (isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Call)):
            raise ActionParseError(f"line {statement.lineno} is not a call: `{ast.unparse(statement)[:80]}`", text)
        reader.call(statement.value)
    if reader.held is not None:
        raise ActionParseError("mouseDown without mouseUp", text)
    if not reader.actions:
        raise ActionParseError("the code block holds no action", text)
    return reader.actions


def render_code(actions: Sequence[Action], *, image_hw: tuple[int, int], screen_hw: tuple[int, int]) -> str:
    """The code block's body for the actions (inverse of the parser up to coordinate rounding)."""
    def xy(p: tuple[int, int]) -> str:
        return f"{round(p[0] / screen_hw[1] * image_hw[1])}, {round(p[1] / screen_hw[0] * image_hw[0])}"

    names = {ActionType.CLICK: "click", ActionType.LEFT_DOUBLE: "doubleClick", ActionType.LEFT_TRIPLE: "tripleClick",
             ActionType.RIGHT_SINGLE: "rightClick", ActionType.MIDDLE_SINGLE: "middleClick",
             ActionType.HOVER: "moveTo"}
    lines = []
    for a in actions:
        if a.kind in names:
            lines.append(f"pyautogui.{names[a.kind]}({xy(a.point)})")
        elif a.kind == ActionType.DRAG:
            lines += [f"pyautogui.moveTo({xy(a.point)})", f"pyautogui.dragTo({xy(a.end_point)}, duration=0.5)"]
        elif a.kind == ActionType.HOTKEY:
            lines.append(f"pyautogui.hotkey({', '.join(map(repr, a.keys))})")
        elif a.kind == ActionType.PRESS:
            lines.append(f"pyautogui.press({a.keys[0]!r})" if len(a.keys) == 1 else f"pyautogui.press({list(a.keys)!r})")
        elif a.kind in (ActionType.KEYDOWN, ActionType.KEYUP):
            func = "keyDown" if a.kind == ActionType.KEYDOWN else "keyUp"
            lines += [f"pyautogui.{func}({k!r})" for k in a.keys]
        elif a.kind == ActionType.TYPE:
            lines.append(f"pyautogui.write({a.text!r})")
        elif a.kind == ActionType.SCROLL:
            sign = 1 if a.direction in ("up", "right") else -1
            amount = a.amount if a.amount else 5.0
            clicks = sign * (int(amount) if float(amount).is_integer() else amount)
            where = f", {xy(a.point)}" if a.point is not None else ""
            lines.append(f"pyautogui.{'scroll' if a.direction in ('up', 'down') else 'hscroll'}({clicks}{where})")
        elif a.kind == ActionType.WAIT:
            lines.append("computer.wait()")
        elif a.kind == ActionType.FINISHED:
            lines.append('computer.terminate(status="success"' + (f", answer={a.text!r})" if a.text else ")"))
        elif a.kind == ActionType.FAIL:
            lines.append('computer.terminate(status="failure")')
        else:
            raise ValueError(f"action {a.kind.value!r} has no pyautogui equivalent in this grammar")
    return "\n".join(lines)


def _sections(text: str) -> dict[str, str]:
    """`## Thought:` / `## Action:` / `## Code:` sections by lower-case name (each up to the next one)."""
    marks = list(_SECTION.finditer(text))
    return {m.group(1).lower(): text[m.end():marks[i + 1].start() if i + 1 < len(marks) else len(text)].strip()
            for i, m in enumerate(marks)}


def render_response(thought: str, semantic: str, actions: Sequence[Action], *, image_hw: tuple[int, int],
                    screen_hw: tuple[int, int], think: bool = False) -> str:
    """One step in Fig. 9's format (the thought as a `[think]` segment with `think`); without actions (a past
    step shown as text) the Code section is left out."""
    head = f"{THINK_OPEN}\n{thought.strip()}\n{THINK_CLOSE}" if think else f"## Thought: {thought.strip()}"
    parts = [head, f"## Action: {semantic.strip()}"]
    if actions:
        parts.append(f"## Code:\n```python\n{render_code(actions, image_hw=image_hw, screen_hw=screen_hw)}\n```")
    return "\n".join(parts)


def split_response(text: str) -> tuple[str, str]:
    """(thought, action in words) of a Fig. 9 response, its thought a `## Thought:` field or a leading
    reasoning segment (`think_segment`; an unclosed one runs to the end); a response with neither nor sections
    is all thought."""
    segment = think_segment(text)
    if segment is not None:
        return segment[0], _sections(text[segment[1]:]).get("action", "")
    sections = _sections(text)
    if not sections:
        return _FENCE.split(text, 1)[0].strip(), ""
    return sections.get("thought", ""), sections.get("action", "")


def system_prompt(password: str = "password", *, think: bool = False) -> str:
    """Fig. 9 (or its thinking variant) with the desktop's password, then the task; one slot, {instruction}, as
    the other prompts have."""
    return (FIG9_THINK_PROMPT if think else FIG9_PROMPT).replace("{password}", password) + INSTRUCTION_TEMPLATE
