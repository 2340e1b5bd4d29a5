"""Asynchronous rollouts: a background thread keeps every environment slot busy while the learner trains.

Synchronous rollouts run episodes in rounds: every slot waits for the round's longest episode, and every
environment waits while the learner updates. Here a slot starts its next episode as soon as its last one
ends, sampling with the newest parameters the learner has published (each step records the policy version
that sampled it), and each *group* (the G episodes of one task) is written to the trajectory store as one
shard, `group-NNNNNN`, the moment its last episode ends; the learner reads groups back from the store in the
order they complete. The same records serve analysis, resume and the learner. Slots do not step in lockstep
either: each slot's reset or step runs in a worker thread, and the sampler batches whichever episodes' screens
have come back, so a slot whose environment has answered waits only for the sampler, never for slower slots.

Back-pressure: at most `max_groups_ahead` groups are started and not yet taken by the learner, so memory and
staleness stay bounded however slow the learner is. Group `i` is fully determined by the caller's
`group_spec(i)` (task and episode seeds), so a resumed run can skip the groups it already has.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import queue
import threading
import time
from typing import Any, Callable, Iterable, Sequence

import jax

from envs.api import Task
from guijax.data.store import TrajectoryStore
from guijax.rollout.trajectory import Trajectory

GroupSpec = Callable[[int], tuple[Task, Sequence[int]]]  # group index -> (task, one episode seed per member)
PREFIX = "group-"


def shard_name(index: int) -> str:
    return f"{PREFIX}{index:06d}"


def group_index(shard: str) -> int | None:
    """The group index of a store shard's name (with or without its suffix); None for other shards."""
    stem = shard.split(".")[0]
    digits = stem[len(PREFIX):]
    return int(digits) if stem.startswith(PREFIX) and digits.isdigit() else None


def sampling_version(trajectories: Iterable[Trajectory], default: int) -> int:
    """The oldest policy version that sampled any step of `trajectories` (`default` when none has steps)."""
    versions = [v for t in trajectories for v in t.meta.get("policy_versions", ())]
    return min(versions, default=default)


@dataclasses.dataclass
class _Building:
    task: Task
    seeds: Sequence[int]  # one episode seed per member
    members: list[Trajectory | None]
    issued: int = 0  # members started so far


def _env_counts() -> dict[str, float]:
    """The counters one environment call adds to, merged into the stream's timings when it returns."""
    return {"env_s": 0.0, "env_slot_s": 0.0, "steps": 0}


class RolloutStream:
    """Runs episodes continuously over `engine`'s pool in a thread; `get()` hands back completed group shard
    names. Call `publish(params, version)` after each update and `release()` for each group taken."""

    def __init__(self, engine: Any, group_spec: GroupSpec, group_size: int, store_dir: Any, rng: jax.Array, *,
                 max_groups_ahead: int, skip: Iterable[int] = (), first: int = 0, gather_s: float = 0.02):
        if max_groups_ahead < 1:
            raise ValueError(f"max_groups_ahead must be >= 1, got {max_groups_ahead}")
        self.engine, self.group_spec, self.group_size = engine, group_spec, group_size
        self.store = TrajectoryStore(store_dir)  # this thread's own reader/writer of the shared directory
        self.max_groups_ahead = max_groups_ahead
        self.gather_s = gather_s  # how long the sampler waits for more environments once one has answered
        self._skip, self._next_group = set(skip), first
        self._rng = rng
        self._ready: queue.Queue[str] = queue.Queue()
        self._cond = threading.Condition()
        self._outstanding = 0  # groups started and not yet released by the learner
        self._params: tuple[int, Any] | None = None
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self.timings = {"env_s": 0.0, "env_slot_s": 0.0, "sample_s": 0.0, "steps": 0, "sampled_tokens": 0,
                        "weight_sync_s": 0.0, "weight_sync_bytes": 0}

    # ------------------------------------------------------------------ learner side
    def publish(self, params: Any, version: int) -> None:
        """Parameters for every step sampled from now on. They must stay valid: pass a copy the learner's
        next update will not donate."""
        with self._cond:
            self._params = (version, params)
            self._cond.notify_all()

    def start(self) -> None:
        if self._params is None:
            raise RuntimeError("publish() the first parameters before start()")
        self._thread = threading.Thread(target=self._run, name="rollout-stream", daemon=True)
        self._thread.start()

    def get(self, timeout_s: float | None = None) -> str:
        """The next completed group's shard name; blocks. Re-raises an error of the rollout thread."""
        deadline = None if timeout_s is None else time.perf_counter() + timeout_s
        while True:
            self._raise_if_failed()
            try:
                return self._ready.get(timeout=0.05)
            except queue.Empty:
                if self._thread is None or not self._thread.is_alive():
                    self._raise_if_failed()
                    raise RuntimeError("the rollout thread is not running")
                if deadline is not None and time.perf_counter() > deadline:
                    raise TimeoutError(f"no group completed in {timeout_s} s")

    def release(self, groups: int = 1) -> None:
        """The learner took `groups` groups: room for as many new ones."""
        with self._cond:
            self._outstanding -= groups
            self._cond.notify_all()

    def preload(self, shards: Sequence[str]) -> None:
        """Groups completed before this stream started (a resumed run's unconsumed ones): handed out first;
        they count against `max_groups_ahead` until released."""
        with self._cond:
            self._outstanding += len(shards)
        for s in shards:
            self._ready.put(s)

    def close(self) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"the rollout thread failed: {type(self._error).__name__}: {self._error}") \
                from self._error

    # ------------------------------------------------------------------ rollout thread
    def _take_slot_work(self, building: dict[int, _Building]) -> tuple[int, int, Task, int] | None:
        """(group, member, task, seed) for a free slot: the next member of a started group, else the first
        member of a new group when back-pressure allows; None when neither."""
        for gi, b in building.items():
            if b.issued < self.group_size:
                b.issued += 1
                return gi, b.issued - 1, b.task, int(b.seeds[b.issued - 1])
        with self._cond:
            if self._outstanding >= self.max_groups_ahead:
                return None
            self._outstanding += 1
        while self._next_group in self._skip:
            self._next_group += 1
        gi = self._next_group
        self._next_group += 1
        task, seeds = self.group_spec(gi)
        if len(seeds) != self.group_size:
            raise ValueError(f"group {gi}: {len(seeds)} episode seeds for a group of {self.group_size}")
        building[gi] = _Building(task, seeds, [None] * self.group_size, issued=1)
        return gi, 0, task, int(seeds[0])

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # surfaced by get()
            self._error = e

    def _claim(self, free: list[int], building: dict[int, _Building], owner: dict[int, tuple[int, int]]
               ) -> dict[int, Any]:
        """New episodes for free slots, as far as back-pressure allows."""
        new = {}
        while free:
            work = self._take_slot_work(building)
            if work is None:
                break
            gi, member, task, seed = work
            ep = self.engine.episode(task, seed)
            owner[id(ep)] = (gi, member)
            new[free.pop(0)] = ep
        return new

    def _loop(self) -> None:
        """Every slot moves on its own: a worker thread resets it or steps it, and the policy samples, in one
        batched call, the next action of every episode whose environment has answered. A slot whose step or
        reset is done never waits for the other slots' environments (a VM's step or reset takes seconds, and
        their times differ), only for the sampler call in flight."""
        engine, timings = self.engine, self.timings
        workers = engine.pool.num_workers
        free = list(range(workers))
        waiting: dict[int, Any] = {}  # slot -> episode whose environment has answered: it needs an action
        owner: dict[int, tuple[int, int]] = {}  # id(episode) -> (group, member)
        building: dict[int, _Building] = {}
        rng = self._rng
        # each call holds its slots until it returns, so there are never more calls in flight than workers
        calls = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="rollout-env")
        # future -> (whether it is a reset, its episodes by slot, its counters)
        in_flight: dict[concurrent.futures.Future, tuple[bool, dict[int, Any], dict[str, float]]] = {}
        try:
            while not self._stop.is_set():
                # nothing to sample: wait for an environment; then keep taking the environments that answer
                # within `gather_s` of each other, so one sampler call serves the steps that end together
                timeout = 0.1 if not waiting else 0.0
                while in_flight:
                    done, _ = concurrent.futures.wait(list(in_flight), timeout=timeout,
                                                      return_when=concurrent.futures.FIRST_COMPLETED)
                    if not done:
                        break
                    for future in done:
                        self._collect(future, in_flight.pop(future), waiting, free, owner, building)
                    timeout = self.gather_s
                new = self._claim(free, building, owner)  # freed slots start resetting before the sampler runs
                if new:
                    counts = _env_counts()
                    in_flight[calls.submit(engine.start, new, counts)] = (True, new, counts)
                if not waiting:
                    if not in_flight:
                        with self._cond:
                            if not self._stop.is_set():
                                self._cond.wait(timeout=0.1)
                    continue
                with self._cond:
                    version, params = self._params
                batch, waiting = waiting, {}
                rng, actions, _ = engine.sample(params, batch, rng, timings, version)
                for slot, ep in batch.items():  # the slots without actions end unstepped: only evaluated
                    counts = _env_counts()
                    in_flight[calls.submit(engine.step_one, slot, ep, actions.get(slot), counts)] = (
                        False, {slot: ep}, counts)
        finally:
            calls.shutdown(wait=True)

    def _collect(self, future: concurrent.futures.Future, call: tuple[bool, dict[int, Any], dict[str, float]],
                 waiting: dict[int, Any], free: list[int], owner: dict[int, tuple[int, int]],
                 building: dict[int, _Building]) -> None:
        """A finished environment call: its counters into the timings, its running episodes to `waiting`, the
        ended ones (or those whose reset failed: ENV_ERROR) finished and their slots freed."""
        reset, episodes, counts = call
        outcome = future.result()  # a reset: the episodes that started; a step: whether its episode ended
        for key, value in counts.items():
            self.timings[key] = self.timings.get(key, 0) + value
        for slot, ep in episodes.items():
            if (slot in outcome) if reset else not outcome:
                waiting[slot] = ep
            else:
                free.append(slot)
                self._finish(ep, owner, building)

    def _finish(self, ep: Any, owner: dict[int, tuple[int, int]], building: dict[int, _Building]) -> None:
        gi, member = owner.pop(id(ep))
        traj = self.engine.trajectory(ep)
        traj.meta["policy_versions"] = list(ep.versions)
        traj.meta["group"] = gi
        b = building[gi]
        b.members[member] = traj
        if all(m is not None for m in b.members):
            del building[gi]
            self.store.append(b.members, name=shard_name(gi))
            self._ready.put(shard_name(gi))

