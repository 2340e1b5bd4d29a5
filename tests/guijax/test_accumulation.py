"""Gradient accumulation in groups: a group of micro-batches updates exactly as one batch holding all their
rows, a short last group is applied before the list ends, and groups never reach past their list."""
from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from guijax import accumulation, objectives, train_step
from guijax.models import policy as policy_lib, weights
from guijax.models.config import PRESETS

CFG = PRESETS["tiny"]
LR = 0.5  # plain SGD: an update is proportional to the gradient, so a wrong weighting shows (AdamW's first
# update is nearly the gradient's sign and would hide it)


def _batch(seed: int, rows: int, loss_tokens: int, s: int = 20) -> dict:
    rs = np.random.RandomState(seed)
    ids = rs.randint(0, 900, (rows, s)).astype(np.int32)
    mask = np.ones((rows, s), np.int32)
    inputs = policy_lib.prepare_inputs(CFG, ids, mask)
    loss_mask = np.zeros((rows, s), np.float32)
    loss_mask[:, 4:4 + loss_tokens] = 1.0
    return {"input_ids": np.asarray(inputs.input_ids), "positions": np.asarray(inputs.positions),
            "attention_mask": np.asarray(inputs.attention_mask), "vision": None,
            "targets": np.roll(ids, -1, axis=1), "loss_mask": loss_mask}


def _merged(*batches: dict) -> dict:
    """One batch holding every row of `batches`."""
    out = {"vision": None}
    for key in ("input_ids", "attention_mask", "targets", "loss_mask"):
        out[key] = np.concatenate([b[key] for b in batches], 0)
    out["positions"] = np.concatenate([b["positions"] for b in batches], 1)
    if "normalizer" in batches[0]:
        out["normalizer"] = np.float32(sum(float(b["normalizer"]) for b in batches))
    return out


@pytest.fixture(scope="module")
def module_params():
    module = weights.build_module(CFG)
    return module, weights.init_params(module, jax.random.PRNGKey(0))


def _fresh(params):
    """A copy the steps may donate: the module's parameters serve every test."""
    return jax.tree.map(jnp.copy, params)


def _steps(module, tx, normalization="token"):
    cfg = train_step.StepConfig(objectives.CrossEntropyLoss(normalization))
    return train_step.make_train_step(module, tx, cfg), train_step.make_empty_microstep(module, tx)


def _accumulated(module, params, batches, k, normalization="token"):
    step, empty = _steps(module, optax.MultiSteps(optax.sgd(LR), every_k_schedule=k), normalization)
    state = train_step.init_state(module, _fresh(params), optax.MultiSteps(optax.sgd(LR), every_k_schedule=k))
    ran = 0
    for batch, ends in accumulation.scaled_groups(batches, k, normalization):
        state, metrics = step(state, batch)
        assert int(metrics["skipped"]) == 0
        if ends:
            state, n = accumulation.flush(state, empty)
            ran += n
    assert train_step.pending_microsteps(state.opt_state) == 0
    assert train_step.applied_updates(state.opt_state) == -(-len(batches) // k)
    return state.params, ran


def _plain(module, params, batches, normalization="token"):
    tx = optax.sgd(LR)
    step = train_step.make_train_step(module, tx, train_step.StepConfig(objectives.CrossEntropyLoss(normalization)))
    state = train_step.init_state(module, _fresh(params), tx)
    for batch in batches:
        state, _ = step(state, batch)
    return state.params


@pytest.mark.parametrize("normalized", [False, True])
def test_a_group_updates_as_one_batch_of_its_rows(module_params, normalized):
    """Batches of 3, 12 and 7 loss tokens per row in groups of 2: (a, b) is one update, c alone (completed by
    an empty micro-step) another; the same as plain steps on merged(a, b) then c. With `normalizer`s (the
    per-trajectory shares) the merged batch's normalizer is their sum."""
    module, params = module_params
    a, b, c = _batch(0, 2, 3), _batch(1, 2, 12), _batch(2, 1, 7)
    if normalized:
        for batch, z in ((a, 1.5), (b, 4.0), (c, 0.5)):
            batch["normalizer"] = np.float32(z)
    got, ran = _accumulated(module, params, [a, b, c], k=2)
    assert ran == 1
    want = _plain(module, params, [_merged(a, b), c])
    chex.assert_trees_all_close(got, want, atol=2e-6, rtol=2e-5)


def test_per_sequence_losses_weigh_their_rows(module_params):
    """`sequence` normalisation (a mean over rows of each row's token mean): minibatches of 2 and 1 rows are
    weighted by their rows, and a group equals the merged minibatch."""
    module, params = module_params
    a, b = _batch(0, 2, 3), _batch(1, 1, 12)
    got, _ = _accumulated(module, params, [a, b], k=2, normalization="sequence")
    want = _plain(module, params, [_merged(a, b)], normalization="sequence")
    chex.assert_trees_all_close(got, want, atol=2e-6, rtol=2e-5)


def test_a_minibatch_without_loss_weighs_nothing(module_params):
    """A minibatch whose rows carry no loss token (normalizer 1, as the trajectory shares give it) leaves its
    group's update that of the others alone."""
    module, params = module_params
    a, empty = _batch(0, 2, 3), _batch(1, 2, 0)
    a["normalizer"], empty["normalizer"] = np.float32(4.0), np.float32(1.0)
    got, _ = _accumulated(module, params, [a, empty], k=2)
    chex.assert_trees_all_close(got, _plain(module, params, [a]), atol=2e-6, rtol=2e-5)


def test_the_mean_of_batch_means_is_not_the_group_update(module_params):
    """What the weighting corrects: optax.MultiSteps alone averages each batch's own token mean, which moves
    the parameters elsewhere than the merged batch does when the batches' token counts differ."""
    module, params = module_params
    a, b = _batch(0, 2, 3), _batch(1, 2, 12)
    tx = optax.MultiSteps(optax.sgd(LR), every_k_schedule=2)
    step = train_step.make_train_step(module, tx, train_step.StepConfig(objectives.CrossEntropyLoss()))
    state = train_step.init_state(module, _fresh(params), tx)
    for batch in (a, b):
        state, _ = step(state, batch)
    want = _plain(module, params, [_merged(a, b)])
    gap = max(float(np.max(np.abs(x - y))) for x, y in zip(jax.tree.leaves(state.params), jax.tree.leaves(want)))
    assert gap > 1e-4


def test_groups_stay_inside_the_list():
    """Five batches in groups of 2: scales k · w / Σ w per group, the short last group scaled on its own."""
    batches = [{"loss_mask": np.ones((1, n), np.float32)} for n in (10, 30, 5, 5, 8)]
    out = list(accumulation.scaled_groups(batches, 2))
    np.testing.assert_allclose([float(b["loss_scale"]) for b, _ in out], [0.5, 1.5, 1.0, 1.0, 2.0])
    assert [ends for _, ends in out] == [False, True, False, True, True]
    normalized = [dict(b, normalizer=np.float32(z)) for b, z in zip(batches[:2], (1.0, 3.0))]
    np.testing.assert_allclose([float(b["loss_scale"]) for b, _ in accumulation.scaled_groups(normalized, 2)],
                               [0.5, 1.5])
    plain = list(accumulation.scaled_groups(batches, 1))
    assert all(ends and "loss_scale" not in b for b, ends in plain)
    with pytest.raises(ValueError, match="k >= 1"):
        list(accumulation.scaled_groups(batches, 0))
    rows = [{"loss_mask": np.asarray([[1, 1, 0], [0, 0, 0], [1, 0, 0]], np.float32)},
            {"loss_mask": np.ones((1, 3), np.float32)}]  # 2 rows with loss (3 tokens), then 1 row (3 tokens)
    np.testing.assert_allclose([float(b["loss_scale"]) for b, _ in accumulation.scaled_groups(rows, 2, "sequence")],
                               [4 / 3, 2 / 3])


def test_on_a_mesh_the_group_update_equals_one_device(module_params):
    """The accumulated step and the empty micro-step jitted with the mesh's shardings (state in its shards,
    moments and accumulated gradients included) give the single-device parameters."""
    from guijax import sharding

    module, params = module_params
    mesh = sharding.make_mesh(sharding.MeshConfig(data=1, fsdp=4, tensor=2))
    tx = optax.MultiSteps(optax.sgd(LR), every_k_schedule=2)
    cfg = train_step.StepConfig(objectives.CrossEntropyLoss())
    step = train_step.make_train_step(module, tx, cfg, mesh)
    empty = train_step.make_empty_microstep(module, tx, mesh)
    state = train_step.init_state(module, _fresh(params), tx, mesh)
    batches = [_batch(0, 4, 3), _batch(1, 4, 12), _batch(2, 4, 7)]
    for batch, ends in accumulation.scaled_groups(batches, 2):
        state, _ = step(state, batch)
        if ends:
            state, _ = accumulation.flush(state, empty)
    kernel = state.params["layers"]["mlp"]["up_proj"]["kernel"]
    assert len(kernel.sharding.device_set) == 8
    single, _ = _accumulated(module, params, batches, k=2)
    chex.assert_trees_all_close(state.params, single, atol=2e-6, rtol=2e-5)
