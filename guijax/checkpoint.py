"""Run checkpoints with orbax: parameters + optimiser state (sharded arrays) and a JSON item with the rest
(iteration, RNG key data, algorithm state such as replay buffers and caches, data-order state).

Orbax writes each step to a temporary directory and renames it when complete, so a crash or a full disk
during a save leaves the previous checkpoint intact; saves are asynchronous and keep the newest N. A step
that cannot be read back (a corrupted file, a JSON item missing a key) is renamed `STEP.unreadable-N` and the
one before it restored instead, so one bad file never blocks a resume and nothing is deleted.
"""
from __future__ import annotations

import pathlib
from typing import Any, Callable, TypeVar

from absl import logging

import jax
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


class Checkpointer:
    def __init__(self, directory: str | pathlib.Path, keep: int = 3, async_save: bool = True):
        self.directory = pathlib.Path(directory).resolve()
        self.manager = ocp.CheckpointManager(
            self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save),
            item_names=("state", "meta"))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state: Any, meta: dict[str, Any]) -> None:
        self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)))

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict[str, Any]]:
        """`abstract_state`: the state pytree (or its ShapeDtypeStructs with shardings) to restore into."""
        target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
                              abstract_state)
        out = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target),
                                                                 meta=ocp.args.JsonRestore()))
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
