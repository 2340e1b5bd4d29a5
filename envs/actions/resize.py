"""smart_resize: the image size a Qwen2-VL-family model (UI-TARS-1.5) actually sees.

UI-TARS-1.5 writes coordinates in pixels of this resized image, so mapping them back to the screen needs
the same arithmetic. Defaults are the ui-tars package's bounds for UI-TARS-1.5; all are overridable.
"""
from __future__ import annotations

import math

IMAGE_FACTOR = 28
MIN_PIXELS = 100 * 28 * 28
MAX_PIXELS = 16384 * 28 * 28
MAX_RATIO = 200


def smart_resize(height: int, width: int, factor: int = IMAGE_FACTOR, min_pixels: int = MIN_PIXELS,
                 max_pixels: int = MAX_PIXELS) -> tuple[int, int]:
    """(height, width) rounded to multiples of `factor`, rescaled so the area lies in [min_pixels, max_pixels]."""
    if min(height, width) <= 0:
        raise ValueError(f"image size must be positive, got {width}x{height}")
    if max(height, width) / min(height, width) > MAX_RATIO:
        raise ValueError(f"aspect ratio of {width}x{height} exceeds {MAX_RATIO}")
    h_bar = max(factor, round(height / factor) * factor)
    w_bar = max(factor, round(width / factor) * factor)
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h_bar, w_bar
