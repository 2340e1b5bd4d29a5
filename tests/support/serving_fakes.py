"""A serving engine for the tests, built from the JAX sampler but behaving as vLLM does towards the trainer:
it keeps its own weights (loaded from checkpoint-named tensors, in its own dtype), preprocesses the
screenshots itself (its own image processor, which may resize differently), takes prompts with one image-pad
token per screenshot and expands them, and returns the prompt it ran, the sampled ids, their log-probs and
the detokenised text."""
from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Sequence

import jax
import numpy as np

from guijax.models import lora as lora_lib
from guijax.models import peft_format, weights
from guijax.rollout.serving import EngineOutput, EngineRequest, EngineSampling, collapse_image_pads
from guijax.sampling import Sampler, SamplingConfig


class JaxServingEngine:
    def __init__(self, module: Any, image_processor: Any, tokenizer: Any, initial: Iterable[tuple[str, np.ndarray]],
                 prompt_buckets: tuple[int, ...] = (64, 128, 256, 512, 1024)):
        self.module, self.image_processor, self.tokenizer = module, image_processor, tokenizer
        self.cfg = module.cfg
        self.prompt_buckets = prompt_buckets
        self.base = weights.load_tensors(weights.ArrayReader(dict(initial)), module)
        self.params = self.base
        self.loads: list[str] = []  # "weights" / "adapter v{n}" in the order they came
        self.received: list[Any] = []  # the arrays of the last weight push, as handed over
        self.weights_device: Any = None  # set to a jax.Device to take pushed weights as arrays there
        self.requests: list[list[EngineRequest]] = []
        self._samplers: dict[Any, Sampler] = {}

    # ------------------------------------------------------------------ weights
    def load_weights(self, tensors: Iterable[tuple[str, Any]]) -> None:
        tensors = list(tensors)
        self.received = [a for _, a in tensors]
        self.base = weights.load_tensors(weights.ArrayReader({name: np.array(a) for name, a in tensors}),
                                         self.module.clone(lora=None))
        self.params = self.base
        self.loads.append("weights")

    def load_adapter(self, directory, version: int) -> None:
        template = lora_lib.combine(self.base, weights.init_adapters(self.module, jax.random.PRNGKey(0)))
        self.params = peft_format.load_adapter(directory, template, self.module)
        self.loads.append(f"adapter v{version}")

    # ------------------------------------------------------------------ sampling
    def _sampler(self, s: EngineSampling) -> Sampler:
        key = (s.temperature, s.top_p, s.top_k, s.max_new_tokens, s.stop_token_ids)
        if key not in self._samplers:
            self._samplers[key] = Sampler(self.module, SamplingConfig(
                temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_new_tokens=s.max_new_tokens,
                stop_token_ids=s.stop_token_ids, prompt_buckets=self.prompt_buckets, patch_bucket=64))
        return self._samplers[key]

    def _expand(self, ids: list[int], counts: list[int]) -> list[int]:
        """One image-pad token per screenshot -> as many as the engine's own preprocessing makes of it."""
        out, left = [], iter(counts)
        for t in ids:
            out += [t] * next(left) if t == self.cfg.image_token_id else [t]
        return out

    def generate(self, requests: Sequence[EngineRequest], sampling: EngineSampling) -> list[EngineOutput]:
        self.requests.append(list(requests))
        merge = self.image_processor.merge_size ** 2
        shots = [im for r in requests for im in r.images]
        vision = self.image_processor(shots) if shots else None
        counts = iter([] if vision is None else [int(np.prod(g)) // merge for g in vision["image_grid_thw"]])
        prompts = []
        for r in requests:
            collapsed = collapse_image_pads(r.prompt_token_ids, self.cfg.image_token_id)
            prompts.append(self._expand(collapsed, [next(counts) for _ in r.images]))
        width = max(len(p) for p in prompts)
        ids = np.zeros((len(prompts), width), np.int32)
        mask = np.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, :len(p)], mask[i, :len(p)] = p, 1
        out = self._sampler(sampling).generate(
            self.params, jax.random.PRNGKey(sampling.seed), ids, mask,
            None if vision is None else vision["pixel_values"], None if vision is None else vision["image_grid_thw"])
        answers = []
        for i, prompt in enumerate(prompts):
            n = int(out.lengths[i])
            tokens = [int(t) for t in out.tokens[i, :n]]
            stopped = bool(out.stopped[i])
            body = tokens[:-1] if stopped else tokens
            answers.append(EngineOutput(prompt, tokens, [float(x) for x in out.logprobs[i, :n]],
                                        "stop" if stopped else "length",
                                        self.tokenizer.decode(body, skip_special_tokens=False)))
        return answers


@dataclasses.dataclass
class Tampered:
    """An engine whose answers pass through `change(row, output) -> output`."""

    engine: JaxServingEngine
    change: Any

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate(self, requests, sampling):
        return [self.change(i, o) for i, o in enumerate(self.engine.generate(requests, sampling))]
