"""Trajectories -> per-step examples -> length-bucketed batches -> globally sharded arrays, as a grain pipeline.

    refs = step_refs(trajectories, advantages)                # one StepRef per (trajectory, step)
    ds = make_dataset(trajectories, refs, processor, model_cfg, PipelineConfig(batch_size=8, seed=0))
    it = iter(ds); batch = next(it); state = it.get_state()  # state goes into the checkpoint
    arrays = global_batch(batch, mesh)                        # jax Arrays sharded over (data, fsdp)

Each step becomes one example: the prompt the agent saw at that step, rebuilt with `build_messages` (instruction,
optional plan, earlier turns as text, the last `max_images` screenshots as images) and rendered with the chat
template, followed by the response tokens — the exact sampled ids for on-policy steps, or for off-policy text
(expert / converted traces, which have no sampled ids) the tokenised response closed with <|im_end|>.

Alignment convention. Example-level arrays are indexed by token position: `loss_mask[t] = 1` iff token t is a
response token, and `behaviour_logprobs[t]` / `advantages[t]` belong to that token. Batch-level training
arrays are indexed by prediction position, because the model at position t predicts token t+1:
`targets[:, t] = input_ids[:, t+1]`, and `loss_mask`, `behaviour_logprobs`, `advantages` are shifted left by one
the same way, so `loss_mask[:, t] = 1` exactly when `targets[:, t]` is a response token. The last column never
has a target (mask 0).

Doing work only where it counts. `response_positions` [b, R] lists each row's loss positions (-1 pads), so
the LM head and the log-prob kernel run on R bucketed columns instead of the whole sequence (a few percent of
a GUI batch's tokens are response). With `dedupe_images` each distinct screenshot of a batch is patchified
into the vision inputs once and `vision["token_features"]` tells the model which merged feature each
image-pad token takes; `meta` reports `screenshots`, `unique_screenshots` and their ratio.

Encoding (chat template, tokenizer, image resize + patchify) and collation (M-RoPE positions, vision window
layout) run inside grain transforms, so with `worker_count > 0` they run in grain worker processes, off the
trainer's thread. Batches are padded to a few length buckets and patch-count multiples (static shapes: a
handful of compiled programs), or with `pack` packed padding-free (guijax.data.packing): the model then sees
rows of several examples, and the training arrays come in response space [batch_size, R]; with `pack_rows`,
`max_response_tokens` and `vision_images` fixed every batch has one shape.
"""
from __future__ import annotations

import dataclasses
import hashlib
import pathlib
import sys
from typing import Any, Mapping, Sequence

import grain
import numpy as np

from guijax.data.packing import PackingError, doubled, pack_tokens, plan_minibatches, plan_rows
from guijax.models.config import ModelConfig
from guijax.models.positions import mrope_positions, vision_layout
from guijax.models.vision_blocks import stack_blocks
from guijax.rollout.prompt import SYSTEM_PROMPT, Turn, build_messages, guided_instruction
from guijax.rollout.trajectory import Source, Trajectory
from guijax.sampling import bucket_for, pad_images, pad_to_image_bucket

IM_END = "<|im_end|>"


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    batch_size: int = 8
    max_images: int = 5  # K: screenshots kept as images (the current one included); older turns are text
    length_buckets: tuple[int, ...] = (256, 512, 1024, 2048, 4096, 8192)
    patch_bucket: int = 1024  # a batch's patch count is padded to a multiple of this
    system_prompt: str = SYSTEM_PROMPT
    grammar: str = "uitars"  # the action grammar of that prompt: how older turns are shown (envs.actions.grammar)
    seed: int = 0
    shuffle: bool = True
    num_epochs: int | None = 1  # None: repeat forever (each epoch shuffled differently)
    drop_remainder: bool = False  # True keeps every batch the same size (needed when it must divide the mesh)
    worker_count: int = 0  # grain worker processes for encoding + collation; 0: in the calling process
    worker_buffer_size: int = 2  # batches each worker prepares ahead
    read_threads: int = 1  # in-process prefetch threads when worker_count == 0 (0: fully synchronous)
    prefetch: int = 2  # in-process prefetch buffer (batches)
    response_bucket: int = 64  # `response_positions` width: the longest row's loss tokens rounded up (0: omit)
    max_response_tokens: int | None = None  # a fixed width instead (one shape); a row with more loss tokens raises
    dedupe_images: bool = True  # encode each distinct screenshot of a batch once (see `unique_images`)
    shuffle_block: int = 1  # shuffle runs of up to this many consecutive steps of a trajectory (see BlockShuffle)
    # > 1: the vision inputs come in this many per-device blocks of consecutive rows, each laid out over its own
    # rows' screenshots (guijax.models.vision_blocks); a short batch leaves the last blocks short or empty
    vision_blocks: int = 1
    # padding-free batches (guijax.data.packing): each batch's examples packed end to end into rows of
    # `pack_length` tokens (None: a length bucket chosen per batch by `pack_length_rule`),
    # `pack_rows` rows per batch (None: as many as the batch needs; a number gives every batch that fits one
    # shape, and one that does not pack_rows x 2^k rows) in `pack_blocks` per-device blocks; the examples'
    # rows (response space) padded to `batch_size`
    pack: bool = False
    pack_length: int | None = None
    # how a batch's row length is chosen when `pack_length` is None: "one_row", the smallest bucket that holds a
    # block's tokens in one row, else the largest (few shapes); "fewest_slots", the bucket whose rows hold the
    # batch in the fewest token slots (higher fill, more shapes)
    pack_length_rule: str = "one_row"
    pack_rows: int | None = None
    # token-budget minibatches: instead of `batch_size` steps each, a pass's steps are packed into the fewest
    # rows first-fit or least-slack filling finds and the rows, in a seeded order, fill minibatches of the one
    # packed shape `pack_rows` x `pack_length` (at most `batch_size` steps each), so the minibatches' count
    # follows the tokens and nearly every token slot is filled (guijax.data.packing.plan_minibatches), each
    # packing block planned as one; one pass (`num_epochs` 1). The pass order (and so `shuffle_block`'s runs of
    # shared screenshots) does not carry into the minibatches. One shape needs `max_response_tokens` and
    # `vision_images` fixed as well.
    pack_fill: bool = False
    pack_blocks: int = 1
    # > 0: every vision layout (each block's) holds exactly this many images, the distinct screenshots padded with
    # blank ones of their size, so the vision inputs have one shape whatever the batch (screenshots of one
    # size; a batch with more distinct ones gets this x 2^k). 0: padded to a multiple of `patch_bucket` patches.
    vision_images: int = 0


@dataclasses.dataclass(frozen=True)
class StepRef:
    """Which step of which trajectory, with the trajectory's scalar advantage."""

    trajectory: int
    step: int
    advantage: float


def step_refs(trajectories: Sequence[Trajectory] | Any,
              advantages: Sequence[float] | np.ndarray | Mapping[int, float] | None = None) -> list[StepRef]:
    """Flatten trajectories into step references.

    advantages: None (1.0 everywhere, e.g. SFT), an array aligned with `trajectories`, or a mapping
    {trajectory index: advantage} that also selects which trajectories are used (e.g. nonzero ones only).
    `trajectories` may be a TrajectoryStore; its step counts are read without decoding screenshots.
    """
    counts = ([n for _, n in trajectories.summaries()] if hasattr(trajectories, "summaries")
              else [len(t.steps) for t in trajectories])
    if advantages is None:
        chosen = {i: 1.0 for i in range(len(counts))}
    elif isinstance(advantages, Mapping):
        bad = [i for i in advantages if not 0 <= int(i) < len(counts)]
        if bad:
            raise ValueError(f"advantages name trajectories {bad} outside the {len(counts)} given")
        chosen = {int(i): float(a) for i, a in sorted(advantages.items())}
    else:
        adv = np.asarray(advantages, np.float64).reshape(-1)
        if len(adv) != len(counts):
            raise ValueError(f"{len(adv)} advantages for {len(counts)} trajectories")
        chosen = {i: float(a) for i, a in enumerate(adv)}
    return [StepRef(i, j, a) for i, a in chosen.items() for j in range(counts[i])]


def text_response(tokenizer: Any, text: str) -> np.ndarray:
    """Response text with no sampled ids as the tokens a model is trained to write: tokenised, closed with
    <|im_end|>."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.convert_tokens_to_ids(IM_END)]
    return np.asarray(ids, np.int32)


def response_length(step: Any, tokenizer: Any) -> int:
    """The tokens a step's response trains: its sampled ids, or its text tokenised as `text_response` does."""
    return len(step.response_tokens) if len(step.response_tokens) else len(text_response(tokenizer, step.response))


def supervised_tokens(prompt_ids: np.ndarray, response: np.ndarray, behaviour: np.ndarray, advantage: float,
                      max_tokens: int, where: str) -> dict[str, np.ndarray]:
    """An example's token-aligned arrays (the module docstring's convention): prompt then response ids, the loss
    mask and advantage on the response, its behaviour log-probs; longer than `max_tokens` is refused, naming
    `where`."""
    n_prompt, n = len(prompt_ids), len(prompt_ids) + len(response)
    if n > max_tokens:
        raise ValueError(f"{where}: {n} tokens ({n_prompt} prompt + {len(response)} response) exceed the largest "
                         f"length bucket {max_tokens}")
    loss_mask = np.zeros(n, np.float32)
    loss_mask[n_prompt:] = 1.0
    behaviour_lp = np.zeros(n, np.float32)
    behaviour_lp[n_prompt:] = behaviour
    return {"input_ids": np.concatenate([prompt_ids, response]), "loss_mask": loss_mask,
            "advantages": loss_mask * np.float32(advantage), "behaviour_logprobs": behaviour_lp}


class EncodeStep(grain.transforms.Map):
    """StepRef -> one example (token-aligned arrays, see the module docstring). Picklable for grain workers:
    holds the trajectories (a list or a TrajectoryStore) and a processor, or the processor's directory, which
    each worker then loads itself."""

    def __init__(self, trajectories: Sequence[Trajectory] | Any, processor: Any, config: PipelineConfig):
        self.trajectories, self.config = trajectories, config
        self._processor_path = str(processor) if isinstance(processor, (str, pathlib.Path)) else None
        self._processor = None if self._processor_path else processor

    @property
    def processor(self) -> Any:
        if self._processor is None:
            from guijax.models.processor import Processor

            self._processor = Processor.from_pretrained(self._processor_path)
        return self._processor

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        if self._processor_path:
            state["_processor"] = None
        return state

    def _prompt(self, ref: StepRef) -> tuple[Any, Any, str, str, list[Any]]:
        """(trajectory, step, how errors name it, the prompt text with one placeholder per image, the images)."""
        traj = self.trajectories[ref.trajectory]
        step = traj.steps[ref.step]
        where = f"task {traj.task_id} (trajectory {ref.trajectory}) step {ref.step}"
        turns = [Turn(s.screenshot, s.response) for s in traj.steps[:ref.step]]
        instruction = guided_instruction(traj.instruction, traj.meta.get("guidance", ""))
        messages, images = build_messages(instruction, turns, step.screenshot, max_images=self.config.max_images,
                                          plan=traj.plan, system_prompt=self.config.system_prompt,
                                          grammar=self.config.grammar)
        return traj, step, where, self.processor.apply_chat_template(messages, add_generation_prompt=True), images

    def length(self, ref: StepRef) -> int:
        """The example's token count, prompt and response, without processing its screenshots: what
        token-budget minibatches are planned by (`PipelineConfig.pack_fill`)."""
        _, step, _, text, images = self._prompt(ref)
        return self.processor.prompt_length(text, images) + response_length(step, self.processor.tokenizer)

    def map(self, ref: StepRef) -> dict[str, Any]:
        traj, step, where, text, images = self._prompt(ref)
        proc = self.processor
        prompt = proc(text=[text], images=[images])
        prompt_ids = np.asarray(prompt["input_ids"][0], np.int32)
        sampled = len(step.response_tokens) > 0
        if sampled:
            response = np.asarray(step.response_tokens, np.int32)
            behaviour = np.asarray(step.behaviour_logprobs, np.float32)
            if behaviour.shape != response.shape:
                raise ValueError(f"{where}: {len(behaviour)} behaviour log-probs for {len(response)} response tokens")
        else:  # off-policy text: no sampled ids, no behaviour log-probs
            response = text_response(proc.tokenizer, step.response)
            behaviour = np.zeros(len(response), np.float32)
        return {**supervised_tokens(prompt_ids, response, behaviour, ref.advantage, max(self.config.length_buckets),
                                    where),
                "pixel_values": np.asarray(prompt["pixel_values"], np.float32),
                "image_grid_thw": np.asarray(prompt["image_grid_thw"], np.int64).reshape(-1, 3),
                "image_keys": self.image_keys(ref, len(images)),
                "trajectory": ref.trajectory, "step": ref.step, "task_id": traj.task_id,
                "source": Source(traj.source).value, "sampled": sampled}

    def image_keys(self, ref: StepRef, count: int) -> np.ndarray:
        """(trajectory, step) of each screenshot in the prompt: the last `max_images` steps up to this one, as
        `build_messages` picks them. Equal keys are the same screenshot, processed the same way."""
        first = max(0, ref.step - (self.config.max_images - 1))
        keys = np.asarray([(ref.trajectory, j) for j in range(first, ref.step + 1)], np.int64).reshape(-1, 2)
        if len(keys) != count:
            raise AssertionError(f"trajectory {ref.trajectory} step {ref.step}: {count} images, {len(keys)} keys")
        return keys


class ResponseBudgetError(ValueError):
    """A row has more loss tokens than the response budget; `row` says which."""

    def __init__(self, message: str, row: int):
        super().__init__(message)
        self.row = row


def response_positions(loss_mask: np.ndarray, bucket: int = 64, budget: int | None = None) -> np.ndarray:
    """[b, R] int32 indices of each row's loss positions (ascending), -1 in the unused slots.

    R is the longest row's count rounded up to `bucket` (few distinct shapes to compile; at most the sequence
    length), or the fixed `budget`. The response-only log-prob path computes nothing anywhere else, so a row
    that does not fit raises rather than losing tokens."""
    hit = np.asarray(loss_mask) > 0
    b, s = hit.shape
    counts = hit.sum(1)
    width = budget if budget is not None else min(-(-max(int(counts.max(initial=0)), 1) // bucket) * bucket, s)
    over = np.flatnonzero(counts > width)
    if over.size:
        row = int(over[0])
        raise ResponseBudgetError(f"row {row} has {int(counts[row])} loss tokens, more than the response budget "
                                  f"of {width} positions", row)
    order = np.argsort(~hit, axis=1, kind="stable")[:, :width]  # loss positions first, in order
    filled = np.arange(width)[None, :] < counts[:, None]
    return np.where(filled, order, -1).astype(np.int32)


@dataclasses.dataclass(frozen=True)
class UniqueImages:
    """The distinct images of a batch, in first-appearance order, and which of them each row shows."""

    pixel_values: np.ndarray  # patches of the distinct images, concatenated
    grids: np.ndarray  # [unique, 3]
    rows: list[list[int]]  # per row, the distinct image index of each of its images, in prompt order
    total: int  # images over all rows, repeats included


def _split_images(pixel_values: np.ndarray, grids: np.ndarray) -> list[np.ndarray]:
    ends = np.cumsum(np.prod(grids, axis=1))
    return np.split(pixel_values, ends[:-1]) if len(grids) else []


def _keys(example: Mapping[str, Any], images: list[np.ndarray]) -> list[Any]:
    """Image identities: EncodeStep's (trajectory, step) keys, else a digest of the patches (examples built
    elsewhere)."""
    if "image_keys" in example:
        return [tuple(int(v) for v in k) for k in example["image_keys"]]
    return [hashlib.blake2b(np.ascontiguousarray(x).tobytes(), digest_size=16).digest() for x in images]


def unique_images(examples: Sequence[Mapping[str, Any]]) -> UniqueImages:
    """Deduplicate the batch's images. Consecutive steps of a trajectory share all but one screenshot of their
    history, so rows of one trajectory in a batch (many with `shuffle_block`) repeat most of their screenshots.
    A repeated key must carry the same grid and patches (spot-checked on a strided sample): a wrong identity
    would give rows another screenshot's features."""
    index: dict[Any, int] = {}
    pixels: list[np.ndarray] = []
    grids: list[np.ndarray] = []
    rows: list[list[int]] = []
    total = 0
    for e in examples:
        grid = np.asarray(e["image_grid_thw"], np.int64).reshape(-1, 3)
        images = _split_images(np.asarray(e["pixel_values"]), grid)
        row = []
        for key, image, g in zip(_keys(e, images), images, grid):
            if key not in index:
                index[key] = len(pixels)
                pixels.append(image)
                grids.append(g)
            k = index[key]
            sample = lambda x: x.reshape(-1)[::997]  # noqa: E731
            if not (np.array_equal(grids[k], g) and np.array_equal(sample(pixels[k]), sample(image))):
                raise ValueError(f"image {key} appears with different pixels in one batch; its identity is not unique")
            row.append(k)
        rows.append(row)
        total += len(images)
    dim = pixels[0].shape[1] if pixels else 0
    return UniqueImages(np.concatenate(pixels) if pixels else np.zeros((0, dim), np.float32),
                        np.asarray(grids, np.int64).reshape(-1, 3), rows, total)


def token_features(input_ids: np.ndarray, image_token_id: int, images: UniqueImages, merge: int) -> np.ndarray:
    """[b * s] int32: the merged vision feature (row of the vision tower's output over `images`) the k-th
    image-pad token of the batch (row-major) takes; -1 past the last. A row's image-pad tokens run through its
    images in prompt order, each image contributing t·h·w / merge² of them. The length depends only on the
    batch shape, so it adds no compiled shapes."""
    units = np.prod(images.grids, axis=1) // (merge * merge)
    starts = np.cumsum(units) - units
    out = np.full(input_ids.size, -1, np.int32)
    filled = 0
    for row, shown in enumerate(images.rows):
        slots = int((input_ids[row] == image_token_id).sum())
        feats = np.concatenate([starts[k] + np.arange(units[k]) for k in shown]) if shown else np.zeros(0, np.int64)
        if slots != len(feats):
            raise ValueError(f"row {row}: {slots} image-pad tokens for images with {len(feats)} features")
        out[filled:filled + slots] = feats
        filled += slots
    return out


def step_name(example: Mapping[str, Any]) -> str:
    """How errors name an example: its task, trajectory and step."""
    return f"task {example['task_id']} (trajectory {example['trajectory']}) step {example['step']}"


def row_flags(examples: Sequence[Mapping[str, Any]], rows: int) -> dict[str, np.ndarray]:
    """Each row's `off_policy`, `expert` and `failure` flag (Collate's docstring), `rows` long: the examples'
    rows first, then empty ones (no flag set)."""
    sources = [e["source"] for e in examples]
    pad = lambda values, dtype: np.pad(np.asarray(values, dtype), (0, rows - len(examples)))  # noqa: E731
    return {"off_policy": pad([s != Source.ON_POLICY.value for s in sources], bool),
            "expert": pad([not e["sampled"] for e in examples], np.float32),
            "failure": pad([s == Source.FAILURE.value for s in sources], bool)}


def batch_meta(examples: Sequence[Mapping[str, Any]], screenshots: int, encoded: int,
               token_fill: float) -> dict[str, Any]:
    """The host-only `meta` of a batch: which step each example is, and what its screenshots and token slots
    cost (`encoded` screenshots through the vision tower of `screenshots` shown; real tokens / token slots)."""
    return {"trajectory": np.asarray([e["trajectory"] for e in examples], np.int32),
            "step": np.asarray([e["step"] for e in examples], np.int32),
            "task_id": np.asarray([e["task_id"] for e in examples]),
            "source": np.asarray([e["source"] for e in examples]),
            "screenshots": np.int32(screenshots), "unique_screenshots": np.int32(encoded),
            "screenshot_dedupe_ratio": np.float32(encoded / max(screenshots, 1)),
            "token_fill": np.float32(token_fill)}


class Collate:
    """A list of examples -> one padded batch: exactly the arrays the model forward (ModelInputs fields) and
    the train step take, plus host-only `meta`. A class, not a lambda, so grain workers can unpickle it.

    Row flags: `off_policy` marks trajectories not sampled by the current rollout (source replay, cache or
    expert: LUFFY's off-policy rows); `expert` marks steps with no sampled ids (text tokenised here, zero
    behaviour log-probs: the rows an RL+SFT cross-entropy term applies to); `failure` marks steps judged to
    have caused a failure (source failure: the rows SEAgent's adversarial imitation pushes away from)."""

    def __init__(self, model_cfg: ModelConfig, config: PipelineConfig, pad_id: int = 0):
        self.model_cfg, self.config, self.pad_id = model_cfg, config, pad_id

    def __call__(self, examples: Sequence[dict[str, Any]]) -> dict[str, Any]:
        if self.config.pack:
            return self.packed(examples)
        cfg = self.model_cfg
        lengths = [len(e["input_ids"]) for e in examples]
        try:
            length = bucket_for(max(lengths), self.config.length_buckets)
        except ValueError:
            e = examples[int(np.argmax(lengths))]
            raise ValueError(f"{step_name(e)}: {max(lengths)} tokens exceed the largest length bucket "
                             f"{max(self.config.length_buckets)}") from None
        b = len(examples)
        ids = np.full((b, length), self.pad_id, np.int32)
        mask = np.zeros((b, length), np.int32)
        token = {k: np.zeros((b, length), np.float32) for k in ("loss_mask", "behaviour_logprobs", "advantages")}
        for i, e in enumerate(examples):
            n = lengths[i]
            ids[i, :n], mask[i, :n] = e["input_ids"], 1
            for k in token:
                token[k][i, :n] = e[k]
        # position t predicts token t+1: shift targets and everything that describes the target left by one
        shifted = {k: np.concatenate([v[:, 1:], np.zeros((b, 1), v.dtype)], axis=1) for k, v in token.items()}
        targets = np.concatenate([ids[:, 1:], np.zeros((b, 1), np.int32)], axis=1)
        grids = np.concatenate([e["image_grid_thw"] for e in examples]).reshape(-1, 3)
        positions, _ = mrope_positions(ids, mask, grids if len(grids) else None, cfg)
        vision, images = self.vision(examples, ids, grids)
        out = {"input_ids": ids, "attention_mask": mask, "positions": positions, "vision": vision,
               "targets": targets, **shifted, **row_flags(examples, b),
               "meta": batch_meta(examples, len(grids), images, sum(lengths) / mask.size)}
        if self.config.response_bucket or self.config.max_response_tokens is not None:
            out["response_positions"] = self.response_positions(shifted["loss_mask"], examples)
        return out

    def vision(self, examples: Sequence[dict[str, Any]], ids: np.ndarray,
               grids: np.ndarray) -> tuple[dict[str, np.ndarray] | None, int]:
        """Vision inputs over the batch's images, padded to the patch bucket, and how many images the tower
        encodes. With `dedupe_images` each distinct image is there once and `token_features` maps the
        image-pad tokens to its features."""
        if not len(grids):
            return None, 0
        blocks = self.config.vision_blocks
        if blocks == 1:
            return self._vision_parts([(examples, ids, None)])
        # block b holds rows [b * rows, (b + 1) * rows): the rows each device gets once the batch is padded to
        # a multiple of the devices (`sharding.pad_rows`); a short batch leaves the last blocks short or empty
        rows = -(-len(examples) // blocks)
        return self._vision_parts([(examples[i:i + rows], ids[i:i + rows], None) for i in range(0, blocks * rows, rows)])

    def _vision_parts(self, parts: Sequence[tuple[Sequence[dict[str, Any]], np.ndarray, list[list[int]] | None]]
                      ) -> tuple[dict[str, np.ndarray], int]:
        """One layout per part (examples, their token rows, which examples each token row holds; None: one
        each), stacked into per-device blocks when there are several."""
        laid = []
        for examples, ids, members in parts:
            grids = np.concatenate([e["image_grid_thw"] for e in examples]
                                   or [np.zeros((0, 3), np.int64)]).reshape(-1, 3)
            laid.append(self._pixels(examples, ids, grids, members))
        encoded = sum(len(g) for _, g, _ in laid)
        if self.config.vision_images:  # a batch past the fixed shape: the fewest doublings that hold it
            count, grid = doubled(self.config.vision_images, max(len(g) for _, g, _ in laid)), self._common_grid(parts)
            fixed = [self._fixed_layout(*part, grid, count) for part in laid]
            return (fixed[0] if len(fixed) == 1 else stack_blocks(fixed)), encoded
        bucket = self.config.patch_bucket
        if len(laid) == 1:
            return self._layout(*laid[0], bucket), encoded
        common = max(max(-(-len(pixels) // bucket) * bucket, bucket) for pixels, _, _ in laid)
        return stack_blocks([self._layout(*part, common) for part in laid]), encoded

    @staticmethod
    def _common_grid(parts: Sequence[tuple[Sequence[dict[str, Any]], Any, Any]]) -> np.ndarray:
        """The one screenshot grid of the batch (a fixed vision shape pads with blank images of it)."""
        grids: dict[tuple[int, ...], dict[str, Any]] = {}  # each grid and the first step showing it
        for examples, _, _ in parts:
            for e in examples:
                for g in np.asarray(e["image_grid_thw"]).reshape(-1, 3):
                    grids.setdefault(tuple(int(v) for v in g), e)
        if len(grids) > 1:
            (a, ea), (b, eb) = list(grids.items())[:2]
            raise ValueError(f"screenshots of different sizes in one batch (grid {a} in task {ea['task_id']} step "
                             f"{ea['step']}, {b} in task {eb['task_id']} step {eb['step']}): "
                             "PipelineConfig.vision_images needs one screenshot size; set it to 0")
        return np.asarray(next(iter(grids)), np.int64)

    def _fixed_layout(self, pixels: np.ndarray, grids: np.ndarray, index: np.ndarray | None,
                      grid: np.ndarray, count: int) -> dict[str, np.ndarray]:
        """Vision inputs over exactly `count` images of `grid`: the layout arrays then have one shape."""
        return self._inputs(*pad_to_image_bucket(pixels, grids, count, grid), index)

    def _pixels(self, examples: Sequence[dict[str, Any]], ids: np.ndarray, grids: np.ndarray,
                members: list[list[int]] | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """The rows' patches (each distinct image once under `dedupe_images`), their grids, and the feature
        each image-pad token takes (None: in order). `members`: the examples each row of `ids` holds, in
        order (packed rows); None: row i is example i."""
        if self.config.dedupe_images and len(grids):
            images = unique_images(examples)
            if members is not None:
                images = dataclasses.replace(images, rows=[[k for i in row for k in images.rows[i]]
                                                           for row in members])
            index = token_features(ids, self.model_cfg.image_token_id, images,
                                   self.model_cfg.vision.spatial_merge_size)
            return images.pixel_values, images.grids, index
        if not len(grids):
            width = self.model_cfg.vision.patch_dim
            return np.zeros((0, width), np.float32), grids.reshape(0, 3), None
        return np.concatenate([e["pixel_values"] for e in examples]), grids, None

    def _layout(self, pixels: np.ndarray, grids: np.ndarray, index: np.ndarray | None,
                multiple: int) -> dict[str, np.ndarray]:
        """Vision inputs over `pixels`, padded with a filler image to a multiple of `multiple` patches."""
        pixels, grids = pad_images(pixels, grids, multiple, self.model_cfg.vision.spatial_merge_size)
        return self._inputs(pixels, grids, index)

    def _inputs(self, pixels: np.ndarray, grids: np.ndarray, index: np.ndarray | None) -> dict[str, np.ndarray]:
        """The model's `vision` argument over `pixels` laid out by `grids` (fillers included)."""
        vision = vision_layout(grids, self.model_cfg.vision).inputs(pixels)
        if self.config.dedupe_images:
            vision["token_features"] = np.zeros(0, np.int32) if index is None else index
        return vision

    def packed(self, examples: Sequence[dict[str, Any]]) -> dict[str, Any]:
        """The padding-free batch (guijax.data.packing): packed model inputs, response-space training arrays
        over `batch_size` rows (examples first, then empty rows), per-row flags padded the same way."""
        cfg, config = self.model_cfg, self.config
        lengths = [len(e["input_ids"]) for e in examples]
        blocks, size = config.pack_blocks, config.batch_size
        if config.vision_blocks not in (1, blocks):
            raise ValueError(f"vision_blocks={config.vision_blocks} with pack_blocks={blocks}: per-device vision "
                             "blocks must be the packing blocks")
        if size % blocks:
            raise ValueError(f"batch size {size} does not divide into {blocks} packing blocks")
        length = config.pack_length or self._pack_length(lengths, size, blocks)
        try:
            layout = plan_rows(lengths, size, length, config.pack_rows, blocks, grow=True)
        except PackingError as err:
            e = examples[err.example]
            raise ValueError(f"{step_name(e)}: {err}; raise PipelineConfig.pack_length or leave it None") from None
        positions = []
        for e in examples:
            grid = np.asarray(e["image_grid_thw"], np.int64).reshape(-1, 3)
            positions.append(mrope_positions(np.asarray(e["input_ids"])[None], None, grid if len(grid) else None,
                                             cfg)[0][:, 0])
        counts = [int((np.asarray(e["loss_mask"])[1:] > 0).sum()) for e in examples]
        bucket = config.response_bucket or 64
        width = config.max_response_tokens or -(-max(max(counts, default=1), 1) // bucket) * bucket
        try:
            out = pack_tokens(examples, layout, size, positions, width, self.pad_id)
        except PackingError as err:
            e = examples[err.example]
            raise ValueError(f"{step_name(e)}: {err}; raise PipelineConfig.max_response_tokens or leave it "
                             "None") from None
        grids = [np.asarray(e["image_grid_thw"]).reshape(-1, 3) for e in examples]
        vision, images = None, 0
        if sum(len(g) for g in grids):
            rows = layout.rows_per_block
            groups = ([range(len(layout.rows))] if config.vision_blocks == 1
                      else [range(k * rows, (k + 1) * rows) for k in range(blocks)])
            parts = []
            for group in groups:
                order = [i for r in group for i in layout.rows[r]]
                where = {i: j for j, i in enumerate(order)}
                parts.append(([examples[i] for i in order], out["input_ids"][list(group)],
                               [[where[i] for i in layout.rows[r]] for r in group]))
            vision, images = self._vision_parts(parts)
        meta = batch_meta(examples, int(sum(len(g) for g in grids)), images, sum(lengths) / out["input_ids"].size)
        out.update(vision=vision, **row_flags(examples, size), meta=dict(meta, packed_rows=np.int32(len(layout.rows))))
        return out

    def _pack_length(self, lengths: Sequence[int], size: int, blocks: int) -> int:
        """The batch's row length under `pack_length_rule` (see PipelineConfig); the largest bucket when an example
        is longer than every one (plan_rows then names it)."""
        buckets = sorted(self.config.length_buckets)
        fitting = [b for b in buckets if b >= max(lengths)]
        if not fitting:
            return buckets[-1]
        if self.config.pack_length_rule == "one_row":
            per_block = size // blocks
            fullest = max(sum(lengths[k * per_block:(k + 1) * per_block]) for k in range(blocks))
            return next((b for b in fitting if b >= fullest), buckets[-1])
        if self.config.pack_length_rule != "fewest_slots":
            raise ValueError(f"pack_length_rule={self.config.pack_length_rule!r}: choose 'one_row' or 'fewest_slots'")
        # Why: packing leaves the end of most rows empty, and a row several examples long wastes less of it when
        # its length fits their sum. Ties go to the shorter rows, whose attention tiles are fewer; with
        # `pack_rows`, the buckets that need no more rows than that come first (more rows is another shape).
        fixed = self.config.pack_rows

        def cost(length: int) -> tuple[bool, int, int]:
            rows = len(plan_rows(lengths, size, length, fixed, blocks, grow=True).rows)
            return fixed is not None and rows > fixed, rows * length, length

        return min(fitting, key=cost)

    def response_positions(self, loss_mask: np.ndarray, examples: Sequence[dict[str, Any]]) -> np.ndarray:
        try:
            return response_positions(loss_mask, self.config.response_bucket or 64, self.config.max_response_tokens)
        except ResponseBudgetError as err:
            e = examples[err.row]
            raise ValueError(f"{step_name(e)}: {err}; raise PipelineConfig.max_response_tokens or leave it "
                             "None") from None


def blank_example(model_cfg: ModelConfig) -> dict[str, Any]:
    """An example of no tokens and no screenshots: it holds a packing block's place when the block has fewer
    steps than its share of the batch, so the next block's steps keep theirs. Its response row has no loss
    position and its `meta` entry trajectory and step -1."""
    empty = np.zeros(0, np.float32)
    return {"input_ids": np.zeros(0, np.int32), "loss_mask": empty, "advantages": empty,
            "behaviour_logprobs": empty, "pixel_values": np.zeros((0, model_cfg.vision.patch_dim), np.float32),
            "image_grid_thw": np.zeros((0, 3), np.int64), "image_keys": np.zeros((0, 2), np.int64),
            "trajectory": -1, "step": -1, "task_id": "", "source": Source.ON_POLICY.value, "sampled": True}


class EncodeBatch(grain.transforms.Map):
    """A planned minibatch (the step refs of each packing block) -> its batch (token-budget minibatches); each
    block but the last filled up to its share of the batch with blank examples. Picklable for grain workers."""

    def __init__(self, encode: Any, collate: Collate):
        self.encode, self.collate = encode, collate

    def map(self, parts: Sequence[Sequence[StepRef]]) -> dict[str, Any]:
        config = self.collate.config
        per_block = config.batch_size // config.pack_blocks
        examples: list[dict[str, Any]] = []
        for k, part in enumerate(parts):
            examples += [self.encode.map(r) for r in part]
            if k < len(parts) - 1:
                examples += [blank_example(self.collate.model_cfg)] * (per_block - len(part))
        return self.collate(examples)


def pack_fill_unset(pack: Any, pack_length: Any, pack_rows: Any) -> str:
    """What token-budget minibatches lack of their packed shape, as one line ('' when nothing): the pipeline's
    check and the launch preflight say it alike."""
    missing = [key for key, value in (("pipeline.pack", pack), ("pipeline.pack_length", pack_length),
                                      ("pipeline.pack_rows", pack_rows)) if not value]
    return f"pipeline.pack_fill fills one packed shape: set {', '.join(missing)}" if missing else ""


def check_fill(config: PipelineConfig, encode: Any) -> None:
    """What token-budget minibatches (`PipelineConfig.pack_fill`) need, each missing piece named."""
    unset = pack_fill_unset(config.pack, config.pack_length, config.pack_rows)
    if unset:
        raise ValueError(unset)
    if config.pack_rows % config.pack_blocks or config.batch_size % config.pack_blocks:
        raise ValueError(f"pipeline.pack_fill: pack_rows={config.pack_rows} and batch size {config.batch_size} "
                         f"must be multiples of the {config.pack_blocks} packing blocks")
    if config.num_epochs != 1:
        raise ValueError(f"pipeline.pack_fill plans one pass over the steps; num_epochs={config.num_epochs}")
    if not hasattr(encode, "length"):
        raise ValueError(f"pipeline.pack_fill plans by token counts; {type(encode).__name__} gives none (length)")


def filled_minibatches(refs: Sequence[StepRef], encode: Any,
                       config: PipelineConfig) -> list[list[list[StepRef]]]:
    """`refs` (in their pass order) planned into token-budget minibatches (`PipelineConfig.pack_fill`), each as
    its packing blocks' step refs: every block (a data-parallel device's share, pack_rows / blocks rows and
    batch_size / blocks steps) is planned as a minibatch of its own, and consecutive blocks make a minibatch
    (the last one may have fewer). `config` as `check_fill` passed it."""
    lengths = [encode.length(r) for r in refs]
    blocks = config.pack_blocks
    try:
        plan = plan_minibatches(lengths, config.pack_rows // blocks, config.pack_length, config.batch_size // blocks,
                                config.seed)
    except PackingError as err:
        ref = refs[err.example]
        raise ValueError(f"trajectory {ref.trajectory} step {ref.step}: {err}; raise pipeline.pack_length") from None
    parts = [[refs[i] for i in members] for members in plan]
    return [parts[k:k + blocks] for k in range(0, len(parts), blocks)]


class BlockShuffle(grain.MapDataset):
    """Step refs in a seeded random order of blocks: runs of up to `block` consecutive steps of one trajectory,
    reshuffled every epoch (`epochs` None: endless). Consecutive steps share all but one of their `max_images`
    screenshots, so a batch made of such runs encodes far fewer distinct screenshots (`dedupe_images`); the
    price is minibatches drawn from fewer trajectories. Indexable, so grain's iterator state resumes it."""

    def __init__(self, refs: Sequence[StepRef], block: int, seed: int, epochs: int | None):
        super().__init__()
        self.refs, self.seed, self.epochs = list(refs), seed, epochs
        self.blocks: list[list[int]] = []
        for i, ref in enumerate(self.refs):
            last = self.refs[self.blocks[-1][-1]] if self.blocks else None
            if last is None or len(self.blocks[-1]) >= block or (last.trajectory, last.step + 1) != (
                    ref.trajectory, ref.step):
                self.blocks.append([])
            self.blocks[-1].append(i)
        self._order: tuple[int, np.ndarray] | None = None

    def __len__(self) -> int:
        return len(self.refs) * self.epochs if self.epochs is not None else sys.maxsize

    def order(self, epoch: int) -> np.ndarray:
        if self._order is None or self._order[0] != epoch:
            rng = np.random.default_rng((self.seed, epoch))
            self._order = (epoch, np.concatenate([self.blocks[k] for k in rng.permutation(len(self.blocks))]))
        return self._order[1]

    def __getitem__(self, index: int) -> StepRef:
        epoch, i = divmod(int(index), len(self.refs))
        return self.refs[self.order(epoch)[i]]

    def __str__(self) -> str:
        return f"BlockShuffle(block={len(max(self.blocks, key=len))}, seed={self.seed})"


def make_dataset(trajectories: Sequence[Trajectory] | Any, refs: Sequence[StepRef], processor: Any,
                 model_cfg: ModelConfig, config: PipelineConfig, encode: Any = None) -> grain.IterDataset:
    """The batch pipeline. Deterministic for `config.seed` (also across worker counts); `iter()` of it gives a
    grain DatasetIterator whose `get_state()` / `set_state()` resume it exactly.

    processor: a guijax.models.processor.Processor, or its directory (then loaded inside each worker).
    encode: what turns a StepRef into an example (default: `EncodeStep` over `trajectories`; chat examples that
    are not agent steps come with guijax.data.chat_examples.EncodeChat).
    """
    if not refs:
        raise ValueError("no steps to train on: every trajectory was empty or filtered out")
    encode = EncodeStep(trajectories, processor, config) if encode is None else encode
    pad_id = encode.processor.tokenizer.pad_token_id  # same padding whichever form the processor came in
    if config.shuffle and config.shuffle_block > 1:
        ds = BlockShuffle(refs, config.shuffle_block, config.seed, config.num_epochs)
    else:
        ds = grain.MapDataset.source(list(refs))
        if config.shuffle:
            ds = ds.shuffle(seed=config.seed)
        if config.num_epochs != 1:
            ds = ds.repeat(config.num_epochs)
    collate = Collate(model_cfg, config, int(pad_id or 0))
    if config.pack_fill:  # the pass's order, planned into minibatches by their tokens
        check_fill(config, encode)
        planned = filled_minibatches([ds[i] for i in range(len(ds))], encode, config)
        ds = grain.MapDataset.source(planned).map(EncodeBatch(encode, collate))
    else:
        ds = ds.map(encode).batch(config.batch_size, drop_remainder=config.drop_remainder, batch_fn=collate)
    if config.worker_count > 0:
        _ensure_absl_flags()
        return ds.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)).mp_prefetch(
            grain.MultiprocessingOptions(num_workers=config.worker_count,
                                         per_worker_buffer_size=config.worker_buffer_size))
    return ds.to_iter_dataset(grain.ReadOptions(num_threads=config.read_threads, prefetch_buffer_size=config.prefetch))


def _ensure_absl_flags() -> None:
    """grain's worker processes read absl flags; outside an absl app (pytest, notebooks) take their defaults."""
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


def global_batch(local: dict[str, Any], mesh: Any, image_token_id: int | None = None) -> dict[str, Any]:
    """Host-local numpy batch -> jax Arrays: rows sharded over the mesh's (data, fsdp) axes (`positions` on its
    batch axis 1), vision inputs replicated, `meta` left on the host. With several processes each contributes
    its local rows and the processes' patches are merged into one array (needs `image_token_id`); see
    guijax.sharding.place_batch / place_vision."""
    from guijax.sharding import place_batch

    return place_batch(local, mesh, image_token_id=image_token_id)
