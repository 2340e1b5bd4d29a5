"""Group advantages (BEPA Eq. 4) and STEP0 (EvoCUA Eq. 4) against loop-by-loop numpy references."""
from __future__ import annotations

import math

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from guijax import advantages as adv_lib
from guijax import losses


def ref_group_advantages(rewards, group_ids, valid, eps):
    out = np.zeros(len(rewards))
    for g in set(group_ids.tolist()):
        members = [i for i in range(len(rewards)) if group_ids[i] == g and valid[i]]
        r = np.array([float(rewards[i]) for i in members])
        mu = r.mean() if len(r) else 0.0
        sd = math.sqrt(sum((x - mu) ** 2 for x in r) / max(len(r), 1))  # population std
        for i in members:
            out[i] = (float(rewards[i]) - mu) / (sd + eps)
    return out


@pytest.mark.parametrize("n", [2, 4, 8, 16])
def test_one_success_among_n_gives_bepa_appendix_b_values(n):
    rewards = np.zeros(n, np.float32)
    rewards[3 % n] = 1.0
    stats = adv_lib.group_advantages(rewards, np.zeros(n, np.int32), 1, eps=0.0)
    adv = np.asarray(stats.advantages)
    assert adv[3 % n] == pytest.approx(math.sqrt(n - 1), rel=1e-5)
    np.testing.assert_allclose(np.delete(adv, 3 % n), -1 / math.sqrt(n - 1), rtol=1e-5)
    assert float(adv.sum()) == pytest.approx(0.0, abs=1e-5)
    dense = adv_lib.group_advantages_dense(rewards[None], eps=0.0)
    np.testing.assert_allclose(dense.advantages[0], adv, rtol=1e-6)


def test_groups_of_different_sizes_zero_variance_and_dropped():
    rs = np.random.RandomState(0)
    rewards = np.array([1, 0, 1, 0, 1, 1, 1, 1, 0, 1, 0, 0, 0.3, 0.7], np.float32)
    groups = np.array([0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3], np.int32)
    rs.shuffle(perm := np.arange(len(rewards)))
    rewards, groups = rewards[perm], groups[perm]
    valid = np.ones(len(rewards), bool)
    valid[np.where((groups == 2) & (rewards == 0))[0][0]] = False  # an errored episode dropped from group 2
    stats = jax.jit(lambda r, g, v: adv_lib.group_advantages(r, g, 5, valid=v))(rewards, groups, valid)
    np.testing.assert_allclose(stats.advantages, ref_group_advantages(rewards, groups, valid, 1e-6), rtol=1e-5, atol=1e-6)
    assert int(stats.zero_variance_groups) == 1  # group 1 (all success); group 4 is empty and not counted
    assert np.all(np.asarray(stats.advantages)[groups == 1] == 0)
    assert float(np.asarray(stats.advantages)[~valid][0]) == 0.0
    np.testing.assert_allclose(stats.group_mean[:4], [0.5, 1.0, 1 / 3, 0.5], rtol=1e-5)


def test_dense_layout_matches_ids_layout():
    rs = np.random.RandomState(1)
    rewards = (rs.uniform(size=(5, 8)) > 0.6).astype(np.float32)
    rewards[2] = 0.0
    valid = rs.uniform(size=(5, 8)) > 0.15
    dense = jax.jit(adv_lib.group_advantages_dense)(rewards, 1e-6, valid)
    ids = adv_lib.group_advantages(rewards.ravel(), np.repeat(np.arange(5), 8), 5, valid=valid.ravel())
    np.testing.assert_allclose(np.asarray(dense.advantages).ravel(), ids.advantages, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(dense.group_std, ids.group_std, rtol=1e-6)
    assert int(dense.zero_variance_groups) == int(ids.zero_variance_groups) >= 1


def test_bad_group_ids_are_reported():
    with pytest.raises(ValueError, match=r"group_ids must lie in \[0, 2\)"):
        adv_lib.group_advantages(np.zeros(4), np.array([0, 1, 2, 0]), 2)
    with pytest.raises(ValueError, match="group_advantages_dense"):
        adv_lib.group_advantages(np.zeros((2, 4)), np.zeros(8, np.int32), 2)
    with pytest.raises(ValueError, match="valid has shape"):
        adv_lib.group_advantages_dense(np.zeros((2, 4)), valid=np.ones((2, 3), bool))


def test_step0_divides_trajectory_advantage_over_its_steps():
    np.testing.assert_allclose(adv_lib.step0_step_advantages(np.array([2.0, -1.0, 0.5]), np.array([4, 1, 0])),
                               [0.5, -1.0, 0.5])
    traj_adv = np.array([math.sqrt(3), -1 / math.sqrt(3), -1 / math.sqrt(3), -1 / math.sqrt(3)], np.float32)
    rows = np.array([0, 0, 1, 2, 2, 2, 3, 3, 3, 3, 3, 0], np.int32)  # trajectory 0 has 3 steps, 1 has 1, ...
    row_valid = np.ones(len(rows), bool)
    row_valid[-1] = False  # a padded row
    out = np.asarray(jax.jit(adv_lib.step0_row_advantages)(traj_adv, rows, row_valid))
    steps = {0: 2, 1: 1, 2: 3, 3: 5}
    expected = [traj_adv[t] / steps[t] if v else 0.0 for t, v in zip(rows, row_valid)]
    np.testing.assert_allclose(out, expected, rtol=1e-6)


def test_step0_objective_normalisation():
    """EvoCUA Eq. 5: (1/G) Σ_i Σ_t (1/K_t) Σ_k — 'sequence' aggregation over step rows with normalizer G."""
    rs = np.random.RandomState(2)
    rows = np.array([0, 0, 1, 2, 2, 2], np.int32)
    per_token = rs.normal(size=(6, 5)).astype(np.float32)
    mask = (rs.uniform(size=(6, 5)) > 0.3).astype(np.float32)
    mask[:, 0] = 1
    got = losses.aggregate(per_token, mask, "sequence", normalizer=3.0)
    want = sum(per_token[k][mask[k] > 0].mean() for k in range(6)) / 3
    assert float(got) == pytest.approx(want, rel=1e-5)


def test_sharded_rewards_equal_unsharded():
    mesh = Mesh(np.array(jax.devices()[:8]), ("batch",))
    rs = np.random.RandomState(3)
    rewards = (rs.uniform(size=16) > 0.5).astype(np.float32)
    groups = np.repeat(np.arange(4), 4).astype(np.int32)
    put = lambda x: jax.device_put(x, NamedSharding(mesh, P("batch")))  # noqa: E731
    f = jax.jit(lambda r, g: adv_lib.group_advantages(r, g, 4).advantages)
    np.testing.assert_allclose(f(put(rewards), put(groups)), f(rewards, groups), rtol=1e-6)
    dense = jax.jit(lambda r: adv_lib.group_advantages_dense(r).advantages)
    put2 = lambda x: jax.device_put(x, NamedSharding(mesh, P(None, "batch")))  # noqa: E731
    r2 = rs.uniform(size=(3, 8)).astype(np.float32)
    np.testing.assert_allclose(dense(put2(r2)), dense(r2), rtol=1e-6)
