"""EnvPool: batched episodes in worker processes, crash and hang recovery, no orphans."""
from __future__ import annotations

import dataclasses
import os
import signal
import time

import pytest

from envs.actions.model import Action, ActionType
from envs.pool import DeskFactory, EnvPool
from envs.tasks import generate_desk_tasks


@dataclasses.dataclass(frozen=True)
class SlowDeskFactory:
    """A desk whose step sleeps when asked to type 'hang' (to test per-call timeouts)."""

    def __call__(self):
        from envs.desk.env import DeskEnv

        class Slow(DeskEnv):
            def step(self, action):
                if isinstance(action, Action) and action.text == "hang":
                    time.sleep(60)
                return super().step(action)

        return Slow(popups=False)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie still answers kill(0)
        return f.read().split()[2] != "Z"


@pytest.fixture(scope="module")
def tasks():
    return generate_desk_tasks(4, seed=0, families=["click_button", "toggle_checkbox", "type_field", "set_slider"])


def test_batched_episodes_end_at_different_times(tasks):
    with EnvPool(DeskFactory(popups=False), 3, timeout_s=30) as pool:
        obs = pool.reset(tasks[:3], seeds=[1, 2, 3])
        assert all(r.ok for r in obs.values()) and obs[0].value.screenshot.shape == (280, 280, 3)
        steps = pool.step({0: Action(ActionType.FINISHED), 1: Action(ActionType.WAIT), 2: [Action(ActionType.WAIT)]})
        assert steps[0].value.done and not steps[1].value.done and not steps[2].value.done
        steps = pool.step({1: Action(ActionType.FAIL), 2: Action(ActionType.WAIT)})
        assert steps[1].value.done and set(steps) == {1, 2}
        scores = pool.evaluate([0, 1, 2])
        assert [scores[i].value for i in range(3)] == [0.0, 0.0, 0.0]


def test_same_seed_same_episode_in_any_worker(tasks):
    with EnvPool(DeskFactory(), 2, timeout_s=30) as pool:
        a = pool.reset([tasks[0], tasks[0]], seeds=[7, 7])
        assert (a[0].value.screenshot == a[1].value.screenshot).all()
        assert a[0].value.a11y_tree == a[1].value.a11y_tree


def test_killed_worker_is_restarted_and_episode_errored(tasks):
    pool = EnvPool(DeskFactory(popups=False), 2, timeout_s=30)
    try:
        pool.reset(tasks[:2])
        victim = pool.worker_pids()[0]
        os.kill(victim, signal.SIGKILL)
        time.sleep(0.2)
        out = pool.step({0: Action(ActionType.WAIT), 1: Action(ActionType.WAIT)})
        assert not out[0].ok and "crashed" in out[0].error and out[1].ok
        assert pool.restarts == 1 and pool.worker_pids()[0] != victim and not _alive(victim)
        again = pool.reset([tasks[2]], slots=[0])  # the restarted worker serves new episodes
        assert again[0].ok
    finally:
        pids = pool.worker_pids()
        pool.close()
    time.sleep(0.2)
    assert not any(_alive(p) for p in pids)


def test_hung_worker_times_out_without_stalling_others(tasks):
    with EnvPool(SlowDeskFactory(), 2, timeout_s=3) as pool:
        pool.reset(tasks[:2])
        start = time.monotonic()
        out = pool.step({0: Action(ActionType.TYPE, text="hang"), 1: Action(ActionType.WAIT)})
        assert time.monotonic() - start < 20
        assert not out[0].ok and "timed out" in out[0].error and out[1].ok and pool.restarts == 1


def test_bad_input_errors(tasks):
    with EnvPool(DeskFactory(), 1, timeout_s=30) as pool:
        with pytest.raises(ValueError, match="run more episodes than workers in rounds"):
            pool.reset(tasks[:2])
        pool.reset(tasks[:1])
        out = pool.step({0: "click(1,2)"})
        assert not out[0].ok and "expects Action objects" in out[0].error
