"""Fresh checkpoints for a preset: random weights + a locally trained tokenizer, in Hugging Face format.

Nothing can be downloaded on the CPU-recipe machines, yet they must exercise the exact loading path used
for UI-TARS-1.5-7B; so a fresh model is written to disk like any released checkpoint and then loaded back
with `from_pretrained`.
"""
from __future__ import annotations

import json
import pathlib

import jax

from envs.atomic import write_text_atomic

from guijax.models import weights
from guijax.models.config import get_preset
from guijax.models.processor import preprocessor_config
from guijax.models.tokenizer import build_tokenizer, special_token_ids


def create_checkpoint(path: str | pathlib.Path, preset: str, *, seed: int = 0, tokenizer_vocab: int = 0,
                      mesh=None) -> pathlib.Path:
    """Write config.json, model.safetensors and tokenizer files for `preset` into `path` (created)."""
    path = pathlib.Path(path)
    cfg = get_preset(preset)
    vocab = tokenizer_vocab or cfg.vocab_size
    if vocab > cfg.vocab_size:
        raise ValueError(f"tokenizer_vocab {vocab} exceeds the {preset} preset's vocab_size {cfg.vocab_size}")
    tokenizer = build_tokenizer(path, vocab_size=vocab)
    cfg = cfg.replace(**special_token_ids(tokenizer))
    module = weights.build_module(cfg)
    params = weights.init_params(module, jax.random.PRNGKey(seed), mesh)
    weights.save_params(str(path), params, cfg)
    if jax.process_index() == 0:
        config = cfg.to_hf_dict()
        config["torch_dtype"] = "float32"
        write_text_atomic(path / "preprocessor_config.json", json.dumps(preprocessor_config(cfg), indent=2))
        write_text_atomic(path / "generation_config.json", json.dumps(
            {"eos_token_id": [cfg.eos_token_id], "pad_token_id": cfg.pad_token_id, "bos_token_id": cfg.bos_token_id},
            indent=2))
        write_text_atomic(path / "config.json", json.dumps(config, indent=2))  # last: it marks the checkpoint whole
    return path
