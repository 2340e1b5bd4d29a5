"""The asynchronous rollout stream with stand-ins for the pool, sampler and processor (no model needed)."""
from __future__ import annotations

import contextlib
import threading
import time

import jax
import numpy as np
import pytest

from envs.api import Observation, StepResult, Task
from envs.pool import Result
from guijax.data.store import SUFFIX, TrajectoryStore
from guijax.rollout.engine import RolloutConfig, RolloutEngine
from guijax.rollout.prompt import COMPACT_PROMPT
from guijax.rollout.stream import RolloutStream, group_index, sampling_version, shard_name
from guijax.rollout.trajectory import Status
from rollout_fakes import FakeProcessor, FakeSampler, FakeTokenizer

SHOT = np.zeros((28, 28, 3), np.uint8)


class LengthPool:
    """Task 'len<N>' ends after N steps; task 'broken' never resets. Records every reset."""

    def __init__(self, num_workers: int, step_s: float = 0.0, reset_s: float = 0.0,
                 step_s_of: dict[str, float] | None = None):
        self.num_workers, self.step_s, self.reset_s = num_workers, step_s, reset_s
        self.step_s_of = step_s_of or {}  # task id -> its own step time (a slower VM)
        self.task_of: dict[int, str] = {}
        self.calls: list[tuple[str, float, float]] = []  # (method, start, end)
        self.resets: list[tuple[int, str, int]] = []  # (slot, task, seed)
        self.events: list[tuple[str, int]] = []  # ("reset", seed) / ("end", slot), in order
        self.left: dict[int, int] = {}
        self.lock = threading.Lock()

    def reset(self, tasks, slots=None, seeds=None, timeout_s=None):
        t0 = time.perf_counter()
        time.sleep(self.reset_s)
        out = {}
        for slot, task, seed in zip(slots, tasks, seeds):
            with self.lock:
                self.resets.append((slot, task.id, seed))
                self.events.append(("reset", seed))
            if task.id == "broken":
                out[slot] = Result(False, error="setup of broken failed")
                continue
            self.left[slot] = int(task.id[3:])
            self.task_of[slot] = task.id
            out[slot] = Result(True, Observation(SHOT, task.id))
        self.calls.append(("reset", t0, time.perf_counter()))
        return out

    def step(self, actions, timeout_s=None):
        t0 = time.perf_counter()
        # a reset started meanwhile (in the stream's helper thread) is done by then
        time.sleep(max(self.step_s_of.get(self.task_of[s], self.step_s) for s in actions))
        out = {}
        for slot in actions:
            self.left[slot] -= 1
            if self.left[slot] == 0:
                self.events.append(("end", slot))
            out[slot] = Result(True, StepResult(Observation(SHOT, ""), self.left[slot] == 0))
        self.calls.append(("step", t0, time.perf_counter()))
        return out

    def evaluate(self, slots, timeout_s=None):
        return {s: Result(True, 1.0) for s in slots}


class Sampler(FakeSampler):
    """Records which parameters each call got; `on_call(n)` runs inside the n-th call."""

    def __init__(self, on_call=None):
        self.params_seen: list[str] = []
        self.on_call = on_call

    def generate(self, params, rng, **inputs):
        self.params_seen.append(params)
        if self.on_call is not None:
            self.on_call(len(self.params_seen))
        return super().generate(params, rng, **inputs)


class ClickTokenizer(FakeTokenizer):
    response = "Thought: click it.\nAction: click(start_box='(10,10)')"


class Processor(FakeProcessor):
    tokenizer = ClickTokenizer()


@contextlib.contextmanager
def _running(stream):
    stream.publish("p0", 0)
    stream.start()
    try:
        yield stream
    finally:
        stream.close()


def _stream(tmp_path, tasks: dict[int, str], *, workers=4, group_size=2, ahead=8, sampler=None, step_s=0.0,
            reset_s=0.0, step_s_of=None, **kw):
    pool = LengthPool(workers, step_s, reset_s, step_s_of)
    engine = RolloutEngine(pool, sampler or Sampler(), Processor(),
                           RolloutConfig(system_prompt=COMPACT_PROMPT, show_progress=False))

    def spec(i):
        return Task(tasks.get(i, "len1"), "do it", domain="test"), [1000 * i + g for g in range(group_size)]

    stream = RolloutStream(engine, spec, group_size, tmp_path, jax.random.key(0), max_groups_ahead=ahead, **kw)
    return stream, pool


def _read(tmp_path, shard: str, n: int):
    store = TrajectoryStore(tmp_path)
    return [store.at(shard + SUFFIX, i) for i in range(n)]


def test_a_slot_starts_its_next_episode_without_waiting_for_the_slowest(tmp_path):
    # group 0 takes 4 steps, group 1 one step: in rounds, group 1's slots would idle until group 0 ended
    stream, pool = _stream(tmp_path, {0: "len4", 1: "len1", 2: "len1", 3: "len4"}, ahead=4, step_s=0.05)
    with _running(stream):
        order = []
        for _ in range(4):
            order.append(group_index(stream.get(timeout_s=30)))
            stream.release()
    assert order[0] == 1 and order.index(2) < order.index(0), order  # short groups overtake the long one
    # group 2 started on a slot group 1 freed, while group 0 (slots 0 and 1) was still running
    slot_of = {seed: slot for slot, _, seed in pool.resets}
    assert slot_of[2000] in (2, 3) and slot_of[0] in (0, 1)
    assert pool.events.index(("reset", 2000)) < pool.events.index(("end", slot_of[0])), pool.events
    for i in order:
        members = _read(tmp_path, shard_name(i), 2)
        assert [t.meta["seed"] for t in members] == [1000 * i, 1000 * i + 1]  # member order, the spec's seeds
        assert all(t.meta["group"] == i and t.meta["policy_versions"] == [0] * len(t.steps) for t in members)
        assert all(len(t.steps) == (4 if i in (0, 3) else 1) for t in members)
    assert len(set(order)) == 4


def test_a_slot_whose_environment_answered_does_not_wait_for_a_slower_slots_step(tmp_path):
    # group 0's environment takes 0.4 s a step for 3 steps, group 1's 0.01 s for 8: stepped in lockstep, group 1
    # would take a step only when group 0's slow step returned, and end after it (8 steps > 3)
    stream, pool = _stream(tmp_path, {0: "len3", 1: "len8"}, ahead=2, step_s=0.01, step_s_of={"len3": 0.4})
    with _running(stream):
        order = [group_index(stream.get(timeout_s=30)) for _ in range(2)]
        stream.release(2)
    assert order == [1, 0], order
    slot_of = {seed: slot for slot, _, seed in pool.resets}
    assert pool.events.index(("end", slot_of[1000])) < pool.events.index(("end", slot_of[0])), pool.events
    assert all(len(t.steps) == 8 for t in _read(tmp_path, shard_name(1), 2))


def test_slots_reset_while_other_slots_step(tmp_path):
    # a VM's reset is as slow as a step: the freed slots' resets must not stall the live episodes
    stream, pool = _stream(tmp_path, {0: "len3", 1: "len1", 2: "len1"}, ahead=3, step_s=0.2, reset_s=0.2)
    with _running(stream):
        got = {group_index(stream.get(timeout_s=30)) for _ in range(3)}
        for _ in range(3):
            stream.release()
    assert got == {0, 1, 2}
    resets = [(a, b) for kind, a, b in pool.calls if kind == "reset"]
    steps = [(a, b) for kind, a, b in pool.calls if kind == "step"]
    assert any(a < d and c < b for a, b in resets[1:] for c, d in steps), pool.calls


def test_back_pressure_starts_no_group_past_the_limit_until_one_is_released(tmp_path):
    stream, pool = _stream(tmp_path, {}, ahead=1)
    with _running(stream):
        first = stream.get(timeout_s=30)
        time.sleep(0.3)  # time to start more, had back-pressure allowed it
        assert [seed for *_, seed in pool.resets] == [0, 1] and stream._ready.empty()
        stream.release()
        second = stream.get(timeout_s=30)
    assert (group_index(first), group_index(second)) == (0, 1)
    assert sorted(seed for *_, seed in pool.resets)[:4] == [0, 1, 1000, 1001]


def test_each_step_records_the_version_that_sampled_it(tmp_path):
    holder = {}

    def on_call(n):
        if n == 2:  # the learner publishes while the second step is being sampled
            holder["stream"].publish("p5", 5)

    sampler = Sampler(on_call)
    stream, _ = _stream(tmp_path, {0: "len3"}, workers=2, group_size=2, ahead=1, sampler=sampler)
    holder["stream"] = stream
    with _running(stream):
        shard = stream.get(timeout_s=30)
    members = _read(tmp_path, shard, 2)
    assert sampler.params_seen[:3] == ["p0", "p0", "p5"]
    assert [t.meta["policy_versions"] for t in members] == [[0, 0, 5], [0, 0, 5]]
    assert sampling_version(members, default=9) == 0 and sampling_version([], default=9) == 9


def test_skipped_groups_are_never_started(tmp_path):
    stream, pool = _stream(tmp_path, {}, ahead=2, skip={0, 2}, first=0)
    with _running(stream):
        got = sorted(group_index(stream.get(timeout_s=30)) for _ in range(2))
    assert got == [1, 3]
    assert {seed // 1000 for *_, seed in pool.resets} == {1, 3}


def test_a_failed_reset_ends_its_member_and_the_group_still_completes(tmp_path):
    stream, _ = _stream(tmp_path, {0: "broken"}, ahead=1)
    with _running(stream):
        shard = stream.get(timeout_s=30)
    members = _read(tmp_path, shard, 2)
    assert [t.status for t in members] == [Status.ENV_ERROR] * 2
    assert all("setup of broken failed" in t.error for t in members)


def test_an_error_in_the_rollout_thread_reaches_the_learner(tmp_path):
    def explode(n):
        raise ValueError("sampler out of memory")

    stream, _ = _stream(tmp_path, {}, sampler=Sampler(explode))
    with _running(stream):
        with pytest.raises(RuntimeError, match="rollout thread failed: ValueError: sampler out of memory"):
            stream.get(timeout_s=30)


def test_preloaded_groups_come_first_and_count_against_the_limit(tmp_path):
    stream, pool = _stream(tmp_path, {}, ahead=1, skip={0})
    TrajectoryStore(tmp_path)  # the directory exists; the preloaded shard is only named here
    stream.preload([shard_name(0)])
    with _running(stream):
        assert stream.get(timeout_s=30) == shard_name(0)
        time.sleep(0.3)
        assert pool.resets == []  # the preloaded group holds the only place until released
        stream.release()
        assert stream.get(timeout_s=30) == shard_name(1)


def test_group_names_round_trip():
    assert group_index(shard_name(12)) == 12 and group_index(shard_name(3) + SUFFIX) == 3
    assert group_index("iter-000001.array_record") is None and group_index("group-x") is None


class SyncingSampler(Sampler):
    """A sampler with weights of its own (a serving engine's stand-in): records each push, in the thread that
    made it, and checks every call samples with the weights last pushed."""

    needs_weight_sync = True

    def __init__(self, on_call=None):
        super().__init__(on_call)
        self.pushed: list[tuple[str, int, str]] = []
        self.holding = None

    def sync_weights(self, params, version):
        from guijax.rollout.serving import WeightSync

        self.pushed.append((params, version, threading.current_thread().name))
        self.holding = params
        return WeightSync(version, 0.5, 10, 1)

    def generate(self, params, rng, **inputs):
        assert params == self.holding, (params, self.holding)
        return super().generate(params, rng, **inputs)


def test_the_rollout_thread_pushes_each_published_version_before_sampling_with_it(tmp_path):
    holder = {}

    def on_call(n):
        if n == 2:
            holder["stream"].publish("p5", 5)

    sampler = SyncingSampler(on_call)
    stream, _ = _stream(tmp_path, {0: "len3"}, workers=2, group_size=2, ahead=1, sampler=sampler)
    holder["stream"] = stream
    with _running(stream):
        stream.get(timeout_s=30)
    assert [(p, v) for p, v, _ in sampler.pushed] == [("p0", 0), ("p5", 5)]
    assert {thread for *_, thread in sampler.pushed} == {"rollout-stream"}
    assert stream.timings["weight_sync_s"] == 1.0 and stream.timings["weight_sync_bytes"] == 20
