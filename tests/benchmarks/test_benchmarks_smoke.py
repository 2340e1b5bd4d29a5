"""Smoke tests of the benchmark scripts (benchmarks/*.py): each main() runs at the smallest sizes and writes
JSON + markdown with the keys the published tables are built from. Speed figures themselves are not checked."""
from __future__ import annotations

import numpy as np
import pytest

from benchmark_scripts import load as load_script, outputs, read as read_outputs


@pytest.mark.slow  # 25 s; recipe_step's smoke test below runs the same train step through the recipe's builder
def test_train_step_benchmark(tmp_path):
    mod = load_script("train_step")
    assert mod.main(["--presets", "tiny", "--batch", "1", "--seq", "16", "--repeats", "1", "--peak-n", "256",
                     "--peak-repeats", "1"] + outputs(tmp_path, "ts")) == 0
    out = read_outputs(tmp_path, "ts")
    assert {"backend", "device_kind", "cpu_count"} <= set(out["meta"]["machine"])
    assert out["meta"]["peak"]["flops_per_s"] > 0
    (row,) = out["rows"]
    assert row["preset"] == "tiny" and row["tokens_per_step"] == 16
    assert row["tokens_per_s"] > 0 and 0 < row["mfu"] and row["last_skipped"] == 0
    fpt = row["flops_per_token"]
    assert fpt["total"] == pytest.approx(fpt["dense"] + fpt["lm_head"] + fpt["attention"])


@pytest.mark.slow
def test_train_step_benchmark_with_screenshots(tmp_path):
    mod = load_script("train_step")
    assert mod.main(["--presets", "tiny", "--batch", "1", "--screenshots", "2", "--screenshot-hw", "56,84",
                     "--response", "8", "--repeats", "1", "--peak-n", "256", "--peak-repeats", "1"]
                    + outputs(tmp_path, "shots")) == 0
    (row,) = read_outputs(tmp_path, "shots")["rows"]
    # 56x84 -> a 4x6 patch grid: 24 patches, 6 image tokens per screenshot; 2 x (6 + 64) + 8 = 148 -> 1024
    assert (row["screenshots"], row["patch_grid"], row["patches"]) == (2, [4, 6], 48)
    assert (row["image_tokens_per_screenshot"], row["used_tokens"], row["seq"]) == (6, 148, 1024)
    assert row["vision_flops"] > 0 and row["last_skipped"] == 0 and row["tokens_per_s"] > 0


def test_machine_line_names_the_cpu_and_its_vector_extensions(tmp_path):
    """Ratios against PyTorch moved by a third between hosts: every figure says which CPU gave it."""
    bc = load_script("bench_common")
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: AMD EPYC 9B14\nflags\t\t: fpu sse2 avx2 avx512f avx512bw "
                       "avx512_vnni\n\nprocessor\t: 1\nmodel name\t: AMD EPYC 9B14\nflags\t\t: fpu\n")
    assert bc.cpu_description(cpuinfo) == ("AMD EPYC 9B14", ["avx2", "avx512f", "avx512_vnni"])
    assert bc.cpu_description(tmp_path / "absent") == (None, [])
    info = dict(bc.machine_info(), cpu_model="AMD EPYC 9B14", cpu_extensions=[])
    assert "(AMD EPYC 9B14; none of avx2/" in bc.machine_line(info)
    info["cpu_extensions"] = ["avx2", "avx512f"]
    assert "(AMD EPYC 9B14; avx2, avx512f)" in bc.machine_line(info)
    assert "(" not in bc.machine_line(dict(info, cpu_model=None)).split(",")[0]


def test_screenshot_batch_places_one_pad_token_per_merged_patch():
    mod = load_script("train_step")
    cfg = mod.model_config("tiny")
    data, info = mod.screenshot_batch(cfg, 2, 3, (56, 84), response=5)
    assert (data["input_ids"] == cfg.image_token_id).sum() == 2 * 3 * info["image_tokens_per_screenshot"]
    assert data["vision"]["pixel_values"].shape[0] == info["patches"] == 2 * 3 * 24
    assert data["loss_mask"].sum() == 2 * 5 and data["attention_mask"].sum() == 2 * info["used_tokens"]
    ids = data["input_ids"]
    for token in (cfg.vision_start_token_id, cfg.vision_end_token_id):  # each image span bracketed, as chats are
        assert (ids == token).sum() == 2 * 3
    starts = np.flatnonzero(ids[0] == cfg.vision_start_token_id)
    assert (ids[0, starts + 1] == cfg.image_token_id).all() and (ids[0, starts - 1] != cfg.image_token_id).all()
    rows, cols = np.nonzero(data["loss_mask"])  # the head's positions are exactly the loss positions
    np.testing.assert_array_equal(data["response_positions"], cols.reshape(2, 5))
    hf = {}
    mod.screenshot_batch(cfg, 2, 3, (56, 84), response=5, hf_inputs=hf)
    assert hf["pixel_values"].shape == (2 * 3 * 24, cfg.vision.patch_dim) and hf["image_grid_thw"].tolist() == [[1, 4, 6]] * 6
    with pytest.raises(ValueError, match="too short"):
        mod.screenshot_batch(cfg, 1, 3, (56, 84), response=5, seq=64)


def test_qwen_0_5b_shape():
    mod = load_script("train_step")
    cfg = mod.model_config(mod.QWEN_0_5B)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.intermediate_size, cfg.vocab_size, cfg.tie_word_embeddings) == (896, 24, 14, 2, 4864, 151936, True)


@pytest.mark.slow
def test_vs_torch_benchmark(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    mod = load_script("vs_torch")
    assert mod.main(["--preset", "tiny", "--batch", "1", "--seq", "16", "--repeats", "1"]
                    + outputs(tmp_path, "vt")) == 0
    out = read_outputs(tmp_path, "vt")
    for key in ("guijax_tokens_per_s", "torch_tokens_per_s", "ratio", "preset", "batch", "seq", "machine"):
        assert key in out, key
    assert out["ratio"] == pytest.approx(out["guijax_tokens_per_s"] / out["torch_tokens_per_s"])
    assert out["initial_loss_abs_diff"] < 1e-4  # both sides run the same model on the same weights
    assert out["target_met"] is None  # the target is for the small preset
    assert out["guijax_frozen"] == ["visual"]  # torch's AdamW leaves the gradient-less tower alone: the same update


@pytest.mark.slow
def test_vs_torch_benchmark_with_screenshots(tmp_path):
    """GUI rows: both sides see the same screenshots, image tokens and M-RoPE positions (transformers computes
    its own), so the initial losses agree; torch takes the real tokens alone and tokens/s counts those."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    mod = load_script("vs_torch")
    assert mod.main(["--preset", "tiny", "--batch", "2", "--screenshots", "2", "--screenshot-hw", "56,84",
                     "--response", "8", "--repeats", "1"] + outputs(tmp_path, "gui")) == 0
    out = read_outputs(tmp_path, "gui")
    assert (out["screenshots"], out["patches"], out["used_tokens_per_row"], out["seq"]) == (2, 96, 148, 1024)
    assert out["tokens_per_step"] == 2 * 148
    assert out["initial_loss_abs_diff"] < 1e-4 and abs(out["initial_loss_guijax"]) > 0


def test_decode_roofline_bytes_and_bandwidths():
    """A decode step reads each decoder/head weight once (a tied head: the table once) and the KV cache."""
    import jax
    import jax.numpy as jnp
    from guijax.models import weights
    from guijax.models.config import get_preset

    mod = load_script("rollout")
    bc = load_script("bench_common")
    cfg = get_preset("tiny")
    module = weights.build_module(cfg, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    params = jax.eval_shape(lambda: weights.init_params(module, jax.random.PRNGKey(0)))
    got = mod.decode_bytes_per_step(cfg, params, batch=4, kv_tokens=100.0, cache_itemsize=2)
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    expected = sum(2 * leaf.size for path, leaf in flat if "visual" not in jax.tree_util.keystr(path))
    if not cfg.tie_word_embeddings:
        expected -= 2 * cfg.vocab_size * cfg.hidden_size  # the lookup reads a row, not the table
    assert got["weights"] == expected
    assert got["kv_cache"] == 4 * 100 * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * 2
    assert got["total"] == got["weights"] + got["kv_cache"]
    assert bc.spec_bandwidth("NVIDIA H100 80GB HBM3") == 3.35e12 and bc.spec_bandwidth("NVIDIA H200") == 4.8e12
    assert bc.spec_bandwidth("TPU v5 lite") == 0.819e12 and bc.spec_bandwidth("cpu") is None


@pytest.mark.slow
def test_vs_torch_benchmark_sequential_in_bf16(tmp_path):
    """bf16 parameters and moments on both sides, torch timed first and freed: the losses still agree."""
    pytest.importorskip("torch")
    mod = load_script("vs_torch")
    assert mod.main(["--preset", "tiny", "--batch", "1", "--seq", "16", "--repeats", "2", "--dtype", "bfloat16",
                     "--param-dtype", "bfloat16", "--sequential"] + outputs(tmp_path, "seq")) == 0
    out = read_outputs(tmp_path, "seq")
    assert out["sequential"] and out["param_dtype"] == "bfloat16"
    assert len(out["torch_times_s"]) == len(out["guijax_times_s"]) == 2
    assert out["initial_loss_abs_diff"] < 1e-3 and abs(out["initial_loss_guijax"]) > 0


@pytest.mark.slow  # 21 s, to keep CI within its budget; the engine and sampler are tested in tests/guijax
def test_rollout_benchmark_env_and_sampler(tmp_path):
    mod = load_script("rollout")
    assert mod.main(["--parts", "env,sampler", "--env-steps", "30", "--batches", "2", "--prompt-len", "16",
                     "--new-tokens", "4", "--repeats", "1"] + outputs(tmp_path, "ro")) == 0
    out = read_outputs(tmp_path, "ro")
    assert out["env"]["steps_per_second_per_core"] > 0
    (row,) = out["sampler"]
    assert row["batch"] == 2 and row["generated"] == 8 and row["tokens_per_s"] > 0
    assert row["decode_bytes_per_step"]["total"] > 0 and row["roofline_fraction"] is None  # no spec bandwidth on CPU


@pytest.mark.slow
def test_rollout_benchmark_end_to_end(tmp_path):
    mod = load_script("rollout")
    assert mod.main(["--parts", "e2e", "--warmup-iterations", "0", "--e2e-workers", "2", "--e2e-group-size", "2",
                     "--e2e-tasks", "1", "--e2e-step-limit", "2", "--e2e-max-new-tokens", "8", "--sft-steps", "0",
                     "--workdir", str(tmp_path / "run")] + outputs(tmp_path, "e2e")) == 0
    e = read_outputs(tmp_path, "e2e")["e2e"]
    for key in ("episodes_per_hour", "env_wait_fraction", "time_iteration_s", "time_env_s", "time_sampling_s"):
        assert key in e, key
    assert e["episodes"] == 2 and 0 <= e["env_wait_fraction"] <= 1
    assert e["backend"] == "jax" and e["time_weight_sync_s"] == 0  # the JAX sampler reads the learner's arrays


@pytest.mark.slow
def test_async_rollout_benchmark(tmp_path):
    from tiny_recipe import TINY

    mod = load_script("async_rollout")
    payload = mod.main(["--seeds", "0", "--latency", "0.02", "--iterations", "2", "--last", "1",
                        "--plot", str(tmp_path / "async.png"), *(f"--override={o}" for o in TINY)]
                       + outputs(tmp_path, "async_rollout"))
    data = read_outputs(tmp_path, "async_rollout")
    for key in ("sync_episodes_per_hour", "async_episodes_per_hour", "speedup", "mean_staleness",
                "env_busy_fraction", "learner_busy_fraction"):
        assert key in data, key
    seed = data["per_seed"]["0"]
    assert seed["sync"]["episodes_trained"] == seed["async"]["episodes_trained"] == 2 * 2 * 2
    assert all(seed[mode]["compile_seconds"] >= 0 for mode in ("sync", "async"))
    assert data["speedup"] == pytest.approx(seed["async"]["episodes_per_hour"] / seed["sync"]["episodes_per_hour"])
    assert payload["env_busy_fraction"]["async"] > 0 and (tmp_path / "async.png").stat().st_size > 0


def test_vision_gather_memory_benchmark(tmp_path):
    mod = load_script("vision_gather_memory")
    assert mod.main(["--devices", "1,2", "--per-device-patches", "256", "--heads", "2", "--head-dim", "8",
                     "--window", "16"] + outputs(tmp_path, "vg")) == 0
    rows = read_outputs(tmp_path, "vg")["rows"]
    assert [(r["devices"], r["layout"]) for r in rows] == [(1, "global"), (1, "block-local"), (2, "global"),
                                                          (2, "block-local")]
    assert all(r["temp_bytes_per_device"] > 0 and r["patches"] == 256 * r["devices"] for r in rows)


def test_attention_memory_benchmark(tmp_path):
    mod = load_script("attention_memory")
    assert mod.main(["--custom", "2,256,4,2,32,1"] + outputs(tmp_path, "am")) == 0
    payload = read_outputs(tmp_path, "am")
    assert [r["implementation"] for r in payload["rows"]] == ["xla", "splash"]
    assert all(r["temp_bytes"] > 0 and r["tokens"] == 256 and r["causal"] for r in payload["rows"])
    assert "| custom 2 x 256 tokens, 4/2 heads x 32 | forward + backward |" in (tmp_path / "am.md").read_text()


def test_attention_memory_benchmark_in_layer(tmp_path):
    """--in-layer compiles the projections around the attention: more arguments, the layer's width recorded."""
    mod = load_script("attention_memory")
    assert mod.main(["--custom", "1,256,4,2,32,1", "--in-layer", "--hidden", "256", "--remat"]
                    + outputs(tmp_path, "al")) == 0
    rows = read_outputs(tmp_path, "al")["rows"]
    assert all(r["in_layer"] and r["hidden"] == 256 and r["remat"] and r["temp_bytes"] > 0 for r in rows)
    alone = mod.measure("alone", (1, 256, 4, 2, 32, True), "xla", False)
    # the layer's arguments are x and four weights, not q, k and v
    assert rows[0]["argument_bytes"] != alone["argument_bytes"]
    assert "inside its layer (q/k/v/o projections, full remat)" in (tmp_path / "al.md").read_text()
    with pytest.raises(SystemExit):
        mod.main(["--custom", "1,256,4,2,32,1", "--remat"] + outputs(tmp_path, "bad"))


def test_block_local_window_attention_equals_the_global_one():
    """The benchmark's block-local layout computes the same attention as the model's global gather."""
    import jax
    import numpy as np

    from guijax.models.vision import window_attention

    mod = load_script("vision_gather_memory")
    blocks, per, heads, hd, window = 2, 32, 2, 4, 8
    rs = np.random.RandomState(0)
    q, k, v = (rs.standard_normal((blocks * per, heads, hd)).astype(np.float32) for _ in range(3))
    local = np.stack([rs.permutation(per) for _ in range(blocks)]).reshape(blocks, per // window, window)
    local[:, -1, -3:] = -1  # a padded window tail
    covered = [np.sort(local[b][local[b] >= 0]) for b in range(blocks)]
    slots_local = np.zeros((blocks, per), np.int32)
    for b in range(blocks):
        flat = local[b].reshape(-1)
        slots_local[b, flat[flat >= 0]] = np.flatnonzero(flat >= 0)
    global_tokens = np.where(local >= 0, local + (np.arange(blocks) * per)[:, None, None], -1).reshape(-1, window)
    global_slots = (slots_local + (np.arange(blocks) * per)[:, None]).reshape(-1)
    want = window_attention(q, k, v, global_tokens, global_slots, "xla")
    got = mod.block_local_attention(q, k, v, local.reshape(-1, window), slots_local.reshape(-1), blocks, "xla")
    uncovered = np.ones(blocks * per, bool)
    for b in range(blocks):
        uncovered[covered[b] + b * per] = False
    np.testing.assert_allclose(np.asarray(got)[~uncovered], np.asarray(want)[~uncovered], rtol=1e-5, atol=1e-6)
    assert jax.numpy.isfinite(got).all()


def _recipe_step(tmp_path, name: str, *overrides: str) -> dict:
    mod = load_script("recipe_step")
    assert mod.main(["--config=grpo_cpu", "--config.model.preset=tiny", "--config.dry_run.screenshot_hw=56,84",
                     "--config.rollout.max_new_tokens=8", "--config.pipeline.length_buckets=(96,)", *overrides,
                     "--steps=2"] + outputs(tmp_path, name)) == 0
    return read_outputs(tmp_path, name)["row"]


def test_recipe_step_runs_the_recipes_own_step_at_its_shape(tmp_path):
    row = _recipe_step(tmp_path, "one", "--config.mesh.num_devices=1", "--config.train.minibatch_size=2")
    # 56x84 -> 24 patches, 6 image tokens; 1 x (6 + 64) + 8 = 78 tokens -> the 96-token bucket
    assert row["batch"] == {"rows": 2, "tokens_per_row": 96, "screenshots_per_row": 1, "screenshot_hw": [56, 84],
                            "patches_per_screenshot": 24}
    assert row["loss_tokens"] == 2 * 8 and row["response_width"] == 64 and row["devices"] == 1
    assert row["last_metrics"]["skipped"] == 0 and row["last_metrics"]["tokens"] == 16
    assert len(row["times_s"]) == 2 and row["tokens_per_s"] > 0 and row["peak_bytes_per_device"] > 0
    flops = row["model_flops"]
    assert flops["total"] == pytest.approx(flops["text"] + flops["lm_head"] + flops["vision"]) and flops["vision"] > 0


@pytest.mark.slow
def test_recipe_step_on_eight_devices_with_per_device_vision_blocks(tmp_path):
    row = _recipe_step(tmp_path, "eight", "--config.pipeline.vision_per_device=True")
    assert row["devices"] == 8 and row["vision_blocks"] == 8 and row["batch"]["rows"] == 8
    assert row["last_metrics"]["skipped"] == 0 and row["last_metrics"]["tokens"] == 8 * 8


def test_recipe_step_random_params_are_distinct_buffers_with_unit_norms():
    import jax
    import numpy as np
    from jax.sharding import Mesh

    from guijax import sharding, train_step
    from guijax.models import weights
    from guijax.models.config import get_preset
    from guijax.optim import make_optimizer
    from configs._common import base

    mod = load_script("recipe_step")
    module = weights.build_module(get_preset("tiny"), scan_layers=False)
    mesh = Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1, 1, 1), sharding.MESH_AXES)
    tx, _ = make_optimizer(base("t").optim)
    params = mod.random_params(module, train_step.state_shardings(module, tx, mesh).params)
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    pointers = [leaf.unsafe_buffer_pointer() for _, leaf in flat]
    assert len(set(pointers)) == len(pointers)  # the step donates every leaf: none may share a buffer
    norms = [leaf for path, leaf in flat if "norm" in jax.tree_util.keystr(path).lower()]
    assert norms and all(np.all(np.asarray(x) == 1) for x in norms)
    weights_2d = [np.asarray(leaf) for _, leaf in flat if leaf.ndim == 2]
    assert all(0.01 < x.std() < 0.03 for x in weights_2d if x.size > 1000)


def test_recipe_step_model_flops_count_what_trains():
    """A frozen tower costs its forward alone; under LoRA the base weights cost forward and input gradient
    (4 of 6 FLOPs per weight per token) and the adapters all 6."""
    from guijax.models import weights
    from guijax.models.config import get_preset
    from guijax.models.lora import LoraConfig
    from guijax.models.trained import TrainedPart

    mod = load_script("recipe_step")
    cfg = get_preset("tiny")
    gui = {"screenshots": 1, "patches": 24}

    def flops(lora=None, frozen=()):
        module = weights.build_module(cfg, lora=lora, frozen=frozen)
        params = weights.abstract_params(module)
        return mod.model_flops(cfg, params, 2, 96, 16, gui, TrainedPart.of(module))

    full, tower, lora = flops(), flops(frozen=("visual",)), flops(lora=LoraConfig(rank=4, alpha=8.0))
    assert tower["vision"] == pytest.approx(full["vision"] / 3) and tower["text"] == full["text"]
    assert tower["lm_head"] == full["lm_head"] and lora["vision"] == pytest.approx(full["vision"] / 3)
    adapters = lora["params"]["adapters"]
    assert adapters > 0 and full["params"]["adapters"] == 0
    attention = 2 * 96 * 12.0 * cfg.num_hidden_layers * cfg.hidden_size * 96
    base_dense = full["text"] - attention
    assert lora["text"] == pytest.approx(base_dense * 4 / 6 + 2 * 96 * 6.0 * adapters + attention)
    assert lora["lm_head"] == pytest.approx(full["lm_head"] * 4 / 6)
    assert mod.trains_label(TrainedPart(LoraConfig(rank=4, alpha=8.0), ("visual",))) == "LoRA r4 adapters but visual"
    head = "embed_tokens" if cfg.tie_word_embeddings else "lm_head"  # frozen: its input gradient alone
    assert flops(frozen=(head,))["lm_head"] == pytest.approx(full["lm_head"] * 4 / 6)
    if not cfg.tie_word_embeddings:  # an untied head still trains when the embedding table is frozen
        assert flops(frozen=("embed_tokens",))["lm_head"] == pytest.approx(full["lm_head"])


def test_recompile_summary_leaves_out_the_first_iteration_and_reads_idle_ones():
    """benchmarks/recompiles.py's table: iterations 1 onward summed, an iteration with nothing to train
    (no update, no token fill) counted as zero time and left out of the fill."""
    mod = load_script("recompiles")
    record = lambda i, compiles, fill: {"iteration": i, "compiles": compiles, "time_compile_s": 2.0 * compiles,  # noqa: E731
                                        "time_update_s": None if fill is None else 1.0, "time_old_logprobs_s": 0.5,
                                        "time_iteration_s": 10.0, "token_fill": fill, "loss": 0.0,
                                        "success_rate": 0.5, "trained_tokens": 0 if fill is None else 500}
    records = [record(0, 30, 0.5), record(1, 2, 0.6), record(2, 0, None), record(3, 1, 0.8)]
    summary = mod.summary(records)
    assert summary == {"iterations": 3, "compiles": 3, "compile_s": 6.0, "update_s": 3.5, "iteration_s": 30.0,
                       "trained_tokens": 1000, "token_fill": pytest.approx(0.7)}
    payload = {"recipe": "grpo_cpu", "iterations": 4, "overrides": {"padded": []}, "command": "python x",
               "machine": {"cpu_count": 2}, "modes": {"padded": records}, "summary": {"padded": summary}}
    table = mod.markdown(dict(payload, machine=mod.bc.machine_info()))
    # 6.0 s of compiling subtracted from 3.5 s of update: reported as is (-2.50), which shows compile time
    # that was not the update's (the column is a lower bound)
    assert "| padded | 3 | 6.0 | 3.5 | 1000 | 3.50 | -2.50 | 30.0 | 0.700 |" in table and "| 2 | 0, 0.0, - |" in table


def test_attention_tile_benchmark_packs_rows():
    """Segment ids and positions restart per example, and an example's last token carries no loss."""
    mod = load_script("attention_tile")
    batch = mod.packed_batch(mod.model_config("tiny"), 1, 8, 4)
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 2, 2, 2, 2]]
    assert batch["positions"][0].tolist() == [[0, 1, 2, 3, 0, 1, 2, 3]]
    assert batch["loss_mask"].tolist() == [[1, 1, 1, 0, 1, 1, 1, 0]]


@pytest.mark.slow  # 60 s: four compiles of the step; test_attention checks the tile's parity in the model
def test_attention_tile_benchmark_keeps_the_loss_across_tiles(tmp_path):
    mod = load_script("attention_tile")
    payload = mod.main(["--preset", "tiny", "--rows", "1", "--seq", "64", "--examples", "16", "--blocks", "16,512",
                        "--attention", "auto,reference", "--repeats", "1"] + outputs(tmp_path, "tiles"))
    small, large, dense, _ = payload["rows"]
    assert (small["block"], large["block"]) == (16, 512) and small["loss"] == pytest.approx(large["loss"], rel=1e-5)
    assert (small["attention"], dense["attention"]) == ("auto", "reference")
    assert dense["loss"] == pytest.approx(small["loss"], rel=1e-5)
    assert read_outputs(tmp_path, "tiles")["rows"] == payload["rows"]
    text = (tmp_path / "tiles.md").read_text()
    assert "| 4 of 16 tokens | auto | 16 |" in text and "| 4 of 16 tokens | reference | 512 |" in text


def test_packing_fill_counts_token_and_screenshot_slots():
    """Three steps of one episode (1, 2, 3 screenshots; 100 tokens each and 10 of text): buckets of 128/256/512
    hold them in 896 token slots and 10-patch screenshots padded to 16 patches in 80 patch slots; packed rows of
    512 take 310 + 110 and 210 (two minibatches, 1,024 slots) with every minibatch's vision padded to the
    fuller one's 4 screenshots."""
    mod = load_script("packing_fill")
    shots = mod.step_screenshots([3, 1], max_images=2)
    assert shots == [1, 2, 2, 1]
    shots = mod.step_screenshots([3], max_images=5)
    tokens = [k * 100 + 10 for k in shots]
    buckets = mod.bucketed(tokens, shots, (128, 256, 512), patches=10, patch_bucket=16)
    assert (buckets["token_slots"], buckets["patch_slots"], buckets["shapes"]) == (896, 80, 3)
    same_bucket = mod.bucketed([100, 120], [1, 3], (128,), patches=10, patch_bucket=16)
    assert same_bucket["shapes"] == 2  # one token bucket, two patch counts (16 and 32): two programs
    assert buckets["token_fill"] == pytest.approx(630 / 896) and buckets["vision_fill"] == pytest.approx(0.75)
    packed = mod.packed(tokens, shots, rows=1, length=512, max_steps=4, patches=10)
    assert (packed["minibatches"], packed["vision_images"], packed["token_slots"]) == (2, 4, 1024)
    assert packed["token_fill"] == pytest.approx(630 / 1024) and packed["vision_fill"] == pytest.approx(6 / 8)


@pytest.mark.slow  # builds the 7B model abstractly
def test_packing_fill_on_the_gpu_recipe(tmp_path):
    mod = load_script("packing_fill")
    mod.main(["--config", "grpo_gpu", "--episode-steps", "3", "--episodes", "2", "--max-steps", "4"]
             + outputs(tmp_path, "pf"))
    out = read_outputs(tmp_path, "pf")
    assert (out["image_tokens_per_screenshot"], out["patches_per_screenshot"]) == (2691, 10764)
    first = out["rows"][0]
    assert first["steps"] == 6 and 0 < first["buckets"]["work_fill"] < 1 and 0 < first["packed"]["work_fill"] <= 1
    assert first["packed"]["vision_images"] == 5  # 1 + 2 + 2 screenshots, or 2 + 3: a row holds five
