"""EvoCUA's agentic dual-stream synthesis (evocua.txt §3.2) on the synthetic desk, with its closed loop.

For a sampled scenario (guijax.evocua.task_space) a task architect proposes an instruction g, an executable
validator V_g in the desk's evaluator format (`desk_state` with an `expected` dict, or `infeasible`) and a
reference solution (the scripted expert's subgoals). The sandbox then executes V_g on a real DeskEnv:

- against the scene's initial state, where it must reject (else the task is solved before it starts);
- against the state the reference solution reaches, where it must accept (else V_g or the reference is wrong).

A failed check's error goes back to the architect with the scenario, and the task is regenerated, up to
`max_attempts`; every attempt and its error is kept in the task's `synthesis` field. Accepted tasks are
OSWorld-shaped like envs/desk/families.py's, so envs.tasks loads and saves them.
"""
from __future__ import annotations

import dataclasses
import json
import random
from typing import Any, Callable, Protocol, Sequence

from envs.actions.model import ActionType
from envs.api import DEFAULT_STEP_LIMIT, Task, TaskError
from envs.desk.a11y import GroundingError
from envs.desk.env import DEFAULT_SIZE, DeskEnv
from envs.desk.expert import ScriptedExpert, run_expert
from guijax.evocua.task_space import Scenario, ScenarioSampler

SOURCE = "evocua_synthesis"
WIDGET_PROPERTIES = ("clicks_at_least", "checked", "text", "value")  # envs/desk/evaluate.py's vocabulary
# the scripted expert's subgoal ops and the keys (and types) each needs
SUBGOAL_KEYS: dict[str, dict[str, type | tuple[type, ...]]] = {
    "click": {"window": str, "target": str}, "check": {"window": str, "target": str, "value": bool},
    "type": {"window": str, "target": str, "text": str}, "select": {"window": str, "target": str, "option": str},
    "slider": {"window": str, "target": str, "value": int}, "list_select": {"window": str, "target": str, "item": str},
    "focus_window": {"target": str}, "confirm": {}, "hotkey": {"keys": list}, "done": {}, "fail": {}}
# rejections by the check that failed
CHECKS = ("format", "structure", "initial_state", "reference")
POPUPS = {"popup_prob": 0.3, "popup_step_prob": 0.05, "banner_prob": 0.2, "banner_step_prob": 0.03}


class ProposalError(ValueError):
    """An architect's answer that is not a well-formed (instruction, validator, reference) proposal."""


class ArchitectSkipped(RuntimeError):
    """The architect gave up on a scenario (unreachable, or no well-formed answer within its retries)."""

    def __init__(self, reason: str, problems: Sequence[str] = ()):
        super().__init__(reason)
        self.problems = list(problems)


@dataclasses.dataclass(frozen=True)
class Proposal:
    instruction: str
    evaluator: dict[str, Any]
    expert: list[dict[str, Any]]
    raw: str = ""  # the architect's own text, replayed to it with the sandbox's verdict
    format_errors: tuple[str, ...] = ()  # malformed answers the architect retried before this one

    def to_dict(self) -> dict[str, Any]:
        return {"instruction": self.instruction, "evaluator": self.evaluator, "expert": self.expert}


@dataclasses.dataclass(frozen=True)
class Attempt:
    """One proposal and the check it failed ("passed" when it was accepted)."""

    index: int
    check: str
    error: str = ""
    proposal: dict[str, Any] | None = None
    raw: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"index": self.index, "check": self.check, "error": self.error, "proposal": self.proposal}


class TaskArchitect(Protocol):
    """Writes (instruction, validator, reference) for a scenario; `history` holds the earlier attempts on the
    same scenario with the sandbox's errors, so the next proposal can repair them."""

    name: str

    def propose(self, scenario: Scenario, history: Sequence[Attempt]) -> Proposal: ...


def _need(data: Any, key: str, typ, where: str) -> Any:
    if key not in data:
        raise ProposalError(f"{where}: missing key {key!r}")
    value = data[key]
    if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
        raise ProposalError(f"{where}: key {key!r} must be {getattr(typ, '__name__', typ)}, got {type(value).__name__}")
    return value


def _parse_evaluator(ev: Any, where: str) -> dict[str, Any]:
    if not isinstance(ev, dict):
        raise ProposalError(f"{where}: 'evaluator' must be an object, got {type(ev).__name__}")
    func = ev.get("func")
    if func == "infeasible":
        extra = sorted(set(ev) - {"func"})
        if extra:
            raise ProposalError(f"{where}: an 'infeasible' evaluator has only 'func'; got keys {extra}")
        return {"func": "infeasible"}
    if func != "desk_state":
        raise ProposalError(f"{where}: evaluator.func must be 'desk_state' or 'infeasible', got {func!r}")
    extra = sorted(set(ev) - {"func", "expected", "options"})
    if extra:
        raise ProposalError(f"{where}: unknown evaluator keys {extra}")
    expected = _need(ev, "expected", dict, f"{where} evaluator")
    if not expected:
        raise ProposalError(f"{where}: evaluator.expected is empty, so it accepts any state")
    for title, want in expected.items():
        at = f"{where} evaluator.expected[{title!r}]"
        if title == "front":
            if not isinstance(want, str):
                raise ProposalError(f"{at}: must be a window title")
            continue
        if not isinstance(want, dict) or not set(want) <= {"saved", "widgets"} or not want:
            raise ProposalError(f"{at}: must be an object with 'widgets' and/or 'saved'")
        if "saved" in want and not isinstance(want["saved"], bool):
            raise ProposalError(f"{at}.saved must be true or false")
        widgets = _need(want, "widgets", dict, at) if "widgets" in want else {}
        for name, props in widgets.items():
            if not isinstance(props, dict) or not props:
                raise ProposalError(f"{at}.widgets[{name!r}]: must be a non-empty object of properties")
            unknown = sorted(set(props) - set(WIDGET_PROPERTIES))
            if unknown:
                raise ProposalError(f"{at}.widgets[{name!r}]: unknown properties {unknown}; "
                                    f"known: {list(WIDGET_PROPERTIES)}")
    options = ev.get("options", {"slider_tolerance": 3})
    if not isinstance(options, dict) or not set(options) <= {"slider_tolerance"}:
        raise ProposalError(f"{where}: evaluator.options may hold only 'slider_tolerance'")
    return {"func": "desk_state", "expected": expected, "options": options}


def _parse_expert(steps: Any, infeasible: bool, where: str) -> list[dict[str, Any]]:
    if not isinstance(steps, list) or not steps:
        raise ProposalError(f"{where}: 'expert' must be a non-empty list of subgoals")
    for i, step in enumerate(steps):
        at = f"{where} expert[{i}]"
        if not isinstance(step, dict):
            raise ProposalError(f"{at}: a subgoal must be an object")
        op = step.get("op")
        if op not in SUBGOAL_KEYS:
            raise ProposalError(f"{at}: unknown op {op!r}; known: {sorted(SUBGOAL_KEYS)}")
        for key, typ in SUBGOAL_KEYS[op].items():
            _need(step, key, typ, f"{at} ({op})")
        extra = sorted(set(step) - {"op"} - set(SUBGOAL_KEYS[op]))
        if extra:
            raise ProposalError(f"{at} ({op}): unknown keys {extra}")
        if op == "hotkey" and not all(isinstance(k, str) for k in step["keys"]):
            raise ProposalError(f"{at} (hotkey): keys must be strings")
        if op == "slider" and not 0 <= step["value"] <= 100:
            raise ProposalError(f"{at} (slider): value must be in [0, 100]")
    last = "fail" if infeasible else "done"
    if steps[-1]["op"] != last or any(s["op"] in ("done", "fail") for s in steps[:-1]):
        raise ProposalError(f"{where}: the reference must end with exactly one {last!r} subgoal, at the end")
    return steps


def parse_proposal(data: Any, where: str, raw: str = "") -> Proposal:
    """`data` checked strictly as {"instruction", "evaluator", "expert"}; a ProposalError names `where` and
    the key at fault."""
    if not isinstance(data, dict):
        raise ProposalError(f"{where}: the answer must be a JSON object, got {type(data).__name__}")
    extra = sorted(set(data) - {"instruction", "evaluator", "expert"})
    if extra:
        raise ProposalError(f"{where}: unknown keys {extra}; expected exactly instruction, evaluator, expert")
    instruction = _need(data, "instruction", str, where).strip()
    if not instruction:
        raise ProposalError(f"{where}: 'instruction' is empty")
    if "evaluator" not in data:
        raise ProposalError(f"{where}: missing key 'evaluator'")
    evaluator = _parse_evaluator(data["evaluator"], where)
    expert = _parse_expert(_need(data, "expert", list, where), evaluator["func"] == "infeasible", where)
    return Proposal(instruction, evaluator, expert, raw)


def build_task(scenario: Scenario, proposal: Proposal, task_id: str, popups: dict[str, float] = POPUPS) -> Task:
    """The OSWorld-shaped desk task: the scenario's scene as the `desk_scene` setup step (with the desk's
    dynamic pop-ups and banners), the proposal's validator and reference."""
    actions = [s for s in proposal.expert if s["op"] not in ("done", "fail", "focus_window")]
    data = {"id": task_id, "instruction": proposal.instruction, "domain": "syn_" + "+".join(scenario.capabilities),
            "config": [{"type": "desk_scene", "parameters": {"windows": scenario.windows, **popups}}],
            "evaluator": proposal.evaluator, "expert": proposal.expert,
            "difficulty": max(1, min(5, len(actions))), "source": SOURCE,
            "synthesis": {"scenario": scenario.id, "capabilities": list(scenario.capabilities),
                          "persona": scenario.persona}}
    return Task.from_dict(json.loads(json.dumps(data)), domain=data["domain"])


def _unmet(expected: dict[str, Any], state: dict[str, Any]) -> dict[str, str]:
    """{'Window/Widget.property' (or 'Window.saved', 'front'): 'expected X, found Y'} for each expected value
    the state does not hold."""
    out = {}
    for title, want in expected.items():
        if title == "front":
            if state["front"] != want:
                out["front"] = f"expected {want!r}, found {state['front']!r}"
            continue
        window = state["windows"].get(title, {})
        if "saved" in want and bool(window.get("saved")) != want["saved"]:
            out[f"{title}.saved"] = f"expected {want['saved']}, found {bool(window.get('saved'))}"
        for name, props in want.get("widgets", {}).items():
            got = window.get("widgets", {}).get(name, {})
            for key, value in props.items():
                found = got.get("clicks", 0) if key == "clicks_at_least" else got.get(key)
                if (found < value) if key == "clicks_at_least" else found != value:
                    out[f"{title}/{name}.{key}"] = f"expected {value!r}, found {found!r}"
    return out


def _expected_keys(expected: dict[str, Any]) -> list[str]:
    """Every value `expected` checks, named as `_unmet` names them."""
    out = []
    for title, want in expected.items():
        if title == "front":
            out.append("front")
            continue
        if "saved" in want:
            out.append(f"{title}.saved")
        out += [f"{title}/{n}.{k}" for n, props in want.get("widgets", {}).items() for k in props]
    return out


@dataclasses.dataclass(frozen=True)
class Verdict:
    check: str  # "passed" or the check that failed (CHECKS)
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.check == "passed"


class Sandbox:
    """Executes a task's validator on a static DeskEnv (no pop-ups): initial state, then after the reference."""

    def __init__(self, size: tuple[int, int] = DEFAULT_SIZE, step_limit: int = DEFAULT_STEP_LIMIT, seed: int = 0):
        self.env = DeskEnv(tuple(size), step_limit, seed=seed, popups=False)

    def check(self, task: Task) -> Verdict:
        env = self.env
        try:
            env.reset(task)
            initial = env.evaluate()
        except (TaskError, KeyError, ValueError) as e:
            return Verdict("structure", f"the scene or the validator does not fit the desk: {e}")
        if initial != 0.0:
            expected = task.evaluator.get("expected", {})
            held = [k for k in _expected_keys(expected) if k not in _unmet(expected, env.scene.state())]
            return Verdict("initial_state", "the validator accepts the initial state (score 1 before any action); "
                           f"these expected values already hold: {held}")
        try:
            trace = run_expert(env, task, ScriptedExpert(noise=0.0))
        except (GroundingError, KeyError, ValueError, TypeError) as e:
            return Verdict("reference", f"the reference solution cannot be executed: {e}")
        except TaskError as e:
            return Verdict("structure", f"the validator does not fit the desk: {e}")
        ended = trace.steps[-1].s2 if trace.steps else "no step"
        how = (f"it hit the step limit of {env.step_limit}" if len(trace.steps) >= env.step_limit and
               not ended.startswith(("done", "fail")) else f"its last action was {ended!r}")
        if trace.reward == 1.0:
            if task.infeasible or env.last_control == ActionType.FINISHED:
                return Verdict("passed")
            return Verdict("reference", f"the reference reaches the validator's state but does not report done ({how})")
        if task.infeasible:
            return Verdict("reference", f"the validator is 'infeasible' but the reference did not report failure ({how})")
        unmet = [f"{k}: {v}" for k, v in _unmet(task.evaluator.get("expected", {}), env.scene.state()).items()]
        return Verdict("reference", f"the validator rejects the state the reference solution reaches ({how}); "
                       f"unmet: {unmet or 'none, but the reference reported failure'}")


@dataclasses.dataclass
class Outcome:
    """What synthesis made of one scenario: the accepted task (None when none), every attempt, and why it
    was skipped."""

    scenario: Scenario
    task: Task | None
    attempts: list[Attempt]
    skipped: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"scenario": self.scenario.id, "capabilities": list(self.scenario.capabilities),
                "persona": self.scenario.persona, "task": self.task.id if self.task else None,
                "skipped": self.skipped, "attempts": [a.to_dict() for a in self.attempts]}


@dataclasses.dataclass
class LoopResult:
    """The closed loop's end: the proposal that passed and what `check` built for it (None when none passed,
    with the reason in `skipped`), and every attempt."""

    proposal: Any
    candidate: Any
    attempts: list[Attempt]
    skipped: str = ""


def closed_loop(architect: Any, scenario: Any, max_attempts: int,
                check: Callable[[Any], tuple[Verdict, Any]]) -> LoopResult:
    """Propose, check, feed the verdict back, up to `max_attempts` proposals: the loop every sandbox shares.
    `check(proposal)` -> (verdict, what it built); a TaskError there is a failed structure check."""
    attempts: list[Attempt] = []
    for _ in range(max_attempts):
        try:
            proposal = architect.propose(scenario, list(attempts))
        except ArchitectSkipped as e:
            attempts += [Attempt(len(attempts), "format", p) for p in e.problems]
            return LoopResult(None, None, attempts, f"architect {architect.name}: {e}")
        attempts += [Attempt(len(attempts), "format", p) for p in proposal.format_errors]
        try:
            verdict, candidate = check(proposal)
        except TaskError as e:
            verdict, candidate = Verdict("structure", str(e)), None
        attempts.append(Attempt(len(attempts), verdict.check, verdict.error, proposal.to_dict(), proposal.raw))
        if verdict.ok:
            return LoopResult(proposal, candidate, attempts)
    return LoopResult(None, None, attempts,
                      f"no proposal passed the sandbox in {max_attempts} attempts; last: {attempts[-1].error}")


class Synthesizer:
    """The closed loop: propose, build, check in the sandbox, feed the error back; `max_attempts` proposals
    per scenario."""

    def __init__(self, architect: TaskArchitect, sampler: ScenarioSampler, *, max_attempts: int = 3,
                 step_limit: int = DEFAULT_STEP_LIMIT, seed: int = 0, popups: dict[str, float] = POPUPS):
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        self.architect, self.sampler, self.max_attempts = architect, sampler, max_attempts
        self.sandbox = Sandbox(sampler.size, step_limit, seed)
        self.seed, self.popups = seed, dict(popups)

    def synthesize(self, scenario: Scenario, task_id: str) -> Outcome:
        def check(proposal: Proposal) -> tuple[Verdict, Task]:
            task = build_task(scenario, proposal, task_id, self.popups)
            return self.sandbox.check(task), task

        loop = closed_loop(self.architect, scenario, self.max_attempts, check)
        if loop.proposal is None:
            return Outcome(scenario, None, loop.attempts, loop.skipped)
        extra = dict(loop.candidate.extra)
        extra["synthesis"] = dict(extra["synthesis"], architect=self.architect.name,
                                  attempts=[a.to_dict() for a in loop.attempts])
        return Outcome(scenario, dataclasses.replace(loop.candidate, extra=extra), loop.attempts)

    def run(self, count: int, max_scenarios: int | None = None) -> list[Outcome]:
        """Scenarios until `count` tasks are accepted or `max_scenarios` (default 4 x count) were tried."""
        rng = random.Random(self.seed)
        outcomes: list[Outcome] = []
        accepted = 0
        limit = 4 * count if max_scenarios is None else max_scenarios
        while accepted < count and len(outcomes) < limit:
            i = len(outcomes)
            scenario = self.sampler.sample(rng, f"scenario-s{self.seed}-{i:04d}")
            outcome = self.synthesize(scenario, f"syn-{'+'.join(scenario.capabilities)}-s{self.seed}-{i:04d}")
            outcomes.append(outcome)
            accepted += outcome.task is not None
        return outcomes


def rejection_counts(outcomes: Sequence[Outcome]) -> dict[str, int]:
    """Failed attempts by the check that rejected them, over every scenario."""
    counts = {c: 0 for c in CHECKS}
    for o in outcomes:
        for a in o.attempts:
            if a.check != "passed":
                counts[a.check] += 1
    return counts
