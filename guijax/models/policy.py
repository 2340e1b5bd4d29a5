"""The user-facing policy: config + Flax module + (sharded) parameters + processor, loaded from and saved to
Hugging Face format directories.

    policy = guijax.models.from_pretrained(path, dtype="bfloat16", mesh=mesh)
    inputs = policy.processor(text=[...], images=[[img, ...], ...])
    logits = policy.logits(**inputs)        # [batch, seq, vocab]
    guijax.models.save_pretrained(policy, out_dir)
"""
from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
import shutil
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from guijax.models.config import ModelConfig
from guijax.models.lora import LoraConfig, combine, merge
from guijax.models.positions import mrope_positions, vision_layout
from guijax.models.qwen2_5_vl import Qwen2_5_VL
from guijax.models.safetensors_io import CheckpointError
from guijax.models import weights

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
# Files that travel with the weights (tokenizer, chat template, image processor, generation defaults).
SIDECAR_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                 "added_tokens.json", "chat_template.json", "chat_template.jinja", "preprocessor_config.json",
                 "processor_config.json", "generation_config.json")


def resolve_dtype(dtype: Any) -> Any:
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; choose one of {sorted(DTYPES)}")
        return DTYPES[dtype]
    return dtype


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ModelInputs:
    """Device-ready forward inputs; `vision` is None for text-only batches."""

    input_ids: jax.Array
    positions: jax.Array
    attention_mask: jax.Array
    vision: dict[str, jax.Array] | None = None


def prepare_inputs(cfg: ModelConfig, input_ids: Any, attention_mask: Any = None, pixel_values: Any = None,
                   image_grid_thw: Any = None) -> ModelInputs:
    """Host-side preparation: M-RoPE positions and the vision window layout (see positions.py).

    Checks that the image-pad tokens match the images, naming both counts when they do not."""
    input_ids = np.asarray(input_ids)
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids must be [batch, seq], got shape {input_ids.shape}")
    attention_mask = np.ones_like(input_ids) if attention_mask is None else np.asarray(attention_mask)
    n_pad = int(((input_ids == cfg.image_token_id) & (attention_mask > 0)).sum())
    vision = None
    if pixel_values is None:
        if n_pad:
            raise ValueError(f"input_ids hold {n_pad} image-pad tokens (id {cfg.image_token_id}) but no pixel_values were given")
    else:
        if image_grid_thw is None:
            raise ValueError("pixel_values given without image_grid_thw")
        grid = np.asarray(image_grid_thw).reshape(-1, 3)
        pixel_values = np.asarray(pixel_values)
        if pixel_values.shape != (int(grid.prod(1).sum()), cfg.vision.patch_dim):
            raise ValueError(f"pixel_values shape {pixel_values.shape} does not match image_grid_thw {grid.tolist()} "
                             f"(expected ({int(grid.prod(1).sum())}, {cfg.vision.patch_dim}))")
        n_feat = int(grid.prod(1).sum()) // cfg.vision.spatial_merge_size ** 2
        if n_feat != n_pad:
            raise ValueError(f"image features and image-pad tokens do not match: {n_feat} features from "
                             f"image_grid_thw {grid.tolist()}, {n_pad} image-pad tokens in input_ids")
        layout = vision_layout(grid, cfg.vision)
        vision = layout.inputs(pixel_values.astype(np.float32))
    positions, _ = mrope_positions(input_ids, attention_mask, image_grid_thw if vision is not None else None, cfg)
    return ModelInputs(input_ids.astype(np.int32), positions, attention_mask.astype(np.int32), vision)


@dataclasses.dataclass
class Policy:
    cfg: ModelConfig
    module: Qwen2_5_VL
    params: Any
    mesh: jax.sharding.Mesh | None = None
    path: pathlib.Path | None = None
    _processor: Any = None

    @property
    def processor(self):
        """The Qwen2.5-VL processor (tokenizer + image preprocessing) of the checkpoint directory."""
        if self._processor is None:
            from guijax.models.processor import Processor

            if self.path is None or not (self.path / "tokenizer_config.json").exists():
                raise CheckpointError(f"no tokenizer files (tokenizer_config.json) in {self.path}; "
                                      "the policy has no processor")
            self._processor = Processor.from_pretrained(self.path)
        return self._processor

    @functools.cached_property
    def _forward(self):
        def forward(params, inputs: ModelInputs, return_logits: bool):
            out, _ = self.module.apply({"params": params}, inputs.input_ids, inputs.positions, inputs.attention_mask,
                                       inputs.vision, return_logits=return_logits)
            return out

        return jax.jit(forward, static_argnames="return_logits")

    def prepare(self, input_ids, attention_mask=None, pixel_values=None, image_grid_thw=None, **_ignored) -> ModelInputs:
        """Processor output -> ModelInputs. Extra processor keys (e.g. mm_token_type_ids) are not needed."""
        return prepare_inputs(self.cfg, input_ids, attention_mask, pixel_values, image_grid_thw)

    def logits(self, **inputs) -> jax.Array:
        """[batch, seq, vocab] float32 logits for processor outputs."""
        return self._forward(self.params, self.prepare(**inputs), True)

    def hidden_states(self, **inputs) -> jax.Array:
        """[batch, seq, hidden] final (normed) hidden states, without the LM head."""
        return self._forward(self.params, self.prepare(**inputs), False)

    def lm_head(self) -> jax.Array:
        """[hidden, vocab] output projection (the transposed embedding when tied)."""
        return self.params["embed_tokens"].T if self.cfg.tie_word_embeddings else self.params["lm_head"]


def from_pretrained(path: str | pathlib.Path, *, dtype: Any = "float32", param_dtype: Any = None,
                    mesh: jax.sharding.Mesh | None = None, remat_policy: str = "none",
                    attention_impl: str = "auto", scan_layers: bool = True, lora: LoraConfig | None = None,
                    lora_seed: int = 0, expert_capacity_factor: float = 0.0, frozen: tuple[str, ...] = (),
                    attention_block: int = 512) -> Policy:
    """Load a Hugging Face Qwen2.5-VL, Qwen2-VL or Qwen3-VL directory (config.json, whose `model_type` picks
    the family; safetensors with optional index; tokenizer).

    dtype is the compute dtype; param_dtype defaults to it. With a mesh, every device reads only its shard.
    attention_impl picks the attention backend ("auto", "xla", "cudnn", "cudnn_packed", "splash", "reference"), attention_block the
    blockwise backend's tile. With `lora`, fresh
    adapters (drawn from `lora_seed`) join the loaded weights, which training then leaves frozen.
    expert_capacity_factor sizes a MoE model's expert-parallel buffers (guijax.models.moe; 0: dropless).
    `frozen` names parameter groups that training then holds fixed (guijax.models.trained).
    """
    path = pathlib.Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory not found: {path}")
    cfg = ModelConfig.from_json_file(path / "config.json")
    dtype = resolve_dtype(dtype)
    module = weights.build_module(cfg, dtype=dtype, param_dtype=resolve_dtype(param_dtype or dtype),
                                  remat_policy=remat_policy, attention_impl=attention_impl, scan_layers=scan_layers,
                                  lora=lora, expert_capacity_factor=expert_capacity_factor, frozen=frozen,
                                  attention_block=attention_block)
    params = weights.load_params(str(path), module, mesh)
    if lora is not None:
        params = combine(params, weights.init_adapters(module, jax.random.PRNGKey(lora_seed), mesh))
    return Policy(cfg, module, params, mesh, path)


def save_pretrained(policy: Policy, path: str | pathlib.Path, *, dtype: Any = None) -> pathlib.Path:
    """Write config.json + safetensors (+ the tokenizer / processor files of the source directory) so that
    transformers' `from_pretrained` and vLLM can serve the trained policy. LoRA adapters are merged into
    the kernels (`guijax.models.peft.save_adapter` writes them on their own)."""
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    dtype = resolve_dtype(dtype) if dtype is not None else None
    lora = policy.module.lora
    params = policy.params if lora is None else merge(policy.params, lora)
    weights.save_params(str(path), params, policy.cfg, dtype)
    if jax.process_index() == 0:
        config = policy.cfg.to_hf_dict()
        leaf_dtype = dtype or params["embed_tokens"].dtype
        config["torch_dtype"] = jnp.dtype(leaf_dtype).name
        (path / "config.json").write_text(json.dumps(config, indent=2))
        if policy.path is not None and policy.path.resolve() != path.resolve():
            for name in SIDECAR_FILES:
                if (policy.path / name).exists():
                    shutil.copy2(policy.path / name, path / name)
    return path
