"""Handoff rollouts on the real desk with scripted policies: guidance switched on mid-episode, continuations of
another policy's prefix branched from one prefix by snapshot or by replay, replay divergence named, and the
desk's snapshots continuing exactly."""
from __future__ import annotations

import types

import chex
import jax
import numpy as np
import pytest

from desk_policies import SCREEN, WAIT, NoSnapshotDeskFactory, plain_or_trained
from envs.actions import parse_uitars
from envs.api import Task
from envs.desk import DeskEnv
from envs.pool import DeskFactory, EnvPool
from envs.tasks import generate_desk_tasks
from guijax.rollout.engine import RolloutConfig, RolloutEngine
from guijax.rollout.handoff import HandoffRunner
from guijax.rollout.trajectory import Status
from rollout_fakes import PromptPolicySampler, TextProcessor

SKILL = "Continuation Plans:\n1. click the button"


@pytest.fixture(scope="module")
def tasks():
    return generate_desk_tasks(2, seed=3, families=["click_button"], screen_hw=SCREEN)


@pytest.fixture(scope="module")
def pool():
    with EnvPool(DeskFactory(SCREEN, step_limit=8, popups=False), 3, timeout_s=60) as p:
        yield p


def _engine(pool, tasks, **kw):
    processor = TextProcessor()
    sampler = PromptPolicySampler(processor, plain_or_trained(tasks, **kw))
    return RolloutEngine(pool, sampler, processor, RolloutConfig(show_progress=False)), sampler


def test_desk_snapshot_restores_the_exact_episode_pop_ups_included():
    (task,) = generate_desk_tasks(1, seed=1, families=["toggle_checkbox"], screen_hw=SCREEN)
    data = task.to_dict()
    data["config"][0]["parameters"] |= {"popup_prob": 0.0, "popup_step_prob": 0.2}  # pop-ups after the snapshot
    task = Task.from_dict(data)
    wait = parse_uitars("Action: wait()", image_hw=SCREEN, screen_hw=SCREEN)
    a, b = DeskEnv(SCREEN, step_limit=30), DeskEnv(SCREEN, step_limit=30)
    a.reset(task, episode_seed=11)
    a.step(wait)
    saved = a.snapshot()
    later = [a.step(wait).observation.screenshot for _ in range(12)]
    b.reset(generate_desk_tasks(1, seed=2, families=["click_button"], screen_hw=SCREEN)[0])
    restored = b.restore(saved)
    chex.assert_trees_all_equal(restored.screenshot, a.restore(saved).screenshot)
    again = [b.step(wait).observation.screenshot for _ in range(12)]
    chex.assert_trees_all_equal(later, again)
    assert any(not np.array_equal(later[0], x) for x in later)  # a pop-up drawn from the restored random stream
    assert b.steps == 13 and b.evaluate() == a.evaluate()


def test_guidance_starts_at_the_handoff_step_and_is_recorded(pool, tasks):
    engine, sampler = _engine(pool, tasks)
    ep = engine.episode(tasks[0], seed=5, guidance=SKILL, handoff=2)
    (traj,), _ = engine.run_episodes("plain", [ep], jax.random.PRNGKey(0))
    assert [s.response.split("Action: ")[1][:5] for s in traj.steps] == ["wait(", "wait(", "click", "finis"]
    assert traj.status == Status.DONE and traj.reward == 1.0 and traj.meta["handoff"] == 2 and traj.meta["guided"]
    assert ["Continuation Plans:" in p for p in sampler.prompts] == [False, False, True, True]
    assert "Skill" not in traj.instruction and traj.plan == ()  # training reads the plain instruction


@pytest.mark.parametrize("branching", ["snapshot", "replay"])
def test_every_depth_branches_from_one_prefix(pool, tasks, branching):
    engine, sampler = _engine(pool, tasks)
    runner = HandoffRunner(engine, branching)
    prefixes = runner.prefixes("plain", tasks, 3, jax.random.PRNGKey(1), seed=7)
    assert len(sampler.prompts) == 2 * 3  # each task's prefix sampled once, to the deepest depth
    assert [p.open_steps for p in prefixes] == [3, 3] and all(len(p.screens) == 4 for p in prefixes)
    trajs = runner.continue_from("trained", prefixes, [1, 2, 3, 4], jax.random.PRNGKey(2))
    assert [(t.task_id, t.meta["handoff"]) for t in trajs] == [(t.id, k) for t in tasks for k in (1, 2, 3)]
    for t in trajs:
        k = t.meta["handoff"]
        assert [s.response for s in t.steps[:k]] == [WAIT] * k  # the prefix, as the plain policy wrote it
        assert t.steps[k].response.startswith('Thought: I should click') and t.status == Status.DONE
        assert t.reward == 1.0 and "guided" not in t.meta


def test_snapshot_and_replay_give_the_same_continuations(pool, tasks):
    out = {}
    for branching in ("snapshot", "replay"):
        runner = HandoffRunner(_engine(pool, tasks)[0], branching)
        prefixes = runner.prefixes("plain", tasks, 2, jax.random.PRNGKey(1), seed=7)
        trajs = runner.continue_from("plain", prefixes, [1, 2], jax.random.PRNGKey(2),
                                     guidance={t.id: SKILL for t in tasks})
        out[branching] = [([s.response for s in t.steps], t.reward, t.meta["handoff"]) for t in trajs]
        for t in trajs:
            np.testing.assert_array_equal(t.steps[-1].screenshot.shape, SCREEN + (3,))
    assert out["snapshot"] == out["replay"] and all(r == 1.0 for _, r, _ in out["snapshot"])


def test_a_continuation_replays_from_its_recorded_seed_pop_ups_included(tasks):
    """Snapshot continuations carry the prefix's episode seed: a reset with it and the recorded actions give the
    screens the continuation saw (what the judge and the skill extractor replay), pop-ups and banners on."""
    from guijax.sgcd.desk_skills import step_verdicts

    with EnvPool(DeskFactory(SCREEN, step_limit=8, popups=True), 2, timeout_s=60) as busy:
        runner = HandoffRunner(_engine(busy, tasks)[0], "snapshot")
        prefixes = runner.prefixes("plain", tasks, 3, jax.random.PRNGKey(4), seed=21)
        trajs = runner.continue_from("trained", prefixes, [1, 2, 3], jax.random.PRNGKey(5), per_state=2)
    assert len(trajs) == 12 and all(t.meta["seed"] == p.seed for p in prefixes for t in trajs if t.task_id == p.task.id)
    for t in trajs:
        kinds = [v.kind for v in step_verdicts(next(x for x in tasks if x.id == t.task_id), t, SCREEN, popups=True)]
        assert "unreplayable" not in kinds and len(kinds) == len(t.steps)


def test_replay_names_the_step_where_the_screen_diverged(pool, tasks):
    runner = HandoffRunner(_engine(pool, tasks)[0], "replay")
    (prefix,) = runner.prefixes("plain", tasks[:1], 3, jax.random.PRNGKey(1), seed=7)
    prefix.screens[2] = prefix.screens[2].copy()
    prefix.screens[2][0, 0] = 255 - prefix.screens[2][0, 0]  # as if the desktop had drawn something else
    runner.replay_tolerance = 0.0
    trajs = runner.continue_from("trained", [prefix], [1, 2, 3], jax.random.PRNGKey(2))
    assert [t.status for t in trajs] == [Status.DONE, Status.ENV_ERROR, Status.ENV_ERROR]
    assert all("diverged" in t.error and "at step 2" in t.error for t in trajs[1:])


def test_a_prefix_that_ends_offers_only_the_depths_before_its_end(pool, tasks):
    def finishes_second(params, prompt):
        return WAIT if prompt.count("assistant:") == 0 else "Thought: done.\nAction: finished(content='x')"

    processor = TextProcessor()
    engine = RolloutEngine(pool, PromptPolicySampler(processor, finishes_second), processor,
                           RolloutConfig(show_progress=False))
    runner = HandoffRunner(engine, "snapshot")
    (prefix,) = runner.prefixes(None, tasks[:1], 4, jax.random.PRNGKey(1))
    assert prefix.open_steps == 1 and prefix.depths([1, 2, 3]) == [1] and len(prefix.steps) == 2


def _stops_first(answer: str):
    """WAIT at step 1; from step 2 on, `answer` the first time a prompt is asked and WAIT when it is asked again
    (a policy that stops after one step unless its stop is sampled again)."""
    asked: dict[str, int] = {}

    def respond(params, prompt):
        asked[prompt] = asked.get(prompt, 0) + 1
        return answer if prompt.count("assistant:") and asked[prompt] == 1 else WAIT
    return respond


@pytest.mark.parametrize("answer", ["Thought: done.\nAction: finished(content='x')",
                                    "Thought: I give up.\nAction: call_user()", "no action in this answer"])
def test_a_stopping_answer_sampled_again_lets_the_prefix_reach_every_depth(pool, tasks, answer):
    processor = TextProcessor()
    sampler = PromptPolicySampler(processor, _stops_first(answer))
    runner = HandoffRunner(RolloutEngine(pool, sampler, processor, RolloutConfig(show_progress=False)), "snapshot")
    (prefix,) = runner.prefixes(None, tasks[:1], 4, jax.random.PRNGKey(1), stop_retries=1)
    assert prefix.open_steps == 4 and prefix.resampled == 3 and prefix.error is None
    assert [s.response for s in prefix.steps] == [WAIT] * 4  # the dropped answers leave no step behind
    assert len(sampler.prompts) == 1 + 2 * 3
    # the stop was never stepped: the desk is still running at depth 4, and a continuation solves it there
    continuer = HandoffRunner(_engine(pool, tasks)[0], "snapshot")
    (t,) = continuer.continue_from("trained", [prefix], [4], jax.random.PRNGKey(2))
    assert t.meta["handoff"] == 4 and t.status == Status.DONE and t.reward == 1.0 and len(t.steps) == 6


def test_a_redrawn_answer_leaves_the_episode_as_if_it_had_never_been_sampled(pool, tasks):
    processor = TextProcessor()
    runner = HandoffRunner(RolloutEngine(pool, PromptPolicySampler(processor, _stops_first("not an action")),
                                         processor, RolloutConfig(show_progress=False)), "snapshot")
    (prefix,) = runner.prefixes(None, tasks[:1], 1, jax.random.PRNGKey(1))  # one step, to have a history
    e = runner.engine.episode(tasks[0], prefix.seed)
    live = runner.engine.start({0: e}, {"env_s": 0.0, "steps": 0})
    timings = {"env_s": 0.0, "sample_s": 0.0, "steps": 0, "sampled_tokens": 0}
    runner.engine.advance(None, live, jax.random.PRNGKey(2), timings)  # step 1: WAIT
    runner._advance(None, live, [prefix], jax.random.PRNGKey(3), timings, retries=1)  # step 2: redrawn once
    assert live == {0: e} and e.status == Status.STEP_LIMIT and e.error is None
    assert [s.response for s in e.steps] == [WAIT, WAIT] and len(e.versions) == len(e.turns) == 2
    assert timings["steps"] == 2 and prefix.resampled == 1


def test_a_policy_that_keeps_stopping_ends_its_prefix_after_the_retries(pool, tasks):
    def always_stops(params, prompt):
        return WAIT if prompt.count("assistant:") == 0 else "Thought: done.\nAction: finished(content='x')"

    processor = TextProcessor()
    sampler = PromptPolicySampler(processor, always_stops)
    runner = HandoffRunner(RolloutEngine(pool, sampler, processor, RolloutConfig(show_progress=False)), "snapshot")
    (prefix,) = runner.prefixes(None, tasks[:1], 4, jax.random.PRNGKey(1), stop_retries=2)
    assert prefix.open_steps == 1 and prefix.resampled == 2 and len(prefix.steps) == 2
    assert "finished" in prefix.steps[-1].response and len(sampler.prompts) == 1 + 3  # the last draw is taken
    with pytest.raises(ValueError, match="stop_retries must be >= 0"):
        runner.prefixes(None, tasks[:1], 4, jax.random.PRNGKey(1), stop_retries=-1)


def test_snapshot_branching_refuses_an_environment_without_snapshots(tasks):
    with EnvPool(NoSnapshotDeskFactory(SCREEN, popups=False), 1, timeout_s=60) as p:
        runner = HandoffRunner(_engine(p, tasks)[0], "snapshot")
        with pytest.raises(RuntimeError, match="cannot save its state.*use replay branching"):
            runner.prefixes("plain", tasks[:1], 2, jax.random.PRNGKey(1))


@pytest.mark.parametrize("branching", ["snapshot", "replay"])
def test_a_policy_in_another_grammar_continues_with_the_prefix_rewritten_into_its_own(pool, tasks, branching):
    """A baseline prompted with the thinking variant of SGCD's Fig. 9 continues the plain policy's UI-TARS
    prefix: its prompt shows the prefix's steps in its grammar (thought in [think], the wait as code), the
    replay reads the prefix in the grammar it was written in, and the trajectory keeps the steps as written."""
    from envs.actions.grammar import render_response
    from envs.actions.model import Action, ActionType
    from guijax.rollout.prompt import PROMPTS

    from desk_policies import button_center

    plain, _ = _engine(pool, tasks)
    prefixes = HandoffRunner(plain, branching).prefixes("plain", tasks, 2, jax.random.PRNGKey(1), seed=7)
    targets = {t.instruction: button_center(t, SCREEN) for t in tasks}

    def thinking(params, prompt):
        (x, y, name), = [v for k, v in targets.items() if k in prompt]
        if "pyautogui.click(" in prompt:
            return render_response("Done.", "Report success.", [Action(ActionType.FINISHED)],
                                   grammar="pyautogui_think", screen_hw=SCREEN)
        return render_response(f"The {name} button.", f"Click {name}.", [Action(ActionType.CLICK, point=(x, y))],
                               grammar="pyautogui_think", screen_hw=SCREEN)

    processor = TextProcessor()
    sampler = PromptPolicySampler(processor, thinking)
    other = RolloutEngine(pool, sampler, processor, RolloutConfig(
        system_prompt=PROMPTS["pyautogui_think"], grammar="pyautogui_think", show_progress=False))
    trajs = HandoffRunner(other, branching).continue_from("baseline", prefixes, [1, 2], jax.random.PRNGKey(2))
    assert [(t.meta["handoff"], t.reward) for t in trajs] == [(1, 1.0), (2, 1.0)] * 2
    for t in trajs:
        k = t.meta["handoff"]
        assert [s.response for s in t.steps[:k]] == [WAIT] * k and t.steps[k].response.startswith("[think]\n")
    first = sampler.prompts[0]  # depth 1: the plain policy's wait, shown as the baseline writes a step
    assert "[think]\nI wait for the screen.\n[/think]\n## Action: Wait.\n## Code:\n```python\ncomputer.wait()" in first
    assert "Action: wait()" not in first


class _Cooling(PromptPolicySampler):
    """A scripted sampler with a temperature: answers `script[k]` at its k-th call, recording temperatures."""

    def __init__(self, processor, script, temperature=1.0, calls=None):
        super().__init__(processor, lambda params, prompt: script[min(len(self.calls) - 1, len(script) - 1)])
        self.config = types.SimpleNamespace(temperature=temperature)
        self.calls = [] if calls is None else calls

    def generate(self, params, rng, rows, prompts):
        self.calls.append(self.config.temperature)
        return super().generate(params, rng, rows, prompts)

    def with_temperature(self, t):
        sibling = _Cooling.__new__(_Cooling)
        sibling.__dict__.update(self.__dict__)
        sibling.config = types.SimpleNamespace(temperature=t)
        return sibling


@pytest.mark.parametrize("retries, temperature", [(3, 1.0), (1, 1.0), (3, 0.0)])
def test_an_unparsable_answer_is_drawn_again_at_a_lower_temperature(pool, tasks, retries, temperature):
    """SGCD's evaluation protocol: an answer that does not parse is dropped and drawn again, colder; the last
    draw stands; a greedy sampler is not asked again."""
    from desk_policies import button_center

    x, y, name = button_center(tasks[0], SCREEN)
    script = ["no action here", "still none", f"Thought: {name}.\nAction: click(start_box='({x},{y})')",
              "Thought: done.\nAction: finished(content='ok')"]
    processor = TextProcessor()
    sampler = _Cooling(processor, script, temperature)
    engine = RolloutEngine(pool, sampler, processor, RolloutConfig(show_progress=False, parse_retries=retries,
                                                                   retry_temperature_decay=0.5))
    (traj,), timings = engine.run("p", tasks[:1], 1, jax.random.PRNGKey(0))
    if retries == 3 and temperature:
        assert sampler.calls == [1.0, 0.5, 0.5, 1.0] and traj.reward == 1.0 and traj.status == Status.DONE
        assert [s.response for s in traj.steps] == script[2:] and traj.meta["parse_redraws"] == 2
        assert timings["parse_redraws"] == 2
    elif retries == 1:  # the second draw does not parse either: it stands
        assert sampler.calls == [1.0, 0.5] and traj.status == Status.PARSE_ERROR
        assert [s.response for s in traj.steps] == ["still none"] and traj.meta["parse_redraws"] == 1
    else:
        assert sampler.calls == [0.0] and traj.status == Status.PARSE_ERROR and "parse_redraws" not in traj.meta


def test_evaluations_take_the_parse_retries_and_rl_rollouts_do_not(tiny_config, tmp_path):
    from guijax import trainer as trainer_lib
    from guijax.pipeline.run import Run

    config = tiny_config("grpo_cpu", "eval.parse_retries=10", "eval.parse_retry_decay=0.7")
    run = Run(config, tmp_path)
    assert trainer_lib.rollout_config(config, run.system_prompt).parse_retries == 0
    import guijax.rollout.backend as backend
    import guijax.trainer

    policy = types.SimpleNamespace(module=None, processor=types.SimpleNamespace(tokenizer=None), path=None)
    patches = pytest.MonkeyPatch()
    patches.setattr(backend, "make_sampler", lambda *a, **k: object())
    patches.setattr(guijax.trainer, "sampling_config", lambda *a, **k: None)
    try:
        with run.evaluation_engine(policy, 0.6) as engine:
            assert (engine.config.parse_retries, engine.config.retry_temperature_decay) == (10, 0.7)
    finally:
        patches.undo()
        run.close()
