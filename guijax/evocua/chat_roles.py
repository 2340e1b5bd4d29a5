"""EvoCUA's model roles around RFT and step-DPO, as OpenAI-compatible clients beside the offline ones:

- `ChatDenoiser`, the judge of step-level denoising (§5.2): shown a successful trajectory (each step's
  thought, action and screenshot), it names the redundant steps, which leave the loss. The offline judge is
  `guijax.evocua.denoise.redundant_steps` (a step that left the screen unchanged).
- `ChatReflectionWriter`, Pair II's GenerateReflection (App. C, Algorithm 2): shown the screen after the
  erring step, the action that erred and the successful reference's aligned step, it writes the "Reflection:"
  thought that notices the error and turns to the remedy. The offline writer is
  `guijax.evocua.step_dpo.reflection_response`'s template.
- `ChatStateAligner`, step-DPO's CheckAlignment (App. C, Algorithm 2): shown two screens, the task and the
  actions taken from each, it says whether they are the same state of the task, which decides the critical
  forking point and whether Pair II's recovery applies. The offline aligner is
  `guijax.evocua.step_dpo.exact_match` (equal screenshots), exact on the desk but not on a real screen, whose
  pointer, caret and clock move between two visits of one state.

The paper prints none of the prompts; the ones here follow its description. Answers are checked strictly and asked
again (`retries`); a trajectory the denoiser cannot read keeps every step in the loss, a reflection the
writer cannot write falls back to the offline template, and two screens the aligner cannot judge are not
aligned (no pair is built on a guess), each counted. A dead endpoint
(ChatError from the transport) propagates: it must stop the run rather than silently change the data.
"""
from __future__ import annotations

import hashlib
from typing import Any, Sequence

from guijax.chat import ChatClient, UnreadableAnswer, ask_parsed, image_part, json_reply
from guijax.rollout.trajectory import Step, Trajectory

DENOISE_PROMPT = """You are reviewing a successful trajectory of a computer-use agent, to keep only the steps worth learning from.

Task: {instruction}

The agent's steps, in order (the screenshot before each step follows its line, for the last {screens} steps):
{steps}

A step is redundant when leaving it out would not change the outcome: an action that changed nothing on the screen, a repeated or undone action, a detour the task did not need. The last step ends the episode and is never redundant.

Answer with one JSON object and nothing else:
{{"redundant_steps": [step numbers], "reason": "one sentence"}}"""

REFLECT_PROMPT = """You write the reasoning of a computer-use agent that has just noticed its previous action did not work.

Task: {instruction}
Its previous action: {tried}
The attached screenshot is the screen now, after that action.
What a successful attempt of the same task did at this point: {remedy}

Write the agent's thought for its next step, in the first person. It must begin with "Reflection:", say what went wrong from what the screen shows, then turn to the corrected plan ("Now I will ..."). Do not name pixel coordinates. Answer with the thought only."""

ALIGN_PROMPT = """You compare two screenshots taken while computer-use agents worked on the same task.

Task: {instruction}

Screen A (the first image): an attempt then did: {action_a}
Screen B (the second image): an attempt then did: {action_b}

Decide whether A and B show the same state of the task: the same application, window, dialog, selection and content that matter to the task, so that any action would have the same effect on either screen. Ignore what does not matter to the task: the mouse pointer, a blinking caret, the clock, notifications.

Answer with one JSON object and nothing else:
{{"same_state": true or false, "reason": "one sentence"}}"""


def _answer_field(answer: str, key: str, kind: type, what: str) -> Any:
    """`key` of the JSON object a model answered, or ValueError when the answer is not one or `key` is not `kind`."""
    try:
        data = json_reply(answer)
    except ValueError as err:
        raise ValueError(f"the answer is not a JSON object ({err})") from None
    if not isinstance(data, dict) or not isinstance(data.get(key), kind):
        raise ValueError(f"the answer is not a JSON object with {what} {key!r}")
    return data[key]


def _action_words(step: Step) -> str:
    """The action a step took, as its response's `Action:` part says it."""
    from guijax.evocua.denoise import action_part

    return action_part(step.response).removeprefix("Action:").strip() or "(no action)"


def _thought_and_action(response: str) -> str:
    return " ".join(line.strip() for line in response.strip().splitlines() if line.strip())


def parse_redundant(answer: str, steps: int) -> list[int]:
    """The 0-based redundant steps of a `steps`-step trajectory from the denoiser's answer, or ValueError naming
    what is wrong (not a JSON object, no list, a number that is not a step, the last step)."""
    out = set()
    for n in _answer_field(answer, "redundant_steps", list, "a list"):
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= steps:
            raise ValueError(f"redundant_steps holds {n!r}, not a step number from 1 to {steps}")
        if n == steps:
            raise ValueError(f"redundant_steps names step {n}, the last one, which ends the episode")
        out.add(n - 1)
    return sorted(out)


class ChatDenoiser:
    """Redundant steps from a model; `unreadable` counts the trajectories whose answers it could not read."""

    def __init__(self, client: ChatClient, retries: int = 2, screens: int = 8, max_side: int = 1280):
        self.client, self.retries, self.screens, self.max_side = client, retries, screens, max_side
        self.unreadable = 0

    def messages(self, instruction: str, steps: Sequence[Step]) -> list[dict[str, Any]]:
        lines = "\n".join(f"Step {i + 1}: {_thought_and_action(s.response)}" for i, s in enumerate(steps))
        shown = list(steps)[-self.screens:] if self.screens else []
        text = DENOISE_PROMPT.format(instruction=instruction, screens=len(shown), steps=lines)
        content: list[dict[str, Any]] = [{"type": "text", "text": text}]
        first = len(steps) - len(shown)
        for i, s in enumerate(shown):
            content += [{"type": "text", "text": f"Before step {first + i + 1}:"},
                        image_part(s.screenshot, self.max_side)]
        return [{"role": "user", "content": content}]

    def __call__(self, trajectory: Trajectory) -> list[bool]:
        """Per step, whether it is redundant; every step kept when no answer can be read."""
        steps = trajectory.steps
        if len(steps) < 2:
            return [False] * len(steps)
        try:
            redundant = ask_parsed(self.client, self.messages(trajectory.instruction, steps),
                                   lambda a: parse_redundant(a, len(steps)), self.retries, "list of redundant steps")
        except UnreadableAnswer:
            self.unreadable += 1
            return [False] * len(steps)
        return [i in redundant for i in range(len(steps))]


class ChatReflectionWriter:
    """Pair II's reflection thought from a model; `fallbacks` counts those the offline template wrote instead."""

    def __init__(self, client: ChatClient, retries: int = 2, max_side: int = 1280):
        self.client, self.retries, self.max_side = client, retries, max_side
        self.fallbacks = 0

    def messages(self, instruction: str, failed_step: Step, reference_step: Step, screen: Any) -> list[dict[str, Any]]:
        text = REFLECT_PROMPT.format(instruction=instruction, tried=_action_words(failed_step),
                                     remedy=_thought_and_action(reference_step.response))
        return [{"role": "user", "content": [{"type": "text", "text": text},
                                             image_part(screen, self.max_side)]}]

    def __call__(self, instruction: str, failed_step: Step, reference_step: Step, screen: Any) -> str | None:
        """The thought (starting "Reflection:"), or None when no answer passed the check."""
        from guijax.evocua.hindsight import check_thought

        try:
            return ask_parsed(self.client, self.messages(instruction, failed_step, reference_step, screen),
                              lambda a: check_thought(a, header="Reflection:"), self.retries, "reflection")
        except UnreadableAnswer:
            self.fallbacks += 1
            return None


def parse_same_state(answer: str) -> bool:
    """The aligner's verdict, or ValueError naming what is wrong (not a JSON object, no boolean 'same_state')."""
    return _answer_field(answer, "same_state", bool, "a boolean")


def _screen_key(step: Step) -> tuple:
    return step.screenshot.shape, hashlib.sha1(step.screenshot.tobytes()).hexdigest()


class ChatStateAligner:
    """A `guijax.evocua.step_dpo.StateMatcher` that asks a model. Equal screenshots are the same state without a
    call; screenshots of different sizes are never aligned (the reference's coordinates would not carry over);
    each pair of screens is asked once per task. `calls` counts the questions asked and `unreadable` those no
    answer could be read for (counted as not aligned)."""

    def __init__(self, client: ChatClient, retries: int = 2, max_side: int = 1280):
        self.client, self.retries, self.max_side = client, retries, max_side
        self.calls = self.unreadable = 0
        self._verdicts: dict[tuple, bool] = {}

    def messages(self, instruction: str, a: Step, b: Step) -> list[dict[str, Any]]:
        text = ALIGN_PROMPT.format(instruction=instruction, action_a=_action_words(a), action_b=_action_words(b))
        return [{"role": "user", "content": [
            {"type": "text", "text": text},
            image_part(a.screenshot, self.max_side),
            image_part(b.screenshot, self.max_side)]}]

    def __call__(self, instruction: str, a: Step, b: Step) -> bool:
        from guijax.evocua.step_dpo import same_state

        if a.screenshot.shape != b.screenshot.shape:
            return False
        if same_state(a, b):
            return True
        key = (instruction, *sorted([_screen_key(a), _screen_key(b)]))
        if key not in self._verdicts:
            self.calls += 1
            try:
                verdict = ask_parsed(self.client, self.messages(instruction, a, b), parse_same_state, self.retries,
                                     "same-state verdict")
            except UnreadableAnswer:
                self.unreadable += 1
                verdict = False
            self._verdicts[key] = verdict
        return self._verdicts[key]
