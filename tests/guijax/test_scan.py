"""Layers under scan: the scanned model equals the unrolled reference (values and gradients, vision included),
every remat policy gives the same gradients, the program does not grow with depth, the stacked KV cache
decodes like the full forward pass (bf16 for bf16 models, sharded like rows and kv heads), and scanned
parameters travel to and from the per-layer checkpoint names."""
from __future__ import annotations

import contextlib
import dataclasses
import io
import re

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from guijax import sharding
from guijax.models import weights
from guijax.models.config import PRESETS, ModelConfig
from guijax.models.policy import prepare_inputs
from guijax.models.qwen2_5_vl import default_cache_dtype, init_cache
from guijax.models.safetensors_io import SafetensorsReader
from guijax.models.scan import REMAT_POLICIES
from guijax.models.vision import BlockPlan, block_plan
from guijax.sampling import Sampler, SamplingConfig

# Three decoder layers and four vision blocks as two periods of (windowed, full): both scans are real loops.
CFG = PRESETS["tiny"].replace(num_hidden_layers=3,
                              vision=dataclasses.replace(PRESETS["tiny"].vision, depth=4, fullatt_block_indexes=(1, 3)))
GRID = np.array([[1, 8, 8]])  # 64 patches, several windows


def _inputs(cfg: ModelConfig = CFG, seed: int = 0):
    """One image row and one shorter text row (right-padded), as device-ready ModelInputs."""
    rs = np.random.RandomState(seed)
    image = [cfg.vision_start_token_id] + [cfg.image_token_id] * (int(GRID.prod()) // 4) + [cfg.vision_end_token_id]
    rows = [list(rs.randint(0, 900, 3)) + image + list(rs.randint(0, 900, 4)), list(rs.randint(0, 900, 9))]
    length = max(map(len, rows))
    ids = np.zeros((2, length), np.int32)
    mask = np.zeros((2, length), np.int32)
    for i, row in enumerate(rows):
        ids[i, :len(row)], mask[i, :len(row)] = row, 1
    pixels = rs.randn(int(GRID.prod()), cfg.vision.patch_dim).astype(np.float32)
    return prepare_inputs(cfg, ids, mask, pixels, GRID)


def _convert(params, cfg: ModelConfig, module, tmp_path):
    """Parameters (or a parameter-shaped gradient tree) re-laid out for `module` through the checkpoint."""
    weights.save_params(str(tmp_path), params, cfg)
    return weights.load_params(str(tmp_path), module)


def _loss_fn(module, inputs):
    """params -> (sum of the valid logits against a fixed random cotangent, logits)."""
    ct = jnp.asarray(np.random.RandomState(5).randn(*inputs.input_ids.shape, module.cfg.vocab_size), jnp.float32)

    def loss(params):
        logits, _ = module.apply({"params": params}, inputs.input_ids, inputs.positions, inputs.attention_mask,
                                 inputs.vision)
        return jnp.sum(logits * ct * inputs.attention_mask[..., None]), logits
    return loss


def _loss(module, inputs):
    return jax.jit(jax.value_and_grad(_loss_fn(module, inputs), has_aux=True))


@pytest.fixture(scope="module")
def scanned_params():
    module = weights.build_module(CFG)
    return module, weights.init_params(module, jax.random.PRNGKey(0))


def test_block_plan_scans_periods_of_runs():
    assert block_plan(PRESETS["qwen2_5_vl_7b"].vision) == BlockPlan(4, ((True, 7), (False, 1)))
    assert block_plan(CFG.vision) == BlockPlan(2, ((True, 1), (False, 1)))
    irregular = block_plan(dataclasses.replace(CFG.vision, depth=5, fullatt_block_indexes=(0, 3)))
    assert irregular == BlockPlan(1, ((False, 1), (True, 2), (False, 1), (True, 1)))
    assert [irregular.block_index(0, 3, 0), BlockPlan(4, ((True, 7), (False, 1))).block_index(2, 1, 0)] == [4, 23]


def test_scanned_params_are_stacked_with_a_layers_axis(scanned_params):
    module, params = scanned_params
    kernel = params["layers"]["mlp"]["up_proj"]["kernel"]
    assert kernel.shape == (CFG.num_hidden_layers, CFG.hidden_size, CFG.intermediate_size)
    assert params["visual"]["blocks"]["run_0"]["attn"]["qkv"]["kernel"].shape[:2] == (2, 1)
    specs = traverse_util.flatten_dict(jax.tree.map(
        tuple, nn.get_partition_spec(weights.abstract_params(module)),
        is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)))
    assert specs[("layers", "mlp", "up_proj", "kernel")] == ("layers", "embed", "mlp")
    assert specs[("visual", "blocks", "run_1", "mlp", "up_proj", "kernel")][:2] == ("layer_groups", "layers")


def test_scanned_equals_unrolled_in_values_and_gradients(scanned_params, tmp_path):
    scanned, params = scanned_params
    unrolled = weights.build_module(CFG, scan_layers=False)
    unrolled_params = _convert(params, CFG, unrolled, tmp_path / "unrolled")
    assert "layers_2" in unrolled_params and "blocks_3" in unrolled_params["visual"]
    inputs = _inputs()
    (_, logits), grads = _loss(scanned, inputs)(params)
    (_, ref_logits), ref_grads = _loss(unrolled, inputs)(unrolled_params)
    assert np.abs(np.asarray(logits)).max() > 0.1
    chex.assert_trees_all_close(logits, ref_logits, atol=1e-5, rtol=1e-5)
    chex.assert_trees_all_close(grads, _convert(ref_grads, CFG, scanned, tmp_path / "grads"), atol=1e-4, rtol=1e-4)


def test_deepstack_plan_ends_runs_at_the_tapped_blocks():
    plan = block_plan(PRESETS["qwen3_vl_8b"].vision)  # taps after blocks 8, 16 and 24 of 27
    assert plan == BlockPlan(1, ((False, 9), (False, 8), (False, 8), (False, 2)), (0, 1, 2))
    assert block_plan(PRESETS["tiny_qwen3_vl"].vision) == BlockPlan(1, ((False, 2), (False, 1), (False, 1)), (0, 1))


@pytest.mark.slow  # 22 s; Qwen3-VL's scanned model is checked against transformers in the default suite
def test_qwen3_scanned_equals_unrolled_in_values_and_gradients(tmp_path):
    """DeepStack inside the layer scan (added under a condition on the scanned layer index) and taps between
    the vision runs give what the plain per-layer loop gives, gradients included."""
    cfg = PRESETS["tiny_qwen3_vl"].replace(num_hidden_layers=3)  # the third layer takes no DeepStack features
    scanned, unrolled = weights.build_module(cfg), weights.build_module(cfg, scan_layers=False)
    params = weights.init_params(scanned, jax.random.PRNGKey(1))
    unrolled_params = _convert(params, cfg, unrolled, tmp_path / "unrolled")
    inputs = _inputs(cfg)
    (_, logits), grads = _loss(scanned, inputs)(params)
    (_, ref_logits), ref_grads = _loss(unrolled, inputs)(unrolled_params)
    chex.assert_trees_all_close(logits, ref_logits, atol=1e-5, rtol=1e-5)
    chex.assert_trees_all_close(grads, _convert(ref_grads, cfg, scanned, tmp_path / "grads"), atol=1e-4, rtol=1e-4)
    deepstack = grads["visual"]["deepstack_1"]["mlp_2"]["kernel"]
    assert float(jnp.abs(deepstack).max()) > 0  # the second tap reaches the loss


@pytest.fixture(scope="module")
def reference_gradients(scanned_params):
    module, params = scanned_params
    (value, _), grads = _loss(module, _inputs())(params)
    return value, grads


@pytest.mark.slow
@pytest.mark.parametrize("policy", [p for p in REMAT_POLICIES if p != "none"])
def test_remat_policies_give_equal_gradients(scanned_params, reference_gradients, policy):
    _, params = scanned_params
    inputs = _inputs()
    value, grads = reference_gradients
    (remat_value, _), remat_grads = _loss(weights.build_module(CFG, remat_policy=policy), inputs)(params)
    assert float(remat_value) == pytest.approx(float(value), rel=1e-6)
    # recomputed activations sum in another order: float32 gradients then differ by a few 1e-5 (the
    # embedding's summed ones, up to ~6, by ~1e-4 of themselves); a wrong recomputation differs by far more
    chex.assert_trees_all_close(remat_grads, grads, atol=5e-5, rtol=1e-4)


def _saved_residuals(policy: str, scan: bool) -> list[str]:
    """What the backward pass of a text-only forward keeps, one line per residual."""
    module = weights.build_module(CFG, remat_policy=policy, scan_layers=scan)
    params = weights.init_params(module, jax.random.PRNGKey(0))
    inputs = _inputs()
    inputs = dataclasses.replace(inputs, input_ids=inputs.input_ids % 900, vision=None)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        jax.ad_checkpoint.print_saved_residuals(lambda p: _loss_fn(module, inputs)(p)[0], params)
    return out.getvalue().splitlines()


@pytest.mark.slow
def test_attention_saveable_keeps_the_named_values():
    unrolled = "\n".join(_saved_residuals("attention_saveable", scan=False))
    assert unrolled.count("named 'attention_out'") == unrolled.count("named 'mlp_in'") == CFG.num_hidden_layers
    # under scan the kept values come out of the loop stacked, [layers, batch, seq, hidden] each
    stacked = f"f32[{CFG.num_hidden_layers},2,25,{CFG.hidden_size}] output of scan"
    full, saveable = (sum(stacked in line for line in _saved_residuals(p, scan=True))
                      for p in ("full", "attention_saveable"))
    assert (full, saveable) == (1, 3)  # the layer inputs; + attention outputs and MLP inputs


# -------------------------------------------------------------------------------------- program size
def _dot_count(cfg: ModelConfig, scan: bool, vision: bool) -> int:
    """dot_general ops in the lowered (not compiled) StableHLO of the forward pass."""
    module = weights.build_module(cfg, scan_layers=scan)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                            nn.unbox(weights.abstract_params(module)))
    inputs = _inputs(cfg) if vision else None
    ids = jnp.zeros((2, 16), jnp.int32)
    args = (inputs.input_ids, inputs.positions, inputs.attention_mask, inputs.vision) if vision else (
        ids, jnp.zeros((3, 2, 16), jnp.int32), jnp.ones((2, 16), jnp.int32), None)
    text = jax.jit(lambda p, *a: module.apply({"params": p}, *a)[0]).lower(abstract, *args).as_text()
    return len(re.findall(r"stablehlo\.dot_general", text))


def test_decoder_program_does_not_grow_with_depth():
    counts = {(n, scan): _dot_count(CFG.replace(num_hidden_layers=n), scan, vision=False)
              for n in (2, 8) for scan in (True, False)}
    assert counts[(2, True)] == counts[(8, True)]
    assert counts[(8, False)] > counts[(2, False)] + 5 * 6  # six more layers of >= 7 matmuls each


def test_vision_program_does_not_grow_with_depth():
    def cfg(depth: int) -> ModelConfig:
        return CFG.replace(vision=dataclasses.replace(CFG.vision, depth=depth,
                                                      fullatt_block_indexes=tuple(range(3, depth, 4))))
    assert _dot_count(cfg(4), True, vision=True) == _dot_count(cfg(16), True, vision=True)
    assert _dot_count(cfg(16), False, vision=True) > _dot_count(cfg(4), False, vision=True)


# -------------------------------------------------------------------------------------- KV cache
@pytest.mark.slow
def test_cache_decode_equals_full_forward(scanned_params):
    module, params = scanned_params
    rs = np.random.RandomState(3)
    b, s, new = 2, 7, 3
    ids = jnp.asarray(rs.randint(0, 900, (b, s + new)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(s + new, dtype=jnp.int32), (3, b, s + new))
    full, _ = module.apply({"params": params}, ids, positions, jnp.ones((b, s + new), jnp.int32))
    kv_mask = jnp.concatenate([jnp.ones((b, s), jnp.int32), jnp.zeros((b, new), jnp.int32)], 1)
    cache = init_cache(CFG, b, s + new)
    assert cache.k.shape == (CFG.num_hidden_layers, b, s + new, CFG.num_key_value_heads, CFG.head_dim)
    logits, cache = module.apply({"params": params}, ids[:, :s], positions[:, :, :s], jnp.ones((b, s), jnp.int32),
                                 cache=cache, cache_index=0, kv_mask=kv_mask)
    steps = [logits]
    for t in range(s, s + new):
        kv_mask = kv_mask.at[:, t].set(1)
        logits, cache = module.apply({"params": params}, ids[:, t:t + 1], positions[:, :, t:t + 1],
                                     jnp.ones((b, 1), jnp.int32), cache=cache, cache_index=t, kv_mask=kv_mask)
        steps.append(logits)
    chex.assert_trees_all_close(jnp.concatenate(steps, 1), full, atol=2e-5, rtol=2e-5)


@pytest.mark.slow
def test_bf16_models_get_a_bf16_cache():
    assert default_cache_dtype(jnp.bfloat16) == jnp.bfloat16 and default_cache_dtype(jnp.float32) == jnp.float32
    assert init_cache(CFG, 1, 4, compute_dtype=jnp.bfloat16).k.dtype == jnp.bfloat16
    module = weights.build_module(CFG, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    assert Sampler(module, SamplingConfig()).cache_dtype == jnp.bfloat16
    assert Sampler(weights.build_module(CFG), SamplingConfig()).cache_dtype == jnp.float32
    params = weights.init_params(module, jax.random.PRNGKey(0))
    ids = jnp.zeros((1, 3), jnp.int32)
    _, cache = module.apply({"params": params}, ids, jnp.zeros((3, 1, 3), jnp.int32), jnp.ones((1, 3), jnp.int32),
                            cache=init_cache(CFG, 1, 5, compute_dtype=module.dtype), kv_mask=jnp.ones((1, 5)))
    assert cache.k.dtype == cache.v.dtype == jnp.bfloat16


@pytest.mark.parametrize("fsdp,tensor,heads", [(4, 2, "tensor"), (2, 4, None)])  # 2 kv heads do not split 4 ways
def test_cache_is_sharded_like_rows_and_kv_heads(fsdp, tensor, heads):
    mesh = sharding.make_mesh(sharding.MeshConfig(data=1, fsdp=fsdp, tensor=tensor))
    with sharding.rules_context(mesh):
        cache = jax.jit(lambda: init_cache(CFG, 8, 16))()
    want = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, ("data", "fsdp"), None, heads))
    assert cache.k.sharding.is_equivalent_to(want, 5) and cache.v.sharding.is_equivalent_to(want, 5)


# -------------------------------------------------------------------------------------- checkpoints
def test_stacked_params_save_per_layer_names_and_load_sharded(scanned_params, tmp_path):
    module, params = scanned_params
    weights.save_params(str(tmp_path), params, CFG)
    reader = SafetensorsReader(tmp_path)
    names = reader.keys()
    assert not any("run_" in n or n.startswith("model.layers.mlp") for n in names)
    assert {f"model.layers.{i}.mlp.up_proj.weight" for i in range(3)} <= set(names)
    np.testing.assert_array_equal(reader.get("model.layers.2.mlp.up_proj.weight"),
                                  np.asarray(params["layers"]["mlp"]["up_proj"]["kernel"][2]).T)
    # block 3 is the full-attention block of the second period
    np.testing.assert_array_equal(reader.get("visual.blocks.3.attn.qkv.bias"),
                                  np.asarray(params["visual"]["blocks"]["run_1"]["attn"]["qkv"]["bias"][1, 0]))
    mesh = sharding.make_mesh(sharding.MeshConfig(data=1, fsdp=4, tensor=2))
    loaded = weights.load_params(str(tmp_path), module, mesh)
    kernel = loaded["layers"]["mlp"]["up_proj"]["kernel"]
    assert kernel.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor")
    chex.assert_trees_all_equal(jax.device_get(loaded), jax.device_get(params))
