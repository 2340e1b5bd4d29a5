"""The hook every method plugs into the shared trainer loop.

`observe(task, rollouts)` sees the raw on-policy group (to update replay buffers or caches);
`assemble(task, rollouts)` returns the group that is trained on (possibly with injected trajectories).
Hooks keep their own JSON-serialisable state, checkpointed with the run. GRPO is the identity hook.
"""
from __future__ import annotations

from typing import Any, Protocol, Sequence

from envs.api import Task
from guijax.rollout.trajectory import Trajectory


class Algorithm(Protocol):
    name: str

    def observe(self, task: Task, rollouts: Sequence[Trajectory]) -> None: ...

    def assemble(self, task: Task, rollouts: Sequence[Trajectory]) -> list[Trajectory]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def metrics(self) -> dict[str, float]:
        """Counters since the last call (injections, cache updates), logged with the iteration."""
        ...


class GRPO:
    """Plain group-relative policy optimisation: train on the on-policy group as it is."""

    name = "grpo"

    def observe(self, task: Task, rollouts: Sequence[Trajectory]) -> None:
        return None

    def assemble(self, task: Task, rollouts: Sequence[Trajectory]) -> list[Trajectory]:
        return list(rollouts)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            raise ValueError(f"GRPO has no state, got keys {sorted(state)}")

    def metrics(self) -> dict[str, float]:
        return {}


def _registry() -> dict[str, Any]:
    from guijax.algorithms.arpo import ARPO
    from guijax.algorithms.bepa import BEPA
    from guijax.algorithms.expert_mix import LUFFY, RLPlusSFT, TraceReplacement

    return {"grpo": GRPO, "arpo": ARPO, "bepa": BEPA, "trace_replacement": TraceReplacement, "luffy": LUFFY,
            "rl_sft": RLPlusSFT}


def algorithm_names() -> list[str]:
    return sorted(_registry())


def make_algorithm(name: str, **kwargs: Any) -> Algorithm:
    """kwargs: the hook's own options (from `config.algorithm`), plus `store` (a TrajectoryStore for hooks that
    checkpoint trajectories) and `expert_traces` ({task id: converted trace}) for hooks that use them; hooks
    ignore the shared keys they do not take."""
    registry = _registry()
    if name not in registry:
        raise ValueError(f"unknown algorithm {name!r}; available: {sorted(registry)}")
    cls = registry[name]
    import inspect

    params = {} if cls.__init__ is object.__init__ else inspect.signature(cls.__init__).parameters
    takes_any = any(p.kind == p.VAR_KEYWORD for p in params.values())
    shared = {"store", "expert_traces", "seed"}
    unknown = [k for k in kwargs if k not in params and k not in shared and not takes_any]
    if unknown:
        raise ValueError(f"algorithm {name!r} has no option(s) {unknown}; it takes "
                         f"{[p for p in params if p not in ('self',)]}")
    return cls(**{k: v for k, v in kwargs.items() if k in params or takes_any})
