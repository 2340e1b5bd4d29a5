"""Routed experts: the grouped (ragged_dot) path equals the dense reference in values and gradients, routing
and the load-balancing loss equal transformers', and the stored expert layouts both load."""
from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from guijax.models import moe, weights
from guijax.models.config import PRESETS
from guijax.models.layers import activation

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

CFG = PRESETS["tiny_qwen3_vl_moe"]


def _experts(seed: int = 0, tokens: int = 37, experts: int = 8, k: int = 3, hidden: int = 16, inter: int = 12):
    rs = np.random.RandomState(seed)
    x = jnp.asarray(rs.randn(tokens, hidden), jnp.float32)
    logits = jnp.asarray(rs.randn(tokens, experts) * 2, jnp.float32)
    gate_up = jnp.asarray(rs.randn(experts, hidden, 2 * inter) * 0.2, jnp.float32)
    down = jnp.asarray(rs.randn(experts, inter, hidden) * 0.2, jnp.float32)
    return x, logits, gate_up, down, k


def test_grouped_experts_equal_the_dense_reference_in_values_and_gradients():
    x, logits, gate_up, down, k = _experts()

    def run(fn):
        def loss(x, logits, gate_up, down):
            weights, experts, _ = moe.route(logits, k)
            out = fn(x, experts, weights, gate_up, down, activation("silu"))
            return jnp.sum(out * jnp.cos(jnp.arange(out.size).reshape(out.shape))), out
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(x, logits, gate_up, down)

    (_, out), grads = run(moe.grouped_experts)
    (_, ref), ref_grads = run(moe.dense_experts)
    assert float(jnp.abs(ref).max()) > 0.1
    chex.assert_trees_all_close(out, ref, atol=1e-5, rtol=1e-5)
    chex.assert_trees_all_close(grads, ref_grads, atol=1e-5, rtol=1e-5)
    assert all(float(jnp.abs(g).max()) > 0 for g in grads)  # the router's logits get gradient too


def test_routing_and_load_balancing_loss_equal_transformers():
    from transformers.models.qwen3_vl_moe import modeling_qwen3_vl_moe as hf

    _, logits, *_ = _experts(seed=1, tokens=20)
    k, experts = 3, logits.shape[1]
    weights, chosen, _ = moe.route(logits, k)
    probs = torch.softmax(torch.tensor(np.asarray(logits)), -1)
    top, idx = torch.topk(probs, k)
    np.testing.assert_array_equal(np.asarray(chosen), idx.numpy())
    np.testing.assert_allclose(np.asarray(weights), (top / top.sum(-1, keepdim=True)).numpy(), atol=1e-6)
    # two layers' router logits over 2 rows x 10 tokens, the last 3 tokens of row 1 padding
    layers = [logits, jnp.roll(logits, 5, axis=1)]
    mask = np.ones((2, 10), np.float32)
    mask[1, 7:] = 0
    stats = []
    for layer_logits in layers:
        _, chosen, probs = moe.route(layer_logits, k)
        flat = mask.reshape(-1)
        counts = np.zeros(experts, np.float32)
        np.add.at(counts, np.asarray(chosen).reshape(-1), np.repeat(flat, k))
        stats.append(np.stack([counts, (np.asarray(probs) * flat[:, None]).sum(0), np.full(experts, flat.sum())]))
    ours = moe.load_balancing_loss({"layers": {moe.ROUTER_STATS: (np.stack(stats),)}})
    ref = hf.load_balancing_loss_func(tuple(torch.tensor(np.asarray(x)) for x in layers), experts, k,
                                      torch.tensor(mask))
    np.testing.assert_allclose(float(ours), float(ref), rtol=1e-5)
    assert float(moe.load_balancing_loss({})) == 0.0


def test_the_model_sows_what_the_loss_reads():
    """Router statistics come out of the scanned layers, one set per layer, and padding is not counted."""
    module = weights.build_module(CFG)
    params = weights.init_params(module, jax.random.PRNGKey(0))
    ids = np.random.RandomState(0).randint(0, 900, (2, 9)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[1, 6:] = 0
    positions = np.broadcast_to(np.arange(9), (3, 2, 9)).astype(np.int32)
    _, state = jax.jit(lambda p: module.apply({"params": p}, ids, positions, mask, mutable=["intermediates"]))(params)
    (stats,) = jax.tree.leaves(state["intermediates"])
    assert stats.shape == (CFG.num_hidden_layers, 3, CFG.num_experts)
    np.testing.assert_allclose(np.asarray(stats[:, 0].sum(-1)), 15 * CFG.num_experts_per_tok)  # 15 real tokens
    loss = float(moe.load_balancing_loss(state["intermediates"]))
    k = CFG.num_experts_per_tok
    assert 0.5 * k <= loss <= k * CFG.num_experts  # k when perfectly balanced, k * E when one expert takes all


def _model_and_text_batch():
    """The tiny MoE model, its parameters, and a text batch of 2 rows x 12 tokens."""
    module = weights.build_module(CFG)
    params = weights.init_params(module, jax.random.PRNGKey(0))
    ids = np.random.RandomState(0).randint(0, 900, (2, 12)).astype(np.int32)
    batch = {"input_ids": ids, "positions": np.broadcast_to(np.arange(12), (3, 2, 12)).astype(np.int32),
             "attention_mask": np.ones_like(ids), "targets": np.roll(ids, -1, 1),
             "loss_mask": np.ones((2, 12), np.float32)}
    return module, params, batch


def test_the_loss_reports_and_weighs_the_router_loss():
    """The load-balancing loss is reported for an expert model and added to the loss with its weight."""
    from guijax import objectives, train_step

    module, params, batch = _model_and_text_batch()

    @jax.jit
    def loss(coef):
        return train_step.loss_fn(params, batch, module, train_step.StepConfig(objectives.CrossEntropyLoss(),
                                                                               router_aux_loss_coef=coef))

    (plain, m0), (weighted, m1) = loss(0.0), loss(0.5)
    assert float(m0["router_aux_loss"]) == pytest.approx(float(m1["router_aux_loss"])) and float(m0["router_aux_loss"]) > 0
    np.testing.assert_allclose(float(weighted), float(plain) + 0.5 * float(m0["router_aux_loss"]), rtol=1e-5)


def _expert_mesh():
    from guijax import sharding

    return sharding.make_mesh(sharding.MeshConfig(data=1, fsdp=2, tensor=1, expert=4))


def _routed_loss(fn, k: int, **kw):
    def loss(x, logits, gate_up, down):
        weights, experts, _ = moe.route(logits, k)
        out = fn(x, experts, weights, gate_up, down, activation("silu"), **kw)
        out = out[0] if isinstance(out, tuple) else out
        return jnp.sum(out * jnp.cos(jnp.arange(out.size).reshape(out.shape))), out
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))


def test_expert_parallel_equals_grouped_in_values_and_gradients():
    """Dropless all-to-all over 4 expert devices (tokens over 8, 37 of them: padded to divide) is exact."""
    from guijax import sharding

    x, logits, gate_up, down, k = _experts()
    (_, ref), ref_grads = _routed_loss(moe.grouped_experts, k)(x, logits, gate_up, down)
    mesh = _expert_mesh()
    with sharding.rules_context(mesh):
        run = _routed_loss(moe.expert_parallel_experts, k)
        (_, out), grads = run(x, logits, gate_up, down)
        hlo = run.lower(x, logits, gate_up, down).compile().as_text()
    assert "all-to-all" in hlo
    chex.assert_trees_all_close(out, ref, atol=1e-5, rtol=1e-5)
    chex.assert_trees_all_close(grads, ref_grads, atol=1e-5, rtol=1e-5)


def test_capacity_drops_the_pairs_past_each_destinations_room():
    """With a capacity factor each device keeps, per destination device, its first pairs in token order up to
    the room; the rest are dropped and counted. Reference: the grouped path with their weights zeroed."""
    from guijax import sharding

    x, logits, gate_up, down, k = _experts()
    weights, experts, _ = moe.route(logits, k)
    shards, per_device_experts = 8, 2  # tokens over data x fsdp x expert; 8 experts over 4 devices
    tokens = x.shape[0]
    rows = -(-tokens // shards)  # 37 tokens padded to 40: 5 per device
    room = moe.expert_capacity(rows * k, 4, 0.5)
    assert room == 2
    keep = np.zeros((tokens, k), bool)
    chosen = np.asarray(experts)
    for start in range(0, tokens, rows):
        used = np.zeros(4, int)
        for t in range(start, min(start + rows, tokens)):
            for c in range(k):
                dest = chosen[t, c] // per_device_experts
                keep[t, c] = used[dest] < room
                used[dest] += 1
    assert 0 < (~keep).sum() < keep.size
    ref = moe.grouped_experts(x, experts, weights * keep, gate_up, down, activation("silu"))
    with sharding.rules_context(_expert_mesh()):
        out, dropped = jax.jit(lambda *a: moe.expert_parallel_experts(*a, activation("silu"), capacity_factor=0.5))(
            x, experts, weights, gate_up, down)
    assert int(dropped) == int((~keep).sum())
    chex.assert_trees_all_close(out, ref, atol=1e-5, rtol=1e-5)


def test_expert_parallel_training_equals_single_device():
    """The tiny MoE model on an expert x fsdp mesh: experts stored split over the expert axis, the loss and every
    gradient equal to one device's, and no pair dropped (dropless)."""
    from guijax import objectives, sharding, train_step

    module, params, batch = _model_and_text_batch()
    step = train_step.StepConfig(objectives.CrossEntropyLoss(), router_aux_loss_coef=0.1)
    grads = jax.jit(jax.value_and_grad(lambda p: train_step.loss_fn(p, batch, module, step), has_aux=True))
    (loss, metrics), want = grads(params)
    mesh = _expert_mesh()
    placed = jax.device_put(params, sharding.param_shardings(weights.abstract_params(module), mesh))
    gate_up = placed["layers"]["mlp"]["experts"]["gate_up_proj"]
    assert gate_up.sharding.spec[:3] == (None, "expert", "fsdp")
    assert gate_up.addressable_shards[0].data.shape[1] == CFG.num_experts // 4
    with sharding.rules_context(mesh):
        (ep_loss, ep_metrics), got = grads(placed)
    assert "moe_dropped_fraction" not in metrics and float(ep_metrics["moe_dropped_fraction"]) == 0.0
    np.testing.assert_allclose(float(ep_loss), float(loss), rtol=1e-5)
    np.testing.assert_allclose(float(ep_metrics["router_aux_loss"]), float(metrics["router_aux_loss"]), rtol=1e-5)
    chex.assert_trees_all_close(got, want, atol=2e-5, rtol=1e-4)
