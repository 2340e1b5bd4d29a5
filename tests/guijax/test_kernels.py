"""guijax.kernels.token_logprobs: every backend against the log_softmax+gather reference.

Shapes are small (d=64, vocab=1000, block_v=128 so the last vocab tile is partial: 1000 = 7*128 +
104) so the Pallas interpreter stays fast. Tolerances: fp32 values and gradients 1e-5 (abs and
rel); bf16 inputs: values 1e-4 against the fp32 reference on the same bf16-rounded inputs (the
kernels accumulate in fp32), gradients 2e-2 of the gradient's max magnitude (dlogits is rounded
to bf16 before the gradient matmuls and results are returned in bf16).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from guijax.kernels import api, naive_token_logprobs, pallas_gpu, pallas_tpu, token_logprobs

B, S, D, V = 2, 16, 64, 1000
BLOCK_V, BLOCK_T = 128, 16
TOL = dict(atol=1e-5, rtol=1e-5)


def make_inputs(dtype=jnp.float32, batch=B, seed=0):
    k = jax.random.split(jax.random.PRNGKey(seed), 6)
    hidden = jax.random.normal(k[0], (batch, S, D), jnp.float32)
    lm_head = jax.random.normal(k[1], (D, V), jnp.float32) * 0.25
    targets = jax.random.randint(k[2], (batch, S), 0, V, jnp.int32)
    targets = targets.at[0, 0].set(V - 1).at[0, 1].set(0).at[1, 2].set(900)  # tail tile + edges
    mask = jax.random.bernoulli(k[3], 0.75, (batch, S)).at[0, :3].set(True).at[1, 2].set(True)
    targets = jnp.where(mask, targets, -100)  # masked ids outside the vocabulary must be fine
    cot = (jax.random.normal(k[4], (batch, S)), jax.random.normal(k[5], (batch, S)))
    return hidden.astype(dtype), lm_head.astype(dtype), targets, mask, cot


def value_and_grads(fn, hidden, lm_head, targets, mask, cot):
    out, vjp = jax.vjp(lambda h, w: fn(h, w, targets, mask), hidden, lm_head)
    return out, vjp(cot)


def call(impl, **kw):
    return lambda h, w, t, m: token_logprobs(h, w, t, m, impl=impl, block_v=BLOCK_V,
                                             block_t=BLOCK_T, **kw)


def assert_close(got, want, **tol):
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), **tol)


def numpy_reference(hidden, lm_head, targets, mask):
    """float64 numpy log-softmax: checks the JAX reference itself."""
    logits = np.asarray(hidden, np.float64) @ np.asarray(lm_head, np.float64)
    logits -= logits.max(-1, keepdims=True)
    logp_all = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    t = np.where(mask, targets, 0)
    logp = np.take_along_axis(logp_all, t[..., None], -1)[..., 0]
    ent = -(np.exp(logp_all) * logp_all).sum(-1)
    return np.where(mask, logp, 0.0), np.where(mask, ent, 0.0)


def test_naive_matches_float64_numpy():
    h, w, t, m, _ = make_inputs()
    got = naive_token_logprobs(h, w, t, m)
    assert got[0].shape == (B, S) and got[1].shape == (B, S)
    assert got[0].dtype == jnp.float32 and got[1].dtype == jnp.float32
    assert_close(got, numpy_reference(h, w, t, m), atol=2e-5, rtol=2e-5)
    assert float(jnp.max(got[1])) <= np.log(V) + 1e-4  # entropy bounded by log |V|


@pytest.mark.parametrize("impl", ["chunked", "pallas_interpret"])
def test_fp32_values_and_grads_match_naive(impl):
    h, w, t, m, cot = make_inputs()
    want, want_g = value_and_grads(naive_token_logprobs, h, w, t, m, cot)
    got, got_g = value_and_grads(call(impl), h, w, t, m, cot)
    assert_close(got, want, **TOL)
    assert_close(got_g, want_g, **TOL)
    assert float(jnp.max(jnp.abs(got_g[1][:, 896:]))) > 0  # the partial tail tile gets gradient


def test_pallas_gpu_kernels_interpreted_match_naive(monkeypatch):
    # Few programs wanted -> each vocab split covers 3 blocks, exercising the split merge.
    monkeypatch.setattr(pallas_gpu, "_TARGET_PROGRAMS", 4)
    h, w, t, m, cot = make_inputs()
    want, want_g = value_and_grads(naive_token_logprobs, h, w, t, m, cot)

    def fn(hh, ww, tt, mm):
        b, s, d = hh.shape
        tt = jnp.where(mm, tt, 0).reshape(-1)
        lp, ent = pallas_gpu.token_logprobs_pallas_gpu(hh.reshape(b * s, d), ww, tt, 16, 128, 32,
                                                       True)
        return jnp.where(mm, lp.reshape(b, s), 0), jnp.where(mm, ent.reshape(b, s), 0)

    got, got_g = value_and_grads(fn, h, w, t, m, cot)
    assert_close(got, want, **TOL)
    assert_close(got_g, want_g, **TOL)


def test_chunked_handles_block_larger_than_vocab_and_exact_multiple():
    h, w, t, m, cot = make_inputs()
    want, want_g = value_and_grads(naive_token_logprobs, h, w, t, m, cot)
    for bv in (200, 4096):  # 1000 = 5 * 200 (no tail); 4096 > vocab (one block)
        fn = lambda hh, ww, tt, mm: token_logprobs(hh, ww, tt, mm, impl="chunked", block_v=bv)
        got, got_g = value_and_grads(fn, h, w, t, m, cot)
        assert_close(got, want, **TOL)
        assert_close(got_g, want_g, **TOL)


@pytest.mark.parametrize("impl", ["chunked", "pallas_interpret"])
def test_bf16_inputs_accumulate_in_fp32(impl):
    h, w, t, m, cot = make_inputs(jnp.bfloat16)
    # Reference: fp32 math on the same (bf16-rounded) numbers.
    want, want_g = value_and_grads(naive_token_logprobs, h.astype(jnp.float32),
                                   w.astype(jnp.float32), t, m, cot)
    got, got_g = value_and_grads(call(impl), h, w, t, m, cot)
    assert got[0].dtype == jnp.float32 and got[1].dtype == jnp.float32
    assert got_g[0].dtype == jnp.bfloat16 and got_g[1].dtype == jnp.bfloat16
    assert_close(got, want, atol=1e-4, rtol=1e-4)
    for g, ref in zip(got_g, want_g):
        scale = float(jnp.max(jnp.abs(ref)))
        err = float(jnp.max(jnp.abs(g.astype(jnp.float32) - ref)))
        assert err <= 2e-2 * scale, (err, scale)


@pytest.mark.parametrize("impl", ["chunked", "pallas_interpret", "naive"])
def test_masked_positions_are_zero_and_get_no_gradient(impl):
    h, w, t, m, cot = make_inputs()
    (logp, ent), (dh, _) = value_and_grads(call(impl), h, w, t, m, cot)
    off = ~np.asarray(m)
    assert off.any() and (~off).any()
    assert np.all(np.asarray(logp)[off] == 0) and np.all(np.asarray(ent)[off] == 0)
    assert np.all(np.asarray(dh)[off] == 0)
    assert np.all(np.asarray(logp)[~off] < 0) and np.all(np.asarray(ent)[~off] > 0)


def test_fully_masked_batch_gives_zero_gradients():
    h, w, t, m, cot = make_inputs()
    m = jnp.zeros_like(m)
    (logp, ent), (dh, dw) = value_and_grads(call("chunked"), h, w, t, m, cot)
    assert float(jnp.abs(logp).max()) == 0 and float(jnp.abs(ent).max()) == 0
    assert float(jnp.abs(dh).max()) == 0 and float(jnp.abs(dw).max()) == 0


@pytest.mark.parametrize("impl", ["chunked", "pallas_interpret"])
def test_under_jit(impl):
    h, w, t, m, cot = make_inputs()
    fn = call(impl)

    @jax.jit
    def loss_and_grads(hh, ww):
        def loss(a, b):
            lp, ent = fn(a, b, t, m)
            return jnp.sum(lp * cot[0] + ent * cot[1])
        return jax.value_and_grad(loss, argnums=(0, 1))(hh, ww)

    def ref_loss(a, b):
        lp, ent = naive_token_logprobs(a, b, t, m)
        return jnp.sum(lp * cot[0] + ent * cot[1])

    val, grads = loss_and_grads(h, w)
    want_val, want_grads = jax.value_and_grad(ref_loss, argnums=(0, 1))(h, w)
    np.testing.assert_allclose(float(val), float(want_val), rtol=1e-5)
    assert_close(grads, want_grads, **TOL)


def test_tied_embedding_passed_transposed():
    h, w, t, m, cot = make_inputs()
    emb = w.T  # [vocab, d], as stored by a tied embedding table

    def loss(fn, e):
        lp, ent = fn(h, e.T, t, m)
        return jnp.sum(lp * cot[0] + ent * cot[1])

    g = jax.grad(lambda e: loss(call("chunked"), e))(emb)
    g_ref = jax.grad(lambda e: loss(naive_token_logprobs, e))(emb)
    assert g.shape == (V, D)
    np.testing.assert_allclose(np.asarray(g), np.asarray(g_ref), **TOL)


def _mesh(shape, names):
    devs = jax.devices()
    if len(devs) < int(np.prod(shape)):
        pytest.skip(f"needs {int(np.prod(shape))} devices")
    return Mesh(np.array(devs[: int(np.prod(shape))]).reshape(shape), names)


def test_batch_sharded_chunked_under_plain_jit():
    mesh = _mesh((8,), ("data",))
    h, w, t, m, cot = make_inputs(batch=8)
    batch = NamedSharding(mesh, P("data"))
    hs, ts, ms = (jax.device_put(x, batch) for x in (h, t, m))
    ws = jax.device_put(w, NamedSharding(mesh, P()))
    cs = tuple(jax.device_put(c, batch) for c in cot)
    fwd = jax.jit(lambda a, b, c, d: token_logprobs(a, b, c, d, impl="chunked", block_v=BLOCK_V))
    got = fwd(hs, ws, ts, ms)
    assert got[0].sharding.spec == P("data") or got[0].sharding.is_equivalent_to(batch, 2)
    want, want_g = value_and_grads(naive_token_logprobs, h, w, t, m, cot)
    assert_close(got, want, **TOL)
    _, got_g = jax.jit(lambda a, b, c0, c1: value_and_grads(
        lambda x, y, tt, mm: token_logprobs(x, y, tt, mm, impl="chunked", block_v=BLOCK_V),
        a, b, ts, ms, (c0, c1)))(hs, ws, *cs)
    assert_close(got_g, want_g, **TOL)


@pytest.mark.slow
def test_vocab_sharded_lm_head_chunked_under_plain_jit():
    mesh = _mesh((4, 2), ("data", "tensor"))
    h, w, t, m, cot = make_inputs(batch=4)
    batch = NamedSharding(mesh, P("data"))
    hs, ts, ms = (jax.device_put(x, batch) for x in (h, t, m))
    ws = jax.device_put(w, NamedSharding(mesh, P(None, "tensor")))
    fn = lambda a, b, tt, mm: token_logprobs(a, b, tt, mm, impl="chunked", block_v=BLOCK_V)
    got, got_g = jax.jit(lambda a, b: value_and_grads(fn, a, b, ts, ms, cot))(hs, ws)
    want, want_g = value_and_grads(naive_token_logprobs, h, w, t, m, cot)
    assert_close(got, want, **TOL)
    assert_close(got_g, want_g, **TOL)


@pytest.mark.parametrize("impl", ["chunked", "pallas_interpret"])
def test_mesh_shard_map_batch_sharding(impl):
    mesh = _mesh((8,), ("data",))
    h, w, t, m, cot = make_inputs(batch=8)
    batch = NamedSharding(mesh, P("data"))
    hs, ts, ms = (jax.device_put(x, batch) for x in (h, t, m))
    ws = jax.device_put(w, NamedSharding(mesh, P()))
    fn = call(impl, mesh=mesh, batch_axes="data")
    got, got_g = jax.jit(lambda a, b: value_and_grads(fn, a, b, ts, ms, cot))(hs, ws)
    assert got[0].sharding.is_equivalent_to(batch, 2)
    want, want_g = value_and_grads(naive_token_logprobs, h, w, t, m, cot)
    assert_close(got, want, **TOL)
    assert_close(got_g, want_g, **TOL)


def test_bad_inputs_name_the_problem():
    h, w, t, m, _ = make_inputs()
    with pytest.raises(ValueError, match="hidden must be"):
        token_logprobs(h[0], w, t, m)
    with pytest.raises(ValueError, match=r"lm_head must be \[d=64, vocab\]"):
        token_logprobs(h, w.T, t, m)
    with pytest.raises(ValueError, match="targets must be"):
        token_logprobs(h, w, t[:, :3], m)
    with pytest.raises(ValueError, match="integer token ids"):
        token_logprobs(h, w, t.astype(jnp.float32), m)
    with pytest.raises(ValueError, match="mask must be"):
        token_logprobs(h, w, t, m[0])
    with pytest.raises(ValueError, match="impl='bogus'"):
        token_logprobs(h, w, t, m, impl="bogus")
    with pytest.raises(ValueError, match="multiple of 128"):
        token_logprobs(h, w, t, m, impl="pallas_interpret", block_v=100)
    with pytest.raises(ValueError, match="multiple of 8"):
        token_logprobs(h, w, t, m, impl="pallas_interpret", block_t=12, block_v=128)
    with pytest.raises(ValueError, match="power of two"):
        pallas_gpu.check_blocks(48, 128, 32, 64)
    with pytest.raises(ValueError, match="multiple of block_k"):
        pallas_gpu.check_blocks(16, 128, 64, 96)
    mesh = _mesh((8,), ("data",))
    with pytest.raises(ValueError, match="not divisible"):
        token_logprobs(h, w, t, m, mesh=mesh)  # batch 2 over 8 shards
    with pytest.raises(ValueError, match="not in mesh axes"):
        token_logprobs(h, w, t, m, mesh=mesh, batch_axes="fsdp")


def test_impl_resolution():
    assert api.resolve_impl("auto", "cpu") == "chunked"
    assert api.resolve_impl("auto", "tpu") == "pallas_tpu"
    assert api.resolve_impl("auto", "gpu") == "chunked"  # measured faster than the Triton kernels on an H100
    assert api.resolve_impl("pallas", "gpu") == "pallas_gpu"
    with pytest.raises(ValueError, match="pallas_interpret"):
        api.resolve_impl("pallas", "cpu")


def _lower_grad(fn, platform, dtype):
    n, d, v = 64, 256, 1000
    args = (jax.ShapeDtypeStruct((n, d), dtype), jax.ShapeDtypeStruct((d, v), dtype),
            jax.ShapeDtypeStruct((n,), jnp.int32))

    def loss(h, w, t):
        lp, ent = fn(h, w, t)
        return jnp.sum(lp) + jnp.sum(ent)

    return jax.jit(jax.grad(loss, (0, 1))).trace(*args).lower(lowering_platforms=(platform,)).as_text()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_tpu_kernels_lower_to_mosaic(dtype):
    """Runs the Mosaic lowering on CPU (no TPU needed): catches unsupported ops and layouts."""
    txt = _lower_grad(lambda h, w, t: pallas_tpu.token_logprobs_pallas_tpu(h, w, t, 32, 128),
                      "tpu", dtype)
    assert txt.count("tpu_custom_call") == 3  # forward, d hidden, d lm_head


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gpu_kernels_lower_to_triton(dtype):
    """Runs the Pallas->Triton lowering on CPU (no GPU needed)."""
    txt = _lower_grad(lambda h, w, t: pallas_gpu.token_logprobs_pallas_gpu(h, w, t), "cuda", dtype)
    assert txt.count("xla.gpu.triton") == 2  # forward, backward


def _device_check():
    h, w, t, m, cot = make_inputs()
    want, want_g = value_and_grads(naive_token_logprobs, h, w, t, m, cot)
    got, got_g = value_and_grads(
        lambda a, b, tt, mm: token_logprobs(a, b, tt, mm, impl="pallas"), h, w, t, m, cot)
    # Device matmuls may use reduced-precision passes even at HIGHEST; allow 1e-4.
    assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert_close(got_g, want_g, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
def test_pallas_gpu_on_device():
    _device_check()


@pytest.mark.tpu
def test_pallas_tpu_on_device():
    _device_check()
