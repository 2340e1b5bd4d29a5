"""ARPO (arpo.txt): GRPO on the valuable tasks (§3.4: those the base policy solves at least once in
`arpo.selection_rollouts` rollouts, chosen by the `select` stage) with experience replay (§3.3): a per-task
FIFO of successful trajectories; a group that is all failure gets one failed rollout replaced by a random
buffered success, so it has a non-zero advantage."""
from __future__ import annotations

import dataclasses
import json
import random
from typing import Any, Sequence

import numpy as np

from envs.api import Task
from guijax.data.store import TrajectoryStore
from guijax.methods.base import Context, IdentityHook, Method
from guijax.methods.persist import TrajectoryBank
from guijax.rng import Streams
from guijax.schema import ranged
from guijax.rollout.trajectory import Source, Trajectory


@dataclasses.dataclass(frozen=True)
class ARPOOptions:
    """`arpo`: replay buffer size, the select stage's rollouts per task, and whether to train on its choice."""

    buffer_size: int = ranged(8, low=1)  # successes kept per task (FIFO)
    selection_rollouts: int = ranged(16, low=1)  # select stage: base-policy rollouts per task (ARPO §3.4: 16)
    task_selection: bool = True  # train on the valuable tasks only (False: the selection ablation)


class ReplayHook(IdentityHook):
    def __init__(self, buffer_size: int = 8, success_threshold: float = 0.1, std_threshold: float = 0.05,
                 mean_threshold: float = 0.2, seed: int = 0, store: TrajectoryStore | None = None):
        """Thresholds are those of the paper's code: a success has reward > 0.1; a group counts as all
        failure when its reward std < 0.05 and mean < 0.2."""
        if buffer_size < 1:
            raise ValueError(f"ARPO buffer_size must be >= 1, got {buffer_size}")
        self.buffer_size, self.success_threshold = buffer_size, success_threshold
        self.std_threshold, self.mean_threshold = std_threshold, mean_threshold
        self.seed, self.draws = seed, 0
        self.buffers: dict[str, list[Trajectory]] = {}
        self.bank = TrajectoryBank(store)
        self._replaced = 0

    def _rng(self) -> random.Random:
        self.draws += 1
        return Streams(self.seed).python("draw", self.draws)

    def observe(self, task: Task, rollouts: Sequence[Trajectory]) -> None:
        buf = self.buffers.setdefault(task.id, [])
        for t in rollouts:
            if t.source == Source.ON_POLICY and t.reward > self.success_threshold:
                buf.append(t)
        del buf[:max(0, len(buf) - self.buffer_size)]  # FIFO: the oldest go first

    def assemble(self, task: Task, rollouts: Sequence[Trajectory]) -> list[Trajectory]:
        group = list(rollouts)
        buf = self.buffers.get(task.id, [])
        if not group or not buf:
            return group
        rewards = np.asarray([t.reward for t in group], np.float64)
        if rewards.std() >= self.std_threshold or rewards.mean() >= self.mean_threshold:
            return group
        rng = self._rng()
        failed = [i for i, t in enumerate(group) if t.reward <= self.success_threshold]
        slot = rng.choice(failed) if failed else 0
        group[slot] = dataclasses.replace(rng.choice(buf), source=Source.REPLAY)
        self._replaced += 1
        return group

    def metrics(self) -> dict[str, float]:
        out = {"replay_injections": float(self._replaced),
               "replay_buffered": float(sum(len(b) for b in self.buffers.values()))}
        self._replaced = 0
        return out

    def state_dict(self) -> dict[str, Any]:
        refs = self.bank.refs(t for b in self.buffers.values() for t in b)
        return {"draws": self.draws, "buffers": {k: [refs[id(t)] for t in b] for k, b in self.buffers.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.draws = int(state["draws"])
        self.buffers = {k: [self.bank.load(i) for i in v] for k, v in state["buffers"].items()}


def valuable_tasks(ctx: Context, tasks: Sequence[Task]) -> list[Task]:
    """The training tasks the select stage kept (solved at least once in its rollouts)."""
    selected = ctx.run_dir / "valuable_tasks.json"
    if not selected.exists():
        raise FileNotFoundError(f"ARPO trains on the valuable tasks in {selected}: add the 'select' stage to "
                                "config.stages before the stage that trains it")
    keep = set(json.loads(selected.read_text())["valuable"])
    kept = [t for t in tasks if t.id in keep]
    if not kept:
        raise ValueError(f"the select stage kept no training task ({selected}: the base policy solved none in "
                         "its rollouts); nothing for ARPO to train on")
    return kept


class ARPO(Method):
    name = "arpo"
    summary = "ARPO: GRPO with per-task success replay on the valuable tasks"
    section = "arpo"
    options_class = ARPOOptions
    requires = ("select",)

    def hook(self, ctx: Context) -> ReplayHook:
        return ReplayHook(self.options.buffer_size, seed=ctx.streams.seed_for("replay"),
                          store=TrajectoryStore(ctx.workdir / "algorithm_trajectories"))

    def training_tasks(self, ctx: Context, tasks: Sequence[Task]) -> list[Task]:
        return valuable_tasks(ctx, tasks) if self.options.task_selection else list(tasks)
