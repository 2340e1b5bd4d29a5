"""LoRA: low-rank adapters on the decoder's projections, trained while the base weights stay frozen.

A targeted `Linear` gains two float32 leaves beside its kernel, `lora_a` [in, r] and `lora_b` [r, out], and
computes y = x W (+ b) + s · dropout(x) A B with s = alpha / r (alpha / √r with rsLoRA), as PEFT's
`LoraLayer` does; A starts uniform in ±1/√in (PEFT's kaiming-uniform with a = √5) and B at zero, so a
fresh adapter leaves the model unchanged. Dropout acts only when the apply call is given a "dropout" rng
(training steps), never while sampling or scoring.

Targets are named as PEFT names them (q_proj, ..., down_proj) and apply to the decoder layers only: the
vision tower stays frozen, as GUI-agent LoRA recipes train it. The adapters live in the same parameter tree
as the base weights; `split`/`combine` separate them so gradients and optimiser state cover the adapters
alone, and `merge` folds them into the kernels for a plain checkpoint.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import traverse_util

from guijax.models.rows import rows_matmul

ADAPTER_LEAVES = ("lora_a", "lora_b")
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
DECODER_TARGETS = ATTENTION_TARGETS + MLP_TARGETS


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """PEFT's `LoraConfig` fields that shape the adapters (r, lora_alpha, lora_dropout, target_modules,
    use_rslora)."""

    rank: int
    alpha: float
    dropout: float = 0.0
    target_modules: tuple[str, ...] = DECODER_TARGETS
    use_rslora: bool = False

    def __post_init__(self):
        if self.rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {self.rank}")
        if not self.alpha > 0:
            raise ValueError(f"LoRA alpha must be > 0, got {self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {self.dropout}")
        unknown = sorted(set(self.target_modules) - set(DECODER_TARGETS))
        if unknown or not self.target_modules:
            raise ValueError(f"LoRA target_modules {list(self.target_modules)}: {unknown or 'empty'}; "
                             f"choose among the decoder's projections {list(DECODER_TARGETS)}")

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    def on(self, name: str) -> "LoraConfig | None":
        """This config for the projection `name` when it is a target, else None."""
        return self if name in self.target_modules else None

    def check_model(self, num_experts: int, model_type: str) -> None:
        """Routed-expert decoders have no gate/up/down projections: their MLPs are fused expert tensors."""
        if num_experts:
            mlp = sorted(set(self.target_modules) & set(MLP_TARGETS))
            if mlp:
                raise ValueError(f"LoRA target_modules {mlp} do not exist in a {model_type} decoder (its MLPs are "
                                 f"routed experts); targets there: {list(ATTENTION_TARGETS)}")


def from_run_config(config: Any) -> LoraConfig | None:
    """The LoraConfig of a run config's `lora` section (guijax.schema.Lora), or None when its rank is 0."""
    section = config.lora
    if not section.rank:
        return None
    return LoraConfig(int(section.rank), float(section.alpha), float(section.dropout), tuple(section.target_modules),
                      bool(section.use_rslora))


def init_a(key: jax.Array, shape: tuple[int, ...], dtype: Any = jnp.float32) -> jax.Array:
    """A [in, r] uniform in ±1/√in: PEFT's kaiming_uniform_(a=√5) on the torch [r, in] weight."""
    bound = 1.0 / math.sqrt(shape[-2])
    return jax.random.uniform(key, shape, dtype, -bound, bound)


def delta(x: jax.Array, a: jax.Array, b: jax.Array, lora: LoraConfig, dtype: Any,
          dropout_key: jax.Array | None) -> jax.Array:
    """s · dropout(x) A B in the compute dtype; dropout only with a key."""
    x = x.astype(dtype)
    if dropout_key is not None and lora.dropout > 0:
        keep = jax.random.bernoulli(dropout_key, 1.0 - lora.dropout, x.shape)
        x = jnp.where(keep, x / (1.0 - lora.dropout), 0).astype(dtype)
    return lora.scale * rows_matmul(rows_matmul(x, a.astype(dtype)), b.astype(dtype))


# ---------------------------------------------------------------------------- the parameter tree

def is_adapter(path: tuple[str, ...]) -> bool:
    return path[-1] in ADAPTER_LEAVES


def split(params: Any) -> tuple[dict, dict]:
    """(adapters, frozen): the same nested dict cut in two by leaf name."""
    flat = traverse_util.flatten_dict(params)
    adapters = {p: v for p, v in flat.items() if is_adapter(p)}
    frozen = {p: v for p, v in flat.items() if not is_adapter(p)}
    return traverse_util.unflatten_dict(adapters), traverse_util.unflatten_dict(frozen)


def combine(frozen: Any, adapters: Any) -> dict:
    """The inverse of `split`."""
    flat = traverse_util.flatten_dict(frozen)
    flat.update(traverse_util.flatten_dict(adapters))
    return traverse_util.unflatten_dict(flat)


def merge(params: Any, lora: LoraConfig) -> dict:
    """The base parameters with each adapter folded into its kernel (W + s·A B, in float32, rounded to the
    kernel's dtype) and the adapter leaves dropped: what a plain checkpoint of the trained model holds."""
    flat = traverse_util.flatten_dict(params)
    out = {}
    for path, value in flat.items():
        if is_adapter(path):
            continue
        owner = path[:-1]
        if path[-1] == "kernel" and owner + ("lora_a",) in flat:
            a, b = flat[owner + ("lora_a",)], flat[owner + ("lora_b",)]
            update = lora.scale * jnp.einsum("...ir,...ro->...io", a.astype(jnp.float32), b.astype(jnp.float32))
            value = (value.astype(jnp.float32) + update).astype(value.dtype)
        out[path] = value
    return traverse_util.unflatten_dict(out)
