"""Step-level denoising: steps that leave the screen unchanged leave the loss (but not the history), the last
step always stays, and a solved infeasible task is reduced to its reasoning and its terminate action."""
from __future__ import annotations

import numpy as np

from guijax.evocua.denoise import denoise, reasoning_only, redundant_steps
from guijax.rollout.trajectory import Status, Step, Trajectory


def _screen(v: int) -> np.ndarray:
    return np.full((4, 4, 3), v, np.uint8)


def _step(v: int, response: str) -> Step:
    return Step(_screen(v), response, np.zeros(0, np.int32), np.zeros(0, np.float32), [response])


def _trajectory(task_id: str, screens: list[int], responses: list[str] | None = None) -> Trajectory:
    responses = responses or [f"Thought: step {i}.\nAction: click({i})" for i in range(len(screens))]
    return Trajectory(task_id, "do it", [_step(v, r) for v, r in zip(screens, responses)], reward=1.0,
                      status=Status.DONE)


def test_steps_that_change_nothing_are_redundant_and_the_last_never_is():
    # step 0 leaves screen 1 as it was; step 3 leaves screen 3; step 4 ends the episode
    traj = _trajectory("t", [1, 1, 2, 3, 3])
    assert redundant_steps(traj) == [True, False, False, True, False]


def test_denoise_masks_redundant_steps_and_keeps_them_as_history():
    traj = _trajectory("t", [1, 1, 2])
    out = denoise([traj], infeasible_ids=set())
    assert out.trajectories == [traj]  # the episode is kept whole: later steps still see the redundant one
    assert [(r.trajectory, r.step) for r in out.refs] == [(0, 1), (0, 2)]
    assert (out.masked_steps, out.total_steps) == (1, 3)


def test_infeasible_successes_keep_only_reasoning_and_the_final_action():
    traj = _trajectory("inf", [1, 2, 3], ["Thought: open the menu.\nAction: click(1)",
                                          "Thought: no such option exists.\nAction: click(2)",
                                          "Thought: it cannot be done.\nAction: FAIL"])
    kept = reasoning_only(traj)
    (step,) = kept.steps
    assert step.response == ("Thought: open the menu. no such option exists. it cannot be done.\nAction: FAIL")
    assert np.array_equal(step.screenshot, _screen(1)) and len(step.response_tokens) == 0
    out = denoise([traj, _trajectory("ok", [1, 2])], infeasible_ids={"inf"})
    assert [len(t.steps) for t in out.trajectories] == [1, 2]
    assert [(r.trajectory, r.step) for r in out.refs] == [(0, 0), (1, 0), (1, 1)]
    assert (out.masked_steps, out.total_steps) == (2, 5)
