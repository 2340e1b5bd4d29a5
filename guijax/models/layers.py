"""Building blocks shared by the vision tower and the language model.

Parameters carry logical axis names (see guijax/sharding.py) so one rule table decides how every weight
is laid out on the mesh. Kernels are [in, out] (Flax convention); the checkpoint loader transposes the
[out, in] Hugging Face weights.
"""
from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from guijax.models import lora as lora_lib
from guijax.models.rows import rows_matmul

Dtype = Any


class _Norm(nn.Module):
    eps: float = 1e-6
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    axis_name: str = "norm"


class RMSNorm(_Norm):
    """RMSNorm computed in float32, the result cast back before the weight multiply (as Qwen2 does)."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        weight = self.param("weight", nn.with_logical_partitioning(nn.initializers.ones, (self.axis_name,)),
                            (x.shape[-1],), self.param_dtype)
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return weight.astype(self.dtype) * normed.astype(self.dtype)


class LayerNorm(_Norm):
    """LayerNorm with weight and bias, computed in float32 (the Qwen2-VL vision tower's norm)."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        axes = (self.axis_name,)
        weight = self.param("weight", nn.with_logical_partitioning(nn.initializers.ones, axes), (x.shape[-1],),
                            self.param_dtype)
        bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros, axes), (x.shape[-1],),
                          self.param_dtype)
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
        normed = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
        return (normed * weight.astype(jnp.float32) + bias.astype(jnp.float32)).astype(self.dtype)


def norm_layer(kind: str) -> type[nn.Module]:
    """The norm a config names: "rms" (Qwen2/2.5) or "layer" (the Qwen2-VL vision tower)."""
    kinds = {"rms": RMSNorm, "layer": LayerNorm}
    if kind not in kinds:
        raise ValueError(f"unsupported norm {kind!r}; supported: {sorted(kinds)}")
    return kinds[kind]


class Linear(nn.Module):
    """Dense layer with logical axes for its kernel ([in, out]) and bias ([out]); with `lora`, plus a
    low-rank adapter (see guijax.models.lora)."""

    features: int
    axes: tuple[str, str]
    use_bias: bool = False
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    init_std: float = 0.02
    lora: lora_lib.LoraConfig | None = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kernel = self.param(
            "kernel", nn.with_logical_partitioning(nn.initializers.normal(self.init_std), self.axes),
            (x.shape[-1], self.features), self.param_dtype)
        y = rows_matmul(x.astype(self.dtype), kernel.astype(self.dtype))
        if self.use_bias:
            bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros, (self.axes[1],)),
                              (self.features,), self.param_dtype)
            y = y + bias.astype(self.dtype)
        if self.lora is not None:
            r = self.lora.rank
            a = self.param("lora_a", nn.with_logical_partitioning(lora_lib.init_a, (self.axes[0], "lora_rank")),
                           (x.shape[-1], r), jnp.float32)
            b = self.param("lora_b", nn.with_logical_partitioning(nn.initializers.zeros, ("lora_rank", self.axes[1])),
                           (r, self.features), jnp.float32)
            key = self.make_rng("dropout") if self.lora.dropout > 0 and self.has_rng("dropout") else None
            y = y + lora_lib.delta(x, a, b, self.lora, self.dtype, key)
        return y


ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "silu": jax.nn.silu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),
}


def activation(name: str) -> Callable[[jax.Array], jax.Array]:
    if name not in ACTIVATIONS:
        raise ValueError(f"unsupported hidden_act {name!r}; supported: {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]


class GatedMLP(nn.Module):
    """SwiGLU MLP: down(act(gate(x)) * up(x))."""

    intermediate_size: int
    hidden_act: str = "silu"
    use_bias: bool = False
    embed_axis: str = "embed"
    mlp_axis: str = "mlp"
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    lora: lora_lib.LoraConfig | None = None  # adapters on the projections it targets (decoder MLPs)

    def _linear(self, features: int, axes: tuple[str, str], name: str) -> Linear:
        return Linear(features, axes, use_bias=self.use_bias, dtype=self.dtype, param_dtype=self.param_dtype,
                      lora=self.lora and self.lora.on(name), name=name)

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        gate = self._linear(self.intermediate_size, (self.embed_axis, self.mlp_axis), "gate_proj")(x)
        up = self._linear(self.intermediate_size, (self.embed_axis, self.mlp_axis), "up_proj")(x)
        return self._linear(x.shape[-1], (self.mlp_axis, self.embed_axis), "down_proj")(
            activation(self.hidden_act)(gate) * up)


class PlainMLP(GatedMLP):
    """fc2(act(fc1(x))): the Qwen2-VL vision blocks' MLP (same fields as the gated one, no gate)."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kw = dict(use_bias=self.use_bias, dtype=self.dtype, param_dtype=self.param_dtype)
        h = Linear(self.intermediate_size, (self.embed_axis, self.mlp_axis), name="fc1", **kw)(x)
        return Linear(x.shape[-1], (self.mlp_axis, self.embed_axis), name="fc2", **kw)(activation(self.hidden_act)(h))


def rotate_half(x: jax.Array) -> jax.Array:
    half = x.shape[-1] // 2
    return jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def apply_rotary(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [..., seq, heads, head_dim]; cos/sin [..., seq, head_dim] broadcast over heads; math in float32."""
    x32 = x.astype(jnp.float32)
    cos, sin = cos[..., None, :].astype(jnp.float32), sin[..., None, :].astype(jnp.float32)
    return (x32 * cos + rotate_half(x32) * sin).astype(x.dtype)

