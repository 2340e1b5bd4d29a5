"""One SGCD round's Stages I-III (`SGCD.collect`) on the real desk with scripted policies: a plain policy that
only waits and solves when a skill is in its context, so every failed task is recoverable and every depth's
continuation should be kept; then what the judge removes, the control's shortcut, and Stage IV's supervision."""
from __future__ import annotations

import pytest

from desk_policies import SCREEN, WAIT, plain_or_trained
from envs.pool import DeskFactory, EnvPool
from envs.tasks import generate_desk_tasks
from guijax.methods import get_method
from guijax.methods.sgcd import supervised_steps
from guijax.rng import Streams
from guijax.rollout.engine import RolloutConfig, RolloutEngine
from rollout_fakes import PromptPolicySampler, TextProcessor

SETTINGS = ("env.popups=False", "env.step_limit=8", "sgcd.max_handoff=3", "sgcd.rollouts_per_task=2")


@pytest.fixture(scope="module")
def tasks():
    return generate_desk_tasks(2, seed=9, families=["click_button"], screen_hw=SCREEN)


@pytest.fixture(scope="module")
def pool():
    with EnvPool(DeskFactory(SCREEN, step_limit=8, popups=False), 4, timeout_s=60) as p:
        yield p


def _collect(tiny_config, pool, tasks, params="plain", method="sgcd", *overrides, **policy):
    processor = TextProcessor()
    sampler = PromptPolicySampler(processor, plain_or_trained(tasks, **policy))
    engine = RolloutEngine(pool, sampler, processor, RolloutConfig(show_progress=False))
    sgcd = get_method(method, tiny_config("grpo_cpu", *SETTINGS, *overrides))
    return sgcd.collect(engine, params, tasks, Streams(0), "test"), sampler


@pytest.mark.parametrize("branching", ["snapshot", "live"])
def test_failed_tasks_get_skills_and_every_depth_a_kept_continuation(tiny_config, pool, tasks, branching):
    got, sampler = _collect(tiny_config, pool, tasks, "plain", "sgcd", f"sgcd.branching={branching}")
    ids = sorted(t.id for t in tasks)
    assert got.rates == {t: 0.0 for t in ids} and got.d_plus == [] and sorted(got.failed) == ids
    assert sorted(got.skills) == ids and got.recoverable == ids and not got.skipped
    assert got.per_depth == {k: {"tried": 2, "verified": 2, "kept": 2} for k in (1, 2, 3)}
    assert sorted((t.task_id, t.meta["handoff"]) for t in got.d_cont) == [(i, k) for i in ids for k in (1, 2, 3)]
    for t in got.d_cont:
        assert [s.response for s in t.steps[:t.meta["handoff"]]] == [WAIT] * t.meta["handoff"]
    # the skill (with the desk's success criteria) reached the guided prompts, and only those
    guided = [p for p in sampler.prompts if "Continuation Plans:" in p]
    assert guided and all("Success Criteria:" in p for p in guided)
    report = got.report()
    assert report["d_cont"] == 6 and report["handoffs_verified"] == 6 and report["plain_success_rate"] == 0.0


def test_stage_iv_supervises_continuations_from_the_handoff_on(tiny_config, pool, tasks):
    got, _ = _collect(tiny_config, pool, tasks)
    refs = supervised_steps(got.d_cont)
    for i, t in enumerate(got.d_cont):
        assert sorted(r.step for r in refs if r.trajectory == i) == list(range(t.meta["handoff"], len(t.steps)))
    assert len(supervised_steps(got.d_cont, k_start=False)) == sum(len(t.steps) for t in got.d_cont)


def test_the_judge_removes_looping_continuations_and_says_why(tiny_config, pool, tasks):
    got, _ = _collect(tiny_config, pool, tasks, "plain", "sgcd", repeat_click=3)  # clicks 3 times, then done
    assert got.recoverable and got.handoffs_tried == 6 and got.d_cont == []
    assert got.rejections == {"redundant loop": 6}
    kept, _ = _collect(tiny_config, pool, tasks, "plain", "sgcd", "sgcd.judge=none", repeat_click=3)
    assert len(kept.d_cont) == 6


def test_solved_tasks_are_d_plus_and_the_control_builds_no_continuations(tiny_config, pool, tasks):
    solved, _ = _collect(tiny_config, pool, tasks, "trained")
    assert len(solved.d_plus) == 4 and solved.failed == [] and solved.d_cont == []
    control, sampler = _collect(tiny_config, pool, tasks, "plain", "sgcd_no_continuations")
    assert sorted(control.failed) == sorted(t.id for t in tasks) and control.skills == {} and control.d_cont == []
    assert not any("Continuation Plans:" in p for p in sampler.prompts)


def test_recipe_errors_name_the_key(tiny_config):
    with pytest.raises(ValueError, match="sgcd.chat_url and sgcd.chat_model"):
        get_method("sgcd", tiny_config("grpo_cpu", "sgcd.judge=chat"))
    with pytest.raises(ValueError, match="sgcd.skill_fields names \\['Plans'\\]"):
        get_method("sgcd", tiny_config("grpo_cpu", "sgcd.skill_fields=('Plans',)"))
    with pytest.raises(ValueError, match="sgcd.prefix_stop_retries samples a prefix's stop again.*'live'"):
        get_method("sgcd", tiny_config("grpo_cpu", "sgcd.branching=live", "sgcd.prefix_stop_retries=2"))


def test_prefix_stop_retries_give_handoffs_past_a_policy_that_stops_after_one_step(tiny_config, pool, tasks):
    """A plain policy that waits once, then stops on every odd asking of a prompt: without retries its prefixes
    end after one step (only k = 1 is handed off); with one retry each stop is sampled again and every depth is."""
    def collect(retries):
        solve, asked = plain_or_trained(tasks), {}

        def respond(params, prompt):
            asked[prompt] = asked.get(prompt, 0) + 1
            if "Continuation Plans:" not in prompt and prompt.count("assistant:") and asked[prompt] % 2:
                return "Thought: done.\nAction: finished(content='x')"
            return solve(params, prompt)
        processor = TextProcessor()
        engine = RolloutEngine(pool, PromptPolicySampler(processor, respond), processor,
                               RolloutConfig(show_progress=False))
        sgcd = get_method("sgcd", tiny_config("grpo_cpu", *SETTINGS, f"sgcd.prefix_stop_retries={retries}"))
        return sgcd.collect(engine, "plain", tasks, Streams(0), "test").report()

    ended, deep = collect(0), collect(1)
    assert ended["recoverable_tasks"] == deep["recoverable_tasks"] == 2
    assert sorted(ended["per_depth"]) == [1] and ended["prefix_resamples"] == 0
    assert set(ended["prefix_steps"].values()) == {1}
    # one stop per prefix sampled again: at step 2 (Stage I already asked the step-3 prompt once, so the prefix's
    # asking of it is even and waits)
    assert sorted(deep["per_depth"]) == [1, 2, 3] and deep["prefix_resamples"] == 2
    assert set(deep["prefix_steps"].values()) == {3} and deep["d_cont"] == 6
