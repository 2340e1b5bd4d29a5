"""The RL recipe end to end on the tiny preset: stages, metrics, checkpoints, reports, and resume."""
from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from guijax import launch
from guijax.pipeline import base_stages as stages
from guijax.pipeline.registry import run_stages
from guijax.pipeline.run import Run
from guijax.data.store import TrajectoryStore
from guijax.sft import sft_steps
from guijax.trainer import pipeline_config
from guijax.evaluation import pass_at_k

RECIPE = textwrap.dedent("""
    from configs._common import base

    def get_config():
        c = base("tiny_rl")
        c.stages = ("base_model", "tasks", "sft", "rl", "eval_final", "report")
        c.model.preset = "tiny"
        c.model.tokenizer_vocab = 1024
        c.model.image_max_pixels = 112 * 112
        c.env.families = ("click_button", "toggle_checkbox")
        c.env.num_tasks = 6
        c.env.num_workers = 4
        c.env.step_limit = 3
        c.rollout.prompt = "compact"
        c.rollout.max_images = 1
        c.rollout.group_size = 2
        c.rollout.tasks_per_iteration = 2
        c.rollout.max_new_tokens = 24
        c.pipeline.length_buckets = (192, 256, 384)
        c.pipeline.patch_bucket = 64
        c.train.iterations = {iterations}
        c.train.checkpoint_every = 1
        c.sft.steps = 6
        c.sft.batch_size = 4
        c.eval.splits = ("held_out",)
        c.eval.episodes_per_task = 2
        c.eval.pass_k = (1, 2)
        return c
""")


def _recipe(tmp_path: pathlib.Path, iterations: int) -> str:
    path = tmp_path / "tiny_rl.py"
    path.write_text(RECIPE.format(iterations=iterations))
    return str(path)


def _iteration_records(workdir: pathlib.Path) -> list[dict]:
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if '"iteration"' in line]


def test_recipe_end_to_end_and_rerun_resumes(tmp_path):
    config = launch.resolve(_recipe(tmp_path, 2), [])
    workdir = tmp_path / "run"
    run_stages(config, workdir)
    for name in ("base_model/config.json", "tasks.json", "splits.json", "sft_model/config.json",
                 "trained_model/model.safetensors", "eval_final.json", "report.md", "curves.png"):
        assert (workdir / name).exists(), name
    records = _iteration_records(workdir)
    assert [r["iteration"] for r in records] == [0, 1]
    for key in ("success_rate", "reward_mean", "format_error_rate", "zero_variance_groups", "time_env_s",
                "time_sampling_s", "response_tokens_mean", "behaviour_logprob_mean"):
        assert key in records[0], key
    assert records[0]["episodes"] == 4 and records[0]["behaviour_logprob_mean"] < 0
    sft = [json.loads(line) for line in (workdir / "sft_metrics.jsonl").read_text().splitlines()]
    assert len(sft) == 6 and sft[-1]["sft_loss"] < sft[0]["sft_loss"]
    report = json.loads((workdir / "eval_final.json").read_text())["splits"]["held_out"]
    assert report["tasks"] == 2 and set(report) >= {"success_rate", "pass@1", "pass@2", "per_domain"}
    assert "| after RL |" in (workdir / "report.md").read_text()
    assert sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()) == [1, 2]
    store = TrajectoryStore(workdir / "trajectories")  # every episode of every iteration, readable back
    assert [p.name.split(".")[0] for p in store.shards] == ["iter-000000", "iter-000001"]
    assert len(store) == 4 + 4 and all(len(t.steps) >= 1 for t in store)
    assert [round(t.reward, 6) for t in store][:4] != [] and store[0].steps[0].screenshot.ndim == 3
    run_stages(config, workdir)  # everything exists: nothing runs again
    assert len(_iteration_records(workdir)) == 2


def test_sft_resumes_from_its_checkpoint_with_the_same_batches(tmp_path):
    config = launch.resolve(_recipe(tmp_path, 1), [])
    run = Run(config, tmp_path / "run")
    stages.base_model.fn(run)
    stages.tasks.fn(run)
    trajectories = stages.expert_trajectories(run, run.tasks()["train"])
    pipeline = pipeline_config(config, run.system_prompt)

    def losses(steps, checkpoint_dir=None):
        policy = run.load_policy(run.base_model_dir)
        return sft_steps(policy, trajectories, policy.processor, config, pipeline, steps, 2, seed=0,
                         checkpoint_dir=checkpoint_dir, checkpoint_every=2)[1]

    uninterrupted = losses(4)
    assert losses(3, tmp_path / "ck") == pytest.approx(uninterrupted[:3], rel=1e-5)  # saved at step 2
    resumed = losses(4, tmp_path / "ck")  # restores step 2 and runs steps 3 and 4 again
    assert resumed == pytest.approx(uninterrupted, rel=1e-5)
    run.close()


def test_pass_at_k():
    assert pass_at_k(4, 0, 1) == 0.0 and pass_at_k(4, 4, 2) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25) and pass_at_k(4, 1, 2) == pytest.approx(0.5)


@pytest.mark.slow
def test_sigkill_mid_training_then_resume_matches_uninterrupted(tmp_path):
    recipe = _recipe(tmp_path, 4)
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    command = [sys.executable, "-m", "guijax.launch", f"--config={recipe}", "--config.stages=('base_model','tasks','sft','rl')"]
    clean = tmp_path / "clean"
    subprocess.run(command + [f"--workdir={clean}"], env=env, check=True, capture_output=True, timeout=900)
    killed = tmp_path / "killed"
    proc = subprocess.Popen(command + [f"--workdir={killed}"], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 600
    while not (killed / "checkpoints" / "2").exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    assert proc.poll() is None, "the run finished before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    subprocess.run(command + [f"--workdir={killed}"], env=env, check=True, capture_output=True, timeout=900)
    ignore = {k for k in _iteration_records(clean)[0]
              if k.startswith("time_") or k in ("tokens_per_s", "env_wait_fraction")}  # wall-clock figures
    strip = lambda r: {k: v for k, v in r.items() if k not in ignore}  # noqa: E731
    clean_records = {r["iteration"]: strip(r) for r in _iteration_records(clean)}
    resumed = [strip(r) for r in _iteration_records(killed)]
    assert [r["iteration"] for r in resumed] == [0, 1, 2, 3]  # each once: the resume drops redone ones first
    for r in resumed:  # iterations redone after the kill reproduce the uninterrupted ones exactly
        assert r == clean_records[r["iteration"]]
