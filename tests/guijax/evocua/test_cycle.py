"""The evolution cycle (EvoCUA §5) on the tiny model: each round rolls the current policy out up the budget
ladder, then RFT on that round's successes and step-DPO on its failures; rounds keep their rollouts, report
and checkpoint, and a rerun resumes after the last finished round. The rollouts come from a scripted engine
(every other episode the expert's success, the others a failure that waits where the expert acted), so
both phases find data while the tiny model itself solves nothing."""
from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import pytest

from guijax import compilation_cache
from guijax.data.store import TrajectoryStore
from guijax.evocua.cycle import first_level_success, rounds_table
from guijax.methods import get_method
from guijax.methods.base import Context
from guijax.pipeline import base_stages
from guijax.pipeline.run import Run
from guijax.rng import Streams
from guijax.rollout.trajectory import Status

CYCLE = ("env.families=('click_button',)", "env.num_tasks=4", "evocua.rft_steps=2", "evocua.dpo_steps=2",
         "evocua.batch_trajectories=4", "evocua.rft_learning_rate=1e-3", "evocua.dpo_learning_rate=1e-3",
         "evocua.budgets=(2, 4)", "evocua.thresholds=(1.0, 0.5)", "evocua.rounds=2")


class ScriptedEngine:
    """engine.run as the rollout engine returns it: in (task, episode) order, alternating the expert's success
    and a failure; records the parameters and the progress label of every call."""

    def __init__(self, traces):
        self.traces, self.calls = traces, []

    def run(self, params, tasks, per_task, rng, seed=0, desc=""):
        self.calls.append((desc, float(np.sum(np.asarray(jax.tree.leaves(params)[0], np.float32)))))
        out = []
        for task in tasks:
            win = self.traces[task.id]
            lose = dataclasses.replace(win, reward=0.0, status=Status.STEP_LIMIT, steps=[dataclasses.replace(
                win.steps[0], response="Thought: wait.\nAction: wait()", actions=["WAIT"])] * 2)
            out += [win if g % 2 == 0 else lose for g in range(per_task)]
        return out, {}


@pytest.fixture(scope="module")
def cycle_run(tiny_config, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("cycle") / "run"
    compilation_cache.enable(str(workdir.parent / "xla"))  # later rounds reuse the first round's programs
    config = tiny_config("grpo_cpu", *CYCLE)
    run = Run(config, workdir)
    base_stages.base_model.fn(run)
    base_stages.tasks.fn(run)
    train = run.tasks()["train"]
    traces = {t.task_id: t for t in base_stages.expert_trajectories(run, train)}
    yield run, train, traces
    run.close()


def _cycle(run, train, traces, workdir, rounds: int, phases=None):
    """Run the cycle; `phases` {name: fn(policy, rollouts) -> report entries} stands in for RFT / step-DPO."""
    from guijax.trainer import pipeline_config

    config = run.config.copy_and_resolve_references()
    config.evocua.rounds = rounds
    method = get_method("evocua_cycle", config)
    for name, fn in (phases or {}).items():
        setattr(method, name, lambda ctx, policy, pipeline, rollouts, *rest, fn=fn: fn(policy, rollouts))
    engine = ScriptedEngine(traces)
    ctx = Context(config, run.workdir, workdir, Streams(0), train_tasks=train,
                  rollout_engine=lambda policy, temperature: engine)
    policy = run.load_policy(run.base_model_dir)
    method.before_rl(ctx, policy, pipeline_config(config, run.system_prompt, policy.mesh))
    return engine, policy


def _shift(policy, rollouts):
    """A stand-in phase that moves the parameters (so the next round must roll out other weights)."""
    policy.params = jax.tree.map(lambda x: x + 1, policy.params)
    return {"rft_trajectories": sum(t.success for t in rollouts)}


def _nothing(policy, rollouts):
    from guijax.methods.evocua import NothingToTrain

    raise NothingToTrain("evocua_cycle: no critical forking point among the rollouts")


def test_rounds_roll_out_the_last_rounds_policy_and_keep_their_data(cycle_run, tmp_path):
    """The cycle's bookkeeping with stand-in phases (no compile): every round's rollouts, report and
    checkpoint kept, round 2 rolls out round 1's parameters, a phase without data is skipped and said so,
    and the table gives each round's start."""
    run, train, traces = cycle_run
    engine, policy = _cycle(run, train, traces, tmp_path, rounds=2, phases={"rft": _shift, "step_dpo": _nothing})
    n = len(train)
    reports = json.loads((tmp_path / "rounds.json").read_text())
    assert [r["round"] for r in reports] == [1, 2]
    for r in reports:  # each task: 1 of its first 2 episodes succeeds (< τ_1 = 1.0), topped up to 4 (0.5 >= τ_2)
        assert r["start_success"] == r["start_success_train"] == 0.5 and r["tasks"] == n
        assert r["synthesized_tasks"] == 0 and "start_success_synthesized" not in r
        assert r["episodes"] == 4 * n and r["settled_at"] == {"2": 0, "4": n} and r["rft_trajectories"] == 2 * n
        assert "no critical forking point" in r["step_dpo_skipped"] and "rft_skipped" not in r
    for k in (1, 2):
        assert len(list(TrajectoryStore(tmp_path / f"round_{k}" / "rollouts"))) == 4 * n
    assert sorted(int(p.name) for p in (tmp_path / "rounds").iterdir() if p.name.isdigit()) == [1, 2]
    sums = {desc.split()[1]: total for desc, total in engine.calls}
    leaf = jax.tree.leaves(run.load_policy(run.base_model_dir).params)[0]
    assert sums["r2"] == pytest.approx(sums["r1"] + np.size(leaf), rel=1e-5)  # round 1's shift, rolled out
    assert f"| 2 | 50.0% ({n} tasks) | 50.0% / – | {4 * n} ({4 * n}) | {n} | {2 * n} | – |" in (
        tmp_path / "rounds.md").read_text()
    assert (tmp_path / "rounds.png").stat().st_size > 0


@pytest.mark.slow  # 140 s: RFT and step-DPO compile and train twice
def test_each_round_rolls_out_the_policy_it_trained_and_keeps_its_data(cycle_run, tmp_path):
    run, train, traces = cycle_run
    engine, policy = _cycle(run, train, traces, tmp_path, rounds=2)
    # every task: 1 of its first 2 episodes succeeds (0.5 < τ_1 = 1.0), topped up to 4, where 0.5 meets τ_2
    reports = json.loads((tmp_path / "rounds.json").read_text())
    assert [r["round"] for r in reports] == [1, 2]
    for r in reports:
        assert r["start_success"] == 0.5 and r["tasks"] == len(train)
        assert r["episodes"] == 4 * len(train) and r["settled_at"] == {"2": 0, "4": len(train)}
        assert r["rft_trajectories"] == 2 * len(train) and r["rft_steps_trained"] > 0
        # each failure waits where its task's success acted: one correction and one reflection pair
        assert r["dpo_action_correction_pairs"] == r["dpo_reflection_pairs"] == 2 * len(train)
        assert np.isfinite(r["dpo_loss_last"]) and "rft_skipped" not in r
    for k in (1, 2):
        assert len(list((tmp_path / f"round_{k}" / "rollouts").glob("*.array_record"))) == 1
        assert json.loads((tmp_path / f"round_{k}" / "round.json").read_text())["round"] == k
    assert sorted(int(p.name) for p in (tmp_path / "rounds").iterdir() if p.name.isdigit()) == [1, 2]
    # round 2 rolled out the parameters round 1 trained: its calls saw other weights than round 1's
    by_round = {desc.split()[1]: s for desc, s in engine.calls}
    assert by_round["r1"] != by_round["r2"]
    n = len(train)
    assert f"| 2 | 50.0% ({n} tasks) | 50.0% / – | {4 * n} ({4 * n}) | {n} | {2 * n} | {2 * n} + {2 * n} |" in (
        tmp_path / "rounds.md").read_text()
    assert (tmp_path / "rounds.png").stat().st_size > 0


@pytest.mark.slow  # 60 s: a third round after a restart
def test_a_rerun_resumes_after_the_last_finished_round(cycle_run, tmp_path):
    run, train, traces = cycle_run
    _cycle(run, train, traces, tmp_path, rounds=1)
    engine, _ = _cycle(run, train, traces, tmp_path, rounds=2)
    assert {desc.split()[1] for desc, _ in engine.calls} == {"r2"}
    assert [r["round"] for r in json.loads((tmp_path / "rounds.json").read_text())] == [1, 2]


def test_first_level_success_reads_only_each_tasks_first_budget():
    from guijax.rollout.trajectory import Trajectory

    def t(task, reward, status=Status.DONE):
        return Trajectory(task, "", [], reward=reward, status=status)

    # task a: first two episodes 1 success; its top-ups (two more successes) are not counted
    rollouts = [t("a", 1.0), t("a", 0.0), t("a", 1.0), t("a", 1.0), t("b", 0.0), t("b", 0.0, Status.ENV_ERROR)]
    assert first_level_success(rollouts, 2) == (0.25, 2)
    table = rounds_table([{"round": 1, "start_success": 0.25, "tasks": 2, "episodes": 6, "uniform_episodes": 8,
                           "tasks_with_success": 1, "rft_trajectories": 3}])
    assert "| 1 | 25.0% (2 tasks) | – | 6 (8) | 1 | 3 | – |" in table


def test_the_cycle_rolls_out_synthesized_tasks_when_asked(cycle_run, tmp_path):
    from envs.tasks import save_tasks

    run, train, traces = cycle_run
    config = run.config.copy_and_resolve_references()
    config.evocua.synthesized = True
    method = get_method("evocua_cycle", config)
    assert method.requires == ("synthesis",) and get_method("evocua_cycle", run.config).requires == ()
    ctx = Context(config, tmp_path, tmp_path / "m", Streams(0), train_tasks=train)
    with pytest.raises(FileNotFoundError, match="add 'synthesis' to config.stages"):
        method.tasks(ctx)
    extra = [dataclasses.replace(train[0], id="syn-click-s0-0000")]
    save_tasks(extra, tmp_path / "synthesized_tasks.json")
    assert [t.id for t in method.tasks(ctx)] == [t.id for t in train] + ["syn-click-s0-0000"]
