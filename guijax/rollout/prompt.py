"""Agent prompts: the system prompt a recipe selects by name (`rollout.prompt`, in UI-TARS's grammar,
EvoCUA's computer_use or SGCD's pyautogui code, plain or with [think] segments), the instruction (optionally with a numbered plan appended, BEPA Fig. 7), and a
multi-turn history in which the last K screenshots are images and every earlier step survives as text only
(K >= steps gives ARPO's full history).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from envs.actions.computer_use import system_prompt as computer_use_prompt
from envs.actions.pyautogui_code import system_prompt as pyautogui_prompt
from envs.actions.grammar import RELATIVE, history_text

# UI-TARS-1.5's computer-use prompt, the one it was trained on, character for character as ByteDance ships it:
# COMPUTER_USE_DOUBAO in ui_tars/prompt.py of the `ui-tars` package (bytedance/UI-TARS, codes/ui_tars/prompt.py;
# tests/guijax/test_prompt.py compares the two). It lists coordinates as <point>x y</point>; UI-TARS-1.5 answers
# in its own start_box='<|box_start|>(x,y)<|box_end|>' form all the same, and envs/actions/uitars.py reads both.
UITARS_COMPUTER_USE = """You are a GUI agent. You are given a task and your action history, with screenshots. You need to perform the next action to complete the task.

## Output Format
```
Thought: ...
Action: ...
```

## Action Space

click(point='<point>x1 y1</point>')
left_double(point='<point>x1 y1</point>')
right_single(point='<point>x1 y1</point>')
drag(start_point='<point>x1 y1</point>', end_point='<point>x2 y2</point>')
hotkey(key='ctrl c') # Split keys with a space and use lowercase. Also, do not use more than 3 keys in one hotkey action.
type(content='xxx') # Use escape characters \\', \\\", and \\n in content part to ensure we can parse the content in normal python string format. If you want to submit your input, use \\n at the end of content. 
scroll(point='<point>x1 y1</point>', direction='down or up or right or left') # Show more information on the `direction` side.
wait() #Sleep for 5s and take a screenshot to check for any changes.
finished(content='xxx') # Use escape characters \\', \\", and \\n in content part to ensure we can parse the content in normal python string format.


## Note
- Use {language} in `Thought` part.
- Write a small plan and finally summarize your next action (with its target element) in one sentence in `Thought` part.

## User Instruction
{instruction}
"""
# Its {language} slot as UI-TARS's agents fill it for English tasks (OSWorld's uitars15_v1 agent and ByteDance's
# examples call COMPUTER_USE_DOUBAO.format(language="English", instruction=...)).
UITARS_LANGUAGE = "English"

# UI-TARS 1.0's (UI-TARS-7B-SFT/DPO on Qwen2-VL) prompt as OSWorld's UI-TARS agent fills it for Qwen2-VL models
# (its "qwen2vl_user" mode): the template UITARS_USR_PROMPT_THOUGHT with the action space that has call_user(), both
# character for character from OSWorld's mm_agents (the model answers in start_box='<|box_start|>(x,y)<|box_end|>'
# with 0-1000 coordinates, rollout.coordinate_model=uitars-1.0).
UITARS_V1_TEMPLATE = """You are a GUI agent. You are given a task and your action history, with screenshots. You need to perform the next action to complete the task. 

## Output Format
```
Thought: ...
Action: ...
```

## Action Space
{action_space}

## Note
- Use {language} in `Thought` part.
- Write a small plan and finally summarize your next action (with its target element) in one sentence in `Thought` part.

## User Instruction
{instruction}
"""
UITARS_V1_ACTION_SPACE = """
click(start_box='<|box_start|>(x1,y1)<|box_end|>')
left_double(start_box='<|box_start|>(x1,y1)<|box_end|>')
right_single(start_box='<|box_start|>(x1,y1)<|box_end|>')
drag(start_box='<|box_start|>(x1,y1)<|box_end|>', end_box='<|box_start|>(x3,y3)<|box_end|>')
hotkey(key='')
type(content='') #If you want to submit your input, use "\\n" at the end of `content`.
scroll(start_box='<|box_start|>(x1,y1)<|box_end|>', direction='down or up or right or left')
wait() #Sleep for 5s and take a screenshot to check for any changes.
finished()
call_user() # Submit the task and call the user when the task is unsolvable, or when you need the user's help.
"""

# A short variant for CPU recipes, where every prompt token costs training time.
COMPACT_PROMPT = ("You are a GUI agent. Reply with\nThought: ...\nAction: ...\n"
                  "Actions: click(start_box='(x,y)'), left_double(start_box='(x,y)'), "
                  "drag(start_box='(x1,y1)', end_box='(x2,y2)'), type(content=''), hotkey(key=''), "
                  "scroll(start_box='(x,y)', direction='down'), finished(content=''), FAIL\n"
                  "Task: {instruction}\n")

# The templates `rollout.prompt` names; each leaves one slot, {instruction}, for build_messages. The
# computer_use ones ask for EvoCUA's tool calls in 0-1000 relative coordinates (the compact one lists the
# actions in one line instead of the tool's JSON schema, for small CPU models); `pyautogui` is SGCD's Fig. 9
# (pyautogui code, 0-1000 relative), with OSWorld's default desktop password, and `pyautogui_think` its variant
# for thinking backbones (the thought as a [think] ... [/think] segment).
PROMPTS = {
    "uitars_official": UITARS_COMPUTER_USE.format(language=UITARS_LANGUAGE, instruction="{instruction}"),
    "uitars_v1": UITARS_V1_TEMPLATE.format(action_space=UITARS_V1_ACTION_SPACE, language=UITARS_LANGUAGE,
                                           instruction="{instruction}"),
    "compact": COMPACT_PROMPT,
    "computer_use": computer_use_prompt(RELATIVE),
    "computer_use_compact": computer_use_prompt(RELATIVE, compact=True),
    "pyautogui": pyautogui_prompt(),
    "pyautogui_think": pyautogui_prompt(think=True),
}
SYSTEM_PROMPT = PROMPTS["uitars_official"]
# the action grammar each prompt asks for (envs.actions.grammar)
PROMPT_GRAMMARS = {"uitars_official": "uitars", "uitars_v1": "uitars", "compact": "uitars", "computer_use": "computer_use",
                   "computer_use_compact": "computer_use", "pyautogui": "pyautogui",
                   "pyautogui_think": "pyautogui_think"}


# the UI-TARS coordinate convention each prompt's answers use, for a model prompted otherwise than the run
# (an SGCD baseline): UI-TARS 1.0 answers in 0-1000, UI-TARS-1.5 in pixels; the others are 0-1000 by grammar
PROMPT_COORDINATES = {"uitars_v1": "uitars-1.0"}


def coordinates_of(name: str) -> str:
    """The coordinate convention (`rollout.coordinate_model`) the prompt `name` asks for."""
    prompt_template(name)
    return PROMPT_COORDINATES.get(name, "uitars-1.5")


def prompt_template(name: str) -> str:
    """The template a recipe's `rollout.prompt` names."""
    if name not in PROMPTS:
        raise ValueError(f"rollout.prompt={name!r} is not one of {', '.join(PROMPTS)}")
    return PROMPTS[name]


def grammar_of(name: str) -> str:
    """The action grammar the prompt `rollout.prompt` names asks the policy to write."""
    prompt_template(name)
    return PROMPT_GRAMMARS[name]


def plan_conditioned_instruction(instruction: str, plan: Sequence[str]) -> str:
    """BEPA LEVEL-1: the instruction followed by the expert's plan as a numbered list (Fig. 7)."""
    if not plan:
        return instruction
    return instruction.rstrip() + "\n\n" + "\n".join(f"{i}. {step}" for i, step in enumerate(plan, 1))


def guided_instruction(instruction: str, guidance: str) -> str:
    """The instruction followed by guidance text (an SGCD skill) after a blank line; unchanged without one."""
    return instruction.rstrip() + "\n\n" + guidance if guidance else instruction


@dataclasses.dataclass
class Turn:
    """One past step: the screenshot the agent saw and the response it wrote."""

    screenshot: np.ndarray
    response: str


def build_messages(instruction: str, history: Sequence[Turn], screenshot: np.ndarray, *, max_images: int = 5,
                   plan: Sequence[str] | None = None, system_prompt: str = SYSTEM_PROMPT,
                   grammar: str = "uitars") -> tuple[list[dict[str, Any]], list[np.ndarray]]:
    """Chat messages in the Qwen2.5-VL content format plus the images they reference, in order.

    The current screenshot always counts as one of the `max_images`; older turns keep only their text, as
    the `grammar` shows a past step (`envs.actions.grammar.history_text`).
    """
    if max_images < 1:
        raise ValueError(f"max_images must be >= 1, got {max_images}")
    text = system_prompt.format(instruction=plan_conditioned_instruction(instruction, plan or ()))
    messages: list[dict[str, Any]] = [{"role": "user", "content": [{"type": "text", "text": text}]}]
    images: list[np.ndarray] = []
    first_with_image = max(0, len(history) - (max_images - 1))
    for i, turn in enumerate(history):
        if i >= first_with_image:
            messages.append({"role": "user", "content": [{"type": "image"}]})
            images.append(turn.screenshot)
        text = turn.response if i >= first_with_image else history_text(turn.response, grammar)
        messages.append({"role": "assistant", "content": [{"type": "text", "text": text}]})
    messages.append({"role": "user", "content": [{"type": "image"}]})
    images.append(screenshot)
    return messages, images
