"""Qwen2.5-VL, Qwen2-VL and Qwen3-VL vision towers: 3-D patch embedding, 2-D rotary attention in windows (full
attention in the blocks listed by `fullatt_block_indexes`: every block for Qwen2-VL and Qwen3-VL), RMSNorm +
gated MLP blocks (Qwen2.5-VL) or LayerNorm + fc1/fc2 MLP blocks (Qwen2-VL, Qwen3-VL: `cfg.norm` / `cfg.mlp`),
and the 2x2 patch merger. Qwen3-VL adds learned position embeddings (a square grid blended per patch) and
DeepStack: the outputs of the blocks in `cfg.deepstack_layers`, each through its own merger, which the
language model adds to the image tokens of its first layers.

Image-size-dependent indices (window permutation, segments, window gathers) come precomputed from
`guijax.models.positions.vision_layout`, so this module is shape-static under jit.

Windowed blocks gather each window's tokens into a padded [windows, max_window, heads, head_dim] batch and
attend within the rows, so their cost is linear in the patch count; full-attention blocks run the blockwise
attention over all patches with one segment per image. The "reference" implementation instead masks one
dense N x N square by segment (windows or images), as the original formulation does.
"""
from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from guijax.models.config import VisionConfig
from guijax.models.attention import attention
from guijax.models.layers import GatedMLP, Linear, PlainMLP, apply_rotary, norm_layer
from guijax.models.scan import ATTENTION_OUT, MLP_IN, maybe_remat, scanned_layers

Dtype = Any


def vision_rotary(rotary_positions: jax.Array, cfg: VisionConfig) -> tuple[jax.Array, jax.Array]:
    """cos/sin [N, head_dim]: rows use head_dim/4 frequencies each for the patch row and column."""
    spatial_dim = cfg.head_dim // 2
    inv_freq = 1.0 / (cfg.rope_theta ** (jnp.arange(0, spatial_dim, 2, dtype=jnp.float32) / spatial_dim))
    freqs = rotary_positions.astype(jnp.float32)[..., None] * inv_freq  # [N, 2, hd/4]
    freqs = freqs.reshape(freqs.shape[0], -1)  # (h freqs, w freqs)
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def window_attention(q: jax.Array, k: jax.Array, v: jax.Array, window_tokens: jax.Array, window_slots: jax.Array,
                     implementation: str) -> jax.Array:
    """q, k, v [N, heads, hd] -> [N, heads, hd], each token attending only the tokens of its group: an
    attention window (windowed blocks) or an image frame (full-attention blocks).

    window_tokens [W, L] (-1 = padding) gathers the groups into rows; window_slots [N] gathers back. The rows
    are split over the data-parallel devices, so each device attends its share of windows or images.

    Every row is right-padded by construction (a group's tokens, then -1), so the GPU's `auto` needs no
    run-time layout check. An empty row (per-device blocks are padded with them) attends one stand-in token
    instead of none: its output is never gathered back, so its cotangent, and with it every gradient it
    sends, is exactly 0, and a kernel that needs a non-empty prefix (cuDNN) stays finite on it."""
    n, heads, hd = q.shape
    valid = jnp.asarray(window_tokens) >= 0
    valid = valid.at[:, 0].set(True) if valid.shape[1] else valid
    index = jnp.maximum(window_tokens, 0)
    rows = lambda x: nn.with_logical_constraint(x, ("vision_windows", None, None, None))  # noqa: E731
    qw, kw, vw = (rows(jnp.take(x, index, axis=0)) for x in (q, k, v))
    ids = valid.astype(jnp.int32)
    out = attention(qw, kw, vw, q_segment_ids=ids, kv_segment_ids=ids, implementation=implementation,
                    row_axis="vision_windows", right_padded=True)
    return jnp.take(rows(out).reshape(-1, heads, hd), window_slots, axis=0)


class VisionAttention(nn.Module):
    cfg: VisionConfig
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    windowed: bool = False
    attention_impl: str = "auto"

    @nn.compact
    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, segments: jax.Array, window_tokens: jax.Array,
                 window_slots: jax.Array) -> jax.Array:
        """segments [N]: each token's window (windowed blocks) or image (full blocks), ids from 0;
        window_tokens / window_slots: the matching gathers (of windows, or of image frames)."""
        n, e = x.shape
        heads = self.cfg.num_heads
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        qkv = Linear(3 * e, ("vision_embed", "vision_heads"), use_bias=True, name="qkv", **kw)(x)
        q, k, v = jnp.moveaxis(qkv.reshape(n, 3, heads, e // heads), 1, 0)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if self.attention_impl != "reference":
            out = window_attention(q, k, v, window_tokens, window_slots, self.attention_impl)
        else:
            ids = segments[None].astype(jnp.int32) + 1  # 0 is the padding id
            out = attention(q[None], k[None], v[None], q_segment_ids=ids, kv_segment_ids=ids,
                            implementation=self.attention_impl)[0]
        out = checkpoint_name(out.reshape(n, e), ATTENTION_OUT)
        return Linear(e, ("vision_heads", "vision_embed"), use_bias=True, name="proj", **kw)(out)


class VisionBlock(nn.Module):
    """One block, shaped as a scan body: x -> (x, None)."""

    cfg: VisionConfig
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    windowed: bool = False
    attention_impl: str = "auto"

    @nn.compact
    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, segments: jax.Array, window_tokens: jax.Array,
                 window_slots: jax.Array) -> tuple[jax.Array, None]:
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        norm = norm_layer(self.cfg.norm)
        x = nn.with_logical_constraint(x, ("vision_tokens", None))  # patches split over the data-parallel devices
        x = x + VisionAttention(self.cfg, name="attn", windowed=self.windowed, attention_impl=self.attention_impl,
                                **kw)(norm(1e-6, name="norm1", axis_name="vision_norm", **kw)(x), cos, sin,
                                      segments, window_tokens, window_slots)
        h = checkpoint_name(norm(1e-6, name="norm2", axis_name="vision_norm", **kw)(x), MLP_IN)
        mlp_axes = dict(embed_axis="vision_embed", mlp_axis="vision_mlp", name="mlp", **kw)
        if self.cfg.mlp == "gated":
            mlp = GatedMLP(self.cfg.intermediate_size, self.cfg.hidden_act, use_bias=True, **mlp_axes)
        else:
            mlp = PlainMLP(self.cfg.intermediate_size, self.cfg.hidden_act, use_bias=True, **mlp_axes)
        return x + mlp(h), None


@dataclasses.dataclass(frozen=True)
class BlockPlan:
    """The vision blocks as `repeats` copies of one period, a period being runs of identical blocks (same
    attention kind). Qwen2.5-VL-7B (full attention at 7, 15, 23, 31 of 32) is 4 x (7 windowed, 1 full):
    two scanned runs inside a scan over periods, so the program holds one windowed and one full block.

    A tower with DeepStack taps is one period whose runs end at the tapped blocks (`taps`: the runs whose
    last block's output is a DeepStack feature); Qwen3-VL-8B is 1 x (9, 8, 8, 2) full blocks."""

    repeats: int
    runs: tuple[tuple[bool, int], ...]  # (windowed, number of blocks) for each run of a period
    taps: tuple[int, ...] = ()

    @property
    def period(self) -> int:
        return sum(n for _, n in self.runs)

    def block_index(self, repeat: int, run: int, position: int) -> int:
        """The checkpoint block number of `position` in run `run` of period `repeat`."""
        return repeat * self.period + sum(n for _, n in self.runs[:run]) + position


def block_plan(cfg: VisionConfig) -> BlockPlan:
    """The shortest period that tiles the blocks' attention kinds, cut into runs (and at DeepStack taps)."""
    kinds = [i not in cfg.fullatt_block_indexes for i in range(cfg.depth)]
    period = next(p for p in range(1, cfg.depth + 1)
                  if cfg.depth % p == 0 and kinds == kinds[:p] * (cfg.depth // p))
    if cfg.deepstack_layers:
        period = cfg.depth
    runs: list[tuple[bool, int]] = []
    taps: list[int] = []
    for i, windowed in enumerate(kinds[:period]):
        if runs and runs[-1][0] == windowed and i - 1 not in cfg.deepstack_layers:
            runs[-1] = (windowed, runs[-1][1] + 1)
        else:
            runs.append((windowed, 1))
        if i in cfg.deepstack_layers:
            taps.append(len(runs) - 1)
    return BlockPlan(cfg.depth // period, tuple(runs), tuple(taps))


class VisionPeriod(nn.Module):
    """One period of a `BlockPlan`, shaped as a scan body: each run of identical blocks is one `nn.scan`
    (parameters under "run_{k}", [run length, ...]). Its scan output is the hidden states after each tapped
    run (a tuple, empty without DeepStack)."""

    cfg: VisionConfig
    runs: tuple[tuple[bool, int], ...]
    taps: tuple[int, ...] = ()
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    remat_policy: str = "none"
    attention_impl: str = "auto"

    @nn.compact
    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, full_segments: jax.Array,
                 window_segments: jax.Array, window_tokens: jax.Array, window_slots: jax.Array,
                 image_tokens: jax.Array, image_slots: jax.Array) -> tuple[jax.Array, tuple[jax.Array, ...]]:
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        block_cls = maybe_remat(VisionBlock, self.remat_policy, scanned=True)
        tapped = []
        for k, (windowed, length) in enumerate(self.runs):
            run = scanned_layers(block_cls, length, nn.broadcast)(
                self.cfg, windowed=windowed, attention_impl=self.attention_impl, name=f"run_{k}", **kw)
            groups = (window_segments, window_tokens, window_slots) if windowed else (
                full_segments, image_tokens, image_slots)
            x, _ = run(x, cos, sin, *groups)
            if k in self.taps:
                tapped.append(x)
        return x, tuple(tapped)


class PatchMerger(nn.Module):
    """Each 2x2 group of neighbouring patches (adjacent rows after the processor's block ordering) is
    concatenated and projected to the language model width by a GELU MLP. The norm comes before the
    concatenation (the tower's output merger) or, `postshuffle`, after it (Qwen3-VL's DeepStack mergers)."""

    cfg: VisionConfig
    postshuffle: bool = False
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        unit = self.cfg.spatial_merge_size ** 2
        width = self.cfg.hidden_size * unit
        norm = norm_layer(self.cfg.norm)(1e-6, name="ln_q", axis_name="vision_norm", **kw)
        x = norm(x.reshape(-1, width)) if self.postshuffle else norm(x).reshape(-1, width)
        x = Linear(width, ("vision_merge", "vision_mlp"), use_bias=True, name="mlp_0", **kw)(x)
        x = jax.nn.gelu(x, approximate=False)
        return Linear(self.cfg.out_hidden_size, ("vision_mlp", "embed"), use_bias=True, name="mlp_2", **kw)(x)


class VisionFeatures(NamedTuple):
    """What the tower gives the language model, in the processor's patch order: the merged features
    [N/4, out_hidden] for the image-pad tokens, and (DeepStack towers) one more set per tapped block
    [taps, N/4, out_hidden] that the first decoder layers add to them; None without taps."""

    merged: jax.Array
    deepstack: jax.Array | None = None


class VisionTower(nn.Module):
    """pixel_values [N, C*T*P*P] (window-independent processor order) -> VisionFeatures in the original
    (processor) order, ready to be placed at the image-pad tokens."""

    cfg: VisionConfig
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    remat_policy: str = "none"
    attention_impl: str = "auto"
    scan_layers: bool = True  # blocks under nested scans (see BlockPlan); False: one module per block

    @nn.compact
    def __call__(self, pixel_values: jax.Array, window_index: jax.Array, rotary_positions: jax.Array,
                 full_segments: jax.Array, window_segments: jax.Array, window_tokens: jax.Array,
                 window_slots: jax.Array, image_tokens: jax.Array, image_slots: jax.Array,
                 pos_indices: jax.Array | None = None, pos_weights: jax.Array | None = None) -> VisionFeatures:
        cfg = self.cfg
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        unit = cfg.spatial_merge_size ** 2
        # Conv3d with kernel == stride == patch is a linear map of the flattened (C, T, P, P) patch.
        x = Linear(cfg.hidden_size, ("vision_patch", "vision_embed"), use_bias=cfg.patch_bias, name="patch_embed",
                   **kw)(pixel_values)
        n = x.shape[0]
        x = x.reshape(n // unit, unit, -1)[window_index].reshape(n, -1)
        if cfg.num_position_embeddings:
            x = x + self._position_embeddings(pos_indices, pos_weights)
        cos, sin = vision_rotary(rotary_positions, cfg)
        groups = {True: (window_segments, window_tokens, window_slots), False: (full_segments, image_tokens, image_slots)}
        tapped: list[jax.Array] = []
        if self.scan_layers and cfg.depth:
            plan = block_plan(cfg)
            # the period is rematerialised too: otherwise the outer scan keeps every inner block's residuals
            # (measured, 3B at one full-HD screenshot: 37.9 GiB of temporaries against 9.8 GiB)
            period = maybe_remat(VisionPeriod, self.remat_policy, scanned=True)
            blocks = scanned_layers(period, plan.repeats, nn.broadcast, axis_name="layer_groups")(
                cfg, plan.runs, plan.taps, remat_policy=self.remat_policy, attention_impl=self.attention_impl,
                name="blocks", **kw)
            x, taps = blocks(x, cos, sin, full_segments, window_segments, window_tokens, window_slots, image_tokens,
                             image_slots)
            tapped = [t[0] for t in taps]  # a tapped plan is a single period
        else:
            block_cls = maybe_remat(VisionBlock, self.remat_policy)
            for i in range(cfg.depth):
                windowed = i not in cfg.fullatt_block_indexes
                x, _ = block_cls(cfg, windowed=windowed, attention_impl=self.attention_impl, name=f"blocks_{i}",
                                 **kw)(x, cos, sin, *groups[windowed])
                if i in cfg.deepstack_layers:
                    tapped.append(x)
        order = jnp.argsort(window_index)
        merged = PatchMerger(cfg, name="merger", **kw)(x)[order]
        if not tapped:
            return VisionFeatures(merged)
        deepstack = [PatchMerger(cfg, postshuffle=True, name=f"deepstack_{k}", **kw)(t)[order]
                     for k, t in enumerate(tapped)]
        return VisionFeatures(merged, jnp.stack(deepstack))

    def _position_embeddings(self, indices: jax.Array, weights: jax.Array) -> jax.Array:
        """Each patch's blend of the learned grid (float32, as transformers sums it), in the compute dtype."""
        table = self.param("pos_embed", nn.with_logical_partitioning(nn.initializers.normal(0.02),
                                                                     ("vision_positions", "vision_embed")),
                           (self.cfg.num_position_embeddings, self.cfg.hidden_size), self.param_dtype)
        blend = jnp.sum(jnp.take(table, indices, axis=0).astype(jnp.float32) * weights[..., None], axis=1)
        return blend.astype(self.dtype)
