"""Expert-trace conversion (D_conv): both thought styles keep the expert's actions and change only the words."""
import pytest

from envs.actions import parse_thought, parse_uitars
from envs.desk import FAMILIES, DeskEnv, ScriptedExpert, run_expert
from envs.tasks import generate_desk_tasks
from guijax.rollout.conversion import THOUGHT_STYLES, convert_trace, thought_for


def _traces():
    env = DeskEnv(popups=False)
    return [run_expert(env, task, ScriptedExpert()) for task in generate_desk_tasks(len(FAMILIES), seed=5)]


def test_styles_keep_actions_and_change_thoughts():
    for trace in _traces():
        terse, verbose = (convert_trace(trace, thought_style=s) for s in THOUGHT_STYLES)
        for a, b in zip(terse.steps, verbose.steps):
            hw = a.screenshot.shape[:2]
            assert parse_uitars(a.response, image_hw=hw, screen_hw=hw) == parse_uitars(b.response, image_hw=hw,
                                                                                      screen_hw=hw)
            thought_a, thought_b = parse_thought(a.response), parse_thought(b.response)
            assert thought_a and thought_b and thought_a != thought_b
            assert len(thought_b) > len(thought_a)


def test_default_is_the_terse_voice_and_unknown_styles_are_named():
    text = 'agent.click("the OK button", 1, "left")'
    assert thought_for(text) == "I should click the OK button."
    assert thought_for(text, "verbose").startswith("Looking at the current screen, I can see the OK button.")
    with pytest.raises(ValueError, match="'chatty'"):
        thought_for(text, "chatty")


def test_traces_are_written_in_the_policys_grammar_with_the_same_actions():
    """computer_use conversions (reasoning, semantic action, tool call in 0-1000 coordinates) parse back, in
    their grammar, to the actions the UI-TARS conversion gives, up to the relative grid's rounding."""
    from envs.actions.grammar import parse_response, reasoning
    from envs.actions.computer_use import split_response

    for trace in _traces():
        uitars, tools = (convert_trace(trace, grammar=g) for g in ("uitars", "computer_use"))
        for a, b in zip(uitars.steps, tools.steps, strict=True):
            hw = a.screenshot.shape[:2]
            assert "<tool_call>" in b.response and "<tool_call>" not in a.response
            assert reasoning(b.response, "computer_use") == parse_thought(a.response)
            assert split_response(b.response)[1]  # the semantic action
            want = parse_response(a.response, grammar="uitars", screen_hw=hw)
            got = parse_response(b.response, grammar="computer_use", screen_hw=hw)
            assert [x.kind for x in got] == [x.kind for x in want]
            for x, y in zip(got, want):
                if y.point is not None:  # one 0-1000 step is a few pixels of this screen
                    assert abs(x.point[0] - y.point[0]) <= hw[1] / 1000 + 1
                    assert abs(x.point[1] - y.point[1]) <= hw[0] / 1000 + 1
                assert (x.text, x.keys) == (y.text, y.keys)
