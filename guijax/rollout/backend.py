"""The rollout sampler, chosen by `rollout.backend`: the JAX KV-cache sampler (the default and the reference,
on every platform) or a serving engine (vLLM on CUDA).

Every backend answers `generate(params, rng, input_ids, attention_mask, pixel_values, image_grid_thw)` with
a `SampleOutput` (response ids and their behaviour log-probs). One that preprocesses screenshots itself says
`wants_screenshots = True` and gets them as `images=` (per row, in prompt order); one that holds its own copy
of the weights says `needs_weight_sync = True` and has `sync_weights(params, version) -> WeightSync`, which
the rollout engine calls whenever the parameters it is handed change.
"""
from __future__ import annotations

import atexit
import pathlib
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
    installed; a policy with LoRA adapters (`module.lora`) is pushed its adapters (and the frozen base when the
    engine serves other weights), written under `adapter_root` (the run's workdir); a plain one (an evaluated
    model) its whole weights. Every serving sampler of the process shares one engine (`shared_engine`)."""
    backend = backend or config.rollout.get("backend", "jax")
    if backend == "jax":
        return Sampler(module, sampling, mesh=mesh)
    if backend != "vllm":
        raise ValueError(f"rollout.backend={backend!r}: not one of {BACKENDS}")
    from guijax.models.lora import from_run_config
    from guijax.rollout.serving import ServingSampler
    from guijax.rollout.vllm_engine import require_vllm

    require_vllm()
    if model_dir is None:
        raise ValueError(f"backend {backend!r} starts the engine from the policy's Hugging Face directory; this "
                         "policy has none")
    run_lora = from_run_config(config)  # the engine serves adapters whenever the run trains them
    cfg = module.cfg
    settings = dict(image_token_id=cfg.image_token_id, dtype=config.model.dtype,
                    memory_fraction=config.rollout.engine_memory_fraction,
                    max_model_len=max(config.pipeline.length_buckets), max_images=config.rollout.max_images,
                    lora_rank=run_lora.rank if run_lora is not None else 0, max_pixels=config.model.image_max_pixels,
                    vision_trained=run_lora is None and "visual" not in config.model.frozen)
    engine, served = shared_engine(backend, settings, model_dir, seed=config.seed)
    # pushed in the engine's compute dtype: float32 master weights would double the bytes for nothing
    return ServingSampler(engine, cfg, sampling, tokenizer, lora=getattr(module, "lora", None),
                          adapter_root=adapter_root, weight_dtype=config.model.dtype, served=served,
                          source_dir=model_dir, owns_engine=False)


# The process's one serving engine, shared by the trainer's rollouts and the evaluations of every stage: an
# engine is never started while another lives (one GPU holds one), and a vLLM engine deleted in its process has
# been reported to keep part of its memory (vLLM issue 21073), so one is kept and handed each user's weights.
_SHARED: dict[str, Any] = {}


def _start_vllm(model_dir: Any, settings: dict[str, Any], seed: int) -> Any:
    from guijax.rollout.vllm_engine import VllmEngine

    return VllmEngine(model_dir, seed=seed, **settings)


def shared_engine(backend: str, settings: dict[str, Any], model_dir: Any, seed: int = 0) -> tuple[Any, Any]:
    """(engine, what it serves) for `backend` with `settings`: the one kept if it was started with them, else
    a new one from `model_dir` (after the old one is closed). `seed` (the engine's own, each request carries its
    seed) does not count: a second run of the process reuses the engine."""
    from guijax.rollout.serving import ServedWeights

    key = (backend, tuple(sorted(settings.items())))
    if _SHARED.get("key") != key:
        close_shared_engine()
        engine = {"vllm": _start_vllm}[backend](model_dir, settings, seed)
        _SHARED.update(key=key, engine=engine, served=ServedWeights(started_from=pathlib.Path(model_dir)))
        if not _SHARED.get("registered"):
            atexit.register(close_shared_engine)
            _SHARED["registered"] = True
    return _SHARED["engine"], _SHARED["served"]


def close_shared_engine() -> None:
    """Close the kept engine, if any (at exit, or before one with other settings starts)."""
    engine = _SHARED.pop("engine", None)
    _SHARED.pop("key", None)
    _SHARED.pop("served", None)
    closer = getattr(engine, "close", None)
    if closer is not None:
        closer()
