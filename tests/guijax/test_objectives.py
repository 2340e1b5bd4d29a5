"""The objectives' wrappers against numpy: the decoupled (behaviour-corrected) policy loss of asynchronous runs."""
from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from guijax import losses, objectives


def _decoupled_reference(logp, old, behaviour, adv, mask, off_policy, cap, eps_low, eps_high, dual):
    """numpy: per token −w·min(r·A, clip(r)·A) (dual-clipped), w = min(π_old/π_behaviour, cap) on on-policy
    rows and 1 on injected ones, r = π_θ/π_old; token-normalised."""
    w = np.where(off_policy[:, None], 1.0, np.minimum(np.exp(old - behaviour), cap))
    r = np.exp(logp - old)
    a = adv[:, None] * np.ones_like(logp)
    per = -np.minimum(r * a, np.clip(r, 1 - eps_low, 1 + eps_high) * a)
    if dual:
        per = np.where(a < 0, np.minimum(per, -dual * a), per)
    per = w * per
    return float((per * mask).sum() / mask.sum()), w


@pytest.mark.parametrize("seed,dual", [(0, 0.0), (1, 3.0)])
def test_behaviour_corrected_loss_value_gradient_and_weights(seed, dual):
    rng = np.random.default_rng(seed)
    b, s = 4, 7
    logp = rng.normal(-1.5, 0.4, (b, s)).astype(np.float32)
    old = (logp + rng.normal(0, 0.2, (b, s))).astype(np.float32)
    behaviour = (old + rng.normal(0, 1.0, (b, s))).astype(np.float32)  # some weights far above the cap
    adv = rng.normal(0, 1, b).astype(np.float32)
    mask = (rng.random((b, s)) > 0.3).astype(np.float32)
    off_policy = np.array([False, True, False, False])
    cap = 2.0
    clip = losses.ClipConfig(dual_clip=dual)
    loss_fn = objectives.BehaviourCorrected(objectives.ClippedPolicyLoss(clip), cap)
    batch = {"old_logp": jnp.asarray(old), "behaviour_logprobs": jnp.asarray(behaviour), "loss_mask": jnp.asarray(mask),
             "advantages": jnp.asarray(adv[:, None] * mask), "off_policy": jnp.asarray(off_policy)}

    def value(lp):
        return loss_fn(lp, jnp.zeros_like(lp), batch)

    (loss, metrics), grad = jax.value_and_grad(value, has_aux=True)(jnp.asarray(logp))
    want, w = _decoupled_reference(logp, old, behaviour, adv, mask, off_policy, cap, clip.eps_low, clip.eps_high, dual)
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)
    # the gradient is the weighted one: the weight is a constant (π_behaviour and π_old are not trained)
    eps = 1e-3
    for i, j in [(0, 1), (2, 3), (1, 0)]:
        bumped = logp.copy()
        bumped[i, j] += eps
        num = (_decoupled_reference(bumped, old, behaviour, adv, mask, off_policy, cap, clip.eps_low, clip.eps_high,
                                    dual)[0] - want) / eps
        np.testing.assert_allclose(float(grad[i, j]), num, rtol=2e-2, atol=2e-4)
    on = mask * ~off_policy[:, None]
    np.testing.assert_allclose(float(metrics["behaviour_weight_mean"]), (w * on).sum() / on.sum(), rtol=1e-5)
    capped = (np.exp(old - behaviour) > cap) * on
    assert 0 < float(metrics["behaviour_weight_capped_frac"]) == pytest.approx(capped.sum() / on.sum())


def test_on_policy_rows_sampled_by_the_same_parameters_change_nothing():
    rng = np.random.default_rng(3)
    logp = jnp.asarray(rng.normal(-1, 0.3, (3, 5)), jnp.float32)
    old = logp + 0.1
    mask = jnp.ones((3, 5))
    batch = {"old_logp": old, "behaviour_logprobs": old, "loss_mask": mask, "advantages": jnp.asarray([1.0, -0.5, 2.0]),
             "off_policy": jnp.zeros(3, bool)}
    plain = objectives.ClippedPolicyLoss()
    loss, _ = objectives.BehaviourCorrected(plain, 5.0)(logp, jnp.zeros_like(logp), batch)
    want, _ = plain(logp, jnp.zeros_like(logp), batch)
    chex.assert_trees_all_close(loss, want, rtol=1e-6)


def test_a_wrapped_loss_still_asks_for_reference_log_probs():
    inner = objectives.WithCrossEntropy(objectives.ClippedPolicyLoss(losses.ClipConfig(kl_coef=0.1)), 0.5)
    assert objectives.Objective(objectives.BehaviourCorrected(inner)).reference_kl
    assert not objectives.Objective(objectives.BehaviourCorrected(objectives.ClippedPolicyLoss())).reference_kl


@pytest.mark.parametrize("form", ["log_ratio", "bounded"])
def test_adversarial_imitation_rows_leave_the_surrogate_and_push_a_f_down(form):
    """SEAgent's L_GRPO + γ·L_AI: the clipped surrogate sees only the non-failure rows; the failure row adds
    γ·L_AI of its summed log-ratio, whose gradient lowers log π_θ(a_F)."""
    rs = np.random.RandomState(0)
    b, s = 3, 5
    mask = jnp.asarray((rs.rand(b, s) > 0.2).astype(np.float32)).at[:, 0].set(1.0)
    logp = jnp.asarray(-rs.rand(b, s).astype(np.float32))
    batch = {"loss_mask": mask, "old_logp": logp - 0.05, "ref_logp": logp - 0.3,
             "advantages": jnp.asarray([1.0, -1.0, 0.0]), "failure": jnp.asarray([False, False, True])}
    inner = objectives.ClippedPolicyLoss(losses.ClipConfig(normalization="sequence"))
    loss_fn = objectives.WithAdversarialImitation(inner, gamma=0.2, form=form)
    loss, metrics = jax.jit(lambda lp, bt: loss_fn(lp, jnp.zeros_like(lp), bt))(logp, batch)
    grpo, _ = jax.jit(lambda lp, bt: inner(lp, jnp.zeros_like(lp), bt))(logp[:2], {k: v[:2] for k, v in batch.items()})
    row = jnp.sum(logp[2] * mask[2]) - jnp.sum(batch["ref_logp"][2] * mask[2])
    ai = 0.2 * row if form == "log_ratio" else 0.2 * -jax.nn.log_sigmoid(-row)
    chex.assert_trees_all_close((loss, metrics["ai_loss"], metrics["failure_rows"]), (grpo + ai, ai, 1.0), atol=1e-6)
    grad = jax.jit(jax.grad(lambda lp: loss_fn(lp, jnp.zeros_like(lp), batch)[0]))(logp)
    assert float(jnp.min(jnp.where(mask[2] > 0, grad[2], 1.0))) > 0  # descent lowers every a_F token's log-prob
    with pytest.raises(ValueError, match="needs the batch's ref_logp"):
        loss_fn(logp, logp, {k: v for k, v in batch.items() if k != "ref_logp"})
    with pytest.raises(ValueError, match="form must be one of"):
        objectives.WithAdversarialImitation(inner, form="printed")


def test_step0_rows_share_each_advantage_and_batches_split_the_trajectories():
    """EvoCUA Eq. 4-5 as the trainer lays them out: each step row carries Â_i/T_i; each batch divides by its
    share of the trajectories, so with a ratio of 1 the batches' losses sum to −ΣÂ_i/N whatever the lengths."""
    from guijax.data.pipeline import step_refs
    from guijax.rollout.trajectory import Trajectory

    trajectories = [Trajectory(f"t{i}", "", [None] * n) for i, n in enumerate((1, 3, 2))]
    advantages = {0: 1.5, 1: -0.6, 2: 0.4}
    loss = objectives.ClippedPolicyLoss(losses.ClipConfig(normalization="sequence"))
    step0 = objectives.Objective(loss, steps="step0")
    rows = step0.step_rows(step_refs(trajectories, advantages))
    chex.assert_trees_all_close([r.advantage for r in rows], [1.5, -0.2, -0.2, -0.2, 0.2, 0.2], rtol=1e-6)
    assert step0.trajectory_normalized and not objectives.Objective(loss).trajectory_normalized
    final = objectives.Objective(loss, steps="final").step_rows(step_refs(trajectories, advantages))
    assert [(r.trajectory, r.step, r.advantage) for r in final] == [(0, 0, 1.5), (1, 2, -0.6), (2, 1, 0.4)]
    # two batches of 4 and 2 rows (and an empty one) for 5 scored trajectories (2 of them with zero advantage)
    z = objectives.trajectory_normalizers([4, 2, 0], 5)
    chex.assert_trees_all_close(z, [5 * 4 / 6, 5 * 2 / 6, 1.0])
    batches = [rows[:4], rows[4:]]
    # at ratio 1 a row's per-token surrogate is −A: each batch's loss estimates Eq. 5 on its rows, and weighted
    # by its share of the rows they give −ΣÂ_i/N (a normaliser of N per batch would give −0.147, not −0.26)
    per_batch = [float(losses.aggregate(-jnp.asarray([[r.advantage] * 3 for r in b]), jnp.ones((len(b), 3)),
                                        "sequence", zb)) for b, zb in zip(batches, z)]
    assert sum(len(b) / 6 * lb for b, lb in zip(batches, per_batch)) == pytest.approx(-sum(advantages.values()) / 5)
    with pytest.raises(ValueError, match="steps must be one of"):
        objectives.Objective(loss, steps="every")


def test_behaviour_mismatch_sums_the_loss_tokens_of_sampled_rows_only():
    """|Δ log p| and the k3 KL estimate r − 1 − log r (r = π_old/π_behaviour) over on-policy loss tokens."""
    rng = np.random.default_rng(5)
    old = rng.normal(-1.2, 0.5, (3, 6)).astype(np.float32)
    behaviour = (old + rng.normal(0, 0.2, (3, 6))).astype(np.float32)
    mask = (rng.random((3, 6)) > 0.3).astype(np.float32)
    sampled = np.array([True, False, True])  # the middle row: injected, or text with no sampled ids
    got = objectives.behaviour_mismatch(jnp.asarray(old), jnp.asarray(behaviour), jnp.asarray(mask),
                                        jnp.asarray(sampled))
    on = mask * sampled[:, None]
    delta = old - behaviour
    np.testing.assert_allclose(float(got["tokens"]), on.sum())
    np.testing.assert_allclose(float(got["abs_sum"]), (np.abs(delta) * on).sum(), rtol=1e-5)
    np.testing.assert_allclose(float(got["kl_sum"]), ((np.exp(delta) - 1 - delta) * on).sum(), rtol=1e-5)
    assert float(got["kl_sum"]) > 0
    same = objectives.behaviour_mismatch(jnp.asarray(old), jnp.asarray(old), jnp.asarray(mask), jnp.asarray(sampled))
    assert float(same["abs_sum"]) == 0 and float(same["kl_sum"]) == 0


def test_rows_without_sampled_ids_keep_weight_one():
    """A text row (`expert`: no sampled ids, behaviour log-probs 0) is not weighted by π_old/0-log-prob."""
    logp = jnp.full((2, 3), -2.0)
    batch = {"old_logp": logp, "behaviour_logprobs": jnp.zeros((2, 3)), "loss_mask": jnp.ones((2, 3)),
             "advantages": jnp.asarray([1.0, 1.0]), "off_policy": jnp.zeros(2, bool), "expert": jnp.asarray([1.0, 0.0])}
    _, metrics = objectives.BehaviourCorrected(objectives.ClippedPolicyLoss(), 5.0)(logp, jnp.zeros_like(logp), batch)
    np.testing.assert_allclose(float(metrics["behaviour_weight_mean"]), np.exp(-2.0), rtol=1e-6)  # row 1 alone
    np.testing.assert_array_equal(np.asarray(objectives.sampled_rows(batch)), [False, True])
    assert not np.asarray(objectives.sampled_rows({"off_policy": jnp.asarray([True, False])}))[0]
