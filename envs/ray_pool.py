"""An environment fleet on Ray: each slot is a Ray actor holding one environment, placed on any host that
joined the cluster (`ray start --address=HEAD:6379` on each CPU host, then `env.fleet=ray` with
`env.ray_address=auto` or the head's address).

The same slots, calls and guarantees as the process pool (`envs.pool.EnvPool`): calls go to every addressed
actor at once and are collected under a deadline; an actor that dies (its host lost, the process killed) or
does not answer in time is killed and replaced by a fresh one, and its episode comes back as an error naming
what happened, dropped by the trainer, never the run. An exception inside the environment is reported the
same way and keeps the actor. Actors are spread over the cluster's nodes (Ray's SPREAD strategy).

Without an address a local Ray instance is started on this machine. Every host that runs actors needs this
package installed (the actors build their environments from the same picklable factories: the synthetic
desk, a remote desktop server's client for an OSWorld VM or a local Xvfb desktop served by envs.server).
"""
from __future__ import annotations

import math
import os
import time
from typing import Any, Callable, Sequence

from envs.api import Env
from envs.pool import Result, SlotPool, per_worker


class _EnvActor:
    """One environment in a Ray actor process."""

    def __init__(self, factory: Callable[[], Env]):
        self.env, self.error = None, None
        try:
            self.env = factory()
        except Exception as e:  # said by ready(): Ray's own report of a failed constructor drops the cause
            self.error = f"{type(e).__name__}: {e}"

    def ready(self) -> tuple[int, str | None]:
        return os.getpid(), self.error

    def call(self, method: str, args: tuple) -> Any:
        return getattr(self.env, method)(*args)

    def close(self) -> None:
        if self.env is not None:
            self.env.close()


def _ray():
    try:
        import ray
    except ImportError as e:
        raise ImportError("env.fleet='ray' needs Ray: pip install 'guijax[ray]' (or pip install ray)") from e
    return ray


class RayEnvPool(SlotPool):
    def __init__(self, factory: Callable[[], Env] | Sequence[Callable[[], Env]], num_workers: int, *,
                 address: str = "", cpus_per_worker: float = 1.0, timeout_s: float = 120.0,
                 start_timeout_s: float = 300.0):
        self.factories = per_worker(factory, num_workers)
        ray = _ray()
        self._ray = ray
        self.timeout_s, self.start_timeout_s = timeout_s, start_timeout_s
        self._owns_ray = not ray.is_initialized()  # started here, so shut down by close()
        if self._owns_ray:
            if address:
                ray.init(address=address, include_dashboard=False, log_to_driver=False)
            else:  # a local instance: environments mostly wait on their applications, so every slot gets room
                ray.init(num_cpus=max(os.cpu_count() or 1, math.ceil(num_workers * cpus_per_worker)),
                         include_dashboard=False, log_to_driver=False)
        self._actor_class = ray.remote(num_cpus=cpus_per_worker, max_restarts=0, max_task_retries=0,
                                       scheduling_strategy="SPREAD")(_EnvActor)
        self._actors: list[Any] = [None] * num_workers
        self._pids: list[int | None] = [None] * num_workers
        self._down: dict[int, str] = {}
        self.restarts = 0
        pending = {slot: self._spawn(slot) for slot in range(num_workers)}
        for slot, ref in pending.items():
            error = self._await_ready(slot, ref)
            if error is not None:
                self.close()
                raise RuntimeError(f"env actor {slot} failed to start: {error}")

    @property
    def num_workers(self) -> int:
        return len(self._actors)

    def worker_pids(self) -> list[int | None]:
        return list(self._pids)

    def _spawn(self, slot: int) -> Any:
        self._actors[slot] = self._actor_class.remote(self.factories[slot])
        return self._actors[slot].ready.remote()

    def _await_ready(self, slot: int, ref: Any) -> str | None:
        try:
            pid, error = self._ray.get(ref, timeout=self.start_timeout_s)
        except self._ray.exceptions.GetTimeoutError:
            self._kill(slot)
            return f"not ready within {self.start_timeout_s}s"
        except Exception as e:  # the factory raised in the actor, or the actor could not be placed
            self._kill(slot)
            return _reason(e)
        if error is not None:
            self._kill(slot)
            return error
        self._pids[slot] = pid
        return None

    def _kill(self, slot: int) -> None:
        if self._actors[slot] is not None:
            try:
                self._ray.kill(self._actors[slot], no_restart=True)
            except Exception:
                pass
        self._actors[slot], self._pids[slot] = None, None

    def _restart(self, slot: int) -> None:
        """Replace a slot's actor; one that cannot start now leaves the slot down, retried on its next call."""
        self._kill(slot)
        self.restarts += 1
        error = self._await_ready(slot, self._spawn(slot))
        if error is None:
            self._down.pop(slot, None)
        else:
            self._down[slot] = error

    def call(self, method: str, slot_args: dict[int, tuple], timeout_s: float | None = None) -> dict[int, Result]:
        ray = self._ray
        results: dict[int, Result] = {}
        refs: dict[Any, int] = {}
        for slot, args in slot_args.items():
            if not 0 <= slot < self.num_workers:
                raise IndexError(f"slot {slot} out of range for a pool of {self.num_workers}")
            if slot in self._down or self._actors[slot] is None:
                self._restart(slot)
                if slot in self._down:
                    results[slot] = Result(False, error=f"env actor {slot} is down: {self._down[slot]}")
                    continue
            refs[self._actors[slot].call.remote(method, args)] = slot
        timeout = timeout_s or self.timeout_s
        deadline = time.monotonic() + timeout
        broken: set[int] = set()
        waiting = list(refs)
        while waiting:
            ready, waiting = ray.wait(waiting, num_returns=len(waiting), timeout=max(0.0, deadline - time.monotonic()))
            for ref in ready:
                slot = refs[ref]
                try:
                    results[slot] = Result(True, ray.get(ref))
                except ray.exceptions.RayTaskError as e:  # the environment raised: reported, actor kept
                    results[slot] = Result(False, error=_reason(e))
                except ray.exceptions.RayActorError as e:  # the actor (its process or node) is gone
                    results[slot] = Result(False, error=f"env actor {slot} died during '{method}': {_reason(e)}")
                    broken.add(slot)
            if time.monotonic() >= deadline:
                break
        for ref in waiting:
            slot = refs[ref]
            results[slot] = Result(False, error=f"env actor {slot} timed out after {timeout}s in '{method}'")
            broken.add(slot)
        for slot in sorted(broken):
            self._restart(slot)
        return {slot: results[slot] for slot in slot_args}

    def close(self) -> None:
        """Close every environment (bounded wait), then end the actors."""
        live = [a.close.remote() for a in self._actors if a is not None]
        if live:
            self._ray.wait(live, num_returns=len(live), timeout=10)
        for slot in range(self.num_workers):
            self._kill(slot)
        if self._owns_ray and self._ray.is_initialized():
            self._ray.shutdown()
            self._owns_ray = False


def _reason(error: BaseException) -> str:
    """The first line of what Ray says, with the environment's own exception when there is one."""
    cause = getattr(error, "cause", None)
    if cause is not None and not isinstance(cause, type(error)):
        return f"{type(cause).__name__}: {cause}"
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"
