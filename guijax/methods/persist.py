"""Checkpointable trajectory references for algorithm state (ARPO's buffers, BEPA's cache, expert traces).

Hook state goes into the checkpoint's JSON item, but trajectories carry screenshots. A `TrajectoryBank`
writes each held trajectory once to an ArrayRecord `TrajectoryStore` (one shard per checkpoint that has
new ones) and the state keeps only references "SHARD_NAME:RECORD"; restoring reads them back. A reference
names its shard, so losing one shard can only fail loudly for the trajectories in it, never hand back
another trajectory in their place (as a global index into the store would).
"""
from __future__ import annotations

from typing import Iterable

from guijax.data.store import TrajectoryStore
from guijax.rollout.trajectory import Trajectory

Ref = str | int  # "shard-000003.array_record:5"; an int is a global index, as checkpoints before named refs hold


class TrajectoryBank:
    def __init__(self, store: TrajectoryStore | None):
        self.store = store
        self._index: dict[int, Ref] = {}  # id(trajectory) -> its reference in the store
        self._alive: dict[int, Trajectory] = {}  # keeps ids stable while indexed

    def refs(self, held: Iterable[Trajectory]) -> dict[int, Ref]:
        """Reference for every trajectory in `held`, writing the ones not yet stored."""
        held = list(held)
        new = [t for t in held if id(t) not in self._index]
        if new:
            if self.store is None:
                raise ValueError("this algorithm holds trajectories but was built without a TrajectoryStore; "
                                 "pass store= to make_algorithm so its state can be checkpointed")
            shard = self.store.append(new).name
            for i, t in enumerate(new):
                self._index[id(t)], self._alive[id(t)] = f"{shard}:{i}", t
        return {id(t): self._index[id(t)] for t in held}

    def load(self, ref: Ref) -> Trajectory:
        if self.store is None:
            raise ValueError("cannot restore stored trajectories without a TrajectoryStore")
        if isinstance(ref, str):
            shard, _, record = ref.rpartition(":")
            t = self.store.at(shard, int(record))
        else:
            self.store.refresh()
            t = self.store[ref]
        self._index[id(t)], self._alive[id(t)] = ref, t
        return t
