"""Work only where it counts: the LM head on response positions only equals the all-positions reference
(log-probs, entropy, GRPO loss, gradients; sharded too), a loss position the indices miss cannot vanish
silently, screenshots shared by a batch's rows are encoded once with identical hidden states, and both cut
work (compiled FLOPs, vision patches)."""
from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from guijax import objectives, sharding, train_step
from guijax.data.pipeline import Collate, EncodeStep, PipelineConfig, make_dataset, step_refs
from guijax.models import weights
from step_histories import trajectories

CONFIG = PipelineConfig(batch_size=8, max_images=3, length_buckets=(128, 256, 512), patch_bucket=64,
                        system_prompt="Task: {instruction}\n", shuffle=False, response_bucket=16)


@pytest.fixture(scope="module")
def module_params(cfg):
    module = weights.build_module(cfg)
    return module, weights.init_params(module, jax.random.PRNGKey(0))


def pipeline_batch(proc, cfg, **config) -> dict:
    trajs = trajectories(proc)
    batch = next(iter(make_dataset(trajs, step_refs(trajs, [1.0, -0.5]), proc, cfg,
                                   dataclasses.replace(CONFIG, **config))))
    return {k: v for k, v in batch.items() if k != "meta"}


def without(batch: dict, *keys: str) -> dict:
    return {k: v for k, v in batch.items() if k not in keys}


def test_response_only_equals_all_positions(proc, cfg, module_params):
    module, params = module_params
    batch = pipeline_batch(proc, cfg)
    width, seq = batch["response_positions"].shape[1], batch["input_ids"].shape[1]
    assert width % 16 == 0 and width < seq // 4  # really a small slice of the batch
    fn = train_step.make_logprob_fn(module, temperature=0.7)
    logp, entropy = fn(params, batch)
    ref_logp, ref_entropy = fn(params, without(batch, "response_positions"))
    chex.assert_trees_all_close((logp, entropy), (ref_logp, ref_entropy), atol=1e-6, rtol=1e-6)
    assert np.count_nonzero(np.asarray(logp)) == batch["loss_mask"].sum()


def test_grpo_loss_and_gradients_equal_all_positions(proc, cfg, module_params):
    module, params = module_params
    batch = pipeline_batch(proc, cfg)
    old, _ = train_step.make_logprob_fn(module)(params, without(batch, "response_positions"))
    noise = np.random.RandomState(0).normal(0, 0.2, batch["loss_mask"].shape).astype(np.float32)
    batch = dict(batch, old_logp=np.asarray(old) + noise * batch["loss_mask"])  # ratios away from 1: clipping
    step = train_step.StepConfig(objectives.WithCrossEntropy(objectives.ClippedPolicyLoss(), 0.1))
    grad = jax.jit(jax.value_and_grad(train_step.loss_fn, has_aux=True), static_argnums=(2, 3))
    (loss, metrics), grads = grad(params, batch, module, step)
    (ref_loss, ref_metrics), ref_grads = grad(params, without(batch, "response_positions"), module, step)
    assert np.isfinite(float(loss))
    chex.assert_trees_all_close(metrics, ref_metrics, atol=1e-6, rtol=1e-5)
    chex.assert_trees_all_close(grads, ref_grads, atol=1e-6, rtol=1e-5)
    assert float(loss) == pytest.approx(float(ref_loss), rel=1e-6)


@pytest.mark.slow
def test_sharded_response_only_equals_single_device(proc, cfg, module_params):
    """Rows (6, padded to 8 with -1 positions) split over data x fsdp; the [b, R] indices shard like rows."""
    module, params = module_params
    batch = pipeline_batch(proc, cfg, batch_size=6)
    mesh = sharding.make_mesh(sharding.MeshConfig(data=2, fsdp=4, tensor=1))
    fn = train_step.make_logprob_fn(module, mesh=mesh)
    placed = fn.place(batch)
    assert placed["response_positions"].sharding.spec == jax.sharding.PartitionSpec(("data", "fsdp"), None)
    assert (np.asarray(placed["response_positions"])[6:] == -1).all()
    assert placed["vision"]["token_features"].sharding.is_fully_replicated
    logp, entropy = fn(params, batch)
    ref_logp, ref_entropy = train_step.make_logprob_fn(module)(params, without(batch, "response_positions"))
    chex.assert_trees_all_close((np.asarray(logp), np.asarray(entropy)), (ref_logp, ref_entropy), atol=1e-5)


@pytest.mark.slow  # 27 s; the response-only path's equality with all positions stays in the default suite
def test_a_missed_loss_position_poisons_the_loss(proc, cfg, module_params):
    """Indices that miss a loss token (hand-built, not the pipeline's) give NaN there, so the step is skipped
    and reported instead of training on a silently shorter response."""
    module, params = module_params
    batch = pipeline_batch(proc, cfg, batch_size=2)
    positions = batch["response_positions"].copy()
    last = int((positions[1] >= 0).sum()) - 1
    dropped = positions[1, last]
    positions[1, last] = -1
    logp, entropy = train_step.make_logprob_fn(module)(params, dict(batch, response_positions=positions))
    assert np.isnan(logp[1, dropped]) and np.isnan(entropy[1, dropped])
    assert np.isfinite(np.asarray(logp)[batch["loss_mask"] == 0]).all() and np.isfinite(logp[0]).all()
    batch = dict(batch, response_positions=positions, old_logp=np.zeros_like(batch["loss_mask"]),
                 advantages=batch["advantages"])
    loss, _ = train_step.loss_fn(params, batch, module, train_step.StepConfig(objectives.ClippedPolicyLoss()))
    assert not np.isfinite(float(loss))


@pytest.mark.slow
def test_deduplicated_screenshots_give_identical_hidden_states(proc, cfg, module_params):
    """Two trajectories' overlapping histories: each screenshot encoded once, the same hidden states and
    log-probs as encoding every row's screenshots, with fewer patches through the vision tower."""
    module, params = module_params
    deduped = pipeline_batch(proc, cfg, patch_bucket=16)
    full = pipeline_batch(proc, cfg, patch_bucket=16, dedupe_images=False)
    assert "token_features" in deduped["vision"] and "token_features" not in full["vision"]
    patches = deduped["vision"]["pixel_values"].shape[0], full["vision"]["pixel_values"].shape[0]
    assert patches[0] <= 0.5 * patches[1], patches  # 8 unique screenshots instead of 2 * (1 + 2 + 3 + 3)
    hidden = jax.jit(lambda p, b: module.apply({"params": p}, b["input_ids"], b["positions"], b["attention_mask"],
                                               b["vision"], return_logits=False)[0])
    np.testing.assert_allclose(hidden(params, deduped), hidden(params, full), atol=1e-5)
    fn = train_step.make_logprob_fn(module)
    chex.assert_trees_all_close(fn(params, deduped), fn(params, full), atol=1e-5)


@pytest.mark.slow
def test_merged_deduplicated_blocks_equal_the_whole_batch(proc, cfg, module_params):
    """What several processes do (sharding.merge_vision over their local vision inputs) with deduplicated
    blocks: each block's distinct screenshots stay, its token -> feature map is shifted to where they land,
    and the language model sees the same features as from the whole batch with every screenshot."""
    module, params = module_params
    trajs = trajectories(proc)
    config = dataclasses.replace(CONFIG, patch_bucket=64)
    encode = EncodeStep(trajs, proc, config)
    examples = [encode.map(r) for r in step_refs(trajs, [1.0, -0.5])]
    whole = Collate(cfg, dataclasses.replace(config, dedupe_images=False))(examples)
    blocks = [Collate(cfg, config)(examples[:3]), Collate(cfg, config)(examples[3:])]
    count = lambda b: int((b["input_ids"] == cfg.image_token_id).sum())  # noqa: E731
    merged = sharding.merge_vision([(b["vision"], count(b)) for b in blocks], cfg.vision.spatial_merge_size ** 2)
    assert len(merged["pixel_values"]) < len(whole["vision"]["pixel_values"])
    forward = jax.jit(lambda p, v: module.apply({"params": p}, whole["input_ids"], whole["positions"],
                                                whole["attention_mask"], v, return_logits=False)[0])
    np.testing.assert_allclose(forward(params, merged), forward(params, whole["vision"]), atol=1e-5)


def _flops(fn, *args) -> float:
    return float(jax.jit(fn).lower(*args).compile().cost_analysis()["flops"])


def test_response_only_cuts_compiled_flops(proc, cfg, module_params):
    """Responses are ~8% of the tokens: the head and kernel run on R = 32 positions per row instead of 256, and
    that is all the whole log-prob function saves (the tiny model's head is a third of its FLOPs)."""
    module, params = module_params
    batch = pipeline_batch(proc, cfg)
    width, seq = batch["response_positions"].shape[1], batch["input_ids"].shape[1]
    assert batch["loss_mask"].mean() < 0.1 and (width, seq) == (32, 256)
    hidden = jnp.zeros((*batch["input_ids"].shape, cfg.hidden_size), jnp.float32)
    head = (hidden, params["lm_head"])
    head_full = _flops(lambda h, w: train_step.all_positions_logprobs(h, w, batch["targets"], batch["loss_mask"]),
                       *head)
    head_resp = _flops(lambda h, w: train_step.response_logprobs(h, w, batch["targets"], batch["loss_mask"],
                                                                 batch["response_positions"]), *head)
    assert head_resp == pytest.approx(width / seq * head_full, rel=0.05), (head_resp, head_full)
    fn = lambda p, b: train_step.batch_logprobs(module, p, b)  # noqa: E731
    full, resp = _flops(fn, params, without(batch, "response_positions")), _flops(fn, params, batch)
    assert full - resp == pytest.approx(head_full - head_resp, rel=0.05), (resp, full)


@pytest.mark.slow  # 46 s; blocks through the trainer and sharded stay in the default suite
def test_per_device_vision_blocks_give_the_same_hidden_states(proc, cfg, module_params):
    """Rows in two blocks, each laid out over its own screenshots (a block's indices reach only its own
    patches): the tower runs vmapped over the blocks and the language model sees the same features."""
    module, params = module_params
    trajs = trajectories(proc)
    encode = EncodeStep(trajs, proc, CONFIG)
    examples = [encode.map(r) for r in step_refs(trajs, [1.0, -0.5])][:6]
    whole = Collate(cfg, dataclasses.replace(CONFIG, dedupe_images=False))(examples)
    forward = jax.jit(lambda p, v: module.apply({"params": p}, whole["input_ids"], whole["positions"],
                                                whole["attention_mask"], v, return_logits=False)[0])
    want = forward(params, whole["vision"])
    for dedupe in (True, False):
        blocked = Collate(cfg, dataclasses.replace(CONFIG, vision_blocks=2, dedupe_images=dedupe))(examples)
        vision = blocked["vision"]
        assert vision["pixel_values"].shape[0] == 2 and vision["window_tokens"].ndim == 3
        per_block = vision["pixel_values"].shape[1]
        assert (vision["window_tokens"] < per_block).all() and (vision["image_tokens"] < per_block).all()
        np.testing.assert_allclose(forward(params, vision), want, atol=1e-5)
    # six rows in four blocks of two: the last block, whose rows are padding on the mesh, holds the filler only
    short = Collate(cfg, dataclasses.replace(CONFIG, vision_blocks=4))(examples)
    assert short["vision"]["pixel_values"].shape[0] == 4 and (short["vision"]["token_features"][3] == -1).all()
    padded = sharding.pad_rows({k: v for k, v in short.items() if k != "meta"}, 4)
    hidden = module.apply({"params": params}, padded["input_ids"], padded["positions"], padded["attention_mask"],
                          padded["vision"], return_logits=False)[0]
    np.testing.assert_allclose(np.asarray(hidden)[:6], want, atol=1e-5)


def test_sharded_vision_blocks_stay_on_their_devices_and_equal_one_device(proc, cfg, module_params):
    """Eight rows, one block per device of a data 2 x fsdp 4 mesh: every vision array is split along the
    block axis like the rows, and the log-probs equal the single-device whole-batch ones."""
    module, params = module_params
    trajs = trajectories(proc)
    encode = EncodeStep(trajs, proc, CONFIG)
    examples = [encode.map(r) for r in step_refs(trajs, [1.0, -0.5])]
    whole = Collate(cfg, dataclasses.replace(CONFIG, dedupe_images=False))(examples)
    blocked = Collate(cfg, dataclasses.replace(CONFIG, vision_blocks=8))(examples)
    mesh = sharding.make_mesh(sharding.MeshConfig(data=2, fsdp=4, tensor=1))
    fn = train_step.make_logprob_fn(module, mesh=mesh)
    batch = {k: v for k, v in blocked.items() if k != "meta"}
    placed = fn.place(batch)
    for key, value in placed["vision"].items():
        assert value.sharding.spec[0] == ("data", "fsdp", "expert") or value.sharding.spec[0] == ("data", "fsdp"), key
        assert value.addressable_shards[0].data.shape[0] == 1, key
    got = fn(params, batch)
    want = train_step.make_logprob_fn(module)(params, {k: v for k, v in whole.items() if k != "meta"})
    chex.assert_trees_all_close((np.asarray(got[0]), np.asarray(got[1])), want, atol=1e-5)
