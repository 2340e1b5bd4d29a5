"""The RL loop with asynchronous rollouts (`rollout.mode=async`) on the tiny recipe: what each iteration trains
on, its staleness and utilisation metrics, and a resume that loses no completed group and trains none twice."""
from __future__ import annotations

import copy
import json
import pathlib
import shutil

import pytest

from guijax.data.store import TrajectoryStore
from guijax.methods import get_method
from guijax.pipeline import base_stages
from guijax.pipeline.registry import run_stages
from guijax.pipeline.run import Run
from guijax.rollout.stream import group_index, sampling_version

ASYNC = ("stages=('base_model', 'tasks', 'sft')", "env.num_tasks=6", "sft.steps=4", "rollout.mode=async",
         "train.checkpoint_every=1", "rollout.max_staleness=1")


def _records(workdir: pathlib.Path) -> list[dict]:
    return [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines() if '"iteration"' in x]


def _with(config, **rollout_train):
    config = copy.deepcopy(config)
    with config.unlocked():
        for key, value in rollout_train.items():
            section, name = key.split("__")
            config[section][name] = value
    return config


def _groups_in(workdir: pathlib.Path) -> dict[int, list]:
    store = TrajectoryStore(workdir / "trajectories")
    out = {}
    for path in store.shards:
        index = group_index(path.name)
        assert index is not None, f"{path.name}: asynchronous runs write only group shards"
        out[index] = [store.at(path.name, m) for m in range(2)]
    return out


@pytest.fixture(scope="module")
def resumed(tiny_config, tmp_path_factory):
    """Two iterations, a stop (the stream had run ahead), then the same run continued to four."""
    config = tiny_config("grpo_cpu", *ASYNC)
    workdir = tmp_path_factory.mktemp("async") / "run"
    run_stages(config, workdir)
    run = Run(config, workdir)
    rl_dir = workdir / "rl"
    first = _with(config, train__iterations=2)
    base_stages.train_with(run, get_method("grpo", first), rl_dir, "grpo")
    before = _groups_in(rl_dir)
    shutil.copytree(rl_dir / "checkpoints", workdir / "checkpoints_after_2")
    _, history = base_stages.train_with(run, get_method("grpo", _with(config, train__iterations=4)), rl_dir, "grpo")
    yield config, rl_dir, before, history
    run.close()


def test_each_iteration_trains_complete_groups_within_the_staleness_bound(resumed):
    config, rl_dir, _, _ = resumed
    records = _records(rl_dir)
    assert [r["iteration"] for r in records] == [0, 1, 2, 3] == [r["policy_version"] for r in records]
    groups = _groups_in(rl_dir)
    for r in records:
        assert len(r["groups"]) == 2  # tasks_per_iteration complete groups, whatever was dropped
        for index in r["groups"]:
            lag = r["iteration"] - sampling_version(groups[index], r["iteration"])
            assert lag <= 1 and all(len(t.meta["policy_versions"]) == len(t.steps) for t in groups[index])
        for index in r["stale_groups"]:  # dropped only when sampled more than max_staleness updates ago
            assert r["iteration"] - sampling_version(groups[index], r["iteration"]) > 1
        assert r["stale_dropped"] == 2 * len(r["stale_groups"])
        assert r["staleness_max"] <= 1 and 0 <= r["staleness_mean"] <= r["staleness_max"]
        for key in ("learner_busy_fraction", "env_wait_fraction"):
            assert 0 <= r[key] <= 1.0 + 1e-6, (key, r[key])
        # counted when each environment call returns, so a call begun in the previous iteration counts here
        assert r["env_busy_fraction"] >= 0
    assert sum(r["env_busy_fraction"] for r in records) > 0


def test_a_resumed_run_first_trains_the_groups_completed_before_it_stopped(resumed):
    _, rl_dir, before, history = resumed
    records = _records(rl_dir)
    taken = [i for r in records for i in r["groups"] + r["stale_groups"]]
    assert len(taken) == len(set(taken))  # no group trained (or dropped) twice
    consumed_first = {i for r in records[:2] for i in r["groups"] + r["stale_groups"]}
    pending = sorted(set(before) - consumed_first)
    assert pending, "the stream should have completed groups ahead of the learner before the stop"
    # every completed group is taken (trained, or dropped as too stale) before any group started after the stop
    seen: set[int] = set()
    for r in records[2:]:
        now = set(r["groups"] + r["stale_groups"])
        if now - set(pending):
            assert set(pending) <= seen | now, (pending, records[2:])
        seen |= now
    assert set(pending) <= seen
    assert [h["iteration"] for h in history] == [2, 3]
    # the checkpoint says exactly which groups the saved parameters have seen
    meta = json.loads((rl_dir / "checkpoints" / "4" / "meta" / "metadata").read_text())
    saved = meta["consumed_groups"]
    assert set(range(saved["below"])) | set(saved["also"]) == set(taken)


@pytest.mark.slow  # 24 s; the Ray pool itself is tested in tests/envs/test_ray_pool.py
def test_an_asynchronous_run_on_a_ray_fleet(tiny_config, tmp_path):
    pytest.importorskip("ray")
    config = tiny_config("grpo_cpu", "stages=('base_model', 'tasks', 'rl')", "rollout.mode=async", "env.fleet=ray",
                         "env.ray_cpus_per_worker=0.5")
    run_stages(config, tmp_path / "run")
    (r,) = _records(tmp_path / "run")
    assert r["episodes"] == 4 and r["env_errors"] == 0 and len(r["groups"]) == 2
    import ray

    assert not ray.is_initialized()  # the fleet shut down the local Ray instance it started


@pytest.mark.slow
def test_the_sampler_on_devices_of_its_own_gets_each_update(tiny_config, tmp_path, monkeypatch):
    import jax

    from guijax import trainer

    published = []
    original = trainer.RolloutStream.publish

    def spy(self, params, version):
        published.append(({d.id for leaf in jax.tree.leaves(params) for d in leaf.devices()}, version))
        return original(self, params, version)

    monkeypatch.setattr(trainer.RolloutStream, "publish", spy)
    config = tiny_config("grpo_cpu", "stages=('base_model', 'tasks', 'sft', 'rl')", "sft.steps=4",
                         "rollout.mode=async", "rollout.sampler_devices=2", "train.iterations=2")
    run = Run(config, tmp_path / "run")
    assert [d.id for d in run.mesh().devices.flat] == [d.id for d in jax.devices()[2:]]
    run_stages(config, tmp_path / "run")
    records = _records(tmp_path / "run")
    assert [r["policy_version"] for r in records] == [0, 1]
    sampler_ids = {d.id for d in jax.devices()[:2]}
    assert [v for _, v in published] == [0, 1, 2] and all(ids == sampler_ids for ids, _ in published)


def test_sampler_devices_need_asynchronous_rollouts(tiny_config, tmp_path):
    run = Run(tiny_config("grpo_cpu", "rollout.sampler_devices=2"), tmp_path / "run")
    with pytest.raises(ValueError, match="rollout.sampler_devices=2 .* set rollout.mode=async"):
        run.mesh()
