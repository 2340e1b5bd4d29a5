"""Task sets: loading OSWorld-shaped JSON from files or directories, generating synthetic-desk tasks by
generation-as-validation (EvoCUA), and named splits.
"""
from __future__ import annotations

import json
import pathlib
import random
from typing import Iterable, Sequence

from envs.api import Task, TaskError, read_json
from envs.atomic import write_text_atomic


def load_tasks(path: str | pathlib.Path) -> list[Task]:
    """One task file, a directory searched recursively for *.json, or a JSON list file of tasks."""
    path = pathlib.Path(path)
    if not path.exists():
        raise TaskError(f"task path not found: {path}")
    if path.is_dir():
        files = sorted(p for p in path.rglob("*.json") if p.is_file())
        if not files:
            raise TaskError(f"no *.json task files under {path}")
        return [Task.from_file(f) for f in files]
    data = read_json(path)
    if isinstance(data, list):
        return [task_from_entry(item, f"{path}[{i}]") for i, item in enumerate(data)]
    return [Task.from_dict(data, domain=path.parent.name, source=str(path))]


# A task saved in a list keeps the file it was first read from: its relative download URLs and cached
# files are beside that file, not beside the list (a run's tasks.json)
SOURCE_KEY = "guijax_task_file"


def task_entry(task: Task) -> dict:
    """The task as a list entry: its JSON, and the file it was read from (if one) under SOURCE_KEY."""
    kept = task.source and pathlib.Path(task.source).is_file()
    return {**task.to_dict(), **({SOURCE_KEY: task.source} if kept else {})}


def task_from_entry(item: object, where: str) -> Task:
    """A list entry `task_entry` wrote (or any task JSON); `where` names it when it has no file of its own."""
    if isinstance(item, dict) and isinstance(item.get(SOURCE_KEY), str):
        item = dict(item)
        return Task.from_dict(item, source=item.pop(SOURCE_KEY))
    return Task.from_dict(item, source=where)


def save_tasks(tasks: Iterable[Task], path: str | pathlib.Path) -> pathlib.Path:
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_text_atomic(path, json.dumps([task_entry(t) for t in tasks], indent=1))


def by_id(tasks: Sequence[Task], task_id: str) -> Task:
    for t in tasks:
        if t.id == task_id:
            return t
    raise TaskError(f"unknown task id {task_id!r} ({len(tasks)} tasks loaded)")


def generate_desk_tasks(n: int, seed: int = 0, families: Sequence[str] | None = None,
                        screen_hw: tuple[int, int] | None = None, max_tries: int = 20) -> list[Task]:
    """`n` desk tasks cycling over `families`. Each candidate is kept only if its validator rejects the
    initial state and accepts the state the noise-free scripted expert reaches (generation-as-validation);
    infeasible tasks must score 1 for the expert's FAIL and 0 for doing nothing."""
    from envs.desk.env import DEFAULT_SIZE, DeskEnv
    from envs.desk.expert import ScriptedExpert, run_expert
    from envs.desk.families import FAMILIES

    names = list(families or FAMILIES)
    unknown = [f for f in names if f not in FAMILIES]
    if unknown:
        raise TaskError(f"unknown desk task families {unknown}; known: {sorted(FAMILIES)}")
    size = tuple(screen_hw or DEFAULT_SIZE)
    rng = random.Random(seed)
    env = DeskEnv(size, seed=seed, popups=False)
    tasks: list[Task] = []
    for i in range(n):
        family = names[i % len(names)]
        for attempt in range(max_tries):
            spec = FAMILIES[family][1](rng, size)
            data = {"id": f"desk-{family}-s{seed}-{i:04d}", "instruction": spec["instruction"], "domain": family,
                    "config": spec["config"], "evaluator": spec["evaluator"], "expert": spec["expert"],
                    "difficulty": FAMILIES[family][0], "source": "synthetic_desk"}
            task = Task.from_dict(data, domain=family)
            env.reset(task)
            if env.evaluate() != 0.0:
                continue  # validator accepts the untouched state
            trace = run_expert(env, task, ScriptedExpert(noise=0.0))
            if trace.reward == 1.0:
                tasks.append(task)
                break
        else:
            raise TaskError(f"family {family!r}: no valid task in {max_tries} tries (seed {seed}, index {i})")
    return tasks


def split_tasks(tasks: Sequence[Task], *, held_out_families: Sequence[str] = (), held_out_fraction: float = 0.2,
                seed: int = 0) -> dict[str, list[Task]]:
    """'train' / 'held_out' splits: whole families can be held out, and of every other family a seeded
    round(fraction * size) of its tasks (so small task sets still get a held-out split)."""
    rng = random.Random(seed)
    families: dict[str, list[Task]] = {}
    for t in tasks:
        families.setdefault(t.domain, []).append(t)
    held_ids: set[str] = set()
    for name in sorted(families):
        members = families[name]
        if name in held_out_families:
            held_ids.update(t.id for t in members)
            continue
        order = list(members)
        rng.shuffle(order)
        held_ids.update(t.id for t in order[:round(held_out_fraction * len(order))])
    return {"train": [t for t in tasks if t.id not in held_ids], "held_out": [t for t in tasks if t.id in held_ids]}


split = split_tasks  # short name used in the issue text
