"""vLLM as the rollouts' sampler. On CPU, against a stand-in `vllm` package: the adapter's engine arguments,
requests (one image pad per screenshot, per-row seeds, banned placeholders), its reading of the answers, the
weight and adapter pushes with their cache resets, and what it refuses. With vLLM and a CUDA GPU (`gpu`,
skipped elsewhere; vLLM is an optional install, `pip install vllm`), on a tiny fresh checkpoint: its greedy
samples equal the JAX sampler's from the same weights and follow pushed weights."""
from __future__ import annotations

import sys
import types

import jax
import numpy as np
import pytest

from guijax.models import weights
from guijax.models.config import get_preset
from guijax.models.fresh import create_checkpoint
from guijax.models.processor import Processor
from guijax.models.tokenizer import special_token_ids
from guijax.rollout import backend
from guijax.rollout.backend import make_sampler
from guijax.sampling import Sampler, SamplingConfig


def test_make_sampler_names_the_install_command_when_vllm_is_missing(tiny_config, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_vllm(name, *args, **kwargs):
        if name == "vllm" or name.startswith("vllm."):
            raise ImportError("No module named 'vllm'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_vllm)
    config = tiny_config("grpo_cpu", "rollout.backend=vllm")
    with pytest.raises(ImportError, match=r"rollout.backend='vllm' needs vLLM, which is not installed.*: pip install vllm"):
        make_sampler(config, None, SamplingConfig(), None, None, "/nowhere")


def test_make_sampler_gives_the_jax_sampler_by_default(tiny_config, cfg):
    module = weights.build_module(cfg)
    assert isinstance(make_sampler(tiny_config("grpo_cpu"), module, SamplingConfig(), None, None), Sampler)


class _Logprob:
    def __init__(self, logprob):
        self.logprob = logprob


class _Model:
    def __init__(self):
        self.loaded = {}

    def load_weights(self, weights):
        self.loaded.update(dict(weights))


class _LLM:
    """`vllm.LLM` as far as the adapter uses it: records its arguments, requests and cache resets, and answers
    every request with the ids 5, 6 then the stop id, the prompt's image pads expanded four to one."""

    instances: list = []

    def __init__(self, **kwargs):
        self.kwargs, self.requests, self.resets = kwargs, [], []
        self.model = _Model()
        runner = types.SimpleNamespace(model=self.model)
        self.llm_engine = types.SimpleNamespace(model_executor=types.SimpleNamespace(
            driver_worker=types.SimpleNamespace(worker=types.SimpleNamespace(model_runner=runner))))
        _LLM.instances.append(self)

    def reset_prefix_cache(self):
        self.resets.append("prefix")
        return True

    def reset_encoder_cache(self):
        self.resets.append("encoder")

    def generate(self, prompts, params, use_tqdm=True, lora_request=None):
        self.requests.append((prompts, params, lora_request))
        out = []
        for prompt in prompts:
            ids = [t for p in prompt["prompt_token_ids"] for t in ([p] * 4 if p == PAD else [p])]
            sample = types.SimpleNamespace(token_ids=(5, 6, STOP), finish_reason="stop", text="ab",
                                           logprobs=[{5: _Logprob(-0.5)}, {6: _Logprob(-1.0)}, {STOP: _Logprob(-0.25)}])
            out.append(types.SimpleNamespace(prompt_token_ids=ids, outputs=[sample]))
        return out


PAD, STOP = 3, 9


@pytest.fixture
def stand_in_vllm(monkeypatch):
    """A `vllm` package of stand-ins, so the adapter's requests and its reading of the answers run on CPU."""
    vllm = types.ModuleType("vllm")
    vllm.LLM = _LLM
    vllm.SamplingParams = lambda **kw: types.SimpleNamespace(**kw)
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = dict
    lora = types.ModuleType("vllm.lora")
    request = types.ModuleType("vllm.lora.request")
    request.LoRARequest = lambda name, int_id, path: (name, int_id, path)
    distributed = types.ModuleType("vllm.distributed")
    distributed.cleanups = []
    distributed.cleanup_dist_env_and_memory = lambda: distributed.cleanups.append("cleanup")
    for name, module in (("vllm", vllm), ("vllm.inputs", inputs), ("vllm.lora", lora), ("vllm.lora.request", request),
                         ("vllm.distributed", distributed)):
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    _LLM.instances.clear()
    backend.close_shared_engine()
    yield _LLM.instances
    backend.close_shared_engine()  # no stand-in engine outlives its test


def test_the_vllm_adapter_sends_the_trainers_prompts_and_reads_the_answers(stand_in_vllm, tmp_path):
    import os

    import ml_dtypes

    from guijax.rollout.serving import EngineRequest, EngineSampling
    from guijax.rollout.vllm_engine import VllmEngine

    engine = VllmEngine(tmp_path, image_token_id=PAD, dtype="bfloat16", memory_fraction=0.3, max_model_len=2048,
                        max_images=5, seed=7, lora_rank=12, max_pixels=12544)
    [llm] = stand_in_vllm
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"  # in-process, or load_weights cannot reach it
    assert llm.kwargs == dict(model=str(tmp_path), dtype="bfloat16", gpu_memory_utilization=0.3, max_model_len=2048,
                              seed=7, enable_prefix_caching=True, limit_mm_per_prompt={"image": 5},
                              logprobs_mode="processed_logprobs", enable_lora=True, max_lora_rank=16, max_loras=1,
                              mm_processor_kwargs={"max_pixels": 12544})
    shot = np.random.RandomState(0).randint(0, 255, (28, 56, 3), np.uint8)
    requests = [EngineRequest((1, PAD, PAD, PAD, PAD, 2), (shot,)), EngineRequest((1, 2), ())]
    sampling = EngineSampling(temperature=0.7, top_p=1.0, top_k=0, max_new_tokens=8, stop_token_ids=(STOP,),
                              banned_token_ids=(PAD, 4), seed=100)
    out = engine.generate(requests, sampling)
    prompts, params, lora = llm.requests[0]
    assert [p["prompt_token_ids"] for p in prompts] == [[1, PAD, 2], [1, 2]]  # one pad per screenshot
    np.testing.assert_array_equal(np.asarray(prompts[0]["multi_modal_data"]["image"][0]), shot)
    assert "multi_modal_data" not in prompts[1] and lora is None
    assert [(p.seed, p.top_k, p.temperature, p.max_tokens, p.logprobs) for p in params] == [
        (100, -1, 0.7, 8, 0), (101, -1, 0.7, 8, 0)]
    assert params[0].logit_bias == {PAD: -100.0, 4: -100.0} and params[0].stop_token_ids == [STOP]
    assert params[0].skip_special_tokens is False
    assert out[0].prompt_token_ids == [1, PAD, PAD, PAD, PAD, 2] and out[0].token_ids == [5, 6, STOP]
    assert out[0].logprobs == [-0.5, -1.0, -0.25] and out[0].finish_reason == "stop" and out[0].text == "ab"

    weights = np.arange(6, dtype=np.float32).reshape(2, 3).astype(ml_dtypes.bfloat16)
    engine.load_weights([("model.norm.weight", weights)])
    loaded = llm.model.loaded["model.norm.weight"]
    assert str(loaded.dtype) == "torch.bfloat16" and loaded.float().numpy().tolist() == weights.astype(np.float32).tolist()
    assert llm.resets == ["prefix", "encoder"]  # the vision tower trains: its cached features are stale too
    on_device = jax.numpy.arange(6, dtype=jax.numpy.bfloat16).reshape(3, 2)  # a JAX array: taken by DLPack
    engine.load_weights([("model.embed_tokens.weight", on_device)])
    taken = llm.model.loaded["model.embed_tokens.weight"]
    assert str(taken.dtype) == "torch.bfloat16" and taken.float().numpy().tolist() == np.asarray(
        on_device, np.float32).tolist()
    del llm.resets[2:]
    engine.load_adapter(tmp_path / "v000003", 3)
    assert llm.resets[2:] == ["prefix"]
    engine.generate(requests[1:], sampling)
    assert llm.requests[1][2] == ("guijax-1-v3", 1, str(tmp_path / "v000003"))  # ids count the adapters loaded
    engine.load_adapter(tmp_path / "v000000", 0)  # another learner's first version: a new id all the same
    engine.generate(requests[1:], sampling)
    assert llm.requests[2][2] == ("guijax-2-v0", 2, str(tmp_path / "v000000"))
    engine.load_weights([("model.norm.weight", weights)])  # whole weights: the adapter no longer applies
    engine.generate(requests[1:], sampling)
    assert llm.requests[3][2] is None
    engine.close()
    assert engine.llm is None and sys.modules["vllm.distributed"].cleanups == ["cleanup"]  # vLLM's own teardown


def test_the_process_keeps_one_engine_while_its_users_can_share_it(stand_in_vllm, tiny_config, cfg, tmp_path):
    """Plain models of one architecture share the kept engine, each pushed whole; closing a sampler leaves it
    open; a LoRA learner gets an engine of its own checkpoint (vLLM's LoRA layers take no whole weights), the
    old one closed first; so do new settings and another architecture, but not another seed. A user whose
    pushes may change the vision tower makes the engine drop its screenshot features from then on."""
    import dataclasses

    from guijax.models.lora import from_run_config

    config = tiny_config("grpo_cpu", "rollout.backend=vllm", "lora.rank=4")
    frozen_tower = weights.build_module(cfg, frozen=("visual",))
    learner = make_sampler(config, frozen_tower, SamplingConfig(), None, None, tmp_path / "base")
    evaluated = make_sampler(config, weights.build_module(cfg), SamplingConfig(), None, None, tmp_path / "trained")
    [llm] = stand_in_vllm
    assert learner.engine is evaluated.engine and llm.kwargs["model"] == str(tmp_path / "base")
    assert "enable_lora" not in llm.kwargs and evaluated.engine.vision_trained  # the evaluated model's tower
    learner.close()
    evaluated.close()
    assert evaluated.engine.llm is llm  # still open
    lora_module = weights.build_module(cfg, lora=from_run_config(config))
    adapters = make_sampler(config, lora_module, SamplingConfig(), None, None, tmp_path / "base")
    assert evaluated.engine.llm is None and adapters.lora is not None and stand_in_vllm[1].kwargs["enable_lora"]
    assert make_sampler(config, lora_module, SamplingConfig(), None, None, tmp_path / "base").engine is adapters.engine
    other_base = make_sampler(config, lora_module, SamplingConfig(), None, None, tmp_path / "other")
    assert other_base.engine is not adapters.engine and len(stand_in_vllm) == 3
    plain = make_sampler(config, weights.build_module(cfg), SamplingConfig(), None, None, tmp_path)
    reseeded = tiny_config("grpo_cpu", "rollout.backend=vllm", "lora.rank=4", "seed=5")
    assert make_sampler(reseeded, weights.build_module(cfg), SamplingConfig(), None, None, tmp_path).engine is \
        plain.engine  # each request carries its own seed
    bigger = weights.build_module(dataclasses.replace(cfg, num_hidden_layers=cfg.num_hidden_layers + 1))
    assert make_sampler(config, bigger, SamplingConfig(), None, None, tmp_path).engine is not plain.engine
    fewer = tiny_config("grpo_cpu", "rollout.backend=vllm", "rollout.max_images=2")
    assert make_sampler(fewer, bigger, SamplingConfig(), None, None, tmp_path).engine is not stand_in_vllm[-2]
    assert len(stand_in_vllm) == 6 and all(i.kwargs for i in stand_in_vllm)


def test_the_vllm_adapter_refuses_what_vllm_cannot_serve(stand_in_vllm, tmp_path):
    from guijax.rollout.vllm_engine import VllmEngine

    with pytest.raises(ValueError, match="rank up to 512"):
        VllmEngine(tmp_path, image_token_id=PAD, lora_rank=1024)
    engine = VllmEngine(tmp_path, image_token_id=PAD)
    del _LLM.reset_encoder_cache  # a vLLM without an encoder-cache reset
    try:
        with pytest.raises(RuntimeError, match="reuse screenshot features from the old vision tower"):
            engine.load_weights([])
        VllmEngine(tmp_path, image_token_id=PAD, vision_trained=False).load_weights([])  # a frozen tower: fine
    finally:
        _LLM.reset_encoder_cache = _reset_encoder_cache


_reset_encoder_cache = _LLM.reset_encoder_cache


@pytest.mark.gpu
def test_vllm_greedy_samples_equal_the_jax_samplers_and_follow_pushed_weights(tmp_path):
    pytest.importorskip("vllm")
    from guijax.rollout.serving import ServingSampler
    from guijax.rollout.vllm_engine import VllmEngine

    path = create_checkpoint(tmp_path / "tiny", "tiny", tokenizer_vocab=1024)
    proc = Processor.from_pretrained(path)
    cfg = get_preset("tiny").replace(**special_token_ids(proc.tokenizer))
    module = weights.build_module(cfg)
    params = weights.load_params(str(path), module)
    stop = proc.tokenizer.convert_tokens_to_ids("<|im_end|>")
    config = SamplingConfig(temperature=0.0, max_new_tokens=8, stop_token_ids=(stop,))
    shots = [np.random.RandomState(i).randint(0, 255, (112, 112, 3), np.uint8) for i in range(2)]
    text = proc.apply_chat_template([{"role": "user", "content": [{"type": "image"},
                                                                  {"type": "text", "text": "click"}]}])
    inputs = proc([text, text], [[shots[0]], [shots[1]]])
    engine = VllmEngine(path, image_token_id=cfg.image_token_id, dtype="float32", memory_fraction=0.2,
                        max_model_len=1024, max_images=1)
    sampler = ServingSampler(engine, cfg, config, proc.tokenizer)
    sampler.sync_weights(params, 0)
    got = sampler.generate(None, jax.random.PRNGKey(0), images=[[shots[0]], [shots[1]]], **inputs)
    want = Sampler(module, config).generate(params, jax.random.PRNGKey(0), **inputs)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_allclose(got.logprobs, want.logprobs, atol=2e-3)
    moved = jax.tree.map(lambda x: x * 1.5, params)
    sampler.sync_weights(moved, 1)
    again = sampler.generate(None, jax.random.PRNGKey(0), images=[[shots[0]], [shots[1]]], **inputs)
    want = Sampler(module, config).generate(moved, jax.random.PRNGKey(0), **inputs)
    np.testing.assert_array_equal(again.tokens, want.tokens)
