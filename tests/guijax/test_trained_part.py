"""What a step trains: parameter groups held fixed by `model.frozen` keep their bits, get no optimiser moments,
leave the other parameters' update exactly as a full fine-tune's (without gradient clipping, whose norm
would include them), cost no backward pass (fewer compiled FLOPs), and are named when wrong."""
from __future__ import annotations

import chex
import flax.linen as nn
import jax
import ml_collections
import numpy as np
import pytest

from guijax import objectives, optim, train_step
from guijax.models import policy as policy_lib, weights
from guijax.models.config import PRESETS
from guijax.models.lora import LoraConfig
from guijax.models.trained import TrainedPart

CFG = PRESETS["tiny"]


def _batch(seed: int = 0) -> dict:
    """Two rows, each with one 4x4-patch screenshot (4 merged tokens) between text, the loss on the text."""
    rs = np.random.RandomState(seed)
    image = [CFG.vision_start_token_id] + [CFG.image_token_id] * 4 + [CFG.vision_end_token_id]
    ids = np.array([list(rs.randint(0, 900, 4)) + image + list(rs.randint(0, 900, 10)) for _ in range(2)], np.int32)
    grid = np.array([[1, 4, 4]] * 2)
    pixels = rs.randn(32, CFG.vision.patch_dim).astype(np.float32)
    inputs = policy_lib.prepare_inputs(CFG, ids, np.ones_like(ids), pixels, grid)
    mask = np.zeros(ids.shape, np.float32)
    mask[:, 10:] = 1
    return {"input_ids": inputs.input_ids, "positions": inputs.positions, "attention_mask": inputs.attention_mask,
            "vision": inputs.vision, "targets": np.roll(ids, -1, axis=1), "loss_mask": mask}


def _tx(max_grad_norm: float = 0.0):
    return optim.make_optimizer(ml_collections.ConfigDict(dict(
        learning_rate=1e-2, warmup_steps=0, total_steps=10, schedule="constant", weight_decay=0.01, b1=0.9,
        b2=0.95, eps=1e-8, max_grad_norm=max_grad_norm, grad_accum_steps=1, state_dtype="float32")))[0]


def _one_step(frozen: tuple[str, ...], params):
    module = weights.build_module(CFG, frozen=frozen)
    tx = _tx()
    state = train_step.init_state(module, jax.tree.map(np.array, params), tx)
    step = train_step.make_train_step(module, tx, train_step.StepConfig(objectives.CrossEntropyLoss()))
    compiled = step.compile(state, _batch())
    new, metrics = compiled(state, compiled.place(_batch()))
    return state, new, metrics, compiled.compiled.cost_analysis()["flops"]


def test_a_frozen_vision_tower_keeps_its_bits_and_costs_no_moments_or_backward():
    params = jax.tree.map(np.asarray, weights.init_params(weights.build_module(CFG), jax.random.PRNGKey(0)))
    full_state, full, full_metrics, full_flops = _one_step((), params)
    frozen_state, frozen, frozen_metrics, frozen_flops = _one_step(("visual",), params)
    # the optimiser holds moments of the decoder alone
    visual_leaves = len(jax.tree.leaves(params["visual"]))
    assert len(jax.tree.leaves(frozen_state.opt_state)) == len(jax.tree.leaves(full_state.opt_state)) - 2 * visual_leaves
    # same forward, so the same loss; the tower is untouched, the rest updated exactly as in the full fine-tune
    np.testing.assert_allclose(float(frozen_metrics["loss"]), float(full_metrics["loss"]), rtol=1e-6)
    chex.assert_trees_all_equal(frozen.params["visual"], params["visual"])
    assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(full.params["visual"]),
                                                        jax.tree.leaves(params["visual"])))
    rest = lambda p: {k: v for k, v in p.items() if k != "visual"}  # noqa: E731
    chex.assert_trees_all_close(rest(frozen.params), rest(full.params), rtol=1e-5, atol=1e-7)
    assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(rest(frozen.params)),
                                                        jax.tree.leaves(rest(params))))
    # no backward pass through the tower: fewer FLOPs than the full step, by more than its forward's share
    assert frozen_flops < 0.95 * full_flops, (frozen_flops, full_flops)
    # checkpoints hold what trains; a restore takes the tower from the loaded model
    module = weights.build_module(CFG, frozen=("visual",))
    saved = train_step.checkpointed(frozen, module)
    assert "visual" not in saved.params
    restored = train_step.restored(frozen_state, saved, module).params["visual"]
    assert all(a is b for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(frozen_state.params["visual"])))


def test_partition_and_join_are_inverse_under_lora_and_frozen_groups():
    params = nn.unbox(weights.abstract_params(weights.build_module(CFG, lora=LoraConfig(4, 8.0))))
    for part in (TrainedPart(), TrainedPart(frozen=("visual", "lm_head")), TrainedPart(LoraConfig(4, 8.0)),
                 TrainedPart(LoraConfig(4, 8.0), ("visual",))):
        trained, fixed = part.partition(params)
        joined = part.join(trained, fixed)
        assert jax.tree.structure(joined) == jax.tree.structure(params)
        assert all(a is b for a, b in zip(jax.tree.leaves(joined), jax.tree.leaves(params)))
        flat = jax.tree_util.tree_flatten_with_path(trained)[0]
        names = {str(path[0].key) for path, _ in flat}
        assert not names & set(part.frozen)
        if part.lora is not None:
            assert all(str(path[-1].key) in ("lora_a", "lora_b") for path, _ in flat)
    assert TrainedPart(frozen=("lm_head",)).trainable(params).keys() == {"embed_tokens", "layers", "norm", "visual"}


def test_wrong_groups_are_named():
    with pytest.raises(ValueError, match=r"model.frozen names \['vision'\].*choose from"):
        TrainedPart(frozen=("vision",))
    tied = {"embed_tokens": np.zeros(2), "layers": {}, "visual": {}}
    with pytest.raises(ValueError, match=r"model.frozen names \['lm_head'\], which this model does not have.*tied"):
        TrainedPart(frozen=("lm_head",)).partition(tied)
