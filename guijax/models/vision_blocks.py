"""Vision inputs in per-device blocks: each data-parallel device's rows get their own patches and layout.

The layout of `guijax.models.positions` indexes one patch array holding every image of the batch. Split over
data-parallel devices, its gathers (patches into windows and image frames, features to image-pad tokens)
may reach any device, and XLA's partitioner answers that by replicating them: on 64 chips, each chip holds
the whole batch's window gather. Stacked per-device blocks, each laid out over its own rows' images with
indices local to the block, keep every gather on its device: the tower runs vmapped over the block axis,
which is split like the rows (`Qwen2_5_VL.encode_images`, `.embed`).

Host-side (numpy) only: the blocks are built by the batch pipeline and the dry run.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

# [rows, width] index arrays whose width may differ between blocks, and the [N] slots that address their
# flattened rows (slot = row * width + column)
_BATCHES = (("window_tokens", "window_slots"), ("image_tokens", "image_slots"))


def is_blocked(vision: Mapping[str, Any] | None) -> bool:
    return vision is not None and np.ndim(vision["pixel_values"]) == 3


def stack_blocks(blocks: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """One vision dict per block (equal patch counts) -> the same keys with a leading block axis.

    Window and image-frame batches are padded with empty rows (-1) to the largest block's, and their width
    to the widest (the slots re-addressed to the new width); `token_features` padded with -1."""
    if not blocks:
        raise ValueError("stack_blocks: no blocks")
    keys = set(blocks[0])
    for i, block in enumerate(blocks):
        if set(block) != keys:
            raise ValueError(f"stack_blocks: block {i} has keys {sorted(block)}, block 0 {sorted(keys)}")
    patches = {int(np.shape(b["pixel_values"])[0]) for b in blocks}
    if len(patches) != 1:
        raise ValueError(f"stack_blocks: blocks hold different patch counts {sorted(patches)}; pad each to one "
                         "count first")
    out: dict[str, np.ndarray] = {}
    padded = {k for pair in _BATCHES for k in pair} | {"token_features"}
    for rows_key, slots_key in _BATCHES:
        if rows_key not in keys:
            continue
        height = max(np.shape(b[rows_key])[0] for b in blocks)
        width = max(np.shape(b[rows_key])[1] for b in blocks)
        rows, slots = [], []
        for b in blocks:
            r, s = np.asarray(b[rows_key]), np.asarray(b[slots_key])
            rows.append(np.pad(r, [(0, height - r.shape[0]), (0, width - r.shape[1])], constant_values=-1))
            own = max(r.shape[1], 1)  # the block's own width: its slots are row * own + column
            slots.append((s // own * width + s % own).astype(s.dtype))
        out[rows_key], out[slots_key] = np.stack(rows), np.stack(slots)
    if "token_features" in keys:
        length = max(len(b["token_features"]) for b in blocks)
        out["token_features"] = np.stack([np.pad(np.asarray(b["token_features"]), (0, length - len(b["token_features"])),
                                                 constant_values=-1) for b in blocks])
    for key in keys - padded:
        out[key] = np.stack([np.asarray(b[key]) for b in blocks])
    return out
