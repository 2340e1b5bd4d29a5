"""Padding-free batches: the packer's row plan, and packed batches that give every example the same log-probs,
loss and gradients as the padded batch (screenshots deduplicated, per-device blocks, on a mesh)."""
from __future__ import annotations

import dataclasses

import chex
import jax
import numpy as np
import pytest

from guijax import objectives, sharding, train_step
from guijax.data import packing
from guijax.data.packing import PackingError, fewest_rows, least_slack_rows, plan_minibatches, plan_rows
from guijax.data.pipeline import Collate, EncodeStep, PipelineConfig, StepRef, make_dataset, step_refs
from guijax.models import weights
from step_histories import trajectories

CONFIG = PipelineConfig(batch_size=8, max_images=3, length_buckets=(128, 256, 512, 1024), patch_bucket=64,
                        system_prompt="Task: {instruction}\n", shuffle=False, response_bucket=16)


@pytest.fixture(scope="module")
def module_params(cfg):
    module = weights.build_module(cfg)
    return module, weights.init_params(module, jax.random.PRNGKey(0))


def _examples(proc, **kwargs) -> list[dict]:
    trajs = trajectories(proc, **kwargs)
    encode = EncodeStep(trajs, proc, CONFIG)
    return [encode.map(r) for r in step_refs(trajs, [1.0, -0.5])]


@pytest.fixture(scope="module")
def examples(proc):
    return _examples(proc)


@pytest.fixture(scope="module")
def one_size(proc):
    """Every screenshot 56 x 84: what a fixed vision shape (`vision_images`) takes."""
    return _examples(proc, sizes=((56, 84),))


def test_rows_are_packed_within_their_blocks():
    layout = plan_rows([60, 50, 40, 30, 20, 10], batch_size=8, length=100)
    assert layout.rows == [[0, 2], [1, 3, 4], [5]] and layout.starts[3] == (1, 50)  # 100, 100, 10 tokens
    # two blocks of four: examples 0-3 only in rows 0-1, examples 4-5 only in rows 2-3 (the last row empty)
    blocked = plan_rows([60, 50, 40, 30, 20, 10], batch_size=8, length=100, blocks=2)
    assert blocked.rows == [[0, 2], [1, 3], [4, 5], []] and blocked.rows_per_block == 2
    assert plan_rows([60, 50], batch_size=8, length=100, rows=4, blocks=2).rows == [[0], [1], [], []]
    with pytest.raises(PackingError, match="need 2 rows of 100 tokens; the packed shape has 1") as err:
        plan_rows([60, 50], batch_size=2, length=100, rows=1)
    assert err.value.example == 1
    with pytest.raises(PackingError, match="example 1 has 120 tokens, more than the packed row length 100"):
        plan_rows([60, 120], batch_size=2, length=100)
    # growing: rows x 2^k per block, the fewest that hold the fullest block
    assert len(plan_rows([60, 50, 40, 30, 20, 10], batch_size=8, length=100, rows=1, grow=True).rows) == 4
    assert len(plan_rows([60, 50, 40, 30, 20, 10], batch_size=8, length=100, rows=2, blocks=2, grow=True).rows) == 4


def test_pack_length_rules(cfg):
    one_row = Collate(cfg, dataclasses.replace(CONFIG, pack=True))._pack_length  # buckets 128, 256, 512, 1024
    assert one_row([100] * 3, 8, 1) == 512 and one_row([300] * 8, 8, 1) == 1024  # one row, else the largest
    assert one_row([100] * 8, 8, 2) == 512  # the fullest block's 400 tokens in one row
    choose = Collate(cfg, dataclasses.replace(CONFIG, pack=True, pack_length_rule="fewest_slots"))._pack_length
    assert choose([200] * 5, 8, 1) == 1024  # one row of five: 1,024 slots against 1,280 (256) and 1,536 (512)
    assert choose([130] * 3, 8, 1) == 512  # 130 + 130 > 256: three rows of 256 hold 768 slots, one of 512 holds 512
    assert choose([100, 100], 8, 1) == 128  # 2 x 128 and 1 x 256 tie: the shorter rows
    # each block gets as many rows as its fullest: one block needs 3 rows of 512 (the other 1), so 2 blocks x 3 x 512
    # slots against 2 x 1 x 1,024; as one block, 3 rows of 512 hold all eight
    lengths = [300, 300, 300, 100, 100, 100, 100, 100]
    assert choose(lengths, 8, 2) == 1024 and choose(lengths, 8, 1) == 512
    assert choose([2000], 8, 1) == 1024  # longer than every bucket: plan_rows names it
    fixed = Collate(cfg, dataclasses.replace(CONFIG, pack=True, pack_rows=2, pack_length_rule="fewest_slots"))
    assert fixed._pack_length([100] * 4, 8, 1) == 256  # two rows of 256 hold four; two of 128 would double to four
    with pytest.raises(ValueError, match="pack_length_rule='fullest'"):
        Collate(cfg, dataclasses.replace(CONFIG, pack=True, pack_length_rule="fullest"))._pack_length([100], 8, 1)


def _per_example(padded: dict, values: np.ndarray) -> list[np.ndarray]:
    """Each padded row's values at its loss positions, in order."""
    return [values[i][padded["loss_mask"][i] > 0] for i in range(len(padded["loss_mask"]))]


def test_packed_batch_gives_each_example_its_padded_log_probs(proc, cfg, one_size, module_params):
    module, params = module_params
    examples = one_size
    padded = Collate(cfg, CONFIG)(examples)
    # the 8 distinct screenshots padded with blank ones to 12: the tower's extra work changes no feature used
    packed = Collate(cfg, dataclasses.replace(CONFIG, pack=True, pack_length=1280, vision_images=12))(examples)
    assert packed["input_ids"].shape == (1, 1280) and packed["attention_mask"].max() == 8  # 8 segments, one row
    assert packed["meta"]["unique_screenshots"] == 8 and packed["vision"]["image_tokens"].shape[0] == 12
    # 99.8% of one packed row against 62% of eight rows padded to the 256 bucket
    assert packed["meta"]["token_fill"] > 0.99 and padded["meta"]["token_fill"] < 0.63, (
        packed["meta"]["token_fill"], padded["meta"]["token_fill"])
    auto = Collate(cfg, dataclasses.replace(CONFIG, pack=True))(examples)
    assert auto["input_ids"].shape == (2, 1024)  # the largest bucket, as many rows as packing needs
    fewest = Collate(cfg, dataclasses.replace(CONFIG, pack=True, pack_length_rule="fewest_slots"))(examples)
    # the bucket with the fewest token slots: 6 rows of 256 (1,536) against 2 of 1,024 or 3 of 512
    assert fewest["input_ids"].shape == (6, 256) and fewest["meta"]["token_fill"] > 0.83
    fn = train_step.make_logprob_fn(module, temperature=0.7)
    strip = lambda b: {k: v for k, v in b.items() if k != "meta"}  # noqa: E731
    logp, entropy = (np.asarray(x) for x in fn(params, strip(packed)))
    ref_logp, ref_entropy = (np.asarray(x) for x in fn(params, strip(padded)))
    counts = packed["loss_mask"].sum(1).astype(int)
    for i, (want_lp, want_h) in enumerate(zip(_per_example(padded, ref_logp), _per_example(padded, ref_entropy))):
        assert counts[i] == len(want_lp) > 0
        np.testing.assert_allclose(logp[i, :counts[i]], want_lp, atol=2e-5)
        np.testing.assert_allclose(entropy[i, :counts[i]], want_h, atol=2e-5)
    for key in ("targets", "advantages", "behaviour_logprobs"):
        for i, want in enumerate(_per_example(padded, padded[key])):
            np.testing.assert_array_equal(packed[key][i, :counts[i]], want)


def test_packed_grpo_loss_and_gradients_equal_the_padded_batch(proc, cfg, examples, module_params):
    module, params = module_params
    strip = lambda b: {k: v for k, v in b.items() if k != "meta"}  # noqa: E731
    padded = strip(Collate(cfg, CONFIG)(examples[:5]))
    packed = strip(Collate(cfg, dataclasses.replace(CONFIG, pack=True, pack_length=512))(examples[:5]))
    assert packed["loss_mask"].shape[0] == 8 and packed["loss_mask"][5:].sum() == 0  # rows padded to the batch
    # the same old log-probs, away from the current ones so the ratios clip: drawn per example's loss token
    noise = np.random.RandomState(0).normal(0, 0.3, (5, 64)).astype(np.float32)
    old_packed = np.zeros_like(packed["loss_mask"])
    old_padded = np.zeros_like(padded["loss_mask"])
    for i in range(5):
        k = int(packed["loss_mask"][i].sum())
        old_packed[i, :k] = packed["behaviour_logprobs"][i, :k] + noise[i, :k]
        old_padded[i, padded["loss_mask"][i] > 0] = old_packed[i, :k]
    step = train_step.StepConfig(objectives.WithCrossEntropy(objectives.ClippedPolicyLoss(), 0.1))
    grad = jax.jit(jax.value_and_grad(train_step.loss_fn, has_aux=True), static_argnums=(2, 3))
    (loss, metrics), grads = grad(params, dict(packed, old_logp=old_packed), module, step)
    (ref_loss, ref_metrics), ref_grads = grad(params, dict(padded, old_logp=old_padded), module, step)
    assert np.isfinite(float(loss)) and float(metrics["clip_frac_low"] + metrics["clip_frac_high"]) > 0
    chex.assert_trees_all_close(metrics, ref_metrics, atol=1e-5, rtol=1e-4)
    chex.assert_trees_all_close(grads, ref_grads, atol=1e-5, rtol=1e-4)


def _shapes(batch: dict) -> tuple:
    return tuple((k, np.shape(v)) for k, v in sorted({**batch, **(batch["vision"] or {})}.items())
                 if k not in ("vision", "meta"))


@pytest.mark.parametrize("blocks", [1, 2])
def test_a_fixed_packed_shape_gives_every_batch_one_shape(proc, cfg, one_size, examples, blocks):
    """Packed rows, response budget and vision images fixed: batches of 4, 3 and 1 steps with different
    numbers of distinct screenshots are one shape, vision layout included (one compiled train step)."""
    config = dataclasses.replace(CONFIG, batch_size=4, pack=True, pack_length=512, pack_rows=2,
                                 max_response_tokens=32, vision_images=12 // blocks, pack_blocks=blocks,
                                 vision_blocks=blocks)
    collate = Collate(cfg, config)
    batches = [collate(one_size[:4]), collate(one_size[4:7]), collate(one_size[7:])]
    assert len({int(b["meta"]["unique_screenshots"]) for b in batches}) > 1  # 4, 3, 3 (6, 5, 3 in two blocks)
    assert len({_shapes(b) for b in batches}) == 1, [_shapes(b) for b in batches]
    # a batch past the fixed shape gets the fewest doublings that hold it (another shape, not a failed run)
    grown = Collate(cfg, dataclasses.replace(config, vision_images=1, pack_length=256))(one_size[:4])
    need = plan_rows([len(e["input_ids"]) for e in one_size[:4]], 4, 256, blocks=blocks).rows_per_block
    per = 2 // blocks
    while per < need:
        per *= 2
    assert per * blocks > 2 and grown["input_ids"].shape == (per * blocks, 256)
    assert grown["vision"]["image_tokens"].shape[-2] == 4  # one image per layout doubled to hold 4 (2 and 4)
    mixed = r"different sizes in one batch \(grid \(1, 4, [46]\) in task task-0 step \d, \(1, 4, [46]\) in"
    with pytest.raises(ValueError, match=mixed):
        collate(examples[:4])
    with pytest.raises(ValueError, match=r"task task-\d .* step \d: example \d has \d+ tokens, more than the packed row"):
        Collate(cfg, dataclasses.replace(config, pack_length=128))(one_size[:4])


@pytest.mark.slow  # 21 s each; blocks' shapes stay in the default suite (the fixed-shape test), values here
@pytest.mark.parametrize("dedupe", [True, False])
def test_packed_blocks_keep_each_example_and_its_screenshots_in_its_block(proc, cfg, examples, module_params, dedupe):
    module, params = module_params
    config = dataclasses.replace(CONFIG, pack=True, pack_length=512, pack_blocks=2, vision_blocks=2,
                                 dedupe_images=dedupe)
    packed = Collate(cfg, config)(examples[:6])
    blocks, per_block, _ = packed["token_index"].shape
    assert (blocks, per_block) == (2, 4)
    per_block_tokens = packed["input_ids"].shape[0] // 2 * 512
    assert packed["token_index"].max() < per_block_tokens  # indices local to the block
    assert packed["vision"]["pixel_values"].shape[0] == 2
    padded = Collate(cfg, CONFIG)(examples[:6])
    fn = train_step.make_logprob_fn(module)
    strip = lambda b: {k: v for k, v in b.items() if k != "meta"}  # noqa: E731
    logp = np.asarray(fn(params, strip(packed))[0])
    ref = _per_example(padded, np.asarray(fn(params, strip(padded))[0]))
    for i in range(6):
        np.testing.assert_allclose(logp[i, :len(ref[i])], ref[i], atol=2e-5)


@pytest.mark.slow
def test_packed_blocks_on_a_mesh_equal_one_device(proc, cfg, examples, module_params):
    """Eight blocks over data x fsdp = 8 devices: each device gathers its own examples' positions."""
    module, params = module_params
    config = dataclasses.replace(CONFIG, pack=True, pack_length=512, pack_blocks=8, vision_blocks=8)
    batch = {k: v for k, v in Collate(cfg, config)(examples).items() if k != "meta"}
    mesh = sharding.make_mesh(sharding.MeshConfig(data=2, fsdp=4, tensor=1))
    fn = train_step.make_logprob_fn(module, mesh=mesh)
    placed = fn.place(batch)
    assert placed["token_index"].sharding.spec[0] == ("data", "fsdp")
    chex.assert_trees_all_close(fn(params, batch), train_step.make_logprob_fn(module)(params, batch), atol=1e-5)
    with pytest.raises(ValueError, match="packed batch .* does not divide over 8 data-parallel devices"):
        fn.place({k: v for k, v in Collate(cfg, dataclasses.replace(config, pack_blocks=2, vision_blocks=2))(
            examples).items() if k != "meta"})


def test_a_recipe_packs_per_data_parallel_device(tiny_config):
    from guijax.trainer import pipeline_config

    mesh = sharding.make_mesh(sharding.MeshConfig(data=2, fsdp=4, tensor=1))
    config = tiny_config("grpo_cpu", "pipeline.pack=True", "pipeline.pack_rows=8", "pipeline.pack_length=512",
                         "pipeline.max_response_tokens=32", "pipeline.vision_images=8")
    built = pipeline_config(config, "Task: {instruction}\n", mesh)
    assert (built.pack, built.pack_rows, built.pack_length, built.max_response_tokens,
            built.vision_images) == (True, 8, 512, 32, 8)
    assert built.pack_blocks == 8 and pipeline_config(config, "", None).pack_blocks == 1
    assert not built.pack_fill
    filled = tiny_config("grpo_cpu", "pipeline.pack=True", "pipeline.pack_rows=1", "pipeline.pack_length=512",
                         "pipeline.pack_fill=True")
    assert pipeline_config(filled, "", None).pack_fill
    with pytest.raises(ValueError, match="train.minibatch_size=6 .* multiples of the 8 data-parallel devices"):
        pipeline_config(tiny_config("grpo_cpu", "pipeline.pack=True", "train.minibatch_size=6"), "", mesh)


def test_preference_batches_pad_their_steps_to_the_packing_blocks(proc, cfg):
    """DPO / step-DPO score trajectories in one batch of all their steps: two last steps padded to 4 rows
    for 4 blocks (a power of two alone would leave 2, which 4 devices cannot split)."""
    from guijax.offline import _steps_batch

    trajs = trajectories(proc)
    config = dataclasses.replace(CONFIG, pack=True, pack_blocks=4)
    batch, segments = _steps_batch(trajs, proc, cfg, config, last_step_only=True)
    assert batch["loss_mask"].shape[0] == 4 and batch["token_index"].shape[:2] == (4, 1)
    assert list(segments) == [0, 1, 2, 2]  # the padding rows' segment is dropped by the segment sum
    # a recipe with token-budget minibatches still scores all its steps in one batch
    filled = dataclasses.replace(CONFIG, pack=True, pack_length=512, pack_rows=1, pack_fill=True)
    batch, segments = _steps_batch(trajs, proc, cfg, filled)
    assert batch["loss_mask"].shape[0] == 8 and list(segments) == [0] * 4 + [1] * 4


def test_rows_are_the_fewer_of_first_fit_and_least_slack_filling():
    """Each row filled by the subset that leaves it least room saves the row first-fit leaves part-filled;
    where committing early loses a row instead, first-fit's rows are kept; the rows cover every example once
    within the row length and per-row count; past the work budget first-fit is used alone."""
    lengths = [3, 2, 5, 2, 4, 4]  # first-fit decreasing: [5, 4] [4, 3, 2] [2]
    filled = least_slack_rows(range(6), lengths, 10)
    assert sorted(sorted(lengths[i] for i in row) for row in filled) == [[2, 3, 5], [2, 4, 4]]
    assert len(fewest_rows(range(6), lengths, 10)) == 2 and len(plan_rows(lengths, 6, 10).rows) == 2
    assert len(least_slack_rows(range(6), lengths, 10, per_row=2)) == 3
    worse = [8, 7, 6, 21, 23, 3, 15, 8, 16, 8]  # filling [21, 6, 3] first strands the 8s: 5 rows, first-fit 4
    assert len(least_slack_rows(range(10), worse, 30)) == 5 and len(fewest_rows(range(10), worse, 30)) == 4
    rs = np.random.RandomState(3)
    for _ in range(40):
        n, length, per_row = rs.randint(5, 40), int(rs.choice([100, 1024])), [None, 3, 8][rs.randint(3)]
        sizes = rs.randint(1, length // 2, n)
        rows = fewest_rows(range(n), sizes, length, per_row)
        assert sorted(i for row in rows for i in row) == list(range(n))
        assert all(sizes[row].sum() <= length and len(row) <= (per_row or n) for row in map(list, rows))
        assert -(-sizes.sum() // length) <= len(rows) <= len(packing._first_fit(range(n), sizes, length, per_row))
    # grpo_cpu's steps of 150-270 tokens in 768-token rows: first-fit 17 rows, the floor 16
    steps = rs.randint(150, 270, 60)
    assert -(-steps.sum() // 768) == len(fewest_rows(range(60), steps, 768, 8)) < len(
        packing._first_fit(range(60), steps, 768, 8))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(packing, "LEAST_SLACK_BUDGET", 0)
        assert len(fewest_rows(range(6), lengths, 10)) == 3


def test_blank_examples_cost_no_row_of_their_own():
    """A short packing block is completed with blank examples (no tokens) when it is collated; they go where
    rows have a free place, so a block planned in `rows` rows still fits them."""
    assert len(plan_rows([3, 2, 5, 2, 4, 4, 0, 0], 8, 10, rows=2).rows) == 2
    assert len(plan_rows([3, 2, 5, 2, 0, 0], 6, 10, rows=2).rows) == 2
    assert len(fewest_rows(range(4), [5, 5, 0, 0], 10, per_row=2)) == 2  # the blanks take a third row only past per_row
    assert len(fewest_rows(range(5), [5, 5, 0, 0, 0], 10, per_row=2)) == 3
    rs = np.random.RandomState(7)  # blocks of 2 rows x 1,024 and 8 steps, as 2 devices' halves of 4 x 1,024, 16
    lengths = rs.randint(150, 500, 200)
    for members in plan_minibatches(lengths, rows=2, length=1024, max_examples=8, seed=2):
        padded = [lengths[i] for i in members] + [0] * (8 - len(members))
        assert len(plan_rows(padded, 8, 1024, rows=2).rows) == 2


def test_minibatches_are_planned_from_rows_packed_over_the_pass():
    """Rows packed over the whole pass (at most `max_examples` to a row), then grouped, in a
    seeded order, into minibatches of `rows` rows and at most `max_examples` examples; too long an example
    is named."""
    lengths = [60, 50, 40, 30, 20, 10, 90, 5]
    assert sorted(plan_minibatches(lengths, rows=1, length=100, max_examples=3)) == [[0, 2], [1, 3, 4], [5, 6], [7]]
    assert sorted(plan_minibatches(lengths, rows=1, length=100, max_examples=2)) == [[0, 2], [1, 3], [4, 7], [5, 6]]
    assert plan_minibatches([60, 50, 40, 30], rows=2, length=100, max_examples=8) == [[0, 1, 2, 3]]
    assert sorted(plan_minibatches([60, 50, 40, 30], rows=2, length=100, max_examples=2)) == [[0, 2], [1, 3]]
    with pytest.raises(PackingError, match="example 1 has 120 tokens, more than the packed row length 100"):
        plan_minibatches([60, 120], rows=1, length=100, max_examples=4)
    rs = np.random.RandomState(0)  # prompts of 150-500 tokens, as grpo_cpu's: nearly every slot filled
    lengths = rs.randint(150, 500, 400)
    plan = plan_minibatches(lengths, rows=2, length=1024, max_examples=16, seed=1)
    assert plan == plan_minibatches(lengths, rows=2, length=1024, max_examples=16, seed=1)
    assert sorted(i for members in plan for i in members) == list(range(400))
    for members in plan:
        assert len(members) <= 16 and len(plan_rows([lengths[i] for i in members], 16, 1024, rows=2).rows) == 2
    assert lengths.sum() / (len(plan) * 2 * 1024) > 0.97  # 0.979 (first-fit rows alone: 0.950)
    # GUI steps of 1-6k tokens (several screenshots each) in 16k-token rows, as the GPU recipes' shapes: 0.960
    gui = rs.randint(1000, 6000, 200)
    assert gui.sum() / (len(plan_minibatches(gui, rows=1, length=16384, max_examples=8)) * 16384) > 0.95
    # rows come in a random order, not longest first: the first minibatches hold steps of the usual length
    first = [lengths[i] for members in plan[:len(plan) // 4] for i in members]
    assert abs(np.mean(first) / np.mean(lengths) - 1) < 0.15


def _with_text_step(trajs: list) -> list:
    """The trajectories plus one whose steps are text with no sampled ids (expert traces)."""
    from guijax.rollout.trajectory import Source, Step, Trajectory

    t = trajs[0]
    text = [Step(s.screenshot, s.response, np.zeros(0, np.int32), np.zeros(0, np.float32)) for s in t.steps]
    return [*trajs, Trajectory("task-text", t.instruction, text, source=Source.EXPERT)]


def test_token_budget_minibatches_hold_every_step_once_in_one_shape(proc, cfg):
    """`pack_fill`: the steps' counted lengths are their encoded lengths, the planned minibatches hold every
    step once, all in one shape, and they fill more of it than minibatches of a fixed step count."""
    trajs = _with_text_step(trajectories(proc, n=3, steps=4, sizes=((56, 84),)))
    refs = step_refs(trajs, [1.0, -0.5, 0.5, 1.0])
    config = dataclasses.replace(CONFIG, batch_size=6, pack=True, pack_length=512, pack_rows=1,
                                 max_response_tokens=32, vision_images=12, shuffle=True, seed=3)
    encode = EncodeStep(trajs, proc, config)
    assert [encode.length(r) for r in refs] == [len(encode.map(r)["input_ids"]) for r in refs]
    filled = list(make_dataset(trajs, refs, proc, cfg, dataclasses.replace(config, pack_fill=True)))
    fixed = list(make_dataset(trajs, refs, proc, cfg, config))
    seen = [(int(t), int(s)) for b in filled for t, s in zip(b["meta"]["trajectory"], b["meta"]["step"])]
    assert sorted(seen) == sorted((r.trajectory, r.step) for r in refs)
    assert len({_shapes(b) for b in filled}) == 1 and filled[0]["input_ids"].shape == (1, 512)
    slots = lambda batches: sum(b["input_ids"].size for b in batches)  # noqa: E731
    assert slots(filled) < slots(fixed)


def test_token_budget_minibatches_name_what_they_need(proc, cfg):
    trajs = trajectories(proc, n=1, steps=2)
    refs = step_refs(trajs)
    base = dataclasses.replace(CONFIG, pack=True, pack_length=512, pack_rows=1, pack_fill=True)
    with pytest.raises(ValueError, match="set pipeline.pack_rows"):
        make_dataset(trajs, refs, proc, cfg, dataclasses.replace(base, pack_rows=None))
    with pytest.raises(ValueError, match="one pass over the steps; num_epochs=None"):
        make_dataset(trajs, refs, proc, cfg, dataclasses.replace(base, num_epochs=None))
    with pytest.raises(ValueError, match="pack_rows=1 and batch size 8 must be multiples of the 2 packing blocks"):
        make_dataset(trajs, refs, proc, cfg, dataclasses.replace(base, pack_blocks=2, batch_size=8))
    with pytest.raises(ValueError, match=r"trajectory 0 step \d: example \d has \d+ tokens, more than the packed row"):
        make_dataset(trajs, refs, proc, cfg, dataclasses.replace(base, pack_length=64))


def test_token_budget_minibatches_fill_each_devices_block(proc, cfg, module_params):
    """With 2 packing blocks each block is planned as a minibatch of its own (1 row, up to 3 steps) and a block
    with fewer steps holds its place with blank examples (rows of 190 tokens hold one step of 96-186 each):
    every step once, in one shape, with its padded log-probs, the gather from rows to steps inside each block."""
    module, params = module_params
    trajs = trajectories(proc, n=3, steps=3, sizes=((56, 84),))
    refs = step_refs(trajs, [1.0, -0.5, 0.5])
    config = dataclasses.replace(CONFIG, batch_size=6, pack=True, pack_length=190, pack_rows=2, pack_blocks=2,
                                 vision_blocks=2, max_response_tokens=32, vision_images=3, pack_fill=True,
                                 shuffle=True, seed=1)
    batches = list(make_dataset(trajs, refs, proc, cfg, config))
    seen = [(int(t), int(s)) for b in batches for t, s in zip(b["meta"]["trajectory"], b["meta"]["step"]) if t >= 0]
    assert sorted(seen) == sorted((r.trajectory, r.step) for r in refs)
    assert len({_shapes(b) for b in batches}) == 1 and batches[0]["token_index"].shape[:2] == (2, 3)
    assert any((b["meta"]["trajectory"] < 0).any() for b in batches)  # a short block held its place
    encode = EncodeStep(trajs, proc, CONFIG)
    fn = train_step.make_logprob_fn(module)
    strip = lambda b: {k: v for k, v in b.items() if k != "meta"}  # noqa: E731
    for batch in batches:
        logp = np.asarray(fn(params, strip(batch))[0])
        for row, (t, s) in enumerate(zip(batch["meta"]["trajectory"], batch["meta"]["step"])):
            if t < 0:
                assert not batch["loss_mask"][row].any()
                continue
            alone = Collate(cfg, CONFIG)([encode.map(StepRef(int(t), int(s), 1.0))])
            want = np.asarray(fn(params, strip(alone))[0])[0][alone["loss_mask"][0] > 0]
            np.testing.assert_allclose(logp[row, :len(want)], want, atol=2e-5)
