"""Losses against loop-by-loop numpy references (float64) on seeded random inputs: values, gradients (jax.grad
vs central finite differences of the reference), each jitted and not (chex.variants), metrics, padding
robustness, no retracing across same-shape calls (chex.assert_max_traces), and sharding on an 8-device mesh."""
from __future__ import annotations

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from guijax import losses

B, S = 8, 12
SEEDS = (0, 1, 2)
NORMS = ("token", "sequence")


def make_inputs(seed: int, b: int = B, s: int = S) -> dict[str, np.ndarray]:
    """Random per-token inputs. π_old is spread wide (σ 0.8 in log space) so that both clip sides occur, and
    row 0 (A < 0) starts with ratios over 3, which the dual clip caps; rows have different lengths, so token
    and sequence normalisation differ, and one row is empty (all padding)."""
    rs = np.random.RandomState(seed)
    logp = np.log(rs.uniform(0.05, 1.0, (b, s))).astype(np.float32)
    mask = (rs.uniform(size=(b, s)) > 0.25).astype(np.float32)
    mask[:, 0] = 1
    mask[b // 2 + 1] = 0
    old = logp + rs.normal(0, 0.8, (b, s))
    adv = rs.normal(0, 1, b)
    adv[0], adv[1] = -abs(adv[0]) - 0.1, abs(adv[1]) + 0.1
    old[0, :3] = logp[0, :3] - rs.uniform(1.3, 3.0, 3)  # ratio e^1.3..e^3 > 3 with A < 0: dual-clipped
    return {"logp": logp, "old": old.astype(np.float32),
            "ref": (logp + rs.normal(0, 0.5, (b, s))).astype(np.float32),
            "adv": adv.astype(np.float32),
            "adv_token": rs.normal(0, 1, (b, s)).astype(np.float32),
            "mask": mask,
            "ent": rs.uniform(0.1, 3.0, (b, s)).astype(np.float32),
            "off": np.arange(b) % 3 == 0}


X0 = make_inputs(0)
LOGP, OLD, REF, ADV, MASK, ENT, OFF = (X0[k] for k in ("logp", "old", "ref", "adv", "mask", "ent", "off"))
RS = np.random.RandomState(100)


# ---------------------------------------------------------------- numpy references (element loops, float64)

def ref_surrogate(logp, old, adv, eps_low=0.2, eps_high=0.3, dual=0.0):
    """−objective per token, written piecewise: A ≥ 0 → min(r, 1+ε_h)·A; A < 0 → max(r, 1−ε_l)·A,
    dual: max(·, c·A). adv: [b] per trajectory or [b, s] per token."""
    adv = np.asarray(adv, np.float64)
    out = np.zeros(logp.shape)
    for i, j in np.ndindex(logp.shape):
        r = math.exp(float(logp[i, j]) - float(old[i, j]))
        a = float(adv[i] if adv.ndim == 1 else adv[i, j])
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


def ref_weights(mask, norm="token"):
    """d aggregate / d per-token loss: 1/Z on every response token (token), 1/(|τ_i|·#rows) (sequence)."""
    mask = np.asarray(mask, np.float64)
    if norm == "token":
        return mask / mask.sum()
    lengths = mask.sum(1, keepdims=True)
    return np.where(lengths > 0, mask / np.maximum(lengths, 1), 0.0) / (lengths > 0).sum()


def ref_k3(logp, ref):
    d = np.asarray(ref, np.float64) - logp
    return np.exp(d) - d - 1


def ref_clipped(logp, x=X0, norm="token", dual=0.0, kl=0.0, adv=None):
    per = ref_surrogate(logp, x["old"], x["adv"] if adv is None else adv, dual=dual)
    if kl:
        per = per + kl * ref_k3(logp, x["ref"])
    return ref_aggregate(per, x["mask"], norm)


def ref_luffy(logp, x=X0, gamma=0.1, shaped=True):
    per = ref_surrogate(logp, x["old"], x["adv"])
    for i, j in np.ndindex(logp.shape):
        if x["off"][i]:
            p = math.exp(float(logp[i, j]))
            per[i, j] = -(p / (p + gamma) if shaped else p) * float(x["adv"][i])
    return ref_aggregate(per, x["mask"])


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


def ref_dpo(cw, cl, rw, rl, beta):
    m = beta * ((cw - rw) - (cl - rl))
    return float(np.mean(np.log1p(np.exp(-m))))


def ref_kto(pol, ref, des, z0, beta, wd, wu):
    r = pol - ref
    return float(np.mean(np.where(des, wd * (1 - sig(beta * (r - z0))), wu * (1 - sig(beta * (z0 - r))))))


def check_boundary(loss, grads, metrics, grad_shapes):
    """What every loss hands back: a float32 scalar, gradients shaped like their inputs, scalar metrics."""
    chex.assert_shape(loss, ())
    chex.assert_type(loss, jnp.float32)
    chex.assert_shape(grads, grad_shapes)
    chex.assert_type(grads, jnp.float32)
    chex.assert_rank(list(metrics.values()), 0)


# ---------------------------------------------------------------- every loss against its reference, jitted and not

class LossesAgainstReferencesTest(chex.TestCase):
    """Values and gradients against the float64 references on random inputs; `self.variant` runs each check
    once under jax.jit and once without, so the two must agree (with each other, through the reference)."""

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.product(seed=SEEDS, norm=NORMS, dual=(0.0, 3.0))
    def test_clipped_value_and_gradient(self, seed, norm, dual):
        x = make_inputs(seed)
        cfg = losses.ClipConfig(dual_clip=dual, normalization=norm)
        f = self.variant(jax.value_and_grad(lambda l: losses.clipped_policy_loss(l, x["old"], x["adv"], x["mask"], cfg),
                                            has_aux=True))
        (loss, m), grad = f(x["logp"])
        check_boundary(loss, grad, m, (B, S))
        ref = lambda l: ref_clipped(l, x, norm=norm, dual=dual)  # noqa: E731
        np.testing.assert_allclose(loss, ref(x["logp"]), rtol=1e-5)
        np.testing.assert_allclose(grad, fd_grad(ref, x["logp"]), rtol=1e-4, atol=1e-6)
        assert not np.asarray(grad)[x["mask"] == 0].any()
        # the inputs can tell the two normalisations apart, and exercise the dual clip when it is on
        other = "sequence" if norm == "token" else "token"
        assert abs(ref_clipped(x["logp"], x, norm=other, dual=dual) - float(loss)) > 1e-3
        if dual:
            assert float(m["dual_clip_frac"]) > 0
            assert abs(ref_clipped(x["logp"], x, norm=norm) - float(loss)) > 1e-3

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.product(seed=SEEDS, norm=NORMS)
    def test_per_token_advantages(self, seed, norm):
        """[b, s] advantages (EvoCUA STEP0 Eq. 4) are used token by token, not broadcast from a row."""
        x = make_inputs(seed)
        cfg = losses.ClipConfig(dual_clip=3.0, normalization=norm)
        f = self.variant(jax.value_and_grad(
            lambda l: losses.clipped_policy_loss(l, x["old"], x["adv_token"], x["mask"], cfg)[0]))
        loss, grad = f(x["logp"])
        ref = lambda l: ref_clipped(l, x, norm=norm, dual=3.0, adv=x["adv_token"])  # noqa: E731
        np.testing.assert_allclose(loss, ref(x["logp"]), rtol=1e-5)
        np.testing.assert_allclose(grad, fd_grad(ref, x["logp"]), rtol=1e-4, atol=1e-6)

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.product(seed=SEEDS, norm=NORMS)
    def test_k3_kl_term_changes_loss_and_gradient(self, seed, norm):
        """kl_coef β > 0 adds β·k3(logp, ref_logp) per token: the loss moves by β·aggregate(k3) and each token's
        gradient by β·(1 − e^(ref − logp)) times its normalisation weight; β = 0 only measures it."""
        x, beta = make_inputs(seed), 0.1
        logp, mask = x["logp"], x["mask"]

        def run(cfg):
            f = lambda l: losses.clipped_policy_loss(l, x["old"], x["adv"], mask, cfg, ref_logp=x["ref"],  # noqa: E731
                                                     entropy=x["ent"])
            return self.variant(jax.value_and_grad(f, has_aux=True))(logp)

        (loss, m), grad = run(losses.ClipConfig(kl_coef=beta, normalization=norm))
        (loss0, m0), grad0 = run(losses.ClipConfig(normalization=norm))
        check_boundary(loss, grad, m, (B, S))
        ref = lambda l: ref_clipped(l, x, norm=norm, kl=beta)  # noqa: E731
        np.testing.assert_allclose(loss, ref(logp), rtol=1e-5)
        np.testing.assert_allclose(grad, fd_grad(ref, logp), rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(loss0, ref_clipped(logp, x, norm=norm), rtol=1e-5)
        k3 = ref_k3(logp, x["ref"])
        kl_part = beta * ref_aggregate(k3, mask, norm)
        assert kl_part > 1e-3
        np.testing.assert_allclose(float(loss) - float(loss0), kl_part, rtol=1e-3)
        kl_grad = beta * (1 - np.exp(x["ref"].astype(np.float64) - logp)) * ref_weights(mask, norm)
        np.testing.assert_allclose(np.asarray(grad) - np.asarray(grad0), kl_grad, rtol=1e-3, atol=1e-7)
        on = mask > 0
        for metrics in (m, m0):
            np.testing.assert_allclose(metrics["ref_kl"], k3[on].mean(), rtol=1e-5)
            np.testing.assert_allclose(metrics["entropy"], x["ent"][on].astype(np.float64).mean(), rtol=1e-6)

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.product(seed=SEEDS, gamma=(0.1, 0.5))
    def test_luffy_value_gradient_and_shaping(self, seed, gamma):
        x = make_inputs(seed)
        f = self.variant(jax.value_and_grad(
            lambda l: losses.luffy_loss(l, x["old"], x["adv"], x["mask"], x["off"], gamma=gamma), has_aux=True))
        (loss, m), grad = f(x["logp"])
        check_boundary(loss, grad, m, (B, S))
        ref = lambda l: ref_luffy(l, x, gamma)  # noqa: E731
        np.testing.assert_allclose(loss, ref(x["logp"]), rtol=1e-5)
        np.testing.assert_allclose(grad, fd_grad(ref, x["logp"]), rtol=1e-4, atol=1e-6)
        # off-policy tokens in closed form: d/dlogp [−(p/(p+γ))·A] = −A·γp/(p+γ)², over Z
        off = x["off"][:, None] & (x["mask"] > 0)
        p = np.exp(x["logp"].astype(np.float64))
        closed = -x["adv"][:, None] * gamma * p / (p + gamma) ** 2 / x["mask"].sum()
        np.testing.assert_allclose(np.asarray(grad)[off], np.broadcast_to(closed, p.shape)[off], rtol=1e-4)
        assert abs(ref_luffy(x["logp"], x, gamma, shaped=False) - float(loss)) > 1e-3  # shaping matters here
        assert float(m["off_policy_tokens"]) == off.sum()
        np.testing.assert_allclose(m["off_policy_prob"], p[off].mean(), rtol=1e-5)
        np.testing.assert_allclose(m["off_policy_shaped_weight"], (p / (p + gamma))[off].mean(), rtol=1e-5)

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.product(seed=SEEDS, norm=NORMS)
    def test_sft_value_and_gradient(self, seed, norm):
        x = make_inputs(seed)
        f = self.variant(jax.value_and_grad(lambda l: losses.sft_loss(l, x["mask"], normalization=norm), has_aux=True))
        (loss, m), grad = f(x["logp"])
        check_boundary(loss, grad, m, (B, S))
        ref = lambda l: ref_aggregate(-np.asarray(l, np.float64), x["mask"], norm)  # noqa: E731
        np.testing.assert_allclose(loss, ref(x["logp"]), rtol=1e-5)
        np.testing.assert_allclose(m["nll"], loss)
        np.testing.assert_allclose(grad, fd_grad(ref, x["logp"]), rtol=1e-4, atol=1e-7)

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.product(seed=SEEDS, beta=(0.1, 0.5))
    def test_dpo_value_and_gradient(self, seed, beta):
        rs = np.random.RandomState(seed)
        cw, cl = rs.normal(-20, 3, 6), rs.normal(-22, 3, 6)
        rw, rl = cw - rs.uniform(-1, 2, 6), cl + rs.uniform(-1, 1, 6)
        f = self.variant(jax.value_and_grad(lambda a, b: losses.dpo_loss(a, b, rw, rl, beta=beta), argnums=(0, 1),
                                            has_aux=True))
        (loss, m), grads = f(cw.astype(np.float32), cl.astype(np.float32))
        check_boundary(loss, grads, m, [(6,), (6,)])
        np.testing.assert_allclose(loss, ref_dpo(cw, cl, rw, rl, beta), rtol=1e-5)
        np.testing.assert_allclose(grads[0], fd_grad(lambda v: ref_dpo(v, cl, rw, rl, beta), cw), atol=1e-6)
        np.testing.assert_allclose(grads[1], fd_grad(lambda v: ref_dpo(cw, v, rw, rl, beta), cl), atol=1e-6)
        margin = beta * ((cw - rw) - (cl - rl))
        np.testing.assert_allclose(m["dpo_margin"], margin.mean(), rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(m["dpo_accuracy"], (margin > 0).mean())

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.product(seed=SEEDS, z0_from=("pairs", "batch", "given"))
    def test_kto_value_and_gradient(self, seed, z0_from):
        """z0 from mismatched pairs (the paper), from the batch's mean r (fallback) or given; never differentiated."""
        rs = np.random.RandomState(seed)
        pol = rs.normal(-20, 3, 8)
        ref = pol - rs.uniform(0.0, 1.0, 8)  # r > 0: the batch fallback's z0 is not clamped to 0
        des = rs.uniform(size=8) < 0.5
        des[:2] = True, False
        kl_pol = rs.normal(-30, 2, 8)
        kl_ref = kl_pol - rs.uniform(0.0, 0.6, 8)
        kwargs = {"pairs": {"kl_policy_logp": kl_pol, "kl_ref_logp": kl_ref}, "batch": {},
                  "given": {"z0": np.float32(0.7)}}[z0_from]
        z0 = {"pairs": max(0.0, float(np.mean(kl_pol - kl_ref))), "batch": max(0.0, float(np.mean(pol - ref))),
              "given": float(np.float32(0.7))}[z0_from]
        f = self.variant(jax.value_and_grad(lambda p: losses.kto_loss(p, ref, des, beta=0.5, undesirable_weight=1.33,
                                                                      **kwargs), has_aux=True))
        (loss, m), grad = f(pol.astype(np.float32))
        check_boundary(loss, grad, m, (8,))
        assert z0 > 0.1  # a clamped z0 would hide a z0 that carries gradient
        np.testing.assert_allclose(m["kto_z0"], z0, rtol=1e-5, atol=1e-6)
        ref_fn = lambda p: ref_kto(p, ref, des, z0, 0.5, 1.0, 1.33)  # noqa: E731
        np.testing.assert_allclose(loss, ref_fn(pol), rtol=1e-5)
        np.testing.assert_allclose(grad, fd_grad(ref_fn, pol), atol=1e-6)

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.product(seed=SEEDS, masked=(False, True))
    def test_failure_step_value_and_gradient(self, seed, masked):
        rs = np.random.RandomState(seed)
        seq = rs.normal(-10, 2, 6)
        ref = seq + rs.normal(0, 1, 6)
        valid = np.array([1, 1, 1, 0, 0, 1], bool) if masked else np.ones(6, bool)
        # γ·(−log σ(−(s − ref))) averaged over the valid steps
        ref_fn = lambda s: 0.2 * float(np.mean(np.log1p(np.exp(s - ref))[valid]))  # noqa: E731
        f = self.variant(jax.value_and_grad(
            lambda s: losses.failure_step_loss(s, ref, 0.2, valid=valid if masked else None), has_aux=True))
        (loss, m), grad = f(seq.astype(np.float32))
        check_boundary(loss, grad, m, (6,))
        np.testing.assert_allclose(loss, ref_fn(seq), rtol=1e-5)
        np.testing.assert_allclose(grad, fd_grad(ref_fn, seq), atol=1e-6)
        assert np.all(np.asarray(grad)[valid] > 0) and not np.asarray(grad)[~valid].any()  # descent lowers log π(a_F)


def test_jitted_loss_does_not_retrace_for_same_shapes():
    """A train step calls the loss with new values, a new (equal) ClipConfig and a new global normaliser every
    minibatch: one trace serves them all; only a new shape traces again."""
    chex.clear_trace_counter()

    @chex.assert_max_traces(n=1)
    def step(logp, old, adv, mask, ref, normalizer, cfg):
        return jax.value_and_grad(lambda l: losses.clipped_policy_loss(l, old, adv, mask, cfg, ref_logp=ref,
                                                                       normalizer=normalizer)[0])(logp)

    jitted = jax.jit(step, static_argnums=6)
    for seed in SEEDS:
        x = make_inputs(seed)
        cfg = losses.ClipConfig(kl_coef=0.05, dual_clip=3.0)  # a fresh, equal config each call
        loss, _ = jitted(x["logp"], x["old"], x["adv"], x["mask"], x["ref"], np.float32(x["mask"].sum()), cfg)
        np.testing.assert_allclose(loss, ref_clipped(x["logp"], x, dual=3.0, kl=0.05), rtol=1e-5)
    small = make_inputs(0, b=4)
    with pytest.raises(AssertionError, match="retrac|trace"):
        jitted(small["logp"], small["old"], small["adv"], small["mask"], small["ref"], np.float32(1.0),
               losses.ClipConfig(kl_coef=0.05, dual_clip=3.0))


# ---------------------------------------------------------------- clipped surrogate: boundaries, metrics, robustness

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


@pytest.mark.parametrize("norm", NORMS)
def test_normalizer_for_accumulation(norm):
    """Micro-batches with the global denominator (token count / sequence count) sum to the full-batch loss."""
    z = MASK.sum() if norm == "token" else float((MASK.sum(1) > 0).sum())
    cfg = losses.ClipConfig(normalization=norm)
    halves = sum(float(losses.clipped_policy_loss(LOGP[s], OLD[s], ADV[s], MASK[s], cfg, normalizer=z)[0])
                 for s in (slice(0, 3), slice(3, 8)))
    assert halves == pytest.approx(float(losses.clipped_policy_loss(LOGP, OLD, ADV, MASK, cfg)[0]), rel=1e-5)


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


# ---------------------------------------------------------------- DPO at step level, KTO reference point

def test_dpo_from_token_logprobs_gives_every_token_its_steps_gradient():
    """EvoCUA Eq. 2 at step level: sequence_logp sums each row's response tokens, and every token of a step
    gets that step's gradient."""
    seq = np.asarray(losses.sequence_logp(LOGP, MASK), np.float64)
    np.testing.assert_allclose(seq, [sum(LOGP[i, j] for j in range(S) if MASK[i, j]) for i in range(B)], rtol=1e-5)
    cw, cl = seq[:4], seq[4:]
    rw, rl = cw - RS.uniform(0, 2, 4), cl + RS.uniform(-1, 1, 4)
    step_grad = jax.grad(lambda a: losses.dpo_loss(a, cl.astype(np.float32), rw, rl, beta=0.1)[0])(
        cw.astype(np.float32))
    tok = jax.grad(lambda l: losses.dpo_loss(losses.sequence_logp(l[:4], MASK[:4]), losses.sequence_logp(l[4:], MASK[4:]),
                                             rw, rl, beta=0.1)[0])(LOGP)
    for i in range(4):
        np.testing.assert_allclose(np.asarray(tok)[i][MASK[i] > 0], float(step_grad[i]), rtol=1e-5)
        assert not np.asarray(tok)[i][MASK[i] == 0].any()


def test_kto_reference_point_is_clamped_and_carries_no_gradient():
    assert float(losses.kto_reference_point(np.full(3, -5.0), np.zeros(3))) == 0.0
    assert float(losses.kto_reference_point(np.full(3, 2.0), np.zeros(3))) == 2.0
    assert float(jax.grad(lambda a: losses.kto_reference_point(a, np.zeros(3)))(np.ones(3))[0]) == 0.0
    with pytest.raises(ValueError, match="mismatched pairs"):
        losses.kto_loss(np.zeros(3), np.zeros(3), np.ones(3, bool), kl_policy_logp=np.zeros(3))


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
