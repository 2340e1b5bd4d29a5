"""SGCD skills: the four-field JSON contract, rendering, and the chat extractor against a local fake server."""
from __future__ import annotations

import json

import numpy as np
import pytest

from envs.api import Task
from fake_chat import fake_chat_server
from guijax.chat import ChatClient
from guijax.rollout.trajectory import Status, Step, Trajectory
from guijax.sgcd.skills import (FIELDS, ChatSkillExtractor, Skill, SkillFormatError, SkillSkipped, parse_skill)

GOOD = {"Continuation Plans": ["Open Settings", "Turn on Wi-Fi"], "Critical Targets": ["the Wi-Fi checkbox"],
        "Failure Traps": [], "Success Criteria": ["Wi-Fi is on"]}
TASK = Task(id="desk-7", instruction="Turn on Wi-Fi.")


def _traj(reward: float, responses: list[str]) -> Trajectory:
    shot = np.zeros((4, 4, 3), np.uint8)
    return Trajectory(TASK.id, TASK.instruction, [Step.text(shot, r) for r in responses], reward,
                      Status.DONE if reward else Status.STEP_LIMIT)


def test_a_skill_is_exactly_four_lists_of_strings():
    skill = parse_skill("```json\n" + json.dumps(GOOD) + "\n```")
    assert skill.continuation_plans == ("Open Settings", "Turn on Wi-Fi") and skill.failure_traps == ()
    assert Skill.from_json(skill.to_json()) == skill
    for bad, why in [({k: v for k, v in GOOD.items() if k != "Failure Traps"}, "missing \\['Failure Traps'\\]"),
                     (GOOD | {"Notes": []}, "unexpected \\['Notes'\\]"),
                     (GOOD | {"Critical Targets": "the checkbox"}, "'Critical Targets' must be a list"),
                     (GOOD | {"Success Criteria": ["ok", " "]}, "'Success Criteria' must be a list of non-empty"),
                     ([GOOD], "expected a JSON object")]:
        with pytest.raises(SkillFormatError, match=why):
            parse_skill(json.dumps(bad))
    with pytest.raises(SkillFormatError, match="not JSON"):
        parse_skill("Here is the skill: " + json.dumps(GOOD))


def test_rendering_keeps_the_chosen_fields_and_leaves_out_empty_ones():
    skill = Skill.from_json(GOOD)
    text = skill.render()
    assert text.startswith("Continuation Plans:\n1. Open Settings\n2. Turn on Wi-Fi\nCritical Targets:\n- the Wi-Fi")
    assert "Failure Traps" not in text
    assert [f in skill.render(FIELDS[:1]) for f in FIELDS] == [True, False, False, False]
    assert Skill().render() == "" and Skill().is_empty()
    with pytest.raises(ValueError, match="unknown skill fields"):
        skill.render(("Plans",))


def test_chat_extractor_sends_the_papers_prompt_and_retries_a_malformed_answer():
    win, loss = _traj(1.0, ["Thought: a.\nAction: click(start_box='(1,1)')"]), _traj(0.0, ["Action: wait()"])
    with fake_chat_server([(200, "I think the skill is..."), (200, json.dumps(GOOD))]) as (url, requests):
        skill = ChatSkillExtractor(ChatClient(url, "judge-model", api_key_env=""), retries=1).extract(TASK, [win], [loss])
    assert skill == Skill.from_json(GOOD) and len(requests) == 2
    system, user = requests[0]["body"]["messages"]
    assert system["content"].startswith("Task id: desk-7.") and '"Continuation Plans": string[]' in system["content"]
    assert "Successful references:\nReference 1 (reward 1.00" in user["content"]
    assert "Failed references: Reference 1 (reward 0.00, ended: step_limit)" in user["content"]
    assert requests[0]["body"]["model"] == "judge-model" and requests[0]["auth"] is None


def test_chat_extractor_skips_the_task_with_the_reason_after_its_retries():
    with fake_chat_server([(200, '{"Continuation Plans": []}')]) as (url, requests):
        with pytest.raises(SkillSkipped, match=r"desk-7: no valid skill after 3 answers; last: .*attempt 3.*missing"):
            ChatSkillExtractor(ChatClient(url, "m", api_key_env=""), retries=2).extract(TASK, [], [])
    assert len(requests) == 3
