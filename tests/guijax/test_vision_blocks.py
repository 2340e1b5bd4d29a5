"""Per-device vision blocks: every family's forward equals the one-layout forward, with each block laid out
over its own rows' images (the DeepStack taps of Qwen3-VL included), and stacking pads what differs."""
from __future__ import annotations

import chex
import jax
import numpy as np
import pytest

from guijax.models import weights
from guijax.models.config import PRESETS
from guijax.models.positions import mrope_positions, vision_layout
from guijax.models.vision_blocks import is_blocked, stack_blocks
from guijax.sampling import pad_images

GRIDS = np.array([[1, 4, 6], [1, 8, 8]])  # row 0 shows the first image, row 1 the second


def _rows(cfg, rs):
    seqs = [list(rs.randint(0, 900, 5)) + [cfg.vision_start_token_id] + [cfg.image_token_id] * (int(g.prod()) // 4)
            + [cfg.vision_end_token_id] + list(rs.randint(0, 900, 3)) for g in GRIDS]
    length = max(map(len, seqs))
    ids, mask = np.zeros((2, length), np.int32), np.zeros((2, length), np.int32)
    for b, seq in enumerate(seqs):
        ids[b, :len(seq)], mask[b, :len(seq)] = seq, 1
    return ids, mask


def _blocked_inputs(cfg, pixels: np.ndarray) -> dict[str, np.ndarray]:
    """GRIDS' two images (their patches in `pixels`), one per block, each padded to the larger's patch count;
    the smaller block's window batch is padded with empty rows."""
    sizes = GRIDS.prod(1)
    blocks = []
    for b, (start, size) in enumerate(zip([0, sizes[0]], sizes)):
        block_pixels, block_grids = pad_images(pixels[start:start + size], GRIDS[b:b + 1], int(sizes.max()),
                                               cfg.vision.spatial_merge_size)
        blocks.append(vision_layout(block_grids, cfg.vision).inputs(block_pixels))
    return stack_blocks(blocks)


# Qwen3-VL (DeepStack) in the default suite, where the trainer and sharded tests run Qwen2.5-VL's blocks
# (tests/guijax/test_trainer_objectives.py, test_response_only.py); the other families with -m slow
@pytest.mark.parametrize("family", ["tiny_qwen3_vl"] + [pytest.param(f, marks=pytest.mark.slow) for f in (
    "tiny", "tiny_qwen2_vl", "tiny_qwen3_vl_moe")])
def test_blocked_forward_equals_one_layout(family):
    cfg = PRESETS[family]
    rs = np.random.RandomState(0)
    ids, mask = _rows(cfg, rs)
    pixels = rs.randn(int(GRIDS.prod(1).sum()), cfg.vision.patch_dim).astype(np.float32)
    whole = vision_layout(GRIDS, cfg.vision).inputs(pixels)
    blocked = _blocked_inputs(cfg, pixels)
    assert is_blocked(blocked) and not is_blocked(whole)
    module = weights.build_module(cfg)
    params = weights.init_params(module, jax.random.PRNGKey(0))
    positions, _ = mrope_positions(ids, mask, GRIDS, cfg)
    forward = jax.jit(lambda v: module.apply({"params": params}, ids, positions, mask, v, return_logits=False)[0])
    valid = mask.astype(bool)
    np.testing.assert_allclose(np.asarray(forward(blocked))[valid], np.asarray(forward(whole))[valid], atol=2e-5)


def test_stacking_pads_batches_and_readdresses_their_slots():
    a = {"pixel_values": np.zeros((4, 2)), "image_tokens": np.array([[0, 1, 2, 3]]), "image_slots": np.arange(4),
         "token_features": np.array([0, 0])}
    b = {"pixel_values": np.ones((4, 2)), "image_tokens": np.array([[0, 1], [2, 3]]),
         "image_slots": np.array([0, 1, 2, 3]), "token_features": np.array([1, 0, 1])}
    out = stack_blocks([a, b])
    np.testing.assert_array_equal(out["image_tokens"][1], [[0, 1, -1, -1], [2, 3, -1, -1]])
    np.testing.assert_array_equal(out["image_slots"][1], [0, 1, 4, 5])  # row * 4 + column in the wider batch
    np.testing.assert_array_equal(out["image_tokens"][0], [[0, 1, 2, 3], [-1, -1, -1, -1]])
    np.testing.assert_array_equal(out["token_features"], [[0, 0, -1], [1, 0, 1]])
    flat = out["image_tokens"][1].reshape(-1)
    np.testing.assert_array_equal(flat[out["image_slots"][1]], np.arange(4))  # each token finds itself
    with pytest.raises(ValueError, match="different patch counts"):
        stack_blocks([a, dict(b, pixel_values=np.ones((8, 2)))])
    with pytest.raises(ValueError, match="block 1 has keys"):
        stack_blocks([a, {k: v for k, v in b.items() if k != "token_features"}])


def test_blocked_tower_on_a_gpu_takes_cudnn_without_a_batched_check(monkeypatch):
    """Traced for a GPU, the tower vmapped over per-device blocks runs `auto` attention as cuDNN alone: its
    rows are right-padded by construction, so no run-time check is made (inside the vmap it was batched, and
    the blockwise branch ran beside cuDNN on every block). cuDNN is stood in for by attention that, like it,
    reads sequence lengths alone and whose values and gradients are not finite on a row with no key, as an
    empty padding row was: values and gradients stay finite and equal the blockwise path's."""
    import jax.numpy as jnp

    import guijax.models.attention as attention_lib
    from guijax.models.attention import compiling_for

    cfg = PRESETS["tiny"]
    pixels = np.random.RandomState(1).randn(int(GRIDS.prod(1).sum()), cfg.vision.patch_dim).astype(np.float32)
    inputs = _blocked_inputs(cfg, pixels)
    assert (inputs["window_tokens"] < 0).all(-1).any(), "the test needs an empty padding row"
    taken, blockwise = [], []

    def cudnn_stand_in(q, k, v, q_seg, kv_seg, causal, scale):
        taken.append(q.shape)
        q_len, kv_len = (jnp.sum(seg != 0, 1).astype(jnp.int32) for seg in (q_seg, kv_seg))
        out = jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=causal, implementation="xla",
                                           query_seq_lengths=q_len, key_value_seq_lengths=kv_len)
        return out / (kv_len > 0)[:, None, None, None]  # a row with no key: not finite, its gradients too

    real_blockwise = attention_lib._blockwise

    def recorded_blockwise(*args):
        blockwise.append(args[0].shape)
        return real_blockwise(*args)

    module = weights.build_module(cfg, dtype=jnp.bfloat16)
    params = weights.init_params(module, jax.random.PRNGKey(0))
    monkeypatch.setattr(attention_lib, "_cudnn", cudnn_stand_in)
    monkeypatch.setattr(attention_lib, "_blockwise", recorded_blockwise)

    def loss(p):
        merged = module.apply({"params": p}, method=lambda m, **v: m.encode_images(**v), **inputs).merged
        return jnp.sum(merged.astype(jnp.float32) * jnp.cos(jnp.arange(merged.size).reshape(merged.shape)))

    with compiling_for("gpu"):
        on_gpu = jax.jit(jax.value_and_grad(loss))(params)
    assert taken and not blockwise
    blockwise_path = jax.jit(jax.value_and_grad(loss))(params)
    assert blockwise
    chex.assert_tree_all_finite(on_gpu)
    chex.assert_trees_all_close(jax.tree.map(lambda x: x.astype(jnp.float32), on_gpu),
                                jax.tree.map(lambda x: x.astype(jnp.float32), blockwise_path), atol=0.05, rtol=0.05)
