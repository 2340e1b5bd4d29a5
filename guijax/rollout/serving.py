"""Rollouts sampled by a serving engine (vLLM, or any engine behind `ServingEngine`) instead of the JAX
sampler, with the trainer's tokens kept exact.

The engine gets the prompt token ids the trainer encoded (image placeholders included) and the screenshots
themselves; its answer is checked before any of it is trained on: the prompt ids the engine ran must be the
trainer's (an engine that resizes screenshots differently would expand them into another number of image
tokens), and the text it returns should be what its token ids decode to (a difference is logged: the rollout
keeps the trainer's decoding). The behaviour log-probs it returns are
the engine's own; the trainer logs their gap to its recomputation (`behaviour_logp_abs_diff`, `behaviour_kl`)
and `train.behaviour_correction` weighs each token by the truncated ratio.

The engine serves the learner's parameters through `sync_weights`: every tensor in the released checkpoints'
names (what engines load), one at a time, through host memory or, for an engine on the learner's accelerator
(`weights_device`), as arrays on that device it takes by DLPack; for LoRA runs, the adapters alone in PEFT's
format. The rollout engine calls it whenever the parameters it is handed change, and the time it takes is
logged per iteration (`time_weight_sync_s`).
"""
from __future__ import annotations

import copy
import dataclasses
import pathlib
import shutil
import tempfile
import time
from typing import Any, Iterable, Protocol, Sequence

import jax
import numpy as np
from absl import logging

from guijax.models.config import ModelConfig
from guijax.models.lora import LoraConfig
from guijax.sampling import SampleOutput, SamplingConfig, vision_placeholder_ids


@dataclasses.dataclass(frozen=True)
class EngineRequest:
    """One row: the trainer's prompt ids (each screenshot already expanded into its image-pad tokens) and the
    screenshots in prompt order, as uint8 [H, W, 3] arrays."""

    prompt_token_ids: tuple[int, ...]
    images: tuple[np.ndarray, ...]


@dataclasses.dataclass(frozen=True)
class EngineSampling:
    temperature: float
    top_p: float
    top_k: int  # 0: off
    max_new_tokens: int
    stop_token_ids: tuple[int, ...]
    banned_token_ids: tuple[int, ...]  # never sampled (the vision placeholders)
    seed: int  # row r samples with seed + r


@dataclasses.dataclass(frozen=True)
class EngineOutput:
    prompt_token_ids: Sequence[int]  # the prompt as the engine ran it
    token_ids: Sequence[int]  # sampled, the stop token included when one ended the row
    logprobs: Sequence[float]  # behaviour log-prob of each sampled token
    finish_reason: str  # "stop" (a stop token) | "length" (max_new_tokens)
    text: str | None = None  # the engine's detokenised response, stop token left out (None: not returned)


class ServingEngine(Protocol):
    """What a serving engine must do for the trainer: sample, and load new weights without a restart."""

    def generate(self, requests: Sequence[EngineRequest], sampling: EngineSampling) -> list[EngineOutput]: ...

    def load_weights(self, tensors: Iterable[tuple[str, Any]]) -> None:
        """Replace the served weights with these checkpoint-named tensors (every tensor of the model): host
        arrays, or arrays on the engine's `weights_device` when it names one (a `jax.Device`)."""

    def load_adapter(self, directory: pathlib.Path, version: int) -> None:
        """Serve the base weights with the PEFT adapter in `directory` from now on."""


@dataclasses.dataclass(frozen=True)
class WeightSync:
    """One push of the learner's parameters to the sampler."""

    version: int
    seconds: float
    bytes: int
    tensors: int
    adapters_only: bool = False


class PromptMismatchError(RuntimeError):
    """The engine ran a prompt other than the one the trainer scores: training on its samples would be wrong."""


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def row_prompts(input_ids: np.ndarray, attention_mask: np.ndarray) -> list[tuple[int, ...]]:
    """Each row's prompt ids without padding (left or right)."""
    ids, mask = np.asarray(input_ids), np.asarray(attention_mask)
    return [tuple(int(t) for t in row[m > 0]) for row, m in zip(ids, mask)]


def collapse_image_pads(prompt_token_ids: Sequence[int], image_token_id: int) -> list[int]:
    """Each run of image-pad tokens cut to one, the form engines that expand screenshots themselves take."""
    out: list[int] = []
    for t in prompt_token_ids:
        if not (t == image_token_id and out and out[-1] == image_token_id):
            out.append(int(t))
    return out


@dataclasses.dataclass
class ServedWeights:
    """What an engine shared by several samplers serves, held beside it so every sampler sees the others'
    pushes: a test of whether given parameters are the last ones any of them handed the engine."""

    last: Any = None
    version: int = 0  # the version those parameters were pushed as


class ServingSampler:
    """The rollout engine's sampler, backed by a serving engine. `params` passed to `generate` are ignored:
    the engine serves what the last `sync_weights` pushed.

    The engine started from this policy's checkpoint, so under LoRA its base is the policy's and only adapters
    are pushed. An engine shared with other samplers (`served` given: the process's one engine, see
    guijax.rollout.backend) is pushed again whenever another sampler handed it other weights, and closing the
    sampler leaves it open (`owns_engine=False`)."""

    name = "serving"  # a serving engine's sampler (rollout.backend other than jax)
    needs_weight_sync = True  # the rollout engine pushes the parameters whenever they change
    wants_screenshots = True  # ... and hands over the screenshots themselves beside their patches

    def __init__(self, engine: ServingEngine, cfg: ModelConfig, config: SamplingConfig, tokenizer: Any, *,
                 lora: LoraConfig | None = None, adapter_root: str | pathlib.Path | None = None,
                 weight_dtype: Any = None, served: ServedWeights | None = None, owns_engine: bool = True):
        if config.top_k or config.top_p < 1.0:
            raise ValueError(f"a serving engine's log-probs are of the top-k/top-p-truncated distribution, the "
                             f"trainer's of the whole one: set rollout.top_k=0 and rollout.top_p=1.0 (got "
                             f"{config.top_k} and {config.top_p}) with rollout.backend other than 'jax'")
        self.engine, self.cfg, self.config, self.tokenizer = engine, cfg, config, tokenizer
        self.lora = lora
        self.weight_dtype = weight_dtype
        self.served, self.owns_engine = served, owns_engine
        self._last: Any = None  # what this sampler pushed last
        self._adapter_root_given = pathlib.Path(adapter_root) if adapter_root else None
        self._adapter_root: pathlib.Path | None = None  # made at the first adapter push
        self.version: int | None = None
        self.last_sync: WeightSync | None = None
        self.text_mismatches = 0  # answers whose text is not what their ids decode to (logged, not fatal)

    # ------------------------------------------------------------------ weights
    def with_temperature(self, temperature: float) -> "ServingSampler":
        """The same sampler, on the same engine and weights, sampling at another temperature."""
        sibling = copy.copy(self)
        sibling.config = dataclasses.replace(self.config, temperature=temperature)
        return sibling

    def holds(self, params: Any) -> bool:
        """Whether the engine serves `params` now (the last parameters handed to it by any of its samplers)."""
        if self.served is not None:
            if self.served.last is None or not self.served.last(params):
                return False
            if self.version is None:  # another sampler of the engine pushed exactly these: nothing to push
                self.version, self._last = self.served.version, self.served.last
            return True
        return self.version is not None and self._last is not None and self._last(params)

    def sync_weights(self, params: Any, version: int) -> WeightSync:
        """Push `params` to the engine (all tensors, or the adapters alone under LoRA); returns what it cost."""
        from guijax.rollout.identity import params_matcher

        t0 = time.perf_counter()
        if self.lora is not None:
            count, size = self._push_adapters(params, version)
        else:
            count, size = self._push_weights(params)
        self._last = params_matcher(params)
        if self.served is not None:
            self.served.last, self.served.version = self._last, version
        self.version = version
        self.last_sync = WeightSync(version, time.perf_counter() - t0, size, count, self.lora is not None)
        return self.last_sync

    def _push_weights(self, params: Any) -> tuple[int, int]:
        """Every tensor of plain `params` to the engine, by checkpoint name: (tensors, bytes)."""
        from guijax.models.weights import hf_entries

        counts = [0, 0]
        device = getattr(self.engine, "weights_device", None)  # an engine on the learner's accelerator

        def tensors():
            for name, _, _, read in hf_entries(params, self.cfg, self.weight_dtype, device):
                array = read()
                counts[0] += 1
                counts[1] += array.nbytes
                yield name, array

        self.engine.load_weights(tensors())
        return counts[0], counts[1]

    def _push_adapters(self, params: Any, version: int) -> tuple[int, int]:
        from guijax.models.peft_format import WEIGHTS_FILE, save_adapter

        if self._adapter_root is None:
            root = self._adapter_root_given
            if root is not None:
                root.mkdir(parents=True, exist_ok=True)
            self._adapter_root = root or pathlib.Path(tempfile.mkdtemp(prefix="guijax-adapters-"))
        directory = self._adapter_root / f"v{version:06d}"
        if directory.exists():
            shutil.rmtree(directory)
        save_adapter(directory, params, self.cfg, self.lora)
        self.engine.load_adapter(directory, version)
        for old in self._adapter_root.glob("v*"):  # the engine has loaded this one: older ones are done with
            if old != directory:
                shutil.rmtree(old, ignore_errors=True)
        from safetensors.numpy import load_file

        tensors = load_file(str(directory / WEIGHTS_FILE))
        return len(tensors), sum(t.nbytes for t in tensors.values())

    # ------------------------------------------------------------------ sampling
    def generate(self, params: Any, rng: jax.Array, input_ids, attention_mask=None, pixel_values=None,
                 image_grid_thw=None, images: Sequence[Sequence[np.ndarray]] | None = None,
                 **_ignored) -> SampleOutput:
        del params  # the engine serves the last synced weights
        if self.version is None:
            raise RuntimeError("the serving engine has no weights from the learner yet: call sync_weights first")
        input_ids = np.asarray(input_ids)
        attention_mask = np.ones_like(input_ids) if attention_mask is None else np.asarray(attention_mask)
        prompts = row_prompts(input_ids, attention_mask)
        rows = len(prompts)
        if images is None:
            if pixel_values is not None:
                raise ValueError("a serving engine needs the screenshots themselves (images=...), not only their "
                                 "patches: it preprocesses them as it serves")
            images = [()] * rows
        if len(images) != rows:
            raise ValueError(f"{len(images)} rows of screenshots for {rows} prompts")
        starts = self.cfg.vision_start_token_id
        for r, (ids, shots) in enumerate(zip(prompts, images)):
            if starts is not None and sum(t == starts for t in ids) != len(shots):
                raise ValueError(f"row {r}: its prompt holds {sum(t == starts for t in ids)} screenshots, "
                                 f"{len(shots)} given")
        sc = self.config
        seed = int(jax.random.randint(rng, (), 0, 2 ** 31 - 1))
        banned = tuple(vision_placeholder_ids(self.cfg)) if sc.suppress_vision_tokens else ()
        sampling = EngineSampling(sc.temperature, sc.top_p, sc.top_k, sc.max_new_tokens, tuple(sc.stop_token_ids),
                                  banned, seed)
        requests = [EngineRequest(ids, tuple(np.asarray(s) for s in shots)) for ids, shots in zip(prompts, images)]
        outputs = self.engine.generate(requests, sampling)
        if len(outputs) != rows:
            raise RuntimeError(f"the serving engine answered {len(outputs)} of {rows} requests")
        return self._assemble(prompts, outputs)

    def _assemble(self, prompts: list[tuple[int, ...]], outputs: list[EngineOutput]) -> SampleOutput:
        """Check each answer against the trainer's view of it, then lay them out as the JAX sampler does."""
        sc = self.config
        rows, width = len(outputs), sc.max_new_tokens
        tokens = np.zeros((rows, width), np.int32)
        logps = np.zeros((rows, width), np.float32)
        lengths = np.zeros((rows,), np.int32)
        stopped = np.zeros((rows,), bool)
        for r, (want, out) in enumerate(zip(prompts, outputs)):
            got = tuple(int(t) for t in out.prompt_token_ids)
            if got != want:
                at = _first_difference(want, got)
                context = lambda ids: self.tokenizer.decode(list(ids[max(0, at - 8):at + 8]),  # noqa: E731
                                                            skip_special_tokens=False)
                raise PromptMismatchError(
                    f"row {r}: the engine ran a prompt of {len(got)} tokens, the trainer encoded {len(want)}; first "
                    f"difference at token {at}: trainer {context(want)!r} vs engine {context(got)!r} (a different "
                    "chat template, tokenizer or screenshot resize in the engine)")
            ids = [int(t) for t in out.token_ids]
            n = len(ids)
            if n > width or len(out.logprobs) != n:
                raise RuntimeError(f"row {r}: the engine returned {n} tokens (limit {width}) with "
                                   f"{len(out.logprobs)} log-probs")
            if out.text is not None:
                self._check_text(r, ids, out)
            tokens[r, :n] = ids
            logps[r, :n] = np.asarray(out.logprobs, np.float32)
            lengths[r] = n
            stopped[r] = out.finish_reason == "stop"
        return SampleOutput(tokens, logps, lengths, stopped)

    def _check_text(self, row: int, ids: list[int], out: EngineOutput) -> None:
        """The engine's text against what its ids decode to with the trainer's tokenizer. The rollout keeps the
        trainer's decoding either way, so a difference is logged and counted, not fatal: an engine decodes
        incrementally (a cut multi-byte character may be dropped rather than shown as U+FFFD) and leaves out
        whichever stop or end token ended the row."""
        body = ids[:-1] if out.finish_reason == "stop" and ids else ids
        decoded = self.tokenizer.decode(body, skip_special_tokens=False)
        if out.text.rstrip("\ufffd") in (decoded.rstrip("\ufffd"),
                                          self.tokenizer.decode(ids, skip_special_tokens=False).rstrip("\ufffd")):
            return
        self.text_mismatches += 1
        logging.warning("row %d: the serving engine's text %r is not what its token ids decode to with the "
                        "trainer's tokenizer, %r (%d such answers so far)", row, out.text[:200], decoded[:200],
                        self.text_mismatches)

    def close(self) -> None:
        """Remove the adapter directories pushed so far (LoRA runs) and close the engine if it is this
        sampler's own and closes."""
        if self._adapter_root is not None:
            shutil.rmtree(self._adapter_root, ignore_errors=True)
        closer = getattr(self.engine, "close", None)
        if closer is not None and self.owns_engine:
            closer()
