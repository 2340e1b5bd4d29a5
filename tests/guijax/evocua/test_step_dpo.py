"""Step-level DPO pairs: the critical deviation step is the first step at a state the reference shares where
the actions differ; Pair I migrates the reference's response onto the failure's history; Pair II is made only
where the wrong action changed nothing, so the reference's action still recovers."""
from __future__ import annotations

import numpy as np

from guijax.evocua.step_dpo import Deviation, critical_deviation, mine_pairs, step_pairs
from guijax.rollout.trajectory import Status, Step, Trajectory


def _step(screen: int, action: str, thought: str = "") -> Step:
    tokens = np.arange(3, dtype=np.int32)
    return Step(np.full((4, 4, 3), screen, np.uint8), f"Thought: {thought or action}.\nAction: {action}", tokens,
                np.zeros(3, np.float32), [action])


def _traj(steps: list[Step], success: bool, task_id: str = "t") -> Trajectory:
    return Trajectory(task_id, "open the file", steps, reward=1.0 if success else 0.0, status=Status.DONE)


REFERENCE = _traj([_step(1, "click(a)"), _step(2, "click(b)", "press the button b"), _step(3, "finished()")], True)


def test_the_deviation_is_the_first_differing_action_at_a_shared_state():
    failed = _traj([_step(1, "click(a)"), _step(2, "click(z)"), _step(2, "click(z)")], False)
    assert critical_deviation(failed, REFERENCE) == Deviation(1, 1)
    # a state the reference never showed ends the search: no pair from rollouts that part by chance
    parted = _traj([_step(1, "click(a)"), _step(9, "click(z)")], False)
    assert critical_deviation(parted, REFERENCE) is None
    # the window aligns a reference that took an extra step first
    slow = _traj([_step(0, "scroll()")] + list(REFERENCE.steps), True)
    late = _traj([_step(1, "click(q)")], False)
    assert critical_deviation(late, slow, window=1) == Deviation(0, 1)
    assert critical_deviation(late, slow, window=0) is None


def test_pair_one_corrects_the_action_and_pair_two_reflects():
    failed = _traj([_step(1, "click(a)"), _step(2, "click(z)"), _step(2, "click(z)")], False)
    correction, reflection = step_pairs(failed, REFERENCE)
    assert correction.kind == "action_correction" and reflection.kind == "reflection"
    # shared history (the failure's first step), the scored last step differs
    assert len(correction.chosen.steps) == len(correction.rejected.steps) == 2
    assert correction.chosen.steps[0] is failed.steps[0] and correction.rejected.steps[-1] is failed.steps[1]
    assert correction.chosen.steps[-1].actions == ["click(b)"]
    assert np.array_equal(correction.chosen.steps[-1].screenshot, failed.steps[1].screenshot)
    # Pair II at t*+1: the blind repeat rejected, the reflection (then the reference's action) chosen
    assert reflection.rejected.steps[-1] is failed.steps[2] and len(reflection.chosen.steps) == 3
    text = reflection.chosen.steps[-1].response
    assert "did not move the task forward" in text and "press the button b" in text and text.endswith("click(b)")
    assert len(reflection.chosen.steps[-1].response_tokens) == 0  # new text: tokenised by the pipeline


def test_no_reflection_where_the_wrong_action_changed_the_screen():
    failed = _traj([_step(1, "click(a)"), _step(2, "click(z)"), _step(7, "click(y)")], False)
    (only,) = step_pairs(failed, REFERENCE)
    assert only.kind == "action_correction"
    assert len(step_pairs(failed, REFERENCE, reflection=False)) == 1


def test_mining_pairs_failures_with_a_success_of_their_task():
    failed = _traj([_step(1, "click(a)"), _step(2, "click(z)"), _step(2, "click(z)")], False)
    orphan = _traj([_step(1, "click(x)")], False, task_id="other")
    pairs, counts = mine_pairs([REFERENCE, failed, orphan])
    assert counts == {"failures": 2, "failures_with_reference": 1, "action_correction_pairs": 1,
                      "reflection_pairs": 1}
    assert {p.task_id for p in pairs} == {"t"}
