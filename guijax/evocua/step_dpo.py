"""Step-level DPO at critical forking points (EvoCUA §5.3, Fig. 5, Eq. 2).

For a failed rollout τ⁻ and a successful reference τ⁺ of the same task, the critical deviation step t* is
the first step of τ⁻ whose state matches a reference state (within a window of w steps) while its action
differs from the reference's there; steps whose actions agree are followed past. Who says two states match
is a `StateMatcher`: by default the screenshots must be equal, the environment's ground truth on the desk; off
the desk (a real screen's pointer, caret and clock move) the paper's VLM aligner does it,
`guijax.evocua.chat_roles.ChatStateAligner`.

Two preference pairs come out of it, each scored on one step with τ⁻'s own history as context:
- Pair I (action correction, at t*): the reference's response (thought and action, migrated from the
  aligned step) preferred over τ⁻'s.
- Pair II (reflection and recovery, at t*+1): a reflection that notices the screen did not move toward the
  goal and takes the recovering action, preferred over τ⁻'s blind continuation. The offline synthesiser
  knows the recovering action only where the erroneous action changed nothing (the state at t*+1 is the state
  at t*, so the reference's action still applies); elsewhere no Pair II is made.
"""
from __future__ import annotations

import dataclasses
import random
from typing import Any, Callable, Sequence

import numpy as np

from envs.actions.uitars import parse_thought
from guijax.evocua.denoise import action_part
from guijax.rollout.trajectory import Source, Step, Trajectory


@dataclasses.dataclass(frozen=True)
class Deviation:
    """t* in the failed rollout and the aligned step of the reference."""

    step: int
    reference_step: int


@dataclasses.dataclass(frozen=True)
class StepPair:
    """Chosen and rejected trajectories that share their history and differ in their last step, the one
    scored. `kind` is "action_correction" (Pair I) or "reflection" (Pair II)."""

    chosen: Trajectory
    rejected: Trajectory
    kind: str
    task_id: str


def same_state(a: Step, b: Step) -> bool:
    return a.screenshot.shape == b.screenshot.shape and np.array_equal(a.screenshot, b.screenshot)


# (instruction, a step of the failed rollout, a step to compare it with) -> whether their states are equivalent
StateMatcher = Callable[[str, Step, Step], bool]


def exact_match(instruction: str, a: Step, b: Step) -> bool:
    """States are equivalent when the screenshots are equal: exact on the desk, where the screen is the state."""
    return same_state(a, b)


def same_action(a: Step, b: Step) -> bool:
    """Equal parsed actions (an unparsable step agrees with nothing)."""
    return bool(a.actions) and list(a.actions) == list(b.actions)


def critical_deviation(failed: Trajectory, reference: Trajectory, window: int = 2,
                       match: StateMatcher = exact_match) -> Deviation | None:
    """The first step of `failed` whose state the reference also reached (within `window` steps of it) and
    where the two act differently; None when the rollouts part without such a step (a state the reference
    never showed, or every matched step agreeing). The matcher is asked as few times as the answer needs (a
    model aligner is a call each): first the reference steps that act as this step does, then the others
    nearest first."""
    for t, step in enumerate(failed.steps):
        lo, hi = max(0, t - window), min(len(reference.steps), t + window + 1)
        nearest = sorted(range(lo, hi), key=lambda j: (abs(j - t), j))
        agreeing = [j for j in nearest if same_action(step, reference.steps[j])]
        if any(match(failed.instruction, step, reference.steps[j]) for j in agreeing):
            continue
        aligned = next((j for j in nearest if j not in agreeing and match(failed.instruction, step, reference.steps[j])),
                       None)
        return None if aligned is None else Deviation(t, aligned)
    return None


def _prefix(trajectory: Trajectory, last: Step, length: int, kind: str) -> Trajectory:
    """`trajectory`'s first `length` steps followed by `last`: the history of a scored step, then the step."""
    return dataclasses.replace(trajectory, steps=list(trajectory.steps[:length]) + [last], source=Source.ON_POLICY,
                               meta=dict(trajectory.meta, step_dpo=kind))


def reflection_response(failed_step: Step, reference_step: Step, thought: str | None = None) -> str:
    """The reflection step's response: `thought` (a writer's, e.g. guijax.evocua.chat_roles') or the offline
    one (what went wrong: the last action left the screen unchanged; the remedy: the reference's reasoning),
    then the reference's action."""
    if thought is None:
        tried = action_part(failed_step.response).removeprefix("Action:").strip() or "the previous action"
        remedy = parse_thought(reference_step.response)
        thought = (f"The screen is exactly as it was before my last action ({tried}), so that action did not move "
                   f"the task forward. I need a different step here." + (f" {remedy}" if remedy else ""))
    return f"Thought: {thought}\n{action_part(reference_step.response)}"


# (instruction, the erring step, the reference's aligned step, the screen now) -> a thought, or None for the offline one
Reflector = Callable[[str, Step, Step, Any], "str | None"]


def step_pairs(failed: Trajectory, reference: Trajectory, window: int = 2, reflection: bool = True,
               reflect: Reflector | None = None, match: StateMatcher = exact_match) -> list[StepPair]:
    """Pair I at t* and, where the recovery is known, Pair II at t*+1 (see the module docstring)."""
    found = critical_deviation(failed, reference, window, match)
    if found is None:
        return []
    t, j = found.step, found.reference_step
    wrong, right = failed.steps[t], reference.steps[j]
    corrected = dataclasses.replace(right, screenshot=wrong.screenshot)
    pairs = [StepPair(_prefix(failed, corrected, t, "action_correction"), _prefix(failed, wrong, t, "action_correction"),
                      "action_correction", failed.task_id)]
    blind = failed.steps[t + 1] if t + 1 < len(failed.steps) else None
    if (reflection and blind is not None and not same_action(blind, right)
            and match(failed.instruction, blind, wrong)):
        thought = reflect(failed.instruction, wrong, right, blind.screenshot) if reflect else None
        recover = Step.text(blind.screenshot, reflection_response(wrong, right, thought), right.actions)
        pairs.append(StepPair(_prefix(failed, recover, t + 1, "reflection"), _prefix(failed, blind, t + 1, "reflection"),
                              "reflection", failed.task_id))
    return pairs


def mine_pairs(rollouts: Sequence[Trajectory], window: int = 2, reflection: bool = True,
               seed: int = 0, reflect: Reflector | None = None,
               match: StateMatcher = exact_match) -> tuple[list[StepPair], dict]:
    """Step pairs from every failed rollout that has a successful reference of its task (one drawn at random
    per failure), and counts of what was found."""
    rng = random.Random(seed)
    by_task: dict[str, list[Trajectory]] = {}
    for t in rollouts:
        if t.steps:
            by_task.setdefault(t.task_id, []).append(t)
    pairs: list[StepPair] = []
    failures = with_reference = 0
    for task_id in sorted(by_task):
        wins = [t for t in by_task[task_id] if t.success]
        for failed in (t for t in by_task[task_id] if not t.success):
            failures += 1
            if not wins:
                continue
            with_reference += 1
            pairs.extend(step_pairs(failed, rng.choice(wins), window, reflection, reflect, match))
    counts = {"failures": failures, "failures_with_reference": with_reference,
              "action_correction_pairs": sum(p.kind == "action_correction" for p in pairs),
              "reflection_pairs": sum(p.kind == "reflection" for p in pairs)}
    return pairs, counts
