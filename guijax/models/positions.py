"""Host-side (numpy) index computations that depend on image sizes, done before `jit`.

Image grids decide the vision tower's window permutation, attention segments and the language model's
M-RoPE positions. They are data-dependent integers, so they are computed here once per batch and passed
to the jitted forward as arrays; the traced program never branches on image sizes.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from guijax.models.config import ModelConfig, VisionConfig


@dataclasses.dataclass(frozen=True)
class VisionLayout:
    """Everything the vision tower needs beyond pixels, in the window-permuted token order.

    window_index:     [N/merge^2] merge-unit permutation that groups tokens by attention window
    rotary_positions: [N, 2] (row, column) patch coordinates, permuted
    full_segments:    [N] id of the image frame each token belongs to (full-attention blocks)
    window_segments:  [N] id of the window each token belongs to (windowed blocks)
    window_tokens:    [W, L] the tokens of each window (consecutive in the permuted order), -1 after its end;
                      L is the largest window the config allows, so only W depends on the image sizes
    window_slots:     [N] where each token sits in the flattened [W * L] window batch (the inverse gather)
    image_tokens:     [I, P] the tokens of each image frame (consecutive in the permuted order), -1 after its
                      end, P the largest frame: full-attention blocks attend within these rows
    image_slots:      [N] each token's slot in the flattened [I * P] frame batch
    pos_indices:      [N, 4] (towers with learned position embeddings) the rows of the square embedding grid
                      whose bilinear blend is each token's position embedding, permuted; None otherwise
    pos_weights:      [N, 4] the blend's weights
    """

    window_index: np.ndarray
    rotary_positions: np.ndarray
    full_segments: np.ndarray
    window_segments: np.ndarray
    window_tokens: np.ndarray
    window_slots: np.ndarray
    image_tokens: np.ndarray
    image_slots: np.ndarray
    pos_indices: np.ndarray | None = None
    pos_weights: np.ndarray | None = None

    @property
    def num_patches(self) -> int:
        return int(self.rotary_positions.shape[0])

    def inputs(self, pixel_values: np.ndarray) -> dict[str, np.ndarray]:
        """The `vision` argument of the model forward: pixels plus this layout."""
        return {"pixel_values": pixel_values, "window_index": self.window_index,
                "rotary_positions": self.rotary_positions, "full_segments": self.full_segments,
                "window_segments": self.window_segments, "window_tokens": self.window_tokens,
                "window_slots": self.window_slots, "image_tokens": self.image_tokens, "image_slots": self.image_slots,
                **({} if self.pos_indices is None else {"pos_indices": self.pos_indices, "pos_weights": self.pos_weights})}


def _check_grid(grid_thw: np.ndarray, merge: int) -> np.ndarray:
    grid_thw = np.asarray(grid_thw, dtype=np.int64).reshape(-1, 3)
    bad = [tuple(g) for g in grid_thw if g[1] % merge or g[2] % merge or min(g) < 1]
    if bad:
        raise ValueError(f"image_grid_thw rows {bad} are not positive multiples of spatial_merge_size={merge} in h and w")
    return grid_thw


def vision_layout(image_grid_thw: np.ndarray, vcfg: VisionConfig) -> VisionLayout:
    """Window permutation and segment ids for Qwen2.5-VL's windowed vision attention.

    Windows are `window_size // patch_size // merge` merge-units on a side; a partial window at the right or
    bottom edge is kept (smaller), empty windows are dropped, exactly as the reference builds cu_seqlens.
    """
    merge = vcfg.spatial_merge_size
    unit = merge * merge
    grid_thw = _check_grid(image_grid_thw, merge)
    win = vcfg.window_size // merge // vcfg.patch_size
    window_index, window_lengths, rotary, frame_lengths = [], [], [], []
    offset = 0
    for t, h, w in grid_thw:
        lh, lw = h // merge, w // merge
        index = np.arange(t * lh * lw).reshape(t, lh, lw)
        pad_h, pad_w = (-lh) % win, (-lw) % win
        padded = np.pad(index, ((0, 0), (0, pad_h), (0, pad_w)), constant_values=-1)
        nh, nw = (lh + pad_h) // win, (lw + pad_w) // win
        windows = padded.reshape(t, nh, win, nw, win).transpose(0, 1, 3, 2, 4).reshape(t, nh * nw, win * win)
        for frame in windows:
            for cells in frame:
                kept = cells[cells >= 0]
                if kept.size:
                    window_index.append(kept + offset)
                    window_lengths.append(kept.size * unit)
        offset += t * lh * lw
        # patch coordinates in the processor's block-major order: (h/m, w/m, m, m)
        hpos = np.arange(h)[:, None].repeat(w, 1).reshape(lh, merge, lw, merge).transpose(0, 2, 1, 3).reshape(-1)
        wpos = np.arange(w)[None, :].repeat(h, 0).reshape(lh, merge, lw, merge).transpose(0, 2, 1, 3).reshape(-1)
        rotary.append(np.tile(np.stack([hpos, wpos], -1), (t, 1)))
        frame_lengths.extend([h * w] * t)
    window_index_arr = np.concatenate(window_index).astype(np.int32)
    rotary_arr = np.concatenate(rotary).astype(np.int32)
    n = rotary_arr.shape[0]

    def permute(per_patch: np.ndarray) -> np.ndarray:  # processor order -> window order, merge units kept whole
        return per_patch.reshape(n // unit, unit, -1)[window_index_arr].reshape(n, -1)

    rotary_arr = permute(rotary_arr)
    full = np.repeat(np.arange(len(frame_lengths)), frame_lengths).astype(np.int32)
    windows_seg = np.repeat(np.arange(len(window_lengths)), window_lengths).astype(np.int32)
    batches = attention_batches(full, windows_seg, win * win * unit)
    if vcfg.num_position_embeddings:
        indices, weights = position_embedding_blend(grid_thw, vcfg)
        batches.update(pos_indices=permute(indices), pos_weights=permute(weights))
    return VisionLayout(window_index_arr, rotary_arr, full, windows_seg, **batches)


def position_embedding_blend(grid_thw: np.ndarray, vcfg: VisionConfig) -> tuple[np.ndarray, np.ndarray]:
    """Each patch's position embedding as a bilinear blend (align_corners) of the learned square grid resized
    to the image's patch grid: the 4 grid rows [N, 4] and their weights [N, 4], patches in the processor's
    merge-block order and repeated over frames, as transformers' Qwen3-VL resamples its table."""
    side = round(vcfg.num_position_embeddings ** 0.5)
    merge = vcfg.spatial_merge_size
    indices, weights = [], []
    for t, h, w in np.asarray(grid_thw, np.int64).reshape(-1, 3):
        rows = np.arange(h).reshape(h // merge, merge)[:, None, :, None]
        cols = np.arange(w).reshape(w // merge, merge)[None, :, None, :]
        rows, cols = np.broadcast_arrays(rows, cols)  # (h/m, w/m, m, m): merge-block order
        (r0, r1), (wr0, wr1) = _axis_taps(rows.reshape(-1), h, side)
        (c0, c1), (wc0, wc1) = _axis_taps(cols.reshape(-1), w, side)
        idx = np.stack([r0 * side + c0, r0 * side + c1, r1 * side + c0, r1 * side + c1], -1)
        wts = np.stack([wr0 * wc0, wr0 * wc1, wr1 * wc0, wr1 * wc1], -1)
        indices.append(np.tile(idx, (t, 1)))
        weights.append(np.tile(wts, (t, 1)))
    return np.concatenate(indices).astype(np.int32), np.concatenate(weights).astype(np.float32)


def _axis_taps(index: np.ndarray, size: int, side: int) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """The two source rows of a linear resize of `side` entries to `size` (corners aligned) and their weights."""
    src = index.astype(np.float32) * np.float32(side - 1) / np.float32(max(size - 1, 1))
    low = np.floor(src)
    frac = src - low
    low = low.astype(np.int64)
    return (np.clip(low, 0, side - 1), np.clip(low + 1, 0, side - 1)), (1 - frac, frac)


def attention_batches(full_segments: np.ndarray, window_segments: np.ndarray,
                      window_len: int) -> dict[str, np.ndarray]:
    """The gathers that batch windows (windowed blocks) and image frames (full-attention blocks) into rows,
    from the segment ids alone (each segment a consecutive run, ids from 0), so merged layouts rebuild them."""
    window_tokens, window_slots = window_batch(np.bincount(window_segments), window_len)
    frames = np.bincount(full_segments)
    image_tokens, image_slots = window_batch(frames, int(frames.max(initial=1)))
    return {"window_tokens": window_tokens, "window_slots": window_slots, "image_tokens": image_tokens,
            "image_slots": image_slots}


def window_batch(window_lengths: np.ndarray, max_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Gather indices that batch consecutive windows of the given lengths into [W, max_len] rows (-1 pads
    each row's tail), and each token's slot in the flattened batch to gather the results back."""
    starts = np.concatenate([[0], np.cumsum(window_lengths)[:-1]])
    offsets = np.arange(max_len)
    valid = offsets[None, :] < window_lengths[:, None]
    tokens = np.where(valid, starts[:, None] + offsets[None, :], -1).astype(np.int32)
    slots = (np.arange(len(window_lengths)) * max_len)[:, None] + offsets[None, :]
    return tokens, slots[valid].astype(np.int32)


def mrope_positions(
    input_ids: np.ndarray,
    attention_mask: np.ndarray | None,
    image_grid_thw: np.ndarray | None,
    cfg: ModelConfig,
) -> tuple[np.ndarray, np.ndarray]:
    """3-D rotary positions [3, batch, seq] and per-sequence deltas [batch], by transformers' get_rope_index rule.

    Text tokens advance all three axes together; a run of image-pad tokens gets (t, h, w) grid coordinates
    offset by the current position, after which text resumes at start + max(h, w) / merge. Padding positions
    are 0. `delta = max_position + 1 - num_valid_tokens` continues positions during decoding.
    """
    input_ids = np.asarray(input_ids)
    batch, seq = input_ids.shape
    mask = np.ones_like(input_ids, dtype=bool) if attention_mask is None else np.asarray(attention_mask).astype(bool)
    merge = cfg.vision.spatial_merge_size
    grids = [] if image_grid_thw is None else list(_check_grid(image_grid_thw, merge))
    grid_iter = iter(grids)
    positions = np.zeros((3, batch, seq), dtype=np.int32)
    deltas = np.zeros((batch,), dtype=np.int32)
    used = 0
    for b in range(batch):
        ids = input_ids[b][mask[b]]
        is_image = ids == cfg.image_token_id
        pos = np.zeros((3, ids.size), dtype=np.int64)
        current, i = 0, 0
        while i < ids.size:
            j = i
            while j < ids.size and is_image[j] == is_image[i]:
                j += 1
            if not is_image[i]:
                pos[:, i:j] = np.arange(j - i) + current
                current += j - i
            else:
                start = i
                while start < j:  # consecutive images with no text between them are separate runs
                    try:
                        t, h, w = next(grid_iter)
                    except StopIteration:
                        raise ValueError(
                            f"sequence {b} has more image-pad tokens than image_grid_thw provides images for"
                        ) from None
                    used += 1
                    lh, lw = h // merge, w // merge
                    count = t * lh * lw
                    if start + count > j:
                        raise ValueError(
                            f"sequence {b}: image {used - 1} with grid {(t, h, w)} needs {count} image-pad tokens, "
                            f"only {j - start} found"
                        )
                    tt, hh, ww = np.meshgrid(np.arange(t), np.arange(lh), np.arange(lw), indexing="ij")
                    pos[:, start:start + count] = np.stack([tt, hh, ww]).reshape(3, -1) + current
                    current += max(lh, lw)
                    start += count
            i = j
        positions[:, b, mask[b]] = pos
        deltas[b] = (pos.max() + 1 - ids.size) if ids.size else 0
    if used != len(grids):
        raise ValueError(f"image_grid_thw lists {len(grids)} images but the input_ids hold image-pad runs for {used}")
    return positions, deltas
