"""KV-cache sampler: greedy equals transformers' greedy generate; cache decoding equals full recomputation;
top-k / top-p truncation; bucketing; sharded sampling."""
from __future__ import annotations

import dataclasses
import types

import chex
import numpy as np
import jax
import jax.numpy as jnp
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from guijax import sampling, sharding  # noqa: E402
from guijax.models import policy as policy_lib  # noqa: E402
from guijax.models.config import PRESETS, ModelConfig  # noqa: E402
from guijax.models.positions import vision_layout  # noqa: E402

CFG = PRESETS["tiny"]
GRIDS = np.array([[1, 4, 6], [1, 4, 4]])


def _saved_hf_model(tmp_path_factory, preset: str, prefix: str):
    cfg = PRESETS[preset]
    hf_cfg = getattr(transformers, f"{prefix}Config")(**cfg.to_hf_dict())
    torch.manual_seed(3)
    model = getattr(transformers, f"{prefix}ForConditionalGeneration")(hf_cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name and "ln_q" not in name:
                p.normal_(0, 0.1)
    path = tmp_path_factory.mktemp(f"sampler_{preset}")
    model.save_pretrained(path)
    return path, model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return _saved_hf_model(tmp_path_factory, "tiny", "Qwen2_5_VL")


@pytest.fixture(scope="module")
def qwen2_vl_checkpoint(tmp_path_factory):
    """Same special-token ids and patch size as `tiny`, so the same prompts serve both families."""
    return _saved_hf_model(tmp_path_factory, "tiny_qwen2_vl", "Qwen2VL")


@pytest.fixture(scope="module")
def qwen3_vl_checkpoint(tmp_path_factory):
    """Same special-token ids as `tiny`; 16-px patches, so its prompts carry wider pixel rows."""
    return _saved_hf_model(tmp_path_factory, "tiny_qwen3_vl", "Qwen3VL")


def _prompts(seed=0, patch_dim: int = CFG.vision.patch_dim):
    rs = np.random.RandomState(seed)
    seqs = []
    for b in range(2):
        seqs.append(list(rs.randint(0, 900, 3 + 2 * b)) + [CFG.vision_start_token_id]
                    + [CFG.image_token_id] * (int(GRIDS[b].prod()) // 4) + [CFG.vision_end_token_id]
                    + list(rs.randint(0, 900, 4)))
    length = max(map(len, seqs))
    ids = np.zeros((2, length), np.int64)
    mask = np.zeros((2, length), np.int64)
    for b, s in enumerate(seqs):  # left padded, as transformers generate wants
        ids[b, length - len(s):] = s
        mask[b, length - len(s):] = 1
    pix = rs.randn(int(GRIDS.prod(1).sum()), patch_dim).astype(np.float32)
    return {"input_ids": ids, "attention_mask": mask, "pixel_values": pix, "image_grid_thw": GRIDS}


def _prompts_twice():
    """The two prompts of `_prompts` repeated: 4 rows, each with its own image."""
    inputs = _prompts()
    inputs = {k: (np.concatenate([v, v]) if k in ("input_ids", "attention_mask") else v) for k, v in inputs.items()}
    inputs["pixel_values"] = np.concatenate([inputs["pixel_values"]] * 2)
    inputs["image_grid_thw"] = np.concatenate([GRIDS, GRIDS])
    return inputs


@pytest.fixture(scope="module")
def qwen3_vl_moe_checkpoint(tmp_path_factory):
    return _saved_hf_model(tmp_path_factory, "tiny_qwen3_vl_moe", "Qwen3VLMoe")


@pytest.mark.parametrize("family", ["checkpoint", "qwen2_vl_checkpoint", "qwen3_vl_checkpoint",
                                    "qwen3_vl_moe_checkpoint"])
def test_greedy_equals_transformers_generate(family, request):
    path, model = request.getfixturevalue(family)
    inputs = _prompts(patch_dim=ModelConfig.from_json_file(path / "config.json").vision.patch_dim)
    new = 12
    with torch.no_grad():
        ref = model.generate(**{k: torch.tensor(v) for k, v in inputs.items()},
                             mm_token_type_ids=torch.tensor((inputs["input_ids"] == CFG.image_token_id).astype(np.int64)),
                             max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
    ref_tokens = ref[:, inputs["input_ids"].shape[1]:].numpy()
    policy = policy_lib.from_pretrained(path)
    sampler = sampling.Sampler(policy.module, sampling.SamplingConfig(temperature=0.0, max_new_tokens=new,
                                                                      stop_token_ids=(-5,), patch_bucket=64))
    out = sampler.generate(policy.params, jax.random.PRNGKey(0), **inputs)
    np.testing.assert_array_equal(out.tokens, ref_tokens)
    assert out.lengths.tolist() == [new, new] and not out.stopped.any()


def _teacher_forced_logits(policy, inputs, tokens):
    """Logits of one full forward pass over prompt + sampled response, at the positions that predict the
    response tokens ([b, new, vocab], a writable copy)."""
    full_ids = np.concatenate([inputs["input_ids"], tokens], axis=1)
    full_mask = np.concatenate([inputs["attention_mask"], np.ones_like(tokens)], axis=1)
    logits = np.asarray(policy.logits(input_ids=full_ids, attention_mask=full_mask,
                                      pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"]))
    prompt_len = inputs["input_ids"].shape[1]
    return np.array(logits[:, prompt_len - 1:-1])  # position t predicts token t + 1


@pytest.mark.slow
@pytest.mark.parametrize("suppress", [False, True])
def test_cached_logprobs_equal_full_forward(checkpoint, suppress):
    """Behaviour log-probs from the decode loop equal a fresh full forward over prompt + response (with the
    vision placeholders, when suppressed, removed from the softmax), and placeholders are never sampled."""
    path, _ = checkpoint
    policy = policy_lib.from_pretrained(path)
    cfg = policy.module.cfg
    inputs = _prompts(1)
    sampler = sampling.Sampler(policy.module, sampling.SamplingConfig(temperature=1.0, max_new_tokens=6,
                                                                      stop_token_ids=(-5,), patch_bucket=128,
                                                                      suppress_vision_tokens=suppress))
    out = sampler.generate(policy.params, jax.random.PRNGKey(7), **inputs)
    logits = _teacher_forced_logits(policy, inputs, out.tokens)
    placeholders = [cfg.image_token_id, cfg.video_token_id, cfg.vision_start_token_id, cfg.vision_end_token_id]
    if suppress:
        logits[..., placeholders] = -np.inf
        assert not np.isin(out.tokens, placeholders).any()
    logp = jax.nn.log_softmax(logits, axis=-1)
    expected = np.take_along_axis(np.asarray(logp), out.tokens[..., None], axis=-1)[..., 0]
    np.testing.assert_allclose(out.logprobs, expected, atol=2e-5)


def test_behaviour_logprobs_at_temperature_are_the_tempered_softmax(checkpoint):
    """At T = 0.7 (neither 1, where a missing 1/T goes unseen, nor greedy) each recorded behaviour log-prob is
    log_softmax(logits / T) of the sampled token under a teacher-forced forward pass over prompt + sampled
    response (float32 throughout), as the PPO ratio's denominator must be."""
    path, _ = checkpoint
    policy = policy_lib.from_pretrained(path)
    cfg = policy.module.cfg
    temperature, new = 0.7, 8
    inputs = _prompts(2)
    sampler = sampling.Sampler(policy.module, sampling.SamplingConfig(temperature=temperature, max_new_tokens=new,
                                                                      stop_token_ids=(-5,), patch_bucket=64))
    out = sampler.generate(policy.params, jax.random.PRNGKey(11), **inputs)
    chex.assert_shape([out.tokens, out.logprobs], (2, new))
    chex.assert_type([out.tokens, out.logprobs], [np.int32, np.float32])
    assert out.lengths.tolist() == [new, new]
    logits = _teacher_forced_logits(policy, inputs, out.tokens)
    chex.assert_type(logits, np.float32)
    logits[..., [cfg.image_token_id, cfg.video_token_id, cfg.vision_start_token_id, cfg.vision_end_token_id]] = -np.inf

    def chosen(scaled):
        logp = np.asarray(jax.nn.log_softmax(jnp.asarray(scaled), axis=-1))
        return np.take_along_axis(logp, out.tokens[..., None], axis=-1)[..., 0]

    np.testing.assert_allclose(out.logprobs, chosen(logits / temperature), atol=1e-4)
    assert np.abs(out.logprobs - chosen(logits)).max() > 1e-2  # the untempered log-probs are far off here
    assert (out.tokens != logits.argmax(-1)).any()  # sampled, not greedy


@pytest.mark.slow
def test_vision_placeholders_are_never_sampled_even_when_most_likely(checkpoint):
    path, _ = checkpoint
    policy = policy_lib.from_pretrained(path)
    cfg = policy.module.cfg
    params = jax.tree.map(lambda x: x, policy.params)
    head_key = "embed_tokens" if cfg.tie_word_embeddings else "lm_head"
    head = np.asarray(params[head_key]).copy()
    if cfg.tie_word_embeddings:
        pytest.skip("test checkpoint ties embeddings")
    head[:, cfg.image_token_id] = 50.0  # the image pad dominates every step's logits
    params[head_key] = head
    sc = sampling.SamplingConfig(temperature=1.0, max_new_tokens=5, stop_token_ids=(-5,), patch_bucket=64)
    out = sampling.Sampler(policy.module, sc).generate(params, jax.random.PRNGKey(1), **_prompts())
    assert not (out.tokens == cfg.image_token_id).any()
    raw = sampling.Sampler(policy.module, dataclasses.replace(sc, suppress_vision_tokens=False))
    assert (raw.generate(params, jax.random.PRNGKey(1), **_prompts()).tokens == cfg.image_token_id).mean() > 0.5


@pytest.mark.slow
def test_stop_token_ends_rows_independently(checkpoint):
    path, _ = checkpoint
    policy = policy_lib.from_pretrained(path)
    inputs = _prompts()
    greedy = sampling.SamplingConfig(temperature=0.0, max_new_tokens=10, stop_token_ids=(-5,), patch_bucket=64)
    free = sampling.Sampler(policy.module, greedy).generate(policy.params, jax.random.PRNGKey(0), **inputs)
    stop = int(free.tokens[0, 3])  # make row 0's 4th token a stop token
    cfg = sampling.SamplingConfig(temperature=0.0, max_new_tokens=10, stop_token_ids=(stop,), patch_bucket=64)
    out = sampling.Sampler(policy.module, cfg).generate(policy.params, jax.random.PRNGKey(0), **inputs)
    first0 = int(np.argmax(free.tokens[0] == stop))
    assert out.lengths[0] == first0 + 1 and out.stopped[0]
    assert (out.tokens[0, first0 + 1:] == 0).all() and (out.logprobs[0, first0 + 1:] == 0).all()
    np.testing.assert_array_equal(out.tokens[0, :first0 + 1], free.tokens[0, :first0 + 1])


def test_top_k_one_is_greedy_and_top_p_truncates():
    logits = jnp.array([[0.0, 3.0, 1.0, 2.0], [5.0, 0.0, 0.0, 0.0]])
    rng = jax.random.PRNGKey(0)
    for seed in range(5):
        tok, _ = sampling.sample_tokens(logits, jax.random.fold_in(rng, seed), 1.0, 1, 1.0)
        assert tok.tolist() == [1, 0]
    truncated = sampling._truncate_logits(jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]])), 0, 0.7)
    assert np.isfinite(np.asarray(truncated)).tolist() == [[True, True, False, False]]
    draws = [int(sampling.sample_tokens(jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]])), jax.random.PRNGKey(s),
                                        1.0, 0, 0.7)[0][0]) for s in range(40)]
    assert set(draws) == {0, 1}


def test_prompt_bucketing_and_errors():
    assert sampling.bucket_for(65, (64, 128)) == 128
    with pytest.raises(ValueError, match="exceeds the largest prompt bucket 128"):
        sampling.bucket_for(129, (64, 128))
    ids, mask = sampling.pad_right(np.array([[0, 5, 6], [7, 0, 0]]), np.array([[0, 1, 1], [1, 0, 0]]), 4)
    assert ids.tolist() == [[5, 6, 0, 0], [7, 0, 0, 0]] and mask.tolist() == [[1, 1, 0, 0], [1, 0, 0, 0]]


def test_sharded_sampling_matches_single_device(checkpoint):
    path, _ = checkpoint
    mesh = sharding.make_mesh(sharding.MeshConfig(data=2, fsdp=2, tensor=2))
    single = policy_lib.from_pretrained(path)
    sharded = policy_lib.from_pretrained(path, mesh=mesh)
    inputs = _prompts_twice()
    cfg = sampling.SamplingConfig(temperature=0.0, max_new_tokens=5, stop_token_ids=(-5,), patch_bucket=64)
    a = sampling.Sampler(single.module, cfg).generate(single.params, jax.random.PRNGKey(0), **inputs)
    b = sampling.Sampler(sharded.module, cfg, mesh=mesh).generate(sharded.params, jax.random.PRNGKey(0), **inputs)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)


def test_per_device_vision_blocks_sample_what_one_layout_samples(checkpoint):
    """Screenshots laid out per data-parallel device (each block its own rows' images, an empty block a filler
    image) give the single-device greedy tokens: 6 image rows padded to 8 over 4 devices, so the last block
    holds only the two dummy rows."""
    path, _ = checkpoint
    mesh = sharding.make_mesh(sharding.MeshConfig(data=2, fsdp=2, tensor=2))
    single = policy_lib.from_pretrained(path)
    sharded = policy_lib.from_pretrained(path, mesh=mesh)
    four, two = _prompts_twice(), _prompts()
    inputs = {k: np.concatenate([four[k], two[k]]) for k in four}
    cfg = sampling.SamplingConfig(temperature=0.0, max_new_tokens=5, stop_token_ids=(-5,), patch_bucket=64)
    blocked = sampling.Sampler(sharded.module, dataclasses.replace(cfg, vision_blocks=4), mesh=mesh)
    a = sampling.Sampler(single.module, cfg).generate(single.params, jax.random.PRNGKey(0), **inputs)
    b = blocked.generate(sharded.params, jax.random.PRNGKey(0), **inputs)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)
    ids = np.concatenate([inputs["input_ids"], np.zeros((2, inputs["input_ids"].shape[1]), np.int64)])
    mask = np.concatenate([inputs["attention_mask"], np.eye(2, inputs["input_ids"].shape[1], dtype=np.int64)])
    vision = blocked._prepare(ids, mask, inputs["pixel_values"], inputs["image_grid_thw"])[-1]
    assert vision["pixel_values"].shape[0] == 4 and vision["pixel_values"].ndim == 3  # one block per device


def _one_size_prompts(rows: int, seed: int = 0):
    """`rows` prompts, each with one 4x4-patch screenshot (4 image tokens) between random text."""
    rs = np.random.RandomState(seed)
    ids = np.stack([np.concatenate([rs.randint(0, 900, 3), [CFG.vision_start_token_id], [CFG.image_token_id] * 4,
                                    [CFG.vision_end_token_id], rs.randint(0, 900, 2)]) for _ in range(rows)])
    return {"input_ids": ids.astype(np.int64), "attention_mask": np.ones_like(ids, np.int64),
            "pixel_values": rs.randn(16 * rows, CFG.vision.patch_dim).astype(np.float32),
            "image_grid_thw": np.tile([[1, 4, 4]], (rows, 1))}


def test_screenshots_pad_with_the_rows_and_the_blanks_change_nothing(checkpoint):
    """A call's screenshots go to its (padded) rows x the screenshots per row rounded up: every vision input (patches,
    windows, frames) of 5 or 7 one-screenshot rows padded to 8 has one shape; 5 prompts sample the same greedy
    tokens and log-probs with three blank screenshots as with none; screenshots of two sizes pad with one filler
    image to a multiple of the patch bucket."""
    assert [sampling.geometric_bucket(n) for n in range(10)] == [1, 1, 2, 3, 4, 6, 6, 8, 8, 12]
    assert len({sampling.geometric_bucket(n) for n in range(1, 33)}) == 10
    assert [sampling.image_bucket(n, 8) for n in (0, 1, 5, 8, 9, 25, 33, 40, 65, 97)] == \
        [8, 8, 8, 8, 16, 32, 40, 40, 96, 128]  # past 8 per row: 12, 16, ... per row
    path, _ = checkpoint
    policy = policy_lib.from_pretrained(path)
    sc = sampling.SamplingConfig(temperature=0.0, max_new_tokens=5, stop_token_ids=(-5,), patch_bucket=16)
    grown = sampling.Sampler(policy.module, sc)
    exact = sampling.Sampler(policy.module, dataclasses.replace(sc, pad_images_with_rows=False))

    def shapes(sampler, inputs, rows=8):
        [(pix, grid)] = sampler._pad_vision([(inputs["pixel_values"], inputs["image_grid_thw"])], rows)
        return {k: np.shape(v) for k, v in vision_layout(grid, CFG.vision).inputs(pix).items()}

    five, seven = _one_size_prompts(5), _one_size_prompts(7)
    assert shapes(grown, five) == shapes(grown, seven) and shapes(exact, five) != shapes(exact, seven)
    assert shapes(grown, five)["pixel_values"][0] == 8 * 16 and shapes(exact, five)["pixel_values"][0] == 5 * 16
    assert shapes(grown, _prompts(), rows=2)["pixel_values"][0] == 48  # two sizes (24 + 16 patches): filler to 48
    a = grown.generate(policy.params, jax.random.PRNGKey(0), **five)
    b = exact.generate(policy.params, jax.random.PRNGKey(0), **five)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


def test_the_recipe_chooses_the_samplers_image_buckets():
    from guijax import launch, trainer

    processor = types.SimpleNamespace(tokenizer=types.SimpleNamespace(convert_tokens_to_ids=lambda token: 7))
    for name, with_rows in (("rows", True), ("exact", False)):
        config = launch.resolve("grpo_cpu", [f"rollout.sampler_image_buckets={name}"])
        assert trainer.sampling_config(config, processor, 1.0).pad_images_with_rows is with_rows


def test_a_prompt_row_without_tokens_is_refused(checkpoint):
    path, _ = checkpoint
    policy = policy_lib.from_pretrained(path)
    sampler = sampling.Sampler(policy.module, sampling.SamplingConfig(max_new_tokens=2))
    ids = np.ones((3, 5), np.int64)
    mask = np.ones_like(ids)
    mask[1] = 0
    with pytest.raises(ValueError, match=r"prompt rows \[1\] hold no tokens"):
        sampler.generate(policy.params, jax.random.PRNGKey(0), input_ids=ids, attention_mask=mask)


def test_odd_batches_pad_to_a_power_of_two_and_keep_their_rows(checkpoint):
    """3 text rows run as 4 (one dummy row dropped): same greedy tokens as rows sampled alone."""
    path, _ = checkpoint
    policy = policy_lib.from_pretrained(path)
    rs = np.random.RandomState(3)
    ids = rs.randint(0, 900, (3, 6)).astype(np.int64)
    sc = sampling.SamplingConfig(temperature=0.0, max_new_tokens=4, stop_token_ids=(-5,), patch_bucket=64)
    sampler = sampling.Sampler(policy.module, sc)
    out = sampler.generate(policy.params, jax.random.PRNGKey(0), input_ids=ids)
    assert out.tokens.shape == (3, 4) and out.lengths.tolist() == [4, 4, 4]
    for row in range(3):
        alone = sampler.generate(policy.params, jax.random.PRNGKey(0), input_ids=ids[row:row + 1])
        np.testing.assert_array_equal(alone.tokens[0], out.tokens[row])
        np.testing.assert_allclose(alone.logprobs[0], out.logprobs[row], atol=1e-5)


@pytest.mark.slow
def test_max_rows_generates_in_chunks_with_each_rows_own_images(checkpoint):
    """4 image rows (two prompts twice) with max_rows=1 and 3: the same greedy tokens as one call."""
    path, _ = checkpoint
    policy = policy_lib.from_pretrained(path)
    inputs = _prompts_twice()
    sc = sampling.SamplingConfig(temperature=0.0, max_new_tokens=5, stop_token_ids=(-5,), patch_bucket=64)
    whole = sampling.Sampler(policy.module, sc).generate(policy.params, jax.random.PRNGKey(0), **inputs)
    for limit in (1, 3):
        chunked = sampling.Sampler(policy.module, dataclasses.replace(sc, max_rows=limit)).generate(
            policy.params, jax.random.PRNGKey(0), **inputs)
        np.testing.assert_array_equal(chunked.tokens, whole.tokens)
        np.testing.assert_allclose(chunked.logprobs, whole.logprobs, atol=1e-5)
    bounds = sampling._images_per_row(inputs["input_ids"], inputs["attention_mask"], inputs["image_grid_thw"], CFG)
    assert bounds.tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="does not match"):
        sampling._images_per_row(inputs["input_ids"], inputs["attention_mask"], GRIDS[::-1], CFG)


def _six_image_rows():
    four, two = _prompts_twice(), _prompts()
    return {k: np.concatenate([four[k], two[k]]) for k in four}


def test_prefill_in_row_chunks_samples_what_one_pass_samples(checkpoint):
    """6 image rows (run as 8) prefilled 2, 4 or 3 (-> 2) rows at a time, then decoded together: the one-pass
    tokens and log-probs, greedy and sampled; each chunk's vision layout holds its own rows' screenshots."""
    path, _ = checkpoint
    policy = policy_lib.from_pretrained(path)
    inputs = _six_image_rows()
    for temperature in (0.0, 1.0):
        sc = sampling.SamplingConfig(temperature=temperature, max_new_tokens=5, stop_token_ids=(-5,), patch_bucket=64)
        whole = sampling.Sampler(policy.module, sc).generate(policy.params, jax.random.PRNGKey(1), **inputs)
        for limit, chunks in ((2, 4), (4, 2), (3, 4)):
            sampler = sampling.Sampler(policy.module, dataclasses.replace(sc, prefill_rows=limit))
            assert sampler._row_split(8) == (1, chunks, 8 // chunks)
            out = sampler.generate(policy.params, jax.random.PRNGKey(1), **inputs)
            np.testing.assert_array_equal(out.tokens, whole.tokens)
            np.testing.assert_allclose(out.logprobs, whole.logprobs, atol=1e-5)
    sampler = sampling.Sampler(policy.module, dataclasses.replace(sc, prefill_rows=4))
    ids = np.concatenate([inputs["input_ids"], np.zeros((2, inputs["input_ids"].shape[1]), np.int64)])
    mask = np.concatenate([inputs["attention_mask"], np.eye(2, inputs["input_ids"].shape[1], dtype=np.int64)])
    vision = sampler._prepare(ids, mask, inputs["pixel_values"], inputs["image_grid_thw"])[-1]
    # chunk 0: rows 0-3 (4 screenshots), chunk 1: rows 4-5 and two text rows (2, padded with 2 blanks)
    assert vision["pixel_values"].ndim == 3 and vision["pixel_values"].shape[0] == 2
    chex.assert_trees_all_close(vision["pixel_values"][0][:int(GRIDS.prod(1).sum()) * 2],
                                np.concatenate([inputs["pixel_values"][:40]] * 2))
    assert sampling.Sampler(policy.module, sc)._row_split(8) == (1, 1, 8)  # prefill_rows 0: one pass


def test_prefill_in_row_chunks_on_a_mesh_keeps_each_devices_rows(checkpoint):
    """On a 4-way data-parallel mesh, 8 image rows prefilled 4 at a time take rows [d, c] of each device d's two
    chunks; with one replicated vision layout or with per-device blocks, the single-device tokens."""
    path, _ = checkpoint
    mesh = sharding.make_mesh(sharding.MeshConfig(data=2, fsdp=2, tensor=2))
    single = policy_lib.from_pretrained(path)
    sharded = policy_lib.from_pretrained(path, mesh=mesh)
    inputs = _prompts_twice()
    inputs = {k: np.concatenate([inputs[k], inputs[k]]) for k in inputs}  # 8 rows, 8 screenshots
    sc = sampling.SamplingConfig(temperature=0.0, max_new_tokens=4, stop_token_ids=(-5,), patch_bucket=64)
    a = sampling.Sampler(single.module, sc).generate(single.params, jax.random.PRNGKey(0), **inputs)
    for blocks in (1, 4):
        chunked = sampling.Sampler(sharded.module, dataclasses.replace(sc, prefill_rows=4, vision_blocks=blocks),
                                   mesh=mesh)
        assert chunked._row_split(8) == (4, 2, 1) and chunked._row_split(6) == (1, 2, 3)
        b = chunked.generate(sharded.params, jax.random.PRNGKey(0), **inputs)
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)
        vision = chunked._prepare(inputs["input_ids"], inputs["attention_mask"], inputs["pixel_values"],
                                  inputs["image_grid_thw"])[-1]
        assert vision["pixel_values"].shape[:2 if blocks > 1 else 1] == ((2, 4) if blocks > 1 else (2,))


def test_prefill_in_row_chunks_holds_less_at_its_peak():
    """Compiled (not run) for 16 text prompts of 2,048 tokens with the small preset: prefilling 4 rows at a time
    needs well under the temporaries of one 16-row prefill (its activations scale with the rows per pass)."""
    import flax.linen as nn
    from guijax.models import weights

    module = weights.build_module(PRESETS["small"], dtype=jnp.float32, param_dtype=jnp.float32)
    params = nn.unbox(jax.eval_shape(lambda: weights.init_params(module, jax.random.PRNGKey(0))))
    rows, length = 16, 2048
    i32 = lambda *dims: jax.ShapeDtypeStruct(dims, jnp.int32)  # noqa: E731

    def temporaries(prefill_rows):
        sampler = sampling.Sampler(module, sampling.SamplingConfig(max_new_tokens=8, prompt_buckets=(length,),
                                                                   prefill_rows=prefill_rows))
        compiled = sampler._programs[True].lower(params, i32(rows, length), i32(rows, length), i32(3, rows, length),
                                                 i32(rows), None, jax.eval_shape(lambda: jax.random.PRNGKey(0))
                                                 ).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    assert temporaries(4) < 0.7 * temporaries(0)
