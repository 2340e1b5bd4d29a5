"""Qwen2.5-VL input processing in numpy: smart-resize, normalise and patchify screenshots, and expand each
`<|image_pad|>` to one token per merged 28x28 patch, giving the same arrays as transformers' processor.

Kept in numpy (no torch, no torchvision) so it runs inside grain workers and on CPU hosts; values equal the
reference `Qwen2VLImageProcessorPil` (tests/guijax/test_processor.py checks it).
"""
from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any, Sequence

import numpy as np
from PIL import Image

from envs.actions import resize as envs_resize

IMAGE_PAD = "<|image_pad|>"
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def preprocessor_config(cfg: Any) -> dict[str, Any]:
    """The preprocessor_config.json of a fresh checkpoint of `cfg` (a ModelConfig): its family's patch grid
    and normalisation (Qwen3-VL: 16-px patches, mean and std 0.5), with pixel bounds of 4 to 1280 merged
    patches as the Qwen2.5-VL processor has."""
    from guijax.models.tokenizer import PREPROCESSOR_CONFIG

    v = cfg.vision
    unit = v.patch_size * v.spatial_merge_size
    out = dict(PREPROCESSOR_CONFIG, patch_size=v.patch_size, temporal_patch_size=v.temporal_patch_size,
               merge_size=v.spatial_merge_size, min_pixels=4 * unit * unit, max_pixels=1280 * unit * unit)
    if cfg.qwen3:  # dense and MoE share Qwen3-VL's processor
        out.update(processor_class="Qwen3VLProcessor", image_mean=[0.5] * 3, image_std=[0.5] * 3)
    elif cfg.model_type == "qwen2_vl":
        out.update(processor_class="Qwen2VLProcessor")
    return out


class ImageSizeError(ValueError):
    """An image the vision tower cannot take (under 28 px on a side, or aspect ratio over 200); names the size."""


def smart_resize(height: int, width: int, factor: int = 28, min_pixels: int = 56 * 56,
                 max_pixels: int = 28 * 28 * 1280) -> tuple[int, int]:
    """Nearest size with both sides multiples of `factor` and area within [min_pixels, max_pixels],
    keeping the aspect ratio (the rule Qwen2.5-VL was trained with). The rule itself is the one the action
    grammars use for their coordinate space (envs.actions.resize); here images too small or too elongated
    for the vision tower are refused first, as transformers does."""
    if min(height, width) < factor:
        raise ImageSizeError(f"image of {width}x{height} px is smaller than {factor} px on a side")
    if max(height, width) / min(height, width) > envs_resize.MAX_RATIO:
        raise ImageSizeError(f"image of {width}x{height} px has aspect ratio "
                             f"{max(height, width) / min(height, width):.1f} > {envs_resize.MAX_RATIO}")
    return envs_resize.smart_resize(height, width, factor, min_pixels, max_pixels)


def _to_rgb(image: Any) -> Image.Image:
    """PIL image in RGB; transparent pixels are composited on white like transformers' convert_rgb."""
    if isinstance(image, np.ndarray):
        if image.dtype != np.uint8 or image.ndim not in (2, 3):
            raise ValueError(f"numpy images must be uint8 [H, W] or [H, W, C], got {image.dtype} {image.shape}")
        image = Image.fromarray(image)
    if not isinstance(image, Image.Image):
        raise TypeError(f"expected a PIL image or uint8 numpy array, got {type(image).__name__}")
    if image.mode == "RGB":
        return image
    rgba = image.convert("RGBA")
    background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return Image.alpha_composite(background, rgba).convert("RGB")


@dataclasses.dataclass(frozen=True)
class ImageProcessor:
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD
    rescale_factor: float = 1 / 255

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "ImageProcessor":
        """From a preprocessor_config.json dict: `min_pixels`/`max_pixels` override `size`, as in transformers."""
        size = config.get("size") or {}
        min_pixels = config.get("min_pixels") or size.get("shortest_edge") or 56 * 56
        max_pixels = config.get("max_pixels") or size.get("longest_edge") or 28 * 28 * 1280
        if min_pixels > max_pixels:
            raise ValueError(f"preprocessor config has min_pixels {min_pixels} > max_pixels {max_pixels}")
        return cls(min_pixels=int(min_pixels), max_pixels=int(max_pixels),
                   patch_size=config.get("patch_size", 14), temporal_patch_size=config.get("temporal_patch_size", 2),
                   merge_size=config.get("merge_size", 2),
                   image_mean=tuple(config.get("image_mean", CLIP_MEAN)), image_std=tuple(config.get("image_std", CLIP_STD)),
                   rescale_factor=config.get("rescale_factor", 1 / 255))

    def resized_hw(self, height: int, width: int) -> tuple[int, int]:
        return smart_resize(height, width, self.patch_size * self.merge_size, self.min_pixels, self.max_pixels)

    def patchify_one(self, image: Any) -> tuple[np.ndarray, tuple[int, int, int]]:
        """[grid_h*grid_w, C*T*P*P] patches in 2x2-merge block order, and the (t, h, w) grid."""
        rgb = _to_rgb(image)
        h, w = self.resized_hw(rgb.height, rgb.width)
        if (h, w) != (rgb.height, rgb.width):
            rgb = rgb.resize((w, h), Image.BICUBIC)
        # Rescale in float64 then round to float32, as the reference does, so values match bit for bit.
        pixels = (np.asarray(rgb).astype(np.float64) * self.rescale_factor).astype(np.float32)
        pixels = (pixels - np.asarray(self.image_mean, np.float32)) / np.asarray(self.image_std, np.float32)
        p, m, t = self.patch_size, self.merge_size, self.temporal_patch_size
        gh, gw = h // p, w // p
        x = pixels.transpose(2, 0, 1).reshape(3, gh // m, m, p, gw // m, m, p)
        x = x.transpose(1, 4, 2, 5, 0, 3, 6)  # (gh/m, gw/m, m, m, C, P, P)
        x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], t, p, p))  # image repeated over time
        return x.reshape(gh * gw, 3 * t * p * p), (1, gh, gw)

    def __call__(self, images: Sequence[Any]) -> dict[str, np.ndarray]:
        patches, grids = zip(*(self.patchify_one(im) for im in images)) if images else ((), ())
        dim = 3 * self.temporal_patch_size * self.patch_size ** 2
        return {"pixel_values": np.concatenate(patches) if patches else np.zeros((0, dim), np.float32),
                "image_grid_thw": np.asarray(grids, dtype=np.int64).reshape(-1, 3)}


def _expand_image_pads(texts: Sequence[str], counts: Sequence[int]) -> list[str]:
    """Each image placeholder repeated as many times as its image has merged tokens; images are consumed in
    order across all the texts, like the reference processor."""
    left = iter(counts)
    expanded = []
    for i, t in enumerate(texts):
        pieces = t.split(IMAGE_PAD)
        rebuilt = [pieces[0]]
        for piece in pieces[1:]:
            try:
                rebuilt.append(IMAGE_PAD * next(left) + piece)
            except StopIteration:
                raise ValueError(f"text {i} has more {IMAGE_PAD} placeholders than the {len(counts)} images "
                                 "given") from None
        expanded.append("".join(rebuilt))
    if next(left, None) is not None:
        raise ValueError(f"{len(counts)} images given but the texts hold fewer {IMAGE_PAD} placeholders")
    return expanded


class Processor:
    """Tokenizer + ImageProcessor with the call signature of transformers' Qwen2.5-VL processor."""

    def __init__(self, tokenizer: Any, image_processor: ImageProcessor | None = None, padding_side: str | None = None):
        """`padding_side=None` follows the tokenizer's own `padding_side` (right for Qwen2.5-VL), as the reference."""
        if padding_side not in (None, "left", "right"):
            raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
        self.tokenizer = tokenizer
        self.image_processor = image_processor or ImageProcessor()
        self.padding_side = padding_side or tokenizer.padding_side
        self.image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
        if self.image_token_id is None or self.image_token_id == tokenizer.unk_token_id:
            raise ValueError(f"tokenizer has no {IMAGE_PAD} token")

    @classmethod
    def from_pretrained(cls, path: str | pathlib.Path, **kwargs: Any) -> "Processor":
        from transformers import AutoTokenizer

        path = pathlib.Path(path)
        if not (path / "tokenizer_config.json").exists():
            raise FileNotFoundError(f"no tokenizer_config.json in {path}")
        config_file = path / "preprocessor_config.json"
        image_processor = ImageProcessor.from_config(json.loads(config_file.read_text())) if config_file.exists() else None
        return cls(AutoTokenizer.from_pretrained(path), image_processor, **kwargs)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)

    def prompt_length(self, text: str, images: Sequence[Any]) -> int:
        """The token count of `self(text=[text], images=[images])` without resizing or patchifying the images:
        each image's placeholder counted by its merged-token grid (what batches are planned by)."""
        [expanded] = _expand_image_pads([text], [self.num_image_tokens(image) for image in images])
        return len(self.tokenizer([expanded])["input_ids"][0])

    def num_image_tokens(self, image: Any) -> int:
        rgb = _to_rgb(image)
        h, w = self.image_processor.resized_hw(rgb.height, rgb.width)
        unit = self.image_processor.patch_size * self.image_processor.merge_size
        return (h // unit) * (w // unit)

    def __call__(self, text: str | Sequence[str], images: Sequence[Sequence[Any]] | Sequence[Any] | None = None,
                 padding_side: str | None = None) -> dict[str, np.ndarray]:
        texts = [text] if isinstance(text, str) else list(text)
        flat: list[Any] = []
        if images is not None:
            for item in images:
                flat.extend(item if isinstance(item, (list, tuple)) else [item])
        out: dict[str, np.ndarray] = {}
        if flat:
            out.update(self.image_processor(flat))
        merge = self.image_processor.merge_size ** 2
        expanded = _expand_image_pads(texts, [int(g.prod()) // merge for g in
                                              out.get("image_grid_thw", np.zeros((0, 3), np.int64))])
        side = padding_side or self.padding_side
        encoded = self.tokenizer(expanded, padding=True, padding_side=side, return_tensors="np")
        out["input_ids"] = encoded["input_ids"].astype(np.int64)
        out["attention_mask"] = encoded["attention_mask"].astype(np.int64)
        out["mm_token_type_ids"] = (out["input_ids"] == self.image_token_id).astype(np.int64)
        return out
