"""Expert traces -> trajectories in the policy's action grammar (BEPA's D_conv): each framework step's actions
rendered as UI-TARS's `Thought: ... Action: ...` (or computer_use's reasoning, semantic action and tool call)
with a thought written from the S2 action, screenshots kept.

Two thought styles. "terse" is the one the desk's SFT warm start teaches, so converted traces are close to
what the base policy writes itself. "verbose" writes each thought the way a framework's worker narrates
its step (Agent S2-like), which the base policy has never seen: converted traces then carry BEPA's
distribution gap (low-probability thought tokens) while their actions stay the same."""
from __future__ import annotations

from typing import Callable

from envs.actions import parse_s2
from envs.actions.grammar import render_response
from envs.desk.expert import ExpertTrace
from guijax.evocua.hindsight import semantic_action
from guijax.rollout.trajectory import Source, Status, Step, Trajectory

THOUGHT_STYLES = ("terse", "verbose")


def _input(a: dict) -> str:
    return f"the input {a['element_description']}" if a.get("element_description") else "the focused input"


# action name -> (terse thought, verbose thought), each from the S2 action's arguments
_THOUGHTS: dict[str, tuple[Callable[[dict], str], Callable[[dict], str]]] = {
    "click": (lambda a: f"I should click {a['element_description']}.",
              lambda a: f"Looking at the current screen, I can see {a['element_description']}. To make progress on "
                        "the task, the next step is to click on it."),
    "type": (lambda a: f"I need to type \"{a.get('text', '')}\"" + (f" into {a['element_description']}."
                                                                     if a.get("element_description") else "."),
             lambda a: f"Now {_input(a)} is available. I will enter the text "
                       f"\"{a.get('text', '')}\" so that it holds the required value."),
    "scroll": (lambda a: f"The item is not visible yet, so I scroll {a['element_description']}.",
               lambda a: "The element I need is not visible on the current screen. I will scroll "
                         f"{a['element_description']} to reveal it."),
    "hotkey": (lambda a: f"I press {'+'.join(a['keys'])}.",
               lambda a: f"A keyboard shortcut is the quickest way here, so I will press {'+'.join(a['keys'])}."),
    "drag_and_drop": (lambda a: f"I drag {a['starting_description']} to {a['ending_description']}.",
                      lambda a: f"I need to move {a['starting_description']} onto {a['ending_description']}, "
                                "so I will drag it there."),
    "done": (lambda a: "The task is complete.",
             lambda a: "All the required changes are visible on the screen now, so the task has been completed "
                       "successfully."),
    "fail": (lambda a: "This cannot be done here, so the task is infeasible.",
             lambda a: "After checking the screen, this request cannot be carried out in this application, so I "
                       "will report it as infeasible."),
}


def thought_for(s2_text: str, style: str = "terse") -> str:
    if style not in THOUGHT_STYLES:
        raise ValueError(f"unknown thought style {style!r}; expected one of {THOUGHT_STYLES}")
    action = parse_s2(s2_text)
    voices = _THOUGHTS.get(action.name)
    if voices is None:
        return f"Next: {action.name}." if style == "terse" else f"The next step is the {action.name} action."
    return voices[THOUGHT_STYLES.index(style)](action.args)


def convert_trace(trace: ExpertTrace, model: str = "uitars-1.5", thought_style: str = "terse",
                  grammar: str = "uitars") -> Trajectory:
    """`grammar`: the one the policy is prompted to write (envs.actions.grammar), so expert steps train the same
    format as its own rollouts."""
    steps = []
    for s in trace.steps:
        hw = s.screenshot.shape[:2]
        response = render_response(thought_for(s.s2, thought_style), semantic_action(s.s2), s.actions,
                                   grammar=grammar, screen_hw=hw, coordinate_model=model)
        steps.append(Step.text(s.screenshot, response))
    status = Status.DONE if trace.reward > 0.5 else Status.STEP_LIMIT
    meta: dict = {"plan": trace.plan}
    injected = [i for i, s in enumerate(trace.steps) if s.injected]
    if injected:
        meta["injected_steps"] = injected  # the noise's actions, which sft.noisy_steps='mask' trains on nothing
    return Trajectory(trace.task_id, trace.instruction, steps, trace.reward, status, Source.EXPERT, meta=meta)

