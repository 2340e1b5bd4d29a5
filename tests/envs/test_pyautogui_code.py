"""SGCD's Fig. 9 grammar: every typed action renders to pyautogui code that reads back to it, a whole
response's sections read back and a past step keeps its thought and action without the code, the cursor is
followed within a response, anything but literal pyautogui / computer calls is refused by name (the code is
never run), and a desk episode is prompted, answered, parsed and executed through the rollout engine."""
from __future__ import annotations

import dataclasses

import jax
import pytest

from envs.actions import ActionParseError
from envs.actions.grammar import history_text, parse_response, reasoning, render_response
from envs.actions.model import Action, ActionType
from envs.actions.pyautogui_code import (WAIT_SECONDS, parse_pyautogui, render_code, split_response,
                                         system_prompt)
from envs.tasks import generate_desk_tasks

from canonical_actions import CANONICAL, SCREEN

REL = (1000, 1000)


def _code(body: str) -> str:
    return f"## Thought: t\n## Action: a\n## Code:\n```python\n{body}\n```"


def _parse(body: str) -> list[Action]:
    return parse_pyautogui(_code(body), image_hw=REL, screen_hw=SCREEN)


@pytest.mark.parametrize("image_hw", [SCREEN, REL], ids=["pixels", "relative"])
@pytest.mark.parametrize("action", CANONICAL, ids=lambda a: f"{a.kind.value}-{a.direction or ''}")
def test_every_action_round_trips(action, image_hw):
    expected = dataclasses.replace(action, amount=WAIT_SECONDS) if action.kind == ActionType.WAIT else action
    code = render_code([action], image_hw=image_hw, screen_hw=SCREEN)
    assert parse_pyautogui(f"```python\n{code}\n```", image_hw=image_hw, screen_hw=SCREEN) == [expected]


def test_a_whole_response_reads_back_and_a_past_step_drops_its_code():
    actions = [Action(ActionType.KEYDOWN, keys=("shift",)), Action(ActionType.CLICK, point=(30, 40)),
               Action(ActionType.KEYUP, keys=("shift",)), Action(ActionType.FINISHED, text="3 files")]
    text = render_response("I hold Shift\nto extend the selection.", 'Shift-click "b.txt".', actions,
                           grammar="pyautogui", screen_hw=SCREEN)
    assert split_response(text) == ("I hold Shift\nto extend the selection.", 'Shift-click "b.txt".')
    assert reasoning(text, "pyautogui") == "I hold Shift\nto extend the selection."
    assert parse_response(text, grammar="pyautogui", screen_hw=SCREEN) == actions
    assert 'computer.terminate(status="success", answer=\'3 files\')' in text
    past = history_text(text, "pyautogui")
    assert past == '## Thought: I hold Shift\nto extend the selection.\n## Action: Shift-click "b.txt".'
    assert history_text("no sections here", "pyautogui") == "no sections here"
    # the code section unfenced, or fenced on its own line, reads the same
    assert _parse("pyautogui.click(500, 500)") == parse_pyautogui(
        "## Thought: t\n## Code: ```python pyautogui.click(500, 500)```", image_hw=REL, screen_hw=SCREEN)


def test_the_thinking_variant_keeps_its_reasoning_in_think_tags_in_past_steps():
    """Fig. 9 for thinking backbones: the thought is a [think] ... [/think] segment, read back as the thought,
    and a past step keeps that segment and its action, not its code."""
    actions = [Action(ActionType.CLICK, point=(30, 40)), Action(ActionType.TYPE, text="x ## Action: y")]
    text = render_response("The field is empty.\n## Code: is not a section in here.", "Type into the field.",
                           actions, grammar="pyautogui_think", screen_hw=SCREEN)
    assert text.startswith("[think]\nThe field is empty.\n## Code: is not a section in here.\n[/think]\n"
                           "## Action: Type into the field.\n## Code:\n```python\n")
    assert "## Thought" not in text
    assert reasoning(text, "pyautogui_think") == "The field is empty.\n## Code: is not a section in here."
    assert split_response(text)[1] == "Type into the field."
    assert parse_response(text, grammar="pyautogui_think", screen_hw=SCREEN) == actions
    assert history_text(text, "pyautogui_think") == ("[think]\nThe field is empty.\n## Code: is not a section in "
                                                     "here.\n[/think]\n## Action: Type into the field.")
    # the plain grammar shows the same step with a Thought field
    assert history_text(text, "pyautogui").startswith("## Thought: The field is empty.")
    # tags in any case; an unclosed segment (the answer cut off) is all thought and holds no action, even a
    # drafted one
    assert split_response("[THINK] maybe the menu [/Think]\n## Action: open it") == ("maybe the menu", "open it")
    assert split_response("[think] still thinking about ## Action: x") == ("still thinking about ## Action: x", "")
    cut = "[think] maybe ```python\npyautogui.click(1, 2)\n```"
    with pytest.raises(ActionParseError, match="never closed") as refused:
        parse_response(cut, grammar="pyautogui_think", screen_hw=SCREEN)
    assert refused.value.text == cut
    # code drafted while thinking is not what runs; the code after the segment is
    drafted = ("[think]\nFirst I thought of ```python\npyautogui.click(100, 100)\n``` but Enter is enough.\n[/think]\n"
               "## Action: press Enter\n## Code:\npyautogui.press('enter')")
    assert parse_response(drafted, grammar="pyautogui_think", screen_hw=SCREEN) == [
        Action(ActionType.PRESS, keys=("enter",))]
    # Qwen3's own tags, and a response whose opening tag was in the prompt (only its closing tag)
    assert split_response("<think>the menu</think>\n## Action: open it") == ("the menu", "open it")
    assert split_response("the menu is shut\n</think>\n## Action: open it") == ("the menu is shut", "open it")
    assert history_text("the menu is shut</think>\n## Action: open it\n## Code:\ncomputer.wait()",
                        "pyautogui_think") == "[think]\nthe menu is shut\n[/think]\n## Action: open it"
    # a segment counts only at the start: the plain grammar's code may type the tag
    plain = "## Thought: t\n## Action: a\n## Code:\n```python\npyautogui.write('[think]')\n```"
    assert split_response(plain) == ("t", "a")
    assert parse_response(plain, grammar="pyautogui", screen_hw=SCREEN) == [Action(ActionType.TYPE, text="[think]")]


def test_the_cursor_is_followed_within_a_response():
    assert _parse("pyautogui.moveTo(100, 200)\npyautogui.dragTo(500, 600, duration=1)") == [
        Action(ActionType.DRAG, point=(28, 56), end_point=(140, 168))]
    assert _parse("pyautogui.mouseDown(100, 200)\npyautogui.moveTo(300, 300)\npyautogui.mouseUp(500, 600)") == [
        Action(ActionType.DRAG, point=(28, 56), end_point=(140, 168))]
    assert _parse("pyautogui.moveTo(100, 200); pyautogui.mouseDown(); pyautogui.mouseUp()") == [
        Action(ActionType.CLICK, point=(28, 56))]
    assert _parse("pyautogui.moveTo((100, 200))\npyautogui.click(clicks=3)\npyautogui.click(button='right')") == [
        Action(ActionType.HOVER, point=(28, 56)), Action(ActionType.LEFT_TRIPLE, point=(28, 56)),
        Action(ActionType.RIGHT_SINGLE, point=(28, 56))]
    assert _parse("pyautogui.click(x=1200, y=-5)") == [Action(ActionType.CLICK, point=(279, 0), clipped=True)]
    assert _parse("import pyautogui, time\npyautogui.hotkey('ctrl', 'a')\ntime.sleep(0.5)\n"
                  "pyautogui.typewrite(['tab', 'enter'])\npyautogui.press('down', presses=2)\n"
                  "pyautogui.hscroll(-2, x=500, y=500)\ncomputer.wait()") == [
        Action(ActionType.HOTKEY, keys=("ctrl", "a")), Action(ActionType.PRESS, keys=("tab", "enter")),
        Action(ActionType.PRESS, keys=("down", "down")),
        Action(ActionType.SCROLL, point=(140, 140), direction="left", amount=2.0),
        Action(ActionType.WAIT, amount=WAIT_SECONDS)]


@pytest.mark.parametrize("body, match", [
    ("import os\nos.system('rm -rf /')", "line 1 is not a call: `import os`"),
    ("__import__('os').system('ls')", "is not a pyautogui, computer or time call"),
    ("subprocess.run(['ls'])", "`subprocess.run` is not a pyautogui"),
    ("x = 500\npyautogui.click(x, 300)", "line 1 is not a call"),
    ("pyautogui.click(x, 300)", "pyautogui.click's argument must be a literal value, got `x`"),
    ("pyautogui.click(*point)", r"\*args / \*\*kwargs are not accepted"),
    ("for i in range(3):\n    pyautogui.press('tab')", "line 1 is not a call"),
    ("pyautogui.drag(10, 0)", "pyautogui.drag moves relative to the cursor"),
    ("pyautogui.screenshot()", "pyautogui.screenshot is not an action"),
    ("pyautogui.click()", "pyautogui.click needs x and y"),
    ("pyautogui.click(100)", "needs both x and y"),
    ("pyautogui.click(100, 200, clicks=2, button='right')", "button='right', clicks=2"),
    ("pyautogui.click(100, 200, foo=1)", "has no argument 'foo'"),
    ("pyautogui.click(True, 200)", "x must be a number"),
    ("pyautogui.mouseDown(100, 200)", "mouseDown without mouseUp"),
    ("pyautogui.mouseDown(1, 2)\npyautogui.press('a')\npyautogui.mouseUp()", "while the mouse button is held"),
    ("pyautogui.keyDown(['shift', 'ctrl'])", "one key"),
    ("pyautogui.press('a', presses=0)", "presses must be a count"),
    ("pyautogui.scroll(0)", "scrolls nothing"),
    ("pyautogui.write(42)", "needs the text to type"),
    ("computer.terminate(status='done')", 'status must be "success" or "failure"'),
    ("computer.wait(5)", "takes no arguments"),
    ("computer.shutdown()", "not a control call"),
    ("pyautogui.click(100, 200", "code is not Python"),
    ("import time", "holds no action"),
])
def test_anything_but_literal_calls_is_refused_by_name(body, match):
    with pytest.raises(ActionParseError, match=match):
        _parse(body)


def test_a_response_without_code_or_with_too_much_is_refused():
    with pytest.raises(ActionParseError, match="no fenced code block"):
        parse_pyautogui("## Thought: hmm\n## Action: click it", image_hw=REL, screen_hw=SCREEN)
    with pytest.raises(ActionParseError, match="at most 20000"):
        _parse("pyautogui.press('a')\n" * 2000)


def test_the_prompt_is_fig_9_with_one_slot():
    prompt = system_prompt("hunter2").format(instruction="Turn on Wi-Fi.")
    assert "The password of the computer is hunter2." in prompt
    assert "## Thought: {thought}\n## Action: {action}\n## Code: {code}" in prompt
    assert "`computer.terminate(status=..., answer=...)`" in prompt and "Task instruction: Turn on Wi-Fi." in prompt
    # the thinking variant differs in the Thought field alone
    think = system_prompt("hunter2", think=True).format(instruction="Turn on Wi-Fi.")
    assert "```\n[think]\n{thought}\n[/think]\n## Action: {action}\n## Code: {code}\n```" in think
    assert think.replace("[think]\n{thought}\n[/think]", "## Thought: {thought}") == prompt


@pytest.mark.parametrize("grammar", ["pyautogui", "pyautogui_think"])
def test_the_engine_rolls_out_a_desk_episode_in_the_grammar(grammar):
    """Prompted with Fig. 9 (or its thinking variant), answered in pyautogui code, parsed in 0-1000 coordinates
    and executed: the task is solved, and the last prompt shows the first step as thought and action without
    its code."""
    from envs.pool import DeskFactory, EnvPool
    from guijax.rollout.engine import RolloutConfig, RolloutEngine
    from guijax.rollout.prompt import PROMPTS, grammar_of
    from guijax.rollout.trajectory import Status

    from desk_policies import button_center
    from rollout_fakes import PromptPolicySampler, TextProcessor

    task = generate_desk_tasks(1, seed=5, families=["click_button"], screen_hw=SCREEN)[0]
    x, y, name = button_center(task, SCREEN)
    answers = [render_response(f"The {name} button is what the task asks for.", f"Click {name}.",
                               [Action(ActionType.CLICK, point=(x, y))], grammar=grammar, screen_hw=SCREEN),
               "## Thought: It was clicked.\n## Action: Report success.\n## Code:\n```python\n"
               'computer.terminate(status="success")\n```']
    processor = TextProcessor()
    sampler = PromptPolicySampler(processor, lambda params, prompt: answers[min(prompt.count("assistant:"), 1)])
    pool = EnvPool(DeskFactory(SCREEN, step_limit=4, popups=False), 1, timeout_s=60)
    engine = RolloutEngine(pool, sampler, processor, RolloutConfig(
        max_images=1, system_prompt=PROMPTS[grammar], grammar=grammar_of(grammar), show_progress=False))
    try:
        (episode,), _ = engine.run(None, [task], 1, jax.random.PRNGKey(0), seed=3)
    finally:
        pool.close()
    assert episode.success and episode.status == Status.DONE and len(episode.steps) == 2
    assert episode.steps[0].actions == [f"import pyautogui\nimport time\npyautogui.click({x}, {y}, button='left')"]
    last_prompt = sampler.prompts[-1]
    assert "The password of the computer is password." in last_prompt
    thought = f"The {name} button is what the task asks for."
    shown = f"[think]\n{thought}\n[/think]" if grammar == "pyautogui_think" else f"## Thought: {thought}"
    assert f"assistant: {shown}\n## Action: Click {name}.\n" in last_prompt
    assert "pyautogui.click(" not in last_prompt  # the code left with the screenshot
    assert ("[think]\n{thought}\n[/think]" in last_prompt) == (grammar == "pyautogui_think")  # the system prompt
