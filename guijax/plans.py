"""Plan extractors φ for BEPA LEVEL-1 (bepa.txt §4.1, Fig. 13): expert trace -> short numbered plan.

- `RulePlanExtractor` (default, offline): one imperative step per effective S2 action; drops what the
  Fig. 13 prompt tells the LLM to drop (dismissing pop-ups and banners, cancelled dialogs, waits, repeats).
- `ChatPlanExtractor`: any OpenAI-compatible /chat/completions endpoint with the paper's plan prompt; the
  key is read from an environment variable, never from the config. Tests never call it.
"""
from __future__ import annotations

import re
from typing import Protocol, Sequence

from envs.actions.s2 import ActionParseError, parse_s2
from envs.desk.expert import ExpertTrace

PLAN_PROMPT = """You are an expert at converting technical GUI automation traces into clear, actionable step-by-step plans.

Your Task: Analyze the complete execution trace and generate a clean, effective step-by-step plan. The trace contains *all* actions that were performed, including exploratory actions, mistakes, and corrections. Your job is to extract only the *effective* actions that contributed to task completion.

Critical Requirements:
1. Filter out exploratory / trial-and-error steps: remove actions that were exploratory attempts that did not work, were mistakes that needed correction, were redundant or duplicated, were verification steps that did not contribute to progress.
2. Keep only effective steps: include actions that successfully moved the task forward, were necessary for completion, represent the optimal path to achieve the goal.
3. Consolidate related actions: if multiple execution steps accomplish one logical action, combine them into a single step.

Output Format: Generate a clean, numbered step-by-step plan that:
1. starts with a brief task description,
2. lists each action as a simple, clear step,
3. uses action verbs (click, type, select, drag, press, etc.),
4. removes technical details and purposes,
5. combines related sub-steps when logical,
6. maintains the essential flow of actions,
7. contains *only* effective actions (no trial-and-error or exploration).

Now convert the following trace into a step-by-step plan:
"""

_NOISE = re.compile(r"pop-up|popup|banner|notification|\bCancel\b", re.IGNORECASE)


class PlanExtractor(Protocol):
    def __call__(self, trace: ExpertTrace) -> list[str]: ...


def trace_text(trace: ExpertTrace) -> str:
    """The trace as the LLM extractor reads it: task, then one S2 action per line."""
    lines = [f"Task: {trace.instruction}"] + [f"Step {i}: {s.s2}" for i, s in enumerate(trace.steps, 1)]
    return "\n".join(lines)


class RulePlanExtractor:
    def __call__(self, trace: ExpertTrace) -> list[str]:
        plan: list[str] = []
        for step in trace.steps:
            try:
                action = parse_s2(step.s2)
            except ActionParseError as e:
                raise ValueError(f"task {trace.task_id}: unreadable expert action {step.s2!r}: {e}") from None
            text = self._sentence(action.name, action.args)
            if text and (not plan or plan[-1] != text):
                plan.append(text)
        return plan

    @staticmethod
    def _sentence(name: str, a: dict) -> str | None:
        desc = a.get("element_description") or ""
        if _NOISE.search(desc) or name in ("wait", "done"):
            return None  # dismissing dynamic UI, waiting and the final report are not plan steps
        if name == "click":
            return f"Click {desc}" if a.get("num_clicks", 1) == 1 else f"Double-click {desc}"
        if name == "type":
            where = f" into {desc}" if desc else ""
            return f'Type "{a.get("text", "")}"{where}'
        if name == "drag_and_drop":
            return f"Drag {a['starting_description']} to {a['ending_description']}"
        if name == "scroll":
            return f"Scroll {desc} {'down' if a.get('clicks', -1) < 0 else 'up'}"
        if name == "hotkey":
            return "Press " + "+".join(k.capitalize() for k in a.get("keys", []))
        if name == "fail":
            return "Report that the task is infeasible"
        return f"{name.replace('_', ' ').capitalize()} {desc}".strip()


class ChatPlanExtractor:
    """φ backed by an LLM (the paper uses GPT-4o) at an OpenAI-compatible URL."""

    def __init__(self, url: str, model: str, api_key_env: str = "OPENAI_API_KEY", timeout_s: float = 60.0):
        from guijax.chat import ChatClient

        self.client = ChatClient(url, model, api_key_env, timeout_s)

    def __call__(self, trace: ExpertTrace) -> list[str]:
        text = self.client.complete([{"role": "user", "content": PLAN_PROMPT + "\n" + trace_text(trace)}])
        plan = parse_numbered_plan(text)
        if not plan:
            raise RuntimeError(f"plan extractor: no numbered step in the reply from {self.client.url} for task "
                               f"{trace.task_id}: {text[:200]!r}")
        return plan


def parse_numbered_plan(text: str) -> list[str]:
    """'Task: ...\\n1. Click X\\n2. Type Y' -> ['Click X', 'Type Y'] (the task line is dropped)."""
    return [m.group(1).strip() for m in re.finditer(r"^\s*\d+[.)]\s+(.+)$", text, re.MULTILINE)]


def make_extractor(kind: str, url: str = "", model: str = "", api_key_env: str = "OPENAI_API_KEY") -> PlanExtractor:
    if kind == "rule":
        return RulePlanExtractor()
    if kind == "chat":
        return ChatPlanExtractor(url, model, api_key_env)
    raise ValueError(f"unknown plan extractor {kind!r}; choose 'rule' or 'chat'")


def extract_plans(traces: Sequence[ExpertTrace], extractor: PlanExtractor) -> dict[str, list[str]]:
    return {t.task_id: extractor(t) for t in traces}
