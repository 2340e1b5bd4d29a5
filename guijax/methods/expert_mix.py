"""Baselines that mix converted expert traces (BEPA's D_conv) into GRPO groups (bepa.txt §5.1):

- Trace Replacement: on a group with no success, the static D_conv trace replaces the first failed rollout.
- LUFFY: the off-policy trace is always added to the group and trained with the LUFFY loss (policy shaping
  γ = `luffy.gamma`, off-policy ratio without π_old).
- RL+SFT: the trace joins the batch for a cross-entropy term only (λ = `rl_sft.coef`): it is an auxiliary
  row, with no part in the group's advantages, so GRPO sees the on-policy group unchanged.

Expert traces are fixed inputs (rebuilt from the run's expert stage), so these hooks have no state to save.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

from envs.api import Task
from guijax import objectives
from guijax.methods.base import Context, IdentityHook, Method
from guijax.schema import ranged
from guijax.rollout.trajectory import Source, Trajectory


class _ExpertHook(IdentityHook):
    def __init__(self, expert_traces: Mapping[str, Trajectory] | None = None):
        self.expert_traces = dict(expert_traces or {})
        self._used = 0

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


class ReplacementHook(_ExpertHook):

    def assemble(self, task: Task, rollouts: Sequence[Trajectory]) -> list[Trajectory]:
        group = list(rollouts)
        if not group or any(t.success for t in group):
            return group
        trace = self._trace(task)
        if trace is not None:
            group[0] = trace
        return group


class AppendHook(_ExpertHook):

    def assemble(self, task: Task, rollouts: Sequence[Trajectory]) -> list[Trajectory]:
        trace = self._trace(task)
        return list(rollouts) + ([trace] if trace is not None else [])


class AuxiliaryHook(_ExpertHook):
    def auxiliary(self, task: Task) -> list[Trajectory]:
        trace = self._trace(task)
        return [trace] if trace is not None else []


@dataclasses.dataclass(frozen=True)
class LuffyOptions:
    """`luffy`: γ of the policy shaping f(w) = w / (w + γ) (BEPA App. E.3)."""

    gamma: float = ranged(0.1, low=0, low_open=True)


@dataclasses.dataclass(frozen=True)
class RLSFTOptions:
    """`rl_sft`: λ of the cross-entropy term on the D_conv rows."""

    coef: float = ranged(1.0, low=0)


class _ExpertMethod(Method):
    requires = ("expert",)
    hook_class: type[_ExpertHook] = ReplacementHook

    def hook(self, ctx: Context) -> _ExpertHook:
        return self.hook_class(ctx.expert_traces())


class TraceReplacement(_ExpertMethod):
    name = "trace_replacement"
    summary = "Trace Replacement: a D_conv trace replaces the first rollout of an all-failure group"


class LUFFY(_ExpertMethod):
    name = "luffy"
    summary = "LUFFY: the D_conv trace added to every group, trained with policy shaping"
    section = "luffy"
    options_class = LuffyOptions
    losses = ("luffy",)
    hook_class = AppendHook

    def loss(self) -> Any:
        return objectives.LuffyLoss(objectives.clip_config(self.config.train), self.options.gamma)


class RLPlusSFT(_ExpertMethod):
    name = "rl_sft"
    summary = "RL+SFT: GRPO plus λ·cross-entropy on the task's D_conv trace"
    section = "rl_sft"
    options_class = RLSFTOptions
    hook_class = AuxiliaryHook

    def loss(self) -> Any:
        return objectives.WithCrossEntropy(super().loss(), self.options.coef)
