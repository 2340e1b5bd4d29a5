"""EvoCUA's quality assurance of synthesized tasks (evocua.txt §3.3), on the synthetic desk.

Consistency filtering: a reference agent (the desk's scripted expert, and optionally any policy given as a
callable) plays each task several episodes with the desk's pop-ups and banners on; where the validator
disagrees with the agent (the agent reports done and the validator rejects, the validator accepts a state
the agent did not finish in, or the task is never passed) the task is flagged, per task.

Tri-fold decontamination against the held-out tasks: instruction overlap (Jaccard of word n-grams, the
offline stand-in for the paper's LLM-judged semantic equivalence), configuration overlap (the same scene
content: windows and widgets, layout aside) and evaluator overlap (the same success conditions), each with
the nearest held-out task; tasks at or above a threshold are dropped.
"""
from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Callable, Mapping, Sequence

from envs.actions.model import Action, ActionType
from envs.api import DEFAULT_STEP_LIMIT, Observation, Task
from envs.desk.env import DEFAULT_SIZE, DeskEnv
from envs.desk.evaluate import evaluate_state
from envs.desk.expert import ScriptedExpert, run_expert

# A policy under test: (task, observation, step index) -> the action(s) of that step.
Policy = Callable[[Task, Observation, int], "Action | Sequence[Action]"]

REFERENCE = "scripted_expert"
# flags that make a task untrustworthy (the others describe its difficulty for a policy)
REJECTING = ("reference_done_rejected", "accepted_without_done", "reference_never_passes")


@dataclasses.dataclass
class AgentRecord:
    """One agent's episodes on one task: how often it reported done (FAIL on an infeasible task), how often
    the validator accepted, and the two kinds of disagreement."""

    episodes: int = 0
    claimed: int = 0
    passed: int = 0
    claimed_rejected: int = 0  # the agent reported done, the validator rejected the state
    accepted_unclaimed: int = 0  # the validator accepted a state the agent did not report done in

    @property
    def pass_rate(self) -> float:
        return self.passed / self.episodes if self.episodes else 0.0

    def add(self, claimed: bool, accepted: bool, reward: float) -> None:
        self.episodes += 1
        self.claimed += claimed
        self.passed += reward == 1.0
        self.claimed_rejected += claimed and not accepted
        self.accepted_unclaimed += accepted and not claimed

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"pass_rate": round(self.pass_rate, 4)}


def _verdict(env: DeskEnv, task: Task) -> tuple[bool, bool, float]:
    """(the agent reported done — FAIL on an infeasible task —, the validator accepts the final state, the
    episode's reward)."""
    if task.infeasible:
        claimed = env.last_control == ActionType.FAIL
        return claimed, claimed, env.evaluate()
    claimed = env.last_control == ActionType.FINISHED
    return claimed, evaluate_state(task, env.scene.state()) == 1.0, env.evaluate()


def _run_policy(env: DeskEnv, task: Task, policy: Policy) -> None:
    obs = env.reset(task)
    for step in range(env.step_limit):
        result = env.step(policy(task, obs, step))
        obs = result.observation
        if result.done:
            return


@dataclasses.dataclass
class TaskConsistency:
    task_id: str
    agents: dict[str, AgentRecord]
    flags: list[str]

    @property
    def keep(self) -> bool:
        return not any(f in REJECTING for f in self.flags)

    def to_dict(self) -> dict[str, Any]:
        return {"agents": {k: v.to_dict() for k, v in self.agents.items()}, "flags": self.flags, "keep": self.keep}


def consistency(tasks: Sequence[Task], *, episodes: int = 3, size: tuple[int, int] = DEFAULT_SIZE,
                step_limit: int = DEFAULT_STEP_LIMIT, seed: int = 0, popups: bool = True, expert_noise: float = 0.0,
                policies: Mapping[str, Policy] | None = None) -> dict[str, TaskConsistency]:
    """Each task played `episodes` times by the scripted expert and by every policy in `policies`; per task,
    the agents' records and the flags:

    reference_done_rejected   the expert reported done and the validator rejected (a false negative of the
                              validator, or a reference that stops early)
    accepted_without_done     the validator accepted a state the expert did not finish in (it accepts too much)
    reference_never_passes    pass rate 0 for the expert (unsolvable with the desk's dynamic UI)
    <policy>_never_passes / <policy>_always_passes   pass-rate outliers of a policy under test
    """
    if episodes < 1:
        raise ValueError(f"consistency needs episodes >= 1, got {episodes}")
    env = DeskEnv(tuple(size), step_limit, seed=seed, popups=popups)
    out = {}
    for task in tasks:
        agents = {REFERENCE: AgentRecord(), **{name: AgentRecord() for name in (policies or {})}}
        for k in range(episodes):
            run_expert(env, task, ScriptedExpert(noise=expert_noise, seed=seed + k))
            agents[REFERENCE].add(*_verdict(env, task))
            for name, policy in (policies or {}).items():
                _run_policy(env, task, policy)
                agents[name].add(*_verdict(env, task))
        ref = agents[REFERENCE]
        flags = [f for f, bad in (("reference_done_rejected", ref.claimed_rejected), ("accepted_without_done",
                                  ref.accepted_unclaimed), ("reference_never_passes", ref.passed == 0)) if bad]
        for name in policies or {}:
            rate = agents[name].pass_rate
            flags += [f"{name}_never_passes"] if rate == 0 else [f"{name}_always_passes"] if rate == 1 else []
        out[task.id] = TaskConsistency(task.id, agents, flags)
    return out


# ---- decontamination ----

def word_ngrams(text: str, n: int) -> set[tuple[str, ...]]:
    """Lower-cased word n-grams; a text shorter than n words is one gram of all its words."""
    words = re.findall(r"[a-z0-9]+", text.lower())
    if len(words) < n:
        return {tuple(words)} if words else set()
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


def jaccard(a: set, b: set) -> float:
    return len(a & b) / len(a | b) if a | b else 0.0


def config_signature(task: Task) -> set[str]:
    """The scene content: one item per window title and per widget (kind, name, text, state, options), the
    layout rectangles and pop-up rates left out; a non-desk setup step counts as one item."""
    out = set()
    for step in task.config:
        if step.get("type") != "desk_scene":
            out.add(json.dumps(step, sort_keys=True))
            continue
        for window in step.get("parameters", {}).get("windows", []):
            out.add(json.dumps(["window", window.get("title")]))
            for w in window.get("widgets", []):
                out.add(json.dumps([window.get("title"), {k: v for k, v in sorted(w.items()) if k != "rect"}],
                                   sort_keys=True))
    return out


def evaluator_signature(task: Task) -> set[str]:
    """The success conditions as 'window/widget.property=value' items; an evaluator without an `expected`
    dict (infeasible) has none to leak, and a non-desk evaluator counts as one item."""
    ev = task.evaluator
    expected = ev.get("expected")
    if ev.get("func") != "desk_state":
        return {json.dumps(ev, sort_keys=True)} if expected else set()
    out = set()
    for title, want in (expected or {}).items():
        if title == "front":
            out.add(f"front={want}")
            continue
        if "saved" in want:
            out.add(f"{title}.saved={want['saved']}")
        for name, props in want.get("widgets", {}).items():
            out |= {f"{title}/{name}.{k}={json.dumps(v)}" for k, v in props.items()}
    return out


@dataclasses.dataclass(frozen=True)
class Thresholds:
    """A synthesized task is dropped when an overlap reaches its threshold (1.0: only identical ones)."""

    instruction: float = 0.5
    config: float = 1.0
    evaluator: float = 1.0


def _nearest(mine: set, others: Sequence[tuple[str, set]]) -> dict[str, Any]:
    best, best_id = 0.0, None
    for task_id, theirs in others:
        score = jaccard(mine, theirs)
        if score > best:
            best, best_id = score, task_id
    return {"overlap": round(best, 4), "nearest": best_id}


def decontamination(tasks: Sequence[Task], held_out: Sequence[Task], *, ngram: int = 3,
                    thresholds: Thresholds = Thresholds()) -> dict[str, dict[str, Any]]:
    """{task id: {"instruction" | "config" | "evaluator": {"overlap", "nearest"}, "dropped_by": [...]}}"""
    if ngram < 1:
        raise ValueError(f"decontamination needs ngram >= 1, got {ngram}")
    held = {"instruction": [(t.id, word_ngrams(t.instruction, ngram)) for t in held_out],
            "config": [(t.id, config_signature(t)) for t in held_out],
            "evaluator": [(t.id, evaluator_signature(t)) for t in held_out]}
    out = {}
    for t in tasks:
        mine = {"instruction": word_ngrams(t.instruction, ngram), "config": config_signature(t),
                "evaluator": evaluator_signature(t)}
        row = {axis: _nearest(mine[axis], held[axis]) for axis in held}
        row["dropped_by"] = [axis for axis in held if row[axis]["nearest"] is not None
                             and row[axis]["overlap"] >= getattr(thresholds, axis)]
        out[t.id] = row
    return out


def decontaminate(tasks: Sequence[Task], held_out: Sequence[Task], *, ngram: int = 3,
                  thresholds: Thresholds = Thresholds()) -> tuple[list[Task], dict[str, dict[str, Any]]]:
    """The tasks below every threshold, and the per-task report."""
    report = decontamination(tasks, held_out, ngram=ngram, thresholds=thresholds)
    return [t for t in tasks if not report[t.id]["dropped_by"]], report
