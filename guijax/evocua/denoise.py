"""Step-level denoising of the successes rejection sampling keeps (EvoCUA §5.2): redundant steps leave the
loss (they stay in later steps' history, since the episode did pass through them), and a solved infeasible
task keeps only its reasoning and the final terminate=failure action.

The judge here is the environment's ground truth: a step whose action left the screen exactly as it was
(the next step's screenshot equals this one's) changed nothing the task can see, so it is redundant. The
desk renders all of its state, so on the desk this is exact."""
from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import numpy as np

from envs.actions.uitars import parse_thought
from guijax.data.pipeline import StepRef
from guijax.rollout.trajectory import Step, Trajectory


def redundant_steps(trajectory: Trajectory) -> list[bool]:
    """Per step: True when the step changed nothing on screen. The last step (the one that ends the
    episode) is never redundant."""
    steps = trajectory.steps
    return [i + 1 < len(steps) and np.array_equal(steps[i].screenshot, steps[i + 1].screenshot)
            for i in range(len(steps))]


def action_part(response: str) -> str:
    """The response from its (last) `Action:` on, '' when it has none."""
    at = response.rfind("Action:")
    return response[at:].strip() if at >= 0 else ""


def reasoning_only(trajectory: Trajectory) -> Trajectory:
    """A solved infeasible task as EvoCUA keeps it: one step on the first screenshot whose response is the
    episode's reasoning (every step's thought, in order) and its final action (the terminate=failure)."""
    thoughts = [t for t in (parse_thought(s.response) for s in trajectory.steps) if t]
    last = action_part(trajectory.steps[-1].response)
    response = (f"Thought: {' '.join(thoughts)}\n{last}" if thoughts else last).strip()
    step = Step.text(trajectory.steps[0].screenshot, response, trajectory.steps[-1].actions)
    return dataclasses.replace(trajectory, steps=[step], meta=dict(trajectory.meta, denoised="reasoning_only"))


@dataclasses.dataclass(frozen=True)
class Denoised:
    """The trajectories to train on, the steps of them that carry loss, and how many steps were masked."""

    trajectories: list[Trajectory]
    refs: list[StepRef]
    masked_steps: int
    total_steps: int


def denoise(successes: Sequence[Trajectory], infeasible_ids: set[str],
            judge: Callable[[Trajectory], list[bool]] = redundant_steps) -> Denoised:
    """The successes with their redundant steps (by `judge`: the screen's, or guijax.evocua.chat_roles'
    ChatDenoiser) out of the loss and infeasible tasks reduced to reasoning."""
    kept: list[Trajectory] = []
    refs: list[StepRef] = []
    masked = total = 0
    for traj in successes:
        if not traj.steps:
            continue
        total += len(traj.steps)
        if traj.task_id in infeasible_ids:
            masked += len(traj.steps) - 1
            kept.append(reasoning_only(traj))
            refs.append(StepRef(len(kept) - 1, 0, 1.0))
            continue
        kept.append(traj)
        flags = judge(traj)
        masked += sum(flags)
        refs.extend(StepRef(len(kept) - 1, j, 1.0) for j, redundant in enumerate(flags) if not redundant)
    return Denoised(kept, refs, masked, total)
