"""Optimiser: schedule values, AdamW = optax.adamw in fp32, clipping effect, accumulation equals one large
batch, bf16 moments, param casting, config errors, sharded update."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from guijax import optim


def _cfg(**kw):
    c = ml_collections.ConfigDict(dict(learning_rate=1e-2, warmup_steps=2, total_steps=10, schedule="cosine",
                                       weight_decay=0.0, b1=0.9, b2=0.95, eps=1e-8, max_grad_norm=0.0,
                                       grad_accum_steps=1, state_dtype="float32"))
    c.update(kw)
    return c


def _run(tx, params, grads_seq):
    state = tx.init(params)
    for g in grads_seq:
        u, state = tx.update(g, state, params)
        params = optax.apply_updates(params, u)
    return params, state


def test_schedule_values():
    s = optim.make_schedule(1.0, 2, 10, "cosine")
    cos = lambda k: 0.5 * (1 + math.cos(math.pi * (k - 2) / 8))  # noqa: E731
    assert [float(s(k)) for k in range(11)] == pytest.approx([0.0, 0.5] + [cos(k) for k in range(2, 11)], abs=1e-6)
    floor = optim.make_schedule(1.0, 0, 10, "cosine", final_fraction=0.1)
    assert float(floor(0)) == pytest.approx(1.0) and float(floor(10)) == pytest.approx(0.1)
    assert float(floor(5)) == pytest.approx(0.1 + 0.9 * 0.5, rel=1e-5)
    c = optim.make_schedule(2.0, 4, 10, "constant")
    assert [float(c(k)) for k in (0, 1, 2, 4, 9, 1000)] == pytest.approx([0.0, 0.5, 1.0, 2.0, 2.0, 2.0])
    assert float(optim.make_schedule(2.0, 0, 10, "constant")(0)) == 2.0
    with pytest.raises(ValueError, match="optim.schedule must be"):
        optim.make_schedule(1.0, 0, 10, "linear")
    with pytest.raises(ValueError, match="total_steps"):
        optim.make_schedule(1.0, 10, 10, "cosine")


def test_optimizer_follows_schedule():
    """With warmup the first update is zero (lr(0) = 0); the second uses lr(1)."""
    tx, sched = optim.make_optimizer(_cfg(warmup_steps=4, schedule="constant"))
    params = {"w": jnp.ones(3)}
    state = tx.init(params)
    u0, state = tx.update({"w": jnp.ones(3)}, state, params)
    u1, _ = tx.update({"w": jnp.ones(3)}, state, params)
    assert float(jnp.abs(u0["w"]).max()) == 0.0
    # Adam's first bias-corrected step on a constant gradient has magnitude ≈ lr
    np.testing.assert_allclose(u1["w"], -float(sched(1)), rtol=1e-5)


@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_adamw_matches_optax_in_float32(wd):
    params = {"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones(3)}
    rs = np.random.RandomState(0)
    grads = [jax.tree.map(lambda p: jnp.asarray(rs.normal(size=p.shape), jnp.float32), params) for _ in range(5)]
    tx, sched = optim.make_optimizer(_cfg(weight_decay=wd))
    ours, _ = _run(tx, params, grads)
    ref, _ = _run(optax.adamw(sched, b1=0.9, b2=0.95, eps=1e-8, weight_decay=wd), params, grads)
    for k in params:
        np.testing.assert_allclose(ours[k], ref[k], rtol=1e-5, atol=1e-7)


def test_global_norm_clipping_effect():
    params = {"w": jnp.zeros(4), "v": jnp.zeros(2)}
    rs = np.random.RandomState(1)
    grads = [{"w": jnp.asarray(rs.normal(size=4) * s, jnp.float32), "v": jnp.asarray(rs.normal(size=2) * s, jnp.float32)}
             for s in (30.0, 0.1, 5.0, 0.3)]
    clip_tx, _ = optim.make_optimizer(_cfg(max_grad_norm=1.0))
    plain_tx, _ = optim.make_optimizer(_cfg())
    clipped, _ = _run(clip_tx, params, grads)

    def by_hand(g):
        n = float(optax.global_norm(g))
        return jax.tree.map(lambda x: x * min(1.0, 1.0 / n), g)

    hand, _ = _run(plain_tx, params, [by_hand(g) for g in grads])
    unclipped, _ = _run(plain_tx, params, grads)
    for k in params:
        np.testing.assert_allclose(clipped[k], hand[k], rtol=1e-5, atol=1e-8)
    # and clipping matters: the large first gradient would otherwise dominate Adam's moments
    assert max(float(jnp.abs(clipped[k] - unclipped[k]).max()) for k in params) > 1e-3


def test_accumulation_equals_large_batch():
    """3 micro-batches per update through MultiSteps = the mean gradient of the whole batch, update by update,
    with clipping on; and the schedule counts updates, not micro-batches."""
    w0 = {"w": jnp.array([0.5, -0.2, 0.1])}
    rs = np.random.RandomState(0)
    loss = lambda p, x, y: jnp.mean((x @ p["w"] - y) ** 2)  # noqa: E731
    batches = [(rs.normal(size=(6, 3)).astype(np.float32), rs.normal(size=6).astype(np.float32)) for _ in range(2)]
    cfg = dict(max_grad_norm=0.5, warmup_steps=1, total_steps=4)
    big_tx, _ = optim.make_optimizer(_cfg(**cfg))
    acc_tx, _ = optim.make_optimizer(_cfg(grad_accum_steps=3, **cfg))
    big, bs = w0, big_tx.init(w0)
    acc, st = w0, acc_tx.init(w0)
    for x, y in batches:
        u, bs = big_tx.update(jax.grad(loss)(big, x, y), bs, big)
        big = optax.apply_updates(big, u)
        for k in range(3):
            sl = slice(2 * k, 2 * k + 2)
            u, st = acc_tx.update(jax.grad(loss)(acc, x[sl], y[sl]), st, acc)
            if k < 2:
                assert float(jnp.abs(u["w"]).max()) == 0.0  # no update mid-accumulation
            acc = optax.apply_updates(acc, u)
        np.testing.assert_allclose(acc["w"], big["w"], rtol=1e-5, atol=1e-7)
    assert int(st.inner_opt_state[-1]["count"]) == 2 and float(jnp.abs(big["w"] - w0["w"]).max()) > 0


def test_bfloat16_moments():
    tx, _ = optim.make_optimizer(_cfg(state_dtype="bfloat16", warmup_steps=0))
    ref_tx, _ = optim.make_optimizer(_cfg(warmup_steps=0))
    params = {"w": jnp.linspace(-1.0, 1.0, 12).reshape(3, 4)}
    rs = np.random.RandomState(2)
    grads = [{"w": jnp.asarray(rs.normal(size=(3, 4)), jnp.float32)} for _ in range(5)]
    state = tx.init(params)
    adam = state[-1]
    assert adam["mu"]["w"].dtype == jnp.bfloat16 and adam["nu"]["w"].dtype == jnp.bfloat16
    p16, s16 = _run(tx, params, grads)
    p32, s32 = _run(ref_tx, params, grads)
    assert s16[-1]["mu"]["w"].dtype == jnp.bfloat16 and s16[-1]["nu"]["w"].dtype == jnp.bfloat16
    assert s32[-1]["nu"]["w"].dtype == jnp.float32
    # bf16 moments keep ~3 significant digits: the parameters move by the same amount to within 2%
    np.testing.assert_allclose(p16["w"] - params["w"], p32["w"] - params["w"], rtol=2e-2, atol=1e-4)
    assert not np.array_equal(np.asarray(s16[-1]["nu"]["w"], np.float32), np.asarray(s32[-1]["nu"]["w"]))
    with pytest.raises(ValueError, match="optim.state_dtype"):
        optim.make_optimizer(_cfg(state_dtype="float16"))


def test_bf16_params_get_bf16_updates():
    tx, _ = optim.make_optimizer(_cfg(warmup_steps=0))
    params = optim.cast_params({"w": jnp.ones((2, 2))}, "bfloat16")
    u, _ = tx.update({"w": jnp.full((2, 2), 0.5, jnp.bfloat16)}, tx.init(params), params)
    assert u["w"].dtype == jnp.bfloat16 and optax.apply_updates(params, u)["w"].dtype == jnp.bfloat16


def test_cast_params():
    tree = {"a": jnp.ones(2), "i": jnp.ones(2, jnp.int32), "h": jnp.ones(2, jnp.bfloat16)}
    out = optim.cast_params(tree, "bfloat16")
    assert out["a"].dtype == jnp.bfloat16 and out["i"].dtype == jnp.int32
    back = optim.cast_params(out, jnp.float32)
    assert back["a"].dtype == jnp.float32 and back["h"].dtype == jnp.float32 and back["i"].dtype == jnp.int32
    with pytest.raises(ValueError, match="param dtype must be"):
        optim.cast_params(tree, "float16")


def test_config_errors_name_the_key():
    c = _cfg()
    del c["b2"]
    with pytest.raises(ValueError, match="missing 'b2'"):
        optim.make_optimizer(c)
    with pytest.raises(ValueError, match="grad_accum_steps"):
        optim.make_optimizer(_cfg(grad_accum_steps=0))
    tx, _ = optim.make_optimizer(dict(_cfg().to_dict()))  # a plain dict works too
    assert tx.init({"w": jnp.ones(1)}) is not None


def test_sharded_update_equals_unsharded():
    mesh = Mesh(np.array(jax.devices()[:8]), ("fsdp",))
    params = {"w": jnp.linspace(-1, 1, 64).reshape(16, 4), "b": jnp.ones(8)}
    grads = jax.tree.map(lambda p: jnp.cos(p * 3.0), params)
    tx, _ = optim.make_optimizer(_cfg(state_dtype="bfloat16", max_grad_norm=1.0, weight_decay=0.1, warmup_steps=0))
    step = jax.jit(lambda p, g, s: tx.update(g, s, p))
    shard = lambda t: jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, P("fsdp"))), t)  # noqa: E731
    u0, _ = step(params, grads, tx.init(params))
    sp = shard(params)
    u1, s1 = step(sp, shard(grads), tx.init(sp))
    assert s1[-1]["mu"]["w"].sharding.spec[0] == "fsdp"
    for k in params:
        np.testing.assert_allclose(u1[k], u0[k], rtol=1e-6, atol=1e-9)
