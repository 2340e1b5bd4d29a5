"""EvoCUA's accelerator recipes resolve, pass the recipe check, and dry-run to the paper's policies' sizes,
prompting in the computer_use grammar."""
from __future__ import annotations

import pytest

from guijax import launch
from guijax.pipeline.registry import check_recipe


@pytest.mark.parametrize("recipe, params, mesh, trained", [
    # Qwen3-VL-8B on one 8-GPU node and 32B on v5p-128, both with the tower frozen
    ("evocua_gpu", 8_767_123_696, {"data": 1, "fsdp": 8, "tensor": 1, "expert": 1}, 8_767_123_696 - 576_388_336),
    ("evocua_tpu", 33_357_390_064, {"data": 4, "fsdp": 16, "tensor": 1, "expert": 1}, 33_357_390_064 - 595_266_800),
])
def test_accelerator_recipes_dry_run(recipe, params, mesh, trained):
    config = launch.resolve(recipe, [])
    check_recipe(config)
    report = launch.dry_run(config)
    assert report["params"] == params and report["mesh"] == mesh and report["trained_params"] == trained
    assert config.rollout.prompt == "computer_use" and set(config.eval.step_limits) == {15, 50}


def test_the_cpu_recipe_runs_every_evocua_stage_in_order():
    config = launch.resolve("evocua_cpu", [])
    check_recipe(config)
    stages = list(config.stages)
    assert stages.index("synthesis") < stages.index("coldstart") < stages.index("sft") < stages.index("methods")
    assert config.sft.data == "coldstart" and config.evocua.synthesized and "evocua_cycle" in config.compare.methods
    with pytest.raises(ValueError, match=r"'evocua_cycle' \(compare.methods\) reads the output of stage\(s\) \['synthesis'\]"):
        check_recipe(launch.resolve("evocua_cpu", ["stages=('base_model', 'tasks', 'coldstart', 'sft', 'methods')",
                                                   "compare.methods=('evocua_cycle',)"]))
    with pytest.raises(ValueError, match="sft.data='coldstart' trains on the coldstart stage's traces"):
        check_recipe(launch.resolve("evocua_cpu", ["stages=('base_model', 'tasks', 'sft', 'report')"]))


def test_the_desktop_recipe_trains_on_recorded_traces_and_evaluates_on_desktop_servers():
    from guijax.models.processor import smart_resize

    config = launch.resolve("evocua_desktop_cpu", [])
    check_recipe(config)
    assert config.env.kind == "osworld" and config.sft.data == "coldstart" and config.rollout.prompt == "computer_use_compact"
    assert list(config.stages).index("coldstart") < list(config.stages).index("sft") < list(config.stages).index("eval_base")
    h, w = smart_resize(720, 1280, 28, max_pixels=config.model.image_max_pixels)
    assert (h // 28) * (w // 28) == 144  # image tokens per 1280x720 screenshot, after the 2x2 merge
    report = launch.dry_run(config)
    assert report["model"] == "small" and report["trained_params"] == report["params"]
