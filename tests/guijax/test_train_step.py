"""Jitted SFT / GRPO / LUFFY steps on the tiny model: kernel log-probs equal the logits path, SFT overfits a
batch, GRPO at ratio 1 has the expected value, non-finite batches are skipped, sharded equals unsharded."""
from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from guijax import objectives, optim, sharding, train_step
from guijax.models import policy as policy_lib, weights
from guijax.models.config import PRESETS

CFG = PRESETS["tiny"]


def _batch(seed=0, b=4, s=24):
    rs = np.random.RandomState(seed)
    ids = rs.randint(0, 900, (b, s)).astype(np.int32)
    mask = np.ones((b, s), np.int32)
    mask[1, -5:] = 0
    inputs = policy_lib.prepare_inputs(CFG, ids, mask)
    loss_mask = np.zeros((b, s), np.float32)
    loss_mask[:, 10:-6] = 1.0
    return {"input_ids": inputs.input_ids, "positions": inputs.positions, "attention_mask": inputs.attention_mask,
            "vision": None, "targets": np.roll(ids, -1, axis=1), "loss_mask": loss_mask,
            "advantages": rs.normal(size=b).astype(np.float32), "off_policy": np.array([1, 0, 0, 0], bool)}


def _opt(lr=1e-2):
    return optim.make_optimizer(ml_collections.ConfigDict(dict(
        learning_rate=lr, warmup_steps=0, total_steps=100, schedule="constant", weight_decay=0.0, b1=0.9, b2=0.95,
        eps=1e-8, max_grad_norm=1.0, grad_accum_steps=1, state_dtype="float32")))[0]


@pytest.fixture(scope="module")
def module_params():
    module = weights.build_module(CFG)
    return module, weights.init_params(module, jax.random.PRNGKey(0))


def test_kernel_logprobs_equal_logits_path(module_params):
    module, params = module_params
    batch = _batch()
    logp, entropy = train_step.make_logprob_fn(module)(params, batch)
    logits, _ = module.apply({"params": params}, batch["input_ids"], batch["positions"], batch["attention_mask"])
    ref = jax.nn.log_softmax(logits, -1)
    ref_logp = np.take_along_axis(np.asarray(ref), batch["targets"][..., None], -1)[..., 0] * batch["loss_mask"]
    np.testing.assert_allclose(logp, ref_logp, atol=1e-5)
    ref_ent = -(np.exp(ref) * ref).sum(-1) * batch["loss_mask"]
    np.testing.assert_allclose(entropy, ref_ent, atol=1e-4)
    hot, _ = train_step.make_logprob_fn(module, temperature=0.5)(params, batch)
    ref_hot = np.take_along_axis(np.asarray(jax.nn.log_softmax(logits / 0.5, -1)), batch["targets"][..., None], -1)[..., 0]
    np.testing.assert_allclose(hot, ref_hot * batch["loss_mask"], atol=1e-4)


def test_sft_steps_reduce_loss(module_params):
    module, params = module_params
    tx = _opt()
    step = train_step.make_train_step(module, tx, train_step.StepConfig(objectives.CrossEntropyLoss()))
    state = train_step.TrainState(jax.tree.map(jnp.copy, params), tx.init(params), jnp.int32(0))
    batch = _batch()
    losses = []
    for _ in range(8):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    assert losses[-1] < 0.7 * losses[0] and int(state.step) == 8


def test_grpo_step_at_ratio_one(module_params):
    module, params = module_params
    batch = _batch(1)
    old, _ = train_step.make_logprob_fn(module)(params, batch)
    batch["old_logp"] = np.asarray(old)
    loss, metrics = train_step.loss_fn(params, batch, module, train_step.StepConfig(objectives.ClippedPolicyLoss()))
    m = batch["loss_mask"]
    expected = -(batch["advantages"][:, None] * m).sum() / m.sum()
    assert float(loss) == pytest.approx(expected, rel=1e-5)
    assert float(metrics["clip_frac_low"]) == 0.0 and float(metrics["approx_kl"]) == pytest.approx(0.0, abs=1e-10)
    luffy, lm = train_step.loss_fn(params, batch, module, train_step.StepConfig(objectives.LuffyLoss()))
    assert np.isfinite(float(luffy)) and float(lm["off_policy_tokens"]) == m[0].sum()


def test_the_initial_state_compiles_the_step_once(module_params):
    """Parameters as a checkpoint loader returns them (host arrays): the step's second call reuses the first
    call's program instead of compiling again for its now device-committed state."""
    module, params = module_params
    tx = _opt()
    step = train_step.make_train_step(module, tx, train_step.StepConfig(objectives.CrossEntropyLoss()))
    state = train_step.init_state(module, jax.tree.map(np.asarray, params), tx)
    for _ in range(3):
        state, _ = step(state, _batch())
    assert step.fn._cache_size() == 1


def test_non_finite_batch_is_skipped(module_params):
    module, params = module_params
    tx = _opt()
    step = train_step.make_train_step(module, tx, train_step.StepConfig(objectives.ClippedPolicyLoss()))
    state = train_step.TrainState(jax.tree.map(jnp.copy, params), tx.init(params), jnp.int32(0))
    batch = _batch(2)
    batch["old_logp"] = np.zeros_like(batch["loss_mask"])
    batch["advantages"] = np.array([np.nan, 0, 0, 0], np.float32)
    before = jax.tree.map(np.array, (state.params, state.opt_state))
    state, metrics = step(state, batch)
    assert int(metrics["skipped"]) == 1
    chex.assert_trees_all_equal((state.params, state.opt_state), before)  # every parameter and moment
    batch["advantages"] = np.array([1.0, 0, 0, 0], np.float32)
    state, metrics = step(state, batch)
    assert int(metrics["skipped"]) == 0
    assert not np.array_equal(state.params["norm"]["weight"], before[0]["norm"]["weight"])


def test_sharded_step_equals_single_device(module_params):
    module, params = module_params
    mesh = sharding.make_mesh(sharding.MeshConfig(data=1, fsdp=4, tensor=2))
    shardings = sharding.param_shardings(weights.abstract_params(module), mesh)
    tx = _opt()
    step = train_step.make_train_step(module, tx, train_step.StepConfig(objectives.CrossEntropyLoss()))
    batch = _batch(3)
    single, m1 = step(train_step.TrainState(jax.tree.map(jnp.copy, params), tx.init(params), jnp.int32(0)), batch)
    sharded_params = jax.device_put(jax.tree.map(jnp.copy, params), shardings)  # the step donates its state
    sharded, m2 = step(train_step.TrainState(sharded_params, tx.init(sharded_params), jnp.int32(0)), batch)
    assert float(m1["loss"]) == pytest.approx(float(m2["loss"]), rel=1e-5)
    np.testing.assert_allclose(sharded.params["layers"]["mlp"]["up_proj"]["kernel"],
                               single.params["layers"]["mlp"]["up_proj"]["kernel"], atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["full", "dots_saveable", "attention_saveable"])
def test_remat_policies_give_the_same_loss_and_gradients(module_params, policy):
    module, params = module_params
    remat = weights.build_module(CFG, remat_policy=policy)
    batch = _batch(4)
    cfg = train_step.StepConfig(objectives.CrossEntropyLoss())
    (l1, _), g1 = jax.value_and_grad(train_step.loss_fn, has_aux=True)(params, batch, module, cfg)
    (l2, _), g2 = jax.value_and_grad(train_step.loss_fn, has_aux=True)(params, batch, remat, cfg)
    assert float(l1) == pytest.approx(float(l2), rel=1e-6)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        np.testing.assert_allclose(a, b, atol=1e-6)
