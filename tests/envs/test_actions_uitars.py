"""UI-TARS grammar: parsing, rendering, pyautogui code, and parity with ByteDance's `ui-tars` reference."""
from __future__ import annotations

import ast

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from envs.actions.model import Action, ActionParseError, ActionType
from envs.actions.uitars import parse_thought, parse_uitars, render_uitars, smart_resize, to_pyautogui

ui_tars = pytest.importorskip("ui_tars.action_parser")

IMAGE = (1080, 1920)  # screenshot h, w as taken
SCREEN = (1080, 1920)


def calls(code: str) -> list[tuple]:
    """pyautogui calls of a code string as (name, args, kwargs) with timing-only kwargs dropped."""
    out = []
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                isinstance(node.func.value, ast.Name) and node.func.value.id == "pyautogui":
            args = [ast.literal_eval(a) for a in node.args]
            kwargs = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg not in ("interval", "duration")}
            out.append((node.func.attr, args, kwargs))
    return out


def same_calls(ours: list[tuple], ref: list[tuple]) -> bool:
    if len(ours) != len(ref):
        return False
    for (n1, a1, k1), (n2, a2, k2) in zip(ours, ref):
        if n1 != n2 or len(a1) != len(a2) or k1.keys() != k2.keys():
            return False
        for x, y in list(zip(a1, a2)) + [(k1[k], k2[k]) for k in k1]:
            if isinstance(x, (int, float)) and isinstance(y, (int, float)):
                if abs(x - y) > 1.0:
                    return False
            elif x != y:
                return False
    return True


def reference_code(text: str, model: str) -> str:
    if model == "uitars-1.5":
        parsed = ui_tars.parse_action_to_structure_output(text, factor=1000, origin_resized_height=IMAGE[0],
                                                          origin_resized_width=IMAGE[1], model_type="qwen25vl")
        return ui_tars.parsing_response_to_pyautogui_code(parsed, SCREEN[0], SCREEN[1], input_swap=False, scale_factor=1)
    # UI-TARS-1.0: relative 0-1000 coordinates; parsed with factor 1 they stay 0-1000 and the default
    # scale 1000 maps them to pixels (factor 1000 with scale 1000 would divide by 1000 twice).
    parsed = ui_tars.parse_action_to_structure_output(text, factor=1, origin_resized_height=IMAGE[0],
                                                      origin_resized_width=IMAGE[1], model_type="qwen2vl")
    return ui_tars.parsing_response_to_pyautogui_code(parsed, SCREEN[0], SCREEN[1], input_swap=False)


RESIZED_H, RESIZED_W = smart_resize(*IMAGE)
# The reference strips leading whitespace from every argument (type(content=' a') types 'a'); guijax types
# what the model wrote, so generated texts start with a non-space character.
words = st.builds(lambda head, tail: head + tail, st.sampled_from("abcdefghijklmnopqrstuvwxyzABC0123456789"),
                  st.text(alphabet=st.sampled_from("abcdefghijklmnopqrstuvwxyz ABC0123456789.,"), max_size=30))
KEYS = ["enter", "ctrl c", "ctrl shift a", "alt f4", "tab", "esc", "ctrl s"]


@st.composite
def responses(draw, model):
    span_w, span_h = (RESIZED_W, RESIZED_H) if model == "uitars-1.5" else (1000, 1000)
    x = draw(st.integers(0, span_w - 1))
    y = draw(st.integers(0, span_h - 1))
    style = draw(st.sampled_from(["plain", "point"]))
    box = f"'({x},{y})'" if style == "plain" else f"'<point>{x} {y}</point>'"
    kind = draw(st.sampled_from(["click", "left_double", "right_single", "hover", "drag", "hotkey", "type",
                                 "scroll", "box4"]))
    if kind == "drag":
        x2, y2 = draw(st.integers(0, span_w - 1)), draw(st.integers(0, span_h - 1))
        action = f"drag(start_box={box}, end_box='({x2},{y2})')"
    elif kind == "hotkey":
        action = f"hotkey(key='{draw(st.sampled_from(KEYS))}')"
    elif kind == "type":
        action = f"type(content='{draw(words)}')"
    elif kind == "scroll":
        action = f"scroll(start_box={box}, direction='{draw(st.sampled_from(['up', 'down']))}')"
    elif kind == "box4":
        x2, y2 = min(x + 20, span_w - 1), min(y + 10, span_h - 1)
        action = f"click(start_box='({x},{y},{x2},{y2})')"
    else:
        action = f"{kind}(start_box={box})"
    return f"Thought: {draw(words)}\nAction: {action}", kind


def _fix_reference_scroll(ref: list[tuple]) -> list[tuple]:
    """The reference passes scroll x/y as 0-1 fractions of the screen instead of pixels; scale them."""
    fixed = []
    for name, args, kwargs in ref:
        if name == "scroll" and "x" in kwargs:
            kwargs = dict(kwargs, x=kwargs["x"] * SCREEN[1], y=kwargs["y"] * SCREEN[0])
        fixed.append((name, args, kwargs))
    return fixed


@pytest.mark.parametrize("model", ["uitars-1.5", "uitars-1.0"])
def test_parity_with_ui_tars_reference(model):
    @settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(responses(model))
    def check(case):
        text, kind = case
        ours = calls(to_pyautogui(parse_uitars(text, image_hw=IMAGE, screen_hw=SCREEN, model=model)))
        ref = calls(reference_code(text, model))
        if model == "uitars-1.5":
            ref = _fix_reference_scroll(ref)
        else:  # in qwen2vl mode the reference's scroll x/y are raw 0-1000 values
            ref = [(n, a, dict(k, x=k["x"] / 1000 * SCREEN[1], y=k["y"] / 1000 * SCREEN[0]) if n == "scroll" and "x" in k else k)
                   for n, a, k in ref]
        assert same_calls(ours, ref), (text, ours, ref)

    check()


def test_reference_rejects_box_tokens_in_qwen25vl_mode_but_guijax_parses_them():
    """UI-TARS-1.5 emits <|box_start|>(x,y)<|box_end|> (the system prompt asks for it); the reference's
    float() on the raw box fails, guijax strips the tokens."""
    text = "Thought: open it\nAction: click(start_box='<|box_start|>(100,200)<|box_end|>')"
    with pytest.raises(ValueError):
        reference_code(text, "uitars-1.5")
    (action,) = parse_uitars(text, image_hw=IMAGE, screen_hw=SCREEN)
    assert action.kind == ActionType.CLICK
    assert action.point == (round(100 / RESIZED_W * 1920), round(200 / RESIZED_H * 1080))


def test_press_is_a_key_press_not_a_held_key():
    """The reference renders `press` as keyDown with no keyUp, leaving the key held; guijax presses it."""
    text = "Thought: confirm\nAction: press(key='enter')"
    assert calls(reference_code(text, "uitars-1.5")) == [("keyDown", ["enter"], {})]
    assert calls(to_pyautogui(parse_uitars(text, image_hw=IMAGE, screen_hw=SCREEN))) == [("press", ["enter"], {})]


def test_multiple_actions_reflection_and_control_words():
    text = ("Reflection: the menu is open\nAction_Summary: pick Save\n"
            "Action: click(start_box='(10,20)')\n\nhotkey(key='ctrl s')")
    actions = parse_uitars(text, image_hw=IMAGE, screen_hw=SCREEN)
    assert [a.kind for a in actions] == [ActionType.CLICK, ActionType.HOTKEY]
    assert actions[1].keys == ("ctrl", "s")
    assert parse_thought(text) == "pick Save"
    assert parse_uitars("Thought: all done\nAction: finished(content='ok')", image_hw=IMAGE, screen_hw=SCREEN)[0].text == "ok"
    assert parse_uitars("FAIL", image_hw=IMAGE, screen_hw=SCREEN) == [Action(ActionType.FAIL)]
    assert to_pyautogui([Action(ActionType.WAIT)]) == "WAIT"
    assert to_pyautogui([Action(ActionType.CLICK, point=(1, 2)), Action(ActionType.FINISHED)]) == "DONE"


def test_type_content_escapes_and_enter():
    text = "Thought: t\nAction: type(content='it\\'s \"fine\"\\n')"
    (action,) = parse_uitars(text, image_hw=IMAGE, screen_hw=SCREEN)
    assert action.text == "it's \"fine\"\n"
    assert calls(to_pyautogui([action])) == [("write", ["it's \"fine\""], {}), ("press", ["enter"], {})]


def test_clipping_is_flagged():
    (inside,) = parse_uitars("Thought: x\nAction: click(start_box='(5,5)')", image_hw=IMAGE, screen_hw=SCREEN)
    (outside,) = parse_uitars(f"Thought: x\nAction: click(start_box='({RESIZED_W + 200},-30)')", image_hw=IMAGE,
                              screen_hw=SCREEN)
    assert not inside.clipped and outside.clipped and outside.point == (1919, 0)


@pytest.mark.parametrize("text,match", [
    ("Thought: nothing to do", "no 'Action:'"),
    ("Thought: x\nAction: teleport(start_box='(1,2)')", "unknown action 'teleport'"),
    ("Thought: x\nAction: click(start_box='(1,2)'", "unterminated argument list"),
    ("Thought: x\nAction: click(start_box='(1)')", "2 or 4 numbers"),
    ("Thought: x\nAction: scroll(start_box='(1,2)', direction='sideways')", "scroll direction"),
    ("Thought: x\nAction: drag(start_box='(1,2)')", "needs start_box and end_box"),
    ("Thought: x\nAction: type(content='unclosed)", "unterminated string"),
])
def test_malformed_output_raises_with_text(text, match):
    with pytest.raises(ActionParseError, match=match) as info:
        parse_uitars(text, image_hw=IMAGE, screen_hw=SCREEN)
    assert info.value.text == text


@pytest.mark.parametrize("model", ["uitars-1.5", "uitars-1.0"])
@settings(max_examples=40, deadline=None)
@given(x=st.integers(0, 1919), y=st.integers(0, 1079), x2=st.integers(0, 1919), y2=st.integers(0, 1079))
def test_render_parse_round_trip(model, x, y, x2, y2):
    actions = [Action(ActionType.CLICK, point=(x, y)), Action(ActionType.DRAG, point=(x, y), end_point=(x2, y2)),
               Action(ActionType.SCROLL, point=(x, y), direction="left", amount=5.0),
               Action(ActionType.TYPE, text="a 'b'\n"), Action(ActionType.HOTKEY, keys=("ctrl", "c"))]
    text = render_uitars(actions, image_hw=IMAGE, screen_hw=SCREEN, model=model, thought="go")
    back = parse_uitars(text, image_hw=IMAGE, screen_hw=SCREEN, model=model)
    tol = 1 if model == "uitars-1.5" else 2  # 1000-step grid is coarser than the 1920 px screen
    for a, b in zip(actions, back):
        assert a.kind == b.kind and a.text == b.text and a.keys == b.keys and a.direction == b.direction
        for p, q in ((a.point, b.point), (a.end_point, b.end_point)):
            if p is not None:
                assert abs(p[0] - q[0]) <= tol and abs(p[1] - q[1]) <= tol
