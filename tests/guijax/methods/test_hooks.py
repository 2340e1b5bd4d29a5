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


def traj(reward: float, steps: int = 1, plan: tuple[str, ...] = (), tag: int = 0, size: int = 8) -> Trajectory:
    shot = np.full((size, size, 3), tag, np.uint8)
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


def test_bepa_level2_injects_only_on_total_failure_into_the_first_slot():
    """Algorithm 2: no success in the group (partial credit <= 0.5 and environment errors are not successes)
    -> τ_{x,1} becomes the cached trajectory without its plan; one success anywhere -> the group as it was."""
    bepa = CacheHook()
    seed = traj(1.0, plan=("click OK", "close the dialog"), tag=9)
    bepa.seed_cache([seed])
    one_success = [traj(0.0, tag=i) for i in range(7)] + [traj(1.0, tag=7)]  # the success is last
    got = bepa.assemble(TASK, one_success)
    assert all(a is b for a, b in zip(got, one_success)) and len(got) == 8
    assert bepa.metrics()["cache_injections"] == 0
    errored = traj(1.0, tag=13)
    errored.status = Status.ENV_ERROR
    failures = [traj(0.3, tag=10), traj(0.5, tag=11), traj(0.0, tag=12), errored]
    got = bepa.assemble(TASK, failures)
    assert tags(got) == [9, 11, 12, 13] and all(a is b for a, b in zip(got[1:], failures[1:]))
    injected = got[0]
    assert injected.source == Source.CACHE and injected.plan == () and injected.instruction == TASK.instruction
    assert injected.steps is seed.steps and injected.reward == seed.reward  # the same steps, re-encoded
    assert seed.plan == ("click OK", "close the dialog") and seed.source == Source.ON_POLICY  # cache untouched
    assert bepa.metrics()["cache_injections"] == 1


def test_bepa_injected_trajectory_is_encoded_under_the_plain_instruction(proc):
    """The pipeline encodes the injected row without the plan (BEPA §4.2: the policy learns to act without
    it), while the LEVEL-1 roll it came from was prompted with the plan."""
    from guijax.data.pipeline import EncodeStep, PipelineConfig, StepRef

    bepa = CacheHook()
    seed = traj(1.0, plan=("open the dialog", "press OK"), tag=9, size=56)
    bepa.seed_cache([seed])
    group = bepa.assemble(TASK, [traj(0.0, tag=i, size=56) for i in range(2)])
    config = PipelineConfig(max_images=1, length_buckets=(512,), system_prompt="Task: {instruction}\n")

    def prompt(trajectories, i):
        ex = EncodeStep(trajectories, proc, config).map(StepRef(i, 0, 1.0))
        return proc.tokenizer.decode(ex["input_ids"][ex["loss_mask"] == 0], skip_special_tokens=False)

    assert "Task: Click OK.\n\n1. open the dialog\n2. press OK\n" in prompt([seed], 0)
    injected = prompt(group, 0)
    assert "Task: Click OK.\n<|im_end|>" in injected and "open the dialog" not in injected


def test_bepa_static_cache_keeps_the_level1_seed():
    """refresh=False (the static LEVEL-1 ablation): successes never replace a seeded entry (it is what gets
    injected), and a task without a seed gets none. refresh=True follows the latest successful group."""
    static, fresh = CacheHook(refresh=False), CacheHook(refresh=True)
    for b in (static, fresh):
        b.seed_cache([traj(1.0, plan=("p",), tag=5)])
        b.observe(TASK, [traj(1.0, tag=6), traj(0.0, tag=0)])
        b.observe(TASK, [traj(1.0, tag=7)])
    assert static.cache["t1"].meta["tag"] == 5 and fresh.cache["t1"].meta["tag"] == 7
    assert tags(static.assemble(TASK, [traj(0.0, tag=1), traj(0.0, tag=2)])) == [5, 2]
    other = Task(id="t2", instruction="x")
    static.observe(other, [traj(1.0, tag=20)])
    assert "t2" not in static.cache and static.assemble(other, [traj(0.0, tag=21)])[0].meta["tag"] == 21


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


@pytest.mark.hostile
def test_a_lost_shard_fails_its_own_references_and_moves_no_other(tmp_path):
    """References name their shard: with the first shard moved away (what a corrupted shard's error advises),
    the buffer held in the second restores the same trajectories; one that pointed into the lost shard fails
    naming it. A global index would have handed back other trajectories or run off the end."""
    from guijax.data.store import StoreError

    store = TrajectoryStore(tmp_path / "bank")
    arpo = ReplayHook(buffer_size=2, store=store)
    arpo.observe(TASK, [traj(1.0, tag=1), traj(0.0, tag=0)])
    arpo.state_dict()  # tag 1 goes to the first shard
    arpo.observe(TASK, [traj(1.0, tag=2), traj(0.0, tag=0)])
    arpo.observe(TASK, [traj(1.0, tag=3), traj(0.0, tag=0)])  # evicts tag 1
    state = arpo.state_dict()  # tags 2 and 3: the second shard
    first = store.shards[0]
    first.rename(tmp_path / first.name)
    again = ReplayHook(buffer_size=2, store=TrajectoryStore(tmp_path / "bank"))
    again.load_state_dict(state)
    assert tags(again.buffers["t1"]) == [2, 3]
    state["buffers"]["t1"].append(f"{first.name}:0")
    with pytest.raises(StoreError, match=f"{first.name} is missing"):
        ReplayHook(buffer_size=3, store=TrajectoryStore(tmp_path / "bank")).load_state_dict(state)


@pytest.mark.parametrize("rewards, replaced", [
    ([1.0] + [0.0] * 7, False),  # 1 of 8: mean 0.125 < 0.2, but std 0.33 >= 0.05: has a learning signal
    ([1.0] * 8, False),  # all success: std 0, mean 1
    ([0.3] * 8, False),  # std 0, but mean 0.3 >= 0.2
    ([0.0] * 8, True),  # all failure
    ([0.1] * 8, True),  # std 0 and mean 0.1 < 0.2: all failure, though no reward is 0
], ids=["one_of_eight", "all_success", "flat_0.3", "all_failure", "flat_0.1"])
def test_arpo_replaces_only_when_std_and_mean_are_both_low(rewards, replaced):
    """ARPO's all-failure check: a group is left alone when its reward std >= 0.05 OR its mean >= 0.2; otherwise one
    failed rollout (reward <= 0.1) is replaced by a buffered success, marked REPLAY."""
    arpo = ReplayHook(buffer_size=4)
    arpo.observe(TASK, [traj(1.0, tag=100), traj(0.9, tag=101), traj(0.0, tag=102)])
    assert tags(arpo.buffers["t1"]) == [100, 101]
    group = [traj(r, tag=i) for i, r in enumerate(rewards)]
    got = arpo.assemble(TASK, group)
    assert len(got) == len(group)
    changed = [i for i, (a, b) in enumerate(zip(got, group)) if a is not b]
    assert arpo.metrics()["replay_injections"] == float(replaced)
    if not replaced:
        assert changed == []
        return
    assert len(changed) == 1 and group[changed[0]].reward <= 0.1
    new = got[changed[0]]
    assert new.source == Source.REPLAY and new.meta["tag"] in (100, 101)
    assert all(t.source == Source.ON_POLICY for t in arpo.buffers["t1"])  # the buffer keeps the originals


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
