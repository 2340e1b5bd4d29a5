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


@pytest.mark.parametrize("grammar, model", [("computer_use", "uitars-1.5"), ("pyautogui", "uitars-1.5"),
                                          ("pyautogui_think", "uitars-1.5"), ("uitars", "uitars-1.0")])
def test_traces_are_written_in_the_policys_grammar_with_the_same_actions(grammar, model):
    """Conversions in computer_use (reasoning, semantic action, tool call), in pyautogui code (both in 0-1000
    coordinates) and in UI-TARS 1.0's 0-1000 coordinates parse back, in their grammar, to the actions the
    UI-TARS-1.5 conversion gives, up to the relative grid's rounding, with the same thought."""
    from envs.actions.grammar import parse_response, reasoning

    for trace in _traces():
        uitars, other = convert_trace(trace), convert_trace(trace, model, grammar=grammar)
        for a, b in zip(uitars.steps, other.steps, strict=True):
            hw = a.screenshot.shape[:2]
            assert reasoning(b.response, grammar) == parse_thought(a.response)
            assert b.response != a.response or not any(x.point for x in parse_response(
                a.response, grammar="uitars", screen_hw=hw))  # a step without coordinates reads the same in 1.0
            want = parse_response(a.response, grammar="uitars", screen_hw=hw)
            got = parse_response(b.response, grammar=grammar, screen_hw=hw, coordinate_model=model)
            assert [x.kind for x in got] == [x.kind for x in want]
            for x, y in zip(got, want):
                if y.point is not None:  # one 0-1000 step is a few pixels of this screen
                    assert abs(x.point[0] - y.point[0]) <= hw[1] / 1000 + 1
                    assert abs(x.point[1] - y.point[1]) <= hw[0] / 1000 + 1
                assert (x.text, x.keys) == (y.text, y.keys)
