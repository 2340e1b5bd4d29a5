"""SGCD's accelerator recipes resolve, pass the recipe check, and dry-run to the paper's policies' sizes with
its vision tower frozen."""
from __future__ import annotations

import pytest

from guijax import launch
from guijax.pipeline.registry import check_recipe


@pytest.mark.parametrize("recipe, params, mesh", [
    ("sgcd_gpu", 8_767_123_696, {"data": 1, "fsdp": 8, "tensor": 1, "expert": 1}),  # Qwen3-VL-8B, one 8-GPU node
    ("sgcd_tpu", 31_070_754_032, {"data": 4, "fsdp": 2, "tensor": 1, "expert": 8}),  # Qwen3-VL-30B-A3B, v5p-128
])
def test_accelerator_recipes_dry_run(recipe, params, mesh):
    config = launch.resolve(recipe, [])
    check_recipe(config)
    report = launch.dry_run(config)
    assert report["params"] == params and report["mesh"] == mesh
    assert config.sgcd.skill_extractor == config.sgcd.judge == "chat" and config.sgcd.branching == "live"
    # Fig. 9's grammar; the ViT and aligner frozen (Table 8): no moments for them
    assert config.rollout.prompt == "pyautogui" and config.model.frozen == ("visual",)
    assert config.eval.parse_retries == 10  # Appendix I's retries of an unparsable answer
    assert report["trained_params"] == params - report["vision_params"] > 0.9 * params


def test_the_desk_only_parts_are_refused_on_osworld_naming_the_key():
    with pytest.raises(ValueError, match="sgcd.skill_extractor='desk'.*use sgcd.skill_extractor='chat'"):
        check_recipe(launch.resolve("sgcd_gpu", ["sgcd.skill_extractor=desk"]))
    with pytest.raises(ValueError, match="sgcd.branching='snapshot' needs environments that save"):
        check_recipe(launch.resolve("sgcd_gpu", ["sgcd.branching=snapshot"]))


def test_a_changed_measurement_reruns_the_csr_stage_but_retrains_nothing():
    from guijax.pipeline.registry import fingerprints

    base = fingerprints(launch.resolve("sgcd_cpu", []))
    trained = fingerprints(launch.resolve("sgcd_cpu", ["sgcd.sft_steps=2"]))
    for measurement in ("sgcd.csr_per_state=2", "sgcd.csr_prefix_stop_retries=2"):
        measured = fingerprints(launch.resolve("sgcd_cpu", [measurement]))
        assert measured["methods/sgcd"] == base["methods/sgcd"] and measured["csr"] != base["csr"], measurement
    assert trained["methods/sgcd"] != base["methods/sgcd"] and trained["csr"] != base["csr"]
    deeper = fingerprints(launch.resolve("sgcd_cpu", ["sgcd.prefix_stop_retries=2"]))  # Stage III's prefixes
    assert deeper["methods/sgcd"] != base["methods/sgcd"]


@pytest.mark.parametrize("prompt, grammar", [("compact", "uitars"), ("computer_use", "computer_use"),
                                            ("pyautogui", "pyautogui"), ("pyautogui_think", "pyautogui_think")])
def test_the_offline_extractor_and_rule_judge_read_the_runs_grammar_and_coordinates(prompt, grammar):
    from guijax.methods import get_method

    method = get_method("sgcd", launch.resolve("sgcd_cpu", [f"rollout.prompt={prompt}",
                                                            "rollout.coordinate_model=uitars-1.0"]))
    assert method.extractor().grammar == method.judge().grammar == grammar
    assert method.extractor().coordinate_model == method.judge().coordinate_model == "uitars-1.0"
