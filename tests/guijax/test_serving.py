"""Rollouts on a serving engine, against a fake engine made of the JAX sampler (tests/support/serving_fakes.py):
the learner's weights reach it by checkpoint names (or adapters alone), its prompts are checked token for token
against the trainer's, its answers are laid out as the JAX sampler's, and the rollout engine pushes weights only
when the parameters change."""
from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from guijax.models import lora as lora_lib
from guijax.models import weights
from guijax.rollout.serving import (EngineOutput, PromptMismatchError, ServingSampler, collapse_image_pads,
                                    row_prompts)
from guijax.sampling import Sampler, SamplingConfig
from serving_fakes import JaxServingEngine, Tampered

SHOTS = [np.random.RandomState(i).randint(0, 255, (56 + 28 * i, 84, 3), np.uint8) for i in range(3)]


def _sampling(proc, **kw) -> SamplingConfig:
    stop = proc.tokenizer.convert_tokens_to_ids("<|im_end|>")
    return SamplingConfig(**{"temperature": 1.0, "max_new_tokens": 6, "stop_token_ids": (stop,),
                             "prompt_buckets": (64, 128, 256, 512, 1024), "patch_bucket": 64, **kw})


def _prompts(proc):
    """Two chat prompts, one with two screenshots and one with one, as the rollout engine encodes them."""
    def text(n, words):
        content = [{"type": "image"}] * n + [{"type": "text", "text": words}]
        return proc.apply_chat_template([{"role": "user", "content": content}])
    images = [SHOTS[:2], SHOTS[2:]]
    return proc([text(2, "click the button"), text(1, "open the menu")], images), images


@pytest.fixture(scope="module")
def learner(cfg):
    module = weights.build_module(cfg)
    return module, weights.init_params(module, jax.random.PRNGKey(1))


def _engine(learner, proc, image_processor=None, dtype=jnp.float32):
    """A fake engine started from other weights than the learner's (as vLLM starts from the checkpoint)."""
    module, _ = learner
    start = weights.init_params(module, jax.random.PRNGKey(7))
    served = module.clone(dtype=dtype)
    return JaxServingEngine(served, image_processor or proc.image_processor, proc.tokenizer,
                            [(name, read()) for name, _, _, read in weights.hf_entries(start, module.cfg)])


def test_sync_hands_the_engine_the_learners_weights_by_checkpoint_name(learner, proc):
    module, params = learner
    engine = _engine(learner, proc)
    sampler = ServingSampler(engine, module.cfg, _sampling(proc), proc.tokenizer)
    pushed = sampler.sync_weights(params, version=3)
    chex.assert_trees_all_close(engine.params, params)
    entries = weights.hf_entries(params, module.cfg)
    assert (pushed.version, pushed.tensors, pushed.adapters_only) == (3, len(entries), False)
    assert pushed.bytes == sum(int(np.prod(shape)) * dtype.itemsize for _, shape, dtype, _ in entries)
    assert engine.loads == ["weights"]


def test_an_engine_on_the_learners_device_takes_arrays_there(learner, proc):
    """Without a trip through host memory: each tensor arrives as an array on the engine's device, in the
    checkpoint's layout, and the engine ends up with the learner's weights."""
    module, params = learner
    engine = _engine(learner, proc)
    engine.weights_device = jax.devices()[0]
    ServingSampler(engine, module.cfg, _sampling(proc), proc.tokenizer).sync_weights(params, 0)
    assert engine.received and all(isinstance(a, jax.Array) and a.devices() == {jax.devices()[0]}
                                   for a in engine.received)
    chex.assert_trees_all_close(engine.params, params)
    host = ServingSampler(_engine(learner, proc), module.cfg, _sampling(proc), proc.tokenizer)
    host.sync_weights(params, 0)
    assert all(isinstance(a, np.ndarray) for a in host.engine.received)


def test_greedy_samples_equal_the_jax_samplers_on_screenshot_prompts(learner, proc):
    """Same weights, same preprocessing: the engine path (prompts cut to one pad per screenshot and expanded
    again, screenshots reprocessed) samples what the JAX sampler samples from the trainer's own inputs."""
    module, params = learner
    config = _sampling(proc, temperature=0.0)
    inputs, images = _prompts(proc)
    want = Sampler(module, config).generate(params, jax.random.PRNGKey(0), **inputs)
    sampler = ServingSampler(_engine(learner, proc), module.cfg, config, proc.tokenizer)
    sampler.sync_weights(params, 0)
    got = sampler.generate(None, jax.random.PRNGKey(5), images=images, **inputs)
    np.testing.assert_array_equal(got.lengths, want.lengths)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_array_equal(got.stopped, want.stopped)
    np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-4)
    assert got.tokens.shape == (2, config.max_new_tokens)


def test_the_engine_gets_the_trainers_ids_and_the_screenshots(learner, proc):
    module, params = learner
    engine = _engine(learner, proc)
    inputs, images = _prompts(proc)
    sampler = ServingSampler(engine, module.cfg, _sampling(proc), proc.tokenizer)
    sampler.sync_weights(params, 0)
    sampler.generate(None, jax.random.PRNGKey(0), images=images, **inputs)
    [requests] = engine.requests
    assert [r.prompt_token_ids for r in requests] == row_prompts(inputs["input_ids"], inputs["attention_mask"])
    assert [len(r.images) for r in requests] == [2, 1]
    np.testing.assert_array_equal(requests[1].images[0], SHOTS[2])
    pad = module.cfg.image_token_id
    assert collapse_image_pads(requests[0].prompt_token_ids, pad).count(pad) == 2


def test_an_engine_that_resizes_screenshots_otherwise_is_refused_by_row(learner, proc):
    module, params = learner
    smaller = dataclasses.replace(proc.image_processor, max_pixels=56 * 56)
    assert smaller.resized_hw(*SHOTS[2].shape[:2]) != proc.image_processor.resized_hw(*SHOTS[2].shape[:2])
    inputs, images = _prompts(proc)
    sampler = ServingSampler(_engine(learner, proc, smaller), module.cfg, _sampling(proc), proc.tokenizer)
    sampler.sync_weights(params, 0)
    with pytest.raises(PromptMismatchError, match=r"row 0: .* first difference at token \d+"):
        sampler.generate(None, jax.random.PRNGKey(0), images=images, **inputs)


def test_text_its_ids_do_not_decode_to_is_counted_and_a_cut_character_is_not(learner, proc, caplog):
    """The engine's text is checked against the trainer's decoding of its ids; the rollout keeps the trainer's
    decoding, so a difference is logged and counted rather than fatal, and a multi-byte character cut at the
    token limit (U+FFFD in one decoding, dropped in an incremental one) is no difference."""
    module, params = learner
    inputs, images = _prompts(proc)

    def change(r, o):
        return dataclasses.replace(o, text=o.text + (" extra" if r == 1 else "\ufffd"))

    sampler = ServingSampler(Tampered(_engine(learner, proc), change), module.cfg, _sampling(proc), proc.tokenizer)
    sampler.sync_weights(params, 0)
    out = sampler.generate(None, jax.random.PRNGKey(0), images=images, **inputs)
    assert sampler.text_mismatches == 1 and out.lengths.shape == (2,)
    assert "row 1: the serving engine's text" in caplog.text and "row 0" not in caplog.text


def test_answers_are_laid_out_as_the_jax_samplers(learner, proc):
    module, _ = learner
    stop = proc.tokenizer.convert_tokens_to_ids("<|im_end|>")
    sampler = ServingSampler(None, module.cfg, _sampling(proc), proc.tokenizer)
    out = sampler._assemble([(1, 2), (3,)], [EngineOutput([1, 2], [5, 6, stop], [-0.5, -1.0, -0.1], "stop"),
                                             EngineOutput([3], [7, 8, 9, 10, 11, 12], [-0.2] * 6, "length")])
    np.testing.assert_array_equal(out.tokens, [[5, 6, stop, 0, 0, 0], [7, 8, 9, 10, 11, 12]])
    np.testing.assert_allclose(out.logprobs[0], [-0.5, -1.0, -0.1, 0, 0, 0])
    np.testing.assert_array_equal(out.lengths, [3, 6])
    np.testing.assert_array_equal(out.stopped, [True, False])
    with pytest.raises(RuntimeError, match="row 0: the engine returned 2 tokens .* with 1 log-probs"):
        sampler._assemble([(1,)], [EngineOutput([1], [5, 6], [-0.5], "length")])


def test_no_sampling_before_the_first_sync_and_no_truncated_sampling(learner, proc):
    module, _ = learner
    inputs, images = _prompts(proc)
    with pytest.raises(RuntimeError, match="call sync_weights first"):
        ServingSampler(None, module.cfg, _sampling(proc), proc.tokenizer).generate(None, jax.random.PRNGKey(0),
                                                                                    images=images, **inputs)
    with pytest.raises(ValueError, match="rollout.top_k=0 and rollout.top_p=1.0"):
        ServingSampler(None, module.cfg, _sampling(proc, top_p=0.9), proc.tokenizer)
    sampler = ServingSampler(None, module.cfg, _sampling(proc), proc.tokenizer)
    sampler.version = 0
    with pytest.raises(ValueError, match="needs the screenshots themselves"):
        sampler.generate(None, jax.random.PRNGKey(0), **inputs)


def test_lora_runs_push_the_adapters_alone(cfg, proc, tmp_path):
    config = lora_lib.LoraConfig(rank=4, alpha=8.0)
    module = weights.build_module(cfg, lora=config)
    base = weights.init_params(module.clone(lora=None), jax.random.PRNGKey(1))
    adapters = jax.tree.map(lambda x: x + 0.01, weights.init_adapters(module, jax.random.PRNGKey(2)))
    params = lora_lib.combine(base, adapters)
    engine = JaxServingEngine(module, proc.image_processor, proc.tokenizer,
                              [(n, read()) for n, _, _, read in weights.hf_entries(base, cfg)])
    sampler = ServingSampler(engine, cfg, _sampling(proc), proc.tokenizer, lora=config, adapter_root=tmp_path)
    first = sampler.sync_weights(params, 1)
    adapter_bytes = sum(x.size * 4 for x in jax.tree.leaves(adapters))
    assert first.adapters_only and first.bytes == adapter_bytes
    chex.assert_trees_all_close(lora_lib.split(engine.params)[0], adapters)
    moved = lora_lib.combine(base, jax.tree.map(lambda x: x * 2, adapters))
    sampler.sync_weights(moved, 2)
    chex.assert_trees_all_close(lora_lib.split(engine.params)[0], lora_lib.split(moved)[0])
    assert engine.loads == ["adapter v1", "adapter v2"]
    assert [p.name for p in tmp_path.iterdir()] == ["v000002"]  # the loaded one only


class CountingSampler:
    """A sampler with weights of its own: counts the pushes the rollout engine makes."""

    needs_weight_sync = True
    wants_screenshots = True

    def __init__(self):
        from rollout_fakes import FakeSampler

        self.inner, self.pushed = FakeSampler(), []

    def sync_weights(self, params, version):
        from guijax.rollout.serving import WeightSync

        self.pushed.append((params["w"] if isinstance(params["w"], int) else None, version))
        return WeightSync(version, 0.25, 100, 1)

    def generate(self, params, rng, images=None, **inputs):
        assert images is not None
        return self.inner.generate(params, rng, **inputs)


class OneStepPool:
    """Four workers; every episode ends after one step, solved."""

    num_workers = 4

    def reset(self, tasks, slots=None, seeds=None, timeout_s=None):
        from envs.api import Observation
        from envs.pool import Result

        return {s: Result(True, Observation(np.zeros((28, 28, 3), np.uint8), "")) for s in slots}

    def step(self, actions, timeout_s=None):
        from envs.api import Observation, StepResult
        from envs.pool import Result

        return {s: Result(True, StepResult(Observation(np.zeros((28, 28, 3), np.uint8), ""), True)) for s in actions}

    def evaluate(self, slots, timeout_s=None):
        from envs.pool import Result

        return {s: Result(True, 1.0) for s in slots}


def test_the_rollout_engine_pushes_weights_only_when_they_change():
    from envs.api import Task
    from guijax.rollout.engine import RolloutConfig, RolloutEngine
    from rollout_fakes import FakeProcessor

    sampler = CountingSampler()
    engine = RolloutEngine(OneStepPool(), sampler, FakeProcessor(), RolloutConfig(show_progress=False))
    tasks = [Task(id=f"t{i}", instruction="a") for i in range(6)]  # two rounds of the pool's four workers
    first = {"w": 1}
    _, timings = engine.run(first, tasks, 1, jax.random.PRNGKey(0), version=4)
    assert sampler.pushed == [(1, 4)]
    assert (timings["weight_sync_s"], timings["weight_sync_bytes"]) == (0.25, 100)
    _, again = engine.run(first, tasks, 1, jax.random.PRNGKey(0), version=4)
    assert len(sampler.pushed) == 1 and again["weight_sync_s"] == 0.0
    engine.run({"w": 2}, tasks, 1, jax.random.PRNGKey(0), version=5)
    assert sampler.pushed == [(1, 4), (2, 5)]


def test_new_adapters_beside_the_same_frozen_base_are_pushed_and_old_weights_are_not_held():
    import gc
    import weakref

    from envs.api import Task
    from guijax.rollout.engine import RolloutConfig, RolloutEngine
    from rollout_fakes import FakeProcessor

    sampler = CountingSampler()
    engine = RolloutEngine(OneStepPool(), sampler, FakeProcessor(), RolloutConfig(show_progress=False))
    tasks = [Task(id="t", instruction="a")]
    base = jnp.zeros((2,))  # under LoRA the frozen base is the same array in every version
    first = {"a_base": base, "w": jnp.ones((2,))}
    engine.run(first, tasks, 1, jax.random.PRNGKey(0), version=0)
    engine.run({"a_base": base, "w": jnp.full((2,), 2.0)}, tasks, 1, jax.random.PRNGKey(0), version=1)
    assert [v for _, v in sampler.pushed] == [0, 1]
    sampler.pushed.clear()
    watch = weakref.ref(first["w"])
    del first
    gc.collect()
    assert watch() is None  # the engine remembers which weights the sampler holds without keeping them alive


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_an_rl_run_on_a_lower_precision_engine_logs_the_sync_and_the_mismatch(tiny_config, tmp_path, monkeypatch,
                                                                              mode):
    """The trainer with its sampler swapped for a serving engine that computes in bfloat16, started from the
    policy's checkpoint directory as vLLM is: each new version of the parameters is pushed whole (in the
    asynchronous mode by the rollout thread, between its sampler calls), and the gap between the engine's
    log-probs and the learner's float32 recomputation is logged and corrected."""
    import json

    from guijax import trainer as trainer_lib
    from guijax.models.processor import Processor
    from guijax.models.safetensors_io import SafetensorsReader
    from guijax.pipeline.registry import run_stages

    engines, checkpoint_bytes = [], []

    def serving_sampler(config, module, sampling, mesh, tokenizer, model_dir=None, adapter_root=None):
        reader = SafetensorsReader(str(model_dir))
        tensors = [(k, reader.get(k)) for k in reader.keys()]
        checkpoint_bytes.append(sum(np.asarray(a, np.float32).nbytes for _, a in tensors))
        # the policy's screenshot downscale handed to the engine's image processor, as VllmEngine hands it
        images = dataclasses.replace(Processor.from_pretrained(model_dir).image_processor,
                                     max_pixels=config.model.image_max_pixels)
        engine = JaxServingEngine(module.clone(dtype=jnp.bfloat16), images, tokenizer, tensors,
                                  prompt_buckets=sampling.prompt_buckets)
        engines.append(engine)
        return ServingSampler(engine, module.cfg, sampling, tokenizer)

    monkeypatch.setattr(trainer_lib, "make_sampler", serving_sampler)
    # LUFFY's expert traces give every group a reward spread, so each iteration updates the parameters
    config = tiny_config("grpo_cpu", "method=luffy", "stages=('base_model', 'tasks', 'expert', 'rl')",
                         "train.iterations=2", "train.behaviour_correction=True", f"rollout.mode={mode}")
    run_stages(config, tmp_path / "run")
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
               if '"iteration"' in line]
    [engine] = engines
    assert [r["iteration"] for r in records] == [0, 1]
    whole = checkpoint_bytes[0]  # float32 parameters: every tensor of the checkpoint, at 4 bytes a value
    if mode == "sync":
        assert engine.loads == ["weights", "weights"]  # one push per iteration, before its rollouts
        assert all(r["time_weight_sync_s"] > 0 and r["weight_sync_bytes"] == whole for r in records)
    else:  # the first version before any group; later ones when the rollout thread next samples
        assert set(engine.loads) == {"weights"} and records[0]["weight_sync_bytes"] >= whole
        assert all(r["weight_sync_bytes"] % whole == 0 for r in records)
        assert sum(r["weight_sync_bytes"] for r in records) <= len(engine.loads) * whole
    for r in records:
        assert r["behaviour_kl"] > 0 and r["behaviour_logp_abs_diff"] > 1e-4  # bfloat16 engine vs float32 learner
        assert 0 <= r["behaviour_weight_capped_frac"] <= 1


class ClosingEngine(JaxServingEngine):
    """The fake engine, recording that the sampler gave it back."""

    closed = False

    def close(self) -> None:
        self.closed = True


def test_evaluations_sample_with_the_runs_serving_engine_and_keep_it(tiny_config, tmp_path, monkeypatch):
    """The eval stage with `eval.backend` served by a float32 fake engine through the real `make_sampler`: the
    process's engine starts from the evaluated model's own directory, is pushed its weights once before
    sampling and is kept open after (closed at exit); its greedy episodes are the JAX sampler's, and the
    report says which sampler ran and what the push cost."""
    import json

    from guijax.data.store import TrajectoryStore
    from guijax.models.policy import from_pretrained
    from guijax.models.safetensors_io import SafetensorsReader
    from guijax.pipeline.registry import run_stages
    from guijax.rollout import backend, vllm_engine

    engines, started_from = [], []

    def start(model_dir, settings, seed, vision):
        started_from.append(model_dir)
        policy = from_pretrained(model_dir)  # the engine's own model, image processor and tokenizer
        images = dataclasses.replace(policy.processor.image_processor, max_pixels=settings["max_pixels"])
        reader = SafetensorsReader(str(model_dir))
        engine = ClosingEngine(policy.module, images, policy.processor.tokenizer,
                               [(k, reader.get(k)) for k in reader.keys()], prompt_buckets=(256, 512, 1024))
        engines.append(engine)
        return engine

    monkeypatch.setattr(backend, "_start_vllm", start)
    monkeypatch.setattr(vllm_engine, "require_vllm", lambda: None)
    backend.close_shared_engine()
    stages = ("stages=('base_model', 'tasks', 'eval_base')", "eval.temperature=0.0")
    run_stages(tiny_config("grpo_cpu", *stages), tmp_path / "jax")  # eval.backend's default
    assert not engines
    try:
        run_stages(tiny_config("grpo_cpu", *stages, "eval.backend=vllm"), tmp_path / "served")
        [engine] = engines
        assert started_from == [tmp_path / "served" / "base_model"] and engine.loads == ["weights"]
        assert not engine.closed  # kept for the process's next evaluation or trainer
    finally:
        backend.close_shared_engine()
    assert engine.closed
    assert engine.requests  # every sampler call of the evaluation went to the engine
    reports = {name: json.loads((tmp_path / name / "eval_base.json").read_text()) for name in ("jax", "served")}
    assert reports["jax"]["sampling"]["sampler"] == "jax" and reports["jax"]["sampling"]["weight_sync_bytes"] == 0
    served = reports["served"]["sampling"]
    assert (served["sampler"], served["engine"]) == ("serving", "ClosingEngine")
    assert served["weight_sync_bytes"] > 0 and served["sampled_tokens"] > 0 and isinstance(served["sampled_tokens"], int)
    episodes = {name: sorted((t.task_id, [s.response for s in t.steps])
                             for t in TrajectoryStore(tmp_path / name / "eval_base_trajectories"))
                for name in ("jax", "served")}
    assert episodes["served"] == episodes["jax"] and episodes["jax"]
    assert reports["served"]["splits"] == reports["jax"]["splits"]


def test_a_rollout_engine_pushes_again_after_another_sampler_of_its_engine_pushed(learner, proc):
    """Two samplers on one engine, each behind its own rollout engine: what decides a push is what the engine
    serves now, not what this rollout engine pushed last."""
    from envs.api import Task
    from guijax.rollout.engine import RolloutConfig, RolloutEngine
    from guijax.rollout.serving import ServedWeights

    module, params = learner
    engine = _engine(learner, proc)
    served = ServedWeights()
    first, second = (ServingSampler(engine, module.cfg, _sampling(proc), proc.tokenizer, served=served,
                                    owns_engine=False) for _ in range(2))
    assert not first.holds(params)
    first.sync_weights(params, 0)
    assert first.holds(params) and second.holds(params)  # the engine serves them, whoever pushed them
    assert second.version == 0  # adopted: it samples without a push
    other = jax.tree.map(lambda x: x + 1, params)
    second.sync_weights(other, 0)
    assert not first.holds(params) and second.holds(other)

    class Recording:  # the first sampler, its pushes counted
        needs_weight_sync, wants_screenshots = True, True
        pushes: list = []

        def holds(self, p):
            return first.holds(p)

        def sync_weights(self, p, version):
            self.pushes.append(version)
            return first.sync_weights(p, version)

        def generate(self, p, rng, images=None, **inputs):
            from rollout_fakes import FakeSampler

            return FakeSampler().generate(p, rng, **inputs)

    from rollout_fakes import FakeProcessor

    rollouts = RolloutEngine(OneStepPool(), Recording(), FakeProcessor(), RolloutConfig(show_progress=False))
    rollouts.run(params, [Task(id="t", instruction="a")], 1, jax.random.PRNGKey(0), version=1)
    rollouts.run(params, [Task(id="t", instruction="a")], 1, jax.random.PRNGKey(0), version=1)
    assert Recording.pushes == [1]  # the engine held them the second time
    second.sync_weights(other, 1)
    rollouts.run(params, [Task(id="t", instruction="a")], 1, jax.random.PRNGKey(0), version=1)
    assert Recording.pushes == [1, 1]  # pushed again: the engine had been handed other weights meanwhile


def test_a_colder_sibling_samples_on_the_same_engine_and_weights(learner, proc):
    from guijax.sampling import Sampler

    module, params = learner
    engine = _engine(learner, proc)
    sampler = ServingSampler(engine, module.cfg, _sampling(proc), proc.tokenizer)
    sampler.sync_weights(params, 4)
    colder = sampler.with_temperature(0.25)
    assert colder.engine is engine and colder.version == 4 and colder.holds(params)
    assert (colder.config.temperature, sampler.config.temperature) == (0.25, 1.0)
    jax_sampler = Sampler(module, _sampling(proc))
    assert jax_sampler.with_temperature(1.0) is jax_sampler
    assert jax_sampler.with_temperature(0.5) is jax_sampler.with_temperature(0.5)  # kept, compiled once
    assert jax_sampler.with_temperature(0.5).config.temperature == 0.5


def test_the_methods_own_stages_sample_with_the_rollout_backend(tiny_config, tmp_path, monkeypatch):
    """Run.engine (SGCD's rounds, EvoCUA's budget, SEAgent's phases, BEPA's and ARPO's sampling stages) asks
    make_sampler for `rollout.backend`'s sampler, as the trainer does; evaluations ask for `eval.backend`'s."""
    import types

    import guijax.trainer
    from guijax.pipeline.run import Run
    from guijax.rollout import backend

    asked = []
    monkeypatch.setattr(backend, "make_sampler", lambda config, *a, backend=None, **k: asked.append(
        backend or config.rollout.backend) or object())
    monkeypatch.setattr(guijax.trainer, "sampling_config", lambda *a, **k: None)
    run = Run(tiny_config("grpo_cpu", "rollout.backend=vllm", "eval.backend=jax"), tmp_path)
    policy = types.SimpleNamespace(module=None, processor=types.SimpleNamespace(tokenizer=None), path=tmp_path)
    from guijax.pipeline.run import STAGE_ADAPTERS

    try:
        run.engine(policy, 1.0)
        with run.evaluation_engine(policy, 0.6):
            pass
        (tmp_path / STAGE_ADAPTERS / "v000001").mkdir(parents=True)  # what a LoRA method's stage pushed
    finally:
        run.close()
    assert asked == ["vllm", "jax"] and not (tmp_path / STAGE_ADAPTERS).exists()  # removed when the run ends
