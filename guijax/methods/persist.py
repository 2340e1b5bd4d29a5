"""Checkpointable trajectory references for algorithm state (ARPO's buffers, BEPA's cache, expert traces).

Hook state goes into the checkpoint's JSON item, but trajectories carry screenshots. A `TrajectoryBank`
writes each held trajectory once to an ArrayRecord `TrajectoryStore` (one shard per checkpoint that has
new ones) and the state keeps only record indices; restoring reads them back.
"""
from __future__ import annotations

from typing import Iterable

from guijax.data.store import TrajectoryStore
from guijax.rollout.trajectory import Trajectory


class TrajectoryBank:
    def __init__(self, store: TrajectoryStore | None):
        self.store = store
        self._index: dict[int, int] = {}  # id(trajectory) -> record index in the store
        self._alive: dict[int, Trajectory] = {}  # keeps ids stable while indexed

    def refs(self, held: Iterable[Trajectory]) -> dict[int, int]:
        """Record index for every trajectory in `held`, writing the ones not yet stored."""
        held = list(held)
        new = [t for t in held if id(t) not in self._index]
        if new:
            if self.store is None:
                raise ValueError("this algorithm holds trajectories but was built without a TrajectoryStore; "
                                 "pass store= to make_algorithm so its state can be checkpointed")
            first = len(self.store)
            self.store.append(new)
            for i, t in enumerate(new):
                self._index[id(t)], self._alive[id(t)] = first + i, t
        return {id(t): self._index[id(t)] for t in held}

    def load(self, index: int) -> Trajectory:
        if self.store is None:
            raise ValueError("cannot restore stored trajectories without a TrajectoryStore")
        self.store.refresh()
        t = self.store[index]
        self._index[id(t)], self._alive[id(t)] = index, t
        return t
