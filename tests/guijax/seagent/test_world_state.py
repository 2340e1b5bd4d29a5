"""SEAgent's World State Model judge: Fig. 8 answers parsed, A.3's step labels, the desk's ground-truth oracle
on episodes rolled out on the real desk, the chat backend against a local server, precision and NPV."""
from __future__ import annotations

import numpy as np
import pytest

from desk_policies import DONE, SCREEN, WAIT, StepsIn, buttons, click, click_task, scripted_episodes
from envs.actions.grammar import GRAMMARS
from fake_chat import decoded_image, fake_chat_server
from guijax.chat import ChatClient, ChatError
from guijax.seagent.world_state import (JUDGE_PROMPT, ChatWorldStateJudge, DeskOracleJudge, Judgment,
                                        JudgmentError, Label, parse_judgment, score_judge, step_labels)

T, F = Label.CORRECT, Label.FAILURE

PAPER_STYLE = """Keyframe 1 shows the dialog. <thinking>The agent clicked Cancel at step 2, so the file was
not saved.</thinking>
res_dict = {
"Correctness": False,
"Redundant": [3],
"Optimized": False,
"First Error Step": 2,
"Error Type": "clicked Cancel instead of Save",
"Correct Action": "click Save"
}"""


def test_a_fig8_answer_parses_python_or_json_style():
    j = parse_judgment(PAPER_STYLE)
    assert j == Judgment(False, (3,), False, 2, "clicked Cancel instead of Save", "click Save",
                         "The agent clicked Cancel at step 2, so the file was\nnot saved.")
    jsonish = parse_judgment('res_dict = {"Correctness": true, "Redundant": [], "Optimized": true, '
                             '"First Error Step": null, "Error Type": "", "Correct Action": ""}')
    assert jsonish.correct and jsonish.first_error_step is None and jsonish.redundant == ()
    assert parse_judgment('{"Correctness": "False", "First Error Step": "4"}').first_error_step == 4
    for bad, why in [("looks fine to me", "no res_dict"), ("res_dict = {'Redundant': []}", "no 'Correctness'"),
                     ("res_dict = {'Correctness': 'maybe'}", "True or False"),
                     ("res_dict = {'Correctness': False, 'First Error Step': 0}", "counts steps from 1"),
                     ("res_dict = {'Correctness': False, 'Redundant': 3}", "list of step numbers"),
                     ("res_dict = {'Correctness': False,", "no res_dict")]:
        with pytest.raises(JudgmentError, match=why):
            parse_judgment(bad)
    assert "[INSTRUCTION]" in JUDGE_PROMPT and '"First Error Step": step number or None' in JUDGE_PROMPT


def test_step_labels_follow_a3():
    assert step_labels(Judgment(True), 3) == [T, T, T]
    assert step_labels(Judgment(True, redundant=(3, 4)), 5) == [T, T, None, None, None]
    assert step_labels(Judgment(False, first_error_step=3), 5) == [T, T, F, None, None]
    assert step_labels(Judgment(False, first_error_step=1), 2) == [F, None]
    assert step_labels(Judgment(False), 3) == [None] * 3  # no error step: nothing to learn from
    assert step_labels(Judgment(False, first_error_step=9), 3) == [None] * 3


@pytest.fixture(scope="module")
def task():
    return click_task()


@pytest.fixture(scope="module")
def episode(task):
    """episode(responses) -> the trajectory of a scripted policy on the task (step limit 6)."""
    with scripted_episodes(task) as run:
        yield run


def test_the_desk_oracle_judges_from_ground_truth(task, episode):
    judge = DeskOracleJudge(SCREEN)
    target = task.instruction.split('"')[1]
    wrong = next(b for b in buttons(task) if b != target)
    clean = episode([click(task, target), DONE])
    assert judge.judge(task, clean) == Judgment(True, (), True, None, "", "")
    detour = episode([click(task, wrong), click(task, target), DONE])
    j = judge.judge(task, detour)
    assert j.correct and j.redundant == (1,) and not j.optimized and step_labels(j, 3) == [None] * 3
    failed = episode([WAIT, click(task, wrong), DONE])
    j = judge.judge(task, failed)
    assert not j.correct and j.first_error_step == 2 and f'"{wrong}" button' in j.error_type
    assert j.correct_action == f'Click the "{target}" button'
    assert step_labels(j, 3) == [T, F, None]
    stuck = episode([WAIT])  # waits to the step limit: the repeated wait is the error
    j = judge.judge(task, stuck)
    assert not j.correct and j.first_error_step == 2 and j.redundant == (2, 3, 4, 5, 6)
    score = score_judge([judge.judge(task, t) for t in (clean, detour, failed, stuck)], [True, True, False, False])
    assert (score.precision, score.npv, score.accuracy) == (1.0, 1.0, 1.0)


def test_the_desk_oracle_reads_the_policys_grammar(task, episode):
    """Clean, detoured, failed and stuck episodes written in each grammar: the same judgments."""
    target = task.instruction.split('"')[1]
    wrong = next(b for b in buttons(task) if b != target)
    seen = {}
    for grammar in GRAMMARS:
        s = StepsIn(grammar, task)
        judge = DeskOracleJudge(SCREEN, grammar=grammar)
        seen[grammar] = [judge.judge(task, episode(steps, grammar)) for steps in (
            [s.click(target), s.done], [s.click(wrong), s.click(target), s.done],
            [s.wait, s.click(wrong), s.done], [s.wait])]
    assert seen["computer_use"] == seen["pyautogui"] == seen["uitars"]
    clean, detour, failed, stuck = seen["uitars"]
    assert clean == Judgment(True, (), True, None, "", "") and detour.correct and detour.redundant == (1,)
    assert not failed.correct and failed.first_error_step == 2 and f'"{wrong}" button' in failed.error_type
    assert failed.correct_action == f'Click the "{target}" button'
    assert not stuck.correct and stuck.first_error_step == 2 and stuck.redundant == (2, 3, 4, 5, 6)


def test_the_chat_judge_sends_the_prompt_and_every_keyframe(task, episode):
    failed = episode([WAIT, click(task, task.instruction.split('"')[1]), WAIT])
    final = np.full((*SCREEN, 3), 7, np.uint8)
    with fake_chat_server([(200, "no dictionary here"), (200, PAPER_STYLE)]) as (url, requests):
        j = ChatWorldStateJudge(ChatClient(url, "judge-model", api_key_env=""), retries=1).judge(task, failed, final)
    assert j.first_error_step == 2 and len(requests) == 2
    content = requests[0]["body"]["messages"][0]["content"]
    assert content[0]["text"].startswith("I am evaluating") and task.instruction in content[0]["text"]
    images = [part["image_url"]["url"] for part in content if part["type"] == "image_url"]
    assert len(images) == len(failed.steps) + 1
    np.testing.assert_array_equal(decoded_image(images[0]), failed.steps[0].screenshot)
    np.testing.assert_array_equal(decoded_image(images[-1]), final)
    with fake_chat_server([(200, "res_dict = {}")]) as (url, _):
        with pytest.raises(ChatError, match="no readable judgment for task .* after 2 answers: res_dict has no"):
            ChatWorldStateJudge(ChatClient(url, "m", api_key_env=""), retries=1).judge(task, failed)


def test_precision_and_npv_against_the_verifier():
    judged = [Judgment(True), Judgment(True), Judgment(False), Judgment(False), Judgment(False)]
    score = score_judge(judged, [True, False, False, False, True])
    assert (score.judged_correct, score.judged_incorrect) == (2, 3)
    assert (score.precision, score.npv, score.accuracy) == (0.5, pytest.approx(2 / 3), 0.6)
    assert score_judge([Judgment(False)], [False]).precision is None
    with pytest.raises(ValueError, match="2 judgments for 1"):
        score_judge(judged[:2], [True])
