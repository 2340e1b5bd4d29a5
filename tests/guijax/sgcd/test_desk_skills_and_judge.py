"""The desk's offline skill extractor and the judges, on episodes rolled out on the real desk by scripted
policies (the replay against the accessibility tree needs the screens the episodes really saw)."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest

from desk_policies import DONE, SCREEN, WAIT, StepsIn, buttons, click, click_task, scripted_episodes
from envs.actions.grammar import GRAMMARS
from fake_chat import decoded_image, fake_chat_server
from guijax.chat import ChatClient
from guijax.rollout.trajectory import Status
from guijax.sgcd.desk_skills import DeskSkillExtractor, first_off_track_step, step_verdicts
from guijax.sgcd.judge import ChatJudge, RuleJudge


@pytest.fixture(scope="module")
def task():
    return click_task()


@pytest.fixture(scope="module")
def episode(task):
    """episode(responses) -> the trajectory of a scripted policy on the task (step limit 6)."""
    with scripted_episodes(task) as run:
        yield run


def _target(task) -> str:
    return task.instruction.split('"')[1]


def test_offline_skill_from_ground_truth_and_the_failures_replayed(task, episode):
    wrong = next(b for b in buttons(task) if b != _target(task))
    failed = episode([click(task, wrong), click(task, wrong), DONE])
    assert failed.status == Status.DONE and failed.reward == 0.0
    extractor = DeskSkillExtractor(SCREEN, popups=False)
    skill = extractor.extract(task, [], [failed])
    assert skill.continuation_plans == (f'Click the "{_target(task)}" button', "Report that the task is done")
    assert skill.critical_targets == (f'the "{_target(task)}" button in the "Dialog" window',)
    assert skill.failure_traps == (
        f'Do not click the "{wrong}" button in the "Dialog" window: it is not part of this task',
        "Do not report the task done while the success criteria do not hold yet")
    assert skill.success_criteria[0] == f'The "{_target(task)}" button in the "Dialog" window has been pressed'
    assert extractor.extract(task, [failed], []).failure_traps == ()  # traps only from failed references
    assert first_off_track_step(task, failed, SCREEN, popups=False) == 1


def test_fixation_is_a_trap_and_the_replay_stops_where_the_screen_differs(task, episode):
    stuck = episode([WAIT])  # waits to the step limit, 6
    verdicts = step_verdicts(task, stuck, SCREEN, popups=False)
    assert [v.trap is not None for v in verdicts] == [False] + [True] * 5
    assert "Do not repeat an action" in verdicts[1].trap
    stuck.steps[1].screenshot = stuck.steps[1].screenshot.copy()
    stuck.steps[1].screenshot[0, 0] += 1
    assert [v.kind for v in step_verdicts(task, stuck, SCREEN, popups=False)] == ["wait", "unreplayable"]


def test_rule_judge_keeps_clean_continuations_and_names_what_it_removes(task, episode):
    judge = RuleJudge(max_repeats=2, screen_hw=SCREEN, popups=False)
    target = _target(task)
    clean = episode([WAIT, click(task, target), DONE])
    assert clean.reward == 1.0 and judge.judge(task, clean, 1).accept
    never_done = episode([WAIT, click(task, target)] + [WAIT] * 2 + [click(task, target), WAIT])
    assert never_done.status == Status.STEP_LIMIT and never_done.reward == 1.0
    assert judge.judge(task, never_done, 1).reason.startswith("accidental success: the episode ended as step_limit")
    loop = episode([WAIT, click(task, target), click(task, target), click(task, target), DONE])
    assert loop.reward == 1.0 and judge.judge(task, loop, 1).reason.startswith("redundant loop")
    assert RuleJudge(max_repeats=3).judge(task, loop, 1).accept
    wrong = next(b for b in buttons(task) if b != target)
    mislabelled = episode([WAIT, click(task, target, thought_name=wrong), DONE])
    verdict = judge.judge(task, mislabelled, 1)
    assert not verdict.accept and verdict.reason.startswith("inconsistent reasoning: step 2's thought names")
    assert RuleJudge().judge(task, mislabelled, 1).accept  # without the desk's tree only the generic rules apply
    assert not judge.judge(task, clean, 3).accept  # nothing after the handoff


def test_step_verdicts_read_the_policys_grammar(task, episode):
    """The same failed episode written in each grammar: the same verdicts, off-track step and traps."""
    wrong = next(b for b in buttons(task) if b != _target(task))
    seen = {}
    for grammar in GRAMMARS:
        s = StepsIn(grammar, task)
        failed = episode([s.wait, s.click(wrong), s.click(wrong), s.done], grammar)
        assert failed.status == Status.DONE and failed.reward == 0.0
        seen[grammar] = (step_verdicts(task, failed, SCREEN, popups=False, grammar=grammar),
                         first_off_track_step(task, failed, SCREEN, popups=False, grammar=grammar),
                         DeskSkillExtractor(SCREEN, popups=False, grammar=grammar).extract(task, [], [failed]))
    assert seen["computer_use"] == seen["pyautogui"] == seen["uitars"]
    verdicts, first, skill = seen["uitars"]
    assert [v.kind for v in verdicts] == ["wait", "click", "click", "finished"] and first == 2
    assert verdicts[1].element == ("button", wrong, "Dialog") and verdicts[0].trap is None
    assert skill.failure_traps[0] == f'Do not click the "{wrong}" button in the "Dialog" window: it is not part of this task'
    assert skill.failure_traps[-1] == "Do not report the task done while the success criteria do not hold yet"


def test_rule_judge_reads_the_policys_grammar(task, episode):
    """Clean, mislabelled, looping and mistyped continuations in each grammar: the same judgments."""
    target = _target(task)
    wrong = next(b for b in buttons(task) if b != target)
    seen = {}
    for grammar in GRAMMARS:
        s = StepsIn(grammar, task)
        judge = RuleJudge(max_repeats=2, screen_hw=SCREEN, popups=False, grammar=grammar)
        runs = [episode(steps, grammar) for steps in (
            [s.wait, s.click(target), s.done],
            [s.wait, s.click(target, thought_name=wrong), s.done],
            [s.wait, s.click(target), s.click(target), s.click(target), s.done],
            [s.wait, s.click(target), s.typed("bye", quoted="hello"), s.done])]
        assert all(t.status == Status.DONE and t.reward == 1.0 for t in runs)
        # the reasons up to the action text, which is written in the grammar
        seen[grammar] = [(v.accept, re.sub(r"redundant loop: .* (\d+ times)", r"redundant loop: \1", v.reason))
                         for v in (judge.judge(task, t, 1) for t in runs)]
    assert seen["computer_use"] == seen["pyautogui"] == seen["uitars"]
    clean, mislabelled, loop, mistyped = seen["uitars"]
    assert clean == (True, "")
    assert mislabelled == (False, f"inconsistent reasoning: step 2's thought names ['{wrong}'] but its click hits "
                                  f"\"{target}\"")
    assert loop == (False, "redundant loop: 3 times in a row (step 4)")
    assert mistyped == (False, "inconsistent reasoning: step 3 types 'bye' but its thought quotes ['hello']")


def test_chat_judge_reads_the_verdict_and_rejects_when_none_comes(task, episode):
    clean = episode([WAIT, click(task, _target(task)), DONE])
    with fake_chat_server([(200, "yes"), (200, json.dumps({"accept": True, "reason": "fine"}))]) as (url, requests):
        verdict = ChatJudge(ChatClient(url, "m", api_key_env=""), retries=1).judge(task, clean, 1)
    assert verdict.accept and verdict.reason == "fine" and len(requests) == 2
    user = requests[0]["body"]["messages"][1]["content"]
    assert "Step 1 (context): Thought: I wait" in user and "Outcome: ended as done, verifier reward 1.00" in user
    with fake_chat_server([(200, "{}")]) as (url, _):
        verdict = ChatJudge(ChatClient(url, "m", api_key_env=""), retries=0).judge(task, clean, 1)
    assert not verdict.accept and verdict.reason.startswith("judge gave no verdict after 1 answers")


def test_chat_judge_sees_the_screens_of_the_last_continuation_steps(task, episode):
    """With `screenshots`, the screen each of the last post-handoff steps acted on comes before its response;
    the context steps stay text; more screenshots than continuation steps show them all."""
    run = episode([WAIT, WAIT, click(task, _target(task)), DONE])
    reply = [(200, json.dumps({"accept": True, "reason": "fine"}))]
    for screenshots, shown in ((2, [3, 4]), (9, [2, 3, 4])):
        with fake_chat_server(reply) as (url, requests):
            ChatJudge(ChatClient(url, "m", api_key_env=""), screenshots=screenshots, max_side=None).judge(task, run, 1)
        content = requests[0]["body"]["messages"][1]["content"]
        labels = [p["text"] for p in content if p["type"] == "text" and p["text"].startswith("Screen before")]
        assert labels == [f"Screen before step {j}:" for j in shown]
        images = [p["image_url"]["url"] for p in content if p["type"] == "image_url"]
        for j, url_ in zip(shown, images):
            np.testing.assert_array_equal(decoded_image(url_), run.steps[j - 1].screenshot)
        texts = [p["text"] for p in content if p["type"] == "text"]
        assert texts[0] == f"Instruction: {task.instruction}" and texts[-1].startswith("Outcome: ended as done")
        assert texts.index(f"Screen before step {shown[0]}:") == texts.index(next(
            t for t in texts if t.startswith(f"Step {shown[0]}: "))) - 1
