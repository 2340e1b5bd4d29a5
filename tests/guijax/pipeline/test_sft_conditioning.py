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


def test_masked_noise_keeps_the_wrong_actions_as_history_but_out_of_the_loss(tiny_config, tmp_path, monkeypatch):
    config = tiny_config("grpo_cpu", *FAMILIES, "sft.expert_noise=0.3", "sft.traces_per_task=3", "env.step_limit=12",
                         "sft.noisy_steps=mask", "sft.steps=1")
    run = Run(config, tmp_path)
    base_stages.tasks.fn(run)
    data = base_stages.sft_trajectories(run)
    injected = {(i, j) for i, t in enumerate(data) for j in t.meta.get("injected_steps", ())}
    assert injected, "no trace kept a noisy step: raise the noise"
    refs = base_stages.clean_step_refs(data)
    chosen = {(r.trajectory, r.step) for r in refs}
    assert chosen.isdisjoint(injected) and len(chosen) == sum(len(t.steps) for t in data) - len(injected)
    later = [(i, j + 1) for i, j in injected if j + 1 < len(data[i].steps)]
    assert later and set(later) - injected <= chosen  # the step after a mistake (its recovery) trains

    seen = {}  # the sft stage hands exactly those steps to the trainer

    def fake_sft_steps(policy, trajectories, *args, refs=None, **kwargs):
        seen["refs"] = refs
        return policy.params, [1.0, 0.5]

    monkeypatch.setattr("guijax.sft.sft_steps", fake_sft_steps)
    base_stages.base_model.fn(run)
    summary = base_stages.sft.fn(run)
    assert {(r.trajectory, r.step) for r in seen["refs"]} == chosen
    assert f"({len(injected)} injected noise steps without loss)" in summary
    run.close()
