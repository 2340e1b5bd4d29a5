"""Optimiser: schedules, clipping, accumulation equals one large batch, bf16 moments."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from guijax import optim


def _cfg(**kw):
    c = ml_collections.ConfigDict(dict(learning_rate=1e-2, warmup_steps=2, total_steps=10, schedule="cosine",
                                       weight_decay=0.0, b1=0.9, b2=0.95, eps=1e-8, max_grad_norm=0.0,
                                       grad_accum_steps=1, state_dtype="float32"))
    c.update(kw)
    return c


def test_schedules():
    s = optim.make_schedule(1.0, 2, 10, "cosine")
    assert [float(s(i)) for i in (0, 1, 2)] == pytest.approx([0.0, 0.5, 1.0])
    assert float(s(10)) == pytest.approx(0.0, abs=1e-6) and 0 < float(s(6)) < 1
    c = optim.make_schedule(1.0, 0, 10, "constant")
    assert float(c(0)) == float(c(9)) == 1.0
    with pytest.raises(ValueError, match="schedule must be"):
        optim.make_schedule(1.0, 0, 10, "linear")


def test_adamw_matches_optax_in_float32():
    params = {"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones(3)}
    grads = jax.tree.map(lambda p: jnp.sin(p) + 0.1, params)
    tx, sched = optim.make_optimizer(_cfg(weight_decay=0.1))
    ref = optax.adamw(sched, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)
    s1, s2 = tx.init(params), ref.init(params)
    p1 = p2 = params
    for _ in range(4):
        u1, s1 = tx.update(grads, s1, p1)
        u2, s2 = ref.update(grads, s2, p2)
        p1, p2 = optax.apply_updates(p1, u1), optax.apply_updates(p2, u2)
    for k in params:
        np.testing.assert_allclose(p1[k], p2[k], rtol=1e-5, atol=1e-7)


def test_global_norm_clipping():
    tx, _ = optim.make_optimizer(_cfg(max_grad_norm=1.0, warmup_steps=0, schedule="constant", learning_rate=1.0))
    params = {"w": jnp.zeros(4)}
    state = tx.init(params)
    clipped = optax.clip_by_global_norm(1.0).update({"w": jnp.full(4, 10.0)}, optax.EmptyState())[0]
    assert float(optax.global_norm(clipped)) == pytest.approx(1.0, rel=1e-5)
    updates, _ = tx.update({"w": jnp.full(4, 10.0)}, state, params)
    assert np.all(np.isfinite(updates["w"]))


def test_accumulation_equals_large_batch():
    w0 = {"w": jnp.array([0.5, -0.2, 0.1])}
    xs = np.random.RandomState(0).normal(size=(8, 3)).astype(np.float32)
    loss = lambda p, x: jnp.mean((x @ p["w"] - 1.0) ** 2)  # noqa: E731
    big_tx, _ = optim.make_optimizer(_cfg())
    acc_tx, _ = optim.make_optimizer(_cfg(grad_accum_steps=2))
    g = jax.grad(loss)(w0, xs)
    u, _ = big_tx.update(g, big_tx.init(w0), w0)
    big = optax.apply_updates(w0, u)
    p, s = w0, acc_tx.init(w0)
    for half in (xs[:4], xs[4:]):
        u, s = acc_tx.update(jax.grad(loss)(w0, half), s, p)
        p = optax.apply_updates(p, u)
    np.testing.assert_allclose(p["w"], big["w"], rtol=1e-5)


def test_bfloat16_moments():
    tx, _ = optim.make_optimizer(_cfg(state_dtype="bfloat16"))
    params = {"w": jnp.ones((2, 2))}
    state = tx.init(params)
    adam = state[-1] if isinstance(state, tuple) else state
    assert adam["mu"]["w"].dtype == jnp.bfloat16 and adam["nu"]["w"].dtype == jnp.bfloat16
    updates, state = tx.update({"w": jnp.full((2, 2), 0.5)}, state, params)
    assert updates["w"].dtype == jnp.float32 and state[-1]["mu"]["w"].dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="state_dtype"):
        optim.make_optimizer(_cfg(state_dtype="float16"))


def test_cast_params():
    out = optim.cast_params({"a": jnp.ones(2), "i": jnp.ones(2, jnp.int32)}, jnp.bfloat16)
    assert out["a"].dtype == jnp.bfloat16 and out["i"].dtype == jnp.int32
