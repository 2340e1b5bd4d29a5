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
