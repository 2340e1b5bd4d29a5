"""The RL recipe end to end on the tiny preset: stages, metrics, checkpoints, reports, and resume."""
from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from guijax.pipeline import base_stages as stages
from guijax.pipeline.registry import STAGES, run_stages
from guijax.pipeline.run import Run
from guijax.data.store import TrajectoryStore
from guijax.sft import sft_steps
from guijax.trainer import pipeline_config
from guijax.evaluation import pass_at_k

RL = ("stages=('base_model', 'tasks', 'sft', 'rl', 'eval_final', 'report')", "env.num_tasks=6", "env.popups=True",
      "env.step_limit=3", "rollout.max_new_tokens=24", "train.iterations=2", "train.checkpoint_every=1", "sft.steps=6",
      "eval.splits=('held_out',)", "eval.episodes_per_task=2", "eval.pass_k=(1, 2)")


def _iteration_records(workdir: pathlib.Path) -> list[dict]:
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if '"iteration"' in line]


@pytest.fixture(scope="module")
def rl_run(tiny_config, tmp_path_factory):
    """The tiny RL recipe run once through every stage; the tests below read what it left."""
    config = tiny_config("grpo_cpu", *RL)
    workdir = tmp_path_factory.mktemp("rl") / "run"
    jax.clear_caches()  # an earlier test in this process may have compiled the same programs; count from scratch
    run_stages(config, workdir)
    return config, workdir


def test_every_file_is_a_declared_stage_output(rl_run):
    config, workdir = rl_run
    declared = {o for name in config.stages for o in STAGES[name].outputs}
    summaries = {"report.md", "curves.png", "stages.json"}
    written = {p.name for p in workdir.iterdir()}
    assert written <= declared | summaries, written - declared - summaries  # what a changed config moves aside
    assert {"base_model", "tasks.json", "splits.json", "sft_model", "trained_model", "checkpoints", "metrics.jsonl",
            "trajectories", "eval_final.json"} <= written


def test_iteration_metrics_are_those_of_the_stored_episodes(rl_run):
    _, workdir = rl_run
    records = _iteration_records(workdir)
    assert [r["iteration"] for r in records] == [0, 1]
    # the first iteration compiles the sampler, the log-probs and the step (or fetches them from the cache)
    assert records[0]["compiles"] >= 3 and records[0]["time_compile_s"] > 0
    store = TrajectoryStore(workdir / "trajectories")  # every episode of every iteration, readable back
    assert [p.name.split(".")[0] for p in store.shards] == ["iter-000000", "iter-000001"]
    episodes = list(store)
    assert len(episodes) == 8 and all(1 <= len(t.steps) <= 3 for t in episodes)
    assert episodes[0].steps[0].screenshot.ndim == 3
    for i, r in enumerate(records):
        mine = episodes[4 * i:4 * i + 4]
        assert r["episodes"] == 4 and r["injected"] == 0  # GRPO trains on its own group only
        assert r["success_rate"] == pytest.approx(np.mean([t.success for t in mine]))
        assert r["reward_mean"] == pytest.approx(np.mean([t.reward for t in mine]), abs=1e-6)
        tokens = np.concatenate([s.behaviour_logprobs for t in mine for s in t.steps])
        assert r["behaviour_logprob_mean"] == pytest.approx(float(tokens.mean()), rel=1e-5) and tokens.max() <= 0
        assert 0 <= r["zero_variance_groups"] <= 2
        assert r["env_steps"] == sum(s.error is None for t in mine for s in t.steps)  # an unparsable step is not run
        assert r["format_error_rate"] == pytest.approx(np.mean([any(s.error for s in t.steps) for t in mine]))


def test_sft_warm_start_lowers_its_loss(rl_run):
    _, workdir = rl_run
    sft = [json.loads(line) for line in (workdir / "sft_metrics.jsonl").read_text().splitlines()]
    assert [r["sft_step"] for r in sft] == list(range(1, 7)) and sft[-1]["sft_loss"] < sft[0]["sft_loss"]


def test_evaluation_report_and_checkpoints(rl_run):
    _, workdir = rl_run
    report = json.loads((workdir / "eval_final.json").read_text())["splits"]["held_out"]
    assert report["tasks"] == 2 and set(report["per_domain"]) <= {"click_button", "toggle_checkbox"}
    assert report["pass@1"] == pytest.approx(report["success_rate"])  # unbiased pass@1 is the mean success
    assert report["success_rate"] <= report["pass@2"] <= 1
    assert report["success_rate"] == pytest.approx(np.mean(list(report["per_task"].values())))
    text = (workdir / "report.md").read_text()
    assert f"| after RL | {100 * report['success_rate']:.1f}% (2) |" in text and (workdir / "curves.png").exists()
    assert sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()) == [1, 2]


def test_rerun_with_the_same_config_reuses_every_stage(rl_run, capsys):
    config, workdir = rl_run
    capsys.readouterr()
    run_stages(config, workdir)
    out = capsys.readouterr().out
    assert "found done: base_model, tasks, sft, rl, eval_final" in out and "running it again" not in out
    assert len(_iteration_records(workdir)) == 2
    ledger = json.loads((workdir / "stages.json").read_text())
    assert {k: v["state"] for k, v in ledger.items()} == dict.fromkeys(
        ("base_model", "tasks", "sft", "rl", "eval_final"), "done")


@pytest.mark.hostile
def test_a_run_killed_before_its_first_checkpoint_starts_over(rl_run, tmp_path):
    """Its episodes and metrics were written but no checkpoint: the rerun redoes those iterations from the
    start, replacing what they left instead of refusing to overwrite an immutable shard."""
    import shutil

    config, workdir = rl_run
    killed = tmp_path / "run"
    shutil.copytree(workdir, killed)
    for name in ("checkpoints", "trained_model"):
        shutil.rmtree(killed / name)
    for name in ("eval_final.json", "report.md"):
        (killed / name).unlink()
    run_stages(config, killed)
    assert [r["iteration"] for r in _iteration_records(killed)] == [0, 1]
    store = TrajectoryStore(killed / "trajectories")
    assert [p.name.split(".")[0] for p in store.shards] == ["iter-000000", "iter-000001"]
    assert (killed / "trained_model" / "config.json").exists()


@pytest.mark.slow  # 24 s each; checkpoint fallback and RL resume cases stay in the default suite
@pytest.mark.parametrize("lora", [(), ("lora.rank=4", "lora.dropout=0.1")], ids=["full", "lora"])
def test_sft_resumes_from_its_checkpoint_with_the_same_batches(tmp_path, tiny_config, lora):
    """Under LoRA the checkpoint holds the adapters and their moments; the base comes from the model dir."""
    config = tiny_config("grpo_cpu", *RL, *lora)
    run = Run(config, tmp_path / "run")
    stages.base_model.fn(run)
    stages.tasks.fn(run)
    trajectories = stages.expert_trajectories(run, run.tasks()["train"])
    pipeline = pipeline_config(config, run.system_prompt)

    def losses(steps, checkpoint_dir=None):
        policy = run.load_policy(run.base_model_dir, trains=config)
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


# a tiny policy warm-started long enough to solve click_button tasks about half the time: its groups have
# mixed rewards, so every iteration changes the parameters and a resume from the wrong iteration shows
RESUME = ("stages=('base_model', 'tasks', 'sft', 'rl')", "train.iterations=4", "train.checkpoint_every=1",
          "rollout.group_size=4", "rollout.max_new_tokens=48", "sft.steps=150", "sft.learning_rate=3e-3",
          "env.families=('click_button',)")


@pytest.mark.hostile
@pytest.mark.slow
def test_sigkill_mid_training_then_resume_matches_uninterrupted(tmp_path, tiny_flags):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    command = [sys.executable, "-m", "guijax.launch", "--config=grpo_cpu", *tiny_flags,
               *(f"--config.{o}" for o in RESUME)]
    clean = tmp_path / "clean"
    subprocess.run(command + [f"--workdir={clean}"], env=env, check=True, capture_output=True, timeout=900)
    groups = 2  # rollout.tasks_per_iteration of the tiny recipe
    assert all(r["zero_variance_groups"] < groups for r in _iteration_records(clean)), \
        "an iteration left the parameters unchanged: this recipe could not tell a late resume from a right one"
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
              if k.startswith("time_") or k.endswith("_busy_fraction") or k == "compiles"
              or k in ("tokens_per_s", "env_wait_fraction")}  # wall-clock figures
    strip = lambda r: {k: v for k, v in r.items() if k not in ignore}  # noqa: E731
    clean_records = {r["iteration"]: strip(r) for r in _iteration_records(clean)}
    resumed = [strip(r) for r in _iteration_records(killed)]
    assert [r["iteration"] for r in resumed] == [0, 1, 2, 3]  # each once: the resume drops redone ones first
    for r in resumed:  # iterations redone after the kill reproduce the uninterrupted ones exactly
        assert r == clean_records[r["iteration"]]
    from safetensors.numpy import load_file  # and so do the final parameters

    final = {name: load_file(d / "trained_model" / "model.safetensors") for name, d in (("clean", clean), ("killed", killed))}
    assert all(np.array_equal(final["clean"][k], final["killed"][k]) for k in final["clean"])


@pytest.mark.slow  # 40 s; the planner, the packed shapes and the accumulation's exactness run in the default suite
def test_token_budget_minibatches_and_accumulation_run_the_recipe(tiny_config, tmp_path):
    """`pipeline.pack_fill` and `optim.grad_accum_steps` through a real update on the 8-device mesh: each
    device's block of every minibatch planned by its tokens into one packed shape, and every accumulation
    group applied inside the update's epochs: with groups of 8, larger than the minibatches an epoch has
    here, the optimiser's own count says one update per epoch (groups running on across the epochs would
    apply none)."""
    config = tiny_config("grpo_cpu", "method=luffy", "stages=('base_model', 'tasks', 'expert', 'sft', 'rl')",
                         "pipeline.pack=True", "pipeline.pack_length=384", "pipeline.pack_rows=8",
                         "pipeline.pack_fill=True", "pipeline.max_response_tokens=48", "pipeline.vision_images=2",
                         "train.minibatch_size=16", "train.ppo_epochs=2", "optim.grad_accum_steps=8", "sft.batch_size=8")
    run_stages(config, tmp_path / "run")
    (record,) = _iteration_records(tmp_path / "run")
    assert 1 <= record["minibatches"] < 8 and 0 < record["token_fill"] <= 1
    assert record["optimizer_updates"] == 2


@pytest.mark.slow  # 30 s each; the families' parity, sampling and round-trip tests run in the default suite
@pytest.mark.parametrize("preset, saved_vision, mesh", [
    ("tiny_qwen2_vl", {"embed_dim": 32}, ()),
    ("tiny_qwen3_vl", {"deepstack_visual_indexes": [1, 2]}, ()),
    # expert parallelism: 8 experts over 4 devices, tokens over all 8, buffers at twice an even share
    ("tiny_qwen3_vl_moe", {"deepstack_visual_indexes": [1, 2]},
     ("mesh.expert=4", "model.expert_capacity_factor=2.0", "method=luffy",  # LUFFY: expert traces make a step
      "stages=('base_model', 'tasks', 'expert', 'sft', 'rl')"))])
def test_other_families_run_the_recipe(tiny_config, tmp_path, preset, saved_vision, mesh):
    """Qwen2-VL, Qwen3-VL and Qwen3-VL-MoE through fresh checkpoint, warm start, sampling, one RL update and save."""
    from guijax.models.config import PRESETS
    from guijax.models.policy import from_pretrained

    config = tiny_config("grpo_cpu", f"model.preset={preset}", "stages=('base_model', 'tasks', 'sft', 'rl')",
                         "train.router_aux_loss_coef=0.001", *mesh)
    run_stages(config, tmp_path / "run")
    (record,) = _iteration_records(tmp_path / "run")
    assert record["episodes"] == 4 and record["behaviour_logprob_mean"] < 0
    if mesh:
        assert 0 <= record["moe_dropped_fraction"] < 0.5, record
    saved = json.loads((tmp_path / "run" / "trained_model" / "config.json").read_text())
    assert saved["model_type"] == PRESETS[preset].model_type
    assert saved_vision.items() <= saved["vision_config"].items()
    assert from_pretrained(tmp_path / "run" / "trained_model").module.cfg.vision.norm == "layer"
