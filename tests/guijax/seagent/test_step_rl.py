"""SEAgent's state-level sampling, Eq. 3/4 scoring and training rows, on episodes rolled out on the real desk
by scripted policies (the sampler answers from a script, so every reward is known)."""
from __future__ import annotations

import itertools

import jax
import numpy as np
import pytest

from desk_policies import DONE, SCREEN, WAIT, StepsIn, buttons, click, click_task, scripted_episodes
from envs.actions.grammar import GRAMMARS
from envs.pool import DeskFactory, EnvPool
from guijax.rollout.engine import RolloutConfig, RolloutEngine
from guijax.rollout.trajectory import Source, Step
from guijax.seagent import step_rl
from guijax.seagent.world_state import DeskOracleJudge, Label, step_labels
from rollout_fakes import PromptPolicySampler, TextProcessor


@pytest.fixture(scope="module")
def task():
    return click_task()


@pytest.fixture(scope="module")
def judged(task):
    """A clean episode and a failed one (a wrong click at step 2), judged by the desk oracle."""
    target = task.instruction.split('"')[1]
    wrong = next(b for b in buttons(task) if b != target)
    with scripted_episodes(task) as run:
        clean, failed = run([click(task, target), DONE]), run([WAIT, click(task, wrong), DONE])
    judge = DeskOracleJudge(SCREEN)
    labels = [step_labels(judge.judge(task, t), len(t.steps)) for t in (clean, failed)]
    return [clean, failed], labels, target, wrong


def test_labelled_states_in_rollout_order(judged):
    _, labels, _, _ = judged
    assert labels == [[Label.CORRECT, Label.CORRECT], [Label.CORRECT, Label.FAILURE, None]]
    positives, failures = step_rl.labelled_states(labels)
    assert positives == [step_rl.State(0, 0), step_rl.State(0, 1), step_rl.State(1, 0)]
    assert failures == [step_rl.State(1, 1)]


def test_samples_at_a_state_see_the_rollouts_prompt_and_score_by_eq4(task, judged):
    trajectories, labels, target, wrong = judged
    positives, failures = step_rl.labelled_states(labels)
    answers = itertools.cycle([click(task, target), click(task, wrong), WAIT, "no action here"])
    processor = TextProcessor()
    sampler = PromptPolicySampler(processor, lambda params, prompt: next(answers))
    with EnvPool(DeskFactory(SCREEN, step_limit=6, popups=False), 1, timeout_s=60) as pool:
        engine = RolloutEngine(pool, sampler, processor, RolloutConfig(show_progress=False))
        samples = step_rl.sample_at_states(engine, None, trajectories, positives[:2], 4, jax.random.PRNGKey(0),
                                           max_rows=3)
        # the prompt at step 2 of the clean episode holds its first response, as the rollout's prompt did
        replayed = PromptPolicySampler(processor, lambda params, prompt: trajectories[0].steps[
            prompt.count("assistant:")].response)
        RolloutEngine(pool, replayed, processor, RolloutConfig(show_progress=False)).run(
            None, [task], 1, jax.random.PRNGKey(0), seed=3)
    assert [len(g) for g in samples] == [4, 4]
    assert sampler.prompts[4:8] == [replayed.prompts[1]] * 4 and sampler.prompts[:4] == [replayed.prompts[0]] * 4
    assert samples[0][0].response == click(task, target) and len(samples[0][0].behaviour_logprobs) == 1
    rewards = step_rl.sample_rewards(trajectories, positives[:2], samples)
    # state 1's a_T is the target click: exact 2, another button 1 + closeness, wait 0, unparsable 0
    assert rewards[0, 0] == 2.0 and 1.0 < rewards[0, 1] < 2.0 and rewards[0, 2] == rewards[0, 3] == 0.0
    # state 2's a_T is finished(): only a finished() scores (none sampled); the cycle continues there
    assert np.all(rewards[1] == 0.0)
    adv = step_rl.group_advantages(rewards)
    np.testing.assert_allclose(adv[0], (rewards[0] - rewards[0].mean()) / rewards[0].std(), rtol=1e-5)
    assert np.all(adv[1] == 0.0)
    data = step_rl.training_rows(trajectories, positives[:2], samples, adv, failures)
    assert (data.groups_kept, data.groups_flat, data.failure_rows, len(data.rows)) == (1, 1, 1, 5)
    for ref, row, sample in zip(data.refs[:4], data.rows[:4], samples[0]):
        assert ref.step == 0 and row.steps[-1] is sample and row.source == Source.ON_POLICY
    fail_ref, fail_row = data.refs[4], data.rows[4]
    assert fail_row.source == Source.FAILURE and fail_ref.step == 1 and fail_ref.advantage == 0.0
    assert fail_row.steps[-1].response == trajectories[1].steps[1].response and len(fail_row.steps) == 2


def test_an_unparsable_correct_step_is_refused_by_name(judged):
    trajectories, _, _, _ = judged
    broken = [trajectories[0]]
    broken[0].steps[0].response, saved = "gibberish", broken[0].steps[0].response
    try:
        with pytest.raises(ValueError, match="a_T response does not parse"):
            step_rl.sample_rewards(broken, [step_rl.State(0, 0)], [[]])
    finally:
        broken[0].steps[0].response = saved


def test_states_whose_correct_step_does_not_parse_are_left_out_before_sampling(judged):
    """A judge may call a step correct that holds no readable action: the phase leaves it out and counts it."""
    trajectories, labels, _, _ = judged
    positives, _ = step_rl.labelled_states(labels)
    saved = trajectories[0].steps[1].response
    trajectories[0].steps[1].response = "gibberish"
    try:
        kept, dropped = step_rl.parsable_states(trajectories, positives)
    finally:
        trajectories[0].steps[1].response = saved
    assert kept == [step_rl.State(0, 0), step_rl.State(1, 0)] and dropped == [step_rl.State(0, 1)]
    assert step_rl.parsable_states(trajectories, positives) == (positives, [])


def test_eq4_rewards_read_the_rollouts_grammar(task, judged):
    """The same a_T states and samples written in each grammar: the same Eq. 4 rewards."""
    _, _, target, wrong = judged
    states = [step_rl.State(0, 0), step_rl.State(0, 1)]
    rewards = {}
    with scripted_episodes(task) as run:
        for grammar in GRAMMARS:
            s = StepsIn(grammar, task)
            clean = run([s.click(target), s.done], grammar)
            answers = [s.click(target), s.click(wrong), s.wait, s.done, "no action here"]
            samples = [[Step.text(clean.steps[k].screenshot, a) for a in answers] for k in range(2)]
            rewards[grammar] = step_rl.sample_rewards([clean], states, samples, grammar=grammar)
    np.testing.assert_allclose(rewards["computer_use"], rewards["uitars"], atol=1e-6)
    np.testing.assert_allclose(rewards["pyautogui"], rewards["uitars"], atol=1e-6)
    # the target click: exact 2, another button 1 + closeness, wait 0, finished 0, unparsable 0; finished(): 2
    first, second = rewards["uitars"]
    assert first[0] == 2.0 and 1.0 < first[1] < 2.0 and np.all(first[2:] == 0.0)
    np.testing.assert_array_equal(second, [0.0, 0.0, 0.0, 2.0, 0.0])


class _OwnWeights(PromptPolicySampler):
    """A scripted sampler that holds weights of its own and preprocesses screenshots itself, as a serving
    engine does: it answers only after a push of the parameters it is asked to sample with."""

    needs_weight_sync = wants_screenshots = True

    def __init__(self, processor, respond):
        super().__init__(processor, respond)
        self.pushed, self.shots = [], []

    def holds(self, params):
        return bool(self.pushed) and self.pushed[-1] is params

    def sync_weights(self, params, version):
        from guijax.rollout.serving import WeightSync

        self.pushed.append(params)
        return WeightSync(version, 0.0, 0, 0)

    def generate(self, params, rng, rows, prompts, images=None):
        assert self.holds(params) and images is not None and len(images) == rows
        self.shots.append([len(i) for i in images])
        return super().generate(params, rng, rows, prompts)


def test_sampling_at_states_hands_a_serving_engine_the_weights_and_the_screenshots(task, judged):
    trajectories, labels, target, _ = judged
    positives, _ = step_rl.labelled_states(labels)
    processor = TextProcessor()
    sampler = _OwnWeights(processor, lambda params, prompt: click(task, target))
    params = {"w": np.zeros(1)}
    with EnvPool(DeskFactory(SCREEN, step_limit=6, popups=False), 1, timeout_s=60) as pool:
        engine = RolloutEngine(pool, sampler, processor, RolloutConfig(show_progress=False))
        samples = step_rl.sample_at_states(engine, params, trajectories, positives[:2], 2, jax.random.PRNGKey(0),
                                           max_rows=3)
    assert [len(g) for g in samples] == [2, 2] and sampler.pushed == [params]  # pushed once, before the first call
    assert sampler.shots == [[1, 1, 2], [2]]  # each prompt's screenshots: step 1's, or step 1's history and step 2's
