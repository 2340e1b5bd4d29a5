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

import collections
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
    """Examples of `lengths` packed into rows of `length` tokens, each block's in the fewest rows that
    first-fit decreasing or least-slack filling finds (`fewest_rows`).

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
    block_rows = [fewest_rows(m, lengths, length) for m in members]
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
    `max_examples` examples. First the examples are packed into rows over the whole pass, in the fewest rows
    `fewest_rows` finds (at most `max_examples` to a row), which leaves little of any row empty; then the
    rows, in a seeded random order (so a minibatch is not all long or all short steps), each join the first
    minibatch with a free row and room for their examples, whose packing (`plan_rows`, as the batch is
    collated) still fits its rows. Only the minibatches still open at the end run short, where cutting the
    steps into minibatches of a fixed count fills a fixed shape only as far as the longest minibatch needs;
    the price is that the number of minibatches (optimiser steps) follows the tokens, not the steps. Returns
    each minibatch's example indices, ascending."""
    if rows < 1 or length < 1 or max_examples < 1:
        raise ValueError(f"minibatches need rows, length and max_examples >= 1, got {rows}, {length}, {max_examples}")
    for i, n in enumerate(lengths):
        if n > length:
            raise PackingError(f"example {i} has {n} tokens, more than the packed row length {length}", i)
    packed = fewest_rows(range(len(lengths)), lengths, length, max_examples)
    batches: list[list[int]] = []
    used_rows: list[int] = []
    for r in np.random.default_rng(seed).permutation(len(packed)):
        row = packed[r]
        for b, members in enumerate(batches):
            if used_rows[b] < rows and len(members) + len(row) <= max_examples:
                trial = [lengths[i] for i in members + row]
                if len(fewest_rows(range(len(trial)), trial, length)) <= rows:
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


# Least-slack filling costs a subset-sum pass per row over the examples left (of each length, as many as a row
# holds), each update a shift of a row-length bitset, and keeps a row's bitsets to read its subset back; past
# this many 64-bit words of updates (a second or two on one core: about 4,000 steps of 150-500 tokens in rows of
# 1,024, or 800 GUI steps of 1-6k tokens in rows of 16k) or bytes of bitsets, first-fit is used alone
LEAST_SLACK_BUDGET = 300_000_000
LEAST_SLACK_MEMORY = 1 << 27


def fewest_rows(members: Sequence[int], lengths: Sequence[int], length: int,
                per_row: int | None = None) -> list[list[int]]:
    """The examples `members` in rows of `length` tokens (at most `per_row` to a row): first-fit decreasing,
    or least-slack filling (`least_slack_rows`) where that needs fewer rows. Why both: first-fit leaves a
    part-filled row wherever no example left fits its end, and on a pass of a few dozen GUI steps that is one
    row in ten; least-slack filling chooses each row's examples to fill it, but commits early and can lose a
    row where first-fit does not. Either depends only on the lengths, longest first, so a minibatch planned
    from rows packs into as many again when it is collated. Examples of no tokens (the blank ones that hold a
    short block's place) go where there is a free place last, so they never cost a row of their own."""
    members = list(members)
    blanks = [i for i in members if int(lengths[i]) == 0]
    if blanks:
        rows = fewest_rows([i for i in members if int(lengths[i])], lengths, length, per_row)
        for i in blanks:
            spot = next((row for row in rows if per_row is None or len(row) < per_row), None)
            if spot is None:
                spot = []
                rows.append(spot)
            spot.append(i)
        return rows
    first = _first_fit(members, lengths, length, per_row)
    total = sum(int(lengths[i]) for i in members)
    floor = max(-(-total // length), -(-len(members) // per_row) if per_row else 0)
    if len(first) <= max(floor, 1):
        return first
    cap = min(per_row or len(members), length // max(1, min(int(lengths[i]) for i in members)))
    candidates = min(len(members), len({int(lengths[i]) for i in members}) * cap)
    if (candidates * len(first) * cap * (length // 64 + 1) > LEAST_SLACK_BUDGET
            or candidates * (cap + 1) * (length // 8 + 1) > LEAST_SLACK_MEMORY):
        return first
    slack = least_slack_rows(members, lengths, length, per_row)
    return slack if len(slack) < len(first) else first


def least_slack_rows(members: Sequence[int], lengths: Sequence[int], length: int,
                     per_row: int | None = None) -> list[list[int]]:
    """Minimum-bin-slack packing: each row opened by the longest example left and completed by the subset of
    the others (at most `per_row` - 1 of them) that fills it most, found exactly by a subset-sum over token
    counts (one bitset of reachable sums per example count)."""
    left = sorted(members, key=lambda j: (-lengths[j], j))
    rows: list[list[int]] = []
    while left:
        opener = left[0]
        room = length - int(lengths[opener])
        most = min(len(left) - 1, (per_row or len(left)) - 1, room // max(1, int(lengths[left[-1]])))
        rest = _copies_at_most(left[1:], lengths, most)
        reach, before = [1] + [0] * most, []  # reach[c]: bit s set when c of the examples seen so far sum to s
        keep = (1 << (room + 1)) - 1
        for i in rest:
            before.append(list(reach))
            for c in range(most, 0, -1):
                reach[c] = (reach[c] | (reach[c - 1] << int(lengths[i]))) & keep
        # the fullest row; of equally full ones, the one with the fewest examples
        total, count = max((reach[c].bit_length() - 1, -c) for c in range(most + 1) if reach[c])
        count = -count
        row = [opener]
        for j in range(len(rest) - 1, -1, -1):
            if count == 0:
                break
            if not (before[j][count] >> total) & 1:  # the sum needs example j
                row.append(rest[j])
                total -= int(lengths[rest[j]])
                count -= 1
        rows.append(row)
        taken = set(row)
        left = [i for i in left if i not in taken]
    return rows


def _copies_at_most(members: Sequence[int], lengths: Sequence[int], copies: int) -> list[int]:
    """`members` keeping the first `copies` of each length: examples of one length are interchangeable, and a
    row never holds more than `copies`, so the subset-sum runs over distinct lengths, not over every step."""
    seen: collections.Counter[int] = collections.Counter()
    kept = []
    for i in members:
        seen[int(lengths[i])] += 1
        if seen[int(lengths[i])] <= copies:
            kept.append(i)
    return kept


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
