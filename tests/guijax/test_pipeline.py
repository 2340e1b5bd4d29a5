"""grain step pipeline: prompts rebuilt exactly, masks on the response tokens (shifted for targets), off-policy
text closed with <|im_end|>, length/patch buckets, forward inputs equal to per-example ones (the tiny model gives
the same logits padded or not), deterministic order, resumable iterator state, worker processes, global sharding."""
from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from guijax import sharding
from guijax.data.pipeline import (Collate, EncodeStep, PipelineConfig, ResponseBudgetError, StepRef, global_batch,
                                  make_dataset, response_positions, step_refs)
from guijax.data.store import TrajectoryStore
from guijax.models import policy as policy_lib
from guijax.rollout.trajectory import Source, Step, Trajectory

SYSTEM = "Task: {instruction}\n"
CONFIG = PipelineConfig(batch_size=4, max_images=2, length_buckets=(64, 128, 256, 512), patch_bucket=64,
                        system_prompt=SYSTEM, seed=3)


def make_trajectories(proc, n: int = 4) -> list[Trajectory]:
    """On-policy trajectories with sampled ids + log-probs, and expert ones with text only; mixed screen sizes."""
    rs = np.random.RandomState(0)
    im_end = proc.tokenizer.convert_tokens_to_ids("<|im_end|>")
    out = []
    for i in range(n):
        sampled = i % 2 == 0
        steps = []
        for j in range(1 + i % 3):
            h, w = [(56, 56), (84, 112), (112, 84)][(i + j) % 3]
            text = f"Thought: click button {j}\nAction: click(start_box='({i},{j})')"
            tokens = np.asarray(proc.tokenizer(text, add_special_tokens=False)["input_ids"] + [im_end], np.int32)
            steps.append(Step(rs.randint(0, 256, (h, w, 3), dtype=np.uint8), text,
                              tokens if sampled else np.zeros(0, np.int32),
                              -rs.rand(len(tokens)).astype(np.float32) if sampled else np.zeros(0, np.float32)))
        out.append(Trajectory(f"task-{i}", f"open the file menu {i}", steps,
                              source=Source.ON_POLICY if sampled else Source.EXPERT,
                              plan=("open menu", "click file") if i == 1 else (),
                              meta={"guidance": "Skill:\n1. open menu"} if i == 2 else {}))
    return out


def collect(ds, k=None):
    it = iter(ds)
    return [next(it) for _ in range(k)] if k else list(it)


def assert_batches_equal(a, b):
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], dict):
            assert_batches_equal(a[key], b[key])
        elif a[key] is None:
            assert b[key] is None
        else:
            np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def test_step_refs(proc):
    trajs = make_trajectories(proc)
    refs = step_refs(trajs, [0.5, -1.0, 2.0, 0.0])
    assert [(r.trajectory, r.step) for r in refs] == [(0, 0), (1, 0), (1, 1), (2, 0), (2, 1), (2, 2), (3, 0)]
    assert [r.advantage for r in refs[:3]] == [0.5, -1.0, -1.0]
    assert [(r.trajectory, r.step, r.advantage) for r in step_refs(trajs, {2: 1.5, 0: -0.5})] == [
        (0, 0, -0.5), (2, 0, 1.5), (2, 1, 1.5), (2, 2, 1.5)]
    assert {r.advantage for r in step_refs(trajs)} == {1.0}
    with pytest.raises(ValueError, match="3 advantages for 4 trajectories"):
        step_refs(trajs, [1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match=r"outside the 4 given"):
        step_refs(trajs, {7: 1.0})


def expected_prompt(instruction: str, plan_lines: str, responses: list[str], pads: list[int | None]) -> str:
    """The Qwen2.5-VL chat layout written out by hand (not through build_messages or the chat template): the
    default system turn, the user's task text, then per earlier step an image turn when that screenshot is
    still shown (`pads[i]` image-pad tokens, None when it is text only) and the assistant's response, then the
    current screenshot (`pads[-1]`) and the opened assistant turn."""
    def image(n):
        return f"<|im_start|>user\n<|vision_start|>{'<|image_pad|>' * n}<|vision_end|><|im_end|>\n"

    text = (f"<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
            f"<|im_start|>user\nTask: {instruction}{plan_lines}\n<|im_end|>\n")
    for response, n in zip(responses, pads):
        text += (image(n) if n is not None else "") + f"<|im_start|>assistant\n{response}<|im_end|>\n"
    return text + image(pads[-1]) + "<|im_start|>assistant\n"


def merged_tokens(screenshot: np.ndarray) -> int:
    """Image-pad tokens of one screenshot: one per 28x28 block (14 px patches merged 2x2); the test sizes
    are multiples of 28 within the resize bounds, so no resizing happens."""
    h, w = screenshot.shape[:2]
    assert h % 28 == 0 and w % 28 == 0
    return (h // 28) * (w // 28)


def image_pad_runs(ids: np.ndarray, image_token_id: int) -> list[int]:
    """Lengths of the runs of consecutive image-pad tokens, in order."""
    runs, n = [], 0
    for hit in np.append(ids == image_token_id, False):
        if hit:
            n += 1
        elif n:
            runs.append(n)
            n = 0
    return runs


def test_example_token_layout(proc, cfg):
    """Each example decodes to the hand-written chat layout (instruction, plan or guidance lines, history turns as text,
    the last max_images=2 screenshots as image-pad runs of patches / merge² tokens); loss_mask covers exactly
    the response tokens, <|im_end|> included."""
    trajs = make_trajectories(proc)
    encode = EncodeStep(trajs, proc, CONFIG)
    tok = proc.tokenizer
    for ref in step_refs(trajs, [0.5, -1.0, 2.0, 0.25]):
        ex = encode.map(ref)
        traj, step = trajs[ref.trajectory], trajs[ref.trajectory].steps[ref.step]
        ids, mask = ex["input_ids"], ex["loss_mask"]
        steps = traj.steps[:ref.step + 1]
        shown = [merged_tokens(s.screenshot) for s in steps]
        pads = [n if i >= ref.step - 1 else None for i, n in enumerate(shown)]  # the current one and the one before
        plan_lines = {1: "\n\n1. open menu\n2. click file", 2: "\n\nSkill:\n1. open menu"}.get(ref.trajectory, "")
        prompt = expected_prompt(traj.instruction, plan_lines, [s.response for s in steps[:-1]], pads)
        prompt_ids = np.asarray(tok(prompt, add_special_tokens=False)["input_ids"])
        n_prompt = len(prompt_ids)
        np.testing.assert_array_equal(ids[:n_prompt], prompt_ids)
        assert tok.decode(ids[:n_prompt], skip_special_tokens=False) == prompt
        np.testing.assert_array_equal(mask, np.arange(len(ids)) >= n_prompt)
        assert image_pad_runs(ids, cfg.image_token_id) == [n for n in pads if n is not None]
        grids = ex["image_grid_thw"]
        np.testing.assert_array_equal(grids, [[1, s.screenshot.shape[0] // 14, s.screenshot.shape[1] // 14]
                                              for s in steps[-2:]])
        assert [int(g.prod()) // cfg.vision.spatial_merge_size ** 2 for g in grids] == image_pad_runs(
            ids, cfg.image_token_id)
        assert len(ex["pixel_values"]) == int(np.prod(grids, axis=1).sum())
        response = ids[n_prompt:]
        assert tok.decode(response, skip_special_tokens=False) == step.response + "<|im_end|>"
        if traj.source is Source.ON_POLICY:  # the exact sampled ids and their log-probs
            np.testing.assert_array_equal(response, step.response_tokens)
            np.testing.assert_array_equal(ex["behaviour_logprobs"][n_prompt:], step.behaviour_logprobs)
        else:  # off-policy text: no behaviour log-probs
            assert not ex["behaviour_logprobs"].any()
        assert not ex["behaviour_logprobs"][:n_prompt].any()
        np.testing.assert_array_equal(ex["advantages"], mask * np.float32(ref.advantage))
        assert (ex["trajectory"], ex["step"], ex["task_id"], ex["source"]) == (
            ref.trajectory, ref.step, traj.task_id, traj.source.value)


@pytest.mark.parametrize("max_images", [1, 3, 6])
def test_encoded_rows_keep_the_last_max_images_screenshots(proc, cfg, max_images):
    """A 5-step trajectory whose screenshots all differ in size: each row's image-pad runs are those of the
    last max_images screenshots up to its step, in order, and the older steps are there as text only."""
    sizes = [(56, 56), (56, 84), (84, 84), (56, 112), (112, 112)]  # 4, 6, 9, 8, 16 merged tokens
    rs = np.random.RandomState(1)
    steps = [Step(rs.randint(0, 256, (*hw, 3), dtype=np.uint8), f"Thought: step {j}\nAction: wait()",
                  np.zeros(0, np.int32), np.zeros(0, np.float32)) for j, hw in enumerate(sizes)]
    trajs = [Trajectory("long", "scroll down", steps, source=Source.EXPERT)]
    encode = EncodeStep(trajs, proc, dataclasses.replace(CONFIG, max_images=max_images))
    tokens = [merged_tokens(s.screenshot) for s in steps]
    for j in range(len(steps)):
        ex = encode.map(StepRef(0, j, 1.0))
        runs = image_pad_runs(ex["input_ids"], cfg.image_token_id)
        assert runs == tokens[max(0, j + 1 - max_images):j + 1]
        text = proc.tokenizer.decode(ex["input_ids"], skip_special_tokens=False)
        assert all(f"Thought: step {i}\n" in text for i in range(j + 1))  # every step's text, images or not
        pads = [n if i > j - max_images else None for i, n in enumerate(tokens[:j + 1])]
        prompt = expected_prompt("scroll down", "", [s.response for s in steps[:j]], pads)
        assert text == prompt + steps[j].response + "<|im_end|>"


def test_batches_shift_targets_and_masks(proc, cfg):
    trajs = make_trajectories(proc)
    refs = step_refs(trajs, [0.5, -1.0, 2.0, 0.25])
    config = dataclasses.replace(CONFIG, shuffle=False)
    batches = collect(make_dataset(trajs, refs, proc, cfg, config))
    assert [len(b["input_ids"]) for b in batches] == [4, 3]
    encode = EncodeStep(trajs, proc, config)
    for k, batch in enumerate(batches):
        ids, attn, lm = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
        assert ids.shape[1] in config.length_buckets
        lengths = attn.sum(1)
        assert ids.shape[1] == min(b for b in config.length_buckets if b >= lengths.max())  # smallest bucket
        for row in range(len(ids)):
            ref = refs[4 * k + row]
            ex = encode.map(ref)
            n = len(ex["input_ids"])
            assert lengths[row] == n and (ids[row, n:] == proc.tokenizer.pad_token_id).all()
            np.testing.assert_array_equal(batch["targets"][row, :n - 1], ids[row, 1:n])  # t predicts t+1
            response = ex["input_ids"][ex["loss_mask"] > 0]
            np.testing.assert_array_equal(batch["targets"][row][lm[row] > 0], response)
            step = trajs[ref.trajectory].steps[ref.step]
            assert proc.tokenizer.decode(batch["targets"][row][lm[row] > 0],
                                         skip_special_tokens=False) == step.response + "<|im_end|>"
            assert lm[row].sum() == len(response) and lm[row, n - 1:].sum() == 0
            np.testing.assert_array_equal(batch["behaviour_logprobs"][row][lm[row] > 0],
                                          ex["behaviour_logprobs"][ex["loss_mask"] > 0])
            np.testing.assert_array_equal(batch["advantages"][row], lm[row] * np.float32(ref.advantage))
            source = trajs[ref.trajectory].source
            assert batch["off_policy"][row] == (source is not Source.ON_POLICY)
            assert batch["expert"][row] == float(source is Source.EXPERT)
            assert (batch["meta"]["trajectory"][row], batch["meta"]["step"][row]) == (ref.trajectory, ref.step)
            assert batch["meta"]["task_id"][row] == trajs[ref.trajectory].task_id
        assert batch["vision"]["pixel_values"].shape[0] % config.patch_bucket == 0


def _first_batch_and_examples(proc, cfg, batch_size=3):
    """Every row's screenshots encoded (no deduplication), as prepare_inputs would."""
    trajs = make_trajectories(proc)
    refs = step_refs(trajs)
    config = dataclasses.replace(CONFIG, shuffle=False, batch_size=batch_size, dedupe_images=False)
    batch = collect(make_dataset(trajs, refs, proc, cfg, config), 1)[0]
    encode = EncodeStep(trajs, proc, config)
    return batch, [encode.map(r) for r in refs[:batch_size]]


def test_batch_positions_and_vision_match_prepare_inputs(proc, cfg):
    """Positions equal prepare_inputs' on the same batch with the unpadded images; the filler image only
    appends zero patches and one grid row that no image-pad token refers to."""
    batch, examples = _first_batch_and_examples(proc, cfg)
    grids = np.concatenate([e["image_grid_thw"] for e in examples])
    pixels = np.concatenate([e["pixel_values"] for e in examples])
    assert len(pixels) % CONFIG.patch_bucket != 0  # so the filler image is really exercised
    reference = policy_lib.prepare_inputs(cfg, batch["input_ids"], batch["attention_mask"], pixels, grids)
    np.testing.assert_array_equal(batch["positions"], reference.positions)
    vision = batch["vision"]
    assert vision.keys() == reference.vision.keys()
    np.testing.assert_array_equal(vision["pixel_values"][:len(pixels)], pixels)
    assert not vision["pixel_values"][len(pixels):].any()
    assert len(vision["pixel_values"]) == -(-len(pixels) // CONFIG.patch_bucket) * CONFIG.patch_bucket
    assert len(vision["full_segments"]) == len(vision["pixel_values"])
    assert vision["full_segments"][-1] == len(grids)  # the filler is its own frame


@pytest.mark.slow
def test_padded_batch_forward_equals_each_example_alone(proc, cfg):
    """The tiny model's logits on the padded batch (filler image, length bucket, other rows) equal those of
    each example run alone through prepare_inputs."""
    from guijax.models import weights

    batch, examples = _first_batch_and_examples(proc, cfg)
    module = weights.build_module(cfg)
    params = weights.init_params(module, jax.random.PRNGKey(0))
    forward = jax.jit(lambda p, x: module.apply({"params": p}, x.input_ids, x.positions, x.attention_mask, x.vision)[0])
    padded = forward(params, policy_lib.ModelInputs(batch["input_ids"], batch["positions"], batch["attention_mask"],
                                                    batch["vision"]))
    for row, e in enumerate(examples):
        alone = policy_lib.prepare_inputs(cfg, e["input_ids"][None], None, e["pixel_values"], e["image_grid_thw"])
        n = len(e["input_ids"])
        np.testing.assert_allclose(np.asarray(padded[row, :n]), np.asarray(forward(params, alone)[0]), atol=2e-4)


def test_too_long_examples_name_the_task(proc, cfg):
    trajs = make_trajectories(proc)
    tight = dataclasses.replace(CONFIG, length_buckets=(32,))
    with pytest.raises(ValueError, match=r"task task-2 \(trajectory 2\) step 1: \d+ tokens .* exceed the largest "
                                         r"length bucket 32"):
        EncodeStep(trajs, proc, tight).map(StepRef(2, 1, 1.0))
    example = EncodeStep(trajs, proc, CONFIG).map(StepRef(3, 0, 1.0))
    with pytest.raises(ValueError, match=rf"task task-3 \(trajectory 3\) step 0: {len(example['input_ids'])} tokens "
                                         r"exceed the largest length bucket 32"):
        Collate(cfg, tight)([example])


def test_order_is_deterministic_and_epochs_reshuffle(proc, cfg):
    trajs = make_trajectories(proc)
    refs = step_refs(trajs)
    config = dataclasses.replace(CONFIG, batch_size=1, num_epochs=2)

    def order(c):
        return [(int(b["meta"]["trajectory"][0]), int(b["meta"]["step"][0])) for b in collect(
            make_dataset(trajs, refs, proc, cfg, c))]

    first = order(config)
    assert first == order(config)
    everything = sorted((r.trajectory, r.step) for r in refs)
    assert sorted(first[:7]) == everything and sorted(first[7:]) == everything  # epochs stay whole
    assert first[:7] != first[7:]  # and are shuffled differently
    assert order(dataclasses.replace(config, seed=4)) != first
    assert order(dataclasses.replace(config, shuffle=False, num_epochs=1)) == [(r.trajectory, r.step) for r in refs]


def test_iterator_state_restores(proc, cfg):
    trajs = make_trajectories(proc)
    refs = step_refs(trajs, [1.0, 2.0, 3.0, 4.0])
    config = dataclasses.replace(CONFIG, batch_size=2, num_epochs=None)  # endless: resumes across epochs
    it = iter(make_dataset(trajs, refs, proc, cfg, config))
    for _ in range(3):
        next(it)
    state = it.get_state()
    expected = [next(it) for _ in range(4)]
    fresh = iter(make_dataset(trajs, refs, proc, cfg, config))
    fresh.set_state(state)
    for want in expected:
        assert_batches_equal(next(fresh), want)


def test_store_source_equals_list(proc, cfg, tmp_path):
    trajs = make_trajectories(proc)
    store = TrajectoryStore(tmp_path)
    store.append(trajs[:3])
    store.append(trajs[3:])
    advantages = {0: 1.0, 1: -0.5, 3: 2.0}
    assert step_refs(store, advantages) == step_refs(trajs, advantages)
    refs = step_refs(store, advantages)
    for a, b in zip(collect(make_dataset(store, refs, proc, cfg, CONFIG)),
                    collect(make_dataset(trajs, refs, proc, cfg, CONFIG))):
        assert_batches_equal(a, b)


def test_worker_process_gives_identical_batches(proc, cfg):
    trajs = make_trajectories(proc)
    refs = step_refs(trajs)
    config = dataclasses.replace(CONFIG, batch_size=2, num_epochs=2)
    local = collect(make_dataset(trajs, refs, proc, cfg, config))
    # the processor travels as its directory and is loaded inside the worker
    worker = collect(make_dataset(trajs, refs, proc.tokenizer.name_or_path, cfg,
                                  dataclasses.replace(config, worker_count=1)))
    assert len(local) == len(worker) == 7
    for a, b in zip(local, worker):
        assert_batches_equal(a, b)
    workers = dataclasses.replace(config, worker_count=1)
    it = iter(make_dataset(trajs, refs, proc, cfg, workers))
    next(it), next(it)
    resumed = iter(make_dataset(trajs, refs, proc, cfg, workers))
    resumed.set_state(it.get_state())
    for want in local[2:4]:
        assert_batches_equal(next(resumed), want)


def test_global_batch_shards_rows(proc, cfg):
    trajs = make_trajectories(proc)
    config = dataclasses.replace(CONFIG, batch_size=8, num_epochs=2, drop_remainder=True)
    local = collect(make_dataset(trajs, step_refs(trajs), proc, cfg, config), 1)[0]
    mesh = sharding.make_mesh(sharding.MeshConfig(data=2, fsdp=4, tensor=1))
    out = global_batch(local, mesh)
    assert out["input_ids"].sharding.spec == jax.sharding.PartitionSpec(("data", "fsdp"), None)
    assert out["positions"].sharding.spec == jax.sharding.PartitionSpec(None, ("data", "fsdp"), None)
    assert out["advantages"].sharding.spec[0] == ("data", "fsdp") and out["off_policy"].shape == (8,)
    assert len(out["input_ids"].addressable_shards) == 8
    assert out["input_ids"].addressable_shards[0].data.shape == (1, local["input_ids"].shape[1])
    pixels = out["vision"]["pixel_values"]  # split along patches when their count divides over the 8 devices
    assert pixels.sharding.spec == jax.sharding.PartitionSpec(("data", "fsdp"), None) or pixels.shape[0] % 8
    assert out["meta"] is local["meta"]
    assert out["response_positions"].sharding.spec == jax.sharding.PartitionSpec(("data", "fsdp"), None)
    assert out["vision"]["token_features"].sharding.is_fully_replicated
    for key in ("input_ids", "positions", "targets", "loss_mask", "behaviour_logprobs", "advantages", "expert",
                "response_positions"):
        np.testing.assert_array_equal(np.asarray(out[key]), local[key], err_msg=key)
    np.testing.assert_array_equal(np.asarray(out["vision"]["window_index"]), local["vision"]["window_index"])
    six = dict(local, input_ids=local["input_ids"][:6])
    with pytest.raises(ValueError, match="6 rows does not divide over data x fsdp = 8"):
        global_batch(six, mesh)


def test_response_positions_index_every_loss_target(proc, cfg):
    trajs = make_trajectories(proc)
    for config in (dataclasses.replace(CONFIG, response_bucket=16), dataclasses.replace(CONFIG, max_response_tokens=40)):
        for batch in collect(make_dataset(trajs, step_refs(trajs), proc, cfg, config)):
            positions, lm = batch["response_positions"], batch["loss_mask"]
            assert positions.dtype == np.int32 and positions.shape[0] == lm.shape[0]
            assert positions.shape[1] == (40 if config.max_response_tokens else
                                          -(-int(lm.sum(1).max()) // 16) * 16)
            for row in range(len(lm)):
                n = int(lm[row].sum())
                np.testing.assert_array_equal(positions[row, :n], np.flatnonzero(lm[row]))
                assert (positions[row, n:] == -1).all()
    wide = np.ones((2, 40), np.float32)
    assert response_positions(wide, bucket=64).shape == (2, 40)  # never wider than the sequence
    assert response_positions(np.zeros((2, 40)), bucket=16).shape == (2, 16)


def test_rows_over_the_response_budget_raise(proc, cfg):
    mask = np.zeros((3, 50), np.float32)
    mask[0, 10:15] = mask[2, 20:29] = 1
    with pytest.raises(ResponseBudgetError, match="row 2 has 9 loss tokens, more than the response budget of 8") as err:
        response_positions(mask, budget=8)
    assert err.value.row == 2
    trajs = make_trajectories(proc)
    tight = dataclasses.replace(CONFIG, shuffle=False, max_response_tokens=4)
    with pytest.raises(ValueError, match=r"task task-0 \(trajectory 0\) step 0: row 0 has \d+ loss tokens, more than "
                                         r"the response budget of 4 positions"):
        collect(make_dataset(trajs, step_refs(trajs), proc, cfg, tight), 1)


def test_dedupe_encodes_each_screenshot_once(proc, cfg):
    """Steps of one trajectory share history screenshots: the batch carries each once, and the token ->
    feature map gives every image-pad token the same patches as the batch that carries them all."""
    trajs = make_trajectories(proc)
    config = dataclasses.replace(CONFIG, shuffle=False, batch_size=7, patch_bucket=16)
    deduped = collect(make_dataset(trajs, step_refs(trajs), proc, cfg, config), 1)[0]
    full = collect(make_dataset(trajs, step_refs(trajs), proc, cfg,
                                dataclasses.replace(config, dedupe_images=False)), 1)[0]
    meta = deduped["meta"]
    assert (int(meta["screenshots"]), int(meta["unique_screenshots"])) == (10, 7)  # images: 1 + 1,2 + 1,2,2 + 1
    assert float(meta["screenshot_dedupe_ratio"]) == pytest.approx(0.7)
    for key in ("input_ids", "positions", "targets", "loss_mask"):
        np.testing.assert_array_equal(deduped[key], full[key], err_msg=key)
    unique = sum(s.screenshot.shape[0] * s.screenshot.shape[1] // 14 ** 2 for t in trajs for s in t.steps)
    assert len(deduped["vision"]["pixel_values"]) == -(-unique // 16) * 16 < len(full["vision"]["pixel_values"])
    unit, dim = cfg.vision.spatial_merge_size ** 2, full["vision"]["pixel_values"].shape[1]
    tokens = int((full["input_ids"] == cfg.image_token_id).sum())
    index = deduped["vision"]["token_features"]
    assert index.shape == (full["input_ids"].size,) and (index[tokens:] == -1).all()
    np.testing.assert_array_equal(deduped["vision"]["pixel_values"].reshape(-1, unit * dim)[index[:tokens]],
                                  full["vision"]["pixel_values"].reshape(-1, unit * dim)[:tokens])
    assert "token_features" not in full["vision"] and full["meta"]["unique_screenshots"] == 10


def test_dedupe_refuses_one_key_for_two_images(proc, cfg):
    trajs = make_trajectories(proc)
    encode = EncodeStep(trajs, proc, CONFIG)
    a, b = encode.map(StepRef(0, 0, 1.0)), encode.map(StepRef(3, 0, 1.0))
    b["image_keys"] = a["image_keys"]  # a wrong identity must not hand row 1 row 0's screenshot
    with pytest.raises(ValueError, match="appears with different pixels"):
        Collate(cfg, CONFIG)([a, b])


def test_block_shuffle_keeps_runs_of_steps_and_resumes(proc, cfg):
    """shuffle_block=2: each epoch covers every step once in runs of consecutive steps of one trajectory
    (so batches share screenshots), differently per epoch, deterministically, and resumes from its state."""
    trajs = make_trajectories(proc, 6)
    refs = step_refs(trajs)
    config = dataclasses.replace(CONFIG, batch_size=1, num_epochs=2, shuffle_block=2)
    order = [(int(b["meta"]["trajectory"][0]), int(b["meta"]["step"][0]))
             for b in collect(make_dataset(trajs, refs, proc, cfg, config))]
    everything = sorted((r.trajectory, r.step) for r in refs)
    n = len(refs)
    assert sorted(order[:n]) == everything == sorted(order[n:]) and order[:n] != order[n:]
    for epoch in (order[:n], order[n:]):
        starts = [i for i, (t, s) in enumerate(epoch) if s % 2 == 0]  # blocks are steps (0, 1), (2,)
        assert all(epoch[i + 1] == (epoch[i][0], epoch[i][1] + 1) for i in starts
                   if epoch[i][1] + 1 < len(trajs[epoch[i][0]].steps))
    it = iter(make_dataset(trajs, refs, proc, cfg, config))
    for _ in range(5):
        next(it)
    fresh = iter(make_dataset(trajs, refs, proc, cfg, config))
    fresh.set_state(it.get_state())
    assert [(int(b["meta"]["trajectory"][0]), int(b["meta"]["step"][0])) for b in (next(fresh), next(fresh))] == order[5:7]
