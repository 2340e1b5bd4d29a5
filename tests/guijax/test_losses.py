"""Losses and advantages against numpy references (values and gradients), under jit and sharding."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from guijax import advantages as adv_lib
from guijax import losses, sharding

RS = np.random.RandomState(0)
B, S = 8, 12
LOGP = np.log(RS.uniform(0.05, 1.0, (B, S))).astype(np.float32)
OLD = (LOGP + RS.normal(0, 0.4, (B, S))).astype(np.float32)
ADV = RS.normal(0, 1, B).astype(np.float32)
MASK = (RS.uniform(size=(B, S)) > 0.25).astype(np.float32)
MASK[:, 0] = 1


def np_clipped(logp, old, adv, mask, eps_low=0.2, eps_high=0.3, dual=0.0, norm="token"):
    ratio = np.exp(logp - old)
    a = adv[:, None]
    per = -np.minimum(ratio * a, np.clip(ratio, 1 - eps_low, 1 + eps_high) * a)
    if dual > 1:
        per = np.where(a < 0, np.minimum(per, -dual * a), per)
    if norm == "token":
        return (per * mask).sum() / mask.sum()
    return np.mean((per * mask).sum(1) / mask.sum(1))


@pytest.mark.parametrize("norm", ["token", "sequence"])
@pytest.mark.parametrize("dual", [0.0, 3.0])
def test_clipped_loss_matches_numpy(norm, dual):
    cfg = losses.ClipConfig(dual_clip=dual, normalization=norm)
    loss, metrics = jax.jit(lambda l: losses.clipped_policy_loss(l, OLD, ADV, MASK, cfg))(LOGP)
    np.testing.assert_allclose(loss, np_clipped(LOGP, OLD, ADV, MASK, dual=dual, norm=norm), rtol=1e-5)
    ratio = np.exp(LOGP - OLD)
    high = ((ratio > 1.3) & (ADV[:, None] > 0) & (MASK > 0)).sum() / MASK.sum()
    np.testing.assert_allclose(metrics["clip_frac_high"], high, rtol=1e-6)
    assert 0 < float(metrics["clip_frac_low"]) < 1


def test_dual_clip_bounds_negative_advantage_loss():
    logp, old = np.array([[3.0]], np.float32), np.array([[0.0]], np.float32)  # ratio e^3 ≈ 20
    plain, _ = losses.clipped_policy_loss(logp, old, np.array([-1.0], np.float32), np.ones((1, 1)))
    dual, _ = losses.clipped_policy_loss(logp, old, np.array([-1.0], np.float32), np.ones((1, 1)),
                                         losses.ClipConfig(dual_clip=3.0))
    assert float(plain) == pytest.approx(math.exp(3.0), rel=1e-5) and float(dual) == pytest.approx(3.0)


def test_clipped_loss_gradient_matches_finite_differences():
    f = lambda l: losses.clipped_policy_loss(l, OLD, ADV, MASK)[0]  # noqa: E731
    grad = np.asarray(jax.grad(f)(jnp.asarray(LOGP, jnp.float64) if jax.config.jax_enable_x64 else LOGP))
    eps = 1e-3
    for (i, j) in [(0, 0), (3, 5), (7, 11)]:
        plus, minus = LOGP.copy(), LOGP.copy()
        plus[i, j] += eps
        minus[i, j] -= eps
        fd = (np_clipped(plus.astype(np.float64), OLD, ADV, MASK) - np_clipped(minus.astype(np.float64), OLD, ADV, MASK)) / (2 * eps)
        assert grad[i, j] == pytest.approx(fd, abs=2e-4)
    assert np.all(grad[MASK == 0] == 0)


def test_token_normalizer_for_accumulation():
    """Two halves with the global token count Z sum to the full-batch loss (gradient accumulation)."""
    z = MASK.sum()
    halves = sum(float(losses.clipped_policy_loss(LOGP[s], OLD[s], ADV[s], MASK[s], normalizer=z)[0])
                 for s in (slice(0, 4), slice(4, 8)))
    assert halves == pytest.approx(float(losses.clipped_policy_loss(LOGP, OLD, ADV, MASK)[0]), rel=1e-5)


def test_kl_term_and_entropy_metric():
    ref = OLD - 0.1
    cfg = losses.ClipConfig(kl_coef=0.05)
    loss, m = losses.clipped_policy_loss(LOGP, OLD, ADV, MASK, cfg, ref_logp=ref, entropy=np.ones_like(LOGP))
    d = ref - LOGP
    k3 = np.exp(d) - d - 1
    np.testing.assert_allclose(loss, np_clipped(LOGP, OLD, ADV, MASK) + 0.05 * (k3 * MASK).sum() / MASK.sum(), rtol=1e-5)
    assert float(m["entropy"]) == pytest.approx(1.0) and float(m["ref_kl"]) > 0


def test_luffy_off_policy_branch_is_shaped_and_unclipped():
    off = np.array([True] * 3 + [False] * 5)
    loss, m = losses.luffy_loss(LOGP, OLD, ADV, MASK, off, gamma=0.1)
    p = np.exp(LOGP)
    ratio = np.exp(LOGP - OLD)
    a = ADV[:, None]
    on = -np.minimum(ratio * a, np.clip(ratio, 0.8, 1.3) * a)
    per = np.where(off[:, None], -(p / (p + 0.1)) * a, on)
    np.testing.assert_allclose(loss, (per * MASK).sum() / MASK.sum(), rtol=1e-5)
    # shaping gradient: d/dlogp [-(p/(p+γ))A] = -A·γp/(p+γ)²
    g = np.asarray(jax.grad(lambda l: losses.luffy_loss(l, OLD, ADV, MASK, off)[0])(LOGP))
    expected = -ADV[0] * 0.1 * p[0, 0] / (p[0, 0] + 0.1) ** 2 / MASK.sum()
    assert g[0, 0] == pytest.approx(expected, rel=1e-4)
    assert float(m["off_policy_tokens"]) == MASK[:3].sum()


def test_sft_dpo_kto_failure_losses():
    sft, _ = losses.sft_loss(LOGP, MASK)
    assert float(sft) == pytest.approx(-(LOGP * MASK).sum() / MASK.sum(), rel=1e-6)
    seq = np.asarray(losses.sequence_logp(LOGP, MASK))
    np.testing.assert_allclose(seq, (LOGP * MASK).sum(1), rtol=1e-6)
    cw, cl, rw, rl = seq[:4], seq[4:], seq[:4] - 0.5, seq[4:] + 0.2
    dpo, m = losses.dpo_loss(cw, cl, rw, rl, beta=0.1)
    margin = 0.1 * ((cw - rw) - (cl - rl))
    assert float(dpo) == pytest.approx(np.mean(np.log1p(np.exp(-margin))), rel=1e-5)
    assert float(m["dpo_accuracy"]) == 1.0
    r = seq - (seq - 0.3)
    desirable = np.array([1, 0] * 4, bool)
    kto, km = losses.kto_loss(seq, seq - 0.3, desirable, beta=0.5)
    z0 = max(0.0, r.mean())
    sig = lambda x: 1 / (1 + np.exp(-x))  # noqa: E731
    ref = np.where(desirable, 1 - sig(0.5 * (r - z0)), 1 - sig(0.5 * (z0 - r))).mean()
    assert float(kto) == pytest.approx(ref, rel=1e-5) and float(km["kto_z0"]) == pytest.approx(z0, rel=1e-5)
    fail, _ = losses.failure_step_loss(seq, seq - 1.0, gamma=0.2)
    assert float(fail) == pytest.approx(0.2 * np.log1p(np.exp(1.0)), rel=1e-5)
    # the gradient pushes the failure step's log-prob down
    assert float(jax.grad(lambda s: losses.failure_step_loss(s, seq - 1.0)[0])(seq)[0]) > 0


def test_group_advantages_one_success_in_n():
    for n in (2, 4, 8, 16):
        rewards = np.zeros(n, np.float32)
        rewards[0] = 1.0
        stats = adv_lib.group_advantages(rewards, np.zeros(n, np.int32), 1, eps=0.0)
        assert float(stats.advantages[0]) == pytest.approx(math.sqrt(n - 1), rel=1e-5)
        np.testing.assert_allclose(stats.advantages[1:], -1 / math.sqrt(n - 1), rtol=1e-5)


def test_group_advantages_groups_zero_variance_and_dropped():
    rewards = np.array([1, 0, 1, 0, 1, 1, 1, 1, 0, 1, 0, 0], np.float32)
    groups = np.repeat(np.arange(3), 4).astype(np.int32)
    valid = np.ones(12, bool)
    valid[11] = False  # an errored episode dropped from group 2
    stats = jax.jit(lambda r, g, v: adv_lib.group_advantages(r, g, 3, valid=v))(rewards, groups, valid)
    for g in range(3):
        sel = (groups == g) & valid
        r = rewards[sel]
        np.testing.assert_allclose(stats.advantages[sel], (r - r.mean()) / (r.std() + 1e-6), rtol=1e-4, atol=1e-5)
    assert int(stats.zero_variance_groups) == 1 and float(stats.advantages[11]) == 0.0
    np.testing.assert_allclose(adv_lib.step0_step_advantages(np.array([2.0, -1.0]), np.array([4, 1])), [0.5, -1.0])


def test_sharded_loss_equals_unsharded():
    mesh = sharding.make_mesh(sharding.MeshConfig(data=2, fsdp=4, tensor=1))
    put = lambda x: jax.device_put(x, NamedSharding(mesh, P(("data", "fsdp"), *([None] * (x.ndim - 1)))))  # noqa: E731
    f = jax.jit(lambda l, o, a, m: losses.clipped_policy_loss(l, o, a, m)[0])
    sharded = f(put(LOGP), put(OLD), put(ADV), put(MASK))
    assert float(sharded) == pytest.approx(float(f(LOGP, OLD, ADV, MASK)), rel=1e-6)
    g = jax.jit(jax.grad(lambda l, o, a, m: losses.clipped_policy_loss(l, o, a, m)[0]))
    np.testing.assert_allclose(g(put(LOGP), put(OLD), put(ADV), put(MASK)), g(LOGP, OLD, ADV, MASK), atol=1e-7)
