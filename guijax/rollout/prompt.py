"""UI-TARS agent prompts: the computer-use system prompt (BEPA Fig. 11), the instruction (optionally with a
numbered plan appended, BEPA Fig. 7), and a multi-turn history in which the last K screenshots are images
and every earlier step survives as its text response only (K >= steps gives ARPO's full history).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

SYSTEM_PROMPT = """You are a GUI agent. You are given a task and your action history, with screenshots. You need to perform the next action to complete the task.

## Output Format
```
Thought: ...
Action: ...
```

## Action Space

click(start_box='<|box_start|>(x1,y1)<|box_end|>')
left_double(start_box='<|box_start|>(x1,y1)<|box_end|>')
right_single(start_box='<|box_start|>(x1,y1)<|box_end|>')
drag(start_box='<|box_start|>(x1,y1)<|box_end|>', end_box='<|box_start|>(x3,y3)<|box_end|>')
hotkey(key='')
type(content='xxx') # Use escape characters \\', \\", and \\n in content part to ensure we can parse the content in normal python string format. If you want to submit your input, use \\n at the end of content.
scroll(start_box='<|box_start|>(x1,y1)<|box_end|>', direction='down or up or right or left')
wait() #Sleep for 5s and take a screenshot to check for any changes.
finished(content='xxx') # Use escape characters \\', \\", and \\n in content part to ensure we can parse the content in normal python string format.

## Note
- Use English in both the Thought and Action parts.
- In the Thought part, write a brief plan and end with one sentence that clearly summarizes your next action and its target element.

## User Instruction
{instruction}
"""

# A short variant for CPU recipes, where every prompt token costs training time.
COMPACT_PROMPT = ("You are a GUI agent. Reply with\nThought: ...\nAction: ...\n"
                  "Actions: click(start_box='(x,y)'), left_double(start_box='(x,y)'), "
                  "drag(start_box='(x1,y1)', end_box='(x2,y2)'), type(content=''), hotkey(key=''), "
                  "scroll(start_box='(x,y)', direction='down'), finished(content=''), FAIL\n"
                  "Task: {instruction}\n")


def plan_conditioned_instruction(instruction: str, plan: Sequence[str]) -> str:
    """BEPA LEVEL-1: the instruction followed by the expert's plan as a numbered list (Fig. 7)."""
    if not plan:
        return instruction
    return instruction.rstrip() + "\n\n" + "\n".join(f"{i}. {step}" for i, step in enumerate(plan, 1))


@dataclasses.dataclass
class Turn:
    """One past step: the screenshot the agent saw and the response it wrote."""

    screenshot: np.ndarray
    response: str


def build_messages(instruction: str, history: Sequence[Turn], screenshot: np.ndarray, *, max_images: int = 5,
                   plan: Sequence[str] | None = None,
                   system_prompt: str = SYSTEM_PROMPT) -> tuple[list[dict[str, Any]], list[np.ndarray]]:
    """Chat messages in the Qwen2.5-VL content format plus the images they reference, in order.

    The current screenshot always counts as one of the `max_images`; older turns keep only their text.
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
        messages.append({"role": "assistant", "content": [{"type": "text", "text": turn.response}]})
    messages.append({"role": "user", "content": [{"type": "image"}]})
    images.append(screenshot)
    return messages, images
