"""LoRA: adapters leave a fresh model unchanged, train alone with the base frozen in its dtype, export merged
(transformers gives the same logits) and in PEFT's format (PEFT gives the same logits), and a recipe trains
with them."""
from __future__ import annotations

import json
import pathlib

import chex
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import traverse_util

from guijax import optim, objectives, train_step
from guijax.models import peft_format, policy as policy_lib, weights
from guijax.models.config import PRESETS
from guijax.models.lora import LoraConfig, combine, merge, split
from guijax.models.trained import TrainedPart

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

LORA = LoraConfig(rank=4, alpha=8.0)
HF_CLASSES = {"qwen2_5_vl": "Qwen2_5_VL", "qwen3_vl_moe": "Qwen3VLMoe"}


def _hf_checkpoint(name: str, path: pathlib.Path):
    cfg = PRESETS[name]
    prefix = HF_CLASSES[cfg.model_type]
    torch.manual_seed(0)
    model = getattr(transformers, f"{prefix}ForConditionalGeneration")(
        getattr(transformers, f"{prefix}Config")(**cfg.to_hf_dict())).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.08)
    model.save_pretrained(path)
    return getattr(transformers, f"{prefix}ForConditionalGeneration"), cfg


def _inputs(cfg, with_image: bool = True) -> dict[str, np.ndarray]:
    rs = np.random.RandomState(1)
    ids = list(rs.randint(0, 900, 5))
    grid = np.array([[1, 4, 4]])
    if with_image:
        ids += [cfg.vision_start_token_id] + [cfg.image_token_id] * 4 + [cfg.vision_end_token_id]
    ids += list(rs.randint(0, 900, 6))
    out = {"input_ids": np.array([ids], np.int64), "attention_mask": np.ones((1, len(ids)), np.int64)}
    if with_image:
        out["pixel_values"] = rs.randn(16, cfg.vision.patch_dim).astype(np.float32)
        out["image_grid_thw"] = grid
    return out


def _hf_logits(model, inputs, cfg) -> np.ndarray:
    kwargs = {k: torch.tensor(v) for k, v in inputs.items()}
    if "pixel_values" in inputs:
        kwargs["mm_token_type_ids"] = torch.tensor((inputs["input_ids"] == cfg.image_token_id).astype(np.int64))
    with torch.no_grad():
        return model(**kwargs).logits.numpy()


def _trained_adapters(params, seed: int = 3, scale: float = 0.1):
    """The parameters with every adapter (B included) drawn at random: what training would leave."""
    adapters, frozen = split(params)
    rs = np.random.RandomState(seed)
    flat = {p: jnp.asarray(scale * rs.randn(*v.shape), v.dtype) for p, v in traverse_util.flatten_dict(adapters).items()}
    return combine(frozen, traverse_util.unflatten_dict(flat))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("lora_base")
    hf_class, cfg = _hf_checkpoint("tiny", path)
    return path, hf_class, cfg


def test_fresh_adapters_leave_the_model_unchanged_and_trained_ones_change_it(tiny):
    path, hf_class, cfg = tiny
    plain = policy_lib.from_pretrained(path)
    adapted = policy_lib.from_pretrained(path, lora=LORA)
    inputs = _inputs(cfg)
    chex.assert_trees_all_close(adapted.logits(**inputs), plain.logits(**inputs), atol=1e-5)
    adapted.params = _trained_adapters(adapted.params)
    changed = float(jnp.abs(adapted.logits(**inputs) - plain.logits(**inputs)).max())
    assert changed > 1e-2
    flat = traverse_util.flatten_dict(split(adapted.params)[0])
    # the seven decoder projections of each (scanned) layer, nothing in the vision tower
    assert {p[-2] for p in flat} == set(LORA.target_modules) and all(p[0] == "layers" for p in flat)
    a = flat[("layers", "self_attn", "q_proj", "lora_a")]
    chex.assert_shape(a, (cfg.num_hidden_layers, cfg.hidden_size, 4))


# the routed-expert family adapts its attention only (same layers as the dense one): -m slow
@pytest.mark.parametrize("name", ["tiny", pytest.param("tiny_qwen3_vl_moe", marks=pytest.mark.slow)])
def test_merged_and_peft_exports_give_transformers_the_same_logits(name, tmp_path):
    peft = pytest.importorskip("peft")
    hf_class, cfg = _hf_checkpoint(name, tmp_path / "base")
    lora = LoraConfig(4, 8.0, 0.0, ("q_proj", "v_proj", "o_proj")) if cfg.num_experts else LORA
    policy = policy_lib.from_pretrained(tmp_path / "base", lora=lora)
    policy.params = _trained_adapters(policy.params)
    inputs = _inputs(cfg)
    ours = np.asarray(policy.logits(**inputs))

    merged = policy_lib.save_pretrained(policy, tmp_path / "merged")
    np.testing.assert_allclose(_hf_logits(hf_class.from_pretrained(merged).eval(), inputs, cfg), ours, atol=1e-4)

    peft_format.save_adapter(tmp_path / "adapter", policy.params, cfg, lora, str(tmp_path / "base"))
    saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (saved["r"], saved["lora_alpha"], saved["peft_type"]) == (4, 8.0, "LORA")
    with_adapter = peft.PeftModel.from_pretrained(hf_class.from_pretrained(tmp_path / "base"), tmp_path / "adapter")
    np.testing.assert_allclose(_hf_logits(with_adapter.eval(), inputs, cfg), ours, atol=1e-4)
    # PEFT put adapters on the decoder's targeted projections only, none on the vision tower's namesakes
    wrapped = [n for n, m in with_adapter.named_modules() if hasattr(m, "lora_A") and n.endswith(lora.target_modules)]
    assert len(wrapped) == cfg.num_hidden_layers * len(lora.target_modules)
    assert not any("visual" in n for n in wrapped)

    fresh = policy_lib.from_pretrained(tmp_path / "base", lora=lora, lora_seed=7)
    fresh.params = peft_format.load_adapter(tmp_path / "adapter", fresh.params, fresh.module)
    chex.assert_trees_all_close(fresh.logits(**inputs), ours, atol=1e-6)


def test_adapter_mismatch_and_bad_targets_are_named(tiny, tmp_path):
    path, _, cfg = tiny
    policy = policy_lib.from_pretrained(path, lora=LORA)
    peft_format.save_adapter(tmp_path / "adapter", policy.params, cfg, LORA)
    other = policy_lib.from_pretrained(path, lora=LoraConfig(8, 8.0))
    with pytest.raises(Exception, match="rank 4.*rank 8"):
        peft_format.load_adapter(tmp_path / "adapter", other.params, other.module)
    # an adapter that computes something else is refused, not loaded partly
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(Exception, match="use_dora"):
        peft_format.load_adapter(tmp_path / "adapter", policy.params, policy.module)
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps(config))
    import safetensors.numpy

    file = tmp_path / "adapter" / "adapter_model.safetensors"
    tensors = safetensors.numpy.load_file(str(file))
    tensors["base_model.model.model.visual.blocks.0.mlp.gate_proj.lora_A.weight"] = np.zeros((4, 8), np.float32)
    safetensors.numpy.save_file(tensors, str(file))
    with pytest.raises(Exception, match="modules guijax does not adapt.*visual"):
        peft_format.load_adapter(tmp_path / "adapter", policy.params, policy.module)
    with pytest.raises(ValueError, match="'qkv'.*choose among"):
        LoraConfig(4, 8.0, target_modules=("q_proj", "qkv"))
    moe = weights.build_module(PRESETS["tiny_qwen3_vl_moe"], lora=LORA)
    with pytest.raises(ValueError, match=r"\['down_proj', 'gate_proj', 'up_proj'\].*routed experts"):
        weights.abstract_params(moe)
    with pytest.raises(ValueError, match="fold them into the kernels"):
        weights.save_params(str(tmp_path / "plain"), policy.params, cfg)


def _batch(cfg, seed: int = 0):
    rs = np.random.RandomState(seed)
    ids = rs.randint(0, 900, (2, 16)).astype(np.int32)
    inputs = policy_lib.prepare_inputs(cfg, ids, np.ones_like(ids))
    mask = np.zeros((2, 16), np.float32)
    mask[:, 6:] = 1
    return {"input_ids": inputs.input_ids, "positions": inputs.positions, "attention_mask": inputs.attention_mask,
            "vision": None, "targets": np.roll(ids, -1, axis=1), "loss_mask": mask}


def _tx():
    return optim.make_optimizer(ml_collections.ConfigDict(dict(
        learning_rate=1e-2, warmup_steps=0, total_steps=10, schedule="constant", weight_decay=0.01, b1=0.9,
        b2=0.95, eps=1e-8, max_grad_norm=1.0, grad_accum_steps=1, state_dtype="float32")))[0]


def test_training_updates_the_adapters_alone_with_the_base_frozen_in_its_dtype():
    cfg = PRESETS["tiny"]
    lora = LoraConfig(4, 8.0, dropout=0.1)
    module = weights.build_module(cfg, param_dtype=jnp.bfloat16, lora=lora)
    params = weights.init_params(module, jax.random.PRNGKey(0))
    tx = _tx()
    state = train_step.init_state(module, params, tx)
    adapters, frozen = split(params)
    # the optimiser holds moments of the adapters only
    n_adapters = len(jax.tree.leaves(adapters))
    assert len(jax.tree.leaves(state.opt_state)) == 2 * n_adapters + 1
    before = jax.tree.map(np.asarray, params)
    step = train_step.make_train_step(module, tx, train_step.StepConfig(objectives.CrossEntropyLoss()))
    losses = []
    for _ in range(3):
        state, metrics = step(state, _batch(cfg))
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0]
    new_adapters, new_frozen = split(state.params)
    chex.assert_trees_all_equal(new_frozen, split(before)[1])  # bit for bit
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(new_frozen))
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(new_adapters))
    b = traverse_util.flatten_dict(new_adapters)[("layers", "mlp", "down_proj", "lora_b")]
    assert float(jnp.abs(b).max()) > 0  # B left zero: A B would still be zero
    saved = train_step.checkpointed(state, module)
    assert jax.tree.structure(saved.params) == jax.tree.structure(new_adapters)


@pytest.mark.slow
def test_dropout_acts_in_training_steps_only():
    cfg = PRESETS["tiny"]
    module = weights.build_module(cfg, lora=LoraConfig(4, 8.0, dropout=0.5))
    params = _trained_adapters(weights.init_params(module, jax.random.PRNGKey(0)), scale=0.5)
    batch = _batch(cfg)
    with_key = jax.jit(lambda key: train_step.batch_logprobs(module, params, batch, dropout_key=key)[0])
    plain = jax.jit(lambda: train_step.batch_logprobs(module, params, batch)[0])()  # what sampling and scoring see
    a, b = with_key(jax.random.PRNGKey(1)), with_key(jax.random.PRNGKey(2))
    assert float(jnp.abs(a - b).max()) > 1e-3 and float(jnp.abs(a - plain).max()) > 1e-3
    merged = weights.build_module(cfg)
    merged_logp = jax.jit(lambda p: train_step.batch_logprobs(merged, p, batch)[0])(merge(params, module.lora))
    chex.assert_trees_all_close(merged_logp, plain, atol=1e-5)


@pytest.mark.slow
def test_a_recipe_trains_with_lora_and_saves_both_forms(tiny_config, tmp_path):
    from guijax.pipeline.registry import run_stages

    config = tiny_config("grpo_cpu", "stages=('base_model', 'tasks', 'sft', 'rl')", "lora.rank=4", "lora.alpha=8",
                         "lora.target_modules=('q_proj', 'v_proj')", "sft.learning_rate=0.01")
    run_stages(config, tmp_path / "run")
    for name in ("sft_model", "trained_model"):
        adapter = tmp_path / "run" / f"{name}_adapter"
        saved = json.loads((adapter / peft_format.CONFIG_FILE).read_text())
        assert saved["r"] == 4 and "q_proj|v_proj" in saved["target_modules"]
        assert (tmp_path / "run" / name / "model.safetensors").exists()
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any("iteration" in m for m in metrics)
    # the checkpoint holds the adapters and their moments, not the frozen base
    ckpt = max((tmp_path / "run" / "checkpoints").iterdir(), key=lambda p: p.name)
    size = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file())
    base = (tmp_path / "run" / "trained_model" / "model.safetensors").stat().st_size
    assert size < base / 2


@pytest.mark.slow
def test_sharded_lora_step_equals_single_device():
    """On a mesh the adapters and their moments are laid out by the logical rules like their kernels."""
    from guijax import sharding

    cfg = PRESETS["tiny"]
    module = weights.build_module(cfg, lora=LoraConfig(4, 8.0))
    params = _trained_adapters(weights.init_params(module, jax.random.PRNGKey(0)))
    tx, cfg_step, batch = _tx(), train_step.StepConfig(objectives.CrossEntropyLoss()), _batch(cfg, 3)
    single, m1 = train_step.make_train_step(module, tx, cfg_step)(
        train_step.init_state(module, jax.tree.map(jnp.copy, params), tx), batch)
    mesh = sharding.make_mesh(sharding.MeshConfig(data=1, fsdp=4, tensor=2))
    state = train_step.init_state(module, jax.tree.map(jnp.copy, params), tx, mesh)
    a = traverse_util.flatten_dict(state.params)[("layers", "mlp", "up_proj", "lora_a")]
    assert a.sharding.spec[1] == "fsdp"  # the input (embed) axis, like the kernel's
    sharded, m2 = train_step.make_train_step(module, tx, cfg_step, mesh)(state, batch)
    assert float(m1["loss"]) == pytest.approx(float(m2["loss"]), rel=1e-5)
    # Adam's first step is ~lr·sign(g): gradients near zero may round to a different side across layouts
    chex.assert_trees_all_close(split(sharded.params)[0], split(single.params)[0], atol=1e-4)


# one device repeats the mesh's check without the sharding (30 s): -m slow
@pytest.mark.parametrize("on_mesh", [pytest.param(False, marks=pytest.mark.slow), True])
def test_steps_leave_the_base_in_place_so_a_reference_policy_shares_it(on_mesh):
    """The frozen base is neither donated nor copied by a LoRA step: the new state holds the same arrays, and
    a KL reference policy taken before the steps shares them and keeps its own adapters."""
    from guijax import sharding

    cfg = PRESETS["tiny"]
    module = weights.build_module(cfg, lora=LoraConfig(4, 8.0))
    params = weights.init_params(module, jax.random.PRNGKey(0))
    tx = _tx()
    mesh = sharding.make_mesh(sharding.MeshConfig(data=1, fsdp=4, tensor=2)) if on_mesh else None
    state = train_step.init_state(module, params, tx, mesh)
    reference = train_step.reference_params(state.params, TrainedPart.of(module))
    ref_adapters, ref_base = split(reference)
    initial = jax.tree.map(np.asarray, ref_adapters)
    step = train_step.make_train_step(module, tx, train_step.StepConfig(objectives.CrossEntropyLoss()), mesh)
    for seed in range(2):
        state, _ = step(state, _batch(cfg, seed))
    new_adapters, new_base = split(state.params)
    for kept, ref in zip(jax.tree.leaves(new_base), jax.tree.leaves(ref_base)):
        assert kept is ref and not ref.is_deleted()
    assert not any(x.is_deleted() for x in jax.tree.leaves(ref_adapters))
    chex.assert_trees_all_equal(jax.tree.map(np.asarray, ref_adapters), initial)
    assert float(jnp.abs(traverse_util.flatten_dict(new_adapters)[("layers", "mlp", "down_proj", "lora_b")]).max()) > 0
    logp = train_step.make_logprob_fn(module, mesh=mesh)(reference, _batch(cfg))[0]
    assert bool(jnp.all(jnp.isfinite(logp)))
