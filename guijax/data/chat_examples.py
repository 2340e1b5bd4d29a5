"""Supervised examples that are not agent steps: one user turn of text and images, and the answer to learn.

A judge or captioner trained in guijax (SEAgent's World State Model) reads prompts the agent never sees: a
whole episode's keyframes under a judging prompt, or a before/after pair of screenshots. `ChatExample` holds
such a turn as its parts in order; `EncodeChat` turns it into the same example dict `EncodeStep` makes for an
agent step (the answer carries the loss, as off-policy response text does), so the batch pipeline, the
train step and `sft_steps` take it unchanged; `chat_prompt` renders the same turn for the sampler.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import grain
import numpy as np

from guijax.data.pipeline import supervised_tokens, text_response
from guijax.rollout.trajectory import Source

Part = str | np.ndarray  # text, or an [H, W, 3] uint8 image


@dataclasses.dataclass(frozen=True)
class ChatExample:
    """One user turn (`parts`: text and images in order) and the `answer` that carries the loss; `name` says
    which example it is in errors."""

    name: str
    parts: tuple[Part, ...]
    answer: str


def chat_messages(parts: Sequence[Part]) -> tuple[list[dict[str, Any]], list[np.ndarray]]:
    """One user message in the Qwen-VL content format, and its images in order."""
    content: list[dict[str, Any]] = []
    images: list[np.ndarray] = []
    for part in parts:
        if isinstance(part, str):
            content.append({"type": "text", "text": part})
        else:
            content.append({"type": "image"})
            images.append(np.asarray(part))
    return [{"role": "user", "content": content}], images


def chat_prompt(processor: Any, parts: Sequence[Part]) -> tuple[str, list[np.ndarray]]:
    """The turn rendered with the chat template up to the assistant's answer, and its images: what the sampler
    is given to write the answer."""
    messages, images = chat_messages(parts)
    return processor.apply_chat_template(messages, add_generation_prompt=True), images


class EncodeChat(grain.transforms.Map):
    """StepRef (its `trajectory` indexes `examples`) -> the example dict of guijax.data.pipeline.EncodeStep."""

    def __init__(self, examples: Sequence[ChatExample], processor: Any, max_tokens: int):
        self.examples, self.processor, self.max_tokens = list(examples), processor, max_tokens

    def map(self, ref: Any) -> dict[str, Any]:
        example = self.examples[ref.trajectory]
        text, images = chat_prompt(self.processor, example.parts)
        proc = self.processor
        prompt = proc(text=[text], images=[images] if images else None)
        answer = text_response(proc.tokenizer, example.answer)
        dim = 3 * proc.image_processor.temporal_patch_size * proc.image_processor.patch_size ** 2
        pixels = prompt.get("pixel_values")
        return {**supervised_tokens(np.asarray(prompt["input_ids"][0], np.int32), answer,
                                    np.zeros(len(answer), np.float32), ref.advantage, self.max_tokens, example.name),
                "pixel_values": np.asarray(pixels if pixels is not None else np.zeros((0, dim)), np.float32),
                "image_grid_thw": np.asarray(prompt.get("image_grid_thw", np.zeros((0, 3))), np.int64).reshape(-1, 3),
                "trajectory": ref.trajectory, "step": 0, "task_id": example.name,
                "source": Source.EXPERT.value, "sampled": False}
