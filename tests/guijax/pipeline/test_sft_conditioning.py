"""The warm start's conditioned copies: BEPA's plan in `plan`, or SGCD's skill as guidance after the instruction;
families listed as conditioned-only never appear bare."""
from __future__ import annotations

import pytest

from guijax.pipeline import base_stages
from guijax.pipeline.run import Run

FAMILIES = ("env.families=('click_button', 'choose_option')", "sft.plan_only_families=('choose_option',)",
            "env.num_tasks=6", "env.popups=False")


@pytest.mark.parametrize("conditioning", ["plan", "skill"])
def test_conditioned_copies_carry_the_plan_or_the_skill(tiny_config, tmp_path, conditioning):
    config = tiny_config("grpo_cpu", *FAMILIES, "sft.plan_fraction=1.0", f"sft.conditioning={conditioning}")
    run = Run(config, tmp_path)
    base_stages.tasks.fn(run)
    data = base_stages.sft_trajectories(run)
    bare = [t for t in data if not t.plan and "guidance" not in t.meta]
    conditioned = [t for t in data if t.plan or "guidance" in t.meta]
    assert bare and not any("choose_option" in t.task_id for t in bare)  # conditioned-only family
    assert len(conditioned) == len(data) - len(bare) > len(bare)  # every trace repeated at fraction 1
    for t in conditioned:
        if conditioning == "plan":
            assert t.plan and "guidance" not in t.meta
        else:
            assert not t.plan and t.meta["guidance"].startswith("Continuation Plans:\n1. ")
            assert "Success Criteria:" in t.meta["guidance"] and "Failure Traps" not in t.meta["guidance"]
    run.close()
