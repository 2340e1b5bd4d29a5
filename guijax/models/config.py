"""Qwen2.5-VL, Qwen2-VL and Qwen3-VL architecture hyperparameters, presets, and the Hugging Face config.json
mapping.

Qwen2-VL and Qwen2.5-VL share the Qwen2 decoder with M-RoPE; their vision towers differ in norm (RMSNorm /
LayerNorm), block MLP (gated SiLU / fc1-fc2 QuickGELU) and attention (windows with a few full blocks / full
everywhere), which `VisionConfig.norm`, `.mlp` and `.fullatt_block_indexes` describe. Qwen3-VL keeps that
shape with Qwen3 decoder blocks (q/k RMSNorm, no q/k/v bias, an explicit head_dim, interleaved M-RoPE) and a
tower with learned position embeddings (`num_position_embeddings`) whose intermediate features at
`deepstack_layers` are merged and added to the first decoder layers' image tokens (DeepStack).

One dataclass describes the checkpoint (what `config.json` says); runtime choices (dtype, remat) live in
the run config, not here, so a saved checkpoint never depends on how it was trained.
"""
from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    depth: int = 32
    hidden_size: int = 1280
    intermediate_size: int = 3420
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 14
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    window_size: int = 112
    out_hidden_size: int = 3584
    fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)
    tokens_per_second: int = 2
    hidden_act: str = "silu"
    rope_theta: float = 10000.0
    norm: str = "rms"  # "rms" (Qwen2.5-VL) or "layer" (Qwen2-VL, Qwen3-VL)
    mlp: str = "gated"  # "gated" (gate/up/down, Qwen2.5-VL) or "plain" (fc1/fc2, Qwen2-VL, Qwen3-VL)
    num_position_embeddings: int = 0  # Qwen3-VL: a learned square grid of position embeddings, resized per image
    deepstack_layers: tuple[int, ...] = ()  # Qwen3-VL: blocks whose outputs feed the first decoder layers
    patch_bias: bool = False  # Qwen3-VL's patch embedding has a bias

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size**2


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Language-model fields follow Qwen2 names; `vision` is the vision tower; `model_type` the family."""

    vocab_size: int = 152064
    hidden_size: int = 3584
    intermediate_size: int = 18944
    num_hidden_layers: int = 28
    num_attention_heads: int = 28
    num_key_value_heads: int = 4
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    mrope_section: tuple[int, int, int] = (16, 24, 24)
    max_position_embeddings: int = 128000
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    image_token_id: int = 151655
    video_token_id: int = 151656
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653
    bos_token_id: int | None = 151643
    eos_token_id: int | None = 151645
    pad_token_id: int | None = None
    vision: VisionConfig = dataclasses.field(default_factory=VisionConfig)
    model_type: str = "qwen2_5_vl"
    explicit_head_dim: int = 0  # config.json's `head_dim` (Qwen3); 0: hidden_size / num_attention_heads
    # Qwen3-VL-MoE: every decoder layer's MLP is `num_experts` routed experts, `num_experts_per_tok` per token
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    router_aux_loss_coef: float = 0.001  # the checkpoint's own; training reads its coefficient from the run config

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim or self.hidden_size // self.num_attention_heads

    @property
    def qwen3(self) -> bool:
        """Qwen3 decoder blocks: q/k RMSNorm per head, no q/k/v bias, interleaved M-RoPE frequencies."""
        return self.model_type in ("qwen3_vl", "qwen3_vl_moe")

    def __post_init__(self):
        if self.model_type not in MODEL_TYPES:
            raise ValueError(f"model_type {self.model_type!r} is not one of {MODEL_TYPES}")
        if (self.model_type == "qwen3_vl_moe") != (self.num_experts > 0):
            raise ValueError(f"{self.model_type} with num_experts {self.num_experts}: routed experts are the "
                             "qwen3_vl_moe family's, and it has them")
        if self.num_experts and not (0 < self.num_experts_per_tok <= self.num_experts and self.moe_intermediate_size):
            raise ValueError(f"num_experts_per_tok {self.num_experts_per_tok} must be in 1..{self.num_experts} "
                             f"and moe_intermediate_size ({self.moe_intermediate_size}) positive")
        v = self.vision
        if self.qwen3 and ((v.norm, v.mlp) != ("layer", "plain") or not v.num_position_embeddings):
            raise ValueError("a qwen3_vl vision tower has LayerNorm, fc1/fc2 blocks and learned position embeddings: "
                             "build it with qwen3_vl_vision()")
        if v.num_position_embeddings and round(v.num_position_embeddings ** 0.5) ** 2 != v.num_position_embeddings:
            raise ValueError(f"vision num_position_embeddings {v.num_position_embeddings} is not a square grid")
        bad = [i for i in v.deepstack_layers if not 0 <= i < v.depth]
        if bad or list(v.deepstack_layers) != sorted(set(v.deepstack_layers)):
            raise ValueError(f"vision deepstack_layers {v.deepstack_layers} must be increasing block numbers "
                             f"below depth {v.depth}")
        if len(v.deepstack_layers) > self.num_hidden_layers:
            raise ValueError(f"{len(v.deepstack_layers)} deepstack layers feed more decoder layers than the "
                             f"{self.num_hidden_layers} there are")
        if self.model_type == "qwen2_vl" and (self.vision.norm, self.vision.mlp) != ("layer", "plain"):
            raise ValueError("a qwen2_vl vision tower has LayerNorm and fc1/fc2 blocks: build it with qwen2_vl_vision()")
        if self.model_type == "qwen2_vl" and self.vision.intermediate_size % self.vision.hidden_size:
            raise ValueError(f"qwen2_vl: vision intermediate_size {self.vision.intermediate_size} must be a multiple of "
                             f"its hidden_size {self.vision.hidden_size} (config.json stores their ratio, mlp_ratio)")
        if not self.explicit_head_dim and self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size {self.hidden_size} not divisible by num_attention_heads {self.num_attention_heads}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads {self.num_attention_heads} not divisible by num_key_value_heads {self.num_key_value_heads}")
        if 2 * sum(self.mrope_section) != self.head_dim:
            raise ValueError(f"mrope_section {self.mrope_section} must sum to head_dim/2 = {self.head_dim // 2}")
        if self.vision.out_hidden_size != self.hidden_size:
            raise ValueError(f"vision.out_hidden_size {self.vision.out_hidden_size} must equal hidden_size {self.hidden_size}")

    # ------------------------------------------------------------------ Hugging Face config.json
    def to_hf_dict(self) -> dict[str, Any]:
        """The transformers 5 layout (text_config / vision_config); transformers 4.x reads it too."""
        v = self.vision
        shared = {"depth": v.depth, "num_heads": v.num_heads, "in_channels": v.in_channels, "patch_size": v.patch_size,
                  "spatial_merge_size": v.spatial_merge_size, "temporal_patch_size": v.temporal_patch_size,
                  "hidden_act": v.hidden_act, "rope_parameters": {"rope_type": "axial", "rope_theta": v.rope_theta}}
        if self.model_type == "qwen2_vl":  # names its vision width `embed_dim` and its output width `hidden_size`
            vision = {"model_type": "qwen2_vl", "embed_dim": v.hidden_size, "hidden_size": v.out_hidden_size,
                      "mlp_ratio": v.intermediate_size // v.hidden_size}
            return self._hf_dict("Qwen2VLForConditionalGeneration", self._text_hf_dict("qwen2_vl_text"),
                                 {**vision, **shared})
        vision = {"hidden_size": v.hidden_size, "intermediate_size": v.intermediate_size,
                  "out_hidden_size": v.out_hidden_size}
        if self.qwen3:
            name = "Qwen3VLMoe" if self.num_experts else "Qwen3VL"
            text = self._text_hf_dict(f"{self.model_type}_text")
            text.pop("use_sliding_window")
            text.update(head_dim=self.head_dim, attention_bias=False)
            text["rope_parameters"]["mrope_interleaved"] = True
            if self.num_experts:
                text.update(num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                            moe_intermediate_size=self.moe_intermediate_size, decoder_sparse_step=1,
                            mlp_only_layers=[], norm_topk_prob=True, router_aux_loss_coef=self.router_aux_loss_coef)
            vision.update(model_type=f"{self.model_type}_vision", num_position_embeddings=v.num_position_embeddings,
                          deepstack_visual_indexes=list(v.deepstack_layers))
            return self._hf_dict(f"{name}ForConditionalGeneration", text, {**vision, **shared})
        vision.update(model_type="qwen2_5_vl_vision", window_size=v.window_size,
                      fullatt_block_indexes=list(v.fullatt_block_indexes), tokens_per_second=v.tokens_per_second)
        return self._hf_dict("Qwen2_5_VLForConditionalGeneration", self._text_hf_dict("qwen2_5_vl_text"),
                             {**vision, **shared})

    def _hf_dict(self, architecture: str, text: dict[str, Any], vision: dict[str, Any]) -> dict[str, Any]:
        return {
            "architectures": [architecture],
            "model_type": self.model_type,
            "image_token_id": self.image_token_id,
            "video_token_id": self.video_token_id,
            "vision_start_token_id": self.vision_start_token_id,
            "vision_end_token_id": self.vision_end_token_id,
            "tie_word_embeddings": self.tie_word_embeddings,
            "text_config": text,
            "vision_config": vision,
        }

    def _text_hf_dict(self, model_type: str) -> dict[str, Any]:
        return {
            "model_type": model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "rms_norm_eps": self.rms_norm_eps,
            "hidden_act": self.hidden_act,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta,
                                "mrope_section": list(self.mrope_section)},
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "use_sliding_window": False,
        }

    @classmethod
    def from_hf_dict(cls, data: dict[str, Any], *, source: str = "config.json") -> "ModelConfig":
        """Reads both layouts: transformers 5 (`text_config`) and the flat 4.x layout of the released
        UI-TARS-1.5 / OpenCUA / Qwen2.5-VL and UI-TARS / Qwen2-VL checkpoints (`rope_scaling: {type: mrope, ...}`)."""
        model_type = data.get("model_type") or "qwen2_5_vl"
        if model_type not in MODEL_TYPES:
            raise ValueError(f"{source}: model_type {model_type!r} is not one of {MODEL_TYPES}, the families guijax runs")
        text = dict(data.get("text_config") or {})
        for key, value in data.items():  # flat 4.x layout: text fields at the top level
            if key not in ("text_config", "vision_config"):
                text.setdefault(key, value)
        if "vision_config" not in data:
            raise ValueError(f"{source}: missing key 'vision_config'")
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
        missing = [k for k in required if k not in text]
        if missing:
            raise ValueError(f"{source}: missing keys {missing}")
        if "mrope_section" not in rope:
            raise ValueError(f"{source}: missing 'mrope_section' in rope_parameters / rope_scaling")
        vd = data["vision_config"]
        vision_rope = vd.get("rope_parameters") or {}
        if model_type == "qwen2_vl":
            embed = vd.get("embed_dim", 1280)
            vision = qwen2_vl_vision(
                vd.get("hidden_size", text["hidden_size"]), depth=vd.get("depth", 32), hidden_size=embed,
                intermediate_size=int(embed * vd.get("mlp_ratio", 4)), num_heads=vd.get("num_heads", 16),
                in_channels=vd.get("in_channels", vd.get("in_chans", 3)), patch_size=vd.get("patch_size", 14),
                spatial_merge_size=vd.get("spatial_merge_size", 2), temporal_patch_size=vd.get("temporal_patch_size", 2),
                hidden_act=vd.get("hidden_act", "quick_gelu"), rope_theta=float(vision_rope.get("rope_theta", 10000.0)))
        elif model_type in ("qwen3_vl", "qwen3_vl_moe"):
            vision = qwen3_vl_vision(
                vd.get("out_hidden_size", text["hidden_size"]), depth=vd.get("depth", 27),
                hidden_size=vd.get("hidden_size", 1152), intermediate_size=vd.get("intermediate_size", 4304),
                num_heads=vd.get("num_heads", 16), in_channels=vd.get("in_channels", 3),
                patch_size=vd.get("patch_size", 16), spatial_merge_size=vd.get("spatial_merge_size", 2),
                temporal_patch_size=vd.get("temporal_patch_size", 2),
                num_position_embeddings=vd.get("num_position_embeddings", 2304),
                deepstack_layers=tuple(vd.get("deepstack_visual_indexes", (8, 16, 24))),
                hidden_act=vd.get("hidden_act", "gelu_pytorch_tanh"),
                rope_theta=float(vision_rope.get("rope_theta", 10000.0)))
            if rope.get("mrope_interleaved") is False:
                raise ValueError(f"{source}: qwen3_vl with mrope_interleaved false is not a released layout")
            if text.get("attention_bias"):
                raise ValueError(f"{source}: qwen3_vl with attention_bias true is not supported")
            if model_type == "qwen3_vl_moe" and (text.get("decoder_sparse_step", 1) != 1 or text.get("mlp_only_layers")
                                                 or text.get("norm_topk_prob") is False):
                raise ValueError(f"{source}: only an expert MLP in every layer with renormalised top-k weights is "
                                 f"supported (decoder_sparse_step {text.get('decoder_sparse_step')}, mlp_only_layers "
                                 f"{text.get('mlp_only_layers')}, norm_topk_prob {text.get('norm_topk_prob')})")
        else:
            vision = VisionConfig(
                depth=vd.get("depth", 32), hidden_size=vd.get("hidden_size", 1280),
                intermediate_size=vd.get("intermediate_size", 3420), num_heads=vd.get("num_heads", 16),
                in_channels=vd.get("in_channels", vd.get("in_chans", 3)), patch_size=vd.get("patch_size", 14),
                spatial_merge_size=vd.get("spatial_merge_size", 2), temporal_patch_size=vd.get("temporal_patch_size", 2),
                window_size=vd.get("window_size", 112), out_hidden_size=vd.get("out_hidden_size", text["hidden_size"]),
                fullatt_block_indexes=tuple(vd.get("fullatt_block_indexes", (7, 15, 23, 31))),
                tokens_per_second=vd.get("tokens_per_second", 2), hidden_act=vd.get("hidden_act", "silu"),
                rope_theta=float(vision_rope.get("rope_theta", 10000.0)),
            )
        eos = text.get("eos_token_id", 151645)
        moe = text if model_type == "qwen3_vl_moe" else {}  # dense families' configs may carry unused MoE keys
        return cls(
            vocab_size=text["vocab_size"], hidden_size=text["hidden_size"],
            intermediate_size=text["intermediate_size"], num_hidden_layers=text["num_hidden_layers"],
            num_attention_heads=text["num_attention_heads"],
            num_key_value_heads=text.get("num_key_value_heads") or text["num_attention_heads"],
            rms_norm_eps=text.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta", text.get("rope_theta", 1000000.0))),
            mrope_section=tuple(rope["mrope_section"]),
            max_position_embeddings=text.get("max_position_embeddings", 128000),
            tie_word_embeddings=bool(data.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
            hidden_act=text.get("hidden_act", "silu"),
            image_token_id=data.get("image_token_id", 151655), video_token_id=data.get("video_token_id", 151656),
            vision_start_token_id=data.get("vision_start_token_id", 151652),
            vision_end_token_id=data.get("vision_end_token_id", 151653),
            bos_token_id=text.get("bos_token_id"), eos_token_id=eos[0] if isinstance(eos, list) else eos,
            pad_token_id=text.get("pad_token_id"), vision=vision, model_type=model_type,
            explicit_head_dim=int(text.get("head_dim") or 0) if model_type.startswith("qwen3") else 0,
            num_experts=int(moe.get("num_experts") or moe.get("num_local_experts") or 0),
            num_experts_per_tok=int(moe.get("num_experts_per_tok") or 0),
            moe_intermediate_size=int(moe.get("moe_intermediate_size") or 0),
            router_aux_loss_coef=float(text.get("router_aux_loss_coef", 0.001)),
        )

    @classmethod
    def from_json_file(cls, path: str | pathlib.Path) -> "ModelConfig":
        path = pathlib.Path(path)
        if not path.exists():
            raise FileNotFoundError(f"model config not found: {path}")
        return cls.from_hf_dict(json.loads(path.read_text()), source=str(path))

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


MODEL_TYPES = ("qwen2_5_vl", "qwen2_vl", "qwen3_vl", "qwen3_vl_moe")


def _vision(out: int, **kw: Any) -> VisionConfig:
    return VisionConfig(out_hidden_size=out, **kw)


def qwen2_vl_vision(out: int, depth: int = 32, **kw: Any) -> VisionConfig:
    """A Qwen2-VL vision tower: LayerNorm + fc1/fc2 QuickGELU blocks, full attention in every block."""
    kw = {"hidden_size": 1280, "intermediate_size": 5120, "hidden_act": "quick_gelu", **kw}
    return VisionConfig(out_hidden_size=out, depth=depth, fullatt_block_indexes=tuple(range(depth)), norm="layer",
                        mlp="plain", **kw)


def qwen3_vl_vision(out: int, depth: int = 27, **kw: Any) -> VisionConfig:
    """A Qwen3-VL vision tower: 16-px patches with a bias, learned position embeddings, LayerNorm + fc1/fc2
    tanh-GELU blocks with full attention, and DeepStack taps after blocks 8, 16 and 24."""
    kw = {"hidden_size": 1152, "intermediate_size": 4304, "hidden_act": "gelu_pytorch_tanh", "patch_size": 16,
          "num_position_embeddings": 2304, "deepstack_layers": (8, 16, 24), **kw}
    return qwen2_vl_vision(out, depth, patch_bias=True, **kw)  # Qwen2-VL's block shape, with those additions


def _small_vocab_ids(vocab: int) -> dict[str, int]:
    """Special-token ids inside a small vocabulary; fresh checkpoints replace them with their tokenizer's."""
    return dict(image_token_id=vocab - 4, video_token_id=vocab - 3, vision_start_token_id=vocab - 2,
                vision_end_token_id=vocab - 1, bos_token_id=vocab - 6, eos_token_id=vocab - 5)


# Presets. The four released sizes match the Hugging Face config.json of Qwen/Qwen2.5-VL-{3,7,32,72}B-Instruct
# (UI-TARS-1.5-7B and OpenCUA-7B use the 7B one). `tiny` is for tests, `small` for the CPU recipes.
PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(
        vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, mrope_section=(2, 3, 3), max_position_embeddings=4096, tie_word_embeddings=False,
        **_small_vocab_ids(1024),
        vision=_vision(64, depth=2, hidden_size=32, intermediate_size=64, num_heads=2, window_size=56,
                       fullatt_block_indexes=(1,)),
    ),
    "small": ModelConfig(
        vocab_size=4096, hidden_size=384, intermediate_size=1024, num_hidden_layers=6, num_attention_heads=6,
        num_key_value_heads=2, mrope_section=(8, 12, 12), max_position_embeddings=8192, tie_word_embeddings=True,
        **_small_vocab_ids(4096),
        vision=_vision(384, depth=4, hidden_size=192, intermediate_size=512, num_heads=3, window_size=112,
                       fullatt_block_indexes=(1, 3)),
    ),
    "tiny_qwen2_vl": ModelConfig(
        vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, mrope_section=(2, 3, 3), max_position_embeddings=4096, tie_word_embeddings=False,
        **_small_vocab_ids(1024), model_type="qwen2_vl",
        vision=qwen2_vl_vision(64, depth=2, hidden_size=32, intermediate_size=128, num_heads=2),
    ),
    # Qwen/Qwen2-VL-7B-Instruct's config.json: the architecture of UI-TARS-7B-DPO (SEAgent's policy)
    "qwen2_vl_7b": ModelConfig(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
        num_key_value_heads=4, max_position_embeddings=32768, tie_word_embeddings=False, model_type="qwen2_vl",
        vision=qwen2_vl_vision(3584),
    ),
    # odd head counts, a head_dim that is not hidden/heads, and DeepStack taps inside and after a run of blocks
    "tiny_qwen3_vl": ModelConfig(
        vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=3,
        num_key_value_heads=1, explicit_head_dim=16, mrope_section=(4, 2, 2), max_position_embeddings=4096,
        tie_word_embeddings=False, rope_theta=5000000.0, **_small_vocab_ids(1024), model_type="qwen3_vl",
        vision=qwen3_vl_vision(64, depth=4, hidden_size=32, intermediate_size=64, num_heads=2,
                               num_position_embeddings=16, deepstack_layers=(1, 2)),
    ),
    # Qwen/Qwen3-VL-8B-Instruct and -32B-Instruct's config.json (EvoCUA's and SGCD's dense policies)
    "qwen3_vl_8b": ModelConfig(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, explicit_head_dim=128, mrope_section=(24, 20, 20), max_position_embeddings=262144,
        rope_theta=5000000.0, tie_word_embeddings=False, model_type="qwen3_vl", vision=qwen3_vl_vision(4096),
    ),
    "qwen3_vl_32b": ModelConfig(
        vocab_size=151936, hidden_size=5120, intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64,
        num_key_value_heads=8, explicit_head_dim=128, mrope_section=(24, 20, 20), max_position_embeddings=262144,
        rope_theta=5000000.0, tie_word_embeddings=False, model_type="qwen3_vl", vision=qwen3_vl_vision(5120),
    ),
    # eight experts, three per token, of an odd width
    "tiny_qwen3_vl_moe": ModelConfig(
        vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=3,
        num_key_value_heads=1, explicit_head_dim=16, mrope_section=(4, 2, 2), max_position_embeddings=4096,
        tie_word_embeddings=False, rope_theta=5000000.0, **_small_vocab_ids(1024), model_type="qwen3_vl_moe",
        num_experts=8, num_experts_per_tok=3, moe_intermediate_size=24,
        vision=qwen3_vl_vision(64, depth=4, hidden_size=32, intermediate_size=64, num_heads=2,
                               num_position_embeddings=16, deepstack_layers=(1, 2)),
    ),
    # Qwen/Qwen3-VL-30B-A3B-Instruct's config.json (SGCD's MoE policy)
    "qwen3_vl_30b_a3b": ModelConfig(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32,
        num_key_value_heads=4, explicit_head_dim=128, mrope_section=(24, 20, 20), max_position_embeddings=262144,
        rope_theta=5000000.0, tie_word_embeddings=False, model_type="qwen3_vl_moe", num_experts=128,
        num_experts_per_tok=8, moe_intermediate_size=768, vision=qwen3_vl_vision(2048),
    ),
    "qwen2_5_vl_3b": ModelConfig(
        vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
        num_key_value_heads=2, tie_word_embeddings=True, vision=_vision(2048),
    ),
    "qwen2_5_vl_7b": ModelConfig(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
        num_key_value_heads=4, tie_word_embeddings=False, vision=_vision(3584),
    ),
    "qwen2_5_vl_32b": ModelConfig(
        vocab_size=152064, hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40,
        num_key_value_heads=8, tie_word_embeddings=False, vision=_vision(5120),
    ),
    "qwen2_5_vl_72b": ModelConfig(
        vocab_size=152064, hidden_size=8192, intermediate_size=29568, num_hidden_layers=80, num_attention_heads=64,
        num_key_value_heads=8, tie_word_embeddings=False, vision=_vision(8192),
    ),
}


def get_preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise KeyError(f"unknown model preset {name!r}; available: {sorted(PRESETS)}")
    return PRESETS[name]
