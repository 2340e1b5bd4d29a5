"""Expert traces -> UI-TARS-format trajectories (BEPA's D_conv): each framework step's actions rendered as
`Thought: ... Action: ...` with a thought written from the S2 action, screenshots kept."""
from __future__ import annotations

from envs.actions import parse_s2, render_uitars
from envs.desk.expert import ExpertTrace
from guijax.rollout.trajectory import Source, Status, Step, Trajectory


def thought_for(s2_text: str) -> str:
    action = parse_s2(s2_text)
    a = action.args
    if action.name == "click":
        return f"I should click {a['element_description']}."
    if action.name == "type":
        target = f" into {a['element_description']}" if a.get("element_description") else ""
        return f"I need to type \"{a.get('text', '')}\"{target}."
    if action.name == "scroll":
        return f"The item is not visible yet, so I scroll {a['element_description']}."
    if action.name == "hotkey":
        return f"I press {'+'.join(a['keys'])}."
    if action.name == "drag_and_drop":
        return f"I drag {a['starting_description']} to {a['ending_description']}."
    if action.name == "done":
        return "The task is complete."
    if action.name == "fail":
        return "This cannot be done here, so the task is infeasible."
    return f"Next: {action.name}."


def convert_trace(trace: ExpertTrace, model: str = "uitars-1.5") -> Trajectory:
    steps = []
    for s in trace.steps:
        hw = s.screenshot.shape[:2]
        response = render_uitars(s.actions, image_hw=hw, screen_hw=hw, model=model, thought=thought_for(s.s2))
        steps.append(Step(s.screenshot, response, response_tokens=_empty(), behaviour_logprobs=_empty(float)))
    status = Status.DONE if trace.reward > 0.5 else Status.STEP_LIMIT
    return Trajectory(trace.task_id, trace.instruction, steps, trace.reward, status, Source.EXPERT,
                      meta={"plan": trace.plan})


def _empty(kind=int):
    import numpy as np

    return np.zeros((0,), np.int32 if kind is int else np.float32)
