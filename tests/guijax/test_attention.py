"""Linear-memory attention: the blockwise backend equals the dense reference (values and gradients) over
GQA, causal, padding, packed segments, ragged block tails and the KV-cache decode; the vision tower's batched
windows equal the dense window mask; compiled temp memory stays far below the dense score matrix."""
from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from guijax.models.attention import attention
from guijax.models.config import PRESETS, VisionConfig
from guijax.models.positions import vision_layout
from guijax.models.processor import ImageProcessor
from guijax.models.qwen2_5_vl import Qwen2_5_VL, init_cache
from guijax.models.vision import VisionTower
from jaxprs import equations  # tests/support

TOL = dict(atol=2e-5, rtol=2e-5)


def _qkv(rs: np.random.RandomState, b: int, sq: int, sk: int, h: int, kvh: int, d: int, dtype=jnp.float32):
    return (jnp.asarray(rs.randn(b, sq, h, d), dtype), jnp.asarray(rs.randn(b, sk, kvh, d), dtype),
            jnp.asarray(rs.randn(b, sk, kvh, d), dtype))


def _values_and_grads(impl: str, q, k, v, **kw):
    """Output and d(sum(out * ct))/d(q, k, v) for a fixed random cotangent."""
    ct = jnp.asarray(np.random.RandomState(99).randn(*q.shape), jnp.float32)

    def f(q, k, v):
        out = attention(q, k, v, implementation=impl, **kw)
        return jnp.sum(out.astype(jnp.float32) * ct), out

    (_, out), grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return out, grads


def _assert_matches_reference(q, k, v, **kw):
    out, grads = _values_and_grads("xla", q, k, v, **kw)
    ref_out, ref_grads = _values_and_grads("reference", q, k, v, **kw)
    chex.assert_tree_all_finite((out, grads))
    chex.assert_trees_all_close(out, ref_out, **TOL)
    chex.assert_trees_all_close(grads, ref_grads, **TOL)
    return out


def _packed_segments(rs: np.random.RandomState, b: int, s: int, n_segments: int, pad_left: bool) -> np.ndarray:
    """[b, s] ids 1..n in runs of random length with padding (0) on one side."""
    seg = np.zeros((b, s), np.int32)
    for i in range(b):
        valid = rs.randint(1, s + 1)
        cuts = np.sort(rs.choice(np.arange(1, valid), min(n_segments - 1, valid - 1), replace=False)).astype(int)
        row = np.repeat(np.arange(1, len(cuts) + 2), np.diff(np.concatenate([[0], cuts, [valid]])))
        if pad_left:
            seg[i, s - valid:] = row
        else:
            seg[i, :valid] = row
    return seg


@pytest.mark.parametrize("seed", range(8))
def test_blockwise_equals_reference_on_random_shapes(seed):
    rs = np.random.RandomState(seed)
    kvh = int(rs.choice([1, 2, 3]))
    h, d, b = kvh * int(rs.choice([1, 2, 4])), int(rs.choice([4, 8, 16])), int(rs.randint(1, 4))
    s = int(rs.randint(1, 70))
    causal, pad_left = bool(rs.rand() < 0.6), bool(rs.rand() < 0.5)
    seg = jnp.asarray(_packed_segments(rs, b, s, int(rs.randint(1, 4)), pad_left))
    q, k, v = _qkv(rs, b, s, s, h, kvh, d)
    _assert_matches_reference(q, k, v, causal=causal, q_segment_ids=seg, kv_segment_ids=seg,
                              block_q=int(rs.choice([4, 8, 16])), block_k=int(rs.choice([8, 16, 32])))


@pytest.mark.parametrize("causal", [False, True])
def test_cross_lengths_not_multiples_of_the_block(causal):
    rs = np.random.RandomState(1)
    q, k, v = _qkv(rs, 2, 13, 29, 4, 2, 8)
    q_seg = jnp.asarray(np.array([[1] * 7 + [2] * 6, [3] * 10 + [0] * 3]), jnp.int32)
    kv_seg = jnp.asarray(np.array([[1] * 11 + [2] * 18, [3] * 20 + [0] * 9]), jnp.int32)
    q_pos = jnp.asarray(np.stack([np.arange(13) * 2, np.arange(13) + 5]), jnp.int32)
    _assert_matches_reference(q, k, v, causal=causal, q_segment_ids=q_seg, kv_segment_ids=kv_seg, q_positions=q_pos,
                              block_q=4, block_k=8)


@pytest.mark.parametrize("new_tokens", [1, 3])
def test_kv_cache_decode_equals_the_rows_of_full_attention(new_tokens):
    """Queries at cache slots cache_index + i over a left-padded cache with unwritten slots give the same rows
    as causal self-attention over the whole (padded) sequence."""
    rs = np.random.RandomState(2)
    b, total, written = 2, 21, 15
    q, k, v = _qkv(rs, b, total, total, 4, 2, 8)
    kv_mask = np.zeros((b, total), np.int32)
    kv_mask[0, 3:written] = 1  # left-padded prompt
    kv_mask[1, 0:written] = 1
    full = attention(q, k, v, causal=True, q_segment_ids=jnp.asarray(kv_mask), kv_segment_ids=jnp.asarray(kv_mask),
                     implementation="reference")
    start = written - new_tokens
    slots = jnp.broadcast_to(start + jnp.arange(new_tokens, dtype=jnp.int32), (b, new_tokens))
    kv_positions = jnp.broadcast_to(jnp.arange(total, dtype=jnp.int32), (b, total))
    # slots past `written` hold stale keys and are marked invalid; causality alone must not be relied on
    kv_seg = jnp.asarray(kv_mask)
    out = _assert_matches_reference(q[:, start:written], k, v, causal=True, q_segment_ids=jnp.ones((b, new_tokens)),
                                    kv_segment_ids=kv_seg, q_positions=slots, kv_positions=kv_positions,
                                    block_q=2, block_k=8)
    chex.assert_trees_all_close(out, full[:, start:written], **TOL)


def test_padding_queries_and_empty_rows_give_zero_without_nans():
    rs = np.random.RandomState(3)
    q, k, v = _qkv(rs, 2, 10, 10, 2, 1, 4)
    seg = jnp.asarray(np.array([[1] * 6 + [0] * 4, [0] * 10]), jnp.int32)
    out = _assert_matches_reference(q, k, v, causal=True, q_segment_ids=seg, kv_segment_ids=seg, block_q=4, block_k=4)
    assert not np.asarray(out[0, 6:]).any() and not np.asarray(out[1]).any()


@pytest.mark.parametrize("causal", [False, True])
def test_one_tile_runs_without_loops_and_equals_reference(causal):
    """A sequence no longer than the tile takes the loop-free path: packed segments, padding on either side
    and an all-padding row still equal the dense reference."""
    rs = np.random.RandomState(5)
    b, s = 4, 40
    seg = _packed_segments(rs, b, s, 3, pad_left=False)
    seg[1] = _packed_segments(rs, 1, s, 2, pad_left=True)[0]
    seg[3] = 0
    seg = jnp.asarray(seg)
    q, k, v = _qkv(rs, b, s, s, 6, 2, 8)
    kw = dict(causal=causal, q_segment_ids=seg, kv_segment_ids=seg, block_q=64, block_k=64)
    out = _assert_matches_reference(q, k, v, **kw)
    assert not np.asarray(out[3]).any()
    grad_jaxpr = str(jax.make_jaxpr(jax.grad(
        lambda q: jnp.sum(attention(q, k, v, implementation="xla", **kw))))(q))
    assert "scan" not in grad_jaxpr and "cond" not in grad_jaxpr and "while" not in grad_jaxpr


@pytest.mark.slow
def test_defaults_mean_no_padding_and_auto_is_blockwise_off_gpu():
    rs = np.random.RandomState(4)
    q, k, v = _qkv(rs, 1, 40, 40, 4, 4, 8)
    dense = attention(q, k, v, causal=True, implementation="reference")
    chex.assert_trees_all_close(attention(q, k, v, causal=True, implementation="auto"), dense, **TOL)
    chex.assert_trees_all_close(attention(q, k, v, causal=True, implementation="xla", block_q=16, block_k=16),
                                attention(q, k, v, causal=True, implementation="xla", block_q=7, block_k=9), **TOL)
    library = jax.nn.dot_product_attention(q, k, v, is_causal=True)  # jax's own dense path agrees
    chex.assert_trees_all_close(dense, library, **TOL)


def test_bfloat16_blockwise_is_close_to_float32_reference():
    rs = np.random.RandomState(5)
    q, k, v = _qkv(rs, 2, 33, 33, 4, 2, 16)
    seg = jnp.asarray(_packed_segments(rs, 2, 33, 2, False))
    kw = dict(causal=True, q_segment_ids=seg, kv_segment_ids=seg)
    ref = attention(q, k, v, implementation="reference", **kw)
    low = attention(*(x.astype(jnp.bfloat16) for x in (q, k, v)), implementation="xla", block_q=8, block_k=8, **kw)
    assert low.dtype == jnp.bfloat16
    chex.assert_trees_all_close(low.astype(jnp.float32), ref, atol=5e-2, rtol=5e-2)


def test_errors_name_the_problem():
    q, k, v = _qkv(np.random.RandomState(0), 1, 4, 4, 3, 2, 8)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        attention(q, k, v)
    q, k, v = _qkv(np.random.RandomState(0), 1, 4, 4, 2, 2, 8)
    with pytest.raises(ValueError, match="unknown attention implementation"):
        attention(q, k, v, implementation="flash")
    with pytest.raises(ValueError, match=r"must be \[1, 4\]"):
        attention(q, k, v, q_segment_ids=jnp.ones((1, 5), jnp.int32))
    if jax.default_backend() != "gpu":
        with pytest.raises(ValueError, match="cudnn attention does not apply.*not a GPU"):
            attention(q, k, v, implementation="cudnn")
    if jax.default_backend() != "tpu":
        with pytest.raises(ValueError, match="splash attention does not apply.*TPU kernel and the target is"):
            attention(q, k, v, implementation="splash")


def test_the_models_attention_block_sets_the_decoders_tiles():
    """`attention_block` reaches the decoder's blockwise attention (a 64-token packed row in 16-token tiles is
    a 4 x 4 grid of tiles, scanned; in 512-token tiles one) and leaves its values unchanged."""
    cfg = PRESETS["tiny"]
    rs = np.random.RandomState(9)
    ids = jnp.asarray(rs.randint(0, 900, (1, 64)), jnp.int32)
    segments = jnp.asarray(np.repeat([1, 2, 3, 4], 16)[None], jnp.int32)  # four packed examples
    positions = jnp.asarray(np.broadcast_to(np.tile(np.arange(16), 4), (3, 1, 64)), jnp.int32)
    params = Qwen2_5_VL(cfg).init(jax.random.PRNGKey(0), ids, positions, segments)
    out, scans = {}, {}
    for block in (16, 512):
        module = Qwen2_5_VL(cfg, attention_impl="xla", attention_block=block)
        out[block] = module.apply(params, ids, positions, segments)[0]
        jaxpr = str(jax.make_jaxpr(lambda p: module.apply(p, ids, positions, segments)[0])(params))
        scans[block] = jaxpr.count("length=4")
    assert scans[16] > 0 and scans[512] == 0
    chex.assert_trees_all_close(out[16], out[512], **TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_cudnn_equals_reference_on_right_padded_rows(causal):
    rs = np.random.RandomState(6)
    q, k, v = _qkv(rs, 2, 256, 256, 8, 2, 64, jnp.bfloat16)
    seg = jnp.asarray(np.array([[1] * 256, [1] * 200 + [0] * 56]), jnp.int32)
    kw = dict(causal=causal, q_segment_ids=seg, kv_segment_ids=seg)
    ref = attention(*(x.astype(jnp.float32) for x in (q, k, v)), implementation="reference", **kw)
    for impl in ("cudnn", "auto"):
        out = jax.jit(lambda q, k, v, impl=impl: attention(q, k, v, implementation=impl, **kw))(q, k, v)
        chex.assert_trees_all_close(out.astype(jnp.float32), ref, atol=2e-2, rtol=2e-2)
    packed = jnp.asarray(np.array([[1] * 128 + [2] * 128, [1] * 256]), jnp.int32)  # not lengths: auto falls back
    kw = dict(causal=causal, q_segment_ids=packed, kv_segment_ids=packed)
    auto = jax.jit(lambda q, k, v: attention(q, k, v, implementation="auto", **kw))(q, k, v)
    ref = attention(*(x.astype(jnp.float32) for x in (q, k, v)), implementation="reference", **kw)
    chex.assert_trees_all_close(auto.astype(jnp.float32), ref, atol=2e-2, rtol=2e-2)
    assert np.isnan(np.asarray(attention(q, k, v, implementation="cudnn", **kw)[0])).all()


# ------------------------------------------------------------------------------------------------ the model
def _tiny_vision(**kw) -> VisionConfig:
    return VisionConfig(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=48,
                        window_size=56, fullatt_block_indexes=(1,), **kw)


def test_window_batch_covers_every_token_once():
    layout = vision_layout(np.array([[1, 4, 6], [1, 10, 6], [2, 6, 4]]), _tiny_vision())
    tokens, slots = layout.window_tokens, layout.window_slots
    assert tokens.shape == (layout.window_segments.max() + 1, 16)  # (56 / 14 / 2)^2 merge units of 4 patches
    flat = tokens.reshape(-1)
    np.testing.assert_array_equal(flat[slots], np.arange(layout.num_patches))
    np.testing.assert_array_equal(np.sort(flat[flat >= 0]), np.arange(layout.num_patches))
    for w, row in enumerate(tokens):  # each row is exactly one window, left-aligned
        real = row[row >= 0]
        assert (row[:real.size] >= 0).all() and (layout.window_segments[real] == w).all()
        assert real.size == (layout.window_segments == w).sum()


@pytest.mark.slow
def test_vision_windows_batched_equal_the_dense_window_mask():
    vcfg = _tiny_vision()
    grids = np.array([[1, 4, 6], [1, 10, 6], [2, 6, 4]])  # partial windows at the edges, two frames
    layout = vision_layout(grids, vcfg)
    rs = np.random.RandomState(7)
    inputs = layout.inputs(rs.randn(layout.num_patches, vcfg.patch_dim).astype(np.float32))
    dense, batched = VisionTower(vcfg, attention_impl="reference"), VisionTower(vcfg, attention_impl="xla")
    params = dense.init(jax.random.PRNGKey(0), **inputs)
    params = jax.tree.map(lambda p: p + 0.05 * jax.random.normal(jax.random.PRNGKey(1), p.shape), params)

    def run(module):
        def loss(p):
            out = module.apply(p, **inputs).merged
            return jnp.sum(out * jnp.cos(jnp.arange(out.size).reshape(out.shape))), out
        return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)

    (_, ref), ref_grads = run(dense)
    (_, out), grads = run(batched)
    assert np.abs(np.asarray(ref)).max() > 0.1
    chex.assert_trees_all_close(out, ref, **TOL)
    chex.assert_trees_all_close(grads, ref_grads, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("padding", ["right", "left"])
def test_decoder_blockwise_equals_reference_with_and_without_cache(padding):
    """Prefill into the cache then one decode step, after the prompt's padding (right: the sampler's layout,
    the step written after a gap of padded slots) or before it (left)."""
    cfg = PRESETS["tiny"]
    rs = np.random.RandomState(8)
    b, s, extra = 2, 11, 4
    ids = jnp.asarray(rs.randint(0, 900, (b, s)), jnp.int32)
    mask = np.ones((b, s), np.int32)
    mask[1, :4] = 0
    if padding == "right":
        mask = mask[:, ::-1].copy()
    positions = jnp.asarray(np.broadcast_to(np.maximum(np.cumsum(mask, 1) - 1, 0), (3, b, s)), jnp.int32)
    next_position = positions.max(axis=(0, 2)) + 1
    ref_module = Qwen2_5_VL(cfg, attention_impl="reference")
    params = ref_module.init(jax.random.PRNGKey(0), ids, positions, jnp.asarray(mask))
    kv_mask = jnp.asarray(np.concatenate([mask, np.zeros((b, extra), np.int32)], 1))
    results = {}
    for impl in ("reference", "xla"):
        module = Qwen2_5_VL(cfg, attention_impl=impl)
        full, _ = module.apply(params, ids, positions, jnp.asarray(mask))
        cached, cache = module.apply(params, ids, positions, jnp.asarray(mask), cache=init_cache(cfg, b, s + extra),
                                     cache_index=0, kv_mask=kv_mask)
        step, _ = module.apply(params, ids[:, :1], jnp.broadcast_to(next_position[None, :, None], (3, b, 1)),
                               jnp.ones((b, 1), jnp.int32), cache=cache, cache_index=s, kv_mask=kv_mask.at[:, s].set(1))
        results[impl] = (full, cached, step)
    valid = mask.astype(bool)
    for a, r in zip(results["xla"], results["reference"]):
        m = valid if a.shape[1] == s else np.ones(a.shape[:2], bool)
        chex.assert_trees_all_close(np.asarray(a)[m], np.asarray(r)[m], **TOL)
    np.testing.assert_allclose(np.asarray(results["xla"][0])[valid], np.asarray(results["xla"][1])[valid], atol=2e-5)


@pytest.mark.gpu
def test_cudnn_runs_inside_the_model_and_matches_blockwise_in_bf16():
    """Under `auto` on a GPU the vision tower (windows and whole images as padded rows) and the decoder
    (right-padded rows) call cuDNN's fused attention, and agree with the blockwise path at bf16 precision,
    gradients included."""
    cfg = PRESETS["tiny"]
    rs = np.random.RandomState(9)
    grids = np.array([[1, 4, 6], [1, 8, 8]])
    layout = vision_layout(grids, cfg.vision)
    vision = layout.inputs(rs.randn(layout.num_patches, cfg.vision.patch_dim).astype(np.float32))
    tokens = int(grids.prod(1).sum()) // cfg.vision.spatial_merge_size ** 2
    b, s = 2, tokens + 24
    ids = rs.randint(0, 900, (b, s)).astype(np.int32)
    mask = np.ones((b, s), np.int32)
    mask[1, -7:] = 0  # right padding, as training batches are laid out
    ids[0, 3:3 + 6] = cfg.image_token_id  # the 4x6 grid's 6 tokens
    ids[1, 2:2 + 16] = cfg.image_token_id  # the 8x8 grid's 16 tokens
    from guijax.models.positions import mrope_positions

    positions, _ = mrope_positions(ids, mask, grids, cfg)
    args = (jnp.asarray(ids), jnp.asarray(positions, jnp.int32), jnp.asarray(mask))
    params = Qwen2_5_VL(cfg).init(jax.random.PRNGKey(0), *args, vision)

    def run(impl):
        module = Qwen2_5_VL(cfg, dtype=jnp.bfloat16, attention_impl=impl)

        def loss(p):
            hidden, _ = module.apply(p, *args, vision)
            hidden = hidden.astype(jnp.float32) * mask[..., None]
            return jnp.sum(hidden * jnp.cos(jnp.arange(hidden.size).reshape(hidden.shape))), hidden
        fn = jax.jit(jax.value_and_grad(loss, has_aux=True))
        return fn(params), fn.lower(params).as_text()

    ((_, ref), ref_grads), _ = run("xla")
    ((_, out), grads), text = run("auto")
    assert "__cudnn$fmha" in text  # cuDNN's fused attention is a custom call of the program
    assert np.abs(np.asarray(ref)).max() > 0.1
    chex.assert_trees_all_close(out, ref, atol=5e-2, rtol=5e-2)
    # bf16 gradients summed in another order differ elementwise (an embedding row by up to 7% where its
    # contributions cancel); each parameter's gradient as a whole must agree
    for (path, g), r in zip(jax.tree_util.tree_flatten_with_path(grads)[0], jax.tree_util.tree_leaves(ref_grads)):
        g, r = np.asarray(g, np.float32), np.asarray(r, np.float32)
        assert np.linalg.norm(g - r) <= 2e-2 * np.linalg.norm(r) + 1e-6, jax.tree_util.keystr(path)


# ------------------------------------------------------------------------------------------------ memory
def _temp_bytes(fn, *args) -> int:
    return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes


def _text_grad_temp(impl: str, s: int, h: int = 8, kvh: int = 2, d: int = 64) -> int:
    """Compiled temp bytes of forward + backward of causal padded self-attention over s tokens."""
    def loss(q, k, v, seg):
        out = attention(q, k, v, causal=True, q_segment_ids=seg, kv_segment_ids=seg, implementation=impl)
        return jnp.sum(jnp.square(out))

    f32 = jnp.float32
    args = (jax.ShapeDtypeStruct((1, s, h, d), f32), jax.ShapeDtypeStruct((1, s, kvh, d), f32),
            jax.ShapeDtypeStruct((1, s, kvh, d), f32), jax.ShapeDtypeStruct((1, s), jnp.int32))
    return _temp_bytes(jax.grad(loss, argnums=(0, 1, 2)), *args)


def test_blockwise_forward_backward_memory_is_linear_in_sequence_length():
    s, h = 8192, 8
    dense_scores = h * s * s * 4  # one [h, s, s] float32 score matrix: 2 GiB
    blockwise, blockwise_2x = _text_grad_temp("xla", s), _text_grad_temp("xla", 2 * s)
    reference = _text_grad_temp("reference", s)
    assert reference > dense_scores  # the threshold below is one the dense path fails
    assert blockwise < dense_scores / 8, (blockwise, dense_scores)
    assert blockwise_2x < 2.5 * blockwise, (blockwise, blockwise_2x)  # doubling s doubles memory, not x4


def _scanned_and_unrolled_temp(implementation: str, dtype) -> tuple[int, int, int]:
    """Compiled temp bytes of forward + backward of two attention layers under `lax.scan` and unrolled, and
    the bytes of one dense [h, s, s] float32 score matrix."""
    s, h, kvh, d, layers = 4096, 8, 2, 64, 2

    def layer(x, w, seg):
        q = (x @ w).reshape(1, s, h, d)
        kv = q[:, :, :kvh]
        return attention(q, kv, kv, causal=True, q_segment_ids=seg, kv_segment_ids=seg,
                         implementation=implementation).reshape(1, s, h * d)

    def scanned(w, x, seg):
        return jnp.sum(jax.lax.scan(lambda c, wl: (layer(c, wl, seg), None), x, w)[0].astype(jnp.float32))

    def unrolled(w, x, seg):
        for i in range(layers):
            x = layer(x, w[i], seg)
        return jnp.sum(x.astype(jnp.float32))

    args = (jax.ShapeDtypeStruct((layers, h * d, h * d), dtype),
            jax.ShapeDtypeStruct((1, s, h * d), dtype), jax.ShapeDtypeStruct((1, s), jnp.int32))
    return _temp_bytes(jax.grad(scanned), *args), _temp_bytes(jax.grad(unrolled), *args), h * s * s * 4


def test_blockwise_memory_stays_linear_inside_a_scan_over_layers():
    """Under a scan over layers the segment ids are loop-invariant; nothing computed from them alone may be
    hoisted out of the loop as every tile's mask at once ([nq, nk, b, h, bq, bk]): the scanned layers must
    need about what the unrolled ones do."""
    scan_temp, unrolled_temp, dense_scores = _scanned_and_unrolled_temp("xla", jnp.float32)
    assert scan_temp < dense_scores / 2, (scan_temp, unrolled_temp, dense_scores)  # hoisted: 3.1x dense
    assert scan_temp < 2 * unrolled_temp, (scan_temp, unrolled_temp)


@pytest.mark.gpu
def test_auto_attention_on_a_gpu_stays_linear_inside_a_scan_over_layers():
    """On a GPU `auto` is cuDNN with the blockwise path as the fallback branch of a `cond`: a branch the
    program must hold memory for, so the fallback's hoisted masks cost memory even when cuDNN runs."""
    scan_temp, unrolled_temp, dense_scores = _scanned_and_unrolled_temp("auto", jnp.bfloat16)
    assert scan_temp < dense_scores / 2, (scan_temp, unrolled_temp, dense_scores)
    assert scan_temp < 2 * unrolled_temp + (64 << 20), (scan_temp, unrolled_temp)


def test_vision_forward_memory_for_one_1080p_screenshot_is_far_below_dense():
    height, width = ImageProcessor(max_pixels=16384 * 28 * 28).resized_hw(1080, 1920)
    vcfg = VisionConfig(depth=2, hidden_size=128, intermediate_size=256, num_heads=2, out_hidden_size=64,
                        fullatt_block_indexes=(1,))  # released patch 14, window 112, merge 2
    layout = vision_layout(np.array([[1, height // vcfg.patch_size, width // vcfg.patch_size]]), vcfg)
    n = layout.num_patches
    assert n == 10764
    inputs = {k: jax.ShapeDtypeStruct(v.shape, v.dtype)
              for k, v in layout.inputs(np.zeros((n, vcfg.patch_dim), np.float32)).items()}
    dense_scores = vcfg.num_heads * n * n * 4  # 884 MiB

    def temp(impl: str) -> int:
        tower = VisionTower(vcfg, attention_impl=impl)
        params = jax.eval_shape(lambda x: tower.init(jax.random.PRNGKey(0), **x), inputs)
        return _temp_bytes(lambda p, x: tower.apply(p, **x).merged, params, inputs)

    assert temp("reference") > dense_scores
    blockwise = temp("xla")
    assert blockwise < dense_scores / 8, (blockwise, dense_scores)


def _primitives(jaxpr) -> set[str]:
    """Every primitive of a jaxpr, nested ones included."""
    return {eqn.primitive.name for eqn in equations(jaxpr)}


def test_a_decode_query_reads_a_long_cache_as_one_tile():
    """One query against 4,096 cached keys in 512-key tiles: one tile of 4,096 keys (no scan, no skip test,
    no while loop; per-tile loop steps dominated a GPU decode), the reference's output all the same; a
    square call still loops over its tiles."""
    rs = np.random.RandomState(0)
    b, sk, h, kvh, d = 2, 4096, 4, 2, 16
    q = jnp.asarray(rs.randn(b, 1, h, d), jnp.float32)
    k, v = (jnp.asarray(rs.randn(b, sk, kvh, d), jnp.float32) for _ in range(2))
    kv_seg = jnp.asarray(np.arange(sk)[None] < np.array([[3000], [4096]]), jnp.int32)
    kw = dict(causal=True, q_segment_ids=jnp.ones((b, 1), jnp.int32), kv_segment_ids=kv_seg,
              q_positions=jnp.full((b, 1), 2999, jnp.int32),
              kv_positions=jnp.broadcast_to(jnp.arange(sk, dtype=jnp.int32), (b, sk)))
    decode = jax.make_jaxpr(lambda q, k, v: attention(q, k, v, implementation="xla", **kw))(q, k, v)
    assert not _primitives(decode.jaxpr) & {"scan", "while", "cond"}
    chex.assert_trees_all_close(attention(q, k, v, implementation="xla", **kw),
                                attention(q, k, v, implementation="reference", **kw), atol=1e-5)
    square = jax.make_jaxpr(lambda x: attention(x, x, x, causal=True, implementation="xla"))(k[:, :1024])
    assert "scan" in _primitives(square.jaxpr)
    # small tiles: 1,100 keys in two balanced tiles of 550 (at most 32 x 32 keys each), the reference's output
    kw = {**kw, "kv_segment_ids": kv_seg[:, :1100], "kv_positions": kw["kv_positions"][:, :1100],
          "q_positions": jnp.full((b, 1), 1050, jnp.int32)}
    small = dict(implementation="xla", block_q=32, block_k=32)
    tiled = jax.make_jaxpr(lambda k: attention(q, k, k, **small, **kw))(k[:, :1100])
    assert "f32[2,2,2,550,16]" in str(tiled) and "1024" not in str(tiled)  # [tiles, b, kv heads, keys, d]
    chex.assert_trees_all_close(attention(q, k[:, :1100], v[:, :1100], **small, **kw),
                                attention(q, k[:, :1100], v[:, :1100], implementation="reference", **kw), atol=1e-5)


def test_a_few_queries_against_one_tile_are_dense_and_keep_no_tile_for_the_backward():
    """Under 16 queries against one tile of keys (a decode step's shape) take the dense path in the callers'
    layout: values and gradients equal the reference's, and under autodiff it saves its inputs alone
    (rematerialised), as the flash path keeps no score tile between the passes."""
    rs = np.random.RandomState(3)
    q, k, v = _qkv(rs, 2, 5, 700, 6, 2, 8)
    kw = dict(causal=True, q_segment_ids=jnp.asarray([[1] * 5, [1] * 3 + [0] * 2], jnp.int32),
              kv_segment_ids=jnp.asarray(np.arange(700)[None] < np.array([[650], [700]]), jnp.int32),
              q_positions=jnp.asarray([[600 + i for i in range(5)]] * 2, jnp.int32),
              kv_positions=jnp.broadcast_to(jnp.arange(700, dtype=jnp.int32), (2, 700)))
    _assert_matches_reference(q, k, v, **kw)
    jaxpr = jax.make_jaxpr(jax.grad(lambda q: jnp.sum(attention(q, k, v, implementation="xla", **kw))))(q)
    assert "remat2" in _primitives(jaxpr.jaxpr) and not _primitives(jaxpr.jaxpr) & {"scan", "while"}


def test_a_prefill_into_an_empty_cache_attends_the_prompt_alone(monkeypatch):
    """At cache_index 0 the decoder's attention gets the prompt's own keys with default positions (square and
    causal, what cuDNN and splash take); a decode step gets the whole cache with its slots."""
    import guijax.models.qwen2_5_vl as qwen

    cfg = PRESETS["tiny"]
    b, s, extra = 2, 9, 3
    ids = jnp.ones((b, s), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (3, b, s))
    module = Qwen2_5_VL(cfg)
    params = module.init(jax.random.PRNGKey(0), ids, positions, jnp.ones((b, s), jnp.int32))
    calls = []

    def recording(q, k, v, **kw):
        calls.append((q.shape[1], k.shape[1], kw["q_positions"] is None and kw["kv_positions"] is None))
        return attention(q, k, v, **{**kw, "implementation": "xla"})

    monkeypatch.setattr(qwen, "attention", recording)
    kv_mask = jnp.concatenate([jnp.ones((b, s), jnp.int32), jnp.zeros((b, extra), jnp.int32)], 1)
    _, cache = module.apply(params, ids, positions, jnp.ones((b, s), jnp.int32), cache=init_cache(cfg, b, s + extra),
                            cache_index=0, kv_mask=kv_mask)
    assert set(calls) == {(s, s, True)}
    calls.clear()
    module.apply(params, ids[:, :1], positions[:, :, :1] + s, jnp.ones((b, 1), jnp.int32), cache=cache,
                 cache_index=s, kv_mask=kv_mask.at[:, s].set(1))
    assert set(calls) == {(1, s + extra, False)}
    # a recipe naming cuDNN or splash: its decode steps (cache slots as positions) take the blockwise path
    named = []
    monkeypatch.setattr(qwen, "attention", lambda q, k, v, **kw: named.append(kw["implementation"]) or
                        attention(q, k, v, **{**kw, "implementation": "xla"}))
    for impl in ("cudnn", "splash"):
        Qwen2_5_VL(cfg, attention_impl=impl).apply(params, ids[:, :1], positions[:, :, :1] + s,
                                                   jnp.ones((b, 1), jnp.int32), cache=cache, cache_index=s,
                                                   kv_mask=kv_mask.at[:, s].set(1))
        Qwen2_5_VL(cfg, attention_impl=impl).apply(params, ids, positions, jnp.ones((b, s), jnp.int32),
                                                   cache=init_cache(cfg, b, s + extra), cache_index=0, kv_mask=kv_mask)
    layers = cfg.num_hidden_layers
    assert named == (["xla"] * layers + ["cudnn"] * layers) + (["xla"] * layers + ["splash"] * layers)


def test_auto_on_a_gpu_mesh_checks_and_runs_each_devices_rows_apart(monkeypatch):
    """Traced for a GPU on 8 devices (data 2 x fsdp 2 x tensor 2), `auto` runs its run-time layout check and
    its branch inside shard_map, each device on its own rows and heads: no device gathers another's rows (the
    partitioner had gathered every row into cuDNN's branch on each device). cuDNN's branch, stood in for by
    attention that reads sequence lengths alone, is traced on one row and 2 of the 4 heads; with right- and
    left-padded rows (the latter wrong through lengths, so only each device's own check keeps it from the
    stand-in), values and gradients are the reference's."""
    import guijax.models.attention as attention_lib
    from guijax import sharding
    from guijax.models.attention import compiling_for

    taken = []

    def cudnn_stand_in(q, k, v, q_seg, kv_seg, causal, scale):  # like cuDNN, it reads lengths alone: a row
        taken.append(q.shape)  # that is not right-padded comes out wrong, so the check must route it away
        lengths = lambda seg: jnp.sum(seg != 0, 1).astype(jnp.int32)  # noqa: E731
        return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=causal, implementation="xla",
                                            query_seq_lengths=lengths(q_seg), key_value_seq_lengths=lengths(kv_seg))

    monkeypatch.setattr(attention_lib, "_cudnn", cudnn_stand_in)
    rs = np.random.RandomState(4)
    q, k, v = _qkv(rs, 4, 64, 64, 4, 2, 16, jnp.bfloat16)
    seg = np.ones((4, 64), np.int32)
    seg[0, 40:] = 0  # right-padded rows on the first device pair, a left-padded row on the second
    seg[3, :10] = 0
    kw = dict(causal=True, q_segment_ids=jnp.asarray(seg), kv_segment_ids=jnp.asarray(seg), block_q=16,
              block_k=16)
    mesh = sharding.make_mesh(sharding.MeshConfig(data=2, fsdp=2, tensor=2))

    def loss(q, k, v, impl):
        return jnp.sum(attention(q, k, v, implementation=impl, **kw).astype(jnp.float32) ** 2)

    grad = jax.grad(loss, argnums=(0, 1, 2))
    with compiling_for("gpu"), sharding.rules_context(mesh):
        jaxpr = str(jax.make_jaxpr(grad, static_argnums=3)(q, k, v, "auto"))
        hlo = jax.jit(grad, static_argnums=3).lower(q, k, v, "auto").compile().as_text()
        got = jax.jit(grad, static_argnums=3)(q, k, v, "auto")
    assert "shard_map" in jaxpr and "in_specs=(P(('data', 'fsdp'), None, 'tensor', None)" in jaxpr
    assert taken and all(shape == (1, 64, 2, 16) for shape in taken)  # one row and 2 of 4 heads per device
    assert "all-gather" not in hlo
    want = grad(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), "reference")
    chex.assert_trees_all_close(tuple(g.astype(jnp.float32) for g in got), want, atol=0.1, rtol=0.05)
