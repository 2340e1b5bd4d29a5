"""Dynamic compute budgeting (Eq. 1): a task stops at the first level whose success rate reaches its
threshold, the others are topped up; environment failures are no evidence; bad ladders are named."""
from __future__ import annotations

import numpy as np
import pytest

from envs.api import Task
from guijax.evocua.budget import BudgetLadder, budgeted_rollouts, summary
from guijax.rollout.trajectory import Status, Trajectory


def _fake_run(rates: dict[str, float], calls: list):
    """Episodes whose success is drawn at each task's rate; each call recorded as (task ids, per task, level)."""
    rng = np.random.RandomState(0)

    def run(tasks, per_task, level):
        calls.append(([t.id for t in tasks], per_task, level))
        out = []
        for t in tasks:
            for _ in range(per_task):
                win = rng.rand() < rates[t.id]
                out.append(Trajectory(t.id, t.instruction, [], reward=1.0 if win else 0.0, status=Status.DONE))
        return out
    return run


def test_easy_tasks_stop_early_and_hard_ones_climb_the_ladder():
    tasks = [Task("easy", "e"), Task("hard", "h"), Task("never", "n")]
    calls: list = []
    ladder = BudgetLadder((2, 4, 8), (1.0, 0.5, 0.25))
    rollouts, budgets = budgeted_rollouts(_fake_run({"easy": 1.0, "hard": 0.3, "never": 0.0}, calls), tasks, ladder)
    by_id = {b.task_id: b for b in budgets}
    assert (by_id["easy"].budget, by_id["easy"].level, by_id["easy"].episodes) == (2, 0, 2)
    assert by_id["never"].level is None and by_id["never"].budget == 8 and by_id["never"].episodes == 8
    # each level tops the still-pending tasks up by the difference to its budget
    assert calls[0] == (["easy", "hard", "never"], 2, 0)
    assert calls[1][1:] == (2, 1) and "easy" not in calls[1][0]
    assert len(rollouts) == sum(b.episodes for b in budgets)
    assert [t.task_id for t in rollouts] == sorted([t.task_id for t in rollouts], key=["easy", "hard", "never"].index)
    hard = by_id["hard"]
    assert hard.success_rate >= ladder.thresholds[hard.level] if hard.level is not None else hard.episodes == 8
    report = summary(budgets, ladder)
    assert report["episodes"] == sum(b.budget for b in budgets) < report["uniform_episodes"] == 24
    assert report["exhausted"] >= 1 and report["settled_at"]["2"] >= 1


def test_environment_failures_are_not_counted_as_failures():
    tasks = [Task("t", "x")]

    def run(tasks, per_task, level):
        # one success and one environment error per call: SR is 1/1, not 1/2
        return [Trajectory("t", "x", [], reward=1.0, status=Status.DONE),
                Trajectory("t", "x", [], status=Status.ENV_ERROR)][:per_task]

    _, (b,) = budgeted_rollouts(run, tasks, BudgetLadder((2, 4), (1.0, 0.5)))
    assert (b.level, b.episodes, b.successes) == (0, 1, 1)


@pytest.mark.parametrize("budgets, thresholds, match", [
    ((2, 2), (1.0, 0.5), "strictly increasing"), ((0, 2), (1.0, 0.5), "positive"),
    ((2, 4), (0.5, 1.0), "not increase"), ((2, 4), (1.0,), "equal length"), ((2,), (1.5,), r"\[0, 1\]")])
def test_bad_ladders_name_the_keys(budgets, thresholds, match):
    with pytest.raises(ValueError, match=match) as err:
        BudgetLadder(budgets, thresholds)
    assert "evocua." in str(err.value)


def test_a_recipe_with_a_bad_ladder_fails_before_it_runs():
    from guijax import launch
    from guijax.methods import get_method

    config = launch.resolve("evocua_cpu", ["evocua.budgets=(4, 2, 8)"])
    with pytest.raises(ValueError, match=r"evocua.budgets \(4, 2, 8\) must be positive and strictly increasing"):
        get_method("evocua", config)
