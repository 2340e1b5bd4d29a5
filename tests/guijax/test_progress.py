"""What a person sees: stage start/end lines, resumed stages named, bars on a terminal, periodic lines in a
file, and preflight failures as one line with the install command."""
from __future__ import annotations

import io
import os
import subprocess
import sys

import ml_collections
import pytest

from guijax import launch, preflight, progress
from guijax.pipeline import registry
from guijax.pipeline.stage import Stage, output_exists


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_lines_in_a_file_carry_count_rate_eta_and_figures(monkeypatch):
    monkeypatch.setenv("GUIJAX_PROGRESS_INTERVAL_S", "0")
    out = io.StringIO()
    with progress.Progress(4, "sft", "step", stream=out) as bar:
        for i in range(4):
            bar.update(1, loss=1.0 / (i + 1))
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert lines[0].startswith("  sft: 1/4 steps (25%)") and "ETA" in lines[0] and "loss=1" in lines[0]
    assert lines[-1].startswith("  sft: 4/4 steps (100%)") and "took" in lines[-1] and "loss=0.25" in lines[-1]
    assert len(lines) == 4  # three periodic lines and the closing one


def test_lines_wait_for_the_interval_and_transient_loops_leave_nothing(monkeypatch):
    monkeypatch.setenv("GUIJAX_PROGRESS_INTERVAL_S", "3600")
    out = io.StringIO()
    with progress.Progress(10, "rl", "iteration", stream=out) as bar:
        bar.update(10)
    assert out.getvalue().count("\n") == 1 and "10/10 iterations" in out.getvalue()
    quiet = io.StringIO()
    with progress.Progress(5, "rollouts", "episode", transient=True, stream=quiet) as bar:
        bar.update(5)
    assert quiet.getvalue() == ""


def test_a_terminal_gets_a_bar_with_rate_and_eta(monkeypatch):
    monkeypatch.delenv("GUIJAX_PROGRESS", raising=False)
    term = FakeTerminal()
    bar = progress.Progress(3, "eval train", "episode", stream=term)
    assert bar.bar is not None
    bar.update(2, success="1/2")
    progress.echo("a line printed while the bar is open", stream=term)
    bar.update(1)
    bar.close()
    text = term.getvalue()
    assert "\r" in text and "3/3" in text and "episode/s" in text and "success=1/2" in text
    assert "a line printed while the bar is open" in text


def test_unknown_progress_style_is_named(monkeypatch):
    monkeypatch.setenv("GUIJAX_PROGRESS", "fancy")
    with pytest.raises(ValueError, match="GUIJAX_PROGRESS='fancy'"):
        progress.Progress(1, "x")


def test_format_duration():
    assert [progress.format_duration(s) for s in (3.24, 95, 7300)] == ["3.2s", "1m35s", "2h01m"]


def _toy_stages(monkeypatch, calls: list[str]) -> None:
    def first(run):
        calls.append("first")
        (run.workdir / "first.txt").write_text("x")
        return "wrote first.txt"

    def summary(run):
        calls.append("summary")

    monkeypatch.setitem(registry.STAGES, "toy_first", Stage(
        "toy_first", first, lambda run: "write one file", output_exists("first.txt")))
    monkeypatch.setitem(registry.STAGES, "toy_summary", Stage(
        "toy_summary", summary, lambda run: "summarise", lambda run: False))


def test_stages_say_what_they_do_and_a_resumed_run_names_the_done_ones(monkeypatch, tmp_path, capsys):
    calls: list[str] = []
    _toy_stages(monkeypatch, calls)
    config = launch.resolve("grpo_cpu", ["name=toy", "stages=('toy_first','toy_summary')", "compilation_cache_dir="])
    registry.run_stages(config, tmp_path)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "[1/2] toy_first: write one file"
    assert out[1].startswith("[1/2] toy_first: done in ") and out[1].endswith("; wrote first.txt")
    assert out[2] == "[2/2] toy_summary: summarise" and out[3].startswith("[2/2] toy_summary: done in ")
    registry.run_stages(config, tmp_path)
    again = capsys.readouterr().out.splitlines()
    assert again[0] == f"toy: resuming in {tmp_path}; found done: toy_first"
    assert again[1] == "[1/2] toy_first: already done, skipped"
    assert calls == ["first", "summary", "summary"]


def _config(**changes) -> ml_collections.ConfigDict:
    config = launch.resolve("bepa_cpu", [f"{k}={v}" for k, v in changes.items()])
    return config


def test_preflight_accepts_the_default_recipe():
    assert preflight.problems(_config()) == []


def test_preflight_names_what_to_install_or_set(monkeypatch, tmp_path):
    gpu = launch.resolve("grpo_gpu", [f"model.path={tmp_path}", f"env.osworld_dir={tmp_path / 'nope'}"])
    monkeypatch.setattr(preflight, "_has_platform", lambda name: False)
    monkeypatch.setattr(preflight, "_has_module", lambda name: name != "requests")
    found = preflight.problems(gpu)
    assert any("pip install -e '.[gpu]'" in p and "GPU" in p for p in found)
    assert any("'requests'" in p and "pip install -e '.[desktop]'" in p for p in found)
    assert any(f"model.path {tmp_path} has no config.json" in p for p in found)
    assert any("env.osworld_dir" in p for p in found)
    for backend, platform in (("splash", "TPU"), ("cudnn", "GPU")):
        assert preflight.problems(_config(**{"model.attention": backend})) == [
            f"model.attention='{backend}' is a {platform} kernel and jax finds no {platform}: use "
            "--config.model.attention=auto (it takes that kernel where one is, the blockwise path elsewhere)"]
    monkeypatch.delenv("GUIJAX_TEST_KEY", raising=False)
    chat = _config(**{"bepa.plan_extractor": "chat", "bepa.plan_api_key_env": "GUIJAX_TEST_KEY"})
    assert preflight.problems(chat) == ["bepa.plan_extractor='chat' reads its API key from $GUIJAX_TEST_KEY, which "
                                        "is not set (or use --config.bepa.plan_extractor=rule)"]
    assert preflight.problems(_config(**{"pipeline.pack_fill": True, "pipeline.pack": True})) == [
        "pipeline.pack_fill fills one packed shape: set pipeline.pack_length, pipeline.pack_rows"]


def test_preflight_names_the_serving_engine_to_install(monkeypatch):
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.45")
    monkeypatch.setattr(preflight, "_has_module", lambda name: name != "vllm")
    assert preflight.problems(_config(**{"rollout.backend": "vllm"})) == [
        "rollout.backend='vllm' samples the rollouts with vLLM, which is not installed: `pip install vllm  (CUDA only; "
        "it brings its own PyTorch)` (or --config.rollout.backend=jax, the JAX sampler)"]
    monkeypatch.setattr(preflight, "_has_module", lambda name: True)
    assert preflight.problems(_config(**{"rollout.backend": "vllm", "rollout.top_p": 0.9})) == [
        "rollout.backend='vllm' returns log-probs of the top-k/top-p-truncated distribution, the learner scores the "
        "whole one: set rollout.top_k=0 and rollout.top_p=1.0"]
    assert preflight.problems(_config(**{"rollout.backend": "vllm"})) == []
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION")  # JAX's default: 75% of the GPU, preallocated
    assert preflight.problems(_config(**{"rollout.backend": "vllm", "rollout.engine_memory_fraction": 0.4})) == [
        "rollout.backend='vllm' takes rollout.engine_memory_fraction=0.4 of the GPU and JAX preallocates 0.75 of it: "
        "start the run with XLA_PYTHON_CLIENT_MEM_FRACTION=0.55 in the environment (or lower the engine's share)"]
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    assert preflight.problems(_config(**{"rollout.backend": "vllm"})) == []
    seagent = launch.resolve("seagent_cpu", ["rollout.backend=vllm"])  # its phases sample on the engine too
    assert preflight.problems(seagent) == []
    offline = launch.resolve("bepa_cpu", ["rollout.backend=vllm", "stages=('base_model', 'tasks', 'expert', 'methods')",
                                          "compare.methods=('grpo', 'sft')"])  # the SFT baseline samples nothing
    assert preflight.problems(offline) == []
    # evaluations on vLLM beside rollouts on the JAX sampler: the same checks, named by eval.backend
    monkeypatch.setattr(preflight, "_has_module", lambda name: name != "vllm")
    assert preflight.problems(_config(**{"eval.backend": "vllm", "rollout.top_k": 5})) == [
        "eval.backend='vllm' samples the evaluations with vLLM, which is not installed: `pip install vllm  (CUDA "
        "only; it brings its own PyTorch)` (or --config.eval.backend=jax, the JAX sampler)",
        "eval.backend='vllm' returns log-probs of the top-k/top-p-truncated distribution, the learner scores the "
        "whole one: set rollout.top_k=0 and rollout.top_p=1.0"]
    monkeypatch.setattr(preflight, "_has_module", lambda name: True)
    assert preflight.problems(launch.resolve("seagent_cpu", ["eval.backend=vllm"])) == []


def test_preflight_reads_the_csr_baselines_before_the_run_trains():
    config = launch.resolve("sgcd_cpu", ["sgcd.csr_baselines=('sgcd=/nowhere',)"])
    assert preflight.problems(config) == [
        "sgcd.csr_baselines entry 'sgcd=/nowhere': the name 'sgcd' is taken (by the base policy, a method of "
        "compare.methods or another baseline)"]


def test_preflight_asks_the_desktop_recipe_for_its_tasks_and_traces(tmp_path):
    config = launch.resolve("evocua_desktop_cpu", [])  # neither is set by the recipe
    assert preflight.problems(config) == [
        "env.kind='osworld' needs env.osworld_dir: a folder of OSWorld task files (OSWorld's evaluation_examples, "
        "or what python -m guijax.evocua.office_synthesis --out= wrote)"]
    (tmp_path / "traces" / "coldstart_trajectories").mkdir(parents=True)
    config = launch.resolve("evocua_desktop_cpu", [f"env.osworld_dir={tmp_path}",
                                                   f"coldstart.traces_dir={tmp_path / 'traces'}"])
    assert preflight.problems(config) == [
        f"coldstart.traces_dir={tmp_path / 'traces'} holds no coldstart_trajectories/ (record them with "
        "python -m guijax.evocua.office_coldstart --out=...)"]
    (tmp_path / "traces" / "coldstart_trajectories" / "coldstart-00000.array_record").write_bytes(b"")
    assert preflight.problems(config) == []


def test_cli_fails_at_start_with_one_line_per_unmet_need(tmp_path):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    run = subprocess.run([sys.executable, "-m", "guijax.launch", "--config=bepa_cpu", f"--workdir={tmp_path / 'w'}",
                          "--config.accelerator=tpu"], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 2, run.stderr
    # where libtpu is installed (the TPU-compile extra), its own start-up warnings precede guijax's line
    assert "Traceback" not in run.stderr
    assert [line for line in run.stderr.strip().splitlines() if line.startswith("error")] == [
        "error: bepa_cpu runs on a TPU and jax finds none: install jax's TPU build with `pip install -e '.[tpu]'` "
        "on a machine that has one (or `--config.accelerator=` to run on what jax finds)"]
    assert not (tmp_path / "w").exists()  # nothing started


def test_desktop_server_names_missing_programs_and_packages(monkeypatch):
    from envs.desktop import checks

    monkeypatch.setattr(checks.shutil, "which", lambda name: None)
    reason = checks.server_missing(own_display=True)
    assert "['Xvfb', 'openbox']" in reason and "setup_desktop.sh" in reason
    assert checks.server_missing(own_display=False) in (None, reason.split("; ")[-1])
    from envs import server

    if checks.server_missing(own_display=True):
        with pytest.raises(SystemExit, match="the desktop server cannot start here: missing programs"):
            server.main([])
