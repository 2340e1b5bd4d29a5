"""Run checkpoints with orbax: parameters + optimiser state (sharded arrays) and a JSON item with the rest
(iteration, RNG key data, algorithm state such as replay buffers and caches, data-order state).

Orbax writes each step to a temporary directory and renames it when complete, so a crash or a full disk
during a save leaves the previous checkpoint intact; saves are asynchronous and keep the newest N.
"""
from __future__ import annotations

import pathlib
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp


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

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
