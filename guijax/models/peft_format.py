"""LoRA adapters in PEFT's on-disk format: `adapter_config.json` + `adapter_model.safetensors`, which
`peft.PeftModel.from_pretrained(transformers_model, directory)` loads onto the base checkpoint.

Tensor names are PEFT's: `base_model.model.<module path in the transformers model>.lora_A.weight` ([r, in])
and `.lora_B.weight` ([out, r]); the module paths are transformers 5's in-memory names
(`model.language_model.layers.N.self_attn.q_proj`). `target_modules` is written as a regular expression that
PEFT full-matches against module paths, so the adapter covers exactly the decoder projections trained here
and never the vision tower's modules of the same names.
"""
from __future__ import annotations

import json
import pathlib
import re
from typing import Any

import flax.linen as nn
import jax
import numpy as np
import safetensors.numpy
from flax import traverse_util

from guijax.models import weights
from guijax.models.config import ModelConfig
from guijax.models.lora import ATTENTION_TARGETS, LoraConfig, combine, split
from guijax.models.safetensors_io import CheckpointError, write_safetensors
from guijax.sharding import param_shardings

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PEFT_NAMES = {"lora_a": "lora_A", "lora_b": "lora_B"}


def target_regex(lora: LoraConfig) -> str:
    """The module paths the adapters sit on, as one regular expression (PEFT full-matches it)."""
    attn = [t for t in lora.target_modules if t in ATTENTION_TARGETS]
    mlp = [t for t in lora.target_modules if t not in ATTENTION_TARGETS]
    parts = ([rf"self_attn\.({'|'.join(attn)})"] if attn else []) + ([rf"mlp\.({'|'.join(mlp)})"] if mlp else [])
    return rf"model\.language_model\.layers\.\d+\.({'|'.join(parts)})"


def adapter_config(lora: LoraConfig, base_model: str = "") -> dict[str, Any]:
    """PEFT's LoraConfig as `save_pretrained` writes it (the fields that shape the adapters)."""
    return {"peft_type": "LORA", "task_type": None, "base_model_name_or_path": base_model, "r": lora.rank,
            "lora_alpha": lora.alpha, "lora_dropout": lora.dropout, "target_modules": target_regex(lora),
            "use_rslora": lora.use_rslora, "bias": "none", "fan_in_fan_out": False, "init_lora_weights": True,
            "inference_mode": True, "modules_to_save": None, "layers_to_transform": None}


def _peft_names(path: tuple[str, ...], cfg: ModelConfig) -> weights.TensorRule:
    """The PEFT tensor names of an adapter leaf (one per layer of a scanned leaf)."""
    rule = weights.flax_to_hf(path[:-1] + ("kernel",), cfg, weights.NESTED)
    names = tuple(f"base_model.model.{name.removesuffix('.weight')}.{_PEFT_NAMES[path[-1]]}.weight"
                  for name in rule.hf_names)
    return weights.TensorRule(names, "transpose", rule.stack)


def save_adapter(directory: str | pathlib.Path, params: Any, cfg: ModelConfig, lora: LoraConfig,
                 base_model: str = "") -> pathlib.Path:
    """Write the adapters of `params` in PEFT's format. Every process must call it in multi-host runs (it
    gathers); only process 0 writes."""
    directory = pathlib.Path(directory)
    adapters = traverse_util.flatten_dict(nn.unbox(split(params)[0]))
    if not adapters:
        raise ValueError("the parameters hold no LoRA adapters to save")
    entries = []
    for path, value in adapters.items():
        rule = _peft_names(path, cfg)
        shape = tuple(reversed(value.shape[len(rule.stack):]))
        for name, read in zip(rule.hf_names, weights._layer_values(value, rule)):
            entries.append((name, shape, np.dtype(np.float32), lambda read=read: np.asarray(read(), np.float32).T))
    entries.sort(key=lambda entry: entry[0])
    if jax.process_index() != 0:
        for *_, fetch in entries:
            fetch()
        return directory
    write_safetensors(directory, entries, file_name=WEIGHTS_FILE)
    (directory / CONFIG_FILE).write_text(json.dumps(adapter_config(lora, base_model), indent=2))
    return directory


def read_config(directory: str | pathlib.Path) -> LoraConfig:
    """The LoraConfig of a saved adapter; errors name the file and the field PEFT wrote that guijax cannot use."""
    path = pathlib.Path(directory) / CONFIG_FILE
    if not path.exists():
        raise CheckpointError(f"no {CONFIG_FILE} in {directory}: not a PEFT adapter directory")
    data = json.loads(path.read_text())
    if data.get("peft_type") != "LORA":
        raise CheckpointError(f"{path}: peft_type {data.get('peft_type')!r}; only LORA adapters load here")
    # fields that change what the adapter computes, at the values plain LoRA has
    plain = {"use_dora": False, "alpha_pattern": {}, "rank_pattern": {}, "fan_in_fan_out": False,
             "lora_bias": False, "layers_to_transform": None}
    changed = {k: data[k] for k, v in plain.items() if data.get(k, v) not in (v, None if v == {} else v)}
    if changed:
        raise CheckpointError(f"{path}: only plain LoRA loads here; these fields change the adapter: {changed}")
    if data.get("bias", "none") != "none" or data.get("modules_to_save"):
        raise CheckpointError(f"{path}: trained biases or modules_to_save are not supported (bias "
                              f"{data.get('bias')!r}, modules_to_save {data.get('modules_to_save')!r})")
    targets = data.get("target_modules")
    if isinstance(targets, str):  # the regex `save_adapter` writes: the names between its alternatives
        targets = re.findall(r"([a-z]+_proj)", targets)
    try:
        return LoraConfig(int(data["r"]), float(data["lora_alpha"]), float(data.get("lora_dropout", 0.0)),
                          tuple(targets or ()), bool(data.get("use_rslora", False)))
    except (KeyError, ValueError) as err:
        raise CheckpointError(f"{path}: {err}") from None


def load_adapter(directory: str | pathlib.Path, params: Any, module: Any, mesh=None) -> dict:
    """`params` with its adapters replaced by the PEFT adapter in `directory` (saved by `save_adapter` or by
    PEFT for the same targets). `module` is the LoRA module the parameters belong to."""
    directory = pathlib.Path(directory)
    saved, ours = read_config(directory), module.lora
    shape_of = lambda c: (c.rank, c.scale, sorted(c.target_modules))  # noqa: E731
    if shape_of(saved) != shape_of(ours):
        raise CheckpointError(f"{directory / CONFIG_FILE}: rank {saved.rank}, scale {saved.scale:g} on "
                              f"{sorted(saved.target_modules)}, but the model's adapters are rank {ours.rank}, scale "
                              f"{ours.scale:g} on {sorted(ours.target_modules)}")
    file = directory / WEIGHTS_FILE
    if not file.exists():
        raise CheckpointError(f"no {WEIGHTS_FILE} in {directory}")
    tensors = safetensors.numpy.load_file(str(file))
    boxed = weights.abstract_params(module)
    shardings = split(param_shardings(boxed, mesh))[0] if mesh is not None else None
    flat = traverse_util.flatten_dict(split(nn.unbox(boxed))[0])
    flat_shards = traverse_util.flatten_dict(shardings) if shardings is not None else {}
    rules = {path: _peft_names(path, module.cfg) for path in flat}
    expected = {name for rule in rules.values() for name in rule.hf_names}
    missing, extra = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
    if missing:
        raise CheckpointError(f"{file}: missing {len(missing)} adapter tensors, e.g. {missing[:3]}")
    if extra:  # e.g. adapters PEFT put on the vision tower's namesakes: dropping them would change the model
        raise CheckpointError(f"{file}: {len(extra)} adapter tensors on modules guijax does not adapt, e.g. {extra[:3]}")
    loaded = {}
    for path, leaf in flat.items():
        rule = rules[path]
        shape = tuple(reversed(leaf.shape[len(rule.stack):]))
        wrong = [f"{n} {tensors[n].shape}" for n in rule.hf_names if tensors[n].shape != shape]
        if wrong:
            raise CheckpointError(f"{file}: {wrong[0]} (and {len(wrong) - 1} more), the model expects {shape}")
        layers = [tensors[name].T for name in rule.hf_names]
        value = (np.stack(layers).reshape(leaf.shape) if rule.stack else layers[0]).astype(np.float32)
        loaded[path] = jax.device_put(value, flat_shards[path]) if path in flat_shards else jax.numpy.asarray(value)
    return combine(split(params)[1], traverse_util.unflatten_dict(loaded))
