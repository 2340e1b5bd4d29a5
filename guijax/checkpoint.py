"""Run checkpoints with orbax: parameters + optimiser state (sharded arrays) and a JSON item with the rest
(iteration, RNG key data, algorithm state such as replay buffers and caches, data-order state).

Orbax writes each step to a temporary directory and renames it when complete, so a crash or a full disk
during a save leaves the previous checkpoint intact; saves are asynchronous and keep the newest N. A step
that cannot be read back (a corrupted file, a JSON item missing a key) is renamed `STEP.unreadable-N` and the
one before it restored instead, so one bad file never blocks a resume and nothing is deleted.

Orbax checks its own indexes (CRC-32C) but not the array bytes: one flipped bit in a data file restores as a
silently different weight. Each step therefore also stores an `integrity` item, two 32-bit sums of every
array's bits and a SHA-256 of the JSON item, computed when saved and checked when restored; a step that does
not match is unreadable like any other.
"""
from __future__ import annotations

import hashlib
import json
import pathlib
from typing import Any, Callable, TypeVar

from absl import logging

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

T = TypeVar("T")


def _uncommit_single_device_leaves(state: Any) -> Any:
    """Leaves created outside the mesh (optimiser step counts, the step number) are uncommitted before a save,
    so jit may place them anywhere; restored, they come back committed to one device, which jit then refuses
    to mix with mesh-sharded parameters. Hand those back as host arrays, uncommitted again."""
    leaves = jax.tree.leaves(state)
    if not any(len(getattr(x, "sharding", None).device_set) > 1 for x in leaves if hasattr(x, "sharding")):
        return state
    single = lambda x: isinstance(getattr(x, "sharding", None), jax.sharding.SingleDeviceSharding)  # noqa: E731
    return jax.tree.map(lambda x: np.asarray(x) if single(x) else x, state)


class IntegrityError(ValueError):
    """A restored step whose bits differ from what was saved."""


_WORD = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}


def _leaf_sums(x: jax.Array) -> jax.Array:
    """[plain, position-weighted] uint32 sums of the leaf's bits. A flipped bit changes a word by ±2^k and the
    weighted sum by ±2^k times an odd factor, never 0 mod 2^32, so one flip is always caught; the position
    weight also catches swapped words. Positions come from per-axis iotas, so a sharded leaf is never reshaped."""
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    words = jax.lax.bitcast_convert_type(x, _WORD[x.dtype.itemsize]).astype(jnp.uint32)
    position = jnp.zeros(words.shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(words.ndim)):
        position = position + jax.lax.broadcasted_iota(jnp.uint32, words.shape, axis) * jnp.uint32(stride % 2**32)
        stride *= words.shape[axis]
    weighted = words * (position * jnp.uint32(2) + jnp.uint32(1))
    return jnp.stack([words.sum(dtype=jnp.uint32), weighted.sum(dtype=jnp.uint32)])


_tree_sums = jax.jit(lambda tree: jax.tree.map(_leaf_sums, tree))


def state_fingerprint(state: Any) -> dict[str, list[int]]:
    """Every leaf's bit sums, by its path in the tree: computed on the devices holding the leaf."""
    state = jax.tree.map(lambda x: x if hasattr(x, "dtype") else np.asarray(x), state)
    sums = _tree_sums(state)
    flat, _ = jax.tree_util.tree_flatten_with_path(sums)
    return {jax.tree_util.keystr(path): [int(v) for v in np.asarray(leaf.addressable_data(0))] for path, leaf in flat}


def meta_digest(meta: dict[str, Any]) -> str:
    """SHA-256 of the JSON item as it reads back (tuples as lists, keys as strings), keys sorted."""
    canonical = json.dumps(json.loads(json.dumps(meta)), sort_keys=True)
    return hashlib.sha256(canonical.encode()).hexdigest()


def _verify(step_dir: pathlib.Path, state: Any, meta: dict[str, Any], expected: dict[str, Any]) -> None:
    got = state_fingerprint(state)
    wrong = sorted(k for k in expected["state"] if got.get(k) != expected["state"][k])
    missing = sorted(set(got) - set(expected["state"]))
    if wrong or missing:
        raise IntegrityError(f"{step_dir}: arrays differ from what was saved: {(wrong + missing)[:5]}"
                             f"{' ...' if len(wrong) + len(missing) > 5 else ''}")
    if meta_digest(meta) != expected["meta_sha256"]:
        raise IntegrityError(f"{step_dir}: the JSON item differs from what was saved")


class Checkpointer:
    def __init__(self, directory: str | pathlib.Path, keep: int = 3, async_save: bool = True):
        self.directory = pathlib.Path(directory).resolve()
        self.manager = ocp.CheckpointManager(
            self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save),
            item_names=("state", "meta", "integrity"))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state: Any, meta: dict[str, Any]) -> None:
        integrity = {"state": state_fingerprint(state), "meta_sha256": meta_digest(meta)}
        self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta),
                                                        integrity=ocp.args.JsonSave(integrity)))

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict[str, Any]]:
        """`abstract_state`: the state pytree (or its ShapeDtypeStructs with shardings) to restore into. Raises
        IntegrityError when the bits differ from what was saved (steps saved before the check are not checked)."""
        target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
                              abstract_state)
        step_dir = self.directory / str(step)
        items = dict(state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore())
        checked = (step_dir / "integrity").is_dir()
        if checked:
            items["integrity"] = ocp.args.JsonRestore()
        out = self.manager.restore(step, args=ocp.args.Composite(**items))
        if checked:
            _verify(step_dir, out["state"], out["meta"], out["integrity"])
        return _uncommit_single_device_leaves(out["state"]), out["meta"]

    def restore_latest(self, abstract_state: Any, use: Callable[[Any, dict[str, Any]], T]) -> tuple[int, T] | None:
        """The newest step that restores and that `use(state, meta)` accepts (it reads the meta it needs and
        raises on what it cannot use), as (step, what `use` returned); None when no step is left. Steps that
        fail are set aside, with a warning naming them, and the previous one is tried."""
        for step in sorted(self.manager.all_steps(), reverse=True):
            try:
                state, meta = self.restore(step, abstract_state)
                return step, use(state, meta)
            except Exception as err:  # any unreadable piece of a step: orbax, JSON, a missing key
                moved = self._set_aside(step)
                logging.warning("checkpoint %s cannot be restored (%s: %s); moved to %s, trying the previous step",
                                self.directory / str(step), type(err).__name__, err, moved)
        return None

    def _set_aside(self, step: int) -> pathlib.Path:
        self.manager.wait_until_finished()
        source = self.directory / str(step)
        n = 0
        while (target := self.directory / f"{step}.unreadable-{n}").exists():
            n += 1
        source.rename(target)
        self.manager.reload()
        return target

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
