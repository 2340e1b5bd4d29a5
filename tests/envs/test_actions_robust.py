"""Any model output either parses or raises ActionParseError carrying the text: never another exception,
because the rollout engine turns ActionParseError (and only it) into a format penalty."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from envs.actions import ActionParseError, parse_computer_use, parse_s2, parse_uitars, smart_resize
from envs.actions import resize

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
