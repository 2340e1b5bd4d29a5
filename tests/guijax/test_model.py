"""Golden-logit parity of the Flax models against transformers, for each family (Qwen2.5-VL, Qwen2-VL,
Qwen3-VL, Qwen3-VL-MoE), sharding, and checkpoint round trips."""
from __future__ import annotations

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from guijax import sharding  # noqa: E402
from guijax.models import policy as policy_lib  # noqa: E402
from guijax.models.config import PRESETS, ModelConfig  # noqa: E402
from guijax.models import weights  # noqa: E402
from guijax.models.safetensors_io import CheckpointError, SafetensorsReader  # noqa: E402

FAMILIES = ("tiny", "tiny_qwen2_vl", "tiny_qwen3_vl", "tiny_qwen3_vl_moe")  # one preset per family
GRIDS = np.array([[1, 4, 6], [1, 8, 8]])  # two images of different sizes; 8x8 spans several windows


def _hf_class(cfg: ModelConfig):
    prefix = {"qwen2_5_vl": "Qwen2_5_VL", "qwen2_vl": "Qwen2VL", "qwen3_vl": "Qwen3VL",
              "qwen3_vl_moe": "Qwen3VLMoe"}[cfg.model_type]
    return getattr(transformers, f"{prefix}Config"), getattr(transformers, f"{prefix}ForConditionalGeneration")


def _hf_model(cfg: ModelConfig, seed: int = 0):
    config_class, model_class = _hf_class(cfg)
    torch.manual_seed(seed)
    model = model_class(config_class(**cfg.to_hf_dict())).eval()
    with torch.no_grad():  # non-trivial norms and biases, and weights large enough to make logits spread
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.3)
            elif "norm" in name or "ln_q" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0, 0.08)
    return model


def _saved(name: str, tmp_path_factory) -> tuple[pathlib.Path, object, ModelConfig]:
    cfg = PRESETS[name]
    path = tmp_path_factory.mktemp(f"hf_{name}")
    model = _hf_model(cfg)
    model.save_pretrained(path)
    return path, model, cfg


@pytest.fixture(scope="module", params=FAMILIES)
def hf_checkpoint(request, tmp_path_factory) -> tuple[pathlib.Path, object, ModelConfig]:
    """A tiny random transformers model of each family, saved as a checkpoint."""
    return _saved(request.param, tmp_path_factory)


# the checks below exercise loading, dtypes and the head, which the Qwen3 families share with the others;
# for those families they run with -m slow, keeping the default suite inside CI's budget
@pytest.fixture(scope="module", params=["tiny", "tiny_qwen2_vl"] + [pytest.param(f, marks=pytest.mark.slow)
                                                                   for f in FAMILIES[2:]])
def hf_checkpoint_shared_paths(request, tmp_path_factory) -> tuple[pathlib.Path, object, ModelConfig]:
    return _saved(request.param, tmp_path_factory)


def _batch(cfg: ModelConfig, grids: np.ndarray | None, seed: int = 1):
    """Two sequences of different lengths (right-padded), each with text around its image."""
    rs = np.random.RandomState(seed)
    seqs = []
    n_images = 0 if grids is None else len(grids)
    for b in range(2):
        seq = list(rs.randint(0, 900, 5 - b))
        if b < n_images:
            seq += [cfg.vision_start_token_id] + [cfg.image_token_id] * (int(grids[b].prod()) // 4) + [cfg.vision_end_token_id]
        seq += list(rs.randint(0, 900, 4 + 2 * b))
        seqs.append(seq)
    length = max(map(len, seqs))
    ids = np.zeros((2, length), np.int64)
    mask = np.zeros((2, length), np.int64)
    for b, seq in enumerate(seqs):
        ids[b, :len(seq)] = seq
        mask[b, :len(seq)] = 1
    inputs = {"input_ids": ids, "attention_mask": mask}
    if grids is not None:
        inputs["pixel_values"] = rs.randn(int(grids.prod(1).sum()), cfg.vision.patch_dim).astype(np.float32)
        inputs["image_grid_thw"] = grids
    return inputs


def _hf_logits(model, inputs, cfg: ModelConfig) -> np.ndarray:
    kwargs = {k: torch.tensor(v) for k, v in inputs.items()}
    if "pixel_values" in inputs:
        kwargs["mm_token_type_ids"] = torch.tensor((inputs["input_ids"] == cfg.image_token_id).astype(np.int64))
    with torch.no_grad():
        return model(**kwargs).logits.numpy()


def _max_diff(a, b, mask) -> float:
    return float(np.abs(np.asarray(a) - np.asarray(b))[mask.astype(bool)].max())


def test_golden_logits_with_two_images(hf_checkpoint):
    path, model, cfg = hf_checkpoint
    inputs = _batch(cfg, GRIDS)
    ref = _hf_logits(model, inputs, cfg)
    policy = policy_lib.from_pretrained(path)
    ours = policy.logits(**inputs)
    assert ours.shape == ref.shape == (2, inputs["input_ids"].shape[1], cfg.vocab_size)
    assert np.abs(ref).max() > 1.0  # logits are not trivially small
    assert _max_diff(ours, ref, inputs["attention_mask"]) <= 1e-4


def test_golden_logits_text_only(hf_checkpoint):
    path, model, cfg = hf_checkpoint
    inputs = _batch(cfg, None)
    ref = _hf_logits(model, inputs, cfg)
    ours = policy_lib.from_pretrained(path).logits(**inputs)
    assert _max_diff(ours, ref, inputs["attention_mask"]) <= 1e-4


def test_images_change_logits(hf_checkpoint_shared_paths):
    """Guards against a vision tower whose output is silently dropped."""
    path, _, cfg = hf_checkpoint_shared_paths
    policy = policy_lib.from_pretrained(path)
    inputs = _batch(cfg, GRIDS)
    other = dict(inputs, pixel_values=inputs["pixel_values"] + 1.0)
    assert _max_diff(policy.logits(**inputs), policy.logits(**other), inputs["attention_mask"]) > 1e-3


def test_hidden_states_times_head_equal_logits(hf_checkpoint_shared_paths):
    path, _, cfg = hf_checkpoint_shared_paths
    policy = policy_lib.from_pretrained(path)
    inputs = _batch(cfg, GRIDS)
    hidden = policy.hidden_states(**inputs)
    assert hidden.shape == (*inputs["input_ids"].shape, cfg.hidden_size)
    np.testing.assert_allclose(np.asarray(hidden @ policy.lm_head()), np.asarray(policy.logits(**inputs)), atol=1e-5)


def test_sharded_forward_equals_single_device(hf_checkpoint):
    path, _, cfg = hf_checkpoint
    assert jax.device_count() == 8
    mesh = sharding.make_mesh(sharding.MeshConfig(data=1, fsdp=4, tensor=2))
    sharded = policy_lib.from_pretrained(path, mesh=mesh)
    single = policy_lib.from_pretrained(path)
    q = sharded.params["layers"]["self_attn"]["q_proj"]["kernel"]
    assert q.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor")
    assert len({str(s.index) for s in q.addressable_shards}) == 8  # really split, not replicated
    inputs = _batch(cfg, GRIDS)
    assert _max_diff(sharded.logits(**inputs), single.logits(**inputs), inputs["attention_mask"]) <= 1e-5


def test_save_pretrained_round_trip_through_transformers(hf_checkpoint, tmp_path):
    path, _, cfg = hf_checkpoint
    policy = policy_lib.from_pretrained(path)
    out = policy_lib.save_pretrained(policy, tmp_path / "saved")
    reloaded = _hf_class(cfg)[1].from_pretrained(out).eval()
    inputs = _batch(cfg, GRIDS)
    assert _max_diff(_hf_logits(reloaded, inputs, cfg), policy.logits(**inputs), inputs["attention_mask"]) <= 1e-4
    saved = json.loads((out / "config.json").read_text())
    assert saved["model_type"] == cfg.model_type and ModelConfig.from_hf_dict(saved) == cfg


def test_bfloat16_load_and_save(hf_checkpoint_shared_paths, tmp_path):
    path, _, cfg = hf_checkpoint_shared_paths
    policy = policy_lib.from_pretrained(path, dtype="bfloat16")
    assert policy.params["embed_tokens"].dtype == jnp.bfloat16
    out = policy_lib.save_pretrained(policy, tmp_path / "bf16")
    reader = SafetensorsReader(out)
    assert reader.get(weights.flax_to_hf(("embed_tokens",), cfg).hf_name).dtype.name == "bfloat16"
    inputs = _batch(cfg, GRIDS)
    full = policy_lib.from_pretrained(path).logits(**inputs)
    half = policy_lib.from_pretrained(out, dtype="bfloat16").logits(**inputs)
    assert _max_diff(half, full, inputs["attention_mask"]) < 0.25  # bf16 rounding only


def test_sharded_checkpoint_with_index(hf_checkpoint_shared_paths, tmp_path):
    path, _, cfg = hf_checkpoint_shared_paths
    policy = policy_lib.from_pretrained(path)
    files = weights.save_params(str(tmp_path), policy.params, cfg)
    assert len(files) == 1
    # force several shards
    from guijax.models import safetensors_io

    entries = [(k, SafetensorsReader(tmp_path).shape(k), np.float32, (lambda k=k: SafetensorsReader(tmp_path).get(k)))
               for k in SafetensorsReader(tmp_path).keys()]
    multi = tmp_path / "multi"
    names = safetensors_io.write_safetensors(multi, entries, max_shard_bytes=200_000)
    assert len(names) > 1 and (multi / "model.safetensors.index.json").exists()
    (multi / "config.json").write_text((path / "config.json").read_text())
    inputs = _batch(cfg, GRIDS)
    assert _max_diff(policy_lib.from_pretrained(multi).logits(**inputs), policy.logits(**inputs),
                     inputs["attention_mask"]) == 0.0


def test_load_errors_name_the_problem(hf_checkpoint, tmp_path):
    path, _, cfg = hf_checkpoint
    with pytest.raises(CheckpointError, match="checkpoint directory not found"):
        policy_lib.from_pretrained(tmp_path / "nope")
    # a config with one more layer than the weights: the missing keys are listed by name
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "model.safetensors").symlink_to(path / "model.safetensors")
    cfg = json.loads((path / "config.json").read_text())
    cfg["text_config"]["num_hidden_layers"] = 3
    cfg["text_config"].pop("layer_types", None)
    (bad / "config.json").write_text(json.dumps(cfg))
    layer = [k for k in SafetensorsReader(path).keys() if ".layers.1." in k]  # one decoder layer's tensors
    prefix = layer[0].split("layers.1.")[0]
    with pytest.raises(CheckpointError, match=rf"missing keys \({len(layer)}\).*{prefix}layers\.2\.self_attn\.o_proj\.weight"):
        policy_lib.from_pretrained(bad)
    cfg["text_config"]["num_hidden_layers"] = 2
    cfg["text_config"]["num_key_value_heads"] = cfg["text_config"]["num_attention_heads"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=rf"shape mismatches.*{prefix}layers\.0\.self_attn\.k_proj\.weight"):
        policy_lib.from_pretrained(bad)
    (bad / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        policy_lib.from_pretrained(bad)


def test_mismatched_image_tokens_fail_clearly(hf_checkpoint):
    path, _, cfg = hf_checkpoint
    policy = policy_lib.from_pretrained(path)
    inputs = _batch(cfg, GRIDS)
    with pytest.raises(ValueError, match=r"do not match: 30 features .* 22 image-pad tokens"):
        policy.logits(**dict(inputs, image_grid_thw=np.array([[1, 4, 6], [1, 8, 12]]),
                             pixel_values=np.zeros((24 + 96, cfg.vision.patch_dim), np.float32)))


def test_flat_transformers4_config_layout_is_read():
    """Released UI-TARS-1.5 / Qwen2.5-VL checkpoints use the flat 4.x config.json."""
    flat = {"model_type": "qwen2_5_vl", "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944,
            "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0, "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
            "tie_word_embeddings": False, "image_token_id": 151655, "bos_token_id": 151643, "eos_token_id": 151645,
            "vision_config": {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
                              "out_hidden_size": 3584, "fullatt_block_indexes": [7, 15, 23, 31], "window_size": 112,
                              "in_chans": 3, "spatial_patch_size": 14, "tokens_per_second": 2}}
    assert ModelConfig.from_hf_dict(flat) == PRESETS["qwen2_5_vl_7b"]


def test_flat_transformers4_qwen2_vl_config_is_read():
    """UI-TARS-7B-DPO / Qwen2-VL-7B-Instruct's config.json: flat 4.x layout, vision width as embed_dim."""
    flat = {"model_type": "qwen2_vl", "architectures": ["Qwen2VLForConditionalGeneration"], "vocab_size": 152064,
            "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
            "num_key_value_heads": 4, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 32768,
            "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}, "tie_word_embeddings": False,
            "image_token_id": 151655, "video_token_id": 151656, "bos_token_id": 151643, "eos_token_id": 151645,
            "vision_config": {"depth": 32, "embed_dim": 1280, "mlp_ratio": 4, "num_heads": 16, "in_chans": 3,
                              "hidden_size": 3584, "patch_size": 14, "spatial_merge_size": 2,
                              "spatial_patch_size": 14, "temporal_patch_size": 2}}
    cfg = ModelConfig.from_hf_dict(flat)
    assert cfg == PRESETS["qwen2_vl_7b"]
    assert (cfg.vision.norm, cfg.vision.mlp, cfg.vision.hidden_act) == ("layer", "plain", "quick_gelu")
    assert cfg.vision.fullatt_block_indexes == tuple(range(32))  # no windows in Qwen2-VL


@pytest.mark.parametrize("preset, count", [("qwen2_vl_7b", 8_291_375_616), ("qwen3_vl_8b", 8_767_123_696),
                                           ("qwen3_vl_32b", 33_357_390_064), ("qwen3_vl_30b_a3b", 31_070_754_032)])
def test_paper_sizes_parameter_count_matches_transformers(preset, count):
    """--dry_run's count of the papers' policies equals transformers' own model of the same config.json."""
    from guijax import launch

    config = launch.resolve("grpo_gpu", [f"model.preset={preset}", "model.path="])
    ours = launch.dry_run(config)["params"]
    cfg = PRESETS[preset]
    with torch.device("meta"):
        config_class, model_class = _hf_class(cfg)
        reference = model_class(config_class(**cfg.to_hf_dict()))
    assert ours == sum(p.numel() for p in reference.parameters()) == count


def test_released_qwen3_vl_config_is_read():
    """Qwen/Qwen3-VL-8B-Instruct's config.json (transformers 4.57 layout: rope_scaling inside text_config)."""
    released = {"architectures": ["Qwen3VLForConditionalGeneration"], "model_type": "qwen3_vl",
                "image_token_id": 151655, "video_token_id": 151656, "vision_start_token_id": 151652,
                "vision_end_token_id": 151653, "tie_word_embeddings": False,
                "text_config": {"model_type": "qwen3_vl_text", "vocab_size": 151936, "hidden_size": 4096,
                                "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
                                "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-6,
                                "rope_theta": 5000000, "max_position_embeddings": 262144, "attention_bias": False,
                                "rope_scaling": {"mrope_interleaved": True, "mrope_section": [24, 20, 20],
                                                 "rope_type": "default"},
                                "bos_token_id": 151643, "eos_token_id": 151645, "hidden_act": "silu",
                                "tie_word_embeddings": False},
                "vision_config": {"model_type": "qwen3_vl", "depth": 27, "hidden_size": 1152,
                                  "intermediate_size": 4304, "num_heads": 16, "in_channels": 3, "patch_size": 16,
                                  "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": 4096,
                                  "num_position_embeddings": 2304, "deepstack_visual_indexes": [8, 16, 24],
                                  "hidden_act": "gelu_pytorch_tanh"}}
    cfg = ModelConfig.from_hf_dict(released)
    assert cfg == PRESETS["qwen3_vl_8b"]
    assert cfg.head_dim == 128 and cfg.vision.patch_dim == 3 * 2 * 16 * 16
    with pytest.raises(ValueError, match="mrope_interleaved false"):
        bad = json.loads(json.dumps(released))
        bad["text_config"]["rope_scaling"]["mrope_interleaved"] = False
        ModelConfig.from_hf_dict(bad)


def test_a_family_guijax_does_not_run_is_named():
    with pytest.raises(ValueError, match=r"model_type 'llava' is not one of \('qwen2_5_vl', 'qwen2_vl', 'qwen3_vl', 'qwen3_vl_moe'\)"):
        ModelConfig.from_hf_dict({"model_type": "llava", "vision_config": {}}, source="x/config.json")
