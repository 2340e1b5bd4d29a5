"""EnvPool: environments in worker processes, driven in batches over the live episodes.

Each slot is one process holding one environment (the synthetic desk, a remote OSWorld client, ...) built by
a picklable factory. Calls go to all addressed slots at once and are collected under a deadline; a worker
that crashes or does not answer in time is killed and restarted, and its episode comes back as an error
with the reason — reported, never scored as a task failure. Workers are started with the 'spawn' method so
they never inherit a JAX runtime from the trainer, and they die with the pool (daemon processes, atexit)
or, should the trainer itself be killed, on their own (a watchdog thread notices the parent is gone).

Slots are the episode ids of a round: `reset(tasks)` starts episode i on slot i, `step({slot: actions})`
advances any subset of live episodes (they end at different times), `evaluate(slots)` scores finished ones.
A caller with more episodes than workers runs them in rounds (guijax's rollout engine does).
"""
from __future__ import annotations

import atexit
import dataclasses
import multiprocessing as mp
import os
import threading
import time
import traceback
import weakref
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Sequence

from envs.api import Env, Task


@dataclasses.dataclass
class Result:
    """Outcome of one call on one slot: `value` when ok, else `error` says what happened."""

    ok: bool
    value: Any = None
    error: str | None = None


def _watch_parent(parent_pid: int, period_s: float = 0.5) -> None:
    """Exit when the parent process is gone (re-parented): a SIGKILLed trainer leaves no orphan workers.
    A thread, not prctl(PR_SET_PDEATHSIG), which fires when the creating *thread* exits."""
    def run() -> None:
        while True:
            if os.getppid() != parent_pid:
                os._exit(1)
            time.sleep(period_s)

    threading.Thread(target=run, name="envpool-parent-watch", daemon=True).start()


def _worker(conn: Connection, factory: Callable[[], Env], parent_pid: int | None = None) -> None:
    if parent_pid is not None:
        _watch_parent(parent_pid)
    env = None
    try:
        env = factory()
    except BaseException as e:  # report instead of dying silently
        conn.send(("init_error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", None))
    while True:
        try:
            method, args, kwargs = conn.recv()
        except (EOFError, OSError):
            break
        if method == "close":
            break
        try:
            conn.send(("ok", getattr(env, method)(*args, **kwargs)))
        except BaseException as e:
            conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}"))
    try:
        env.close()
    except Exception:
        pass


def per_worker(factory: Callable[[], Env] | Sequence[Callable[[], Env]], num_workers: int
               ) -> list[Callable[[], Env]]:
    """One factory for every worker, or one per worker (e.g. one remote desktop server URL each)."""
    if num_workers < 1:
        raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    factories = list(factory) if isinstance(factory, (list, tuple)) else [factory] * num_workers
    if len(factories) != num_workers:
        raise ValueError(f"{len(factories)} factories for {num_workers} workers; give one or one per worker")
    return factories


class SlotPool:
    """Episodes on numbered slots over `call(method, {slot: args})`: what every fleet (worker processes here,
    Ray actors in envs.ray_pool) shares, so the rollout engine drives any of them the same way."""

    num_workers: int
    timeout_s: float

    def call(self, method: str, slot_args: dict[int, tuple], timeout_s: float | None = None) -> dict[int, Result]:
        raise NotImplementedError

    def reset(self, tasks: Sequence[Task], slots: Sequence[int] | None = None,
              seeds: Sequence[int] | None = None, timeout_s: float | None = None) -> dict[int, Result]:
        """Start one episode per task on slots 0..len(tasks)-1 (or the given slots); `seeds` makes each
        episode's randomness (pop-ups) reproducible wherever it runs."""
        slots = list(range(len(tasks))) if slots is None else list(slots)
        if len(tasks) > self.num_workers or len(slots) != len(tasks):
            raise ValueError(f"{len(tasks)} tasks for {len(slots)} slots of a pool of {self.num_workers}: "
                             "run more episodes than workers in rounds")
        if len(set(slots)) != len(slots):
            raise ValueError(f"reset: slots {slots} repeat a slot")
        if seeds is None:
            return self.call("reset", {s: (t,) for s, t in zip(slots, tasks)}, timeout_s)
        if len(seeds) != len(tasks):
            raise ValueError(f"reset: {len(seeds)} seeds for {len(tasks)} tasks")
        return self.call("reset", {s: (t, seed) for s, t, seed in zip(slots, tasks, seeds)}, timeout_s)

    def step(self, actions: dict[int, Any], timeout_s: float | None = None) -> dict[int, Result]:
        """actions: slot -> an Action or a list of Actions (one response); returns slot -> StepResult."""
        return self.call("step", {s: (a,) for s, a in actions.items()}, timeout_s)

    def evaluate(self, slots: Sequence[int], timeout_s: float | None = None) -> dict[int, Result]:
        return self.call("evaluate", {s: () for s in slots}, timeout_s)

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class EnvPool(SlotPool):
    def __init__(self, factory: Callable[[], Env] | Sequence[Callable[[], Env]], num_workers: int, *,
                 timeout_s: float = 120.0, start_timeout_s: float = 120.0):
        """factory: one picklable factory for every worker, or one per worker (e.g. one remote desktop
        server URL each)."""
        self.factories = per_worker(factory, num_workers)
        self.factory = self.factories[0]
        self.timeout_s = timeout_s
        self.start_timeout_s = start_timeout_s
        self._ctx = mp.get_context("spawn")
        self._procs: list[Any] = [None] * num_workers
        self._conns: list[Connection | None] = [None] * num_workers
        self._down: dict[int, str] = {}  # slot -> why its worker could not be restarted (retried next call)
        self.restarts = 0
        for slot in range(num_workers):
            self._start(slot)
        for slot in range(num_workers):
            self._await_ready(slot)
        self._finalizer = weakref.finalize(self, EnvPool._shutdown, self._procs, self._conns)
        atexit.register(self._finalizer)

    @property
    def num_workers(self) -> int:
        return len(self._procs)

    def _start(self, slot: int) -> None:
        parent, child = self._ctx.Pipe()
        proc = self._ctx.Process(target=_worker, args=(child, self.factories[slot], os.getpid()), daemon=True,
                                 name=f"envpool-{slot}")
        proc.start()
        child.close()
        self._procs[slot], self._conns[slot] = proc, parent

    def _await_ready(self, slot: int) -> None:
        conn = self._conns[slot]
        if not conn.poll(self.start_timeout_s):
            self._kill(slot)
            raise RuntimeError(f"env worker {slot} did not start within {self.start_timeout_s}s")
        try:
            status, message = conn.recv()
        except (EOFError, OSError):  # the worker died before it could say why (killed, os._exit, a segfault)
            raise RuntimeError(f"env worker {slot} died while starting ({self._exit_code(slot)})") from None
        if status != "ready":
            self._kill(slot)
            raise RuntimeError(f"env worker {slot} failed to build its environment: {message}")

    def _kill(self, slot: int) -> None:
        proc, conn = self._procs[slot], self._conns[slot]
        if conn is not None:
            conn.close()
        if proc is not None and proc.is_alive():
            proc.kill()
        if proc is not None:
            proc.join(5)

    def _exit_code(self, slot: int) -> str:
        """How a worker ended, once its process has been reaped (its pipe closes a moment before)."""
        proc = self._procs[slot]
        proc.join(1.0)
        code = proc.exitcode
        if code is None:
            return "still running"
        return f"killed by signal {-code}" if code < 0 else f"exit code {code}"

    def _restart(self, slot: int) -> None:
        """Replace a slot's worker. A factory that fails now (a remote VM being down) leaves the slot down,
        to be retried on its next call, instead of raising into the training loop."""
        self._kill(slot)
        self.restarts += 1
        try:
            self._start(slot)
            self._await_ready(slot)
            self._down.pop(slot, None)
        except (RuntimeError, OSError) as e:
            self._down[slot] = str(e)

    def worker_pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def call(self, method: str, slot_args: dict[int, tuple], timeout_s: float | None = None) -> dict[int, Result]:
        """Run `env.method(*args)` on each addressed slot concurrently; failed slots are restarted. The
        timeout starts once every call is sent, so restarting a down slot never eats a healthy slot's time."""
        results: dict[int, Result] = {}
        broken: set[int] = set()  # slots whose worker must be restarted
        pending: dict[Connection, int] = {}
        for slot, args in slot_args.items():
            if not 0 <= slot < self.num_workers:
                raise IndexError(f"slot {slot} out of range for a pool of {self.num_workers}")
            if slot in self._down:
                self._restart(slot)
                if slot in self._down:
                    results[slot] = Result(False, error=f"env worker {slot} is down: {self._down[slot]}")
                    continue
            try:
                self._conns[slot].send((method, args, {}))
                pending[self._conns[slot]] = slot
            except (BrokenPipeError, OSError) as e:
                results[slot] = Result(False, error=f"env worker {slot} crashed before '{method}' "
                                                    f"({self._exit_code(slot)}; {e})")
                broken.add(slot)
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        while pending:
            remaining = deadline - time.monotonic()
            ready = wait(list(pending), timeout=max(0.0, remaining)) if remaining > 0 else []
            if not ready:
                break
            for conn in ready:
                slot = pending.pop(conn)
                try:
                    status, value = conn.recv()
                except (EOFError, OSError):
                    results[slot] = Result(False, error=f"env worker {slot} crashed during '{method}' "
                                                        f"({self._exit_code(slot)})")
                    broken.add(slot)
                    continue
                results[slot] = Result(True, value) if status == "ok" else Result(False, error=value)
        for slot in pending.values():
            results[slot] = Result(False, error=f"env worker {slot} timed out after {timeout_s or self.timeout_s}s in '{method}'")
            broken.add(slot)
        for slot in sorted(broken):
            self._restart(slot)
        return {slot: results[slot] for slot in slot_args}

    def close(self) -> None:
        self._finalizer()

    @staticmethod
    def _shutdown(procs, conns) -> None:
        for conn in conns:
            try:
                if conn is not None:
                    conn.send(("close", (), {}))
            except (BrokenPipeError, OSError):
                pass
        deadline = time.monotonic() + 5
        for proc in procs:
            if proc is not None:
                proc.join(max(0.0, deadline - time.monotonic()))
                if proc.is_alive():
                    proc.kill()
                    proc.join(2)
        for conn in conns:
            if conn is not None:
                conn.close()


@dataclasses.dataclass(frozen=True)
class DeskFactory:
    """Picklable factory for synthetic-desk workers."""

    screen_hw: tuple[int, int] = (280, 280)
    step_limit: int = 15
    seed: int = 0
    popups: bool = True
    step_latency_s: float = 0.0  # every reset and step waits this long (envs.latency: a VM stand-in)

    def __call__(self) -> Env:
        from envs.desk.env import DeskEnv
        from envs.latency import Slowed

        env = DeskEnv(self.screen_hw, self.step_limit, self.seed, self.popups)
        return Slowed(env, self.step_latency_s) if self.step_latency_s else env
