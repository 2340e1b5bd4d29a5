"""SGCD's off-trajectory continuation skills (sgcd.txt §4.3, Table 1, Appendix D): a task's successful and
failed plain-policy rollouts abstracted into exactly four lists (Continuation Plans, Critical Targets, Failure
Traps, Success Criteria), rendered into the skill-guided policy's context (Eq. 3).

Two extractors G share one contract, `extract(task, successes, failures) -> Skill`:

- `ChatSkillExtractor`: an OpenAI-compatible model with the paper's prompt (Fig. 5). Its answer must be one JSON
  object with exactly the four fields, each a list of strings; a malformed answer is asked again up to
  `retries` times, then the task is skipped with the reason (`SkillSkipped`).
- `guijax.sgcd.desk_skills.DeskSkillExtractor`: the offline counterpart on the synthetic desk, written from the
  task's validator and the accessibility tree along the failed references.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Protocol, Sequence

from envs.api import Task
from guijax.chat import ChatClient, ChatError, json_reply
from guijax.rollout.trajectory import Trajectory

FIELDS = ("Continuation Plans", "Critical Targets", "Failure Traps", "Success Criteria")

# Fig. 5, system prompt, as printed (the task id filled in per task).
SYSTEM_PROMPT = """Task id: {task_id}.

You are extracting a concise SOP (standard operating procedure) for one computer-use task. You will be given successful references and failed references for the same task.

- Use **successful references** to infer the stable good path.
- Use **failed references** to infer obstacles, traps, and bad paths to avoid.
- Do not copy long trajectory text verbatim. Compress them into short, reusable procedural knowledge.
- Only include information supported by the provided references.

Output Format

Return JSON only with exactly these fields:

```
{{
  "Continuation Plans": string[],
  "Critical Targets": string[],
  "Failure Traps": string[],
  "Success Criteria": string[]
}}
```

Guidelines

- Keep each bullet short, concrete, and reusable.
- Prefer task-level decisions over click-by-click replay.
- Include wrong formulas / wrong pages / wrong menus in Failure Traps when supported by failed references.
- Alternative paths must only come from successful references; do not invent or generalize new alternatives.
- If uncertain, leave a field empty instead of hallucinating."""

# Fig. 5, user prompt: the references concatenated into its two slots.
USER_PROMPT = """Successful references:
{successful_trajectories}
Failed references: {failed_trajectories}"""


class SkillFormatError(ValueError):
    """An extractor's answer is not the four-field skill JSON."""


class SkillSkipped(RuntimeError):
    """No valid skill for a task (malformed answers past the retries, or no evidence at all); says why."""


@dataclasses.dataclass(frozen=True)
class Skill:
    continuation_plans: tuple[str, ...] = ()
    critical_targets: tuple[str, ...] = ()
    failure_traps: tuple[str, ...] = ()
    success_criteria: tuple[str, ...] = ()

    def fields(self) -> dict[str, tuple[str, ...]]:
        return dict(zip(FIELDS, (self.continuation_plans, self.critical_targets, self.failure_traps,
                                 self.success_criteria)))

    def to_json(self) -> dict[str, list[str]]:
        return {k: list(v) for k, v in self.fields().items()}

    @classmethod
    def from_json(cls, data: Any, where: str = "skill") -> "Skill":
        """The skill in `data`, which must be an object with exactly the four fields, each a list of non-empty
        strings (an empty list is allowed: a field without evidence)."""
        if not isinstance(data, dict):
            raise SkillFormatError(f"{where}: expected a JSON object with fields {list(FIELDS)}, got "
                                   f"{type(data).__name__}")
        missing, extra = [f for f in FIELDS if f not in data], sorted(set(data) - set(FIELDS))
        if missing or extra:
            raise SkillFormatError(f"{where}: the fields must be exactly {list(FIELDS)}; "
                                   + "; ".join(x for x in (f"missing {missing}" if missing else "",
                                                           f"unexpected {extra}" if extra else "") if x))
        values = []
        for name in FIELDS:
            items = data[name]
            if not isinstance(items, list) or not all(isinstance(x, str) and x.strip() for x in items):
                raise SkillFormatError(f"{where}: field {name!r} must be a list of non-empty strings, got "
                                       f"{json.dumps(items)[:120]}")
            values.append(tuple(x.strip() for x in items))
        return cls(*values)

    def render(self, fields: Sequence[str] = FIELDS) -> str:
        """The skill as the skill-guided policy reads it after the instruction: each field under its name, the
        Continuation Plans numbered (an ordered procedure, as plans are), the others as bullets; `fields`
        keeps a subset (the paper's Table 3 ablation). Empty fields are left out."""
        unknown = [f for f in fields if f not in FIELDS]
        if unknown:
            raise ValueError(f"unknown skill fields {unknown}; the fields are {list(FIELDS)}")
        parts = []
        for name, items in self.fields().items():
            if name in fields and items:
                lines = (f"{i}. {x}" for i, x in enumerate(items, 1)) if name == FIELDS[0] else (f"- {x}" for x in items)
                parts.append(f"{name}:\n" + "\n".join(lines))
        return "\n".join(parts)

    def is_empty(self) -> bool:
        return not any(self.fields().values())


def parse_skill(text: str, where: str = "skill answer") -> Skill:
    """A model's answer -> Skill. The JSON object may be wrapped in a ```json fence; nothing else may be
    around it."""
    try:
        data = json_reply(text)
    except ValueError as e:
        raise SkillFormatError(f"{where}: not JSON ({e}): {text[:120]!r}") from None
    return Skill.from_json(data, where)


class SkillExtractor(Protocol):
    def extract(self, task: Task, successes: Sequence[Trajectory], failures: Sequence[Trajectory]) -> Skill: ...


def reference_text(trajectory: Trajectory, index: int) -> str:
    """One reference as the extractor reads it: its outcome, then each step's response (thought and action)."""
    lines = [f"Reference {index} (reward {trajectory.reward:.2f}, ended: {trajectory.status.value}):"]
    lines += [f"Step {j}: {s.response.strip()}" for j, s in enumerate(trajectory.steps, 1)]
    return "\n".join(lines)


def references_text(trajectories: Sequence[Trajectory]) -> str:
    return "\n\n".join(reference_text(t, i) for i, t in enumerate(trajectories, 1)) or "(none)"


class ChatSkillExtractor:
    """G backed by an OpenAI-compatible model (the paper uses Gemini-3-Pro) with the Fig. 5 prompt."""

    def __init__(self, client: ChatClient, retries: int = 2, max_references: int = 4):
        self.client, self.retries, self.max_references = client, retries, max_references

    def messages(self, task: Task, successes: Sequence[Trajectory],
                 failures: Sequence[Trajectory]) -> list[dict[str, str]]:
        n = self.max_references
        user = USER_PROMPT.format(successful_trajectories=references_text(list(successes)[:n]),
                                  failed_trajectories=references_text(list(failures)[:n]))
        return [{"role": "system", "content": SYSTEM_PROMPT.format(task_id=task.id)},
                {"role": "user", "content": f"Task: {task.instruction}\n\n{user}"}]

    def extract(self, task: Task, successes: Sequence[Trajectory], failures: Sequence[Trajectory]) -> Skill:
        messages = self.messages(task, successes, failures)
        problems = []
        for attempt in range(self.retries + 1):
            try:
                answer = self.client.complete(messages)
            except ChatError as e:
                raise SkillSkipped(f"task {task.id}: skill extractor unreachable: {e}") from None
            try:
                return parse_skill(answer, where=f"task {task.id}, attempt {attempt + 1}")
            except SkillFormatError as e:
                problems.append(str(e))
        raise SkillSkipped(f"task {task.id}: no valid skill after {self.retries + 1} answers; last: {problems[-1]}")
