"""The rollout sampler, chosen by `rollout.backend`: the JAX KV-cache sampler (the default and the reference,
on every platform) or a serving engine (vLLM on CUDA).

Every backend answers `generate(params, rng, input_ids, attention_mask, pixel_values, image_grid_thw)` with
a `SampleOutput` (response ids and their behaviour log-probs). One that preprocesses screenshots itself says
`wants_screenshots = True` and gets them as `images=` (per row, in prompt order); one that holds its own copy
of the weights says `needs_weight_sync = True` and has `sync_weights(params, version) -> WeightSync`, which
the rollout engine calls whenever the parameters it is handed change.
"""
from __future__ import annotations

from typing import Any, Protocol

import jax

from guijax.sampling import SampleOutput, Sampler, SamplingConfig

BACKENDS = ("jax", "vllm")


class RolloutSampler(Protocol):
    def generate(self, params: Any, rng: jax.Array, input_ids: Any, attention_mask: Any = None,
                 pixel_values: Any = None, image_grid_thw: Any = None, **screenshots: Any) -> SampleOutput: ...


def make_sampler(config: Any, module: Any, sampling: SamplingConfig, mesh: jax.sharding.Mesh | None,
                 tokenizer: Any, model_dir: Any = None, adapter_root: Any = None,
                 backend: str | None = None) -> RolloutSampler:
    """The sampler `backend` (default: `config.rollout.backend`) names, for `module`'s policy. A serving engine starts from
    `model_dir` (the policy's Hugging Face directory) and fails here, before any rollout, when it is not
    installed; a policy with LoRA adapters (`module.lora`) is pushed its adapters alone, written under
    `adapter_root` (the run's workdir); a plain one (an evaluated model) its whole weights."""
    backend = backend or config.rollout.get("backend", "jax")
    if backend == "jax":
        return Sampler(module, sampling, mesh=mesh)
    if backend != "vllm":
        raise ValueError(f"rollout.backend={backend!r}: not one of {BACKENDS}")
    from guijax.rollout.serving import ServingSampler
    from guijax.rollout.vllm_engine import VllmEngine, require_vllm

    require_vllm()
    if model_dir is None:
        raise ValueError(f"backend {backend!r} starts the engine from the policy's Hugging Face directory; this "
                         "policy has none")
    lora = getattr(module, "lora", None)
    cfg = module.cfg
    engine = VllmEngine(model_dir, image_token_id=cfg.image_token_id, dtype=config.model.dtype,
                        memory_fraction=config.rollout.engine_memory_fraction,
                        max_model_len=max(config.pipeline.length_buckets), max_images=config.rollout.max_images,
                        seed=config.seed, lora_rank=lora.rank if lora is not None else 0,
                        max_pixels=config.model.image_max_pixels,
                        vision_trained=lora is None and "visual" not in config.model.frozen)
    # pushed in the engine's compute dtype: float32 master weights would double the bytes for nothing
    return ServingSampler(engine, cfg, sampling, tokenizer, lora=lora, adapter_root=adapter_root,
                          weight_dtype=config.model.dtype)
