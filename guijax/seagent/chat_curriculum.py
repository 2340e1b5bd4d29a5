"""SEAgent's curriculum generator as the paper runs it (App. B-C, Fig. 9): a large language model that reads
the phase's state-change captions, its own previous software guidebook and the judged results, and answers
with the updated guidebook U_{p+1} and the next task buffer I_{p+1}:

    I_{p+1}, U_{p+1} <- M_task(U_p, I_p, {J_I}, {C_I})        (Alg. 1 line 25)

The first call (Alg. 1 line 4, `M_task(∅, ∅, ∅, C_0)`) passes the captions of the software's initial screen and
empty guidebook and results. The answer's tasks are instructions only, as in the paper: sequences of subtasks
(`[subtask1, subtask2, ...]`) or single tasks (`[task]`), with no validator; the World State Model's judgment
is all that rewards them.

`ChatCurriculumGenerator` sends Fig. 9 through an OpenAI-compatible client; an answer without a readable
`{"software document new": ..., "exam new": [...]}` is asked again, then refused with the reasons.
`phase_feedback` turns a phase's judged episodes and their captions into the prompt's three inputs.

The "software" is the set of the training tasks' initial screens: `place_on_scenes` runs each generated
instruction from the setup of the training task whose screen names its elements most (a task with the `judged`
evaluator: no validator, the judge alone decides), and leaves out one that names nothing there. The desk's
accessibility tree names a screen's elements; elsewhere a vision model does (guijax.seagent.chat_captions).
"""
from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Sequence

from envs.api import Task
from envs.metrics import evaluator_funcs
from guijax.chat import ChatClient, ask_parsed
from guijax.seagent.world_state import Judgment

# Fig. 9 as printed, its typos kept; the template's `{json.dumps(...)}` slots are named fields here, and the
# JSON example at the end, whose braces the figure lost, is written out as the dictionary it describes.
TASK_BUFFER_PROMPT = """You are now a teacher training a Computer Use Agent (CUA). This CUA is exposed to a new software environment and undergoes multiple rounds of iterative training. Your task is to issue new tasks for the agent to explore and train on, based on the feedback from the agent's actions. You are also responsible for summarizing a software usage manual to help the agent remember knowledge about the software.
The agent has provided the following feedback on its operations within the software:
{action_descriptions}
Here is the software usage document you summarized in the previous round:
{document}
Here is the agent's performance on the task you provided in the previous round:
{exam}
Your are also access to the previous given tasks with the screenshot caption after agent's execution. You can also use these captions and results to evaluate the agent's capability and generate new task and update document accordingly given the caption of the new screen and the corresponding intruction with judged evaluation:
{prev_states}

Analyze the agent's performance.
- Integrate new knowledge from the feedback.
- Update the usage manual accordingly.
- Design a new set of tasks (with increased difficulty) (30 or more) that reinforce the concepts the agent struggled with in the last round.
- Each task **must be concise and specific**, targeting a concrete atomic action, based on the document and agent's observations, such as: "Create a file named main.py."
- "Open Terminal card."
- Each task must be executable from software initial state with no file open, e.g. you should not generate task like save xxx.txt if xxx.txt doesn't exist or created.
- if task is in sequencial order with reliance, you should output a seg list like [subtask1, subtask2, ...], if there is no reliance, output [task].
- Decompose and target previous errors in a more focused way.
Output your reasoning and analysis process first. Then output the updated usage document and task list in the following JSON format within a SINGLE JSON DICT easier for me to parse:
```json
{{"software document new": "...", "exam new": [["subtask1", "subtask2", "..."], ["task"]]}}
```"""

DOCUMENT_KEY, TASKS_KEY = "software document new", "exam new"


class CurriculumAnswerError(ValueError):
    """A generator's answer without a readable guidebook and task buffer."""


@dataclasses.dataclass(frozen=True)
class TaskBuffer:
    """U_{p+1} and I_{p+1}: the updated guidebook and the next tasks, each a sequence of subtask instructions."""

    document: str
    tasks: tuple[tuple[str, ...], ...]
    reasoning: str = ""

    def instructions(self) -> list[str]:
        """Each task as one instruction; a sequence's subtasks joined in order ("A, then B")."""
        return [", then ".join(t) for t in self.tasks]

    def to_json(self) -> dict[str, Any]:
        return {DOCUMENT_KEY: self.document, TASKS_KEY: [list(t) for t in self.tasks], "reasoning": self.reasoning}


MAX_OPENINGS = 5000  # '{' positions tried from the end of an answer: enough for any real one, bounded for any input


def _last_buffer_dict(text: str) -> tuple[int, dict] | None:
    """The JSON object starting latest in `text` that decodes and holds both keys (else the latest holding one,
    for the error to name the other), with where it starts. Objects are tried from the last '{' back (at most
    MAX_OPENINGS), so a long answer costs no quadratic scan; one nested too deep to decode does not decode."""
    decoder, partial = json.JSONDecoder(), None
    start = len(text)
    for _ in range(MAX_OPENINGS):
        start = text.rfind("{", 0, start)
        if start < 0:
            break
        try:
            value, _ = decoder.raw_decode(text, start)
        except (json.JSONDecodeError, RecursionError):
            continue
        if isinstance(value, dict) and TASKS_KEY in value and DOCUMENT_KEY in value:
            return start, value
        if isinstance(value, dict) and (TASKS_KEY in value or DOCUMENT_KEY in value) and partial is None:
            partial = start, value
    return partial


def parse_task_buffer(text: str) -> TaskBuffer:
    """The last JSON dict in a Fig. 9 answer holding both keys; the text before it is the reasoning. A task given
    as a bare string is read as a one-step sequence."""
    found = _last_buffer_dict(text)
    if found is None:
        raise CurriculumAnswerError(f"no JSON dict with {DOCUMENT_KEY!r} and {TASKS_KEY!r} in the answer")
    start, answer = found
    for key in (DOCUMENT_KEY, TASKS_KEY):
        if key not in answer:
            raise CurriculumAnswerError(f"the answer's JSON dict has no {key!r}")
    document = answer[DOCUMENT_KEY]
    if not isinstance(document, str):
        raise CurriculumAnswerError(f"{DOCUMENT_KEY!r} must be text, got {type(document).__name__}")
    raw = answer[TASKS_KEY]
    if not isinstance(raw, list) or not raw:
        raise CurriculumAnswerError(f"{TASKS_KEY!r} must be a non-empty list of task lists, got {raw!r}"[:300])
    tasks = []
    for i, item in enumerate(raw):
        steps = [item] if isinstance(item, str) else item
        if not isinstance(steps, list) or not steps or not all(isinstance(s, str) and s.strip() for s in steps):
            raise CurriculumAnswerError(f"{TASKS_KEY!r}[{i}] must be a list of non-empty task instructions, "
                                        f"got {item!r}"[:300])
        tasks.append(tuple(s.strip() for s in steps))
    return TaskBuffer(document.strip(), tuple(tasks), text[:start].strip())


def phase_feedback(results: Sequence[tuple[Task, Judgment, Sequence[str]]], max_descriptions: int = 100,
                   ) -> tuple[list[str], list[dict[str, Any]], list[dict[str, Any]]]:
    """Fig. 9's three inputs from a phase's judged episodes `(task, judgment, step captions)`:

    * the action descriptions: every step caption, in order, distinct, at most `max_descriptions` (the paper
      finds 50-100 best; more made its generator's context too long);
    * the exam: per instruction, how often the judge found it done and the errors it named;
    * the previous states: per episode, the instruction, the caption of the screen it ended on and the judgment.
    """
    descriptions: list[str] = []
    exam: dict[str, dict[str, Any]] = {}
    states: list[dict[str, Any]] = []
    for task, judgment, captions in results:
        for caption in captions:
            text = caption.split(": ", 1)[-1]  # "Step k: ..." without its number, so repeats fold together
            if text not in descriptions:
                descriptions.append(text)
        entry = exam.setdefault(task.instruction, {"task": task.instruction, "attempts": 0, "judged_correct": 0,
                                                   "errors": []})
        entry["attempts"] += 1
        entry["judged_correct"] += int(judgment.correct)
        if judgment.error_type and judgment.error_type not in entry["errors"]:
            entry["errors"].append(judgment.error_type)
        verdict = "correct" if judgment.correct else "incorrect" + (
            f" (first error at step {judgment.first_error_step}: {judgment.error_type})"
            if judgment.first_error_step else "")
        states.append({"instruction": task.instruction, "caption": captions[-1] if captions else "",
                       "judged": verdict})
    return descriptions[:max_descriptions], list(exam.values()), states


JUDGED_EVALUATOR = {"func": "judged"}


def is_judged(task: Task) -> bool:
    """A task no validator checks: its outcome is the judge's."""
    return "judged" in evaluator_funcs(task.evaluator)


def _mentions(lowered: str, name: str) -> bool:
    """`name` as a whole word (or phrase) of the lower-cased text: "OK" is not in "look"."""
    return re.search(rf"(?<!\w){re.escape(name.lower())}(?!\w)", lowered) is not None


def place_on_scenes(instructions: Sequence[str], scenes: Sequence[Task], element_names: Sequence[Sequence[str]],
                    id_prefix: str) -> tuple[list[Task], list[str]]:
    """Each instruction as a judged task on the scene (`scenes[i]`, whose screen names `element_names[i]`) whose
    element names it mentions most (whole words, case-insensitively), longer names first to break ties, then the first scene;
    instructions that mention none are returned apart."""
    placed, left_out = [], []
    for k, text in enumerate(instructions):
        lowered = text.lower()
        scores = [sorted((len(n) for n in names if n and _mentions(lowered, n)), reverse=True) for names in element_names]
        best = max(range(len(scenes)), key=lambda i: (len(scores[i]), scores[i], -i), default=None)
        if best is None or not scores[best]:
            left_out.append(text)
            continue
        scene = scenes[best]
        # the scene task's own solutions (the desk's expert, a synthesized task's reference) solve another task
        extra = {key: v for key, v in scene.extra.items() if key not in ("expert", "solution")} | {
            "source": "seagent_curriculum", "scene": scene.id}
        placed.append(dataclasses.replace(scene, id=f"{id_prefix}-{k:03d}", instruction=text,
                                          evaluator=dict(JUDGED_EVALUATOR), extra=extra))
    return placed, left_out


class ChatCurriculumGenerator:
    """Fig. 9 through an OpenAI-compatible model; `retries` more requests on an unreadable answer."""

    def __init__(self, client: ChatClient, retries: int = 2):
        self.client, self.retries = client, retries

    @staticmethod
    def prompt(action_descriptions: Sequence[str], document: str, exam: Sequence[dict[str, Any]],
               prev_states: Sequence[dict[str, Any]]) -> str:
        return TASK_BUFFER_PROMPT.format(action_descriptions=json.dumps(list(action_descriptions)),
                                         document=document, exam=json.dumps(list(exam)),
                                         prev_states=json.dumps(list(prev_states)))

    def update(self, action_descriptions: Sequence[str], document: str = "", exam: Sequence[dict[str, Any]] = (),
               prev_states: Sequence[dict[str, Any]] = ()) -> TaskBuffer:
        """U_{p+1}, I_{p+1}; the first phase passes the initial screen's captions and nothing else."""
        messages = [{"role": "user", "content": self.prompt(action_descriptions, document, exam, prev_states)}]
        return ask_parsed(self.client, messages, parse_task_buffer, self.retries, "task buffer")
