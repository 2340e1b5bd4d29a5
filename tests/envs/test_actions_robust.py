"""Any model output either parses or raises ActionParseError carrying the text: never another exception,
because the rollout engine turns ActionParseError (and only it) into a format penalty."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from envs.actions import ActionParseError, parse_computer_use, parse_pyautogui, parse_s2, parse_uitars, smart_resize
from envs.actions import resize

pytestmark = pytest.mark.hostile  # the standing hostile-input and fault suite

HW = (480, 640)
# Fragments of each grammar so generated text reaches deep into the parsers, not only the first check.
UITARS_BITS = ["Thought: ", "Action: ", "click(", "drag(", "scroll(", "type(", "hotkey(", "finished(", "wait()",
               "start_box=", "end_box=", "point=", "direction=", "content=", "key=", "'", '"', "(", ")", ",", "\\",
               "<|box_start|>", "<|box_end|>", "<point>", "</point>", "1.2.3", "-5", "99999", "12", " ", "\n",
               "FAIL", "DONE", "up", "=", "1e5", "nan"]
CU_BITS = ["<tool_call>", "</tool_call>", '{"name": "computer_use", "arguments": ', "{", "}", '"action": ',
           '"left_click"', '"scroll"', '"type"', '"key"', '"wait"', '"terminate"', '"left_click_drag"',
           '"coordinate": ', "[1, 2]", "[1]", '"x"', '"keys": ', '"pixels": ', '"time": ', '"status": ', "null",
           "3", '"3"', "[]", ", ", '"arguments": "{}"', '"arguments": "x"', "true"]
PY_BITS = ["## Thought: ", "## Action: ", "## Code:", "```python\n", "```", "\n", "pyautogui.", "computer.", "time.",
           "click(", "moveTo(", "dragTo(", "mouseDown(", "mouseUp(", "hotkey(", "press(", "write(", "scroll(",
           "hscroll(", "wait()", "terminate(", "sleep(", "status=", "'success'", "answer=", "x=", "y=", "clicks=",
           "button='right'", "presses=", "(", ")", "[", "]", ", ", "1", "-7", "1e999", "2.5", "'a'", "True", "None",
           "import pyautogui", ";", "*", "**", "lambda", "=", " ", "[think]", "[/think]", "<think>", "</think>"]
S2_BITS = ["agent.", "click", "type", "scroll", "wait", "hotkey", "done", "(", ")", '"a"', "1", "None", "[",
           "]", ", ", "num_clicks=", "time=", "{", "}", ":", "x", "lambda", "**"]


def _fuzz(bits):
    return st.lists(st.sampled_from(bits) | st.text(max_size=3), max_size=25).map("".join)


def _only_parse_errors(fn, text):
    try:
        fn(text)
    except ActionParseError as e:
        assert e.text == text
    # any other exception propagates and fails the test


@settings(max_examples=300, deadline=None)
@given(_fuzz(UITARS_BITS), st.sampled_from(["uitars-1.5", "uitars-1.0"]))
def test_uitars_never_raises_anything_but_parse_errors(text, model):
    _only_parse_errors(lambda t: parse_uitars(t, image_hw=HW, screen_hw=HW, model=model), text)


@settings(max_examples=300, deadline=None)
@given(_fuzz(CU_BITS))
def test_computer_use_never_raises_anything_but_parse_errors(text):
    _only_parse_errors(lambda t: parse_computer_use(t, image_hw=HW, screen_hw=HW), text)


@settings(max_examples=300, deadline=None)
@given(_fuzz(PY_BITS))
def test_pyautogui_never_raises_anything_but_parse_errors(text):
    from envs.actions.grammar import history_text, reasoning

    _only_parse_errors(lambda t: parse_pyautogui(t, image_hw=(1000, 1000), screen_hw=HW), text)
    _only_parse_errors(lambda t: parse_pyautogui(t, image_hw=(1000, 1000), screen_hw=HW, think=True), text)
    for grammar in ("pyautogui", "pyautogui_think"):  # the prompt shows any answer, parsed or not, as history
        assert isinstance(history_text(text, grammar), str) and isinstance(reasoning(text, grammar), str)


@settings(max_examples=300, deadline=None)
@given(_fuzz(S2_BITS))
def test_s2_never_raises_anything_but_parse_errors(text):
    _only_parse_errors(parse_s2, text)


@pytest.mark.parametrize("text", [
    "Thought: x\nAction: click(point='<point>1.2.3 4</point>')",
    "Thought: x\nAction: click(start_box='(nan,4)')",
    "Thought: x\nAction: click(start_box='(1e400,4)')",
])
def test_uitars_bad_numbers_are_parse_errors(text):
    with pytest.raises(ActionParseError, match="start_box|point"):
        parse_uitars(text, image_hw=HW, screen_hw=HW)


@pytest.mark.parametrize("body,match", [
    ('{"name": "computer_use", "arguments": "not json"}', "arguments"),
    ('{"name": "computer_use", "arguments": [1, 2]}', "arguments"),
    ('{"name": "computer_use", "arguments": {"action": "wait", "time": "soon"}}', "time"),
    ('{"name": "computer_use", "arguments": {"action": "scroll", "pixels": 3, "coordinate": "here"}}', "coordinate"),
    ('{"name": "computer_use", "arguments": {"action": "type", "text": 5}}', "text"),
])
def test_computer_use_bad_argument_types_are_parse_errors(body, match):
    text = f"<tool_call>{body}</tool_call>"
    with pytest.raises(ActionParseError, match=match) as info:
        parse_computer_use(text, image_hw=HW, screen_hw=HW)
    assert info.value.text == text


def test_smart_resize_matches_the_ui_tars_package():
    ref = pytest.importorskip("ui_tars.action_parser").smart_resize
    sizes = [(1080, 1920), (720, 1280), (768, 1366), (2160, 3840), (1, 199), (28, 28), (5000, 5000), (480, 640),
             (100000, 1000), (57, 3)]
    for h, w in sizes:
        assert smart_resize(h, w) == ref(h, w, 28, resize.MIN_PIXELS, resize.MAX_PIXELS), (h, w)
    assert smart_resize(1080, 1920) == (1092, 1932)
    assert smart_resize(1080, 1920, factor=14, max_pixels=1000 * 14 * 14)[0] % 14 == 0


@pytest.mark.parametrize("hw,match", [((0, 10), "positive"), ((10, 2100), "aspect ratio")])
def test_smart_resize_rejects_bad_sizes(hw, match):
    with pytest.raises(ValueError, match=match):
        smart_resize(*hw)


HUGE = "9" * 400  # a float of 400 digits is inf; round(inf) raises OverflowError
DEEP_JSON = "[" * 100_000  # json and ast recurse once per bracket


@pytest.mark.parametrize("parse, text", [
    (lambda t: parse_uitars(t, image_hw=HW, screen_hw=HW), f"Action: click(start_box='({HUGE},5)')"),
    (lambda t: parse_uitars(t, image_hw=HW, screen_hw=HW), f"Action: click(point='<point>5 {HUGE}</point>')"),
    (lambda t: parse_uitars(t, image_hw=HW, screen_hw=HW, model="uitars-1.0"),
     f"Action: drag(start_box='(1,2)', end_box='({HUGE},{HUGE})')"),
    (lambda t: parse_computer_use(t, image_hw=HW, screen_hw=HW),
     '<tool_call>{"name": "computer_use", "arguments": {"action": "left_click", "coordinate": [1e999, 5]}}</tool_call>'),
    (lambda t: parse_computer_use(t, image_hw=HW, screen_hw=HW),
     '<tool_call>{"name": "computer_use", "arguments": {"action": "scroll", "pixels": 1e999}}</tool_call>'),
    (lambda t: parse_computer_use(t, image_hw=HW, screen_hw=HW), f"<tool_call>{DEEP_JSON}</tool_call>"),
    (parse_s2, "agent.click(" + "(" * 100_000 + ")"),
    (parse_s2, f"agent.scroll('x', {HUGE}e999)"),
], ids=["uitars-box", "uitars-point", "uitars-1.0-drag", "cu-coordinate", "cu-pixels", "cu-deep-json", "s2-deep",
        "s2-huge"])
def test_overflowing_or_deep_outputs_are_parse_errors(parse, text):
    """One such output used to raise OverflowError or RecursionError out of the rollout and end training."""
    with pytest.raises(ActionParseError) as err:
        parse(text)
    assert err.value.text == text and len(str(err.value)) < 2_000  # the message quotes a bounded excerpt


@pytest.mark.parametrize("image_hw", [(0, 640), (480, 0)])
def test_a_zero_image_size_is_a_parse_error(image_hw):
    with pytest.raises(ActionParseError, match="image"):
        parse_uitars("Action: click(start_box='(10,20)')", image_hw=image_hw, screen_hw=HW)
