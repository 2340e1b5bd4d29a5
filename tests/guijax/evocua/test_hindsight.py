"""Hindsight reasoning generation: the coordinate check, the desk's rule writer on scripted-expert traces of
every family (goal, target widget, what changed, what remains, the verdict; never a coordinate), and the
chat writer against a local OpenAI-compatible server (prompts, PNG data URLs, validation, retries, skips)."""
from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
from PIL import Image

from envs.desk import DeskEnv, ScriptedExpert, run_expert
from envs.desk.expert import expert_subgoals
from envs.desk.families import FAMILIES
from envs.tasks import generate_desk_tasks
from fake_chat import fake_chat_server
from guijax.chat import ChatClient, ChatError
from guijax.evocua.hindsight import (ChatHindsight, HindsightStep, RuleHindsight, ThoughtError, check_thought,
                                     coordinate_leaks, make_writer, semantic_action)


@pytest.mark.parametrize("text", ["I click at (120, 45).", "Click [12,40] now", "the button at 120, 45 is it",
                                  "move to x=130", "it sits 40px lower", "a 30 x 20 box", "<point>1 2</point>",
                                  "coordinate: the middle", "scroll by 120 pixels"])
def test_coordinates_are_rejected(text):
    assert coordinate_leaks(text)
    with pytest.raises(ThoughtError, match="pixel coordinates"):
        check_thought(text)


@pytest.mark.parametrize("text", ['Type the code "8113" into the Code field.', "Set Brightness to 20%.",
                                  'Select "invoice_4.txt"; 3 items remain.', "Step 2 of the plan, then 1 more."])
def test_content_numbers_are_kept(text):
    assert check_thought("Thought: " + text) == text


def test_other_unusable_thoughts():
    with pytest.raises(ThoughtError, match="empty"):
        check_thought("  Thought:  ")
    with pytest.raises(ThoughtError, match="holds the action"):
        check_thought('I click OK.\n<tool_call>{"name": "computer_use"}</tool_call>')
    with pytest.raises(ThoughtError, match="must open with 'Reflection:'"):
        check_thought("I will retry.", header="Reflection:")


def _traces():
    env = DeskEnv((280, 280), step_limit=15, seed=1, popups=True)
    by_family = {}
    for task in generate_desk_tasks(48, seed=2):
        if task.domain not in by_family:
            trace = run_expert(env, task, ScriptedExpert(seed=3))
            assert trace.reward == 1.0, task.id
            by_family[task.domain] = (task, trace)
    assert set(by_family) == set(FAMILIES)
    return by_family


@pytest.fixture(scope="module")
def traces():
    return _traces()


def _steps(trace) -> list[HindsightStep]:
    return [HindsightStep(s.screenshot, tuple(s.actions), semantic_action(s.s2), "", s.a11y, s.s2) for s in trace.steps]


def test_rule_thoughts_explain_every_step_of_every_family(traces):
    for family, (task, trace) in traces.items():
        thoughts = RuleHindsight().thoughts(task.instruction, _steps(trace), subgoals=expert_subgoals(task))
        assert len(thoughts) == len(trace.steps), family
        for i, (step, thought) in enumerate(zip(trace.steps, thoughts)):
            where = f"{family} step {i}: {thought.text}"
            assert thought.text and thought.skipped is None and not coordinate_leaks(thought.text), where
            names = [d.split('"')[1] for d in step.element_descriptions]
            assert all(f'"{n}"' in thought.text for n in names), where  # the targeted widget, by name
        assert task.instruction.strip() in thoughts[0].text  # the goal, at step 0
        verdict = "report failure" if "infeasible" in family else "report success"
        assert verdict in thoughts[-1].text, family


def test_rule_thoughts_say_what_changed_and_what_remains(traces):
    task, trace = traces["fill_form"]
    subgoals = expert_subgoals(task)
    thoughts = [t.text for t in RuleHindsight().thoughts(task.instruction, _steps(trace), subgoals=subgoals)]
    typed = next(i for i, s in enumerate(trace.steps) if s.s2.startswith("agent.type"))
    field = trace.steps[typed].element_descriptions[0].split('"')[1]
    assert f'the "{field}" field is now "' in thoughts[typed + 1]  # the next step sees the change
    assert "what remains" in thoughts[typed] and 'click the "Submit" button' in thoughts[typed]
    submit = next(i for i, s in enumerate(trace.steps) if s.element_descriptions
                  and '"Submit"' in s.element_descriptions[0])
    assert "what remains" not in thoughts[submit]
    box = next(g["target"] for g in subgoals if g["op"] == "check")
    assert f'the "{box}" checkbox is on' in thoughts[-1]  # the evidence for success


def test_a_resumed_trace_opens_with_its_reflection(traces):
    task, trace = traces["click_button"]
    thoughts = RuleHindsight().thoughts(task.instruction, _steps(trace), subgoals=expert_subgoals(task),
                                        error_context="My earlier click hit the Share button instead")
    assert thoughts[0].text.startswith("Reflection: I realize that my earlier click hit the Share button instead.")
    with pytest.raises(ValueError, match="step 0: the rule-based writer needs"):
        RuleHindsight().thoughts(task.instruction, [HindsightStep(trace.steps[0].screenshot, (), "Click.")])


def _decode(url: str) -> np.ndarray:
    assert url.startswith("data:image/png;base64,")
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))))


def _images(request) -> list[np.ndarray]:
    return [_decode(p["image_url"]["url"]) for p in request["body"]["messages"][0]["content"] if p["type"] == "image_url"]


def test_the_chat_writer_sends_the_phases_validates_and_retries(traces):
    task, trace = traces["copy_between_windows"]
    steps = [HindsightStep(s.screenshot, tuple(s.actions), semantic_action(s.s2), f"<tool_call>{i}</tool_call>")
             for i, s in enumerate(trace.steps)]
    n = len(steps)
    replies = [(200, "I click at (172, 32) on the field.")]  # step 0, first answer: a coordinate, asked again
    replies += [(200, f"Thought: I see the form and act on it, step {i}.") for i in range(n)]
    with fake_chat_server(replies) as (url, requests):
        thoughts = ChatHindsight(ChatClient(url, "vlm", api_key_env=""), retries=1).thoughts(task.instruction, steps)
    assert [t.text for t in thoughts] == [f"I see the form and act on it, step {i}." for i in range(n)]
    assert len(requests) == n + 1 and requests[0]["body"]["messages"] == requests[1]["body"]["messages"]
    first = requests[0]["body"]["messages"][0]["content"][0]["text"]
    assert task.instruction in first and "goal" in first and steps[0].semantic in first and "<tool_call>0" in first
    np.testing.assert_array_equal(_images(requests[0])[0], trace.steps[0].screenshot)
    middle = requests[2]["body"]["messages"][0]["content"][0]["text"]
    assert "what changed" in middle and "Its steps so far" in middle
    assert "step 0." in middle  # the history carries the earlier thought
    before, now = _images(requests[2])
    np.testing.assert_array_equal(before, trace.steps[0].screenshot)
    np.testing.assert_array_equal(now, trace.steps[1].screenshot)
    last = requests[-1]["body"]["messages"][0]["content"][0]["text"]
    assert "reporting success" in last and len(_images(requests[-1])) == 1


def test_the_chat_writer_skips_a_step_with_the_reason(traces):
    task, trace = traces["click_button"]
    steps = _steps(trace)
    with fake_chat_server([(200, "The button sits at 26, 92."), (200, ""), (200, "Reflection: the OK text.")]) as (url, req):
        thoughts = ChatHindsight(ChatClient(url, "vlm", api_key_env=""), retries=1).thoughts(
            task.instruction, steps[:1], error_context="the click missed")
    assert thoughts[0].text is None and "step 0: no usable thought after 2 answers" in thoughts[0].skipped
    assert "pixel coordinates" in thoughts[0].skipped and "empty" in thoughts[0].skipped
    assert "Reflection:" in req[0]["body"]["messages"][0]["content"][0]["text"]


def test_transport_failures_stop_the_writer(traces):
    task, trace = traces["click_button"]
    with fake_chat_server([(400, "bad request")]) as (url, _):
        with pytest.raises(ChatError, match="HTTP 400"):
            ChatHindsight(ChatClient(url, "vlm", api_key_env="")).thoughts(task.instruction, _steps(trace))
    with pytest.raises(ValueError, match="hindsight_url and coldstart.hindsight_model"):
        make_writer("chat")
    assert isinstance(make_writer("rule"), RuleHindsight)
    with pytest.raises(ValueError, match="'oracle' is not one of"):
        make_writer("oracle")


def test_semantic_actions_name_targets_not_positions():
    assert semantic_action('agent.click("the \\"OK\\" button in the \\"Dialog\\" window", 2, "left")') == \
        'Double-click the "OK" button in the "Dialog" window.'
    assert semantic_action('agent.type("the \\"City\\" field in the \\"Profile\\" window", "bob", True)') == \
        'Type "bob" into the "City" field in the "Profile" window, replacing its content.'
    assert semantic_action(json.dumps("x") and 'agent.hotkey(["ctrl", "s"])') == "Press Ctrl+S."
    assert semantic_action("agent.fail()") == "Report that the task cannot be done."
