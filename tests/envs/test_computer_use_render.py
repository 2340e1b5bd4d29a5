"""EvoCUA's computer_use grammar end to end: every typed action renders to a tool call that parses back to
it (in both coordinate spaces), a whole response (reasoning, semantic action, calls) reads back, and a desk
episode written in the grammar is prompted, parsed, executed and rendered back, stateful keys included."""
from __future__ import annotations

import json
import re

import pytest

from envs.actions.computer_use import (ACTIONS, parse_computer_use, render_computer_use, render_response,
                                       split_response, system_prompt)
from envs.actions.model import Action, ActionType
from envs.api import Task
from envs.desk import DeskEnv
from envs.tasks import generate_desk_tasks

from canonical_actions import CANONICAL, SCREEN


def _call_names(text: str) -> set[str]:
    return {json.loads(body)["arguments"]["action"]
            for body in re.findall(r"<tool_call>\s*(.*?)\s*</tool_call>", text, re.DOTALL)}


@pytest.mark.parametrize("image_hw", [SCREEN, (1000, 1000)], ids=["pixels", "relative"])
@pytest.mark.parametrize("action", CANONICAL, ids=lambda a: f"{a.kind.value}-{a.direction or ''}")
def test_every_action_round_trips(action, image_hw):
    text = render_computer_use([action], image_hw=image_hw, screen_hw=SCREEN)
    assert parse_computer_use(text, image_hw=image_hw, screen_hw=SCREEN) == [action]


def test_the_renderings_cover_table_6():
    names = set().union(*(_call_names(render_computer_use([a], image_hw=SCREEN, screen_hw=SCREEN)) for a in CANONICAL))
    assert names == set(ACTIONS)


@pytest.mark.parametrize("kind", [ActionType.LONG_PRESS, ActionType.CALL_USER, ActionType.PRESS_BACK])
def test_actions_outside_the_grammar_fail_by_name(kind):
    with pytest.raises(ValueError, match=f"{kind.value!r} has no computer_use equivalent"):
        render_computer_use([Action(kind, point=(1, 1))], image_hw=SCREEN, screen_hw=SCREEN)


def test_a_whole_response_reads_back():
    actions = [Action(ActionType.KEYDOWN, keys=("shift",)), Action(ActionType.CLICK, point=(30, 40)),
               Action(ActionType.KEYUP, keys=("shift",))]
    text = render_response("I hold Shift to extend the selection.", 'Shift-click the "b.txt" row.', actions,
                           image_hw=(1000, 1000), screen_hw=SCREEN)
    assert split_response(text) == ("I hold Shift to extend the selection.", 'Shift-click the "b.txt" row.')
    assert parse_computer_use(text, image_hw=(1000, 1000), screen_hw=SCREEN) == actions
    compressed = render_response("", "Click OK.", [], image_hw=SCREEN, screen_hw=SCREEN)
    assert compressed == "Action: Click OK." and split_response(compressed) == ("", "Click OK.")
    assert split_response("just thinking") == ("just thinking", "")


def test_the_prompt_declares_the_tool_and_keeps_one_slot():
    for compact in (False, True):
        prompt = system_prompt((1000, 1000), compact=compact).format(instruction="Turn on Wi-Fi.")
        assert prompt.rstrip().endswith("Turn on Wi-Fi.") and "relative" in prompt
        assert all(name in prompt for name in ACTIONS)
    tool = re.search(r"<tools>\n(.*)\n</tools>", system_prompt(SCREEN).format(instruction="x")).group(1)
    assert set(json.loads(tool)["function"]["parameters"]["properties"]["action"]["enum"]) == set(ACTIONS)
    assert "280 wide" in system_prompt(SCREEN).format(instruction="x")


def _call(action: str, **args) -> str:
    return f'<tool_call>\n{json.dumps({"name": "computer_use", "arguments": {"action": action, **args}})}\n</tool_call>'


def _task(family: str) -> Task:
    return next(t for t in generate_desk_tasks(24, seed=0, families=[family]) if t.domain == family)


def _center(a11y: str, role: str, name: str) -> tuple[int, int]:
    m = re.search(rf'{role} "{re.escape(name)}" \[(\d+),(\d+),(\d+),(\d+)\]', a11y)
    x1, y1, x2, y2 = map(int, m.groups())
    return (x1 + x2) // 2, (y1 + y2) // 2


def _episode(task: Task, respond) -> tuple[DeskEnv, list[str], list[list[Action]]]:
    """Run `respond(a11y, step) -> response text` on the desk, prompted and parsed in the grammar; return the
    environment, the prompts' texts and the parsed actions."""
    from guijax.rollout.prompt import Turn, build_messages

    env = DeskEnv(SCREEN, step_limit=10, popups=False)
    obs = env.reset(task)
    history, prompts, parsed = [], [], []
    for step in range(10):
        messages, images = build_messages(task.instruction, history, obs.screenshot, max_images=2,
                                          system_prompt=system_prompt((1000, 1000)))
        prompts.append(messages[0]["content"][0]["text"])
        assert len(images) == min(step + 1, 2)
        text = respond(obs.a11y_tree, step)
        actions = parse_computer_use(text, image_hw=(1000, 1000), screen_hw=SCREEN)
        parsed.append(actions)
        history.append(Turn(obs.screenshot, text))
        result = env.step(actions)
        obs = result.observation
        if result.done:
            break
    return env, prompts, parsed


def _rel(point: tuple[int, int]) -> list[int]:
    return [round(point[0] / SCREEN[1] * 1000), round(point[1] / SCREEN[0] * 1000)]


def test_a_desk_episode_in_the_grammar_with_stateful_keys():
    task = _task("type_field")
    target = re.search(r'into the (\w+) field', task.instruction).group(1)
    text = re.search(r'"([^"]*)"', task.instruction).group(1)

    def respond(a11y: str, step: int) -> str:
        field = _rel(_center(a11y, "field", target))
        script = [
            "I look around first.\n\nAction: Wait for the screen.\n" + _call("wait", time=0.5)
            + _call("mouse_move", coordinate=field) + _call("hscroll", pixels=-2, coordinate=field),
            f"The field holds old text, so I select all of it.\n\nAction: Triple-click the {target} field.\n"
            + _call("key_down", keys=["shift"]) + _call("key_up", keys=["shift"])
            + _call("triple_click", coordinate=field),
            "It is selected, so typing replaces it.\n\nAction: Type the text.\n" + _call("type", text=text),
            "The field shows the text now.\n\nAction: Report success.\n" + _call("terminate", status="success"),
        ]
        return script[step]

    env, prompts, parsed = _episode(task, respond)
    assert env.evaluate() == 1.0 and len(parsed) == 4
    assert [a.kind for a in parsed[0]] == [ActionType.WAIT, ActionType.HOVER, ActionType.SCROLL]
    assert parsed[0][2].direction == "left" and parsed[0][0].amount == 0.5
    assert [a.kind for a in parsed[1]] == [ActionType.KEYDOWN, ActionType.KEYUP, ActionType.LEFT_TRIPLE]
    assert parsed[3] == [Action(ActionType.FINISHED)]
    assert "computer_use" in prompts[0] and task.instruction in prompts[0]
    for actions in parsed:  # rendered back, each response parses to the same actions
        back = render_response("thought", "semantic", actions, image_hw=(1000, 1000), screen_hw=SCREEN)
        assert parse_computer_use(back, image_hw=(1000, 1000), screen_hw=SCREEN) == actions


def test_terminate_failure_solves_an_infeasible_task():
    task = _task("infeasible_toggle")
    env, _, parsed = _episode(task, lambda a11y, step: "There is no such setting.\n\nAction: Give up.\n"
                              + _call("terminate", status="failure"))
    assert parsed == [[Action(ActionType.FAIL)]] and env.evaluate() == 1.0
