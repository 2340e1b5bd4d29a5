"""The second filter of SGCD's spliced rollouts (sgcd.txt §4.4): after the verifier accepts the final state, a
judge removes accidental successes, redundant loops, inconsistent reasoning and behaviour unrelated to the
instruction, looking at the post-handoff part (the prefix is the plain policy's, kept as context only).

- `RuleJudge`: rules that need no model. Any environment: the agent must end the episode itself with the
  right control action (DONE on a feasible task, FAIL on an infeasible one; a verifier success at the step
  limit is accidental); no action may repeat more than `max_repeats` times in a row; every step has a thought.
  On the synthetic desk the continuation is also replayed against the accessibility tree: a click must hit the
  element its thought names, a typed text must be the one its thought quotes. Responses are read in the
  action grammar the policy writes (`grammar`: UI-TARS's Thought, computer_use's reasoning before `Action:`).
- `ChatJudge`: an OpenAI-compatible model with the prompt below (the paper names the criteria but prints no
  prompt; this one is ours). It reads the instruction, each step's response as written (thought and action in
  the run's grammar) and the outcome, and, as the paper's judge inspects the observations, the screen each of
  the last `screenshots` post-handoff steps acted on (0: text only). An answer that is not the JSON verdict is
  asked again, then counted as a rejection with the reason.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Protocol

from envs.actions import ActionParseError
from envs.actions.grammar import parse_response, reasoning
from envs.actions.model import Action, ActionType
from envs.api import Task
from guijax.chat import ChatClient, ChatError, image_part, json_reply
from guijax.rollout.trajectory import Status, Step, Trajectory

JUDGE_PROMPT = """You review one computer-use episode in which an agent continued a task from a state reached by another policy (the first {handoff} steps, shown for context). The environment's verifier has already accepted the final state.

Reject the episode if, after step {handoff}, any of these holds:
- the success is accidental: the agent's own actions did not bring it about, or it never declared the task finished;
- it contains redundant loops (the same ineffective action repeated);
- a thought is inconsistent with its action or with the screen it describes;
- an operation is unsafe or unrelated to the instruction.

Answer with JSON only: {{"accept": true or false, "reason": "one sentence"}}"""


@dataclasses.dataclass(frozen=True)
class Verdict:
    accept: bool
    reason: str = ""


class Judge(Protocol):
    def judge(self, task: Task, trajectory: Trajectory, handoff: int) -> Verdict: ...


def _action(response: str) -> str:
    return response.split("Action:")[-1].strip() if "Action:" in response else response.strip()


class RuleJudge:
    def __init__(self, max_repeats: int = 2, screen_hw: tuple[int, int] | None = None, popups: bool = False,
                 coordinate_model: str = "uitars-1.5", grammar: str = "uitars"):
        """`screen_hw` (the desk's screen) turns on the accessibility-tree checks for desk tasks; `grammar` is
        the action grammar the policy writes (envs.actions.grammar)."""
        self.max_repeats, self.screen_hw, self.popups = max_repeats, screen_hw, popups
        self.coordinate_model, self.grammar = coordinate_model, grammar

    def _actions(self, step: Step) -> tuple[Action, ...] | None:
        """The step's actions on the screen it saw, None when its response does not parse."""
        try:
            return tuple(parse_response(step.response, grammar=self.grammar, screen_hw=step.screenshot.shape[:2],
                                        coordinate_model=self.coordinate_model))
        except (ActionParseError, ValueError):
            return None

    def judge(self, task: Task, trajectory: Trajectory, handoff: int) -> Verdict:
        post = trajectory.steps[handoff:]
        if not post:
            return Verdict(False, "no step after the handoff")
        ending = Status.FAIL if task.infeasible else Status.DONE
        if trajectory.status != ending:
            return Verdict(False, f"accidental success: the episode ended as {trajectory.status.value}, not by the "
                                  f"agent's own {'FAIL' if task.infeasible else 'DONE'}")
        run, last = 0, None
        for j, step in enumerate(post, handoff + 1):
            if not reasoning(step.response, self.grammar):
                return Verdict(False, f"inconsistent reasoning: step {j} has no thought")
            action = _action(step.response)
            # the same call counts however its text words it (a computer_use step's semantic action is free text)
            key = self._actions(step) or action
            run = run + 1 if key == last else 1
            last = key
            if run > self.max_repeats:
                return Verdict(False, f"redundant loop: {action!r} {run} times in a row (step {j})")
        if self.screen_hw is not None and any(s.get("type") == "desk_scene" for s in task.config):
            return self._desk(task, trajectory, handoff)
        return Verdict(True)

    def _desk(self, task: Task, trajectory: Trajectory, handoff: int) -> Verdict:
        from guijax.sgcd.desk_skills import step_verdicts

        for v in step_verdicts(task, trajectory, self.screen_hw, self.popups, self.coordinate_model,
                               grammar=self.grammar):
            if v.index <= handoff:
                continue
            if v.kind == "unreplayable":
                return Verdict(False, f"step {v.index} cannot be replayed on the desk to check it")
            step = trajectory.steps[v.index - 1]
            named = re.findall(r'"([^"]+)"', reasoning(step.response, self.grammar))
            if v.element is not None and named and v.element[1] not in named:
                return Verdict(False, f"inconsistent reasoning: step {v.index}'s thought names {named} but its click "
                                      f"hits \"{v.element[1]}\"")
            typed = next((a.text for a in self._actions(step) or () if a.kind == ActionType.TYPE), None)
            if typed is not None and named and typed not in named:
                return Verdict(False, f"inconsistent reasoning: step {v.index} types {typed!r} but its "
                                      f"thought quotes {named}")
        return Verdict(True)


def parse_verdict(text: str) -> Verdict:
    data = json_reply(text)
    if not isinstance(data, dict) or not isinstance(data.get("accept"), bool):
        raise ValueError(f"expected {{\"accept\": bool, \"reason\": str}}, got {text.strip()[:120]!r}")
    return Verdict(data["accept"], str(data.get("reason", "")))


class ChatJudge:
    def __init__(self, client: ChatClient, retries: int = 2, screenshots: int = 0, max_side: int | None = 1280):
        self.client, self.retries, self.screenshots, self.max_side = client, retries, screenshots, max_side

    def messages(self, task: Task, trajectory: Trajectory, handoff: int) -> list[dict[str, Any]]:
        """The system prompt and the episode: text alone, or with the screen before each of the last
        `screenshots` post-handoff steps placed ahead of that step's response (at most `max_side` pixels)."""
        steps = trajectory.steps
        shown = set(range(max(handoff, len(steps) - self.screenshots), len(steps))) if self.screenshots else set()
        lines = [f"Step {j}{' (context)' if j <= handoff else ''}: {s.response.strip()}" for j, s in enumerate(steps, 1)]
        head = f"Instruction: {task.instruction}"
        tail = f"Outcome: ended as {trajectory.status.value}, verifier reward {trajectory.reward:.2f}"
        system = {"role": "system", "content": JUDGE_PROMPT.format(handoff=handoff)}
        if not shown:
            return [system, {"role": "user", "content": "\n\n".join([head, "\n".join(lines), tail])}]
        content: list[dict[str, Any]] = [{"type": "text", "text": head}]
        for i, line in enumerate(lines):
            if i in shown:
                content += [{"type": "text", "text": f"Screen before step {i + 1}:"},
                            image_part(steps[i].screenshot, self.max_side)]
            content.append({"type": "text", "text": line})
        content.append({"type": "text", "text": tail})
        return [system, {"role": "user", "content": content}]

    def judge(self, task: Task, trajectory: Trajectory, handoff: int) -> Verdict:
        messages, last = self.messages(task, trajectory, handoff), ""
        for _ in range(self.retries + 1):
            try:
                answer = self.client.complete(messages)
            except ChatError as e:
                return Verdict(False, f"judge unreachable: {e}")
            try:
                return parse_verdict(answer)
            except ValueError as e:
                last = str(e)
        return Verdict(False, f"judge gave no verdict after {self.retries + 1} answers; last: {last}")
