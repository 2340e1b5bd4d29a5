"""Dynamic compute budgeting (EvoCUA §5.2, Eq. 1): a ladder of rollout budgets k_1 < ... < k_n with
non-increasing success-rate thresholds τ_1 >= ... >= τ_n. Every task is rolled out k_1 times; a task whose
success rate SR(k_i) reaches τ_i stops there (K* = k_i), the others are topped up to k_{i+1}. Tasks the
policy solves easily cost k_1 episodes; the budget goes to the boundary tasks where it is unsure."""
from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

from envs.api import Task
from guijax.rollout.trajectory import Status, Trajectory

# run(tasks, episodes per task, level) -> the episodes, in (task, episode) order
RunEpisodes = Callable[[Sequence[Task], int, int], Sequence[Trajectory]]


@dataclasses.dataclass(frozen=True)
class BudgetLadder:
    budgets: tuple[int, ...] = (2, 4, 8)
    thresholds: tuple[float, ...] = (1.0, 0.5, 0.25)

    def __post_init__(self):
        b, t = tuple(self.budgets), tuple(self.thresholds)
        if not b or len(b) != len(t):
            raise ValueError(f"evocua.budgets {b} and evocua.thresholds {t} must be non-empty and of equal length")
        if b[0] < 1 or any(x >= y for x, y in zip(b, b[1:])):
            raise ValueError(f"evocua.budgets {b} must be positive and strictly increasing")
        if any(not 0 <= x <= 1 for x in t) or any(x < y for x, y in zip(t, t[1:])):
            raise ValueError(f"evocua.thresholds {t} must lie in [0, 1] and not increase (Eq. 1's descending τ_i)")


@dataclasses.dataclass(frozen=True)
class TaskBudget:
    """One task's outcome: the budget it settled at (K*), the ladder level (None: no threshold was met and
    the whole ladder was spent), and the episodes and successes that decided it."""

    task_id: str
    budget: int
    level: int | None
    episodes: int
    successes: int

    @property
    def success_rate(self) -> float:
        return self.successes / self.episodes if self.episodes else 0.0


def success_rate(rollouts: Sequence[Trajectory]) -> tuple[int, int]:
    """(successes, episodes) over the episodes that ran: an environment failure is no evidence either way."""
    ran = [t for t in rollouts if t.status != Status.ENV_ERROR]
    return sum(t.success for t in ran), len(ran)


def budgeted_rollouts(run: RunEpisodes, tasks: Sequence[Task],
                      ladder: BudgetLadder) -> tuple[list[Trajectory], list[TaskBudget]]:
    """Every episode the ladder asked for (task order, then level order) and each task's budget."""
    pending = list(tasks)
    by_task: dict[str, list[Trajectory]] = {t.id: [] for t in tasks}
    settled: dict[str, TaskBudget] = {}
    previous = 0
    for level, (k, tau) in enumerate(zip(ladder.budgets, ladder.thresholds)):
        if not pending:
            break
        per_task = k - previous
        episodes = list(run(pending, per_task, level))
        if len(episodes) != per_task * len(pending):
            raise ValueError(f"budget level {level}: {len(episodes)} episodes for {len(pending)} tasks x {per_task}")
        for i, task in enumerate(pending):
            by_task[task.id].extend(episodes[i * per_task:(i + 1) * per_task])
        still = []
        for task in pending:
            wins, ran = success_rate(by_task[task.id])
            if ran and wins / ran >= tau:
                settled[task.id] = TaskBudget(task.id, k, level, ran, wins)
            else:
                still.append(task)
        pending, previous = still, k
    for task in pending:  # the ladder is spent: K* = k_n
        wins, ran = success_rate(by_task[task.id])
        settled[task.id] = TaskBudget(task.id, ladder.budgets[-1], None, ran, wins)
    return [t for task in tasks for t in by_task[task.id]], [settled[t.id] for t in tasks]


def summary(budgets: Sequence[TaskBudget], ladder: BudgetLadder) -> dict:
    """What the ladder spent against the uniform budget k_n on every task, and where tasks settled."""
    spent = sum(b.budget for b in budgets)
    uniform = ladder.budgets[-1] * len(budgets)
    levels = {str(k): sum(b.level == i for b in budgets) for i, k in enumerate(ladder.budgets)}
    return {"episodes": spent, "uniform_episodes": uniform, "saved_fraction": 1 - spent / uniform if uniform else 0.0,
            "settled_at": levels, "exhausted": sum(b.level is None for b in budgets),
            "tasks_with_success": sum(b.successes > 0 for b in budgets)}
