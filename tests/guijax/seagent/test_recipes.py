"""seagent_cpu resolves and passes the recipe check; the accelerator recipes dry-run to the paper's policies'
sizes; the desk-only parts are refused elsewhere, naming the key."""
from __future__ import annotations

import pytest

from guijax import launch
from guijax.methods import get_method
from guijax.pipeline.registry import check_recipe


def test_the_cpu_recipe_checks_and_trains_seagent_from_the_sft_policy():
    config = launch.resolve("seagent_cpu", [])
    check_recipe(config)
    method = get_method("seagent", config)
    assert method.options.curriculum == "desk" and method.options.judge == "oracle" and not method.rl
    assert config.train.normalization == "sequence"
    assert "sft" in config.stages and config.stages.index("sft") < config.stages.index("methods")


@pytest.mark.parametrize("recipe, params, mesh, coordinates", [
    ("seagent_gpu", 8_291_375_616, {"data": 2, "fsdp": 4, "tensor": 1, "expert": 1}, "uitars-1.0"),  # UI-TARS-7B-DPO
    ("seagent_tpu", 8_292_166_656, {"data": 4, "fsdp": 16, "tensor": 1, "expert": 1}, "uitars-1.5"),  # Qwen2.5-VL-7B
])
def test_accelerator_recipes_dry_run(recipe, params, mesh, coordinates):
    config = launch.resolve(recipe, [])
    check_recipe(config)
    report = launch.dry_run(config)
    assert report["params"] == params and report["mesh"] == mesh
    method = get_method("seagent", config)
    assert (method.options.judge, method.options.curriculum, method.options.phases) == ("chat", "chat", 3)
    assert (method.options.tasks_per_phase, method.options.curriculum_descriptions) == (100, 100)  # Table 7
    assert config.rollout.coordinate_model == coordinates and method.options.gamma == 0.2


def test_desk_only_parts_and_a_missing_chat_endpoint_are_named():
    with pytest.raises(ValueError, match="seagent.judge='oracle' reads the synthetic desk"):
        get_method("seagent", launch.resolve("grpo_gpu", ["method=seagent", "seagent.curriculum=none"]))
    with pytest.raises(ValueError, match="seagent.curriculum='desk' generates synthetic desk tasks"):
        get_method("seagent", launch.resolve("grpo_gpu", ["method=seagent", "seagent.judge=chat",
                                                           "seagent.curriculum=desk", "seagent.chat_url=http://x/v1",
                                                           "seagent.chat_model=m"]))
    with pytest.raises(ValueError, match="set seagent.chat_url and seagent.chat_model"):
        get_method("seagent", launch.resolve("seagent_cpu", ["seagent.judge=chat"]))
    with pytest.raises(ValueError, match=r"curriculum_families names \['paint'\]"):
        get_method("seagent", launch.resolve("seagent_cpu", ["seagent.curriculum_families=('paint',)"]))
    chat = ["seagent.curriculum=chat", "seagent.curriculum_url=http://x/v1", "seagent.curriculum_model=m"]
    with pytest.raises(ValueError, match="set seagent.curriculum_url and seagent.curriculum_model"):
        get_method("seagent", launch.resolve("seagent_cpu", ["seagent.curriculum=chat"]))
    with pytest.raises(ValueError, match="the oracle judge cannot judge: set seagent.judge='chat'"):
        get_method("seagent", launch.resolve("seagent_cpu", chat))
    # off the desk the chat curriculum runs from the training tasks' setups, captioned by the chat judge
    off_desk = get_method("seagent", launch.resolve("grpo_gpu", ["method=seagent", "seagent.judge=chat",
                                                                 "seagent.chat_url=http://x/v1",
                                                                 "seagent.chat_model=m", *chat]))
    assert off_desk.options.curriculum == "chat" and off_desk.config.env.kind == "osworld"


@pytest.mark.parametrize("prompt, grammar", [("compact", "uitars"), ("computer_use", "computer_use")])
def test_the_desk_oracle_reads_the_runs_grammar_and_coordinates(prompt, grammar):
    judge = get_method("seagent", launch.resolve("seagent_cpu", [f"rollout.prompt={prompt}",
                                                                 "rollout.coordinate_model=uitars-1.0"])).judge()
    assert (judge.grammar, judge.coordinate_model) == (grammar, "uitars-1.0")
