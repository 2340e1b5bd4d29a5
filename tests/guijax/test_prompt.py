"""System prompts: UI-TARS-1.5's official computer-use prompt verbatim and filled as ByteDance fills it, the
7B recipes on it and the CPU recipes on the compact one, and an unknown `rollout.prompt` named at start.
build_messages: the plan-conditioned instruction and the history cut to max_images screenshots (the current
one included), older turns kept as text only."""
from __future__ import annotations

import numpy as np
import pytest

from guijax import launch, preflight
from guijax.rollout.prompt import (COMPACT_PROMPT, PROMPTS, SYSTEM_PROMPT, UITARS_COMPUTER_USE, Turn,
                                   build_messages, plan_conditioned_instruction, prompt_template)
from guijax.pipeline.run import Run

SHOT = np.zeros((28, 28, 3), np.uint8)


def test_official_prompt_is_ui_tars_computer_use_character_for_character():
    reference = pytest.importorskip("ui_tars.prompt")
    assert UITARS_COMPUTER_USE == reference.COMPUTER_USE_DOUBAO


@pytest.mark.parametrize("plan", [(), ("open the menu", "click {Save}")])
def test_official_prompt_is_filled_as_ui_tars_fills_it(plan):
    """ByteDance's examples and OSWorld's UI-TARS-1.5 agent send COMPUTER_USE_DOUBAO.format(language="English",
    instruction=...) as the first user turn; braces in an instruction or plan stay text."""
    reference = pytest.importorskip("ui_tars.prompt")
    instruction = "Rename {draft}.txt to final.txt"
    messages, _ = build_messages(instruction, [], SHOT, plan=plan, system_prompt=prompt_template("uitars_official"))
    full = plan_conditioned_instruction(instruction, plan)
    assert messages[0]["content"][0]["text"] == reference.COMPUTER_USE_DOUBAO.format(language="English",
                                                                                    instruction=full)


@pytest.mark.parametrize("recipe,expected", [
    ("grpo_gpu", "uitars_official"), ("grpo_tpu", "uitars_official"), ("bepa_gpu", "uitars_official"),
    ("bepa_tpu", "uitars_official"), ("grpo_cpu", "compact"), ("bepa_cpu", "compact"), ("seagent_gpu", "uitars_v1"),
    ("seagent_tpu", "uitars_official")])
def test_recipes_prompt_their_policy_with_the_named_template(recipe, expected, tmp_path):
    config = launch.resolve(recipe, [])
    assert config.rollout.prompt == expected
    assert Run(config, tmp_path).system_prompt == PROMPTS[expected]
    assert PROMPTS["compact"] == COMPACT_PROMPT


def test_unknown_prompt_name_is_refused_naming_the_key(tmp_path):
    config = launch.resolve("grpo_cpu", ["rollout.prompt=uitars"])
    message = ("rollout.prompt='uitars' is not one of uitars_official, uitars_v1, compact, computer_use, "
               "computer_use_compact, pyautogui, pyautogui_think")
    with pytest.raises(ValueError, match=message):
        Run(config, tmp_path).system_prompt
    assert message in preflight.problems(config)


SHOTS = [np.full((28, 28, 3), i, np.uint8) for i in range(6)]  # five history screenshots and the current one
HISTORY = [Turn(SHOTS[i], f"Thought: t{i}\nAction: wait()") for i in range(5)]


def layout(messages):
    """(role, kind) of every content item in order, with the text for text items."""
    return [(m["role"], c["type"] if c["type"] != "text" else c["text"]) for m in messages for c in m["content"]]


@pytest.mark.parametrize("max_images, imaged", [
    (1, []),  # the current screenshot only
    (2, [4]),
    (3, [3, 4]),
    (5, [1, 2, 3, 4]),
    (6, [0, 1, 2, 3, 4]),  # the full history (ARPO)
    (10, [0, 1, 2, 3, 4]),
])
def test_history_keeps_the_last_max_images_screenshots(max_images, imaged):
    messages, images = build_messages("Open the menu.", HISTORY, SHOTS[5], max_images=max_images,
                                      system_prompt="Task: {instruction}")
    assert len(images) == len(imaged) + 1
    assert all(got is want for got, want in zip(images, [SHOTS[i] for i in imaged] + [SHOTS[5]]))
    expected = [("user", "Task: Open the menu.")]
    for i, turn in enumerate(HISTORY):
        expected += [("user", "image")] * (i in imaged) + [("assistant", turn.response)]
    assert layout(messages) == expected + [("user", "image")]


def test_no_history_and_the_default_system_prompt():
    messages, images = build_messages("Open the menu.", [], SHOTS[0])
    assert len(images) == 1 and images[0] is SHOTS[0]
    assert layout(messages) == [("user", SYSTEM_PROMPT.format(instruction="Open the menu.")), ("user", "image")]
    assert messages[0]["content"][0]["text"].endswith("## User Instruction\nOpen the menu.\n")


def test_plan_is_appended_as_a_numbered_list():
    messages, _ = build_messages("Open the menu.  ", [], SHOTS[0], plan=("click File", "click Open"),
                                 system_prompt="Task: {instruction}")
    assert messages[0]["content"][0]["text"] == "Task: Open the menu.\n\n1. click File\n2. click Open"
    assert plan_conditioned_instruction("Open the menu.  ", ()) == "Open the menu.  "


def test_max_images_below_one_is_refused():
    with pytest.raises(ValueError, match="max_images must be >= 1, got 0"):
        build_messages("x", HISTORY, SHOTS[5], max_images=0)


@pytest.mark.parametrize("prompt, coordinates, grammar", [("uitars_official", "uitars-1.0", "uitars"),
                                                          ("pyautogui", "uitars-1.5", "pyautogui"),
                                                          ("pyautogui_think", "uitars-1.5", "pyautogui_think")])
def test_the_rollout_engine_reads_the_prompts_grammar_and_coordinates(prompt, coordinates, grammar):
    from guijax.trainer import rollout_config

    config = launch.resolve("grpo_cpu", [f"rollout.prompt={prompt}", f"rollout.coordinate_model={coordinates}"])
    engine = rollout_config(config, PROMPTS[prompt])
    assert (engine.grammar, engine.coordinate_model, engine.system_prompt) == (grammar, coordinates, PROMPTS[prompt])


def test_ui_tars_1_prompt_lists_its_actions_and_its_answers_parse_in_0_1000_coordinates():
    """UI-TARS 1.0's prompt: its box form and call_user(); an answer in that form lands where 0-1000 says."""
    from envs.actions.model import ActionType
    from envs.actions.grammar import parse_response

    prompt = PROMPTS["uitars_v1"]
    assert prompt.count("{instruction}") == 1 and "call_user() # Submit the task" in prompt
    assert "click(start_box='<|box_start|>(x1,y1)<|box_end|>')" in prompt and "<point>" not in prompt
    assert "- Use English in `Thought` part." in prompt and 'use "\\n" at the end' in prompt
    (click,) = parse_response("Thought: open it.\nAction: click(start_box='<|box_start|>(500,250)<|box_end|>')",
                              grammar="uitars", screen_hw=(1080, 1920), coordinate_model="uitars-1.0")
    assert click.kind == ActionType.CLICK and click.point == (960, 270)
    (call,) = parse_response("Thought: I cannot do this.\nAction: call_user()", grammar="uitars",
                             screen_hw=(1080, 1920), coordinate_model="uitars-1.0")
    assert call.kind == ActionType.CALL_USER
