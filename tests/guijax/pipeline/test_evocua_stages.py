"""The budget stage on the tiny recipe: the base policy's episodes per task follow the ladder, every episode is
kept for the EvoCUA methods, and budget.json accounts for them."""
from __future__ import annotations

import json

from guijax.data.store import TrajectoryStore
from guijax.pipeline.registry import run_stages


def test_budget_stage_climbs_the_ladder_for_unsolved_tasks(tiny_config, tmp_path):
    config = tiny_config("grpo_cpu", "stages=('base_model', 'tasks', 'budget')", "evocua.budgets=(1, 3)",
                         "evocua.thresholds=(1.0, 0.5)")
    run_stages(config, tmp_path / "run")
    report = json.loads((tmp_path / "run" / "budget.json").read_text())
    episodes = list(TrajectoryStore(tmp_path / "run" / "budget_rollouts"))
    tasks = report["tasks"]
    assert tasks and sum(t["budget"] for t in tasks.values()) == report["episodes"] == len(episodes)
    assert report["uniform_episodes"] == 3 * len(tasks)
    for task_id, t in tasks.items():
        mine = [e for e in episodes if e.task_id == task_id]
        assert len(mine) == t["budget"] and t["successes"] == sum(e.success for e in mine)
        # solved in its one episode: settled at k_1; otherwise topped up to k_2 = 3
        assert t["budget"] == (1 if t["level"] == 0 else 3)
    assert report["exhausted"] == sum(t["level"] is None for t in tasks.values())
