"""vLLM behind `guijax.rollout.serving.ServingEngine`: the rollouts' sampler on CUDA, in the learner's process.

vLLM is an optional extra (`pip install vllm`, which brings its own CUDA PyTorch); nothing here imports it
until an engine is built. The engine starts from the policy's Hugging Face directory and is then handed the
learner's parameters after every update through its model's `load_weights` (checkpoint names, no disk round
trip; on the GPU they share, JAX's arrays are handed over by DLPack, not through host memory), and its
prefix cache and (where vLLM has one) its cache of vision-encoder outputs are reset, so neither KV nor
screenshot features computed with the old weights are reused. LoRA runs hand it the adapter directory instead
(the vision tower is frozen under LoRA, so its cached features stay valid). Prompts go in as the trainer's
token ids, each screenshot's image-pad run cut to one token for vLLM to expand with its own image processor;
`ServingSampler` then checks that vLLM's expanded prompt is the trainer's token for token. One GPU per
engine: the model must live in this process for `load_weights` to reach it.

Its log-probs are `processed_logprobs`: after temperature and logit bias, as the JAX sampler's are (the
serving sampler refuses top-k/top-p, after which vLLM's would be of the truncated distribution).

Written against vLLM's offline `LLM` API as read in its source, and never run: vLLM cannot be installed on
this project's machines. The adapter's requests and answers are tested on CPU against a stand-in `vllm`
module; the test against vLLM itself is marked `gpu` and skips without vLLM and a GPU.

vLLM takes its share of the GPU (`rollout.engine_memory_fraction`) beside JAX's, which by default
preallocates 75% of it: the preflight asks for `XLA_PYTHON_CLIENT_MEM_FRACTION` to leave vLLM its share.
"""
from __future__ import annotations

import os
import pathlib
from typing import Any, Iterable, Sequence

import jax
import numpy as np
from absl import logging

from guijax.rollout.serving import EngineOutput, EngineRequest, EngineSampling, collapse_image_pads

INSTALL = "pip install vllm  (CUDA only; it brings its own PyTorch)"
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the adapter ranks vLLM serves


def require_vllm() -> Any:
    """The vllm module, or an error that says how to install it."""
    try:
        import vllm
    except ImportError as err:
        raise ImportError(f"rollout.backend='vllm' needs vLLM, which is not installed ({err}): {INSTALL}") from None
    return vllm


def _torch_tensor(array: Any) -> Any:
    """An array as a torch tensor without a copy: a JAX array on the GPU (or CPU) by DLPack, where it lies; a
    host numpy array in place (bfloat16 through its bits)."""
    import torch

    if isinstance(array, jax.Array):
        return torch.from_dlpack(array)
    if array.dtype.name == "bfloat16":
        return torch.from_numpy(np.ascontiguousarray(array).view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(array))


class VllmEngine:
    """One in-process `vllm.LLM` over `model_dir` (the policy's checkpoint directory)."""

    def __init__(self, model_dir: str | pathlib.Path, *, image_token_id: int, dtype: str = "bfloat16",
                 memory_fraction: float = 0.5, max_model_len: int = 16384, max_images: int = 5, seed: int = 0,
                 lora_rank: int = 0, max_pixels: int = 0, vision_trained: bool = True):
        vllm = require_vllm()
        # the model must live in this process for `load_weights` to reach it
        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0") != "0":
            logging.warning("VLLM_ENABLE_V1_MULTIPROCESSING=%s set to 0: the trainer hands vLLM its weights in "
                            "this process", os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"])
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        self.vision_trained = vision_trained
        kwargs: dict[str, Any] = dict(model=str(model_dir), dtype=dtype, gpu_memory_utilization=memory_fraction,
                                      max_model_len=max_model_len, seed=seed, enable_prefix_caching=True,
                                      limit_mm_per_prompt={"image": max_images},
                                      logprobs_mode="processed_logprobs")
        if lora_rank:
            served = next((r for r in LORA_RANKS if r >= lora_rank), None)
            if served is None:
                raise ValueError(f"lora.rank={lora_rank}: vLLM serves adapters of rank up to {LORA_RANKS[-1]}")
            kwargs.update(enable_lora=True, max_lora_rank=served, max_loras=1)
        if max_pixels:
            kwargs["mm_processor_kwargs"] = {"max_pixels": max_pixels}
        self._vllm = vllm
        self.llm = vllm.LLM(**kwargs)
        # vLLM runs on this process's first GPU, which is JAX's first too: weights are handed over there
        gpus = [d for d in jax.local_devices() if d.platform == "gpu"]
        self.weights_device = gpus[0] if gpus else None
        self.image_token_id = image_token_id
        self._lora: Any = None
        self._adapters_loaded = 0  # each adapter gets an id of its own: vLLM keeps adapters it saw by id

    def _model(self) -> Any:
        executor = self.llm.llm_engine.model_executor
        worker = executor.driver_worker
        runner = getattr(worker, "worker", worker).model_runner
        return runner.get_model() if hasattr(runner, "get_model") else runner.model

    def _reset_caches(self, vision_changed: bool) -> None:
        """Drop what the old weights computed: the KV of cached prefixes, and, when the vision tower changed,
        the cached features of screenshots seen before (rollouts meet the same screens again and again)."""
        if self.llm.reset_prefix_cache() is False:
            raise RuntimeError("vLLM did not reset its prefix cache after new weights (requests still running?)")
        if not vision_changed:
            return
        for owner in (self.llm, self.llm.llm_engine):
            reset = getattr(owner, "reset_encoder_cache", None)
            if reset is not None:
                reset()
                return
        raise RuntimeError("this vLLM has no reset_encoder_cache: after new weights it would reuse screenshot "
                           "features from the old vision tower; upgrade vLLM (or, to train on it, freeze the tower: "
                           "--config.model.frozen=\"('visual',)\"; evaluations on it need the reset)")

    def load_weights(self, tensors: Iterable[tuple[str, Any]]) -> None:
        def handed():
            for name, array in tensors:
                yield name, _torch_tensor(array)
                # resumed when vLLM asks for the next tensor: its copies out of this one (a JAX buffer handed
                # over by DLPack, which JAX may reuse once the array is dropped) finish first
                if isinstance(array, jax.Array) and self.weights_device is not None:
                    import torch

                    torch.cuda.synchronize()

        self._model().load_weights(handed())
        self._lora = None  # an adapter was for the weights these replace
        self._reset_caches(self.vision_trained)

    def load_adapter(self, directory: pathlib.Path, version: int) -> None:
        from vllm.lora.request import LoRARequest

        self._adapters_loaded += 1  # vLLM tells adapters apart by name and id: both new for every push
        self._lora = LoRARequest(f"guijax-{self._adapters_loaded}-v{version}", self._adapters_loaded, str(directory))
        self._reset_caches(False)

    def close(self) -> None:
        """Give the engine's GPU memory back (at exit, or before an engine with other settings replaces it): the
        engine dropped, then vLLM's own teardown of its distributed state and memory
        (`cleanup_dist_env_and_memory`, where this vLLM has it). An in-process vLLM engine has been reported to
        keep some of its memory all the same (vLLM issue 21073), which is why a process keeps one engine."""
        import gc

        llm, self.llm = self.llm, None
        del llm
        gc.collect()
        try:
            from vllm.distributed import cleanup_dist_env_and_memory
        except ImportError:
            cleanup_dist_env_and_memory = None
        if cleanup_dist_env_and_memory is not None:
            cleanup_dist_env_and_memory()
            return
        try:
            import torch

            torch.cuda.empty_cache()
        except (ImportError, RuntimeError):
            pass

    def generate(self, requests: Sequence[EngineRequest], sampling: EngineSampling) -> list[EngineOutput]:
        from PIL import Image
        from vllm.inputs import TokensPrompt

        prompts, params = [], []
        for r, request in enumerate(requests):
            prompt: dict[str, Any] = {"prompt_token_ids": collapse_image_pads(request.prompt_token_ids,
                                                                              self.image_token_id)}
            if request.images:
                prompt["multi_modal_data"] = {"image": [Image.fromarray(np.asarray(im)) for im in request.images]}
            prompts.append(TokensPrompt(**prompt))
            params.append(self._vllm.SamplingParams(
                n=1, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k or -1,
                max_tokens=sampling.max_new_tokens, stop_token_ids=list(sampling.stop_token_ids), logprobs=0,
                seed=sampling.seed + r, logit_bias={int(i): -100.0 for i in sampling.banned_token_ids} or None,
                skip_special_tokens=False, spaces_between_special_tokens=False))
        results = self.llm.generate(prompts, params, use_tqdm=False, lora_request=self._lora)
        outputs = []
        for result in results:
            sample = result.outputs[0]
            ids = list(sample.token_ids)
            logps = [entry[token].logprob for token, entry in zip(ids, sample.logprobs or [])]
            outputs.append(EngineOutput(list(result.prompt_token_ids), ids, logps,
                                        "stop" if sample.finish_reason == "stop" else "length", sample.text))
        return outputs
