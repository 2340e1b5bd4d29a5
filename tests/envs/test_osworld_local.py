"""The local task suite on a real Xvfb desktop: for every task the evaluator rejects the untouched initial
state and accepts the scripted solution executed through pyautogui. One desktop serves all tasks (reset
closes the previous task's apps). Every task runs in the default suite (and so in CI, with the Xvfb and Debian
apps .ci/setup_desktop.sh installs); about two minutes on 2 cores."""
import os
import pathlib

import pytest

from envs.desktop.checks import desktop_missing
from envs.osworld.local import load_local_tasks, run_solution

MISSING = desktop_missing(apps=True)
pytestmark = [pytest.mark.desktop, pytest.mark.skipif(MISSING is not None, reason=str(MISSING))]

TASKS = load_local_tasks()


@pytest.fixture(scope="module")
def env():
    from envs.desktop.env import DesktopEnv

    e = DesktopEnv((1280, 720), settle_s=0.3, step_limit=50)
    yield e
    e.close()


def test_suite_has_at_least_20_tasks_over_four_apps():
    assert len(TASKS) >= 20
    assert {t.domain for t in TASKS} == {"terminal", "editor", "calc", "writer"}
    assert len({t.id for t in TASKS}) == len(TASKS)


@pytest.mark.parametrize("task", [pytest.param(t, id=t.id) for t in TASKS])
def test_evaluator_rejects_initial_state_and_accepts_scripted_solution(env, task):
    before, after = run_solution(env, task)
    assert before == 0.0, f"{task.id}: the untouched initial state must score 0"
    assert after == 1.0, f"{task.id}: the scripted solution must score 1"


REPO = pathlib.Path(__file__).resolve().parents[2]
OSWORLD = pathlib.Path(os.environ.get("GUIJAX_OSWORLD_DIR", REPO.parent / "shared" / "osworld"))
if not OSWORLD.exists():
    OSWORLD = pathlib.Path("/work/shared/osworld")


@pytest.mark.skipif(not (OSWORLD / "examples").is_dir(), reason=f"OSWorld task files not at {OSWORLD}")
def test_osworld_tasks_that_run_as_they_are(env):
    """Every OSWorld task the coverage check calls runnable sets up and evaluates here: the untouched state
    scores 0, and on infeasible tasks FAIL scores 1."""
    from envs.actions.model import Action, ActionType
    from envs.osworld.coverage import task_needs
    from envs.osworld.loader import load_osworld

    runnable = [t for t in load_osworld(OSWORLD) if not task_needs(t)]
    assert len(runnable) >= 4
    for t in runnable:
        env.reset(t)
        assert env.evaluate() == 0.0, t.id
        if t.evaluator.infeasible:
            env.step(Action(ActionType.FAIL))
            assert env.evaluate() == 1.0, t.id
