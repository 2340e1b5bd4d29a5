"""OSWorld task JSON as typed tasks: setup steps, evaluator (metrics, getters, options, postconfig).

Parsing never fails on an unknown step, getter or metric type: those are listed by `unsupported(task)` so a
run can report, per task, what it lacks. Only malformed structure (a step without `type`, a metric list and
a getter list of different lengths) is a `TaskError` naming the file and key.
"""
from __future__ import annotations

import dataclasses
import pathlib
import re
from typing import Any

from envs.api import Task, TaskError, read_json


@dataclasses.dataclass(frozen=True)
class Step:
    """One setup / postconfig step: `type` names an OSWorld `_<type>_setup` handler."""

    type: str
    parameters: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Getter:
    """A result / expected getter config: `type` names an OSWorld `get_<type>` function."""

    type: str
    config: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Evaluator:
    funcs: tuple[str, ...]
    conj: str = "and"
    results: tuple[Getter | None, ...] = ()
    expected: tuple[Getter | None, ...] = ()
    options: tuple[dict[str, Any], ...] = ()
    postconfig: tuple[Step, ...] = ()

    @property
    def infeasible(self) -> bool:
        return "infeasible" in self.funcs


@dataclasses.dataclass(frozen=True)
class OSWorldTask:
    task: Task
    setup: tuple[Step, ...]
    evaluator: Evaluator
    related_apps: tuple[str, ...] = ()
    snapshot: str = ""

    @property
    def id(self) -> str:
        return self.task.id

    @property
    def domain(self) -> str:
        return self.task.domain


def _where(task: Task) -> str:
    return f"{task.source or '<dict>'} (task {task.id})"


def _steps(raw: Any, task: Task, key: str) -> tuple[Step, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise TaskError(f"{_where(task)}: {key} must be a list of steps")
    out = []
    for i, s in enumerate(raw):
        if not isinstance(s, dict) or not isinstance(s.get("type"), str):
            raise TaskError(f"{_where(task)}: {key}[{i}] must be an object with a string 'type'")
        params = s.get("parameters", {})
        if not isinstance(params, dict):
            raise TaskError(f"{_where(task)}: {key}[{i}].parameters must be an object")
        out.append(Step(s["type"], params))
    return tuple(out)


def _getters(raw: Any, n: int, task: Task, key: str) -> tuple[Getter | None, ...]:
    if raw is None or raw == {} or raw == []:
        return (None,) * n
    items = raw if isinstance(raw, list) else [raw]
    if isinstance(raw, list) and len(items) != n:
        raise TaskError(f"{_where(task)}: evaluator.{key} has {len(items)} getters for {n} metrics")
    if not isinstance(raw, list):
        items = items * n
    out: list[Getter | None] = []
    for i, g in enumerate(items):
        if g is None or g == {}:
            out.append(None)
        elif isinstance(g, dict) and isinstance(g.get("type"), str):
            out.append(Getter(g["type"], {k: v for k, v in g.items() if k != "type"}))
        else:
            raise TaskError(f"{_where(task)}: evaluator.{key}[{i}] must be an object with a string 'type'")
    return tuple(out)


def parse_evaluator(task: Task) -> Evaluator:
    ev = task.evaluator
    func = ev.get("func")
    funcs = tuple(func) if isinstance(func, list) else ((func,) if func else ())
    if not funcs or not all(isinstance(f, str) for f in funcs):
        raise TaskError(f"{_where(task)}: evaluator.func must be a metric name or a list of names")
    conj = ev.get("conj", "and")
    if conj not in ("and", "or"):
        raise TaskError(f"{_where(task)}: evaluator.conj must be 'and' or 'or', got {conj!r}")
    n = len(funcs)
    options = ev.get("options", {})
    if isinstance(options, list):
        if len(options) != n:
            raise TaskError(f"{_where(task)}: evaluator.options has {len(options)} entries for {n} metrics")
        opts = tuple(o or {} for o in options)
    elif isinstance(options, dict):
        opts = (options,) * n
    else:
        raise TaskError(f"{_where(task)}: evaluator.options must be an object or a list")
    results = _getters(ev.get("result"), n, task, "result")
    expected = _getters(ev.get("expected"), n, task, "expected")
    return Evaluator(funcs, conj, results, expected, opts, _steps(ev.get("postconfig"), task, "evaluator.postconfig"))


_SAFE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def parse_task(task: Task) -> OSWorldTask:
    # the id names the task's cache directory, which reset empties: no separators, no '..', not absolute
    if not _SAFE_ID.fullmatch(task.id) or ".." in task.id:
        raise TaskError(f"{_where(task)}: task id {task.id!r} must be letters, digits, '.', '_' or '-' (it names "
                        "a cache directory), without '..'")
    apps = task.extra.get("related_apps", [])
    return OSWorldTask(task=task, setup=_steps(list(task.config), task, "config"), evaluator=parse_evaluator(task),
                       related_apps=tuple(apps) if isinstance(apps, list) else (), snapshot=str(task.extra.get("snapshot", "")))


def load_osworld(root: str | pathlib.Path) -> list[OSWorldTask]:
    """Every task under `root` (an OSWorld checkout's `evaluation_examples`, its `examples/` folder, or one
    domain folder), sorted by domain then id. The domain is the task file's parent folder."""
    root = pathlib.Path(root)
    base = root / "examples" if (root / "examples").is_dir() else root
    if not base.is_dir():
        raise TaskError(f"OSWorld task folder not found: {base}")
    files = sorted(p for p in base.rglob("*.json") if p.is_file())
    if not files:
        raise TaskError(f"no OSWorld task files (*.json) under {base}")
    return [parse_task(Task.from_file(f)) for f in files]


def load_split(path: str | pathlib.Path, root: str | pathlib.Path) -> list[OSWorldTask]:
    """Tasks named by an OSWorld split file ({domain: [ids]}, e.g. test_all.json)."""
    path = pathlib.Path(path)
    split = read_json(path, "split file")
    if not isinstance(split, dict):
        raise TaskError(f"{path}: a split file maps domains to task id lists, got {type(split).__name__}")
    base = pathlib.Path(root)
    base = base / "examples" if (base / "examples").is_dir() else base
    out = []
    for domain, ids in split.items():
        for tid in ids:
            f = base / domain / f"{tid}.json"
            if not f.exists():
                raise TaskError(f"{path}: task {domain}/{tid} listed but {f} does not exist")
            out.append(parse_task(Task.from_file(f)))
    return out
