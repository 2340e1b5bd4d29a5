"""Qwen2.5-VL in Flax: Qwen2 decoder (GQA, qkv bias, RMSNorm, SwiGLU) with multimodal rotary positions
(M-RoPE) and the vision tower's features placed at the image-pad tokens. The same module runs Qwen2-VL and
Qwen3-VL (`cfg.qwen3`: q/k norm, no q/k/v bias, interleaved M-RoPE, DeepStack features added after the
first layers), as their config says.

`Qwen2_5_VL.__call__` returns final hidden states (the log-prob kernel consumes them with the LM head
directly, so [tokens, vocab] logits need never exist) or logits. An optional KV cache makes the same graph
serve prefill and decode for the sampler. Attention masks are never dense: padding is a segment id per token
and causality compares positions (see `guijax.models.attention`).
"""
from __future__ import annotations

from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from guijax.models.config import ModelConfig
from guijax.models.attention import KERNEL_PLATFORMS, attention
from guijax.models.layers import GatedMLP, Linear, RMSNorm, apply_rotary
from guijax.models.lora import LoraConfig
from guijax.models.moe import SparseMoE
from guijax.models.scan import ATTENTION_OUT, MLP_IN, maybe_remat, scanned_layers
from guijax.models.vision import VisionFeatures, VisionTower
from guijax.sharding import DATA_AXES, constrain

Dtype = Any


class KVCache(NamedTuple):
    """Keys and values of every decoder layer, stacked: [layers, batch, max_len, kv_heads, head_dim] each.

    One array per side (not one per layer) so a scan over the layers carries it and each layer writes only
    its new tokens in place."""

    k: jax.Array
    v: jax.Array


CACHE_AXES = ("layers", "batch", "seq", "kv_heads", None)


class MaskSpec(NamedTuple):
    """Causal attention over segments, the [b, s] arrays `attention` takes: segment ids are 1 for tokens and
    0 for padding; positions are None (0..s-1) without a cache and the cache slots with one."""

    q_segment_ids: jax.Array
    kv_segment_ids: jax.Array
    q_positions: jax.Array | None = None
    kv_positions: jax.Array | None = None


def mrope_axes(cfg: ModelConfig) -> np.ndarray:
    """The position axis (0 temporal, 1 height, 2 width) of each of the head_dim/2 rotary frequencies.

    Qwen2-VL and Qwen2.5-VL give each axis one contiguous band of `mrope_section` frequencies; Qwen3-VL
    interleaves them (T H W T H W ..., height and width limited to 3x their section, temporal the rest)."""
    half = cfg.head_dim // 2
    if not cfg.qwen3:
        return np.repeat(np.arange(3), cfg.mrope_section)[:half]
    j = np.arange(half)
    axes = np.zeros(half, np.int64)
    for axis in (1, 2):
        axes[(j % 3 == axis) & (j < 3 * cfg.mrope_section[axis])] = axis
    return axes


def mrope_cos_sin(positions: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """positions [3, b, s] -> cos/sin [b, s, head_dim]. Each frequency takes its angle from the position
    axis `mrope_axes` gives it; text tokens have equal positions on all three axes."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [3, b, s, dim/2]
    axes = mrope_axes(cfg)
    picked = jnp.where(axes == 0, freqs[0], jnp.where(axes == 1, freqs[1], freqs[2]))
    emb = jnp.concatenate([picked, picked], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


class Attention(nn.Module):
    cfg: ModelConfig
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    attention_impl: str = "auto"
    attention_block: int = 512  # the blockwise ("xla") attention's query and key tile
    lora: LoraConfig | None = None

    @nn.compact
    def __call__(self, x, cos, sin, mask: MaskSpec, cache: KVCache | None, cache_index, layer):
        """With a cache, the new keys/values go to slots cache_index.. of layer `layer` and the attention
        reads that layer's whole (updated) cache; a prefill into an empty cache (a mask over the new tokens
        alone) attends the new keys, square and causal as in training, so cuDNN or splash can take it."""
        cfg = self.cfg
        b, s, _ = x.shape
        hd = cfg.head_dim
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        bias = not cfg.qwen3
        proj = lambda n, axes, name, use_bias: Linear(n, axes, use_bias=use_bias, name=name,  # noqa: E731
                                                      lora=self.lora and self.lora.on(name), **kw)
        q = proj(cfg.num_attention_heads * hd, ("embed", "q_heads"), "q_proj", bias)(x)
        k = proj(cfg.num_key_value_heads * hd, ("embed", "kv_heads"), "k_proj", bias)(x)
        v = proj(cfg.num_key_value_heads * hd, ("embed", "kv_heads"), "v_proj", bias)(x)
        q, k, v = (t.reshape(b, s, -1, hd) for t in (q, k, v))
        if cfg.qwen3:  # Qwen3 normalises each head's query and key before the rotation
            q = RMSNorm(cfg.rms_norm_eps, name="q_norm", **kw)(q)
            k = RMSNorm(cfg.rms_norm_eps, name="k_norm", **kw)(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        # keys at cache slots (a decode step); else training, or a prefill into an empty cache (its keys all new)
        decoding = mask.kv_positions is not None
        if cache is not None:
            cache = KVCache(_write_layer(cache.k, k, layer, cache_index), _write_layer(cache.v, v, layer, cache_index))
            if decoding:
                k = jax.lax.dynamic_index_in_dim(cache.k, layer, 0, keepdims=False)
                v = jax.lax.dynamic_index_in_dim(cache.v, layer, 0, keepdims=False)
        # cache slots as positions are beyond cuDNN and splash: a recipe naming either still decodes
        impl = "xla" if decoding and self.attention_impl in KERNEL_PLATFORMS else self.attention_impl
        out = attention(q, k.astype(q.dtype), v.astype(q.dtype), causal=True, q_segment_ids=mask.q_segment_ids,
                        kv_segment_ids=mask.kv_segment_ids, q_positions=mask.q_positions,
                        kv_positions=mask.kv_positions, implementation=impl,
                        block_q=self.attention_block, block_k=self.attention_block)
        out = checkpoint_name(out.reshape(b, s, -1), ATTENTION_OUT)
        return proj(cfg.hidden_size, ("q_heads", "embed"), "o_proj", False)(out), cache


def _write_layer(stacked: jax.Array, new: jax.Array, layer, index) -> jax.Array:
    """stacked [layers, b, L, kvh, hd] with new [b, s, kvh, hd] written at (layer, :, index..index+s)."""
    zero = jnp.zeros((), jnp.int32)
    start = (jnp.asarray(layer, jnp.int32), zero, jnp.asarray(index, jnp.int32), zero, zero)
    return jax.lax.dynamic_update_slice(stacked, new[None].astype(stacked.dtype), start)


# logical axes that split a batch's patches, windows or image frames over the data-parallel devices; with
# per-device vision blocks the block axis does that and these stay whole within a block
BLOCK_LOCAL_AXES = ("vision_tokens", "vision_windows")


def gather_features(features: jax.Array, index: jax.Array, rows_shape: tuple[int, ...]) -> jax.Array:
    """Each token's image feature [*rows_shape, hidden]: features [F, hidden] with index [b, s], or per-device
    blocks [blocks, F, hidden] with index [blocks, b / blocks, s] into the row's own block (a batched gather,
    so it stays on the block's device)."""
    if features.ndim == 3:
        return jax.vmap(lambda f, i: jnp.take(f, i, axis=0))(features, index).reshape(*rows_shape, -1)
    return jnp.take(features, index, axis=0)


class DeepStack(NamedTuple):
    """Qwen3-VL's extra image features for the first decoder layers: after layer i < taps, the image-pad
    tokens' hidden states gain features[i][index] (index: each token's feature, as `Qwen2_5_VL.embed` places
    the merged ones)."""

    features: jax.Array  # [taps, image features, hidden]; per-device blocks: [blocks, taps, features, hidden]
    index: jax.Array  # [b, s] int; per-device blocks: [blocks, b / blocks, s], into the row's block
    is_image: jax.Array  # [b, s] bool

    def add(self, x: jax.Array, layer) -> jax.Array:
        taps = self.features.shape[-3]

        def added(x):
            tap = jax.lax.dynamic_index_in_dim(self.features, jnp.minimum(layer, taps - 1), self.features.ndim - 3,
                                               keepdims=False)
            feats = gather_features(tap, self.index, x.shape[:2]).astype(x.dtype)
            return jnp.where(self.is_image[..., None], x + feats, x)

        if isinstance(layer, int):  # unrolled: known here
            return added(x) if layer < taps else x
        return jax.lax.cond(layer < taps, added, lambda x: x, x)


class DecoderLayer(nn.Module):
    """One decoder layer, shaped as a scan body: carry (hidden, cache) -> (carry, None). `layer` is this
    layer's index into the stacked cache (a traced scan counter, or a Python int when unrolled)."""

    cfg: ModelConfig
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    attention_impl: str = "auto"
    attention_block: int = 512
    lora: LoraConfig | None = None
    expert_capacity_factor: float = 0.0

    @nn.compact
    def __call__(self, carry, cos, sin, mask, cache_index, deepstack: DeepStack | None, layer):
        x, cache = carry
        cfg = self.cfg
        kw = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        h, cache = Attention(cfg, name="self_attn", attention_impl=self.attention_impl,
                             attention_block=self.attention_block, lora=self.lora, **kw)(
            RMSNorm(cfg.rms_norm_eps, name="input_layernorm", **kw)(x), cos, sin, mask, cache, cache_index, layer)
        x = x + h
        h = checkpoint_name(RMSNorm(cfg.rms_norm_eps, name="post_attention_layernorm", **kw)(x), MLP_IN)
        if cfg.num_experts:
            x = x + SparseMoE(cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.hidden_act,
                              capacity_factor=self.expert_capacity_factor, name="mlp", **kw)(h, mask.q_segment_ids)
        else:
            x = x + GatedMLP(cfg.intermediate_size, cfg.hidden_act, name="mlp", lora=self.lora, **kw)(h)
        if deepstack is not None:
            x = deepstack.add(x, layer)
        x = nn.with_logical_constraint(x, ("batch", "seq", "activation_embed"))
        return (x, cache), None


class Qwen2_5_VL(nn.Module):
    """The full policy network. Inputs are device arrays; image-size-dependent indices come precomputed
    (see `guijax.models.positions`). `attention_impl` picks the attention backend of the decoder and the
    vision tower ("auto", "xla", "cudnn", "cudnn_packed", "splash" or the dense "reference"; see `guijax.models.attention`).

    scan_layers: run the decoder layers (and vision blocks) under `nn.scan`, parameters stacked on a leading
    layer axis (params["layers"][...] is [num_hidden_layers, ...]), so compile time does not grow with depth.
    False keeps one module per layer ("layers_0", ...), the plain reference the scan is tested against."""

    cfg: ModelConfig
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    remat_policy: str = "none"
    attention_impl: str = "auto"
    scan_layers: bool = True
    lora: LoraConfig | None = None  # low-rank adapters on the decoder projections it targets (guijax.models.lora)
    # the decoder's blockwise attention tile (queries and keys); smaller tiles skip more of a packed row's
    # cross-example pairs, larger ones make fewer, bigger matmuls
    attention_block: int = 512
    frozen: tuple[str, ...] = ()  # parameter groups training holds fixed (guijax.models.trained)
    # routed experts under expert parallelism: each destination's room per device (guijax.models.moe); 0: dropless
    expert_capacity_factor: float = 0.0

    def setup(self):
        cfg, kw = self.cfg, dict(dtype=self.dtype, param_dtype=self.param_dtype)
        if self.lora is not None:
            self.lora.check_model(cfg.num_experts, cfg.model_type)
        self.embed_tokens = self.param(
            "embed_tokens", nn.with_logical_partitioning(nn.initializers.normal(0.02), ("vocab", "embed")),
            (cfg.vocab_size, cfg.hidden_size), self.param_dtype)
        self.visual = VisionTower(cfg.vision, remat_policy=self.remat_policy, attention_impl=self.attention_impl,
                                  scan_layers=self.scan_layers, **kw)
        layer_cls = maybe_remat(DecoderLayer, self.remat_policy, scanned=self.scan_layers)
        if self.scan_layers:
            broadcast = (nn.broadcast,) * 5 + (0,)  # cos, sin, mask, cache_index, deepstack; the layer index is scanned
            self.layers = scanned_layers(layer_cls, cfg.num_hidden_layers, broadcast)(
                cfg, name="layers", attention_impl=self.attention_impl, attention_block=self.attention_block,
                lora=self.lora,
                expert_capacity_factor=self.expert_capacity_factor, **kw)
        else:
            self.layers = [layer_cls(cfg, name=f"layers_{i}", attention_impl=self.attention_impl,
                                     attention_block=self.attention_block, lora=self.lora,
                                     expert_capacity_factor=self.expert_capacity_factor, **kw)
                           for i in range(cfg.num_hidden_layers)]
        self.norm = RMSNorm(cfg.rms_norm_eps, **kw)
        if not cfg.tie_word_embeddings:
            self.lm_head = self.param(
                "lm_head", nn.with_logical_partitioning(nn.initializers.normal(0.02), ("embed", "vocab")),
                (cfg.hidden_size, cfg.vocab_size), self.param_dtype)

    def lm_head_matrix(self) -> jax.Array:
        """[hidden, vocab]: the untied head, or the transposed embedding when tied."""
        return self.embed_tokens.T if self.cfg.tie_word_embeddings else self.lm_head

    def embed(self, input_ids: jax.Array, image_features: jax.Array | None,
              token_features: jax.Array | None = None) -> jax.Array:
        """Token embeddings with image-pad tokens replaced by merged vision features.

        The k-th image-pad token (row-major over the batch) takes feature k, or with `token_features` (int
        [>= number of image-pad tokens]) feature token_features[k]: rows that share a screenshot then read
        one encoding of it. The caller guarantees the counts agree."""
        x = jnp.take(self.embed_tokens, input_ids, axis=0).astype(self.dtype)
        if image_features is None:
            return x
        is_image, index = self.image_feature_index(input_ids, image_features, token_features)
        feats = gather_features(image_features.astype(self.dtype), index, input_ids.shape)
        return jnp.where(is_image[..., None], feats, x)

    def image_feature_index(self, input_ids: jax.Array, image_features: jax.Array,
                            token_features: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """Which tokens are image pads [b, s], and the feature each takes [b, s] (see `embed`). With per-device
        blocks (features [blocks, F, hidden], token_features [blocks, ...]) each block's rows count their own
        image-pad tokens and the index is [blocks, b / blocks, s], into the row's block."""
        if image_features.ndim == 3:
            blocks = image_features.shape[0]
            is_image, index = jax.vmap(
                lambda ids, tf: self._feature_index(ids, image_features.shape[1], tf),
                in_axes=(0, None if token_features is None else 0))(
                    input_ids.reshape(blocks, -1, input_ids.shape[1]), token_features)
            return is_image.reshape(input_ids.shape), index
        return self._feature_index(input_ids, image_features.shape[0], token_features)

    def _feature_index(self, input_ids: jax.Array, n_features: int,
                       token_features: jax.Array | None) -> tuple[jax.Array, jax.Array]:
        is_image = input_ids == self.cfg.image_token_id
        order = jnp.cumsum(is_image.reshape(-1)) - 1
        if token_features is not None:
            order = jnp.take(token_features, jnp.clip(order, 0, token_features.shape[0] - 1), axis=0)
        return is_image, jnp.clip(order, 0, n_features - 1).reshape(input_ids.shape)

    def encode_images(self, **vision: jax.Array) -> VisionFeatures:
        """Features of every image in the batch: the `vision` inputs of `VisionLayout.inputs`, or those of
        per-device blocks stacked on a leading axis (`guijax.models.vision_blocks`), which the tower encodes
        vmapped over the blocks, so every gather stays within a device's own patches."""
        if vision["pixel_values"].ndim == 2:
            return self.visual(**vision)
        rules = nn.get_logical_axis_rules()
        # the block axis carries the data-parallel split; inside a block nothing is split along patches
        inner = tuple((name, None if name in BLOCK_LOCAL_AXES else axes) for name, axes in rules)
        encode = nn.vmap(lambda tower, v: tower(**v), variable_axes={"params": None}, split_rngs={"params": False},
                         spmd_axis_name=DATA_AXES if rules else None)
        with nn.logical_axis_rules(inner):
            return encode(self.visual, vision)

    def __call__(
        self,
        input_ids: jax.Array,
        positions: jax.Array,
        attention_mask: jax.Array,
        vision: dict[str, jax.Array] | None = None,
        *,
        cache: KVCache | None = None,
        cache_index: jax.Array | int = 0,
        kv_mask: jax.Array | None = None,
        return_logits: bool = True,
    ):
        """Forward pass.

        input_ids [b, s]; positions [3, b, s] M-RoPE ids; attention_mask [b, s] segment ids (1 = real token,
        or 1, 2, ... for the examples packed into a row, each attending only itself; 0 = padding, which attends
        nothing, so its outputs carry no information);
        vision: pixel_values + the VisionLayout arrays, or None for text-only; optionally `token_features`,
        the feature each image-pad token takes when the pixels hold each distinct image once (see `embed`).
        Cache mode: `cache` holds [layers, b, L, kvh, hd] keys and values, the s new tokens are written at slots
        cache_index..cache_index+s, and `kv_mask` [b, L] marks the valid slots (prompt padding excluded). At a
        static cache_index of 0 (a prefill into an empty cache) the prompt attends itself under
        `attention_mask`, and `kv_mask` is not read.
        Returns (logits or hidden [b, s, ...], new cache or None).
        """
        image_features = token_features = deepstack = None
        if vision is not None:
            vision = dict(vision)
            token_features = vision.pop("token_features", None)
            features = self.encode_images(**vision)
            image_features = features.merged
            if features.deepstack is not None:
                is_image, index = self.image_feature_index(input_ids, image_features, token_features)
                deepstack = DeepStack(features.deepstack, index, is_image)
        x = self.embed(input_ids, image_features, token_features)
        x = nn.with_logical_constraint(x, ("batch", "seq", "activation_embed"))
        cos, sin = mrope_cos_sin(positions, self.cfg)
        s = input_ids.shape[1]
        if cache is None:  # segment ids as given: 1 per row, or 1, 2, ... for the examples of a packed row
            segments = attention_mask.astype(jnp.int32)
            mask = MaskSpec(segments, segments)
        else:
            segments = (attention_mask != 0).astype(jnp.int32)
            if isinstance(cache_index, (int, np.integer)) and cache_index == 0:
                # prefill into an empty cache: every key is a new token, so the prompt attends itself (positions
                # 0..s-1 on both sides); `kv_mask` then marks the prompt's tokens, as `attention_mask` does
                mask = MaskSpec(segments, segments)
            else:
                b, total = input_ids.shape[0], cache.k.shape[2]
                slots = jnp.broadcast_to(cache_index + jnp.arange(s, dtype=jnp.int32), (b, s))
                mask = MaskSpec(segments, (kv_mask != 0).astype(jnp.int32), slots,
                                jnp.broadcast_to(jnp.arange(total, dtype=jnp.int32), (b, total)))
        x, new_cache = self._run_layers(x, cos, sin, mask, cache, cache_index, deepstack)
        x = self.norm(x)
        if not return_logits:
            return x, new_cache
        logits = jnp.einsum("bsd,dv->bsv", x, self.lm_head_matrix().astype(self.dtype),
                            preferred_element_type=jnp.float32)
        return logits, new_cache

    def _run_layers(self, x, cos, sin, mask: MaskSpec, cache: KVCache | None, cache_index,
                    deepstack: DeepStack | None = None):
        """All decoder layers: one scan, or the unrolled loop. The cache rides in the carry."""
        cache = None if cache is None else constrain_cache(cache)
        if self.scan_layers:
            layers = jnp.arange(self.cfg.num_hidden_layers, dtype=jnp.int32)
            (x, cache), _ = self.layers((x, cache), cos, sin, mask, cache_index, deepstack, layers)
        else:
            for i, layer in enumerate(self.layers):
                (x, cache), _ = layer((x, cache), cos, sin, mask, cache_index, deepstack, i)
        return x, None if cache is None else constrain_cache(cache)


def default_cache_dtype(compute_dtype: Dtype) -> Dtype:
    """The compute dtype of a bfloat16 (or float16) model: half the cache memory and bandwidth, and its keys
    and values are computed in that dtype anyway; float32 otherwise so float32 models keep exact parity."""
    dtype = jnp.dtype(compute_dtype)
    return dtype if dtype in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) else jnp.dtype(jnp.float32)


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype: Dtype | None = None,
               compute_dtype: Dtype = jnp.float32) -> KVCache:
    """An empty stacked cache; dtype defaults to `default_cache_dtype(compute_dtype)`. Under a mesh and
    logical rules its rows are split like the batch and its kv heads over "tensor" where they divide."""
    dtype = default_cache_dtype(compute_dtype) if dtype is None else dtype
    shape = (cfg.num_hidden_layers, batch, max_len, cfg.num_key_value_heads, cfg.head_dim)
    return constrain_cache(KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)))


def constrain_cache(cache: KVCache) -> KVCache:
    return KVCache(*(constrain(x, CACHE_AXES) for x in cache))
