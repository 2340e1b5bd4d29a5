"""SEAgent's World State Model as a trajectory judge (App. A, Fig. 8): whole trajectory in, structured
judgment out, and the step labels RL learns from (A.3).

Backends share one output, `Judgment`:

* `ChatWorldStateJudge`: an OpenAI-compatible vision model given the paper's Fig. 8 prompt and the episode's
  keyframes (the screen before each action, and the final screen when the caller has it), answering with
  reasoning and a `res_dict = {...}`; malformed answers are asked again, then refused with the reason.
* `DeskOracleJudge`: the synthetic desk's ground truth. Correctness is the verifier's; each step is replayed
  against the accessibility tree (`guijax.sgcd.desk_skills.step_verdicts`): a failed episode's first error
  is its first step off the task's path, redundant steps are actions repeated on an unchanged screen (and,
  in a successful episode, any step off the path).

Step labels (A.3), with steps numbered from 1 as the prompt numbers them:
* correct and no redundant step: every step is a_T;
* correct with redundant steps from k: the steps before k are a_T;
* incorrect with first error e: the steps before e are a_T and step e is a_F (an incorrect judgment without
  an error step labels nothing).
Steps after those are left unlabelled: nothing is learnt from them.
"""
from __future__ import annotations

import ast
import dataclasses
import enum
import json
import re
from typing import Any, Protocol, Sequence

import numpy as np

from envs.api import Task
from guijax.chat import ChatClient, ask_parsed, image_part
from guijax.rollout.trajectory import Trajectory

# Fig. 8 as printed (its item numbers included); the figure is cut after the last field, whose quotes are closed
# here, and the dictionary's closing brace restored.
JUDGE_PROMPT = """I am evaluating the performance of a UI agent. The images provided are sequential keyframes that represent the full execution trajectory of the agent when attempting to follow a command. These keyframes correspond to the instruction: [INSTRUCTION].

Please thoroughly analyze the sequence to assess the following aspects:
1. Correctness — Did the agent successfully complete the task as instructed?
2. Redundant Steps — Identify any unnecessary or repeated actions that do not contribute to the goal.
3. Optimization — Did the agent follow an efficient plan with a minimal number of steps?
5. First Error Step — If the execution is incorrect or sub-optimal, determine the index of the first keyframe where a mistake occurred.
6. Error Analysis — Provide a brief explanation of the mistake at that step.
7. Correct Action Suggestion — Explain what the agent should have done instead at the point of error.

Important Instructions: The agent may have made progress toward the goal, but unless the task is fully and correctly completed, you must set 'Correctness' to False.
Be cautious in determining success. Missing confirmation screens, skipped inputs, or wrong UI elements clicked all count as errors.
Carefully examine all UI changes, button interactions, text entries, and any visual feedback in the screenshots. Clearly indicate which exact steps are redundant (starting from 1).
Once you finish the analysis, return your evaluation in the following dictionary format. Include your step-by-step reasoning above the result.

<thinking>step by step reasoning.</thinking>
res_dict = {
"Correctness": True or False,
"Redundant": [step numbers],
"Optimized": True or False,
"First Error Step": step number or None,
"Error Type": "brief description of the mistake",
"Correct Action": "what should have been done instead"
}"""


class JudgmentError(ValueError):
    """A judge's answer without a readable `res_dict`."""


class Label(str, enum.Enum):
    CORRECT = "a_T"
    FAILURE = "a_F"


@dataclasses.dataclass(frozen=True)
class Judgment:
    correct: bool
    redundant: tuple[int, ...] = ()
    optimized: bool = True
    first_error_step: int | None = None
    error_type: str = ""
    correct_action: str = ""
    reasoning: str = ""
    readable: bool = True  # False: the judge's answer had no readable res_dict (counted, labels nothing)

    def as_dict(self) -> dict[str, Any]:
        return {"Correctness": self.correct, "Redundant": list(self.redundant), "Optimized": self.optimized,
                "First Error Step": self.first_error_step, "Error Type": self.error_type,
                "Correct Action": self.correct_action}


def _literal(block: str) -> dict:
    """The dictionary in `block`, Python-style (True/None) or JSON-style (true/null)."""
    try:
        value = ast.literal_eval(block)
    except (ValueError, SyntaxError):
        jsonish = re.sub(r"\btrue\b", "True", re.sub(r"\bfalse\b", "False", re.sub(r"\bnull\b", "None", block)))
        try:
            value = ast.literal_eval(jsonish)
        except (ValueError, SyntaxError) as err:
            raise JudgmentError(f"res_dict is not a dictionary literal: {err}") from None
    if not isinstance(value, dict):
        raise JudgmentError("res_dict is not a dictionary")
    return value


def _step(value: Any, key: str) -> int | None:
    if value is None or (isinstance(value, str) and value.strip().lower() in ("none", "null", "")):
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise JudgmentError(f"{key!r} must be a step number, got {value!r}")
    try:
        number = int(str(value).strip())
    except ValueError:
        raise JudgmentError(f"{key!r} must be a step number, got {value!r}") from None
    if number < 1:
        raise JudgmentError(f"{key!r} counts steps from 1, got {number}")
    return number


def _flag(value: Any, key: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise JudgmentError(f"{key!r} must be True or False, got {value!r}")


def parse_judgment(text: str) -> Judgment:
    """The judgment in a Fig. 8 answer: the last `{...}` after `res_dict =` (or the last `{...}` at all),
    with the reasoning from `<thinking>...</thinking>` when present."""
    start = text.rfind("res_dict")
    brace = text.find("{", start) if start >= 0 else text.rfind("{")
    end = text.rfind("}")
    if brace < 0 or end < brace:
        raise JudgmentError("no res_dict = {...} in the answer")
    fields = _literal(text[brace:end + 1])
    if "Correctness" not in fields:
        raise JudgmentError("res_dict has no 'Correctness'")
    redundant = fields.get("Redundant") or []
    if not isinstance(redundant, (list, tuple)):
        raise JudgmentError(f"'Redundant' must be a list of step numbers, got {redundant!r}")
    thinking = re.search(r"<thinking>(.*?)</thinking>", text, re.S)
    optimized = fields.get("Optimized")
    return Judgment(
        correct=_flag(fields["Correctness"], "Correctness"),
        redundant=tuple(sorted({_step(s, "Redundant") for s in redundant} - {None})),
        optimized=(not redundant) if optimized is None else _flag(optimized, "Optimized"),
        first_error_step=_step(fields.get("First Error Step"), "First Error Step"),
        error_type=str(fields.get("Error Type") or ""), correct_action=str(fields.get("Correct Action") or ""),
        reasoning=(thinking.group(1) if thinking else text[:max(start, 0)]).strip())


def _literal_text(value: Any) -> str:
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_literal_text(v) for v in value) + "]"
    return repr(value)


def judgment_answer(judgment: Judgment) -> str:
    """A Fig. 8 answer stating `judgment`: its reasoning in <thinking>, then the res_dict in the figure's
    Python-literal style; `parse_judgment` reads it back to the same judgment (what a judge trained in guijax
    learns to write)."""
    body = ",\n".join(f'"{k}": {_literal_text(v)}' for k, v in judgment.as_dict().items())
    return f"<thinking>{judgment.reasoning}</thinking>\nres_dict = {{\n{body}\n}}"


def keyframe_parts(instruction: str, frames: Sequence[np.ndarray]) -> list[str | np.ndarray]:
    """Fig. 8's request as text and images in order: the prompt with the instruction, then "Keyframe k:" and
    the k-th frame. Every judge backend that reads screenshots is asked exactly this."""
    parts: list[str | np.ndarray] = [JUDGE_PROMPT.replace("[INSTRUCTION]", instruction)]
    for k, frame in enumerate(frames, 1):
        parts += [f"Keyframe {k}:", frame]
    return parts


def step_labels(judgment: Judgment, num_steps: int) -> list[Label | None]:
    """A.3's labels of a judged trajectory's `num_steps` steps (index i is step i + 1); None: unlabelled."""
    labels: list[Label | None] = [None] * num_steps
    if judgment.correct:
        stop = min(judgment.redundant, default=num_steps + 1)
        for i in range(min(stop - 1, num_steps)):
            labels[i] = Label.CORRECT
        return labels
    error = judgment.first_error_step
    if error is None or error > num_steps:
        return labels
    for i in range(error - 1):
        labels[i] = Label.CORRECT
    labels[error - 1] = Label.FAILURE
    return labels


def episode_frames(trajectory: Trajectory, final_screenshot: np.ndarray | None = None) -> list[np.ndarray]:
    """An episode's keyframes: the screen before each action, then the final screen when known."""
    frames = [s.screenshot for s in trajectory.steps]
    return frames if final_screenshot is None else [*frames, final_screenshot]


class WorldStateJudge(Protocol):
    def judge(self, task: Task, trajectory: Trajectory) -> Judgment: ...


class DeskOracleJudge:
    """Judgments from the desk's ground truth (see the module docstring); responses are read in `grammar`, the
    action grammar the policy writes (envs.actions.grammar)."""

    def __init__(self, screen_hw: tuple[int, int], popups: bool = False, coordinate_model: str = "uitars-1.5",
                 grammar: str = "uitars"):
        self.screen_hw, self.popups, self.coordinate_model = screen_hw, popups, coordinate_model
        self.grammar = grammar

    def judge(self, task: Task, trajectory: Trajectory) -> Judgment:
        from envs.desk.expert import expert_subgoals, plan_text
        from guijax.sgcd.desk_skills import critical_targets, step_verdicts

        verdicts = step_verdicts(task, trajectory, self.screen_hw, self.popups, self.coordinate_model,
                                 grammar=self.grammar)
        repeated = tuple(v.index for v in verdicts if v.trap and v.trap.startswith("Do not repeat"))
        off_path = [v for v in verdicts if v.trap is not None]
        if trajectory.success:
            redundant = tuple(v.index for v in off_path)
            return Judgment(True, redundant, not redundant, redundant[0] if redundant else None,
                            off_path[0].trap if off_path else "", "")
        if not off_path:
            return Judgment(False, repeated, not repeated, None, "the task is not complete", "")
        first = off_path[0]
        targets = set(critical_targets(task))
        done = sum(1 for v in verdicts if v.index < first.index and v.element in targets)
        subgoals = expert_subgoals(task)
        suggestion = plan_text(subgoals[done]) if done < len(subgoals) else "Report that the task is done"
        return Judgment(False, repeated, False, first.index, first.trap, suggestion)


def desk_oracle(config: Any) -> DeskOracleJudge:
    """The desk's ground-truth judge for a run config's screen, pop-ups and action grammar."""
    from guijax.rollout.prompt import grammar_of

    env = config.env
    return DeskOracleJudge(tuple(env.screen), popups=env.popups, coordinate_model=config.rollout.coordinate_model,
                           grammar=grammar_of(config.rollout.prompt))


class ChatWorldStateJudge:
    """Fig. 8 through an OpenAI-compatible vision model; `retries` more requests on an unreadable answer."""

    def __init__(self, client: ChatClient, retries: int = 2):
        self.client, self.retries = client, retries

    def messages(self, task: Task, trajectory: Trajectory,
                 final_screenshot: np.ndarray | None = None) -> list[dict[str, Any]]:
        parts = keyframe_parts(trajectory.instruction or task.instruction, episode_frames(trajectory, final_screenshot))
        return [{"role": "user", "content": [{"type": "text", "text": p} if isinstance(p, str) else
                                             image_part(p)
                                             for p in parts]}]

    def judge(self, task: Task, trajectory: Trajectory, final_screenshot: np.ndarray | None = None) -> Judgment:
        return ask_parsed(self.client, self.messages(task, trajectory, final_screenshot), parse_judgment,
                          self.retries, f"judgment for task {task.id}")


@dataclasses.dataclass(frozen=True)
class JudgeScore:
    """A judge against the verifier (the paper's Table 1 columns): precision = verified successes among the
    trajectories judged correct, NPV = verified failures among those judged incorrect."""

    trajectories: int
    judged_correct: int
    judged_incorrect: int
    precision: float | None
    npv: float | None
    accuracy: float

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def score_judge(judgments: Sequence[Judgment], verified: Sequence[bool]) -> JudgeScore:
    """Precision and NPV of `judgments` against the verifier's outcomes (`verified[i]`: trajectory i succeeded)."""
    if len(judgments) != len(verified):
        raise ValueError(f"{len(judgments)} judgments for {len(verified)} verified outcomes")
    pairs = [(j.correct, bool(v)) for j, v in zip(judgments, verified)]
    yes = [v for j, v in pairs if j]
    no = [v for j, v in pairs if not j]
    return JudgeScore(len(pairs), len(yes), len(no), sum(yes) / len(yes) if yes else None,
                      sum(not v for v in no) / len(no) if no else None,
                      sum(j == v for j, v in pairs) / len(pairs) if pairs else 0.0)
