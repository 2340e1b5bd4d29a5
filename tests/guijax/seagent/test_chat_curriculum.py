"""SEAgent's LLM curriculum generator (Fig. 9): the prompt's inputs from judged desk episodes and their captions,
the answer's guidebook and task buffer parsed strictly, and the client's retries against a local server."""
from __future__ import annotations

import json

import pytest

from desk_policies import DONE, SCREEN, WAIT, buttons, click, click_task, scripted_episodes
from envs.desk.env import DeskEnv
from fake_chat import fake_chat_server
from guijax.chat import ChatClient, ChatError
from guijax.seagent.captions import desk_episode_record, screen_captions
from guijax.seagent.chat_curriculum import (TASK_BUFFER_PROMPT, ChatCurriculumGenerator, CurriculumAnswerError,
                                            TaskBuffer, parse_task_buffer, phase_feedback)
from guijax.seagent.world_state import DeskOracleJudge

ANSWER = """The agent clicks the right buttons but reports done too early on dialogs.
```json
{"software document new": "1. Dialog window: buttons Archive, Print, Export.",
 "exam new": [["Click the \\"Print\\" button", "Report the task done"], ["Click the \\"Export\\" button."],
              "Click the \\"Archive\\" button."]}
```"""


def test_a_fig9_answer_gives_the_guidebook_and_task_sequences():
    buffer = parse_task_buffer(ANSWER)
    assert buffer.document == "1. Dialog window: buttons Archive, Print, Export."
    assert buffer.tasks == (('Click the "Print" button', "Report the task done"), ('Click the "Export" button.',),
                            ('Click the "Archive" button.',))
    assert buffer.instructions()[0] == 'Click the "Print" button, then Report the task done'
    assert buffer.reasoning.startswith("The agent clicks the right buttons")
    # the last dict holding the keys wins over an earlier draft, and JSON in the reasoning is not mistaken for it
    two = 'draft {"exam new": [["a"]], "software document new": "old"} final ' \
          '{"software document new": "new", "exam new": [["b"]]} {"unrelated": 1}'
    assert parse_task_buffer(two) == TaskBuffer("new", (("b",),), two[:two.index('{"software document new": "new"')].strip())
    nested = '{"software document new": "d", "exam new": [["a"]], "notes": {"exam new": "ignored"}}'
    assert parse_task_buffer(nested).tasks == (("a",),)  # a later, inner dict with one key does not hide it
    for bad, why in [("no json at all", "no JSON dict"), ('{"exam new": [["a"]]}', "no 'software document new'"),
                     ('{"software document new": "d"}', "no 'exam new'"),
                     ('{"software document new": 3, "exam new": [["a"]]}', "must be text"),
                     ('{"software document new": "d", "exam new": []}', "non-empty list"),
                     ('{"software document new": "d", "exam new": [["a"], [""]]}', r"\[1\] must be a list"),
                     ('{"software document new": "d", "exam new": [["a"], 7]}', r"\[1\] must be a list")]:
        with pytest.raises(CurriculumAnswerError, match=why):
            parse_task_buffer(bad)


@pytest.fixture(scope="module")
def judged_phase():
    """Two judged desk episodes of one task with their captions: one solved, one that clicked the wrong button."""
    task = click_task()
    target = task.instruction.split('"')[1]
    wrong = next(b for b in buttons(task) if b != target)
    judge = DeskOracleJudge(SCREEN)
    with scripted_episodes(task) as run:
        episodes = [run([click(task, target), DONE]), run([WAIT, click(task, wrong), DONE])]
    return task, wrong, [(task, judge.judge(task, t), desk_episode_record(task, t, SCREEN).captions) for t in episodes]


def test_a_phases_judged_episodes_become_the_prompts_three_inputs(judged_phase):
    task, wrong, results = judged_phase
    descriptions, exam, states = phase_feedback(results)
    assert descriptions[0].startswith("clicked the") and "Step" not in descriptions[0]
    assert len(descriptions) == len(set(descriptions))  # "waited" and "reported done" folded over the episodes
    assert exam == [{"task": task.instruction, "attempts": 2, "judged_correct": 1,
                     "errors": [results[1][1].error_type]}]
    assert f'"{wrong}" button' in results[1][1].error_type
    assert states[0] == {"instruction": task.instruction, "caption": results[0][2][-1], "judged": "correct"}
    assert states[1]["judged"].startswith("incorrect (first error at step 2:")
    assert len(phase_feedback(results, max_descriptions=2)[0]) == 2


def test_the_generator_sends_fig9_and_asks_again_on_an_unreadable_answer(judged_phase):
    task, _, results = judged_phase
    descriptions, exam, states = phase_feedback(results)
    with fake_chat_server([(200, "I would suggest more tasks."), (200, ANSWER)]) as (url, requests):
        buffer = ChatCurriculumGenerator(ChatClient(url, "qwen2.5-72b", api_key_env=""), retries=1).update(
            descriptions, "old manual", exam, states)
    assert buffer == parse_task_buffer(ANSWER) and len(requests) == 2
    prompt = requests[0]["body"]["messages"][0]["content"]
    assert prompt.startswith("You are now a teacher training a Computer Use Agent (CUA).")
    assert json.dumps(descriptions) in prompt and json.dumps(exam) in prompt and json.dumps(states) in prompt
    assert "in the previous round:\nold manual\n" in prompt and '"exam new": [["subtask1"' in prompt
    with fake_chat_server([(200, '{"software document new": "d", "exam new": []}')]) as (url, _):
        with pytest.raises(ChatError, match="no readable task buffer after 2 answers: 'exam new' must be"):
            ChatCurriculumGenerator(ChatClient(url, "m", api_key_env=""), retries=1).update(descriptions)
    assert TASK_BUFFER_PROMPT.count("{action_descriptions}") == 1


def test_the_first_call_captions_the_initial_screen():
    task = click_task()
    captions = screen_captions(DeskEnv(SCREEN, popups=False).reset(task).a11y_tree)
    assert captions == ['The "Dialog" window (in front) holds: label "Info" (reads "Choose an action"); '
                        'button "Archive"; button "Print"; button "Export".']
    prompt = ChatCurriculumGenerator.prompt(captions, "", [], [])
    assert json.dumps(captions) in prompt and "in the previous round:\n\nHere is" in prompt


def test_generated_instructions_run_as_judged_tasks_on_the_screen_they_name():
    from envs.tasks import generate_desk_tasks
    from guijax.seagent.chat_curriculum import JUDGED_EVALUATOR, is_judged, place_on_scenes

    import dataclasses

    toggle = generate_desk_tasks(1, seed=1, families=["toggle_checkbox"], screen_hw=SCREEN)[0]
    # a synthesized task's reference solves that task, not the instructions placed on its screen
    scenes = [click_task(), dataclasses.replace(toggle, extra={**toggle.extra, "solution": [{"kind": "wait"}]})]
    names = [["Dialog", "Info", "Archive", "Print", "Export"], ["Settings", "Notifications", "Wi-Fi", "Dark mode"]]
    placed, left_out = place_on_scenes(["Turn on wi-fi", "Print twice", "Open the terminal",
                                        "Click Print in Settings", "Look at the reprints"], scenes, names, "gen")
    assert left_out == ["Open the terminal", "Look at the reprints"]  # whole names only: "print" is not in "reprints"
    assert [(t.id, t.instruction, t.extra["scene"]) for t in placed] == [
        ("gen-000", "Turn on wi-fi", scenes[1].id), ("gen-001", "Print twice", scenes[0].id),
        ("gen-003", "Click Print in Settings", scenes[1].id)]  # a tie goes to the longer name
    assert all(t.evaluator == JUDGED_EVALUATOR and is_judged(t) and not {"expert", "solution"} & set(t.extra)
               for t in placed)
    assert placed[0].config == scenes[1].config and not is_judged(scenes[0])
    env = DeskEnv(SCREEN, popups=False)
    env.reset(placed[0])
    assert env.evaluate() == 0.0  # the desk verifies nothing: the judge decides
