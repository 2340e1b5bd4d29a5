"""Agent S2-style and computer_use grammars onto the typed action model."""
from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings, strategies as st

from envs.actions import (Action, ActionParseError, ActionType, S2Action, S2ConversionError, parse_computer_use,
                          parse_s2, parse_uitars, render_computer_use, s2_to_actions, s2_to_uitars_text)
from envs.actions.s2 import SIGNATURES

BOXES = {"the Save button": (100, 40, 140, 60), "the name field": (20, 100, 220, 120), "slider knob": (50, 200, 60, 210),
         "right end of the slider": (300, 200, 310, 210)}
HW = (480, 640)


def ground(description: str):
    if description not in BOXES:
        raise KeyError(f"cannot ground {description!r}")
    return BOXES[description]


@pytest.mark.parametrize("action", [
    S2Action("click", {"element_description": "the Save button", "num_clicks": 1, "button_type": "left"}),
    S2Action("type", {"element_description": "the name field", "text": "Ada", "overwrite": True, "enter": True}),
    S2Action("scroll", {"element_description": "the name field", "clicks": -3}),
    S2Action("hotkey", {"keys": ["ctrl", "s"]}),
    S2Action("hold_and_press", {"hold_keys": ["shift"], "press_keys": ["down", "down"]}),
    S2Action("drag_and_drop", {"starting_description": "slider knob", "ending_description": "right end of the slider"}),
    S2Action("set_cell_values", {"cell_values": {"A1": 3}, "app_name": "Calc", "sheet_name": "Sheet1"}),
    S2Action("wait", {"time": 1.5}), S2Action("done"), S2Action("fail"),
    S2Action("switch_applications", {"app_code": "gedit"}),
    S2Action("highlight_text_span", {"starting_phrase": "Dear", "ending_phrase": "regards,", "button": "left"}),
    S2Action("save_to_knowledge", {"text": ["a", "b'c"]}),
    S2Action("click", {"element_description": "x", "hold_keys": ["ctrl"]}),
])
def test_s2_render_parse_round_trip(action):
    parsed = parse_s2(action.render())
    assert parsed.name == action.name
    assert all(parsed.get(k) == v for k, v in action.args.items())


def test_s2_conversion_to_uitars_primitives():
    click = s2_to_actions(S2Action("click", {"element_description": "the Save button", "num_clicks": 2}), ground)
    assert click == [Action(ActionType.LEFT_DOUBLE, point=(120, 50))]
    typed = s2_to_actions(S2Action("type", {"element_description": "the name field", "text": "Ada", "overwrite": True,
                                            "enter": True}), ground)
    assert [a.kind for a in typed] == [ActionType.CLICK, ActionType.HOTKEY, ActionType.PRESS, ActionType.TYPE]
    assert typed[-1].text == "Ada\n"
    held = s2_to_actions(S2Action("hold_and_press", {"hold_keys": ["shift"], "press_keys": ["a"]}), ground)
    assert [(a.kind, a.keys) for a in held] == [(ActionType.KEYDOWN, ("shift",)), (ActionType.PRESS, ("a",)),
                                                (ActionType.KEYUP, ("shift",))]
    (drag,) = s2_to_actions(S2Action("drag_and_drop", {"starting_description": "slider knob",
                                                       "ending_description": "right end of the slider"}), ground)
    assert drag.point == (55, 205) and drag.end_point == (305, 205)
    (scroll,) = s2_to_actions(S2Action("scroll", {"element_description": "the name field", "clicks": -3}), ground)
    assert scroll.direction == "down" and scroll.amount == 3


def test_s2_non_convertible_actions_name_themselves():
    with pytest.raises(S2ConversionError, match="switch_applications.*no UI-TARS equivalent.*wmctrl"):
        s2_to_actions(S2Action("switch_applications", {"app_code": "code"}), ground)
    with pytest.raises(S2ConversionError, match="set_cell_values.*no UI-TARS equivalent.*UNO"):
        s2_to_actions(S2Action("set_cell_values", {"cell_values": {"A1": 1}, "app_name": "x", "sheet_name": "y"}), ground)
    with pytest.raises(S2ConversionError, match="button_type='right', num_clicks=2"):
        s2_to_actions(S2Action("click", {"element_description": "the Save button", "num_clicks": 2,
                                         "button_type": "right"}), ground)
    with pytest.raises(S2ConversionError, match="num_clicks=4"):
        s2_to_actions(S2Action("click", {"element_description": "the Save button", "num_clicks": 4}), ground)
    with pytest.raises(S2ConversionError, match="scroll by 0"):
        s2_to_actions(S2Action("scroll", {"element_description": "the name field", "clicks": 0}), ground)
    with pytest.raises(ValueError, match="unknown platform 'beos'"):
        s2_to_actions(S2Action("fail"), ground, platform="beos")
    # a triple click converts, but UI-TARS text has no triple click: the error names the S2 action
    triple = S2Action("click", {"element_description": "the Save button", "num_clicks": 3})
    assert s2_to_actions(triple, ground) == [Action(ActionType.LEFT_TRIPLE, point=(120, 50))]
    with pytest.raises(S2ConversionError, match='agent.click\\("the Save button", 3\\).*left_triple'):
        s2_to_uitars_text(triple, ground, image_hw=HW, screen_hw=HW, thought="t")


def test_s2_platform_specific_conversions_follow_agent_s2():
    switch = S2Action("switch_applications", {"app_code": "gedit"})
    assert s2_to_actions(switch, ground, platform="darwin") == [Action(ActionType.HOTKEY, keys=("command", "space")),
                                                                 Action(ActionType.TYPE, text="gedit\n")]
    assert s2_to_actions(switch, ground, platform="windows")[0].keys == ("win", "d")
    overwrite = S2Action("type", {"text": "x", "overwrite": True})
    assert s2_to_actions(overwrite, ground, platform="darwin")[0].keys == ("command", "a")
    assert s2_to_actions(overwrite, ground)[0].keys == ("ctrl", "a")


def test_s2_scroll_directions_follow_pyautogui_signs():
    """Agent S2 runs vscroll(clicks) (+ up) or, with shift, hscroll(clicks) (+ right)."""
    def direction(clicks, shift):
        (a,) = s2_to_actions(S2Action("scroll", {"element_description": "the name field", "clicks": clicks,
                                                 "shift": shift}), ground)
        return a.direction, a.amount
    assert [direction(2, False), direction(-2, False), direction(4, True), direction(-4, True)] == \
        [("up", 2), ("down", 2), ("right", 4), ("left", 4)]


def test_s2_highlight_and_knowledge():
    span = S2Action("highlight_text_span", {"starting_phrase": "the name field", "ending_phrase": "the Save button"})
    assert parse_s2(span.render()) == span
    (drag,) = s2_to_actions(span, ground)
    assert drag == Action(ActionType.DRAG, point=(20, 110), end_point=(140, 50))  # first word's left, last's right
    with pytest.raises(S2ConversionError, match="button='right'"):
        s2_to_actions(S2Action("highlight_text_span", {"starting_phrase": "a", "ending_phrase": "b", "button": "right"}),
                      ground)
    note = parse_s2('agent.save_to_knowledge(["the total is 42"])')
    assert note.args == {"text": ["the total is 42"]}
    assert s2_to_actions(note, ground) == [Action(ActionType.WAIT)]
    with pytest.raises(ActionParseError, match="list of strings"):
        parse_s2('agent.save_to_knowledge("not a list")')


def test_s2_to_uitars_text_parses_back():
    text = s2_to_uitars_text(S2Action("click", {"element_description": "the Save button"}), ground, image_hw=HW,
                             screen_hw=HW, thought="Save the document.")
    assert text.startswith("Thought: Save the document.\nAction: click(")
    (action,) = parse_uitars(text, image_hw=HW, screen_hw=HW)
    assert abs(action.point[0] - 120) <= 1 and abs(action.point[1] - 50) <= 1


@pytest.mark.parametrize("text,match", [
    ("click('x')", "expected agent.<action>"),
    ("agent.fly('x')", "unknown S2 action 'fly'"),
    ("agent.click(", "not a python call"),
    ("agent.click()", "missing arguments"),
    ('agent.click("x", "two")', "'num_clicks' of 'click' must be int"),
    ('agent.click("x", 1, "up")', "button_type"),
    ("agent.wait(True)", "'time' of 'wait'"),
    ('agent.hotkey([1])', "'keys' of 'hotkey'"),
    ('agent.click("x", nope=1)', "unknown arguments"),
])
def test_s2_parse_errors(text, match):
    with pytest.raises(ActionParseError, match=match):
        parse_s2(text)


def test_computer_use_round_trip_and_semantics():
    actions = [Action(ActionType.CLICK, point=(10, 20)), Action(ActionType.LEFT_TRIPLE, point=(30, 40)),
               Action(ActionType.HOTKEY, keys=("ctrl", "c")), Action(ActionType.TYPE, text="hello"),
               Action(ActionType.SCROLL, point=(5, 5), direction="down", amount=100.0),
               Action(ActionType.SCROLL, point=(5, 5), direction="left", amount=50.0),
               Action(ActionType.WAIT, amount=2.0), Action(ActionType.FAIL)]
    text = render_computer_use(actions, image_hw=HW, screen_hw=HW)
    assert parse_computer_use(text, image_hw=HW, screen_hw=HW) == actions
    drag = [Action(ActionType.DRAG, point=(1, 2), end_point=(300, 400))]
    rendered = render_computer_use(drag, image_hw=HW, screen_hw=HW)
    assert '"mouse_move"' in rendered and '"left_click_drag"' in rendered
    assert parse_computer_use(rendered, image_hw=HW, screen_hw=HW) == drag  # mouse_move + drag is one DRAG
    presses = [Action(ActionType.PRESS, keys=("down", "down", "enter")), Action(ActionType.HOTKEY, keys=("ctrl", "v"))]
    back = parse_computer_use(render_computer_use(presses, image_hw=HW, screen_hw=HW), image_hw=HW, screen_hw=HW)
    assert back == [Action(ActionType.PRESS, keys=(k,)) for k in ("down", "down", "enter")] + presses[1:]
    clicked_then_dragged = parse_computer_use(
        '<tool_call>{"name": "computer_use", "arguments": {"action": "left_click", "coordinate": [10, 10]}}</tool_call>'
        '<tool_call>{"name": "computer_use", "arguments": {"action": "left_click_drag", "coordinate": [50, 60]}}'
        '</tool_call>', image_hw=HW, screen_hw=HW)
    assert [a.kind for a in clicked_then_dragged] == [ActionType.CLICK, ActionType.DRAG]
    assert clicked_then_dragged[1].point == (10, 10)
    bare = parse_computer_use('{"name": "computer_use", "arguments": {"action": "terminate", "status": "success"}}',
                              image_hw=HW, screen_hw=HW)
    assert bare == [Action(ActionType.FINISHED)]
    relative = parse_computer_use('<tool_call>{"name": "computer_use", "arguments": {"action": "double_click", '
                                  '"coordinate": [500, 250]}}</tool_call>', image_hw=(1000, 1000), screen_hw=(1080, 1920))
    assert relative == [Action(ActionType.LEFT_DOUBLE, point=(960, 270))]
    scroll = parse_computer_use('<tool_call>{"name": "computer_use", "arguments": {"action": "hscroll", "pixels": -3, '
                                '"coordinate": [900, 20]}}</tool_call>', image_hw=HW, screen_hw=HW)
    assert scroll == [Action(ActionType.SCROLL, point=(639, 20), direction="left", amount=3.0, clipped=True)]
    keys = parse_computer_use('<tool_call>{"name": "computer_use", "arguments": {"action": "key_up", "keys": ["ctrl", "shift"]}}</tool_call>',
                              image_hw=HW, screen_hw=HW)
    assert [a.keys for a in keys] == [("shift",), ("ctrl",)]  # released in reverse order
    scaled = parse_computer_use('<tool_call>{"name": "computer_use", "arguments": {"action": "left_click", "coordinate": [320, 240]}}</tool_call>',
                                image_hw=(240, 320), screen_hw=(1080, 1920))
    assert scaled[0].point == (1919, 1079) and scaled[0].clipped


@pytest.mark.parametrize("text,match", [
    ("no call", "no <tool_call>"),
    ("<tool_call>{bad json}</tool_call>", "not valid JSON"),
    ('<tool_call>{"name": "browser", "arguments": {}}</tool_call>', "unknown tool 'browser'"),
    ('<tool_call>{"name": "computer_use", "arguments": {"action": "jump"}}</tool_call>', "unknown computer_use action 'jump'"),
    ('<tool_call>{"name": "computer_use", "arguments": {"action": "left_click_drag", "coordinate": [1, 2]}}</tool_call>',
     "known cursor position"),
    ('<tool_call>{"name": "computer_use", "arguments": {"action": "terminate", "status": "maybe"}}</tool_call>',
     "terminate status"),
])
def test_computer_use_errors(text, match):
    with pytest.raises(ActionParseError, match=match):
        parse_computer_use(text, image_hw=HW, screen_hw=HW)


def test_s2_render_is_agent_s2_style():
    action = S2Action("click", {"element_description": 'the "OK" button', "num_clicks": 1, "button_type": "left"})
    assert action.render() == 'agent.click("the \\"OK\\" button", 1, "left")'
    assert S2Action("hotkey", {"keys": ["ctrl", "s"]}).render() == 'agent.hotkey(["ctrl", "s"])'
    assert S2Action("type", {"text": "hi"}).render() == 'agent.type(None, "hi")'


@settings(max_examples=80, deadline=None)
@given(description=st.text(max_size=40), text=st.text(max_size=40), overwrite=st.booleans(), seconds=st.floats(0, 60))
def test_s2_round_trip_any_text(description, text, overwrite, seconds):
    for action in (S2Action("type", {"element_description": description, "text": text, "overwrite": overwrite}),
                   S2Action("click", {"element_description": description, "num_clicks": 2, "hold_keys": ["shift"]}),
                   S2Action("wait", {"time": seconds})):
        parsed = parse_s2(action.render())  # positional rendering spells out defaults before the last argument
        assert parsed.name == action.name
        assert all(parsed.get(p) == action.get(p) for p, _ in SIGNATURES[action.name])


@settings(max_examples=60, deadline=None)
@given(x=st.integers(-50, 700), y=st.integers(-50, 500), text=st.text(max_size=30),
       clicks=st.integers(1, 500), kind=st.sampled_from(["left_click", "right_click", "middle_click", "double_click",
                                                          "triple_click", "mouse_move"]))
def test_computer_use_round_trip_and_clipping(x, y, text, clicks, kind):
    import json
    body = {"name": "computer_use", "arguments": {"action": kind, "coordinate": [x, y]}}
    (action,) = parse_computer_use(f"<tool_call>{json.dumps(body)}</tool_call>", image_hw=HW, screen_hw=HW)
    inside = 0 <= x < HW[1] and 0 <= y < HW[0]
    assert action.clipped == (not inside)
    assert action.point == (min(max(x, 0), HW[1] - 1), min(max(y, 0), HW[0] - 1))
    actions = [action, Action(ActionType.TYPE, text=text),
               Action(ActionType.SCROLL, point=action.point, direction="up", amount=float(clicks))]
    back = parse_computer_use(render_computer_use(actions, image_hw=HW, screen_hw=HW), image_hw=HW, screen_hw=HW)
    assert back == [dataclasses.replace(action, clipped=False)] + actions[1:]


RELATIVE_GRAMMARS = ("computer_use", "pyautogui", "pyautogui_think")


@pytest.mark.parametrize("source", RELATIVE_GRAMMARS)
@pytest.mark.parametrize("target", RELATIVE_GRAMMARS + ("uitars",))
def test_a_response_converts_between_grammars_keeping_thought_words_and_actions(source, target):
    """What one policy wrote, as a policy prompted in another grammar is shown it: the same actions (up to the
    0-1000 grid's rounding), thought and action in words."""
    from canonical_actions import CANONICAL, SCREEN
    from envs.actions.grammar import convert_response, parse_response, reasoning, render_response
    from envs.actions.pyautogui_code import split_response as pyautogui_words
    from envs.actions.computer_use import split_response as computer_use_words

    words = {"computer_use": lambda t: computer_use_words(t)[1], "pyautogui": lambda t: pyautogui_words(t)[1],
             "pyautogui_think": lambda t: pyautogui_words(t)[1]}
    uitars_writes = {ActionType.CLICK, ActionType.RIGHT_SINGLE, ActionType.LEFT_DOUBLE, ActionType.HOTKEY,
                     ActionType.TYPE, ActionType.DRAG, ActionType.WAIT, ActionType.FINISHED}
    for action in CANONICAL:
        text = render_response("I look first.", "Do the thing.", [action], grammar=source, screen_hw=SCREEN)
        moved = convert_response(text, source=source, target=target, screen_hw=SCREEN)
        if target == "uitars" and action.kind not in uitars_writes:
            continue  # UI-TARS text writes fewer kinds; what it cannot write is kept as it was, or written its way
        (got,), (want,) = (parse_response(moved, grammar=target, screen_hw=SCREEN),
                           parse_response(text, grammar=source, screen_hw=SCREEN))
        assert got.kind == want.kind and got.keys == want.keys and got.text == want.text, (action, moved)
        for p, q in ((got.point, want.point), (got.end_point, want.end_point)):
            assert (p is None) == (q is None) and (p is None or max(abs(p[0] - q[0]), abs(p[1] - q[1])) <= 1)
        assert reasoning(moved, target) == "I look first."
        if target in words:
            assert words[target](moved) == "Do the thing."
    assert convert_response("not an action", source=source, target=target, screen_hw=SCREEN) == "not an action"


def test_ui_tars_text_gets_its_action_in_words_when_shown_in_a_grammar_that_has_them():
    from envs.actions.grammar import action_words, convert_response

    text = "Thought: Save it.\nAction: hotkey(key='ctrl s')"
    assert convert_response(text, source="uitars", target="pyautogui", screen_hw=(280, 280)) == (
        "## Thought: Save it.\n## Action: Press ctrl+s.\n## Code:\n```python\npyautogui.hotkey('ctrl', 's')\n```")
    assert action_words([Action(ActionType.TYPE, text="hi"), Action(ActionType.CLICK, point=(1, 2))]) == \
        "Type 'hi'; Click."
    # UI-TARS-1.5's pixels shown to a UI-TARS 1.0 policy (0-1000) and back
    pixels = "Thought: Open it.\nAction: click(start_box='(140,70)')"
    relative = convert_response(pixels, source="uitars", target="uitars", screen_hw=(280, 280),
                                coordinate_model="uitars-1.5", target_coordinate_model="uitars-1.0")
    assert "(500,250)" in relative and relative.startswith("Thought: Open it.")
    assert "(140,70)" in convert_response(relative, source="uitars", target="uitars", screen_hw=(280, 280),
                                          coordinate_model="uitars-1.0", target_coordinate_model="uitars-1.5")
    assert convert_response(pixels, source="uitars", target="uitars", screen_hw=(280, 280)) == pixels


def test_a_prompt_names_its_coordinate_convention():
    from guijax.rollout.prompt import coordinates_of

    assert [coordinates_of(p) for p in ("uitars_v1", "uitars_official", "pyautogui")] == [
        "uitars-1.0", "uitars-1.5", "uitars-1.5"]
    with pytest.raises(ValueError, match="is not one of"):
        coordinates_of("uitars")
