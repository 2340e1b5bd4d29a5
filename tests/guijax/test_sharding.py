"""Sharding on 8 simulated devices: where parameters, optimiser state and batches actually live, that the
compiled step splits its work over the data-parallel devices, and that sharded results equal one device's."""
from __future__ import annotations

import collections

import chex
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from guijax import objectives, optim, sharding, train_step
from guijax.models import weights
from guijax.models.config import PRESETS
from guijax.models.positions import mrope_positions, vision_layout
from guijax.sampling import pad_images

TINY, SMALL = PRESETS["tiny"], PRESETS["small"]
SFT = train_step.StepConfig(objectives.CrossEntropyLoss())


def _tx(eps: float = 1e-8):
    """AdamW; a large eps keeps m / (sqrt(v) + eps) from amplifying fp32 noise in near-zero gradients when
    comparing sharded and single-device updates."""
    return optim.make_optimizer(ml_collections.ConfigDict(dict(
        learning_rate=1e-2, warmup_steps=0, total_steps=100, schedule="constant", weight_decay=0.01, b1=0.9, b2=0.95,
        eps=eps, max_grad_norm=1.0, grad_accum_steps=1, state_dtype="float32")))[0]


def _mesh(data: int, fsdp: int, tensor: int = 1):
    return sharding.make_mesh(sharding.MeshConfig(data, fsdp, tensor), jax.devices()[:data * fsdp * tensor])


def _text_batch(cfg, b=8, s=32, seed=0):
    rs = np.random.RandomState(seed)
    ids = rs.randint(0, 900, (b, s)).astype(np.int32)
    mask = np.ones((b, s), np.int32)
    mask[1, -5:] = 0
    positions, _ = mrope_positions(ids, mask, None, cfg)
    loss_mask = np.zeros((b, s), np.float32)
    loss_mask[:, s // 3:-6] = 1.0
    return {"input_ids": ids, "positions": positions, "attention_mask": mask, "targets": np.roll(ids, -1, 1),
            "loss_mask": loss_mask}


def _rows_with_images(cfg, b, s=40, seed=0):
    """Token rows with one image each (4x4 or 4x8 patches, alternating) right after two text tokens."""
    rs = np.random.RandomState(seed)
    merge = cfg.vision.spatial_merge_size
    grids = np.array([[1, 4, 4 if i % 2 == 0 else 8] for i in range(b)])
    ids = rs.randint(0, 900, (b, s)).astype(np.int32)
    for i, (_, h, w) in enumerate(grids):
        ids[i, 2:2 + h * w // merge ** 2] = cfg.image_token_id
    pixels = [rs.normal(size=(h * w, cfg.vision.patch_dim)).astype(np.float32) for _, h, w in grids]
    return ids, grids, pixels


def _vision(cfg, grids, pixels, bucket=40):
    pix, padded = pad_images(np.concatenate(pixels), grids, bucket, cfg.vision.spatial_merge_size)
    return vision_layout(padded, cfg.vision).inputs(pix)


def _vision_batch(cfg, b=8, s=40, seed=0):
    ids, grids, pixels = _rows_with_images(cfg, b, s, seed)
    mask = np.ones_like(ids)
    positions, _ = mrope_positions(ids, mask, grids, cfg)
    loss_mask = np.zeros((b, s), np.float32)
    loss_mask[:, 12:-4] = 1.0
    return {"input_ids": ids, "positions": positions, "attention_mask": mask, "vision": _vision(cfg, grids, pixels),
            "targets": np.roll(ids, -1, 1), "loss_mask": loss_mask}


def _per_device_bytes(tree) -> collections.Counter:
    """Bytes each device actually holds (from the arrays' shards, not from their declared shardings)."""
    held = collections.Counter()
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            held[shard.device] += shard.data.nbytes
    return held


@pytest.fixture(scope="module")
def tiny():
    module = weights.build_module(TINY)
    return module, weights.init_params(module, jax.random.PRNGKey(0))


@pytest.fixture(scope="module")
def small_fsdp8():
    module = weights.build_module(SMALL)
    mesh = _mesh(1, 8)
    tx = _tx()
    params = weights.init_params(module, jax.random.PRNGKey(0), mesh)
    return module, mesh, tx, train_step.init_state(module, params, tx, mesh)


def test_parameters_and_moments_hold_an_eighth_per_device(small_fsdp8):
    module, mesh, tx, state = small_fsdp8
    mu, nu = state.opt_state[-1]["mu"], state.opt_state[-1]["nu"]
    for tree in (state.params, mu, nu):
        total = sum(leaf.nbytes for leaf in jax.tree.leaves(tree))
        held = _per_device_bytes(tree)
        assert len(held) == 8
        # norms and tensor-axis biases stay replicated: a few KB above the exact eighth
        assert total / 8 <= max(held.values()) <= 1.01 * total / 8, (total, held)
    # what the declared shardings promise is what the arrays hold
    declared = sharding.bytes_per_device(state.params, jax.tree.map(lambda x: x.sharding, state.params))
    assert declared == max(_per_device_bytes(state.params).values())


def test_moments_are_sharded_like_their_parameters(small_fsdp8):
    module, mesh, tx, state = small_fsdp8
    expected = sharding.param_shardings(weights.abstract_params(module), mesh)
    for moments in (state.opt_state[-1]["mu"], state.opt_state[-1]["nu"]):
        jax.tree.map(lambda m, p, want: (m.sharding == p.sharding == want) or pytest.fail(f"{m.sharding} {want}"),
                     moments, state.params, expected)
    embed = state.opt_state[-1]["mu"]["embed_tokens"]
    assert embed.sharding.spec == jax.sharding.PartitionSpec("tensor", "fsdp")
    assert len(embed.sharding.device_set) == 8 and embed.addressable_shards[0].data.shape == (4096, 48)
    assert state.step.sharding.is_fully_replicated and len(state.step.sharding.device_set) == 8


def test_init_opt_state_never_materialises_on_one_device():
    mesh = _mesh(1, 8)
    params = {"w": jax.device_put(np.ones((64, 16), np.float32), sharding.batch_sharding(mesh, 2)),
              "b": jax.device_put(np.ones((16,), np.float32), sharding.replicated(mesh))}
    tx = optim.make_optimizer(ml_collections.ConfigDict(dict(
        learning_rate=1e-2, warmup_steps=0, total_steps=10, schedule="constant", weight_decay=0.0, b1=0.9,
        b2=0.95, eps=1e-8, max_grad_norm=1.0, grad_accum_steps=4, state_dtype="bfloat16")))[0]
    state = sharding.init_opt_state(tx, params, mesh)
    by_shape = collections.defaultdict(set)
    for leaf in jax.tree.leaves(state):
        assert not isinstance(leaf.sharding, jax.sharding.SingleDeviceSharding)
        by_shape[leaf.shape].add(leaf.sharding.spec)
    assert by_shape[(64, 16)] == {jax.sharding.PartitionSpec(("data", "fsdp"), None)}  # moments + accumulators
    assert by_shape[()] == {jax.sharding.PartitionSpec()}


def test_compiled_step_splits_batch_rows_over_data_and_fsdp(tiny):
    module, params = tiny
    mesh, tx = _mesh(2, 4), _tx()
    state = train_step.init_state(module, jax.tree.map(np.asarray, params), tx, mesh)
    step = train_step.make_train_step(module, tx, SFT, mesh)
    compiled = step.lower(state, _vision_batch(TINY)).compile()
    (state_in, frozen_in, batch_in), _ = compiled.input_shardings  # frozen: {} without LoRA
    for key in ("input_ids", "attention_mask", "targets", "loss_mask"):
        assert batch_in[key].spec == jax.sharding.PartitionSpec(("data", "fsdp"), None), key
        assert batch_in[key].shard_shape((8, 40)) == (1, 40)
    assert batch_in["positions"].spec == jax.sharding.PartitionSpec(None, ("data", "fsdp"), None)
    vision_in = dict(batch_in["vision"])
    assert vision_in.pop("pixel_values").spec == jax.sharding.PartitionSpec(("data", "fsdp"), None)
    assert all(s.is_fully_replicated for s in jax.tree.leaves(vision_in))
    want = train_step.state_shardings(module, tx, mesh)
    out_state, metrics = compiled.output_shardings
    for got, expect, leaf in zip(jax.tree.leaves(out_state), jax.tree.leaves(want), jax.tree.leaves(state)):
        assert got.is_equivalent_to(expect, np.ndim(leaf))
    assert all(s.is_fully_replicated for s in jax.tree.leaves(metrics))


@pytest.fixture(scope="module")
def single_device_flops():
    module = weights.build_module(SMALL)
    return module, _step_flops(module, _mesh(1, 1))


def _step_flops(module, mesh) -> float:
    tx = _tx()
    params = weights.init_params(module, jax.random.PRNGKey(0), mesh)
    step = train_step.make_train_step(module, tx, SFT, mesh)
    compiled = step.lower(train_step.init_state(module, params, tx, mesh), _text_batch(SMALL, b=8, s=64)).compile()
    return compiled.cost_analysis()["flops"]


# the per-device FLOPs of a compiled step on 8 devices (about 55 s): -m slow
@pytest.mark.slow
@pytest.mark.parametrize("data,fsdp", [(1, 8), (2, 4)])
def test_per_device_flops_fall_with_the_data_parallel_size(single_device_flops, data, fsdp):
    module, one = single_device_flops
    ratio = one / _step_flops(module, _mesh(data, fsdp))
    assert 7.5 < ratio <= 8.05, ratio


def _vision_flops(mesh) -> float:
    """Compiled per-device FLOPs of the vision tower alone (forward + backward) on a batch of 16 images."""
    module = weights.build_module(SMALL)
    params = weights.init_params(module, jax.random.PRNGKey(0), mesh)
    vision = _vision(SMALL, *_rows_with_images(SMALL, 16)[1:], bucket=64)

    def loss(p, v):
        return jnp.sum(module.apply({"params": p}, **v, method=module.encode_images).merged ** 2)

    placed = {k: jax.device_put(v, s) for (k, v), s in zip(vision.items(),
                                                          sharding.vision_shardings(vision, mesh).values())}
    with sharding.rules_context(mesh):
        return jax.jit(jax.grad(loss)).lower(params, placed).compile().cost_analysis()["flops"]


@pytest.mark.slow
def test_vision_tower_work_falls_with_the_data_parallel_size():
    one, eight = _vision_flops(_mesh(1, 1)), _vision_flops(_mesh(1, 8))
    assert one / eight > 5.0, one / eight  # patches, windows and image frames split over the 8 devices


def test_logical_constraints_reach_the_program(tiny):
    module, params = tiny
    mesh = _mesh(2, 4)
    batch = _text_batch(TINY)
    sharded = train_step.make_logprob_fn(module, mesh=mesh).lower(params, batch).as_text()
    plain = jax.jit(lambda p, b: train_step.batch_logprobs(module, p, b)).lower(params, batch).as_text()
    constraints = lambda text: text.count("sharding_constraint") + text.count("@Sharding")  # noqa: E731
    assert constraints(plain) == 0
    # the embedding and the decoder layer's output (one scan body serves every layer) are constrained to rows
    # over (data, fsdp)
    assert constraints(sharded) >= 2


# the vision batch repeats the text batch's check with screenshots (60 s): -m slow
@pytest.mark.parametrize("batch_fn", [_text_batch, pytest.param(_vision_batch, marks=pytest.mark.slow)],
                         ids=["text", "vision"])
def test_sharded_step_equals_single_device(tiny, batch_fn):
    module, params = tiny
    tx = _tx(eps=1e-3)
    batch = batch_fn(TINY)
    single = train_step.make_train_step(module, tx, SFT)
    s1 = train_step.init_state(module, jax.tree.map(np.array, params), tx)
    s1, m1 = single(s1, batch)
    s1, m1b = single(s1, batch)
    mesh = _mesh(2, 4)
    sharded = train_step.make_train_step(module, tx, SFT, mesh)
    s8 = train_step.init_state(module, jax.tree.map(np.array, params), tx, mesh)
    s8, m8 = sharded(s8, batch)
    s8, m8b = sharded(s8, batch)
    for a, b in ((m1, m8), (m1b, m8b)):
        np.testing.assert_allclose(float(a["loss"]), float(b["loss"]), rtol=1e-5)
        np.testing.assert_allclose(float(a["grad_norm"]), float(b["grad_norm"]), rtol=1e-4)
    chex.assert_trees_all_close(jax.device_get(s8.params), jax.device_get(s1.params), atol=2e-5)
    chex.assert_trees_all_close(jax.device_get(s8.opt_state), jax.device_get(s1.opt_state), atol=2e-5)
    assert int(s8.step) == 2


def test_rows_that_do_not_divide_are_padded_and_handed_back(tiny):
    module, params = tiny
    batch = {k: (v[:, :6] if k == "positions" else v[:6]) for k, v in _text_batch(TINY).items()}
    mesh = _mesh(1, 8)
    single = train_step.make_logprob_fn(module)(params, batch)
    sharded = train_step.make_logprob_fn(module, mesh=mesh)(params, batch)
    chex.assert_trees_all_close(jax.device_get(sharded), jax.device_get(single), atol=1e-5)
    assert sharded[0].shape == (6, 32)
    placed = sharding.place_batch(batch, mesh, pad=True)
    assert placed["input_ids"].shape == (8, 32) and not np.asarray(placed["loss_mask"])[6:].any()
    with pytest.raises(ValueError, match="6 rows does not divide over data x fsdp = 8"):
        sharding.place_batch(batch, mesh)
    tx = _tx()
    _, m1 = train_step.make_train_step(module, tx, SFT)(
        train_step.init_state(module, jax.tree.map(np.array, params), tx), batch)
    _, m8 = train_step.make_train_step(module, tx, SFT, mesh)(
        train_step.init_state(module, jax.tree.map(np.array, params), tx, mesh), batch)
    np.testing.assert_allclose(float(m8["loss"]), float(m1["loss"]), rtol=1e-5)


@pytest.mark.slow
def test_pallas_interpret_kernel_runs_under_shard_map_on_the_mesh(tiny):
    module, params = tiny
    tx, mesh = _tx(), _mesh(2, 4)
    batch = _text_batch(TINY)
    ref = train_step.StepConfig(objectives.CrossEntropyLoss(), impl="chunked")
    pallas = train_step.StepConfig(objectives.CrossEntropyLoss(), impl="pallas_interpret")
    assert train_step.kernel_mesh("pallas_interpret", mesh) == {"mesh": mesh, "batch_axes": sharding.DATA_AXES}
    assert train_step.kernel_mesh("chunked", mesh) == {}
    _, m1 = train_step.make_train_step(module, tx, ref)(
        train_step.init_state(module, jax.tree.map(np.array, params), tx), batch)
    step = train_step.make_train_step(module, tx, pallas, mesh)
    state = train_step.init_state(module, jax.tree.map(np.array, params), tx, mesh)
    assert "manual" in step.lower(state, batch).as_text()  # the kernel is a shard_map body
    _, m8 = step(state, batch)
    np.testing.assert_allclose(float(m8["loss"]), float(m1["loss"]), rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["tiny", "tiny_qwen3_vl"])
def test_merged_vision_of_row_blocks_equals_the_whole_batch(preset):
    """What several processes do with their local patches (all-gather, then merge_vision) gives the language
    model the same image features as collating every row in one place; each block's filler image is moved
    behind all real images so the k-th image-pad token still meets the k-th feature (and Qwen3-VL's
    per-patch position blends follow their patches)."""
    cfg = PRESETS[preset]
    module = weights.build_module(cfg)
    params = weights.init_params(module, jax.random.PRNGKey(0))
    ids, grids, pixels = _rows_with_images(cfg, 8)
    mask = np.ones_like(ids)
    positions, _ = mrope_positions(ids, mask, grids, cfg)
    whole = _vision(cfg, grids, pixels)
    n_real = lambda rows: int((ids[rows] == cfg.image_token_id).sum())  # noqa: E731
    blocks = [(_vision(cfg, grids[r], [pixels[i] for i in range(8)[r]]), n_real(r))
              for r in (slice(0, 3), slice(3, 8))]
    assert all(v["pixel_values"].shape[0] % 40 == 0 for v, _ in blocks)  # both blocks carry a filler
    merged = sharding.merge_vision(blocks, cfg.vision.spatial_merge_size ** 2)
    assert merged.keys() == whole.keys()
    forward = jax.jit(lambda vision: module.apply({"params": params}, ids, positions, mask, vision,  # noqa: E731
                                                  return_logits=False)[0])
    np.testing.assert_allclose(forward(merged), forward(whole), atol=1e-5)
    shuffled = sharding.merge_vision(blocks[::-1], cfg.vision.spatial_merge_size ** 2)
    assert not np.allclose(forward(shuffled), forward(whole), atol=1e-3)  # order matters: the test can fail


def test_place_batch_splits_rows_and_pixels_and_replicates_the_vision_layout():
    mesh = _mesh(2, 4)
    batch = dict(_vision_batch(TINY), normalizer=np.float32(3.0), meta={"x": 1})
    placed = sharding.place_batch(batch, mesh)
    assert placed["meta"] is batch["meta"]
    assert placed["normalizer"].sharding.is_fully_replicated
    for key in ("input_ids", "targets", "loss_mask"):
        assert {s.data.shape for s in placed[key].addressable_shards} == {(1, 40)}
    assert {s.data.shape for s in placed["positions"].addressable_shards} == {(3, 1, 40)}
    vision = dict(placed["vision"])
    pixels = vision.pop("pixel_values")  # 4 images of 16 patches and 4 of 32, bucketed to 200: 25 per device
    assert {sh.data.shape for sh in pixels.addressable_shards} == {(25, TINY.vision.patch_dim)}
    np.testing.assert_array_equal(np.asarray(pixels), batch["vision"]["pixel_values"])
    assert all(len(v.sharding.device_set) == 8 and v.sharding.is_fully_replicated for v in vision.values())
    again = sharding.place_batch(placed, mesh)
    assert again["input_ids"] is placed["input_ids"]
