"""guijax's local task suite: OSWorld-shaped tasks for the Xvfb desktop's Debian apps (xterm + tmux,
mousepad, LibreOffice Calc and Writer), each with a scripted solution (`solution`: a list of Action dicts,
one per env step) that the tests run through pyautogui.
"""
from __future__ import annotations

import pathlib

from envs.actions.model import Action
from envs.api import TaskError
from envs.osworld.env import action_from_dict
from envs.osworld.loader import OSWorldTask, load_osworld

LOCAL_TASKS_DIR = pathlib.Path(__file__).parent / "local_tasks"


def load_local_tasks(domains: tuple[str, ...] | None = None) -> list[OSWorldTask]:
    tasks = load_osworld(LOCAL_TASKS_DIR)
    return [t for t in tasks if domains is None or t.domain in domains]


def solution_actions(task: OSWorldTask) -> list[Action]:
    sol = task.task.extra.get("solution")
    if not isinstance(sol, list) or not sol:
        raise TaskError(f"{task.task.source} (task {task.id}): key 'solution' must be a non-empty list of actions")
    try:
        return [action_from_dict(a) for a in sol]
    except ValueError as e:
        raise TaskError(f"{task.task.source} (task {task.id}): {e}") from e


def run_solution(env, task: OSWorldTask) -> tuple[float, float]:
    """(score of the untouched initial state, score after the scripted solution), on a fresh reset."""
    env.reset(task)
    before = env.evaluate()
    for action in solution_actions(task):
        env.step(action)
    return before, env.evaluate()
