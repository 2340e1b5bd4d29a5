"""Method hooks on hand-made groups: ARPO replay, BEPA LEVEL-2 cache, expert-mixing baselines, and
their checkpointed state round-tripping through a TrajectoryStore."""
from __future__ import annotations

import numpy as np
import pytest

from envs.api import Task
from guijax.methods.arpo import ReplayHook
from guijax.methods.bepa import CacheHook
from guijax.methods.expert_mix import AppendHook, AuxiliaryHook, ReplacementHook
from guijax.data.store import TrajectoryStore
from guijax.rollout.trajectory import Source, Status, Step, Trajectory

TASK = Task(id="t1", instruction="Click OK.")


def traj(reward: float, steps: int = 1, plan: tuple[str, ...] = (), tag: int = 0) -> Trajectory:
    shot = np.full((8, 8, 3), tag, np.uint8)
    s = [Step(shot, f"Thought: {tag}\nAction: click(start_box='(1,1)')", np.arange(3, dtype=np.int32) + tag,
              np.full(3, -0.5, np.float32)) for _ in range(steps)]
    return Trajectory("t1", TASK.instruction, s, reward, Status.DONE if reward > 0.5 else Status.STEP_LIMIT,
                      plan=plan, meta={"tag": tag})


def tags(group):
    return [t.meta["tag"] for t in group]


def test_bepa_injects_cache_into_first_failure_without_plan_and_refreshes_on_success(tmp_path):
    bepa = CacheHook(store=TrajectoryStore(tmp_path))
    failures = [traj(0.0, tag=i) for i in range(4)]
    assert bepa.assemble(TASK, failures) == failures  # empty cache: the group is left alone
    assert bepa.seed_cache([traj(0.0, tag=8), traj(1.0, plan=("1. click OK",), tag=9)]) == 1
    bepa.observe(TASK, failures)
    group = bepa.assemble(TASK, failures)
    assert tags(group) == [9, 1, 2, 3] and group[0].source == Source.CACHE and group[0].plan == ()
    assert failures[0].source == Source.ON_POLICY  # the rollout itself is not mutated
    mixed = [traj(0.0, tag=10), traj(1.0, tag=11), traj(1.0, tag=12), traj(0.0, tag=13)]
    bepa.observe(TASK, mixed)
    assert bepa.assemble(TASK, mixed) == mixed  # a group with a success is never touched
    assert bepa.cache["t1"].meta["tag"] in (11, 12)
    m = bepa.metrics()
    assert m["cache_updates"] == 1 and m["cache_injections"] == 1 and m["cache_update_frequency"] == 0.5
    assert bepa.metrics()["cache_updates"] == 0  # counters are per iteration


def test_bepa_update_rules():
    short, long_ = traj(1.0, steps=1, tag=1), traj(1.0, steps=3, tag=2)
    b = CacheHook(update_rule="shortest")
    b.observe(TASK, [long_, short])
    assert b.cache["t1"] is short
    b = CacheHook(update_rule="logprob", scorer=lambda ts: [-1.0 if t is short else -0.1 for t in ts])
    b.observe(TASK, [short, long_])
    assert b.cache["t1"] is long_
    with pytest.raises(ValueError, match="scorer"):
        CacheHook(update_rule="logprob").observe(TASK, [short])
    with pytest.raises(ValueError, match="update_rule"):
        CacheHook(update_rule="best")
    static = CacheHook(refresh=False)
    static.seed_cache([traj(1.0, tag=5)])
    static.observe(TASK, [traj(1.0, tag=6)])
    assert static.cache["t1"].meta["tag"] == 5


def test_bepa_cache_survives_a_checkpoint(tmp_path):
    store = TrajectoryStore(tmp_path / "bank")
    b = CacheHook(store=store)
    b.seed_cache([traj(1.0, tag=7)])
    state = b.state_dict()
    assert b.state_dict() == state and len(store) == 1  # stored once, referenced after
    restored = CacheHook(store=TrajectoryStore(tmp_path / "bank"))
    restored.load_state_dict(state)
    got = restored.cache["t1"]
    assert got.meta["tag"] == 7 and np.array_equal(got.steps[0].response_tokens, np.arange(3) + 7)
    unstored = CacheHook()
    unstored.seed_cache([traj(1.0)])
    with pytest.raises(ValueError, match="TrajectoryStore"):
        unstored.state_dict()


def test_arpo_replays_a_buffered_success_into_an_all_failure_group(tmp_path):
    arpo = ReplayHook(buffer_size=2, store=TrajectoryStore(tmp_path))
    for tag in (1, 2, 3):
        arpo.observe(TASK, [traj(1.0, tag=tag), traj(0.0, tag=0)])
    assert tags(arpo.buffers["t1"]) == [2, 3]  # FIFO evicts the oldest
    failures = [traj(0.0, tag=10 + i) for i in range(4)]
    arpo.observe(TASK, failures)
    group = arpo.assemble(TASK, failures)
    replayed = [t for t in group if t.source == Source.REPLAY]
    assert len(replayed) == 1 and replayed[0].meta["tag"] in (2, 3) and len(group) == 4
    mixed = [traj(1.0, tag=20), traj(0.0, tag=21)]
    assert arpo.assemble(TASK, mixed) == mixed  # std >= 0.05: not all failure
    state = arpo.state_dict()
    again = ReplayHook(buffer_size=2, store=TrajectoryStore(tmp_path))
    again.load_state_dict(state)
    assert tags(again.buffers["t1"]) == tags(arpo.buffers["t1"]) and again.draws == arpo.draws


def test_expert_mixing_baselines():
    expert = traj(1.0, tag=99)
    expert.source = Source.EXPERT
    failures = [traj(0.0, tag=i) for i in range(3)]
    tr = ReplacementHook({"t1": expert})
    assert tags(tr.assemble(TASK, failures)) == [99, 1, 2]
    assert tags(tr.assemble(TASK, [traj(1.0, tag=5)])) == [5]
    luffy = AppendHook({"t1": expert})
    assert tags(luffy.assemble(TASK, [traj(1.0, tag=5)])) == [5, 99]
    rl_sft = AuxiliaryHook({"t1": expert})
    assert rl_sft.assemble(TASK, failures) == failures  # the group itself is untouched: advantages as GRPO's
    assert tags(rl_sft.auxiliary(TASK)) == [99] and rl_sft.auxiliary(TASK)[0].source == Source.EXPERT
    assert AppendHook({}).assemble(TASK, failures) == failures


def test_static_level1_cache_never_gains_an_entry_for_an_unseeded_task():
    """The LEVEL-1-only ablation keeps D_self only: a task with no seed stays uncached after a success."""
    static = CacheHook(refresh=False)
    static.observe(TASK, [traj(1.0, tag=6)])
    assert "t1" not in static.cache
    assert static.assemble(TASK, [traj(0.0, tag=1)])[0].meta["tag"] == 1
    live = CacheHook()
    live.observe(TASK, [traj(1.0, tag=6)])
    assert live.cache["t1"].meta["tag"] == 6
