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
    `adapter_root` (the run's workdir); a plain one (an evaluated model) its whole weights. The serving
    samplers of the process share one engine while they can (`shared_engine`)."""
    backend = backend or config.rollout.get("backend", "jax")
    if backend == "jax":
        return Sampler(module, sampling, mesh=mesh)
    if backend != "vllm":
        raise ValueError(f"rollout.backend={backend!r}: not one of {BACKENDS}")
    from guijax.rollout.serving import ServingSampler
    from guijax.rollout.vllm_engine import require_vllm

    require_vllm()
    if model_dir is None:
        raise ValueError(f"backend {backend!r} starts the engine from the policy's Hugging Face directory; this "
                         "policy has none")
    lora = getattr(module, "lora", None)
    cfg = module.cfg
    settings = dict(image_token_id=cfg.image_token_id, dtype=config.model.dtype,
                    memory_fraction=config.rollout.engine_memory_fraction,
                    max_model_len=max(config.pipeline.length_buckets), max_images=config.rollout.max_images,
                    lora_rank=lora.rank if lora is not None else 0, max_pixels=config.model.image_max_pixels)
    # A LoRA engine serves adapters on the base it started from and takes no whole weights (vLLM renames the
    # layers it wraps for LoRA), so it serves learners of that one checkpoint; a plain one serves any model of
    # the same architecture, each pushed whole.
    serves = (repr(cfg), str(model_dir) if lora is not None else None)
    # whole weights of another model may change the vision tower: its cached screenshot features must go
    vision = lora is None and "visual" not in getattr(module, "frozen", ())
    engine, served = shared_engine(backend, settings, model_dir, seed=config.seed, serves=serves, vision=vision)
    # pushed in the engine's compute dtype: float32 master weights would double the bytes for nothing
    return ServingSampler(engine, cfg, sampling, tokenizer, lora=lora, adapter_root=adapter_root,
                          weight_dtype=config.model.dtype, served=served, owns_engine=False)


# The process's one serving engine, shared by the trainers' rollouts and the evaluations of every stage while
# they can share it: an engine is never started while another lives (one GPU holds one), and a vLLM engine
# deleted in its process has been reported to keep part of its memory (vLLM issue 21073), so one is kept and
# handed each user's weights, and replaced only for other settings, another architecture or, for LoRA, another
# base checkpoint.
_SHARED: dict[str, Any] = {}


def _start_vllm(model_dir: Any, settings: dict[str, Any], seed: int, vision: bool) -> Any:
    from guijax.rollout.vllm_engine import VllmEngine

    return VllmEngine(model_dir, seed=seed, vision_trained=vision, **settings)


def shared_engine(backend: str, settings: dict[str, Any], model_dir: Any, seed: int = 0, serves: Any = (),
                  vision: bool = True) -> tuple[Any, Any]:
    """(engine, what it serves) for `backend` with `settings`: the one kept if it was started with them for
    the same models (`serves`: the architecture, and for a LoRA engine its checkpoint), else a new one from
    `model_dir`, the old one closed first. `seed` (the engine's own; each request carries its seed) does not
    count. `vision`: this user's pushes may change the vision tower, so the engine drops its cached screenshot
    features after every push from now on."""
    from guijax.rollout.serving import ServedWeights

    key = (backend, tuple(sorted(settings.items())), serves)
    if _SHARED.get("key") != key:
        close_shared_engine()
        engine = {"vllm": _start_vllm}[backend](model_dir, settings, seed, vision)
        _SHARED.update(key=key, engine=engine, served=ServedWeights())
        if not _SHARED.get("registered"):
            atexit.register(close_shared_engine)
            _SHARED["registered"] = True
    engine = _SHARED["engine"]
    if vision and not getattr(engine, "vision_trained", True):
        engine.vision_trained = True
    return engine, _SHARED["served"]


def close_shared_engine() -> None:
    """Close the kept engine, if any (at exit, or before one with other settings starts)."""
    engine = _SHARED.pop("engine", None)
    _SHARED.pop("key", None)
    _SHARED.pop("served", None)
    closer = getattr(engine, "close", None)
    if closer is not None:
        closer()
