"""System prompts: UI-TARS-1.5's official computer-use prompt verbatim and filled as ByteDance fills it, the
7B recipes on it and the CPU recipes on the compact one, and an unknown `rollout.prompt` named at start."""
from __future__ import annotations

import numpy as np
import pytest

from guijax import launch, preflight
from guijax.rollout.prompt import (COMPACT_PROMPT, PROMPTS, UITARS_COMPUTER_USE, build_messages,
                                   plan_conditioned_instruction, prompt_template)
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
    ("bepa_tpu", "uitars_official"), ("grpo_cpu", "compact"), ("bepa_cpu", "compact")])
def test_recipes_prompt_their_policy_with_the_named_template(recipe, expected, tmp_path):
    config = launch.resolve(recipe, [])
    assert config.rollout.prompt == expected
    assert Run(config, tmp_path).system_prompt == PROMPTS[expected]
    assert PROMPTS["compact"] == COMPACT_PROMPT


def test_unknown_prompt_name_is_refused_naming_the_key(tmp_path):
    config = launch.resolve("grpo_cpu", ["rollout.prompt=uitars"])
    message = "rollout.prompt='uitars' is not one of uitars_official, compact"
    with pytest.raises(ValueError, match=message):
        Run(config, tmp_path).system_prompt
    assert message in preflight.problems(config)
