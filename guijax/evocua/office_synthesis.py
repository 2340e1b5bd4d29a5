"""EvoCUA's closed-loop synthesis (evocua.txt §3.2) for the local desktop's office apps, and its command:

    python -m guijax.evocua.office_synthesis --out=DIR --count=10 [--seed=0] [--capabilities=...]
        [--architect=chat --chat_url=URL --chat_model=NAME]

The architect is the offline one (guijax.evocua.office_architect) or a model (office_chat_architect). Each
scenario's proposal is written as an OSWorld task (DIR/examples/<domain>/<id>.json, its documents under
DIR/examples/assets/) and executed on a real Xvfb desktop: the validator must reject the freshly set-up state and accept the state
the reference solution reaches; a failure's error goes back to the architect, up to `max_attempts` times.
Kept tasks load with envs.osworld.loader.load_osworld, so `env.kind=osworld` with `env.osworld_dir=DIR`
trains on them; DIR/synthesis_report.json holds every attempt and the decontamination against the held-out
tasks given with --held_out (OSWorld's evaluation_examples, or any folder of task files).
"""
from __future__ import annotations

import dataclasses
import json
import pathlib
import random
import sys
import tempfile
import time
from typing import Any, Protocol, Sequence

from envs.api import Task, TaskError
from envs.atomic import write_text_atomic
from envs.osworld.env import EvaluationError
from envs.osworld.loader import OSWorldTask, load_osworld, parse_task
from envs.osworld.local import solution_actions
from guijax.evocua.office_architect import EXPECTED, OfficeArchitect, OfficeProposal
from guijax.evocua.office_resources import CAPABILITIES, OfficeScenario, OfficeScenarioSampler
from guijax.evocua.synthesis import SOURCE, Attempt, Verdict, closed_loop, rejection_counts

SNAPSHOT = "guijax-local"


def write_task(root: pathlib.Path, scenario: OfficeScenario, proposal: OfficeProposal, task_id: str,
               extra: dict[str, Any] | None = None) -> pathlib.Path:
    """The OSWorld task file and its two documents (as set up, as expected) under `root`; returns the file."""
    assets = root / "assets"
    assets.mkdir(parents=True, exist_ok=True)
    doc = scenario.document
    initial, expected = f"{task_id}-{doc.name}", f"{task_id}-expected-{doc.name}"
    doc.write(assets / initial)
    proposal.expected.write(assets / expected)
    evaluator = json.loads(json.dumps(proposal.evaluator))
    if evaluator.get("expected", {}).get("path") == EXPECTED:
        evaluator["expected"]["path"] = f"../assets/{expected}"
    task = {"id": task_id, "snapshot": SNAPSHOT, "instruction": proposal.instruction, "source": SOURCE,
            "config": [{"type": "download", "parameters": {"files": [{"url": f"../assets/{initial}",
                                                                      "path": f"~/{doc.name}"}]}},
                       {"type": "open", "parameters": {"path": f"~/{doc.name}"}}],
            "related_apps": ["libreoffice_calc" if scenario.domain == "calc" else "mousepad"],
            "evaluator": evaluator, "solution": proposal.solution,
            "synthesis": dict(extra or {}, scenario=scenario.to_dict())}
    path = root / scenario.domain / f"{task_id}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(task, indent=1))
    return path


class Desktop(Protocol):
    """What the sandbox needs of envs.desktop.env.DesktopEnv."""

    def reset(self, task: OSWorldTask): ...
    def step(self, action): ...
    def evaluate(self) -> float: ...


def _read_back(env: Desktop, scenario: OfficeScenario) -> str:
    """The document as the reference left it, for the error the architect reads (or why it cannot be read)."""
    home = getattr(getattr(env, "display", None), "home", None)
    if home is None:
        return ""
    path = pathlib.Path(home) / scenario.document.name
    if not path.exists():
        return f"; ~/{scenario.document.name} does not exist"
    try:
        if scenario.document.kind == "xlsx":
            import openpyxl

            rows = [list(r) for r in openpyxl.load_workbook(path).active.iter_rows(values_only=True)]
            return f"; the sheet holds {rows}"
        return f"; the file holds {path.read_text()!r}"
    except Exception as e:  # a file the app left unreadable is itself the answer the architect needs
        return f"; ~/{scenario.document.name} cannot be read back: {type(e).__name__}: {e}"


class DesktopSandbox:
    """Runs a written task on a desktop: the validator on the initial state, then after the reference."""

    def __init__(self, env: Desktop):
        self.env = env

    def check(self, scenario: OfficeScenario, task: OSWorldTask) -> Verdict:
        env = self.env
        try:
            env.reset(task)
            initial = env.evaluate()
        except (TaskError, EvaluationError, OSError) as e:
            return Verdict("structure", f"the task does not set up or evaluate on the desktop: {e}")
        if initial != 0.0:
            return Verdict("initial_state", "the validator accepts the state before any action (score "
                           f"{initial}): the expected file equals ~/{scenario.document.name} as set up")
        try:
            actions = solution_actions(task)
            for action in actions:
                env.step(action)
            final = env.evaluate()
        except (TaskError, EvaluationError, OSError, ValueError) as e:
            return Verdict("reference", f"the reference solution cannot be executed: {e}")
        if final != 1.0:
            return Verdict("reference", f"the validator ({task.evaluator.funcs[0]}) rejects the state the "
                           f"reference reaches after {len(actions)} actions{_read_back(env, scenario)}")
        return Verdict("passed")


@dataclasses.dataclass
class OfficeOutcome:
    scenario: OfficeScenario
    task_file: pathlib.Path | None
    attempts: list[Attempt]
    skipped: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"scenario": self.scenario.id, "capability": self.scenario.capability,
                "persona": self.scenario.persona, "task": self.task_file.stem if self.task_file else None,
                "skipped": self.skipped, "attempts": [a.to_dict() for a in self.attempts]}


class OfficeSynthesizer:
    """Propose, write, check on the desktop, feed the error back; accepted tasks are written under
    `out`/examples, where load_osworld(`out`) finds them."""

    def __init__(self, sandbox: DesktopSandbox, out: pathlib.Path, *, architect: Any = None,
                 sampler: OfficeScenarioSampler | None = None, max_attempts: int = 3, seed: int = 0):
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        self.sandbox, self.out = sandbox, pathlib.Path(out)
        self.architect = architect or OfficeArchitect()
        self.sampler = sampler or OfficeScenarioSampler()
        self.max_attempts, self.seed = max_attempts, seed

    def synthesize(self, scenario: OfficeScenario, task_id: str) -> OfficeOutcome:
        def check(proposal: OfficeProposal) -> tuple[Verdict, None]:
            with tempfile.TemporaryDirectory(prefix="office-candidate-") as tmp:
                staged = pathlib.Path(tmp)
                write_task(staged, scenario, proposal, task_id)
                (task,) = load_osworld(staged)
                return self.sandbox.check(scenario, task), None

        loop = closed_loop(self.architect, scenario, self.max_attempts, check)
        if loop.proposal is None:
            return OfficeOutcome(scenario, None, loop.attempts, loop.skipped)
        record = {"architect": self.architect.name, "capabilities": [scenario.capability],
                  "attempts": [a.to_dict() for a in loop.attempts]}
        return OfficeOutcome(scenario, write_task(self.out / "examples", scenario, loop.proposal, task_id, record),
                             loop.attempts)

    def run(self, count: int, max_scenarios: int | None = None, progress=None) -> list[OfficeOutcome]:
        """Scenarios until `count` tasks are accepted or `max_scenarios` (default 2 x count) were tried."""
        rng = random.Random(self.seed)
        outcomes: list[OfficeOutcome] = []
        limit = 2 * count if max_scenarios is None else max_scenarios
        while sum(o.task_file is not None for o in outcomes) < count and len(outcomes) < limit:
            i = len(outcomes)
            scenario = self.sampler.sample(rng, f"office-s{self.seed}-{i:04d}")
            outcomes.append(self.synthesize(scenario, f"syn-{scenario.capability}-s{self.seed}-{i:04d}"))
            if progress:
                progress(outcomes[-1])
        return outcomes


def decontaminate(outcomes: Sequence[OfficeOutcome], held_out: Sequence[OSWorldTask], *, ngram: int = 3,
                  thresholds=None) -> dict[str, Any]:
    """Each accepted task's overlap with the held-out tasks (instruction n-grams, setup, validator; §3.3);
    a task at a threshold is removed from the output folder with its documents. Returns the report part."""
    from guijax.evocua import quality

    thresholds = thresholds or quality.Thresholds()
    files = {o.task_file.stem: o.task_file for o in outcomes if o.task_file}
    accepted = [parse_task(Task.from_file(f)) for f in files.values()]
    overlap = quality.decontamination([t.task for t in accepted], [t.task for t in held_out], ngram=ngram,
                                      thresholds=thresholds)
    dropped = sorted(k for k, v in overlap.items() if v["dropped_by"])
    for task_id in dropped:
        path = files[task_id]
        for asset in (path.parent.parent / "assets").glob(f"{task_id}-*"):
            asset.unlink()
        path.unlink()
    return {"ngram": ngram, "thresholds": dataclasses.asdict(thresholds), "held_out_tasks": len(held_out),
            "dropped": dropped, "tasks": overlap}


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m guijax.evocua.office_synthesis", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for the tasks (created; OSWorld layout)")
    p.add_argument("--count", type=int, default=10, help="tasks to accept")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max_attempts", type=int, default=3)
    p.add_argument("--max_scenarios", type=int, default=0, help="scenarios to try at most (0: 2 x count)")
    p.add_argument("--capabilities", default=",".join(CAPABILITIES), help=f"comma-separated, of {sorted(CAPABILITIES)}")
    p.add_argument("--held_out", default="", help="folder of held-out OSWorld task files to decontaminate against")
    p.add_argument("--screen", default="1280x720", help="the desktop's WIDTHxHEIGHT")
    p.add_argument("--architect", default="procedural", choices=("procedural", "chat"),
                   help="the offline architect, or a model at --chat_url")
    p.add_argument("--chat_url", default="", help="chat architect: an OpenAI-compatible base URL")
    p.add_argument("--chat_model", default="")
    p.add_argument("--chat_api_key_env", default="OPENAI_API_KEY", help="the variable holding the key ('' for none)")
    p.add_argument("--chat_retries", type=int, default=2, help="chat architect: malformed answers asked again")
    args = p.parse_args(argv)
    from envs.desktop.checks import desktop_missing

    missing = desktop_missing(apps=True)
    if missing is not None:
        print(f"office synthesis needs the local desktop: {missing}", file=sys.stderr)
        return 2
    architect: Any = OfficeArchitect()
    if args.architect == "chat":
        if not (args.chat_url and args.chat_model):
            print("office synthesis: --architect=chat needs --chat_url and --chat_model", file=sys.stderr)
            return 2
        from guijax.chat import ChatClient
        from guijax.evocua.office_chat_architect import ChatOfficeArchitect

        architect = ChatOfficeArchitect(ChatClient(args.chat_url, args.chat_model, api_key_env=args.chat_api_key_env),
                                        retries=args.chat_retries)
    try:
        sampler = OfficeScenarioSampler(tuple(c for c in args.capabilities.split(",") if c))
        held_out = load_osworld(args.held_out) if args.held_out else []
        width, height = (int(x) for x in args.screen.lower().split("x"))
    except (ValueError, TaskError) as e:
        print(f"office synthesis: {e}", file=sys.stderr)
        return 2
    from envs.desktop.env import DesktopEnv

    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.time()

    def progress(o: OfficeOutcome) -> None:
        what = f"kept {o.task_file.stem}" if o.task_file else f"skipped ({o.skipped})"
        print(f"[{time.time() - start:6.0f}s] {o.scenario.id} {o.scenario.capability}: {len(o.attempts)} "
              f"attempt(s), {what}", flush=True)

    env = DesktopEnv((width, height), settle_s=0.3, step_limit=50)
    try:
        synthesizer = OfficeSynthesizer(DesktopSandbox(env), out, architect=architect, sampler=sampler,
                                        max_attempts=args.max_attempts, seed=args.seed)
        outcomes = synthesizer.run(args.count, args.max_scenarios or None, progress)
    finally:
        env.close()
    contamination = decontaminate(outcomes, held_out)
    kept = sum(o.task_file is not None for o in outcomes) - len(contamination["dropped"])
    summary = (f"{kept} office tasks kept of {sum(o.task_file is not None for o in outcomes)} accepted from "
               f"{len(outcomes)} scenarios ({sum(len(o.attempts) for o in outcomes)} attempts; rejected: "
               + (", ".join(f"{k} {v}" for k, v in rejection_counts(outcomes).items() if v) or "none")
               + f"); {len(contamination['dropped'])} overlapped the {len(held_out)} held-out tasks")
    record = {"summary": summary, "seed": args.seed, "architect": synthesizer.architect.name,
              "capabilities": list(sampler.capabilities), "seconds": round(time.time() - start, 1),
              "rejections": rejection_counts(outcomes), "decontamination": contamination,
              "outcomes": [o.to_dict() for o in outcomes]}
    write_text_atomic(out / "synthesis_report.json", json.dumps(record, indent=1))
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
