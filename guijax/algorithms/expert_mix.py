"""Baselines that mix converted expert traces (BEPA's D_conv) into GRPO groups (bepa.txt §5.1):

- Trace Replacement: on a group with no success, the static D_conv trace replaces the first failed rollout.
- LUFFY: the off-policy trace is always added to the group; train with `train.loss = "luffy"` (policy
  shaping γ, off-policy ratio without π_old).
- RL+SFT: the trace is added for a cross-entropy term only (`train.sft_coef` = λ): it takes no part in the
  group's advantages (`meta["sft_only"]`), so GRPO sees the on-policy group unchanged.

Expert traces are fixed inputs (rebuilt from the run's expert stage), so these hooks have no state to save.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

from envs.api import Task
from guijax.rollout.trajectory import Source, Trajectory


class _ExpertHook:
    name = "expert"

    def __init__(self, expert_traces: Mapping[str, Trajectory] | None = None, **_: Any):
        self.expert_traces = dict(expert_traces or {})
        self._used = 0

    def observe(self, task: Task, rollouts: Sequence[Trajectory]) -> None:
        return None

    def _trace(self, task: Task) -> Trajectory | None:
        t = self.expert_traces.get(task.id)
        if t is None:
            return None
        self._used += 1
        return dataclasses.replace(t, source=Source.EXPERT)

    def metrics(self) -> dict[str, float]:
        out = {"expert_injections": float(self._used)}
        self._used = 0
        return out

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None


class TraceReplacement(_ExpertHook):
    name = "trace_replacement"

    def assemble(self, task: Task, rollouts: Sequence[Trajectory]) -> list[Trajectory]:
        group = list(rollouts)
        if not group or any(t.success for t in group):
            return group
        trace = self._trace(task)
        if trace is not None:
            group[0] = trace
        return group


class LUFFY(_ExpertHook):
    name = "luffy"

    def assemble(self, task: Task, rollouts: Sequence[Trajectory]) -> list[Trajectory]:
        trace = self._trace(task)
        return list(rollouts) + ([trace] if trace is not None else [])


class RLPlusSFT(_ExpertHook):
    name = "rl_sft"

    def assemble(self, task: Task, rollouts: Sequence[Trajectory]) -> list[Trajectory]:
        trace = self._trace(task)
        if trace is None:
            return list(rollouts)
        return list(rollouts) + [dataclasses.replace(trace, meta=dict(trace.meta, sft_only=True))]
