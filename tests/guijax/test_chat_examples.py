"""Chat examples that are not agent steps: the answer alone carries the loss, closed with <|im_end|>; the prompt is
the chat template's rendering of the turn; they batch through the step pipeline (mixed image counts)."""
from __future__ import annotations

import numpy as np
import pytest

from guijax.data.chat_examples import ChatExample, EncodeChat, chat_messages, chat_prompt
from guijax.data.pipeline import PipelineConfig, StepRef, make_dataset

CONFIG = PipelineConfig(batch_size=3, length_buckets=(64, 128, 256, 512), patch_bucket=64, seed=0, shuffle=False)


def _image(seed: int, hw=(56, 56)) -> np.ndarray:
    return np.random.RandomState(seed).randint(0, 256, (*hw, 3), dtype=np.uint8)


EXAMPLES = [ChatExample("judged", ("Judge this:", "Keyframe 1:", _image(0), "Keyframe 2:", _image(1)), "correct"),
            ChatExample("change", ("Before:", _image(2), "After:", _image(3, (84, 56)), "What changed?"),
                        "a dialog opened"),
            ChatExample("text only", ("Say hello",), "hello")]


def test_messages_keep_the_parts_in_order():
    messages, images = chat_messages(EXAMPLES[1].parts)
    assert [c["type"] for c in messages[0]["content"]] == ["text", "image", "text", "image", "text"]
    assert len(images) == 2 and images[1].shape == (84, 56, 3)


def test_the_answer_alone_carries_the_loss_and_ends_the_turn(proc):
    encode = EncodeChat(EXAMPLES, proc, max_tokens=512)
    for i, example in enumerate(EXAMPLES):
        out = encode.map(StepRef(i, 0, 1.0))
        text, images = chat_prompt(proc, example.parts)
        prompt = proc(text=[text], images=[images] if images else None)["input_ids"][0]
        answer = proc.tokenizer(example.answer, add_special_tokens=False)["input_ids"]
        n = len(prompt)
        np.testing.assert_array_equal(out["input_ids"][:n], prompt)
        assert list(out["input_ids"][n:-1]) == answer
        assert out["input_ids"][-1] == proc.tokenizer.convert_tokens_to_ids("<|im_end|>")
        assert out["loss_mask"][:n].sum() == 0 and out["loss_mask"][n:].all()
        assert len(out["image_grid_thw"]) == sum(isinstance(p, np.ndarray) for p in example.parts)
        assert out["task_id"] == example.name and not out["sampled"]


def test_a_too_long_example_is_named(proc):
    with pytest.raises(ValueError, match="judged: .* exceed the largest length bucket 32"):
        EncodeChat(EXAMPLES, proc, max_tokens=32).map(StepRef(0, 0, 1.0))


def test_examples_batch_through_the_step_pipeline(proc, cfg):
    refs = [StepRef(i, 0, 1.0) for i in range(len(EXAMPLES))]
    data = make_dataset([], refs, proc, cfg, CONFIG, encode=EncodeChat(EXAMPLES, proc, 512))
    batch = next(iter(data))
    assert batch["input_ids"].shape[0] == 3
    answers = [len(proc.tokenizer(e.answer, add_special_tokens=False)["input_ids"]) + 1 for e in EXAMPLES]
    assert batch["loss_mask"].sum(axis=1).tolist() == answers  # shifted to prediction positions, same count
    assert int(batch["meta"]["screenshots"]) == 4 and int(batch["meta"]["unique_screenshots"]) == 4
