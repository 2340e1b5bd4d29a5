"""UI-TARS grammar: parsing, rendering, pyautogui code, and parity with ByteDance's `ui-tars` reference.

Parity means: for generated UI-TARS outputs, the pyautogui calls guijax produces are the reference's calls
(same functions, same arguments, coordinates within 1 px), compared as parsed call lists, not strings.
Where the reference is wrong, a test below shows what it does and what guijax does instead, and why.
"""
from __future__ import annotations

import ast
import re

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from envs.actions.model import Action, ActionParseError, ActionType
from envs.actions.uitars import parse_thought, parse_uitars, render_uitars, smart_resize, to_pyautogui

ui_tars = pytest.importorskip("ui_tars.action_parser")

IMAGE = (1080, 1920)  # screenshot h, w as taken
SCREEN = (1080, 1920)
RESIZED_H, RESIZED_W = smart_resize(*IMAGE)
# (screenshot size, screen size): equal, and a screenshot taken at half the screen's resolution.
SIZES = [((1080, 1920), (1080, 1920)), ((720, 1280), (1440, 2560))]


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


def reference_code(text: str, model: str, image=IMAGE, screen=SCREEN) -> str:
    if model == "uitars-1.5":
        parsed = ui_tars.parse_action_to_structure_output(text, factor=1000, origin_resized_height=image[0],
                                                          origin_resized_width=image[1], model_type="qwen25vl")
        return ui_tars.parsing_response_to_pyautogui_code(parsed, screen[0], screen[1], input_swap=False,
                                                          scale_factor=1)
    # UI-TARS-1.0: relative 0-1000 coordinates; parsed with factor 1 they stay 0-1000 and the default
    # scale 1000 maps them to pixels (factor 1000 with scale 1000 would divide by 1000 twice).
    parsed = ui_tars.parse_action_to_structure_output(text, factor=1, origin_resized_height=image[0],
                                                      origin_resized_width=image[1], model_type="qwen2vl")
    return ui_tars.parsing_response_to_pyautogui_code(parsed, screen[0], screen[1], input_swap=False)


def ours(text: str, model: str = "uitars-1.5", image=IMAGE, screen=SCREEN) -> str:
    return to_pyautogui(parse_uitars(text, image_hw=image, screen_hw=screen, model=model))


# ------------------------------------------------------------------------------------ generated outputs
# Texts avoid what the reference mishandles (tested separately below): leading spaces (it strips them), single
# quotes (it types a backslash before each), a trailing newline (it presses Enter twice), "')" and ")\n\n"
# (its regex and action split cut there).
_CHARS = "abcdefghijklmnopqrstuvwxyz ABCXYZ0123456789.,:;!?-\"é"
words = st.builds(lambda head, tail: head + tail, st.sampled_from("abcdefghijklmnopqrstuvwxyzABC0123456789\""),
                  st.text(alphabet=st.sampled_from(_CHARS), max_size=30))
# content='...' as the model writes it: a newline is the escape \n, never at the end.
contents = st.one_of(st.just(""), st.lists(words, min_size=1, max_size=3).map("\\n".join))
HOTKEYS = ["enter", "ctrl c", "ctrl shift a", "alt f4", "tab", "esc", "ctrl s", "ctrl space", "arrowleft",
           "arrowdown", "ctrl alt t", "shift tab", "f5", "ctrl +"]
SINGLE_KEYS = ["shift", "ctrl", "alt", "space", "a", "enter", "arrowup", "arrowright", "tab"]
POINT_KINDS = ["click", "left_single", "left_double", "right_single", "hover"]


@st.composite
def coordinate(draw, model, image, arg, allow_box4=True):
    """One coordinate argument in any of the spellings UI-TARS emits and the reference accepts, inside the
    image (guijax clips outside coordinates, the reference does not: tested apart)."""
    span_h, span_w = smart_resize(*image) if model == "uitars-1.5" else (1000, 1000)
    x, y = draw(st.integers(0, span_w - 1)), draw(st.integers(0, span_h - 1))
    styles = ["plain", "spaced", "point"] + (["box4"] if allow_box4 else [])
    style = draw(st.sampled_from(styles))
    if style == "plain":
        value = f"({x},{y})"
    elif style == "spaced":
        value = f"({x}, {y})"
    elif style == "point":
        value = f"<point>{x} {y}</point>"
    else:
        value = f"({x},{y},{min(x + draw(st.integers(0, 40)), span_w - 1)},{min(y + draw(st.integers(0, 40)), span_h - 1)})"
    names = ["start_box", "point", "start_point"] if arg == "start" else ["end_box", "end_point"]
    return f"{draw(st.sampled_from(names))}='{value}'"


@st.composite
def one_action(draw, model, image):
    kind = draw(st.sampled_from(POINT_KINDS + ["drag", "select", "hotkey", "keydown", "keyup", "release", "type",
                                               "scroll", "scroll_nobox"]))
    if kind in POINT_KINDS:
        return f"{kind}({draw(coordinate(model, image, 'start'))})"
    if kind in ("drag", "select"):
        return f"{kind}({draw(coordinate(model, image, 'start'))}, {draw(coordinate(model, image, 'end'))})"
    if kind == "hotkey":
        return f"hotkey(key='{draw(st.sampled_from(HOTKEYS))}')"
    if kind in ("keydown", "keyup", "release"):
        return f"{kind}(key='{draw(st.sampled_from(SINGLE_KEYS))}')"
    if kind == "type":
        return f"type(content='{draw(contents)}')"
    direction = draw(st.sampled_from(["up", "down"]))
    if kind == "scroll_nobox":
        return f"scroll(direction='{direction}')"
    # The reference takes a 4-number scroll box's top-left corner (clicks take the centre): tested below.
    return f"scroll({draw(coordinate(model, image, 'start', allow_box4=False))}, direction='{direction}')"


@st.composite
def responses(draw, model, image=IMAGE):
    actions = draw(st.lists(one_action(model, image), min_size=1, max_size=3))
    if draw(st.integers(0, 5)) == 0:  # rarely: finished() makes the whole step DONE, hiding the other actions
        actions.append(f"finished(content='{draw(words)}')")
    prefix = draw(st.sampled_from(["Thought: {}\n", "Reflection: {}\nAction_Summary: {}\n", "Action_Summary: {}\n"]))
    head = prefix.format(draw(words), draw(words))
    return head + "Action: " + "\n\n".join(actions)


def _fix_reference_scroll(ref: list[tuple], model: str, screen) -> list[tuple]:
    """The reference passes scroll x/y unscaled: 0-1 fractions in qwen25vl mode, raw 0-1000 values in qwen2vl
    mode, where pyautogui wants pixels. Scale them to pixels so the rest of the call can be compared."""
    scale = 1.0 if model == "uitars-1.5" else 1000.0
    fixed = []
    for name, args, kwargs in ref:
        if name == "scroll" and "x" in kwargs:
            kwargs = dict(kwargs, x=kwargs["x"] / scale * screen[1], y=kwargs["y"] / scale * screen[0])
        fixed.append((name, args, kwargs))
    return fixed


@pytest.mark.parametrize("image,screen", SIZES)
@pytest.mark.parametrize("model", ["uitars-1.5", "uitars-1.0"])
def test_parity_with_ui_tars_reference(model, image, screen):
    @settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(responses(model, image))
    def check(text):
        mine = ours(text, model, image, screen)
        reference = reference_code(text, model, image, screen)
        if reference.strip() == "DONE":  # the reference's control word for finished()
            assert mine == "DONE", text
            return
        ref = _fix_reference_scroll(calls(reference), model, screen)
        assert same_calls(calls(mine), ref), (text, calls(mine), ref)

    check()


def test_parity_generator_reaches_every_kind():
    """Guard against a generator that silently stops producing some action kinds."""
    seen = set()

    @settings(max_examples=600, deadline=None, database=None)
    @given(responses("uitars-1.5"))
    def collect(text):
        seen.update(name for name, _, _ in calls(ours(text)))
        seen.update(["DONE"] if ours(text) == "DONE" else [])

    collect()
    assert {"click", "doubleClick", "moveTo", "dragTo", "hotkey", "keyDown", "keyUp", "write", "scroll",
            "DONE"} <= seen, seen


# ---------------------------------------------------------------------- where the reference is wrong
def test_reference_rejects_box_tokens_in_qwen25vl_mode_but_guijax_parses_them():
    """UI-TARS-1.5 emits <|box_start|>(x,y)<|box_end|> (the system prompt asks for it); the reference's
    float() on the raw box fails, guijax strips the tokens."""
    text = "Thought: open it\nAction: click(start_box='<|box_start|>(100,200)<|box_end|>')"
    with pytest.raises(ValueError):
        reference_code(text, "uitars-1.5")
    (action,) = parse_uitars(text, image_hw=IMAGE, screen_hw=SCREEN)
    assert action.kind == ActionType.CLICK
    assert action.point == (round(100 / RESIZED_W * 1920), round(200 / RESIZED_H * 1080))


def test_reference_scrolls_at_fractions_guijax_at_pixels():
    """pyautogui.scroll(x=, y=) takes pixels; the reference passes the 0-1 fraction of the screen."""
    text = "Thought: more\nAction: scroll(start_box='(966,546)', direction='down')"
    ((name, args, kw),) = calls(reference_code(text, "uitars-1.5"))
    assert name == "scroll" and args == [-5] and kw["x"] < 1 and kw["y"] < 1
    assert calls(ours(text)) == [("scroll", [-5], {"x": 960, "y": 540})]


def test_reference_uses_top_left_of_a_scroll_box_guijax_the_centre():
    """For clicks and drags the reference takes a 4-number box's centre; for scroll its top-left corner.
    guijax takes the centre for every action."""
    text = "Thought: more\nAction: scroll(start_box='(100,100,300,300)', direction='up')"
    ((_, _, kw),) = calls(reference_code(text, "uitars-1.5"))
    assert (kw["x"] * RESIZED_W, kw["y"] * RESIZED_H) == pytest.approx((100, 100))
    (action,) = parse_uitars(text, image_hw=IMAGE, screen_hw=SCREEN)
    assert action.point == (round(200 / RESIZED_W * 1920), round(200 / RESIZED_H * 1080))


def test_reference_drops_horizontal_scrolls():
    """The reference only knows up/down; left/right produce no code. guijax scrolls with hscroll (+ is right)."""
    text = "Thought: wide table\nAction: scroll(start_box='(100,100)', direction='left')"
    assert calls(reference_code(text, "uitars-1.5")) == []
    assert [c[:2] for c in calls(ours(text))] == [("hscroll", [-5])]
    right = "Thought: wide table\nAction: scroll(start_box='(100,100)', direction='right')"
    assert [c[:2] for c in calls(ours(right))] == [("hscroll", [5])]


def test_press_is_a_key_press_not_a_held_key():
    """The reference renders `press` as keyDown with no keyUp, leaving the key held; guijax presses it."""
    text = "Thought: confirm\nAction: press(key='enter')"
    assert calls(reference_code(text, "uitars-1.5")) == [("keyDown", ["enter"], {})]
    assert calls(ours(text)) == [("press", ["enter"], {})]


def test_reference_types_a_backslash_before_single_quotes():
    """The model escapes quotes as \\' (its prompt says so); the reference escapes them a second time and
    types `it\\'s`; guijax types `it's`."""
    text = "Thought: t\nAction: type(content='it\\'s')"
    assert calls(reference_code(text, "uitars-1.5")) == [("write", ["it\\'s"], {})]
    assert calls(ours(text)) == [("write", ["it's"], {})]


def test_reference_presses_enter_twice_for_a_trailing_newline():
    """A trailing \\n means 'submit'. The reference writes the newline (pyautogui types it as Enter) and then
    presses Enter again; guijax writes the text and presses Enter once."""
    text = "Thought: t\nAction: type(content='hello\\n')"
    assert calls(reference_code(text, "uitars-1.5")) == [("write", ["hello\n"], {}), ("press", ["enter"], {})]
    assert calls(ours(text)) == [("write", ["hello"], {}), ("press", ["enter"], {})]


def test_reference_strips_leading_spaces_of_typed_text():
    text = "Thought: t\nAction: type(content='  indented')"
    assert calls(reference_code(text, "uitars-1.5")) == [("write", ["indented"], {})]
    assert calls(ours(text)) == [("write", ["  indented"], {})]


def test_wait_and_call_user_are_control_words():
    """As in OSWorld's UI-TARS agent, wait() is the WAIT step and call_user() ends the episode as FAIL; the
    reference emits only a comment ('Unrecognized action type') and no call for either."""
    for text, word in (("Thought: loading\nAction: wait()", "WAIT"), ("Thought: stuck\nAction: call_user()", "FAIL")):
        reference = reference_code(text, "uitars-1.5")
        assert calls(reference) == [] and "Unrecognized action type" in reference
        assert ours(text) == word


def test_finished_ends_the_step_even_before_other_actions():
    """The reference overwrites its code with DONE at finished() and then appends later actions after it
    (invalid python); guijax ends the step at the control action."""
    text = "Thought: t\nAction: finished(content='ok')\n\nclick(start_box='(1,2)')"
    assert reference_code(text, "uitars-1.5").startswith("DONE\n")
    assert ours(text) == "DONE"


# ------------------------------------------------------------------------------------- guijax itself
def _action_space(prompt: str) -> list[tuple[str, str]]:
    """(name, call) for each action a ByteDance prompt lists, its placeholders filled: <point>xN yN</point> with
    pixels, one call per scroll direction; trailing comments dropped (no listed call nests parentheses)."""
    section = prompt.split("## Action Space", 1)[1].split("## ", 1)[0]
    out = []
    for line in filter(None, map(str.strip, section.splitlines())):
        call = re.sub(r"<point>x(\d) y(\d)</point>", lambda m: f"<point>{int(m[1]) * 100} {int(m[2]) * 60}</point>",
                      line[:line.index(")") + 1])
        name = call[:call.index("(")]
        for d in ("down", "up", "right", "left"):
            out.append((name, call.replace("'down or up or right or left'", f"'{d}'")))
    return list(dict.fromkeys(out))


def test_every_action_of_the_official_computer_use_prompt_parses_and_runs():
    """UI-TARS-1.5's prompt (guijax.rollout.prompt.UITARS_COMPUTER_USE is this text verbatim) lists nine actions in
    its <point> spelling: each parses to the action it names and renders as pyautogui code or a control word."""
    from ui_tars.prompt import COMPUTER_USE_DOUBAO

    listed = _action_space(COMPUTER_USE_DOUBAO)
    assert {name for name, _ in listed} == {"click", "left_double", "right_single", "drag", "hotkey", "type",
                                            "scroll", "wait", "finished"}
    for name, call in listed:
        (action,) = parse_uitars(f"Thought: go\nAction: {call}", image_hw=IMAGE, screen_hw=SCREEN)
        assert action.kind.value == name, call
        assert to_pyautogui([action]), call
    (drag,) = parse_uitars("Thought: go\nAction: " + dict(listed)["drag"], image_hw=IMAGE, screen_hw=SCREEN)
    assert (drag.point, drag.end_point) == ((round(100 / RESIZED_W * 1920), round(60 / RESIZED_H * 1080)),
                                            (round(200 / RESIZED_W * 1920), round(120 / RESIZED_H * 1080)))
    (hotkey,) = parse_uitars("Thought: go\nAction: " + dict(listed)["hotkey"], image_hw=IMAGE, screen_hw=SCREEN)
    assert calls(to_pyautogui([hotkey])) == [("hotkey", ["ctrl", "c"], {})]


def test_mobile_prompt_actions_map_to_the_desktop_or_fail_naming_themselves():
    """ByteDance's mobile prompt (MOBILE_USE_DOUBAO), which the same model also learned: long_press holds the
    left button for a second; press_home, press_back and open_app have no desktop counterpart and fail with
    their name, which the rollout engine reports as the step's parse error."""
    from ui_tars.prompt import MOBILE_USE_DOUBAO

    listed = dict(_action_space(MOBILE_USE_DOUBAO))
    assert set(listed) == {"click", "long_press", "type", "scroll", "open_app", "drag", "press_home", "press_back",
                           "finished"}
    (hold,) = parse_uitars("Thought: go\nAction: " + listed["long_press"], image_hw=IMAGE, screen_hw=SCREEN)
    assert [c[0] for c in calls(to_pyautogui([hold]))] == ["mouseDown", "mouseUp"]
    for name in ("press_home", "press_back"):
        with pytest.raises(ValueError, match=f"action '{name}' has no desktop pyautogui equivalent"):
            to_pyautogui(parse_uitars("Thought: go\nAction: " + listed[name], image_hw=IMAGE, screen_hw=SCREEN))
    with pytest.raises(ActionParseError, match="unknown action 'open_app'"):
        parse_uitars("Thought: go\nAction: " + listed["open_app"], image_hw=IMAGE, screen_hw=SCREEN)


def test_multiple_actions_reflection_and_control_words():
    text = ("Reflection: the menu is open\nAction_Summary: pick Save\n"
            "Action: click(start_box='(10,20)')\n\nhotkey(key='ctrl s')")
    actions = parse_uitars(text, image_hw=IMAGE, screen_hw=SCREEN)
    assert [a.kind for a in actions] == [ActionType.CLICK, ActionType.HOTKEY]
    assert actions[1].keys == ("ctrl", "s")
    assert parse_thought(text) == "pick Save"
    assert parse_thought("Thought: go on\nAction: wait()") == "go on"
    assert parse_thought("Action: wait()") == ""
    assert parse_uitars("Thought: all done\nAction: finished(content='ok')", image_hw=IMAGE, screen_hw=SCREEN)[0].text == "ok"
    assert parse_uitars("FAIL", image_hw=IMAGE, screen_hw=SCREEN) == [Action(ActionType.FAIL)]
    assert to_pyautogui([Action(ActionType.WAIT)]) == "WAIT"
    assert to_pyautogui([Action(ActionType.CLICK, point=(1, 2)), Action(ActionType.FINISHED)]) == "DONE"


def test_several_action_lines_and_action_word_inside_text():
    text = ("Thought: The Action: menu is what I need.\nAction: click(start_box='(10,20)')\n"
            "Action: type(content='Action: go')")
    actions = parse_uitars(text, image_hw=IMAGE, screen_hw=SCREEN)
    assert [a.kind for a in actions] == [ActionType.CLICK, ActionType.TYPE]
    assert actions[1].text == "Action: go"


def test_argument_spellings():
    def point(text):
        (a,) = parse_uitars("Thought: x\nAction: " + text, image_hw=(1000, 1000), screen_hw=(1000, 1000), model="uitars-1.0")
        return a

    for spelling in ["start_box='(500,300)'", "start_box='<|box_start|>(500,300)<|box_end|>'", "point='<point>500 300</point>'",
                     "start_point='(500, 300)'", "start_box='[500, 300]'", "start_box='(490,290,510,310)'",
                     'start_box="(500,300)"']:
        assert point(f"click({spelling})").point == (500, 300), spelling
    drag = point("drag(start_point='<point>1 2</point>', end_point='<point>3 4</point>')")
    assert (drag.point, drag.end_point) == ((1, 2), (3, 4))


@pytest.mark.parametrize("raw,keys", [("ctrl c", ("ctrl", "c")), ("Ctrl+Shift+A", ("ctrl", "shift", "a")),
                                      ("ctrl +", ("ctrl", "+")), ("ctrl++", ("ctrl", "+")), ("arrowleft", ("left",)),
                                      ("escape", ("esc",)), ("control return", ("ctrl", "enter"))])
def test_hotkey_names(raw, keys):
    (a,) = parse_uitars(f"Thought: x\nAction: hotkey(key='{raw}')", image_hw=IMAGE, screen_hw=SCREEN)
    assert a.keys == keys


def test_type_content_escapes_and_enter():
    text = "Thought: t\nAction: type(content='it\\'s \"fine\"\\n')"
    (action,) = parse_uitars(text, image_hw=IMAGE, screen_hw=SCREEN)
    assert action.text == "it's \"fine\"\n"
    assert calls(to_pyautogui([action])) == [("write", ["it's \"fine\""], {}), ("press", ["enter"], {})]


def test_to_pyautogui_keys_and_scroll_amounts():
    code = to_pyautogui([Action(ActionType.KEYDOWN, keys=("shift", "space")), Action(ActionType.PRESS, keys=("a", "b")),
                         Action(ActionType.KEYUP, keys=("shift", "space")),
                         Action(ActionType.SCROLL, direction="down", amount=0.0),
                         Action(ActionType.SCROLL, point=(3, 4), direction="up", amount=2.0)])
    assert calls(code) == [("keyDown", ["shift"], {}), ("keyDown", [" "], {}), ("press", ["a"], {}),
                           ("press", ["b"], {}), ("keyUp", [" "], {}), ("keyUp", ["shift"], {}),
                           ("scroll", [0], {}), ("scroll", [2], {"x": 3, "y": 4})]
    with pytest.raises(ValueError, match="press_home"):
        to_pyautogui([Action(ActionType.PRESS_HOME)])


def test_clipping_is_flagged():
    (inside,) = parse_uitars("Thought: x\nAction: click(start_box='(5,5)')", image_hw=IMAGE, screen_hw=SCREEN)
    (outside,) = parse_uitars(f"Thought: x\nAction: click(start_box='({RESIZED_W + 200},-30)')", image_hw=IMAGE,
                              screen_hw=SCREEN)
    assert not inside.clipped and outside.clipped and outside.point == (1919, 0)
    (drag,) = parse_uitars("Thought: x\nAction: drag(start_box='(5,5)', end_box='(1200,5)')", image_hw=(1000, 1000),
                           screen_hw=(100, 100), model="uitars-1.0")
    assert drag.clipped and drag.point == (0, 0) and drag.end_point == (99, 0)


@pytest.mark.parametrize("text,match", [
    ("Thought: nothing to do", "no 'Action:'"),
    ("Thought: x\nAction: teleport(start_box='(1,2)')", "unknown action 'teleport'"),
    ("Thought: x\nAction: click(start_box='(1,2)'", "unterminated argument list"),
    ("Thought: x\nAction: click(start_box='(1)')", "2 or 4 numbers"),
    ("Thought: x\nAction: click()", "needs start_box"),
    ("Thought: x\nAction: hotkey()", "needs a key"),
    ("Thought: x\nAction: scroll(start_box='(1,2)', direction='sideways')", "scroll direction"),
    ("Thought: x\nAction: drag(start_box='(1,2)')", "needs start_box and end_box"),
    ("Thought: x\nAction: type(content='unclosed)", "unterminated string"),
    ("Thought: x\nAction: ", "followed by no action"),
    ("Thought: x\nAction: click(start_box='(1,2)') and then some prose", "'and' is missing its argument list"),
])
def test_malformed_output_raises_with_text(text, match):
    with pytest.raises(ActionParseError, match=match) as info:
        parse_uitars(text, image_hw=IMAGE, screen_hw=SCREEN)
    assert info.value.text == text


def test_unknown_model_is_rejected():
    with pytest.raises(ValueError, match="unknown UI-TARS model 'uitars-9'"):
        parse_uitars("Thought: x\nAction: wait()", image_hw=IMAGE, screen_hw=SCREEN, model="uitars-9")


ROUND_TRIP_SCREENS = [("uitars-1.5", (1080, 1920), 1), ("uitars-1.5", (768, 1366), 1),
                      ("uitars-1.0", (720, 1000), 1),  # a 1000-step grid is exact to 1 px up to 1000 px
                      ("uitars-1.0", (1080, 1920), 2)]  # ... and coarser than a 1920 px screen


@pytest.mark.parametrize("model,screen,tol", ROUND_TRIP_SCREENS)
@settings(max_examples=25, deadline=None)
@given(fx=st.floats(0, 1, exclude_max=True), fy=st.floats(0, 1, exclude_max=True),
       gx=st.floats(0, 1, exclude_max=True), gy=st.floats(0, 1, exclude_max=True), text=st.text(max_size=20))
def test_render_parse_round_trip(model, screen, tol, fx, fy, gx, gy, text):
    p = (int(fx * screen[1]), int(fy * screen[0]))
    q = (int(gx * screen[1]), int(gy * screen[0]))
    actions = [Action(ActionType.CLICK, point=p), Action(ActionType.LEFT_DOUBLE, point=q),
               Action(ActionType.RIGHT_SINGLE, point=p), Action(ActionType.HOVER, point=q),
               Action(ActionType.LONG_PRESS, point=p), Action(ActionType.DRAG, point=p, end_point=q),
               Action(ActionType.SCROLL, point=p, direction="left", amount=5.0),
               Action(ActionType.SCROLL, direction="down", amount=5.0),
               Action(ActionType.TYPE, text=text), Action(ActionType.TYPE, text="a 'b'\n"),
               Action(ActionType.HOTKEY, keys=("ctrl", "+")), Action(ActionType.PRESS, keys=("enter",)),
               Action(ActionType.KEYDOWN, keys=("shift",)), Action(ActionType.KEYUP, keys=("shift",)),
               Action(ActionType.PRESS_BACK), Action(ActionType.PRESS_HOME), Action(ActionType.PRESS_ENTER),
               Action(ActionType.WAIT, amount=5.0), Action(ActionType.CALL_USER, text="need a password"),
               Action(ActionType.FINISHED, text=text), Action(ActionType.FAIL)]
    rendered = render_uitars(actions, image_hw=screen, screen_hw=screen, model=model, thought="go")
    back = parse_uitars(rendered, image_hw=screen, screen_hw=screen, model=model)
    assert len(back) == len(actions)
    for a, b in zip(actions, back):
        assert (a.kind, a.text, a.keys, a.direction, a.amount) == (b.kind, b.text, b.keys, b.direction, b.amount)
        for u, v in ((a.point, b.point), (a.end_point, b.end_point)):
            assert (u is None) == (v is None)
            if u is not None:
                assert abs(u[0] - v[0]) <= tol and abs(u[1] - v[1]) <= tol


def test_render_rejects_actions_without_a_uitars_form():
    with pytest.raises(ValueError, match="'left_triple' has no UI-TARS equivalent"):
        render_uitars([Action(ActionType.LEFT_TRIPLE, point=(1, 1))], image_hw=IMAGE, screen_hw=SCREEN)
