"""Padding-free batches: a batch's examples packed end to end into fixed-length rows.

A GUI step's prompt is mostly screenshot tokens and its length varies with the screenshots in its history,
so padding every row to the longest one's bucket spends a large share of the forward pass on nothing.
Packing puts several examples into one row of `length` tokens. The model sees:

* `attention_mask` [P, L] as segment ids: 1, 2, ... for the examples of a row in order, 0 after the last,
  so attention stays inside each example (guijax.models.attention takes segment ids as they are);
* `positions` [3, P, L]: each example's own M-RoPE positions, restarting at 0 where it starts.

The losses see the examples as rows again, in *response space*: `targets`, `loss_mask`, `advantages`,
`behaviour_logprobs` are [b, R], the b examples of the batch (padded with empty rows up to the batch size)
by their R loss positions, and `token_index` [blocks, b / blocks, R] says where in the packed rows each of
those positions sits (flat over its block's rows, -1 in unused slots). The losses reduce over rows and masked
tokens only, so they take [b, R] arrays exactly as they take [b, s] ones.

Blocks. With `blocks` > 1 the examples and the packed rows are cut into that many equal blocks (example i in
block i // (b / blocks)) and each block's examples go into that block's rows only; on a mesh the blocks are the
data-parallel devices, so the gather from packed rows to response space never leaves a device.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np


class PackingError(ValueError):
    """The examples do not fit the packed shape; `example` is the index of one that does not fit."""

    def __init__(self, message: str, example: int):
        super().__init__(message)
        self.example = example


@dataclasses.dataclass(frozen=True)
class PackedLayout:
    """Where each example of a batch sits: `rows[r]` lists the examples of packed row r in order (rows of block
    k are rows[k * rows_per_block:(k + 1) * rows_per_block]); `starts[i]` is example i's (row, offset)."""

    rows: list[list[int]]
    starts: list[tuple[int, int]]
    length: int
    blocks: int

    @property
    def rows_per_block(self) -> int:
        return len(self.rows) // self.blocks


def doubled(base: int, need: int) -> int:
    """base x 2^k, the smallest that is at least `need`: how a fixed shape grows for a batch past it, so the
    shapes a run meets stay few."""
    while base < need:
        base *= 2
    return base


def plan_rows(lengths: Sequence[int], batch_size: int, length: int, rows: int | None = None,
              blocks: int = 1, grow: bool = False) -> PackedLayout:
    """First-fit decreasing packing of examples of `lengths` into rows of `length` tokens.

    Example i belongs to block i // (batch_size / blocks). `rows`: packed rows per batch (a multiple of
    `blocks`; one shape for every batch) or None: as many as the fullest block needs, the same count in every
    block. Raises PackingError when an example is longer than a row, or when a block's examples need more
    than `rows` rows; with `grow` such a batch gets rows x 2^k instead, the fewest that hold it (a second
    shape, not a failed run)."""
    if batch_size % blocks:
        raise ValueError(f"batch size {batch_size} does not divide into {blocks} blocks")
    if rows is not None and rows % blocks:
        raise ValueError(f"{rows} packed rows do not divide into {blocks} blocks")
    if len(lengths) > batch_size:
        raise ValueError(f"{len(lengths)} examples for a batch of {batch_size}")
    for i, n in enumerate(lengths):
        if n > length:
            raise PackingError(f"example {i} has {n} tokens, more than the packed row length {length}", i)
    per_block = batch_size // blocks
    members = [range(k * per_block, min((k + 1) * per_block, len(lengths))) for k in range(blocks)]
    block_rows = [_first_fit(m, lengths, length) for m in members]
    need = max(1, max(len(placed) for placed in block_rows))
    per = need if rows is None else rows // blocks
    if need > per:
        if not grow:
            k = max(range(blocks), key=lambda j: len(block_rows[j]))
            raise PackingError(f"block {k}'s {len(members[k])} examples ({sum(lengths[j] for j in members[k])} "
                               f"tokens) need {need} rows of {length} tokens; the packed shape has {per} per block",
                               block_rows[k][per][0])  # the example that opened the first row too many
        per = doubled(per, need)
    out: list[list[int]] = []
    for placed in block_rows:
        out.extend(sorted(placed, key=min) + [[] for _ in range(per - len(placed))])
    starts: list[tuple[int, int]] = [(0, 0)] * len(lengths)
    for r, row in enumerate(out):
        offset = 0
        for i in row:
            starts[i] = (r, offset)
            offset += lengths[i]
    return PackedLayout(out, starts, length, blocks)


def plan_minibatches(lengths: Sequence[int], rows: int, length: int, max_examples: int,
                     seed: int = 0) -> list[list[int]]:
    """Examples into minibatches of one packed shape: `rows` rows of `length` tokens holding at most
    `max_examples` examples. First the examples are packed into rows over the whole pass, longest first,
    each into the first row with room (at most `max_examples` to a row), which leaves little of any row
    empty; then the rows, in a seeded random order (so a minibatch is not all long or all short steps), each
    join the first minibatch with a free row and room for their examples, whose longest-first packing
    (`plan_rows`, as the batch is collated) still fits its rows. Only the minibatches still open at the end
    run short, where cutting the steps into minibatches of a fixed count fills a fixed shape only as far as
    the longest minibatch needs; the price is that the number of minibatches (optimiser steps) follows the
    tokens, not the steps. Returns each minibatch's example indices, ascending."""
    if rows < 1 or length < 1 or max_examples < 1:
        raise ValueError(f"minibatches need rows, length and max_examples >= 1, got {rows}, {length}, {max_examples}")
    for i, n in enumerate(lengths):
        if n > length:
            raise PackingError(f"example {i} has {n} tokens, more than the packed row length {length}", i)
    packed = _first_fit(range(len(lengths)), lengths, length, max_examples)
    batches: list[list[int]] = []
    used_rows: list[int] = []
    for r in np.random.default_rng(seed).permutation(len(packed)):
        row = packed[r]
        for b, members in enumerate(batches):
            if used_rows[b] < rows and len(members) + len(row) <= max_examples:
                trial = [lengths[i] for i in members + row]
                if len(_first_fit(range(len(trial)), trial, length)) <= rows:
                    members.extend(row)
                    used_rows[b] += 1
                    break
        else:
            batches.append(list(row))
            used_rows.append(1)
    return [sorted(members) for members in batches]


def _first_fit(members: Sequence[int], lengths: Sequence[int], length: int,
               per_row: int | None = None) -> list[list[int]]:
    """The examples `members`, longest first, each into the first row with room (and fewer than `per_row`
    examples, when given); a new row when none has."""
    filled: list[int] = []
    placed: list[list[int]] = []
    for i in sorted(members, key=lambda j: (-lengths[j], j)):
        spot = next((r for r, used in enumerate(filled)
                     if used + lengths[i] <= length and (per_row is None or len(placed[r]) < per_row)), None)
        if spot is None:
            filled.append(0)
            placed.append([])
            spot = len(placed) - 1
        filled[spot] += lengths[i]
        placed[spot].append(i)
    return placed


def pack_tokens(examples: Sequence[dict[str, Any]], layout: PackedLayout, batch_size: int,
                positions: Sequence[np.ndarray], response_width: int, pad_id: int = 0) -> dict[str, np.ndarray]:
    """The packed model inputs and the response-space training arrays (module docstring) of `examples`
    (EncodeStep's token-aligned examples) placed as `layout` says; `positions[i]` is example i's own
    [3, n_i] M-RoPE positions. A row with more loss tokens than `response_width` raises PackingError."""
    rows, length = len(layout.rows), layout.length
    ids = np.full((rows, length), pad_id, np.int32)
    segments = np.zeros((rows, length), np.int32)
    pos = np.zeros((3, rows, length), np.int32)
    response = {k: np.zeros((batch_size, response_width), np.float32)
                for k in ("loss_mask", "advantages", "behaviour_logprobs")}
    targets = np.zeros((batch_size, response_width), np.int32)
    index = np.full((batch_size, response_width), -1, np.int32)
    per_block_rows, per_block = layout.rows_per_block, batch_size // layout.blocks
    for r, members in enumerate(layout.rows):
        for segment, i in enumerate(members, start=1):
            e = examples[i]
            n = len(e["input_ids"])
            _, offset = layout.starts[i]
            ids[r, offset:offset + n] = e["input_ids"]
            segments[r, offset:offset + n] = segment
            pos[:, r, offset:offset + n] = positions[i]
            # prediction position t predicts token t + 1: a loss position is one whose next token is a response
            where = np.flatnonzero(np.asarray(e["loss_mask"])[1:] > 0)
            if len(where) > response_width:
                raise PackingError(f"example {i} has {len(where)} loss tokens, more than the response budget of "
                                   f"{response_width} positions", i)
            k = len(where)
            local_row = r - (i // per_block) * per_block_rows
            index[i, :k] = local_row * length + offset + where
            targets[i, :k] = np.asarray(e["input_ids"])[where + 1]
            for key in response:
                response[key][i, :k] = np.asarray(e[key])[where + 1]
    return {"input_ids": ids, "attention_mask": segments, "positions": pos, "targets": targets, **response,
            "token_index": index.reshape(layout.blocks, per_block, response_width)}


def packed_hidden(hidden: Any, token_index: Any) -> Any:
    """hidden [P, L, d] of packed rows -> [b, R, d] at `token_index` [blocks, b / blocks, R] (-1 slots read
    position 0 of their block; their mask is 0). A batched gather per block, so it partitions along blocks."""
    import jax.numpy as jnp

    blocks, per_block, width = token_index.shape
    rows, length, dim = hidden.shape
    flat = hidden.reshape(blocks, (rows // blocks) * length, dim)
    index = jnp.maximum(token_index, 0).reshape(blocks, per_block * width, 1)
    return jnp.take_along_axis(flat, index, axis=1).reshape(blocks * per_block, width, dim)
