"""Qwen2.5-VL vision tower: 3-D patch embedding, 2-D rotary attention in windows (full attention in the
blocks listed by `fullatt_block_indexes`), RMSNorm + gated MLP blocks, and the 2x2 patch merger.

Image-size-dependent indices (window permutation, segments) come precomputed from
`guijax.models.positions.vision_layout`, so this module is shape-static under jit.
"""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from guijax.models.config import VisionConfig
from guijax.models.layers import GatedMLP, Linear, RMSNorm, apply_rotary, dot_product_attention

Dtype = Any


def vision_rotary(rotary_positions: jax.Array, cfg: VisionConfig) -> tuple[jax.Array, jax.Array]:
    """cos/sin [N, head_dim]: rows use head_dim/4 frequencies each for the patch row and column."""
    spatial_dim = cfg.head_dim // 2
    inv_freq = 1.0 / (cfg.rope_theta ** (jnp.arange(0, spatial_dim, 2, dtype=jnp.float32) / spatial_dim))
    freqs = rotary_positions.astype(jnp.float32)[..., None] * inv_freq  # [N, 2, hd/4]
    freqs = freqs.reshape(freqs.shape[0], -1)  # (h freqs, w freqs)
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


class VisionAttention(nn.Module):
    cfg: VisionConfig
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, segments: jax.Array) -> jax.Array:
        n, e = x.shape
        heads = self.cfg.num_heads
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        qkv = Linear(3 * e, ("vision_embed", "vision_heads"), use_bias=True, name="qkv", **kw)(x)
        q, k, v = jnp.moveaxis(qkv.reshape(n, 3, heads, e // heads), 1, 0)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        mask = segments[:, None] == segments[None, :]
        out = dot_product_attention(q[None], k[None], v[None], mask[None])[0]
        return Linear(e, ("vision_heads", "vision_embed"), use_bias=True, name="proj", **kw)(out.reshape(n, e))


class VisionBlock(nn.Module):
    cfg: VisionConfig
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, segments: jax.Array) -> jax.Array:
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        x = x + VisionAttention(self.cfg, name="attn", **kw)(
            RMSNorm(1e-6, name="norm1", axis_name="vision_norm", **kw)(x), cos, sin, segments)
        h = RMSNorm(1e-6, name="norm2", axis_name="vision_norm", **kw)(x)
        return x + GatedMLP(self.cfg.intermediate_size, self.cfg.hidden_act, use_bias=True, embed_axis="vision_embed",
                            mlp_axis="vision_mlp", name="mlp", **kw)(h)


class PatchMerger(nn.Module):
    """RMSNorm, then each 2x2 group of neighbouring patches (adjacent rows after the processor's block
    ordering) is concatenated and projected to the language model width by a GELU MLP."""

    cfg: VisionConfig
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        unit = self.cfg.spatial_merge_size ** 2
        width = self.cfg.hidden_size * unit
        x = RMSNorm(1e-6, name="ln_q", axis_name="vision_norm", **kw)(x).reshape(-1, width)
        x = Linear(width, ("vision_merge", "vision_mlp"), use_bias=True, name="mlp_0", **kw)(x)
        x = jax.nn.gelu(x, approximate=False)
        return Linear(self.cfg.out_hidden_size, ("vision_mlp", "embed"), use_bias=True, name="mlp_2", **kw)(x)


class VisionTower(nn.Module):
    """pixel_values [N, C*T*P*P] (window-independent processor order) -> merged features [N/4, out_hidden]
    in the original (processor) order, ready to be placed at the image-pad tokens."""

    cfg: VisionConfig
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    remat_policy: str = "none"

    @nn.compact
    def __call__(self, pixel_values: jax.Array, window_index: jax.Array, rotary_positions: jax.Array,
                 full_segments: jax.Array, window_segments: jax.Array) -> jax.Array:
        cfg = self.cfg
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        unit = cfg.spatial_merge_size ** 2
        # Conv3d with kernel == stride == patch is a linear map of the flattened (C, T, P, P) patch.
        x = Linear(cfg.hidden_size, ("vision_patch", "vision_embed"), name="patch_embed", **kw)(pixel_values)
        n = x.shape[0]
        x = x.reshape(n // unit, unit, -1)[window_index].reshape(n, -1)
        cos, sin = vision_rotary(rotary_positions, cfg)
        block_cls = _maybe_remat(VisionBlock, self.remat_policy)
        for i in range(cfg.depth):
            segments = full_segments if i in cfg.fullatt_block_indexes else window_segments
            x = block_cls(cfg, name=f"blocks_{i}", **kw)(x, cos, sin, segments)
        merged = PatchMerger(cfg, name="merger", **kw)(x)
        return merged[jnp.argsort(window_index)]


REMAT_POLICIES = ("none", "full", "dots_saveable")


def _maybe_remat(cls: type[nn.Module], policy: str) -> type[nn.Module]:
    """Wrap a layer class in rematerialisation: 'full' saves nothing, 'dots_saveable' keeps matmul outputs."""
    if policy == "none":
        return cls
    if policy == "full":
        return nn.remat(cls, prevent_cse=True)
    if policy == "dots_saveable":
        return nn.remat(cls, prevent_cse=True, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
    raise ValueError(f"unknown remat policy {policy!r}; choose one of {REMAT_POLICIES}")
