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


ALGORITHMS = {"grpo": GRPO}


def make_algorithm(name: str, **kwargs: Any) -> Algorithm:
    if name not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {name!r}; available: {sorted(ALGORITHMS)}")
    return ALGORITHMS[name](**kwargs)
