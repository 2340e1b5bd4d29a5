"""EnvPool: batched episodes in worker processes, crash and hang recovery, no orphans."""
from __future__ import annotations

import dataclasses
import os
import pathlib
import signal
import subprocess
import sys
import threading
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


@dataclasses.dataclass(frozen=True)
class FlakyFactory:
    """A desk that cannot be built while `marker` exists (a remote VM that is down)."""

    marker: str

    def __call__(self):
        from envs.desk.env import DeskEnv

        if os.path.exists(self.marker):
            raise ConnectionError(f"server down ({self.marker})")
        return DeskEnv(popups=False)


@dataclasses.dataclass(frozen=True)
class DyingFactory:
    """A worker that dies while building its environment, before it can report anything."""

    def __call__(self):
        os._exit(3)


@dataclasses.dataclass(frozen=True)
class SlowStartFactory:
    """A desk that takes `delay_s` to build while `marker` exists (a VM that is slow to come back)."""

    marker: str
    delay_s: float

    def __call__(self):
        from envs.desk.env import DeskEnv

        if os.path.exists(self.marker):
            time.sleep(self.delay_s)
        return DeskEnv(popups=False)


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


@pytest.mark.hostile
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


@pytest.mark.hostile
def test_hung_worker_times_out_without_stalling_others(tasks):
    with EnvPool(SlowDeskFactory(), 2, timeout_s=3) as pool:
        pool.reset(tasks[:2])
        start = time.monotonic()
        out = pool.step({0: Action(ActionType.TYPE, text="hang"), 1: Action(ActionType.WAIT)})
        assert time.monotonic() - start < 20
        assert not out[0].ok and "timed out" in out[0].error and out[1].ok and pool.restarts == 1


@pytest.mark.hostile
def test_bad_input_errors(tasks):
    with EnvPool(DeskFactory(), 1, timeout_s=30) as pool:
        with pytest.raises(ValueError, match="run more episodes than workers in rounds"):
            pool.reset(tasks[:2])
        pool.reset(tasks[:1])
        out = pool.step({0: "click(1,2)"})
        assert not out[0].ok and "expects Action objects" in out[0].error


@pytest.mark.hostile
def test_worker_killed_mid_step(tasks):
    """SIGKILL while the worker is inside env.step: the call returns promptly with that episode errored."""
    with EnvPool(SlowDeskFactory(), 2, timeout_s=30) as pool:
        pool.reset(tasks[:2])
        victim = pool.worker_pids()[0]
        killer = threading.Timer(0.5, os.kill, (victim, signal.SIGKILL))
        killer.start()
        start = time.monotonic()
        out = pool.step({0: Action(ActionType.TYPE, text="hang"), 1: Action(ActionType.WAIT)})
        killer.join()
        assert time.monotonic() - start < 15
        assert not out[0].ok and "crashed during 'step'" in out[0].error and out[1].ok
        assert pool.restarts == 1 and not _alive(victim)
        assert pool.reset([tasks[3]], slots=[0])[0].ok


@pytest.mark.hostile
def test_unbuildable_worker_is_reported_not_raised(tasks, tmp_path):
    marker = tmp_path / "down"
    with EnvPool(FlakyFactory(str(marker)), 2, timeout_s=30) as pool:
        pool.reset(tasks[:2])
        marker.touch()
        os.kill(pool.worker_pids()[1], signal.SIGKILL)
        time.sleep(0.2)
        out = pool.step({0: Action(ActionType.WAIT), 1: Action(ActionType.WAIT)})
        assert out[0].ok and not out[1].ok and "crashed" in out[1].error
        again = pool.reset(tasks[:2])
        assert again[0].ok and not again[1].ok and "is down" in again[1].error and "server down" in again[1].error
        marker.unlink()
        assert pool.reset(tasks[:2])[1].ok  # retried and back


TRAINER = """
import time
from envs.actions.model import Action, ActionType
from envs.desk.env import DeskEnv
from envs.pool import EnvPool


class Hang:
    def __call__(self):
        class Hung(DeskEnv):
            def step(self, action):
                time.sleep(300)

        return Hung(popups=False)


if __name__ == "__main__":  # spawned workers re-import this file
    from envs.tasks import generate_desk_tasks

    pool = EnvPool(Hang(), 2, timeout_s=300)
    pool.reset(generate_desk_tasks(2, seed=0, families=["click_button"]))
    print(*pool.worker_pids(), flush=True)
    pool.step({0: Action(ActionType.WAIT), 1: Action(ActionType.WAIT)})
"""


@pytest.mark.hostile
def test_no_orphans_when_the_trainer_is_killed(tmp_path):
    """SIGKILL the trainer while its workers are busy in env.step: they must not outlive it."""
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    root = pathlib.Path(__file__).resolve().parents[2]
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, cwd=root,
                            env={**os.environ, "PYTHONPATH": str(root)})
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2 and all(_alive(p) for p in pids)
        time.sleep(0.5)  # the workers are now sleeping inside step
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = [p for p in pids if _alive(p)]
    for p in alive:  # do not leave them behind if the test fails
        os.kill(p, signal.SIGKILL)
    assert not alive


@pytest.mark.hostile
def test_a_worker_dying_at_start_is_an_error_naming_it():
    with pytest.raises(RuntimeError, match=r"env worker 0 died while starting \(exit code 3\)"):
        EnvPool(DyingFactory(), 1, timeout_s=10)


@pytest.mark.hostile
def test_a_crash_reports_how_the_worker_ended(tasks):
    with EnvPool(DeskFactory(), 1, timeout_s=30) as pool:
        pool.reset(tasks[:1])
        os.kill(pool.worker_pids()[0], signal.SIGKILL)
        out = pool.step({0: Action(ActionType.WAIT)})
        assert not out[0].ok and "killed by signal 9" in out[0].error and "None" not in out[0].error


@pytest.mark.hostile
def test_restarting_a_down_slot_does_not_eat_a_healthy_slots_time(tasks, tmp_path):
    """The restart of slot 1 takes 3 s of a 2 s call timeout; slot 0's episode must still come back."""
    marker = tmp_path / "slow"
    with EnvPool(SlowStartFactory(str(marker), 3.0), 2, timeout_s=2) as pool:
        pool.reset(tasks[:2])
        marker.touch()
        os.kill(pool.worker_pids()[1], signal.SIGKILL)
        time.sleep(0.2)
        out = pool.step({0: Action(ActionType.WAIT), 1: Action(ActionType.WAIT)})  # slot 1 crashed: restarted after
        assert out[0].ok and not out[1].ok
        pool._down[1] = "a VM being rebuilt"  # as _restart leaves a slot whose factory failed: the next call restarts it first (3 s)
        out = pool.reset(tasks[:2])
        assert out[0].ok, out[0].error  # healthy slot 0 got its full 2 s after the restart
