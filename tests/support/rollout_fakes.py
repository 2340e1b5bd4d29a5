"""Stand-ins for the rollout engine's sampler, tokenizer and processor, shared by the engine and stream tests
(no model needed): every row samples three tokens that decode to `FakeTokenizer.response`."""
from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class Out:
    tokens: np.ndarray
    logprobs: np.ndarray
    lengths: np.ndarray


class FakeSampler:
    def generate(self, params, rng, **inputs):
        b = inputs["rows"]
        return Out(np.ones((b, 3), np.int32), np.full((b, 3), -0.1, np.float32), np.full((b,), 3))


class FakeTokenizer:
    response = "Thought: done.\nAction: finished(content='ok')"

    def decode(self, tokens, skip_special_tokens=True):
        return self.response

    def convert_tokens_to_ids(self, token):
        return 0


class FakeProcessor:
    tokenizer = FakeTokenizer()

    def apply_chat_template(self, messages):
        return "prompt"

    def __call__(self, texts, images):
        return {"rows": len(texts)}
