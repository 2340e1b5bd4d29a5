"""The Ray environment fleet on a local Ray instance (several actor processes): the same episodes as the
process pool, and a killed, hung or failing actor reported per slot and replaced, never raised."""
from __future__ import annotations

import os
import signal
import threading

import numpy as np
import pytest

from envs.actions.model import Action, ActionType
from envs.pool import DeskFactory, EnvPool
from envs.tasks import generate_desk_tasks

ray = pytest.importorskip("ray")
from envs.ray_pool import RayEnvPool  # noqa: E402


@pytest.fixture(scope="module")
def local_cluster():
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def tasks():
    return generate_desk_tasks(4, seed=0, families=["click_button"])


def _click(x=10, y=10):
    return Action(ActionType.CLICK, point=(x, y))


def test_actors_run_the_same_episodes_as_worker_processes(local_cluster, tasks):
    factory = DeskFactory(popups=True, seed=3)
    with RayEnvPool(factory, 3, cpus_per_worker=0.5) as fleet, EnvPool(factory, 3) as pool:
        pids = fleet.worker_pids()
        assert len(set(pids)) == 3 and os.getpid() not in pids  # one process per actor
        got = [p.reset(tasks[:3], seeds=[7, 8, 9]) for p in (fleet, pool)]
        for slot in range(3):
            assert got[0][slot].ok, got[0][slot].error
            np.testing.assert_array_equal(got[0][slot].value.screenshot, got[1][slot].value.screenshot)
        steps = [p.step({0: _click(), 2: _click(40, 60)}) for p in (fleet, pool)]
        for slot in (0, 2):
            np.testing.assert_array_equal(steps[0][slot].value.observation.screenshot,
                                          steps[1][slot].value.observation.screenshot)
        assert fleet.evaluate([0, 1, 2]).keys() == {0, 1, 2}


@pytest.mark.hostile
def test_an_actor_killed_mid_episode_ends_that_episode_with_the_reason_and_is_replaced(local_cluster, tasks):
    with RayEnvPool(DeskFactory(popups=False, step_latency_s=1.5), 3, cpus_per_worker=0.5, timeout_s=60) as fleet:
        assert all(r.ok for r in fleet.reset(tasks[:3]).values())
        victim = fleet.worker_pids()[1]
        threading.Timer(0.5, os.kill, (victim, signal.SIGKILL)).start()  # while the step is in flight
        results = fleet.step({0: _click(), 1: _click(), 2: _click()})
        assert results[0].ok and results[2].ok
        assert not results[1].ok and "env actor 1 died during 'step'" in results[1].error
        assert fleet.restarts == 1 and fleet.worker_pids()[1] not in (None, victim)
        again = fleet.reset([tasks[3]], slots=[1])  # the replacement takes the next episode
        assert again[1].ok


@pytest.mark.hostile
def test_a_hung_actor_times_out_and_an_environment_error_keeps_its_actor(local_cluster, tasks):
    with RayEnvPool(DeskFactory(popups=False, step_latency_s=30), 2, cpus_per_worker=0.5, timeout_s=1.0,
                    start_timeout_s=120) as fleet:
        pids = fleet.worker_pids()
        out = fleet.call("no_such_method", {0: ()})
        assert not out[0].ok and "AttributeError" in out[0].error and fleet.worker_pids()[0] == pids[0]
        assert fleet.restarts == 0
        slow = fleet.reset(tasks[:1], slots=[1])
        assert not slow[1].ok and "env actor 1 timed out after 1.0s in 'reset'" in slow[1].error
        assert fleet.restarts == 1 and fleet.worker_pids()[1] != pids[1]


@pytest.mark.hostile
def test_a_factory_that_fails_is_named_at_start(local_cluster):
    with pytest.raises(RuntimeError, match=r"env actor 0 failed to start: .*ConnectionError"):
        RayEnvPool(_DownServer(), 1, cpus_per_worker=0.5)


class _DownServer:
    def __call__(self):
        raise ConnectionError("desktop server at http://10.0.0.1:5000 is down")
