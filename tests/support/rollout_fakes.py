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


class TableTokenizer:
    """Decodes the one token a `PromptPolicySampler` row samples back to the response it stands for."""

    def __init__(self):
        self.table: list[str] = []

    def decode(self, tokens, skip_special_tokens=True):
        return self.table[int(tokens[0]) - 1]

    def convert_tokens_to_ids(self, token):
        return 0


class TextProcessor:
    """Chat messages rendered as plain text ('<image>' per image), so a fake policy can read its prompt."""

    def __init__(self):
        self.tokenizer = TableTokenizer()

    def apply_chat_template(self, messages):
        return "\n".join(f"{m['role']}: " + "".join(c.get("text", "<image>") for c in m["content"]) for m in messages)

    def __call__(self, texts, images):
        return {"rows": len(texts), "prompts": list(texts)}


class PromptPolicySampler:
    """A sampler whose every row answers `respond(params, prompt)`; it keeps the prompts it was given."""

    def __init__(self, processor: TextProcessor, respond):
        self.table, self.respond, self.prompts = processor.tokenizer.table, respond, []

    def generate(self, params, rng, rows, prompts):
        ids = []
        for prompt in prompts:
            self.prompts.append(prompt)
            self.table.append(self.respond(params, prompt))
            ids.append(len(self.table))
        return Out(np.asarray(ids, np.int32)[:, None], np.full((rows, 1), -0.1, np.float32), np.ones((rows,), np.int64))
