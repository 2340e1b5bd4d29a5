"""The evolution cycle's bookkeeping (EvoCUA §5): the success each round's policy starts from, measured on the
episodes every task gets at the ladder's first budget (the later levels top up only the tasks the policy is
unsure of, so they would bias the rate), and the table and plot of the rounds."""
from __future__ import annotations

import pathlib
from collections import defaultdict
from typing import Any, Sequence

from guijax.rollout.trajectory import Status, Trajectory


def first_level_success(rollouts: Sequence[Trajectory], first_budget: int) -> tuple[float, int]:
    """(mean per-task success rate, tasks) over each task's first `first_budget` episodes that ran, in the
    order `budgeted_rollouts` returns them (task by task, level by level)."""
    by_task: dict[str, list[Trajectory]] = defaultdict(list)
    for t in rollouts:
        by_task[t.task_id].append(t)
    rates = []
    for episodes in by_task.values():
        ran = [t for t in episodes[:first_budget] if t.status != Status.ENV_ERROR]
        if ran:
            rates.append(sum(t.success for t in ran) / len(ran))
    return (sum(rates) / len(rates) if rates else 0.0), len(rates)


def rounds_table(reports: Sequence[dict[str, Any]]) -> str:
    """A markdown table, one line per round: the success it started from and what it trained on."""
    lines = ["| round | start success (first budget) | of it: train / synthesized | episodes (uniform) "
             "| tasks with a success | RFT trajectories | step-DPO pairs (correction + reflection) |",
             "|---|---|---|---|---|---|---|"]
    for r in reports:
        pairs = (f"{r.get('dpo_action_correction_pairs', 0)} + {r.get('dpo_reflection_pairs', 0)}"
                 if "dpo_failures" in r else "–")
        split = (f"{100 * r['start_success_train']:.1f}% / " + (f"{100 * r['start_success_synthesized']:.1f}%"
                                                                if "start_success_synthesized" in r else "–")
                 if "start_success_train" in r else "–")
        lines.append(f"| {r['round']} | {100 * r['start_success']:.1f}% ({r['tasks']} tasks) | {split} | {r['episodes']} "
                     f"({r['uniform_episodes']}) | {r['tasks_with_success']} | {r.get('rft_trajectories', '–')} "
                     f"| {pairs} |")
    return "\n".join(lines)


def plot_rounds(reports: Sequence[dict[str, Any]], path: str | pathlib.Path) -> pathlib.Path:
    """The success each round starts from, and the episodes the ladder spent against the uniform budget."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = pathlib.Path(path)
    rounds = [r["round"] for r in reports]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4))
    left.plot(rounds, [100 * r["start_success"] for r in reports], marker="o")
    left.set_xlabel("round (policy at its start)")
    left.set_ylabel("success, first budget (%)")
    left.set_ylim(-2, 102)
    left.set_xticks(rounds)
    right.bar([x - 0.2 for x in rounds], [r["episodes"] for r in reports], width=0.4, label="ladder")
    right.bar([x + 0.2 for x in rounds], [r["uniform_episodes"] for r in reports], width=0.4, label="uniform top budget")
    right.set_xlabel("round")
    right.set_ylabel("episodes")
    right.set_xticks(rounds)
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
