"""EvoCUA's stages:

    budget   dynamic compute budgeting (evocua.txt §5.2, Eq. 1): the base policy rolls each training task out
             k_1 times and is topped up the ladder while its success rate stays under τ_i; every episode is
             kept for the EvoCUA methods (RFT on the successes, step-level DPO on the failures)
"""
from __future__ import annotations

import json

from envs.atomic import write_text_atomic
from guijax.pipeline.base_stages import BASE_POLICY, ROLLOUT_READS, policy_dir
from guijax.pipeline.expert_stages import _write_shard
from guijax.pipeline.run import Run
from guijax.pipeline.stage import output_exists, stage


def _ladder(run: Run):
    from guijax.evocua.budget import BudgetLadder

    return BudgetLadder(tuple(run.config.evocua.budgets), tuple(run.config.evocua.thresholds))


@stage("budget", lambda run: f"budgeted base-policy rollouts per training task: ladder "
       f"{tuple(run.config.evocua.budgets)} at success thresholds {tuple(run.config.evocua.thresholds)}",
       done=output_exists("budget.json"), reads=ROLLOUT_READS + ("evocua.budgets", "evocua.thresholds"),
       needs=BASE_POLICY + ("tasks", "bepa_splits"), outputs=("budget.json", "budget_rollouts"))
def budget(run: Run) -> str:
    """Eq. 1 over the training split; budget.json records each task's K*, level and success rate."""
    from guijax.evocua import budget as lib

    ladder = _ladder(run)
    policy = run.load_policy(policy_dir(run))
    engine = run.engine(policy, run.config.rollout.temperature)
    train = run.tasks()["train"]

    def episodes(tasks, per_task: int, level: int):
        rollouts, _ = engine.run(policy.params, tasks, per_task, run.streams.key("budget", "sampling", level),
                                 seed=run.streams.seed_for("budget", "episodes", level), desc=f"budget k{level + 1}")
        return rollouts

    rollouts, budgets = lib.budgeted_rollouts(episodes, train, ladder)
    _write_shard(run.workdir / "budget_rollouts", "rollouts", rollouts)
    report = lib.summary(budgets, ladder)
    report["tasks"] = {b.task_id: {"budget": b.budget, "level": b.level, "episodes": b.episodes,
                                   "successes": b.successes, "success_rate": round(b.success_rate, 4)}
                       for b in budgets}
    write_text_atomic(run.workdir / "budget.json", json.dumps(report, indent=1))
    return (f"{report['episodes']} episodes instead of {report['uniform_episodes']} at the top budget "
            f"({100 * report['saved_fraction']:.0f}% saved); {report['tasks_with_success']}/{len(train)} tasks with a "
            f"success; {report['exhausted']} spent the whole ladder")
