"""The SFT stage warns, before it trains, when the answers it trains on are longer than the rollouts let the
policy write (each sampled answer would be cut off before its action)."""
from __future__ import annotations

import numpy as np

from guijax.data.pipeline import StepRef
from guijax.pipeline.base_stages import answers_beyond_budget
from guijax.rollout.trajectory import Step, Trajectory


class WordTokenizer:
    """One token per word, and one for <|im_end|>."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": list(range(len(text.split())))}

    def convert_tokens_to_ids(self, token):
        return 0


def test_answers_longer_than_the_rollouts_budget_are_named():
    screen = np.zeros((4, 4, 3), np.uint8)
    sampled = Step(screen, "sampled", np.arange(9, dtype=np.int32), np.zeros(9, np.float32))
    trajectories = [Trajectory("t", "do", [Step.text(screen, "a b c"), Step.text(screen, "a b c d e f g h"), sampled])]
    tokenizer = WordTokenizer()
    assert answers_beyond_budget(trajectories, None, tokenizer, 9) == ""  # 4, 9 and 9 tokens fit 9
    assert answers_beyond_budget(trajectories, None, tokenizer, 8) == (
        "2 of 3 trained answers are longer than rollout.max_new_tokens=8 (up to 9 tokens): the policy's own "
        "answers will be cut off before their action")
    assert answers_beyond_budget(trajectories, [StepRef(0, 0, 1.0)], tokenizer, 8) == ""  # only trained steps count
