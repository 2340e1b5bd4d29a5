"""Smoke tests of the benchmark scripts (benchmarks/*.py): each main() runs at the smallest sizes and writes
JSON + markdown with the keys the published tables are built from. Speed figures themselves are not checked."""
from __future__ import annotations

import importlib.util
import json
import pathlib
import sys

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"


def _load(name: str):
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _outputs(tmp_path, name):
    return ["--json", str(tmp_path / f"{name}.json"), "--markdown", str(tmp_path / f"{name}.md")]


def _read(tmp_path, name) -> dict:
    assert (tmp_path / f"{name}.md").read_text().strip()
    return json.loads((tmp_path / f"{name}.json").read_text())


def test_train_step_benchmark(tmp_path):
    mod = _load("train_step")
    assert mod.main(["--presets", "tiny", "--batch", "1", "--seq", "16", "--repeats", "1", "--peak-n", "256",
                     "--peak-repeats", "1"] + _outputs(tmp_path, "ts")) == 0
    out = _read(tmp_path, "ts")
    assert {"backend", "device_kind", "cpu_count"} <= set(out["meta"]["machine"])
    assert out["meta"]["peak"]["flops_per_s"] > 0
    (row,) = out["rows"]
    assert row["preset"] == "tiny" and row["tokens_per_step"] == 16
    assert row["tokens_per_s"] > 0 and 0 < row["mfu"] and row["last_skipped"] == 0
    fpt = row["flops_per_token"]
    assert fpt["total"] == pytest.approx(fpt["dense"] + fpt["lm_head"] + fpt["attention"])


def test_train_step_benchmark_with_screenshots(tmp_path):
    mod = _load("train_step")
    assert mod.main(["--presets", "tiny", "--batch", "1", "--screenshots", "2", "--screenshot-hw", "56,84",
                     "--response", "8", "--repeats", "1", "--peak-n", "256", "--peak-repeats", "1"]
                    + _outputs(tmp_path, "shots")) == 0
    (row,) = _read(tmp_path, "shots")["rows"]
    # 56x84 -> a 4x6 patch grid: 24 patches, 6 image tokens per screenshot; 2 x (6 + 64) + 8 = 148 -> 1024
    assert (row["screenshots"], row["patch_grid"], row["patches"]) == (2, [4, 6], 48)
    assert (row["image_tokens_per_screenshot"], row["used_tokens"], row["seq"]) == (6, 148, 1024)
    assert row["vision_flops"] > 0 and row["last_skipped"] == 0 and row["tokens_per_s"] > 0


def test_screenshot_batch_places_one_pad_token_per_merged_patch():
    mod = _load("train_step")
    cfg = mod.model_config("tiny")
    data, info = mod.screenshot_batch(cfg, 2, 3, (56, 84), response=5)
    assert (data["input_ids"] == cfg.image_token_id).sum() == 2 * 3 * info["image_tokens_per_screenshot"]
    assert data["vision"]["pixel_values"].shape[0] == info["patches"] == 2 * 3 * 24
    assert data["loss_mask"].sum() == 2 * 5 and data["attention_mask"].sum() == 2 * info["used_tokens"]
    with pytest.raises(ValueError, match="too short"):
        mod.screenshot_batch(cfg, 1, 3, (56, 84), response=5, seq=64)


def test_qwen_0_5b_shape():
    mod = _load("train_step")
    cfg = mod.model_config(mod.QWEN_0_5B)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.intermediate_size, cfg.vocab_size, cfg.tie_word_embeddings) == (896, 24, 14, 2, 4864, 151936, True)


def test_vs_torch_benchmark(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    mod = _load("vs_torch")
    assert mod.main(["--preset", "tiny", "--batch", "1", "--seq", "16", "--repeats", "1"]
                    + _outputs(tmp_path, "vt")) == 0
    out = _read(tmp_path, "vt")
    for key in ("guijax_tokens_per_s", "torch_tokens_per_s", "ratio", "preset", "batch", "seq", "machine"):
        assert key in out, key
    assert out["ratio"] == pytest.approx(out["guijax_tokens_per_s"] / out["torch_tokens_per_s"])
    assert out["initial_loss_abs_diff"] < 1e-4  # both sides run the same model on the same weights
    assert out["target_met"] is None  # the target is for the small preset


def test_rollout_benchmark_env_and_sampler(tmp_path):
    mod = _load("rollout")
    assert mod.main(["--parts", "env,sampler", "--env-steps", "30", "--batches", "2", "--prompt-len", "16",
                     "--new-tokens", "4", "--repeats", "1"] + _outputs(tmp_path, "ro")) == 0
    out = _read(tmp_path, "ro")
    assert out["env"]["steps_per_second_per_core"] > 0
    (row,) = out["sampler"]
    assert row["batch"] == 2 and row["generated"] == 8 and row["tokens_per_s"] > 0


@pytest.mark.slow
def test_rollout_benchmark_end_to_end(tmp_path):
    mod = _load("rollout")
    assert mod.main(["--parts", "e2e", "--warmup-iterations", "0", "--e2e-workers", "2", "--e2e-group-size", "2",
                     "--e2e-tasks", "1", "--e2e-step-limit", "2", "--e2e-max-new-tokens", "8", "--sft-steps", "0",
                     "--workdir", str(tmp_path / "run")] + _outputs(tmp_path, "e2e")) == 0
    e = _read(tmp_path, "e2e")["e2e"]
    for key in ("episodes_per_hour", "env_wait_fraction", "time_iteration_s", "time_env_s", "time_sampling_s"):
        assert key in e, key
    assert e["episodes"] == 2 and 0 <= e["env_wait_fraction"] <= 1


@pytest.mark.slow
def test_async_rollout_benchmark(tmp_path):
    from tiny_recipe import TINY

    mod = _load("async_rollout")
    payload = mod.main(["--seeds", "0", "--latency", "0.02", "--iterations", "2", "--last", "1",
                        "--plot", str(tmp_path / "async.png"), *(f"--override={o}" for o in TINY)]
                       + _outputs(tmp_path, "async_rollout"))
    data = _read(tmp_path, "async_rollout")
    for key in ("sync_episodes_per_hour", "async_episodes_per_hour", "speedup", "mean_staleness",
                "env_busy_fraction", "learner_busy_fraction"):
        assert key in data, key
    seed = data["per_seed"]["0"]
    assert seed["sync"]["episodes_trained"] == seed["async"]["episodes_trained"] == 2 * 2 * 2
    assert data["speedup"] == pytest.approx(seed["async"]["episodes_per_hour"] / seed["sync"]["episodes_per_hour"])
    assert payload["env_busy_fraction"]["async"] > 0 and (tmp_path / "async.png").stat().st_size > 0
