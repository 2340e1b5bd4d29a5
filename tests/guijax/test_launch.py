"""Config resolution, override checking, dry runs and multi-host detection of `python -m guijax.launch`."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from guijax import config as config_lib
from guijax import distributed, launch

RECIPE = textwrap.dedent("""
    from configs._common import base

    def get_config():
        c = base("tmp_recipe")
        c.model.preset = "tiny"
        c.optim_lr = 1e-6
        return c
""")


@pytest.fixture
def recipe(tmp_path):
    path = tmp_path / "tmp_recipe.py"
    path.write_text(RECIPE)
    return str(path)


def test_unknown_config_lists_available():
    with pytest.raises(config_lib.ConfigError, match=r"unknown config 'bepa_cpuu'; available configs: .*"):
        config_lib.load_config("bepa_cpuu")


def test_overrides_are_typed_and_checked(recipe):
    config = launch.resolve(recipe, ["model.preset=small", "mesh.tensor=2", "optim_lr=3e-6", "model.dtype=bfloat16"])
    assert (config.model.preset, config.mesh.tensor, config.optim_lr) == ("small", 2, 3e-6)
    with pytest.raises(config_lib.ConfigError, match=r"unknown config key 'model.presett'; did you mean one of: model.preset"):
        launch.resolve(recipe, ["model.presett=small"])
    with pytest.raises(config_lib.ConfigError, match=r"mesh.tensor='two': expected a int"):
        launch.resolve(recipe, ["mesh.tensor=two"])
    with pytest.raises(config_lib.ConfigError, match="must look like key.path=value"):
        launch.resolve(recipe, ["mesh.tensor"])


def test_split_overrides_accepts_both_spellings():
    rest, overrides = launch.split_overrides(["prog", "--config=x", "--config.a.b=1", "--config.c", "2", "--dry_run"])
    assert rest == ["prog", "--config=x", "--dry_run"] and overrides == ["a.b=1", "c=2"]


def test_dry_run_7b_counts_parameters_and_bytes(recipe):
    config = launch.resolve(recipe, ["model.preset=qwen2_5_vl_7b", "model.dtype=bfloat16", "mesh.num_devices=64",
                                     "mesh.fsdp=16", "mesh.tensor=4"])
    report = launch.dry_run(config)
    assert report["params"] == 8_292_166_656  # Qwen2.5-VL-7B (UI-TARS-1.5-7B) with its vision tower
    assert report["vision_params"] == 676_550_144
    assert report["mesh"] == {"data": 1, "fsdp": 16, "tensor": 4, "expert": 1}
    # bf16, split 64 ways except small unsharded vectors: a little over 2 bytes * 8.29B / 64
    assert 2 * 8_292_166_656 / 64 < report["param_bytes_per_device"] < 1.05 * 2 * 8_292_166_656 / 64


def test_cli_dry_run_and_errors(tmp_path):
    # the recipe without its key outside the schema (optim_lr), which the run's check (dry runs too) refuses
    recipe = tmp_path / "clean_recipe.py"
    recipe.write_text(RECIPE.replace("    c.optim_lr = 1e-6\n", ""))
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    ok = subprocess.run([sys.executable, "-m", "guijax.launch", f"--config={recipe}", "--dry_run", "--nodry_run_compile",
                         "--config.model.preset=qwen2_5_vl_3b", "--config.mesh.tensor=2"],
                        capture_output=True, text=True, env=env, timeout=300)
    assert ok.returncode == 0, ok.stderr
    assert "parameters: 3,754,622,976" in ok.stdout and "'fsdp': 4, 'tensor': 2" in ok.stdout
    wrong = subprocess.run([sys.executable, "-m", "guijax.launch", f"--config={recipe}", "--dry_run",
                            "--config.model.frozen=('vision',)"], capture_output=True, text=True, env=env, timeout=300)
    assert wrong.returncode == 2 and "model.frozen[0]='vision' is not one of" in wrong.stderr  # checked before sizing
    bad = subprocess.run([sys.executable, "-m", "guijax.launch", f"--config={recipe}", "--config.mesh.tensr=2"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert bad.returncode == 2 and "unknown config key 'mesh.tensr'" in bad.stderr and "mesh.tensor" in bad.stderr
    missing = subprocess.run([sys.executable, "-m", "guijax.launch", "--config=no_such_recipe"],
                             capture_output=True, text=True, env=env, timeout=300)
    assert missing.returncode == 2 and "available configs:" in missing.stderr


def test_cluster_detection():
    assert distributed.detect_cluster({}) is None
    assert distributed.detect_cluster({"SLURM_NTASKS": "1"}) is None
    assert distributed.detect_cluster({"SLURM_NTASKS": "16"}) == "slurm"
    assert distributed.detect_cluster({"TPU_WORKER_HOSTNAMES": "a,b,c,d"}) == "tpu"
    assert distributed.detect_cluster({"TPU_WORKER_HOSTNAMES": "localhost"}) is None
    assert distributed.detect_cluster({"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234"}) == "coordinator"
    with pytest.raises(ValueError, match="distributed must be"):
        distributed.maybe_initialize("sometimes")


def test_resolved_config_serialises(recipe):
    data = json.loads(config_lib.to_json(launch.resolve(recipe, [])))
    assert data["model"]["preset"] == "tiny" and data["mesh"]["fsdp"] == -1
