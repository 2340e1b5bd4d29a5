"""vLLM as the rollouts' sampler, on a tiny fresh checkpoint: its greedy samples equal the JAX sampler's from
the same weights, and weights pushed after an update change what it samples. Needs vLLM and a CUDA GPU;
skipped elsewhere (vLLM is an optional install: `pip install vllm`)."""
from __future__ import annotations

import jax
import numpy as np
import pytest

from guijax.models import weights
from guijax.models.config import get_preset
from guijax.models.fresh import create_checkpoint
from guijax.models.processor import Processor
from guijax.models.tokenizer import special_token_ids
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
