"""Losses against loop-by-loop numpy references (float64): values, gradients (jax.grad vs central finite
differences of the reference), metrics, padding robustness, jit, and sharding on an 8-device mesh."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from guijax import losses

RS = np.random.RandomState(0)
B, S = 8, 12
LOGP = np.log(RS.uniform(0.05, 1.0, (B, S))).astype(np.float32)
OLD = (LOGP + RS.normal(0, 0.4, (B, S))).astype(np.float32)
REF = (LOGP + RS.normal(0, 0.3, (B, S))).astype(np.float32)
ADV = RS.normal(0, 1, B).astype(np.float32)
MASK = (RS.uniform(size=(B, S)) > 0.25).astype(np.float32)
MASK[:, 0] = 1
MASK[5] = 0  # an empty row (all padding) must not count as a sequence
ENT = RS.uniform(0.1, 3.0, (B, S)).astype(np.float32)
OFF = np.array([True, False, True, False, False, False, False, True])


# ---------------------------------------------------------------- numpy references (element loops, float64)

def ref_surrogate(logp, old, adv, eps_low=0.2, eps_high=0.3, dual=0.0):
    """−objective per token, written piecewise: A ≥ 0 → min(r, 1+ε_h)·A; A < 0 → max(r, 1−ε_l)·A, dual: max(·, c·A)."""
    out = np.zeros(logp.shape)
    for i, j in np.ndindex(logp.shape):
        r, a = math.exp(float(logp[i, j]) - float(old[i, j])), float(adv[i])
        obj = min(r, 1 + eps_high) * a if a >= 0 else max(r, 1 - eps_low) * a
        if dual and a < 0:
            obj = max(obj, dual * a)
        out[i, j] = -obj
    return out


def ref_aggregate(per, mask, norm="token"):
    if norm == "token":
        return sum(per[i, j] for i, j in np.ndindex(per.shape) if mask[i, j]) / mask.sum()
    rows = [np.mean([per[i, j] for j in range(per.shape[1]) if mask[i, j]]) for i in range(per.shape[0]) if mask[i].any()]
    return float(np.mean(rows))


def ref_k3(logp, ref):
    d = np.asarray(ref, np.float64) - logp
    return np.exp(d) - d - 1


def ref_clipped(logp, old=OLD, adv=ADV, mask=MASK, norm="token", dual=0.0, kl=0.0, ref=None):
    per = ref_surrogate(logp, old, adv, dual=dual)
    if kl:
        per = per + kl * ref_k3(logp, ref)
    return ref_aggregate(per, mask, norm)


def ref_luffy(logp, old=OLD, adv=ADV, mask=MASK, off=OFF, gamma=0.1):
    per = ref_surrogate(logp, old, adv)
    for i, j in np.ndindex(logp.shape):
        if off[i]:
            p = math.exp(float(logp[i, j]))
            per[i, j] = -(p / (p + gamma)) * float(adv[i])
    return ref_aggregate(per, mask)


def fd_grad(f, x, h=1e-6):
    """Central finite differences of a float64 numpy function, every element."""
    x = np.asarray(x, np.float64)
    g = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        plus, minus = x.copy(), x.copy()
        plus[idx] += h
        minus[idx] -= h
        g[idx] = (f(plus) - f(minus)) / (2 * h)
    return g


def sig(x):
    return 1 / (1 + np.exp(-x))


# ---------------------------------------------------------------- clipped GRPO/PPO surrogate

@pytest.mark.parametrize("norm", ["token", "sequence"])
@pytest.mark.parametrize("dual", [0.0, 3.0])
def test_clipped_loss_value_and_gradient(norm, dual):
    cfg = losses.ClipConfig(dual_clip=dual, normalization=norm)
    f = jax.jit(jax.value_and_grad(lambda l: losses.clipped_policy_loss(l, OLD, ADV, MASK, cfg)[0]))
    loss, grad = f(LOGP)
    ref = lambda l: ref_clipped(l, norm=norm, dual=dual)  # noqa: E731
    np.testing.assert_allclose(loss, ref(LOGP), rtol=1e-5)
    np.testing.assert_allclose(grad, fd_grad(ref, LOGP), atol=2e-6)
    assert np.all(np.asarray(grad)[MASK == 0] == 0)


def test_defaults_are_the_papers():
    cfg = losses.ClipConfig()
    assert (cfg.eps_low, cfg.eps_high, cfg.dual_clip, cfg.kl_coef, cfg.normalization) == (0.2, 0.3, 0.0, 0.0, "token")


def test_asymmetric_clip_boundaries():
    """A>0 stops at r = 1.3 (ε_high), A<0 at r = 0.8 (ε_low): beyond them the gradient is zero."""
    logp = np.log(np.array([[1.5, 1.2, 0.7, 0.9]], np.float32))
    one = np.ones((1, 4), np.float32)
    for adv, live in ((1.0, [False, True, True, True]), (-1.0, [True, True, False, True])):
        g = jax.grad(lambda l: losses.clipped_policy_loss(l, np.zeros((1, 4), np.float32),
                                                          np.array([adv], np.float32), one)[0])(logp)
        assert list(np.asarray(g)[0] != 0) == live


def test_dual_clip_bounds_negative_advantage_loss():
    logp, old = np.array([[3.0]], np.float32), np.array([[0.0]], np.float32)  # ratio e^3 ≈ 20
    neg, one = np.array([-1.0], np.float32), np.ones((1, 1), np.float32)
    plain, _ = losses.clipped_policy_loss(logp, old, neg, one)
    dual, m = losses.clipped_policy_loss(logp, old, neg, one, losses.ClipConfig(dual_clip=3.0))
    assert float(plain) == pytest.approx(math.exp(3.0), rel=1e-5) and float(dual) == pytest.approx(3.0)
    assert float(m["dual_clip_frac"]) == 1.0
    assert float(jax.grad(lambda l: losses.clipped_policy_loss(l, old, neg, one, losses.ClipConfig(dual_clip=3.0))[0])(logp)[0, 0]) == 0.0


def test_per_token_advantages_equal_broadcast():
    a, _ = losses.clipped_policy_loss(LOGP, OLD, ADV, MASK)
    b, _ = losses.clipped_policy_loss(LOGP, OLD, np.repeat(ADV[:, None], S, 1), MASK)
    assert float(a) == pytest.approx(float(b), rel=1e-6)


@pytest.mark.parametrize("norm", ["token", "sequence"])
def test_normalizer_for_accumulation(norm):
    """Micro-batches with the global denominator (token count / sequence count) sum to the full-batch loss."""
    z = MASK.sum() if norm == "token" else float((MASK.sum(1) > 0).sum())
    cfg = losses.ClipConfig(normalization=norm)
    halves = sum(float(losses.clipped_policy_loss(LOGP[s], OLD[s], ADV[s], MASK[s], cfg, normalizer=z)[0])
                 for s in (slice(0, 3), slice(3, 8)))
    assert halves == pytest.approx(float(losses.clipped_policy_loss(LOGP, OLD, ADV, MASK, cfg)[0]), rel=1e-5)


def test_kl_term_value_gradient_and_metrics():
    cfg = losses.ClipConfig(kl_coef=0.05)
    f = lambda l: losses.clipped_policy_loss(l, OLD, ADV, MASK, cfg, ref_logp=REF, entropy=ENT)  # noqa: E731
    (loss, m), grad = jax.value_and_grad(f, has_aux=True)(LOGP)
    ref = lambda l: ref_clipped(l, kl=0.05, ref=REF)  # noqa: E731
    np.testing.assert_allclose(loss, ref(LOGP), rtol=1e-5)
    np.testing.assert_allclose(grad, fd_grad(ref, LOGP), atol=2e-6)
    on = MASK > 0
    assert float(m["ref_kl"]) == pytest.approx(ref_k3(LOGP, REF)[on].mean(), rel=1e-5)
    assert float(m["entropy"]) == pytest.approx(ENT[on].mean(), rel=1e-6)
    # kl_coef 0 (default): a passed ref_logp is only measured, never added
    no_kl, m0 = losses.clipped_policy_loss(LOGP, OLD, ADV, MASK, ref_logp=REF)
    assert float(no_kl) == pytest.approx(ref_clipped(LOGP), rel=1e-5) and "ref_kl" in m0


def test_metrics_match_numpy():
    _, m = losses.clipped_policy_loss(LOGP, OLD, ADV, MASK, losses.ClipConfig(dual_clip=3.0))
    on = MASK > 0
    r = np.exp(LOGP.astype(np.float64) - OLD)
    a = np.broadcast_to(ADV[:, None], r.shape)
    assert float(m["clip_frac_low"]) == pytest.approx(((r < 0.8) & (a < 0))[on].mean(), rel=1e-6)
    assert float(m["clip_frac_high"]) == pytest.approx(((r > 1.3) & (a > 0))[on].mean(), rel=1e-6)
    assert float(m["dual_clip_frac"]) == pytest.approx(((r > 3.0) & (a < 0))[on].mean(), abs=1e-7)
    assert float(m["approx_kl"]) == pytest.approx((r - 1 - np.log(r))[on].mean(), rel=1e-4)
    assert float(m["ratio_mean"]) == pytest.approx(r[on].mean(), rel=1e-5)
    assert float(m["ratio_max"]) == pytest.approx(r[on].max(), rel=1e-5)
    assert float(m["tokens"]) == MASK.sum()
    assert 0 < float(m["clip_frac_low"]) < 1 and 0 < float(m["clip_frac_high"]) < 1


def test_padding_garbage_gives_finite_loss_and_zero_gradient():
    logp, old, ref = LOGP.copy(), OLD.copy(), REF.copy()
    pad = MASK == 0
    logp[pad], old[pad], ref[pad] = -np.inf, np.inf, np.nan
    cfg = losses.ClipConfig(kl_coef=0.1, dual_clip=3.0)
    loss, grad = jax.value_and_grad(lambda l: losses.clipped_policy_loss(l, old, ADV, MASK, cfg, ref_logp=ref)[0])(logp)
    clean = losses.clipped_policy_loss(LOGP, OLD, ADV, MASK, cfg, ref_logp=REF)[0]
    assert float(loss) == pytest.approx(float(clean), rel=1e-6)
    assert np.all(np.isfinite(grad)) and np.all(np.asarray(grad)[pad] == 0)
    lgrad = jax.grad(lambda l: losses.luffy_loss(l, old, ADV, MASK, OFF)[0])(logp)
    assert np.all(np.isfinite(lgrad)) and np.all(np.asarray(lgrad)[pad] == 0)


def test_bad_inputs_name_the_problem():
    with pytest.raises(ValueError, match="old_logp has shape"):
        losses.clipped_policy_loss(LOGP, OLD[:, :5], ADV, MASK)
    with pytest.raises(ValueError, match="advantages must be"):
        losses.clipped_policy_loss(LOGP, OLD, ADV[:3], MASK)
    with pytest.raises(ValueError, match="dual_clip"):
        losses.clipped_policy_loss(LOGP, OLD, ADV, MASK, losses.ClipConfig(dual_clip=0.5))
    with pytest.raises(ValueError, match="normalization"):
        losses.clipped_policy_loss(LOGP, OLD, ADV, MASK, losses.ClipConfig(normalization="batch"))
    with pytest.raises(ValueError, match="off_policy must be"):
        losses.luffy_loss(LOGP, OLD, ADV, MASK, OFF[:3])


# ---------------------------------------------------------------- LUFFY

def test_luffy_value_gradient_and_shaping():
    (loss, m), grad = jax.value_and_grad(lambda l: losses.luffy_loss(l, OLD, ADV, MASK, OFF, gamma=0.1),
                                         has_aux=True)(LOGP)
    np.testing.assert_allclose(loss, ref_luffy(LOGP), rtol=1e-5)
    np.testing.assert_allclose(grad, fd_grad(ref_luffy, LOGP), atol=2e-6)
    # off-policy token gradient in closed form: d/dlogp [−(p/(p+γ))·A] = −A·γp/(p+γ)², /Z
    p = np.exp(LOGP[0, 0].astype(np.float64))
    assert float(grad[0, 0]) == pytest.approx(-ADV[0] * 0.1 * p / (p + 0.1) ** 2 / MASK.sum(), rel=1e-4)
    assert float(m["off_policy_tokens"]) == MASK[OFF].sum()
    assert float(m["off_policy_prob"]) == pytest.approx(np.exp(LOGP.astype(np.float64))[OFF][MASK[OFF] > 0].mean(), rel=1e-5)


def test_luffy_off_policy_branch_is_not_clipped_and_ignores_old_logp():
    """A huge π_θ/π_old on an off-policy row would be clipped on-policy; off-policy it is not even looked at."""
    old = OLD.copy()
    old[OFF] = -50.0
    a = losses.luffy_loss(LOGP, old, ADV, MASK, OFF)[0]
    b = losses.luffy_loss(LOGP, OLD, ADV, MASK, OFF)[0]
    assert float(a) == pytest.approx(float(b), rel=1e-6)
    g = jax.grad(lambda l: losses.luffy_loss(l, old, ADV, MASK, OFF)[0])(LOGP)
    assert np.all(np.asarray(g)[OFF][MASK[OFF] > 0] != 0)


def test_luffy_all_on_policy_equals_clipped():
    none = np.zeros(B, bool)
    assert float(losses.luffy_loss(LOGP, OLD, ADV, MASK, none)[0]) == pytest.approx(
        float(losses.clipped_policy_loss(LOGP, OLD, ADV, MASK)[0]), rel=1e-6)


# ---------------------------------------------------------------- SFT, DPO, KTO, failure-step

def test_sft_value_and_gradient():
    ref = lambda l: -sum(l[i, j] for i, j in np.ndindex(l.shape) if MASK[i, j]) / MASK.sum()  # noqa: E731
    (loss, m), grad = jax.value_and_grad(losses.sft_loss, has_aux=True)(LOGP, MASK)
    assert float(loss) == pytest.approx(ref(LOGP), rel=1e-6) and float(m["nll"]) == float(loss)
    np.testing.assert_allclose(grad, fd_grad(ref, LOGP), atol=1e-6)
    per_seq = losses.sft_loss(LOGP, MASK, normalization="sequence")[0]
    assert float(per_seq) == pytest.approx(ref_aggregate(-LOGP.astype(np.float64), MASK, "sequence"), rel=1e-5)


def _ref_dpo(cw, cl, rw, rl, beta):
    m = beta * ((cw - rw) - (cl - rl))
    return float(np.mean(np.log1p(np.exp(-m))))


def test_dpo_value_gradient_and_step_level_sum():
    seq = np.asarray(losses.sequence_logp(LOGP, MASK), np.float64)
    np.testing.assert_allclose(seq, [sum(LOGP[i, j] for j in range(S) if MASK[i, j]) for i in range(B)], rtol=1e-5)
    cw, cl = seq[:4], seq[4:]
    rw, rl = cw - RS.uniform(0, 2, 4), cl + RS.uniform(-1, 1, 4)
    (loss, m), grads = jax.value_and_grad(lambda a, b: losses.dpo_loss(a, b, rw, rl, beta=0.1), argnums=(0, 1),
                                          has_aux=True)(cw.astype(np.float32), cl.astype(np.float32))
    assert float(loss) == pytest.approx(_ref_dpo(cw, cl, rw, rl, 0.1), rel=1e-5)
    np.testing.assert_allclose(grads[0], fd_grad(lambda x: _ref_dpo(x, cl, rw, rl, 0.1), cw), atol=1e-6)
    np.testing.assert_allclose(grads[1], fd_grad(lambda x: _ref_dpo(cw, x, rw, rl, 0.1), cl), atol=1e-6)
    margin = 0.1 * ((cw - rw) - (cl - rl))
    assert float(m["dpo_accuracy"]) == pytest.approx((margin > 0).mean())
    # EvoCUA Eq. 2 at step level: from per-token log-probs, every token of a step gets its step's gradient
    tok = jax.grad(lambda l: losses.dpo_loss(losses.sequence_logp(l[:4], MASK[:4]), losses.sequence_logp(l[4:], MASK[4:]),
                                             rw, rl, beta=0.1)[0])(LOGP)
    for i in range(4):
        np.testing.assert_allclose(np.asarray(tok)[i][MASK[i] > 0], float(grads[0][i]), rtol=1e-5)


def _ref_kto(pol, ref, des, z0, beta, wd, wu):
    r = pol - ref
    return float(np.mean(np.where(des, wd * (1 - sig(beta * (r - z0))), wu * (1 - sig(beta * (z0 - r))))))


def test_kto_reference_point_value_and_gradient():
    pol = RS.normal(-20, 3, 8)
    ref = pol + RS.normal(0, 0.5, 8)
    des = np.array([1, 0, 1, 1, 0, 0, 1, 0], bool)
    kl_pol, kl_ref = RS.normal(-30, 2, 8), RS.normal(-30.3, 2, 8)
    z0 = max(0.0, float(np.mean(kl_pol - kl_ref)))
    f = lambda p: losses.kto_loss(p, ref, des, beta=0.5, desirable_weight=1.0, undesirable_weight=1.33,  # noqa: E731
                                  kl_policy_logp=kl_pol, kl_ref_logp=kl_ref)
    (loss, m), grad = jax.value_and_grad(f, has_aux=True)(pol)
    assert float(m["kto_z0"]) == pytest.approx(z0, rel=1e-5, abs=1e-6)
    ref_fn = lambda p: _ref_kto(p, ref, des, z0, 0.5, 1.0, 1.33)  # noqa: E731
    assert float(loss) == pytest.approx(ref_fn(pol), rel=1e-5)
    np.testing.assert_allclose(grad, fd_grad(ref_fn, pol), atol=1e-6)
    # z0 is clamped at 0 and carries no gradient
    assert float(losses.kto_reference_point(np.full(3, -5.0), np.zeros(3))) == 0.0
    assert float(jax.grad(lambda a: losses.kto_reference_point(a, np.zeros(3)))(np.ones(3))[0]) == 0.0
    # fallback without mismatched pairs: batch mean of r, clamped
    _, m2 = losses.kto_loss(pol, ref, des, beta=0.5)
    assert float(m2["kto_z0"]) == pytest.approx(max(0.0, float(np.mean(pol - ref))), rel=1e-5, abs=1e-6)
    with pytest.raises(ValueError, match="mismatched pairs"):
        losses.kto_loss(pol, ref, des, kl_policy_logp=kl_pol)


def test_failure_step_loss_value_gradient_direction():
    seq = RS.normal(-10, 2, 6)
    ref = seq + RS.normal(0, 1, 6)
    ref_fn = lambda s: 0.2 * float(np.mean(np.log1p(np.exp(s - ref))))  # γ·(−log σ(−(s − ref)))  # noqa: E731
    (loss, _), grad = jax.value_and_grad(losses.failure_step_loss, has_aux=True)(seq, ref, 0.2)
    assert float(loss) == pytest.approx(ref_fn(seq), rel=1e-5)
    np.testing.assert_allclose(grad, fd_grad(ref_fn, seq), atol=1e-6)
    assert np.all(np.asarray(grad) > 0)  # descent lowers log π(a_F)
    valid = np.array([1, 1, 1, 0, 0, 1], bool)
    lv, _ = losses.failure_step_loss(seq, ref, 0.2, valid=valid)
    assert float(lv) == pytest.approx(0.2 * float(np.mean(np.log1p(np.exp(seq - ref))[valid])), rel=1e-5)


# ---------------------------------------------------------------- sharding

def test_sharded_equals_unsharded():
    """Inputs sharded on the batch axis over 8 CPU devices give the same values and gradients."""
    assert len(jax.devices()) >= 8, "tests/conftest.py should give 8 CPU devices"
    mesh = Mesh(np.array(jax.devices()[:8]), ("batch",))
    rs = np.random.RandomState(1)
    n = 16
    logp = np.log(rs.uniform(0.05, 1, (n, S))).astype(np.float32)
    old = (logp + rs.normal(0, 0.4, (n, S))).astype(np.float32)
    adv = rs.normal(0, 1, n).astype(np.float32)
    mask = (rs.uniform(size=(n, S)) > 0.3).astype(np.float32)
    off = rs.uniform(size=n) > 0.7
    put = lambda x: jax.device_put(x, NamedSharding(mesh, P("batch", *([None] * (x.ndim - 1)))))  # noqa: E731
    for cfg in (losses.ClipConfig(), losses.ClipConfig(normalization="sequence", dual_clip=3.0)):
        f = jax.jit(jax.value_and_grad(lambda l, o, a, m: losses.clipped_policy_loss(l, o, a, m, cfg)[0]))
        (v1, g1), (v0, g0) = f(put(logp), put(old), put(adv), put(mask)), f(logp, old, adv, mask)
        assert g1.sharding.spec[0] == "batch"  # the gradient stays sharded like its input
        assert float(v1) == pytest.approx(float(v0), rel=1e-6)
        np.testing.assert_allclose(g1, g0, rtol=1e-6, atol=1e-9)
    h = jax.jit(jax.value_and_grad(lambda l, o, a, m, x: losses.luffy_loss(l, o, a, m, x)[0]))
    (v1, g1), (v0, g0) = h(put(logp), put(old), put(adv), put(mask), put(off)), h(logp, old, adv, mask, off)
    assert float(v1) == pytest.approx(float(v0), rel=1e-6)
    np.testing.assert_allclose(g1, g0, rtol=1e-6, atol=1e-9)
