"""The World State Model trained in guijax: its answers read back to the judgment they state, its training
examples hold the episode's keyframes and the ground truth's captions and change descriptions, unreadable answers
are asked again and then counted, and a tiny model tuned on a judgment writes it back."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from desk_policies import DONE, SCREEN, WAIT, buttons, click, click_task, scripted_episodes
from guijax.seagent.captions import desk_episode_record
from guijax.seagent.judge_model import CHANGE_PROMPT, TrainedWorldStateJudge, judge_examples
from guijax.seagent.world_state import (DeskOracleJudge, Judgment, judgment_answer, keyframe_parts, parse_judgment,
                                        step_labels)


@pytest.fixture(scope="module")
def episodes():
    """A clean episode and a failed one (a wrong click at step 2), with the oracle's judgment and the record."""
    task = click_task()
    target = task.instruction.split('"')[1]
    wrong = next(b for b in buttons(task) if b != target)
    with scripted_episodes(task) as run:
        clean, failed = run([click(task, target), DONE]), run([WAIT, click(task, wrong), DONE])
    judge = DeskOracleJudge(SCREEN)
    return [(task, t, judge.judge(task, t), desk_episode_record(task, t, SCREEN)) for t in (clean, failed)]


def is_change(example) -> bool:
    return isinstance(example.parts[-1], str) and example.parts[-1] == CHANGE_PROMPT


@pytest.mark.parametrize("judgment", [
    Judgment(True, reasoning="Step 1: clicked the \"OK\" button."),
    Judgment(False, (2, 3), False, 2, 'clicked "Cancel" instead', 'Click the "OK" button', "Step 1: waited."),
    Judgment(False, (), False, None, "", "", ""),
])
def test_an_answer_reads_back_to_the_judgment_it_states(judgment):
    assert parse_judgment(judgment_answer(judgment)) == judgment


def test_judgment_examples_show_the_keyframes_and_answer_with_the_ground_truth(episodes):
    (task, clean, j_clean, r_clean), (_, failed, j_failed, r_failed) = episodes
    assert j_clean.correct and not j_failed.correct and j_failed.first_error_step == 2
    examples = judge_examples(episodes)
    judged = [e for e in examples if not is_change(e)]
    assert len(judged) == 2
    for example, (_, traj, judgment, record) in zip(judged, episodes):
        frames = [p for p in example.parts if isinstance(p, np.ndarray)]
        assert len(frames) == len(traj.steps) + 1  # the screen before each action, then the final screen
        for frame, step in zip(frames, traj.steps):
            np.testing.assert_array_equal(frame, step.screenshot)
        np.testing.assert_array_equal(frames[-1], record.final_screenshot)
        assert example.parts[0] == keyframe_parts(task.instruction, [])[0]
        answer = parse_judgment(example.answer)
        assert answer == dataclasses.replace(judgment, reasoning=" ".join(record.captions))
        assert 'clicked the "' in answer.reasoning
    # the failed episode's labels come out of the trained answer as they come out of the oracle's
    assert step_labels(parse_judgment(judged[1].answer), 3) == step_labels(j_failed, 3)


def test_change_descriptions_pair_each_steps_screens(episodes):
    _, failed, _, record = episodes[1]
    changes = [e for e in judge_examples([episodes[1]]) if is_change(e)]
    assert len(changes) == len(record.changes) == len(failed.steps)
    for k, (example, change) in enumerate(zip(changes, record.changes)):
        before, after = [p for p in example.parts if isinstance(p, np.ndarray)]
        np.testing.assert_array_equal(before, failed.steps[k].screenshot)
        if k + 1 < len(failed.steps):  # the screen the episode saw next
            np.testing.assert_array_equal(after, failed.steps[k + 1].screenshot)
        assert example.answer == change.change
    assert changes[0].answer == "The screen did not change."  # the wait
    assert not [e for e in judge_examples([episodes[1]], change_descriptions=False) if is_change(e)]


class ScriptedJudge(TrainedWorldStateJudge):
    """The retry logic with scripted answers instead of a model: `answers[attempt][row]`."""

    def __init__(self, answers, retries):
        self.answers, self.retries, self.max_rows, self.calls = answers, retries, 2, []

    def _answers(self, prompts, greedy):
        self.calls.append((greedy, len(prompts)))
        return [self.answers.pop(0) for _ in prompts]


def test_unreadable_answers_are_asked_again_with_sampling_then_counted(episodes, proc, monkeypatch, capsys):
    monkeypatch.setenv("GUIJAX_PROGRESS", "lines")
    good = judgment_answer(Judgment(True, reasoning="fine"))
    eps = [(task, t, r.final_screenshot) for task, t, _, r in episodes] * 2  # four episodes
    # greedy: rows 0 and 2 readable; first retry: row 1 readable; second retry: row 3 still garbage
    judge = ScriptedJudge([good, "garbage", good, "garbage", good, "garbage", "still garbage"], retries=2)
    judge.processor = proc
    out = judge.judge_all(eps)
    assert judge.calls == [(True, 2), (True, 2), (False, 2), (False, 1)]
    lines = capsys.readouterr().out.splitlines()  # each attempt's closing line, with how many it has read
    assert [line.split(",")[0].strip() for line in lines] == [
        "world state model: judging: 4/4 episodes (100%)", "world state model: judging (sampled retry 1): 2/2 "
        "episodes (100%)", "world state model: judging (sampled retry 2): 1/1 episodes (100%)"]
    assert [line.rsplit("readable=", 1)[1] for line in lines] == ["2", "1", "0"]
    assert [j.readable for j in out] == [True, True, True, False]
    assert out[3] == dataclasses.replace(out[3], correct=False, first_error_step=None)
    assert "unreadable judgment" in out[3].error_type and step_labels(out[3], 2) == [None, None]
    # its error quotes the greedy answer (the paper's decoding), not the last sampled one
    assert out[3].error_type.endswith("greedy answer: 'garbage')") and "2 sampled retries" in out[3].error_type


@pytest.mark.slow  # ~1.5 min: tunes the tiny model on one judgment until it writes it back
def test_a_judge_tuned_in_guijax_writes_back_the_judgment_it_learnt(episodes, tmp_path, tiny_config):
    from guijax.data.chat_examples import EncodeChat
    from guijax.data.pipeline import PipelineConfig, StepRef
    from guijax.models.fresh import create_checkpoint
    from guijax.models.policy import from_pretrained
    from guijax.sft import sft_steps
    from guijax.trainer import sampling_config

    config = tiny_config("seagent_cpu", "rollout.max_new_tokens=160", "pipeline.length_buckets=(512, 1024, 2048)")
    path = create_checkpoint(tmp_path / "base", "tiny", tokenizer_vocab=1024)
    policy = from_pretrained(path)
    policy.processor.image_processor = dataclasses.replace(policy.processor.image_processor, max_pixels=56 * 56)
    task, failed, _, record = episodes[1]
    judgment = Judgment(False, (), False, 2, "wrong button", "", "Step 2 missed.")
    example = dataclasses.replace(judge_examples([(task, failed, judgment, record)], False)[0],
                                  answer=judgment_answer(judgment))
    sampling = sampling_config(config, policy.processor, 0.0)
    episode = [(task, failed, record.final_screenshot)]
    untrained = TrainedWorldStateJudge(policy.module, policy.params, policy.processor, sampling, retries=0)
    assert not untrained.judge_all(episode)[0].readable  # before: the step donates the initial parameters
    pipeline = PipelineConfig(length_buckets=(512, 1024, 2048), patch_bucket=64)
    params, losses = sft_steps(policy, [], policy.processor, config, pipeline, 80, 2, seed=0, learning_rate=3e-3,
                               refs=[StepRef(0, 0, 1.0)] * 2, encode=EncodeChat([example], policy.processor, 2048))
    assert losses[-1] < 0.05 * losses[0]
    trained = TrainedWorldStateJudge(policy.module, params, policy.processor, sampling, retries=0)
    assert trained.judge_all(episode) == [judgment]


def test_the_final_keyframe_is_the_screen_the_last_action_left():
    """A checkbox ticked in the episode's only step: the final screen shows it ticked, as a fresh desk does."""
    from envs.actions.model import Action, ActionType
    from envs.desk.a11y import parse_tree
    from envs.desk.env import DeskEnv
    from envs.tasks import generate_desk_tasks

    task = generate_desk_tasks(1, seed=2, families=["toggle_checkbox"], screen_hw=SCREEN)[0]
    env = DeskEnv(SCREEN, popups=False)
    (box,) = [n for n in parse_tree(env.reset(task).a11y_tree) if n.role == "checkbox" and n.name in task.instruction]
    x, y = (box.rect[0] + box.rect[2]) // 2, (box.rect[1] + box.rect[3]) // 2
    with scripted_episodes(task, step_limit=1) as run:
        episode = run([f"Thought: tick it.\nAction: click(start_box='({x},{y})')"])
    env.reset(task, episode.meta.get("seed"))
    expected = env.step([Action(ActionType.CLICK, point=(x, y))]).observation.screenshot
    record = desk_episode_record(task, episode, SCREEN)
    assert not np.array_equal(expected, episode.steps[-1].screenshot)
    np.testing.assert_array_equal(record.final_screenshot, expected)
    frames = [p for p in judge_examples([(task, episode, Judgment(True), record)])[0].parts if isinstance(p, np.ndarray)]
    np.testing.assert_array_equal(frames[-1], expected)
