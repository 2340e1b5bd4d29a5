"""Batched multimodal sampling with a KV cache: one prefill over right-padded prompts, then a jitted decode
loop that stops when every row has emitted a stop token or `max_new_tokens` is reached.

Prompts are right-padded to a length bucket (the layout cuDNN's flash attention takes for the prefill) and
images padded to a patch-count bucket, so a run compiles a handful of programs rather than one per batch.
Returned log-probs are those of the behaviour distribution, softmax(logits / temperature) before top-k /
top-p truncation (what the PPO ratio's denominator needs; the trainer scores tokens at the same temperature).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from guijax.models.config import ModelConfig
from guijax.models.positions import mrope_positions, vision_layout
from guijax.models.qwen2_5_vl import KVCache, Qwen2_5_VL, constrain_cache, default_cache_dtype, init_cache
from guijax.sharding import DATA_AXES, data_parallel_size

DEFAULT_PROMPT_BUCKETS = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    max_new_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()  # e.g. <|im_end|>, <|endoftext|>
    stop_strings: tuple[str, ...] = ()  # cut on the host after decoding
    prompt_buckets: tuple[int, ...] = DEFAULT_PROMPT_BUCKETS
    patch_bucket: int = 1024  # image patches are padded up to a multiple of this
    # Never sample the vision placeholders (image/video pad, vision start/end): they are input-only, and one in
    # a response would be taken for an image by M-RoPE and the vision merge when the step is trained on.
    # Released checkpoints give them ~0 probability; a fresh or tiny model does not. The behaviour log-probs
    # are then over the other tokens, off from the trainer's full-vocabulary ones by log(1 - p(placeholders)).
    suppress_vision_tokens: bool = True
    # Rows are padded up to the next power of two (text-only dummy rows, dropped from the output), so a
    # shrinking set of live episodes reuses a few compiled programs instead of compiling one per batch size.
    pad_batch_to_power_of_two: bool = True
    # Likewise the screenshots, when a call's are all of one size: blank ones of that size are appended up to the
    # rows (padded ones included) x the screenshots per row rounded up (past 8, to 12, 16, 24, ...), so the vision
    # inputs' shapes (patches, windows, frames) follow the row count and a few per-row counts instead of taking
    # one value per screenshot count as live episodes come and go (one screenshot per row: one shape per row
    # count; rows that all hold `max_images` need no blank). False, or screenshots of several sizes: one filler
    # image pads the patches to a multiple of patch_bucket.
    pad_images_with_rows: bool = True
    # Rows per device program (0: all in one). The KV cache grows with rows x (prompt + new tokens): a 7B
    # prompt with five full-HD screenshots is ~16k tokens, so the rows that fit beside the parameters are
    # planned by `python -m guijax.launch --dry_run` and a larger batch is generated in chunks of this size.
    max_rows: int = 0
    # Rows per prefill pass (0: all in one). Prefill's transients grow with rows x prompt (a 7B model's MLP
    # at 64 prompts of ~14k tokens: ~68 GB) while decode's only working set is the KV cache, so a large batch
    # fills the cache a few rows at a time and then decodes every row together (unlike `max_rows`, which
    # decodes each chunk on its own, at a smaller batch). With a data-parallel mesh each device's rows are cut
    # alike, so no chunk leaves its device.
    prefill_rows: int = 0
    # > 1: when the rows split over the data-parallel devices, the screenshots come in this many per-device blocks,
    # each laid out over its own rows' images (guijax.models.vision_blocks), so the tower's gathers stay on
    # their device instead of being replicated (the training step's `pipeline.vision_per_device`)
    vision_blocks: int = 1


@dataclasses.dataclass
class SampleOutput:
    tokens: np.ndarray  # [b, max_new_tokens] generated ids, pad after the end
    logprobs: np.ndarray  # [b, max_new_tokens] behaviour log-probs, 0 after the end
    lengths: np.ndarray  # [b] tokens kept (stop token included when stopped by id)
    stopped: np.ndarray  # [b] True when a stop token or stop string ended the row
    texts: list[str] | None = None


def _images_per_row(input_ids: np.ndarray, attention_mask: np.ndarray, image_grid_thw: Any,
                    cfg: ModelConfig) -> np.ndarray:
    """Cumulative image counts by row ([rows + 1]): the grids of row r are image_grid_thw[out[r]:out[r+1]],
    matched by the image-pad tokens each row holds (each grid fills t*h*w / merge^2 of them)."""
    tokens = ((np.asarray(input_ids) == cfg.image_token_id) & (np.asarray(attention_mask) > 0)).sum(1)
    per_image = np.prod(np.asarray(image_grid_thw), axis=1) // cfg.vision.spatial_merge_size ** 2
    bounds, image = [0], 0
    for need in tokens:
        while need > 0:
            need -= int(per_image[image])
            image += 1
        if need:
            raise ValueError("image_grid_thw does not match the image-pad tokens of the rows")
        bounds.append(image)
    return np.asarray(bounds)


def vision_placeholder_ids(cfg: ModelConfig) -> list[int]:
    """The input-only vision tokens (image/video pad, vision start/end) in the vocabulary: what a sampler with
    `suppress_vision_tokens` never samples, this one or a serving engine."""
    return [i for i in (cfg.image_token_id, cfg.video_token_id, cfg.vision_start_token_id, cfg.vision_end_token_id)
            if i is not None and 0 <= i < cfg.vocab_size]


def bucket_for(n: int, buckets: Sequence[int]) -> int:
    for b in sorted(buckets):
        if n <= b:
            return b
    raise ValueError(f"prompt of {n} tokens exceeds the largest prompt bucket {max(buckets)}")


def geometric_bucket(n: int) -> int:
    """The smallest of 1, 2, 3, 4, 6, 8, 12, 16, 24, ... (powers of two and 1.5x them) that is >= n."""
    if n <= 2:
        return max(n, 1)
    power = 1 << (n - 1).bit_length()
    return power * 3 // 4 if n <= power * 3 // 4 else power


def image_bucket(images: int, rows: int) -> int:
    """Screenshots a layout of `rows` rows holding `images` is padded to: rows x the screenshots per row rounded
    up, and past 8 per row up to the next geometric bucket (12, 16, 24, ...)."""
    per_row = -(-images // max(rows, 1))
    return rows * max(per_row if per_row <= 8 else geometric_bucket(per_row), 1)


def images_padded_with_rows(config: Any) -> bool:
    """Whether a run config's sampler pads screenshots in step with its rows (`rollout.sampler_image_buckets`)."""
    return config.rollout.get("sampler_image_buckets", "rows") == "rows"


def pad_to_image_bucket(pixel_values: np.ndarray, grid_thw: np.ndarray, count: int, size: np.ndarray):
    """Append blank images of grid `size` ([t, h, w], the screenshots' one size) until there are `count`. No
    image-pad token refers to them: their features are computed and never used, each in its own frame."""
    grid_thw = np.asarray(grid_thw, np.int64).reshape(-1, 3)
    extra = count - len(grid_thw)
    if extra <= 0:
        return pixel_values, grid_thw
    size = np.asarray(size, np.int64).reshape(1, 3)
    blank = np.zeros((extra * int(np.prod(size)), pixel_values.shape[1]), pixel_values.dtype)
    return np.concatenate([pixel_values, blank]), np.concatenate([grid_thw, np.repeat(size, extra, axis=0)])


def pad_right(input_ids: np.ndarray, attention_mask: np.ndarray, length: int, pad_id: int = 0):
    """Move each row's valid tokens to the start of a `length`-wide row (right padding): what cuDNN's flash
    attention takes as sequence lengths, so a prefill on a GPU can run it. Decoding then writes every row's
    new tokens at the same slots past `length`, after its padding, which the cache's mask leaves out."""
    b = input_ids.shape[0]
    ids = np.full((b, length), pad_id, dtype=np.int32)
    mask = np.zeros((b, length), dtype=np.int32)
    for i in range(b):
        valid = input_ids[i][attention_mask[i].astype(bool)]
        ids[i, :valid.size] = valid
        mask[i, :valid.size] = 1
    return ids, mask


def _last_token(hidden: jax.Array, mask: jax.Array) -> jax.Array:
    """[b, hidden]: each right-padded row's hidden state at its last real token."""
    last = jnp.maximum(jnp.sum(mask != 0, axis=1) - 1, 0)
    return jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]


def pad_images(pixel_values: np.ndarray, grid_thw: np.ndarray, multiple: int, merge: int):
    """Append one filler image so the patch count is a multiple of `multiple` (no patches: the filler alone, one
    multiple, as a per-device block whose rows show no screenshot needs). No image-pad token refers to it, so its
    features are computed and never used; its own segment keeps it out of real images' attention."""
    n = pixel_values.shape[0]
    target = max(-(-n // multiple) * multiple, multiple)
    extra = target - n
    if extra == 0:
        return pixel_values, grid_thw
    unit = merge * merge
    if extra % unit:
        raise ValueError(f"patch bucket {multiple} must be a multiple of {unit}")
    filler_grid = np.array([[1, merge, extra // merge]])
    return (np.concatenate([pixel_values, np.zeros((extra, pixel_values.shape[1]), pixel_values.dtype)]),
            np.concatenate([grid_thw.reshape(-1, 3), filler_grid]))


def _truncate_logits(logits: jax.Array, top_k: int, top_p: float) -> jax.Array:
    """Mask logits outside the top-k and outside the smallest nucleus of mass >= top_p."""
    if top_k <= 0 and top_p >= 1.0:
        return logits
    sorted_logits = jnp.sort(logits, axis=-1)[..., ::-1]
    keep = jnp.ones_like(sorted_logits, dtype=bool)
    if top_k > 0:
        keep &= jnp.arange(logits.shape[-1]) < top_k
    if top_p < 1.0:
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        keep &= (jnp.cumsum(probs, axis=-1) - probs) < top_p  # always keeps the first
    threshold = jnp.min(jnp.where(keep, sorted_logits, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(logits >= threshold, logits, -jnp.inf)


def sample_tokens(logits: jax.Array, rng: jax.Array, temperature: float, top_k: int, top_p: float):
    """Next token and its behaviour log-prob. logits [b, vocab] float32."""
    if temperature <= 0:
        token = jnp.argmax(logits, axis=-1)
        logp = jax.nn.log_softmax(logits, axis=-1)
    else:
        scaled = logits / temperature
        logp = jax.nn.log_softmax(scaled, axis=-1)
        token = jax.random.categorical(rng, _truncate_logits(scaled, top_k, top_p), axis=-1)
    return token.astype(jnp.int32), jnp.take_along_axis(logp, token[:, None], axis=-1)[:, 0]


class Sampler:
    """Generates for a batch of processor outputs with the policy's parameters (sharded or not)."""

    name = "jax"  # the rollout.backend it is

    def __init__(self, module: Qwen2_5_VL, config: SamplingConfig, *, mesh: jax.sharding.Mesh | None = None,
                 tokenizer: Any = None, cache_dtype: Any = None):
        self.module = module
        self.cfg: ModelConfig = module.cfg
        self.config = config
        self.mesh = mesh
        self.tokenizer = tokenizer
        self.cache_dtype = cache_dtype or default_cache_dtype(module.dtype)
        if not config.stop_token_ids and self.cfg.eos_token_id is not None:
            self.config = dataclasses.replace(config, stop_token_ids=(self.cfg.eos_token_id,))
        self._programs = self._build_programs()
        self._siblings: dict[float, Sampler] = {}

    def with_temperature(self, temperature: float) -> "Sampler":
        """The same sampler at another temperature (its own programs, compiled at first use and kept)."""
        if temperature == self.config.temperature:
            return self
        if temperature not in self._siblings:
            config = dataclasses.replace(self.config, temperature=temperature)
            self._siblings[temperature] = Sampler(self.module, config, mesh=self.mesh, tokenizer=self.tokenizer,
                                                  cache_dtype=self.cache_dtype)
        return self._siblings[temperature]

    def _build_programs(self) -> dict[bool, Any]:
        """The jitted generation program, keyed by whether the rows divide over the data-parallel axes. With a mesh each
        is jitted with explicit shardings: parameters by the logical rules, prompt rows split (or, for a batch
        that does not divide, replicated, with the batch activations left unconstrained), vision inputs and
        the RNG key replicated, outputs row-sharded like the prompts."""
        if self.mesh is None:
            program = jax.jit(self._generate)
            return {True: program, False: program}
        from guijax.models.weights import abstract_params
        from guijax.sharding import LOGICAL_RULES, MeshJit, param_shardings, replicated

        params = param_shardings(abstract_params(self.module), self.mesh)
        repl = replicated(self.mesh)

        def shardings_for(split: bool):
            rows = DATA_AXES if split else None
            put = lambda *spec: NamedSharding(self.mesh, P(*spec))  # noqa: E731

            def shardings(params_, ids, mask, positions, next_position, vision, rng):
                # per-device vision blocks split along their block axis like the rows; one layout replicated
                ins = (params, put(rows, None), put(rows, None), put(None, rows, None), put(rows),
                       self._vision_shardings(vision, ids.shape[0], split), repl)
                return ins, (put(rows, None), put(rows, None), put(rows), put(rows))
            return shardings

        unsplit_rules = tuple((name, None if name == "batch" else axes) for name, axes in LOGICAL_RULES)
        return {True: MeshJit(self._generate, self.mesh, shardings_for(True)),
                False: MeshJit(self._generate, self.mesh, shardings_for(False), rules=unsplit_rules)}

    # ------------------------------------------------------------------ compiling ahead of time
    def program(self, rows: int) -> Any:
        """The jitted generation program for `rows` prompt rows: (params, ids, mask, positions, next_position,
        vision, rng) -> (tokens, logprobs, lengths, stopped), the inputs after the parameters as `inputs` makes
        them. Its `.lower(...)` takes arrays or ShapeDtypeStructs, so it compiles ahead of time."""
        return self._programs[self.mesh is None or rows % data_parallel_size(self.mesh) == 0]

    def prefill_passes(self, rows: int) -> int:
        """The passes in which the program prefills `rows` rows (`prefill_rows`); with screenshots, the vision
        inputs then carry one layout per pass on a leading axis."""
        return self._row_split(rows)[1]

    def inputs(self, input_ids, attention_mask=None, pixel_values=None, image_grid_thw=None) -> tuple:
        """The program's inputs between the parameters and the key, (ids, mask, positions, next_position,
        vision), for prompt rows as the processor gives them (`generate` first pads the rows to a power of
        two), placed on the mesh when there is one."""
        arrays = self._prepare(input_ids, attention_mask, pixel_values, image_grid_thw)
        return arrays if self.mesh is None else self._place(arrays)

    # ------------------------------------------------------------------ host-side preparation
    def _prepare(self, input_ids, attention_mask, pixel_values, image_grid_thw):
        input_ids = np.asarray(input_ids)
        attention_mask = np.ones_like(input_ids) if attention_mask is None else np.asarray(attention_mask)
        length = bucket_for(int(attention_mask.sum(1).max()), self.config.prompt_buckets)
        ids, mask = pad_right(input_ids, attention_mask, length)
        positions, _ = mrope_positions(ids, mask, image_grid_thw if pixel_values is not None else None, self.cfg)
        next_position = np.where(mask.any(1), positions.max(axis=(0, 2)) + 1, 0).astype(np.int32)
        vision = None
        if pixel_values is not None:
            pixels, grids = np.asarray(pixel_values, np.float32), np.asarray(image_grid_thw)
            devices, chunks, per = self._row_split(ids.shape[0])
            blocked = self._vision_blocked(ids.shape[0])
            if chunks == 1 and not blocked:
                [(pix, grid)] = self._pad_vision([(pixels, grids)], ids.shape[0])
                vision = vision_layout(grid, self.cfg.vision).inputs(pix)
            else:  # one layout per prefill chunk, or per (chunk, device) with per-device blocks
                order = np.arange(ids.shape[0]).reshape(devices, chunks, per).transpose(1, 0, 2)
                groups = order.reshape(chunks * devices, per) if blocked else order.reshape(chunks, devices * per)
                vision = self._vision_groups(input_ids, attention_mask, pixels, grids, groups.tolist())
                if chunks > 1 and blocked:  # [chunk, device, ...]
                    vision = {k: v.reshape((chunks, devices) + v.shape[1:]) for k, v in vision.items()}
        return ids, mask, positions, next_position, vision

    def _row_split(self, rows: int) -> tuple[int, int, int]:
        """(devices, chunks, per): the rows as [devices, chunks, per], devices the data-parallel ones holding them
        (1 without a mesh or when the rows do not divide over them), chunks the prefill passes (`prefill_rows`):
        the fewest that divide each device's rows into passes of at most `prefill_rows` rows in all (at least
        one row per device: with fewer `prefill_rows` than devices, each pass holds one row per device)."""
        devices = 1
        if self.mesh is not None and rows % data_parallel_size(self.mesh) == 0:
            devices = data_parallel_size(self.mesh)
        local, limit = rows // devices, self.config.prefill_rows
        chunks = 1
        if limit and rows > limit:
            chunks = next((c for c in range(2, local + 1) if local % c == 0 and rows // c <= limit), local)
        return devices, chunks, local // chunks

    def _vision_blocked(self, rows: int) -> bool:
        """Whether the screenshots come in per-device blocks (`vision_blocks` equal to the data-parallel devices
        the rows divide over)."""
        blocks = self.config.vision_blocks
        return (blocks > 1 and self.mesh is not None and blocks == data_parallel_size(self.mesh)
                and rows % blocks == 0)

    def _vision_shardings(self, vision: Any, rows: int, split: bool) -> Any:
        """Per-device blocks split like the rows along their block axis (after the prefill-chunk axis, when there
        is one); a single layout, or one per prefill chunk, replicated."""
        if vision is None:
            return None
        repl = NamedSharding(self.mesh, P())
        if not (split and self._vision_blocked(rows)):
            return jax.tree.map(lambda v: repl, vision)
        lead = (None,) if self._row_split(rows)[1] > 1 else ()
        split_blocks = lambda v: P(*lead, DATA_AXES, *[None] * (np.ndim(v) - 1 - len(lead)))  # noqa: E731
        return jax.tree.map(lambda v: NamedSharding(self.mesh, split_blocks(v)), vision)

    def _vision_groups(self, input_ids, attention_mask, pixels: np.ndarray, grids: np.ndarray,
                       groups: list[list[int]]) -> dict[str, np.ndarray]:
        """One vision layout per group of rows, over those rows' images in row order, every group padded to one
        shape (`_pad_vision`) and stacked on a leading axis (`stack_blocks`)."""
        from guijax.models.vision_blocks import stack_blocks

        images = _images_per_row(input_ids, attention_mask, grids, self.cfg)
        starts = np.concatenate([[0], np.cumsum(np.prod(grids, axis=1))])
        parts = []
        for rows in groups:
            pix = [pixels[starts[images[r]]:starts[images[r + 1]]] for r in rows]
            parts.append((np.concatenate(pix) if pix else pixels[:0],
                          np.concatenate([grids[images[r]:images[r + 1]] for r in rows]).reshape(-1, 3)))
        return stack_blocks([vision_layout(grid, self.cfg.vision).inputs(pix)
                             for pix, grid in self._pad_vision(parts, len(groups[0]))])

    def _pad_vision(self, parts: list[tuple[np.ndarray, np.ndarray]], rows: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """Each part's (pixels, grids), the screenshots of `rows` rows, padded to one shape: with screenshots of one
        size (and `pad_images_with_rows`), to `image_bucket` of the fullest part in blank screenshots (an empty
        part then holds blanks alone); otherwise with a filler image to the fullest part's patch count rounded up
        to `patch_bucket`."""
        grids = [np.asarray(g, np.int64).reshape(-1, 3) for _, g in parts]
        every = np.concatenate(grids)
        if self.config.pad_images_with_rows and len(every) and (every == every[0]).all():
            count = image_bucket(max(len(g) for g in grids), rows)
            return [pad_to_image_bucket(pix, g, count, every[0]) for (pix, _), g in zip(parts, grids)]
        bucket, merge = self.config.patch_bucket, self.cfg.vision.spatial_merge_size
        common = max(max(-(-len(pix) // bucket) * bucket, bucket) for pix, _ in parts)
        return [pad_images(pix, grid, common, merge) for pix, grid in parts]

    # ------------------------------------------------------------------ device program
    def _generate(self, params, ids, mask, positions, next_position, vision, rng):
        cfg, sc = self.cfg, self.config
        b, prompt_len = ids.shape
        kv_mask = jnp.concatenate([mask, jnp.zeros((b, sc.max_new_tokens), mask.dtype)], axis=1)
        last_hidden, cache = self._prefill(params, ids, mask, positions, vision, kv_mask)
        head = params["embed_tokens"].T if cfg.tie_word_embeddings else params["lm_head"]
        head = head.astype(self.module.dtype)

        suppressed = vision_placeholder_ids(cfg)
        blocked = jnp.zeros((cfg.vocab_size,), jnp.float32)
        if sc.suppress_vision_tokens and suppressed:
            blocked = blocked.at[jnp.asarray(suppressed)].set(-jnp.inf)

        def logits_of(h):
            return jnp.einsum("bd,dv->bv", h, head, preferred_element_type=jnp.float32) + blocked

        stop_ids = jnp.asarray(sc.stop_token_ids or (-1,), jnp.int32)
        tokens = jnp.zeros((b, sc.max_new_tokens), jnp.int32)
        logps = jnp.zeros((b, sc.max_new_tokens), jnp.float32)
        done = jnp.zeros((b,), bool)

        def cond(state):
            step, _, _, _, done, *_ = state
            return (step < sc.max_new_tokens) & ~jnp.all(done)

        def body(state):
            step, tokens, logps, lengths, done, last_hidden, cache, kv_mask, rng = state
            rng, key = jax.random.split(rng)
            token, logp = sample_tokens(logits_of(last_hidden), key, sc.temperature, sc.top_k, sc.top_p)
            live = ~done
            token = jnp.where(live, token, 0)
            tokens = tokens.at[:, step].set(token)
            logps = logps.at[:, step].set(jnp.where(live, logp, 0.0))
            lengths = lengths + live.astype(jnp.int32)
            done = done | (live & jnp.isin(token, stop_ids))
            slot = prompt_len + step
            kv_mask = kv_mask.at[:, slot].set(1)
            pos = jnp.broadcast_to((next_position + step)[None, :, None], (3, b, 1))
            h, cache = self.module.apply({"params": params}, token[:, None], pos, jnp.ones((b, 1), jnp.int32), None,
                                         cache=cache, cache_index=slot, kv_mask=kv_mask, return_logits=False)
            return step + 1, tokens, logps, lengths, done, h[:, -1], cache, kv_mask, rng

        state = (jnp.int32(0), tokens, logps, jnp.zeros((b,), jnp.int32), done, last_hidden, cache, kv_mask, rng)
        _, tokens, logps, lengths, done, *_ = jax.lax.while_loop(cond, body, state)
        return tokens, logps, lengths, done

    def _prefill(self, params, ids, mask, positions, vision, kv_mask) -> tuple[jax.Array, KVCache]:
        """Each row's last prompt hidden state [b, hidden] and the cache filled with the prompts: in one pass, or
        `prefill_rows` at a time (chunk c: rows [d, c, :] of every device d's [chunks, per]), each pass writing
        its rows of the cache in place."""
        b, total = ids.shape[0], kv_mask.shape[1]
        devices, chunks, per = self._row_split(b)
        if chunks == 1:
            hidden, cache = self.module.apply({"params": params}, ids, positions, mask, vision,
                                              cache=init_cache(self.cfg, b, total, self.cache_dtype), cache_index=0,
                                              kv_mask=kv_mask, return_logits=False)
            return _last_token(hidden, mask), cache

        def take(x, axis, c):  # chunk c's rows of x, whose rows lie along `axis`
            split = x.reshape(x.shape[:axis] + (devices, chunks, per) + x.shape[axis + 1:])
            part = jax.lax.dynamic_index_in_dim(split, c, axis + 1, keepdims=False)
            return part.reshape(x.shape[:axis] + (devices * per,) + x.shape[axis + 1:])

        def put(full, part, axis, c):  # write chunk c's rows into full, in place
            split = full.reshape(full.shape[:axis] + (devices, chunks, per) + full.shape[axis + 1:])
            part = part.reshape(part.shape[:axis] + (devices, 1, per) + part.shape[axis + 1:]).astype(full.dtype)
            start = [0] * split.ndim
            start[axis + 1] = c
            return jax.lax.dynamic_update_slice(split, part, start).reshape(full.shape)

        def one_pass(c, carry):
            cache, last = carry
            hidden, part = self.module.apply(
                {"params": params}, take(ids, 0, c), take(positions, 1, c), take(mask, 0, c),
                None if vision is None else jax.tree.map(lambda v: v[c], vision),
                cache=init_cache(self.cfg, devices * per, total, self.cache_dtype), cache_index=0,
                kv_mask=take(kv_mask, 0, c), return_logits=False)
            cache = KVCache(*(put(f, p, 1, c) for f, p in zip(cache, part)))
            return constrain_cache(cache), put(last, _last_token(hidden, take(mask, 0, c)), 0, c)

        last = jnp.zeros((b, self.cfg.hidden_size), self.module.dtype)
        cache, last = jax.lax.fori_loop(0, chunks, one_pass, (init_cache(self.cfg, b, total, self.cache_dtype), last))
        return last, cache

    def generate(self, params: Any, rng: jax.Array, input_ids, attention_mask=None, pixel_values=None,
                 image_grid_thw=None, **_ignored) -> SampleOutput:
        input_ids = np.asarray(input_ids)
        attention_mask = np.ones_like(input_ids) if attention_mask is None else np.asarray(attention_mask)
        rows = input_ids.shape[0]
        empty = np.flatnonzero(attention_mask.sum(1) == 0)
        if empty.size:
            raise ValueError(f"prompt rows {empty.tolist()} hold no tokens (attention_mask all 0): nothing to continue")
        limit = self.config.max_rows
        if limit and rows > limit:
            return self._generate_in_chunks(params, rng, input_ids, attention_mask, pixel_values, image_grid_thw)
        if self.config.pad_batch_to_power_of_two and rows & (rows - 1):
            extra = (1 << rows.bit_length()) - rows  # dummy rows: one valid text token each, no image
            input_ids = np.concatenate([input_ids, np.zeros((extra, input_ids.shape[1]), input_ids.dtype)])
            dummy_mask = np.zeros((extra, attention_mask.shape[1]), attention_mask.dtype)
            dummy_mask[:, 0] = 1
            attention_mask = np.concatenate([attention_mask, dummy_mask])
        arrays = self.inputs(input_ids, attention_mask, pixel_values, image_grid_thw)
        tokens, logps, lengths, done = jax.device_get(self.program(input_ids.shape[0])(params, *arrays, rng))
        out = SampleOutput(np.asarray(tokens)[:rows], np.asarray(logps)[:rows], np.asarray(lengths)[:rows],
                           np.asarray(done)[:rows])
        if self.tokenizer is not None:
            self._apply_stop_strings(out)
        return out

    def _generate_in_chunks(self, params, rng, input_ids, attention_mask, pixel_values, image_grid_thw
                            ) -> SampleOutput:
        """`max_rows` rows at a time, each chunk with its own images and a key folded from `rng`."""
        limit = self.config.max_rows
        if pixel_values is not None:
            grids = np.asarray(image_grid_thw)
            images = _images_per_row(input_ids, attention_mask, grids, self.cfg)
            patch_starts = np.concatenate([[0], np.cumsum(np.prod(grids, axis=1))])
        parts = []
        for i, start in enumerate(range(0, input_ids.shape[0], limit)):
            stop = min(start + limit, input_ids.shape[0])
            pix = grid = None
            if pixel_values is not None and images[stop] > images[start]:
                first, last = images[start], images[stop]
                grid = grids[first:last]
                pix = np.asarray(pixel_values)[patch_starts[first]:patch_starts[last]]
            parts.append(self.generate(params, jax.random.fold_in(rng, i), input_ids[start:stop],
                                       attention_mask[start:stop], pix, grid))
        out = SampleOutput(*(np.concatenate([getattr(o, f) for o in parts]) for f in
                             ("tokens", "logprobs", "lengths", "stopped")))
        if self.tokenizer is not None:
            out.texts = [t for o in parts for t in (o.texts or [])]
        return out

    def _place(self, arrays):
        """Batch-shard prompt arrays over the data-parallel axes when the batch divides; replicate otherwise."""
        ids, mask, positions, next_position, vision = arrays
        rows = DATA_AXES if ids.shape[0] % data_parallel_size(self.mesh) == 0 else None
        put = lambda x, *spec: jax.device_put(x, NamedSharding(self.mesh, P(*spec)))  # noqa: E731
        if vision is not None:
            vision = jax.device_put(vision, self._vision_shardings(vision, ids.shape[0], rows is not None))
        return (put(ids, rows, None), put(mask, rows, None), put(positions, None, rows, None),
                put(next_position, rows), vision)

    def _apply_stop_strings(self, out: SampleOutput) -> None:
        """Decode texts; cut each at the first stop string, shortening `lengths` to the tokens that cover it."""
        texts = []
        for i in range(out.tokens.shape[0]):
            ids = out.tokens[i, :out.lengths[i]].tolist()
            text = self.tokenizer.decode(ids, skip_special_tokens=False)
            cut = min((text.find(s) + len(s) for s in self.config.stop_strings if s in text), default=None)
            if cut is not None:
                keep = len(ids)
                while keep > 1 and len(self.tokenizer.decode(ids[:keep - 1], skip_special_tokens=False)) >= cut:
                    keep -= 1
                out.lengths[i] = keep
                out.tokens[i, keep:] = 0
                out.logprobs[i, keep:] = 0.0
                out.stopped[i] = True
                text = text[:cut]
            texts.append(text)
        out.texts = texts
