"""The dry run compiles the recipe's real train step at its real shapes for its target, and reports what the
compiler says a step needs."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import chex
import pytest

from guijax import aot, launch, sampling
from guijax.models.config import get_preset

REQUIRED = ("compiled", "compile_target", "devices", "peak_bytes_per_device", "param_bytes_per_device",
            "opt_bytes_per_device", "batch")


def test_gpu_recipe_shape_is_five_full_hd_screenshots_per_row():
    config = launch.resolve("grpo_gpu", [])
    shape = aot.batch_shape(config, get_preset("qwen2_5_vl_7b"))
    assert shape.patch_grid == (78, 138)  # 1920x1080 kept at 1932x1092 by UI-TARS's preprocessor
    assert shape.as_dict() == {"rows": 1, "tokens_per_row": 16384, "screenshots_per_row": 5,
                               "screenshot_hw": [1080, 1920], "patches_per_screenshot": 10764}
    batch = aot.host_batch(shape, get_preset("qwen2_5_vl_7b"))
    assert batch["vision"]["pixel_values"].shape == (5 * 10764, 1176)
    assert batch["input_ids"].shape == (1, 16384) and batch["positions"].shape == (3, 1, 16384)
    # packed minibatches of up to 4 steps in one row, their screenshots in one fixed vision shape of 5
    four = dataclasses.replace(shape, rows=4)
    packed = aot.PackedShape(rows=1, length=16384, blocks=1, response=512)
    batch = aot.host_batch(four, get_preset("qwen2_5_vl_7b"), packed=packed, vision_images=5)
    assert batch["vision"]["pixel_values"].shape == (5 * 10764, 1176)
    assert batch["input_ids"].shape == (1, 16384) and batch["targets"].shape == (4, 512)
    assert aot.host_batch(four, get_preset("qwen2_5_vl_7b"), packed=packed)["vision"]["pixel_values"].shape == (
        20 * 10764, 1176)  # unset: every step's screenshots distinct
    # a fixed shape smaller than what a batch can meet grows as the pipeline grows it (x 2^k): a padded row shows
    # 5 screenshots, so 2 becomes 8; a packed row of 16,384 tokens holds at most 5 (2,691 + 64 tokens each): 4 -> 8
    assert aot.host_batch(shape, get_preset("qwen2_5_vl_7b"), vision_images=2)["vision"]["pixel_values"].shape[0] \
        == 8 * 10764
    grown = aot.host_batch(four, get_preset("qwen2_5_vl_7b"), packed=packed, vision_images=4)
    assert grown["vision"]["pixel_values"].shape[0] == 8 * 10764


@pytest.mark.slow
def test_cli_compiles_the_cpu_recipe_and_writes_the_report(tmp_path):
    out = tmp_path / "dry.json"
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    run = subprocess.run([sys.executable, "-m", "guijax.launch", "--config=grpo_cpu", "--dry_run",
                          f"--dry_run_json={out}", "--config.mesh.num_devices=8"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert all(k in report for k in REQUIRED)
    assert report["compiled"] is True and report["compile_target"] == "cpu" and report["exact"] is False
    assert report["attention_traced_for"] == "cpu" and report["tpu_kernel_sites"] == 0
    assert report["devices"] == 8 and report["mesh"] == {"data": 1, "fsdp": 8, "tensor": 1, "expert": 1}
    assert report["batch"] == {"rows": 8, "tokens_per_row": 160, "screenshots_per_row": 1,
                               "screenshot_hw": [280, 280], "patches_per_screenshot": 64}
    chex.assert_scalar_positive(report["flops_per_device"])
    assert report["peak_bytes_per_device"] > report["param_bytes_per_device"] + report["opt_bytes_per_device"]
    assert "train step compiled for cpu" in run.stdout and "peak bytes per device" in run.stdout


@pytest.mark.slow  # 52 s of the default suite's 30-minute CI budget
@pytest.mark.skipif(not aot.has_libtpu(), reason="needs libtpu (pip install -e '.[tpu-compile]')")
def test_tpu_compiler_figures_for_a_small_topology():
    config = launch.resolve("grpo_cpu", ["dry_run.topology=v5p:2x2x1", "mesh.num_devices=4"])
    report = aot.compile_train_step(config, get_preset("small"))
    assert report["exact"] is True and report["compile_target"] == "tpu v5p:2x2x1"
    assert report["fits"] is True and report["capacity_bytes_per_device"] == 95 * 1024 ** 3
    # attention traced for the TPU: the scanned decoder layer's splash kernel, forward, dq and dkv
    assert report["attention_traced_for"] == "tpu" and report["tpu_kernel_sites"] == 3


def test_too_few_devices_names_the_way_out():
    config = launch.resolve("grpo_tpu", [])
    if aot.has_libtpu():
        pytest.skip("libtpu present: the TPU topology is compiled instead")
    with pytest.raises(ValueError, match="install libtpu .*tpu-compile.*xla_force_host_platform_device_count=64"):
        aot.compile_target(config, 64)


def test_the_tpu_compilers_refusal_is_read_as_figures():
    message = ("RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: Ran out of memory on HBM, the total memory required "
               "for HLO temporaries (142.96G) exceeds available HBM (95.73G). HLO module: jit_step.")
    assert aot._compiler_oom_figures(message) == {"required_bytes_per_device": int(142.96 * 2 ** 30),
                                                  "compiler_available_bytes": int(95.73 * 2 ** 30)}
    other = ("RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: XLA:TPU compile permanent error. Ran out of memory in "
             "memory space hbm. Used 361.54M of 307.00M hbm. Exceeded hbm capacity by 54.54M.")
    assert aot._compiler_oom_figures(other) == {"required_bytes_per_device": int(361.54 * 2 ** 20),
                                                "compiler_available_bytes": int(307.00 * 2 ** 20)}
    # over two lines, and in plain bytes
    assert aot._compiler_oom_figures("RESOURCE_EXHAUSTED: ... temporaries (2048)\nexceeds available HBM (1024).") == \
        {"required_bytes_per_device": 2048, "compiler_available_bytes": 1024}
    assert aot._compiler_oom_figures("RESOURCE_EXHAUSTED: something else") == {}


def test_per_device_vision_blocks_of_the_tpu_recipe():
    """bepa_tpu's 64 rows as 64 blocks, one row's five screenshots each, every index local to its block."""
    config = launch.resolve("bepa_tpu", ["pipeline.vision_per_device=True"])
    cfg = get_preset("qwen2_5_vl_7b")
    batch = aot.host_batch(aot.batch_shape(config, cfg), cfg, vision_blocks=64)
    vision = batch["vision"]
    assert vision["pixel_values"].shape == (64, 5 * 10764, 1176)
    assert vision["window_tokens"].shape[0] == 64 and (vision["window_tokens"] < 5 * 10764).all()
    assert vision["window_slots"].shape == (64, 5 * 10764) and vision["image_tokens"].shape[:2] == (64, 5)
    padded = aot.host_batch(aot.batch_shape(config, cfg), cfg, vision_blocks=64,
                            image_bucket=sampling.image_bucket)["vision"]  # as the sampler pads: 5 per row stay 5
    assert {k: v.shape for k, v in padded.items()} == {k: v.shape for k, v in vision.items()}
    odd = aot.host_batch(aot.batch_shape(config, cfg), cfg, vision_blocks=64,
                         image_bucket=lambda images, rows: sampling.image_bucket(images + 4, rows))["vision"]
    assert odd["pixel_values"].shape == (64, 12 * 10764, 1176)  # 9 screenshots in a row: past 8, the next is 12
    with pytest.raises(ValueError, match="64 rows per step cannot be split into 48"):
        aot.host_batch(aot.batch_shape(config, cfg), cfg, vision_blocks=48)


@pytest.mark.slow
def test_the_dry_run_compiles_per_device_vision_blocks():
    config = launch.resolve("grpo_cpu", ["mesh.num_devices=8", "pipeline.vision_per_device=True",
                                         "dry_run.topology="])
    report = aot.compile_train_step(config, get_preset("small"))
    assert report["compiled"] is True and report["vision_blocks"] == 8 and "empty_microstep" not in report


@pytest.mark.slow
def test_the_dry_run_compiles_the_sampler_with_per_device_vision_blocks():
    """The sampler's generation program at 8 rows over 8 devices takes one vision block per device; rows that
    do not divide fall back to one layout."""
    config = launch.resolve("grpo_cpu", ["mesh.num_devices=8", "pipeline.vision_per_device=True",
                                         "dry_run.topology="])
    blocked = aot.compile_sampler(config, get_preset("small"), rows=8)
    assert blocked["compiled"] is True and blocked["vision_blocks"] == 8
    assert aot.compile_sampler(config, get_preset("small"), rows=4)["vision_blocks"] == 1


def test_the_packed_step_shape_of_a_recipe():
    """bepa_tpu packed: its 64 steps in 64 rows of 16,384 tokens, one block per chip, responses in 512 columns."""
    overrides = ["pipeline.pack=True", "pipeline.max_response_tokens=512"]
    config = launch.resolve("bepa_tpu", overrides)
    cfg = get_preset("qwen2_5_vl_7b")
    shape = aot.batch_shape(config, cfg)
    packed = aot.packed_shape(config, shape, 64)
    assert packed == aot.PackedShape(rows=64, length=16384, blocks=64, response=512)
    batch = aot.host_batch(shape, cfg, 64, packed)
    assert batch["input_ids"].shape == (64, 16384) and batch["positions"].shape == (3, 64, 16384)
    assert batch["token_index"].shape == (64, 1, 512) and batch["loss_mask"].shape == (64, 512)
    assert "response_positions" not in batch
    fixed = launch.resolve("bepa_tpu", [*overrides, "pipeline.pack_rows=32", "pipeline.pack_length=32768"])
    assert aot.packed_shape(fixed, shape, 32) == aot.PackedShape(32, 32768, 32, 512)
    assert aot.packed_shape(launch.resolve("bepa_tpu", []), shape, 64) is None
    with pytest.raises(ValueError, match="64 steps and 32 packed rows cannot be split into 64 blocks"):
        aot.host_batch(shape, cfg, 1, aot.PackedShape(32, 32768, 64, 512))


@pytest.mark.slow
def test_the_dry_run_compiles_a_packed_step():
    overrides = ["mesh.num_devices=8", "pipeline.pack=True", "pipeline.pack_rows=8", "pipeline.pack_length=320",
                 "dry_run.topology=", "optim.grad_accum_steps=4", "pipeline.vision_images=1"]
    config = launch.resolve("grpo_cpu", overrides)
    report = aot.compile_train_step(config, get_preset("small"))
    assert report["compiled"] is True and report["packed"] == {"rows": 8, "length": 320, "blocks": 8,
                                                               "response": 64}
    # one vision layout over the minibatch's 8 steps of one screenshot each (their 8 rows could show 32): 1 grows
    # to 8, as the pipeline grows it; with per-device layouts, each holds its one row's step
    assert report["vision_images"] == 8
    per_device = aot.compile_train_step(launch.resolve("grpo_cpu", [*overrides, "pipeline.vision_per_device=True"]),
                                        get_preset("small"))
    assert per_device["vision_blocks"] == 8 and per_device["vision_images"] == 1
    assert report["empty_microstep"]["compiled"] is True  # accumulation's group-completing step, on the mesh


def test_a_gpu_recipes_proxy_figure_is_scaled_before_the_capacity_check():
    """The TPU proxy under-counted grpo_gpu's unrolled step on a GPU (73.23 GiB compiled, 84.43 GiB held on an
    H200), so an unrolled GPU recipe's proxy peak is scaled by that measured ratio before it is checked against
    80 GB; a scanned one's is not (the proxy and XLA:GPU agree on the scanned step: 68.68 and 68.69 GiB)."""
    target = aot.Target("proxy", [], 80 * 1000 ** 3, True, "", aot.GPU_PROXY_FACTOR)
    assert target.fits(int(73.23 * 2 ** 30)) is False  # grpo_gpu's proxy figure: 84.4 GiB on the GPU
    assert target.fits(int(60 * 2 ** 30)) is True
    assert aot.Target("tpu", [], 100, True, "").fits(100) is True
    assert aot.GPU_PROXY_FACTOR == pytest.approx(84.43 / 73.23, abs=1e-3)
    assert aot.Target("proxy", [], 80 * 1000 ** 3, True, "", aot.GPU_PROXY_FACTOR_SCANNED).fits(int(68.69 * 2 ** 30))
    if aot.has_libtpu():
        found = aot.compile_target(launch.resolve("grpo_gpu", ["dry_run.compiler=tpu_proxy",
                                                               "model.scan_layers=False"]), 1)
        assert found.proxy_factor == aot.GPU_PROXY_FACTOR and "scaling by 1.153" in found.note
        scanned = aot.compile_target(launch.resolve("grpo_gpu", ["dry_run.compiler=tpu_proxy"]), 1)
        assert scanned.proxy_factor == aot.GPU_PROXY_FACTOR_SCANNED == 1.0 and "scanned step" in scanned.note


def test_a_multi_gpu_recipe_compiles_for_one_v5p_chip_per_gpu():
    """An 8-GPU node's recipe is compiled for eight v5p chips (it could not be compiled at all with the one-chip
    proxy); a GPU count with no v5p topology of that size is named."""
    config = launch.resolve("sgcd_gpu", ["dry_run.compiler=tpu_proxy"])
    with pytest.raises(ValueError, match=r"no v5p proxy for 3 GPUs \(mesh.num_devices\)"):
        aot.compile_target(config, 3)
    if aot.has_libtpu():
        found = aot.compile_target(config, 8)
        assert found.name == "tpu v5p:2x2x2 (proxy for 8 H100s)" and len(found.devices) == 8
        assert found.proxy_factor == aot.GPU_PROXY_FACTOR


def test_the_empty_microstep_is_compiled_for_the_recipe_and_checked_against_capacity(tiny_config):
    """The zero-gradient micro-step that completes a short accumulation group holds the whole trained state
    (parameters, moments, accumulated gradients) as its arguments, and a target too small for it is named."""
    import jax
    from jax.sharding import Mesh
    import numpy as np

    from guijax import sharding

    config = tiny_config("grpo_cpu", "optim.grad_accum_steps=2")
    mesh = Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1, 1, 1), sharding.MESH_AXES)
    built = aot.recipe_step(config, get_preset("tiny"), mesh)
    state = aot.abstract_state(built)
    state_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
    roomy = aot.compile_empty_microstep(built, state, aot.Target("cpu", [], 10 * state_bytes, False, ""))
    assert roomy["compiled"] is True and roomy["fits"] is True
    assert roomy["argument_bytes_per_device"] == state_bytes and roomy["peak_bytes_per_device"] >= state_bytes
    tight = aot.compile_empty_microstep(built, state, aot.Target("cpu", [], state_bytes, False, ""))
    assert tight["fits"] is False  # the state alone fills it; the micro-step needs room to update it
    # a frozen tower is not the micro-step's argument but stays on the device: counted in its peak
    frozen_built = aot.recipe_step(tiny_config("grpo_cpu", "optim.grad_accum_steps=2", 'model.frozen=("visual",)'),
                                   get_preset("tiny"), mesh)
    frozen_state = aot.abstract_state(frozen_built)
    tower = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(frozen_state.params["visual"]))
    micro = aot.compile_empty_microstep(frozen_built, frozen_state, aot.Target("cpu", [], None, False, ""))
    assert micro["frozen_param_bytes_per_device"] == tower > 0 and micro["fits"] is None
    assert micro["peak_bytes_per_device"] >= micro["argument_bytes_per_device"] + tower
    assert micro["argument_bytes_per_device"] < state_bytes  # only the trained part and its moments


def test_the_dry_run_can_be_compiled_by_this_machines_cpu_where_libtpu_is_installed():
    """dry_run.compiler=cpu: XLA:CPU's figures for the same program, to set against the proxy's."""
    target = aot.compile_target(launch.resolve("grpo_gpu", ["dry_run.compiler=cpu"]), 1)
    assert target.name == "cpu" and target.capacity_bytes is None and "dry_run.compiler='cpu'" in target.note
    if aot.has_libtpu():
        proxy = launch.resolve("grpo_gpu", ["dry_run.compiler=tpu_proxy"])
        assert aot.compile_target(proxy, 1).name == "tpu v5p:1x1x1 (proxy for one H100)"


def test_arpo_gpu_trains_every_parameter_on_two_replicas_of_a_four_gpu_fsdp_group():
    """The mesh its dry run fits 8 H100s with (FSDP over all eight did not: README)."""
    from guijax import sharding
    from guijax.pipeline.registry import check_recipe

    config = launch.resolve("arpo_gpu", [])
    check_recipe(config)
    assert tuple(config.model.frozen) == () and config.lora.rank == 0 and config.mesh.num_devices == 8
    assert sharding.MeshConfig.from_run_config(config).shape(8) == (2, 4, 1, 1)


def test_the_printed_report_names_which_program_does_not_fit(capsys):
    """A train step that fits beside a micro-step that does not: the step's line says it fits, the micro-step's
    says it does not, and the report's overall `fits` (the exit code) is False."""
    report = {"compiled": True, "compile_target": "tpu v5p:2x2x2 (proxy for 8 H100s)", "compile_s": 1.0, "note": "",
              "batch": {"rows": 8, "tokens_per_row": 16384, "screenshots_per_row": 5, "screenshot_hw": [1080, 1920],
                        "patches_per_screenshot": 10764},
              "fits": False, "train_step_fits": True, "capacity_bytes_per_device": 80 * 10 ** 9, "proxy_factor": 2.0,
              "peak_bytes_per_device": 30 * 2 ** 30, "param_bytes_per_device": 0, "opt_bytes_per_device": 0,
              "temp_bytes_per_device": 0,
              "empty_microstep": {"compiled": True, "fits": False, "compile_s": 2.0, "peak_bytes_per_device": 40 * 2 ** 30}}
    launch.print_compiled(report)
    out = capsys.readouterr().out.splitlines()
    assert "(fits)" in next(line for line in out if "peak bytes per device" in line)
    micro = next(line for line in out if "micro-step" in line)
    assert "peak 40.00 GiB (x2.0: 80.00 GiB) per device" in micro and "(does NOT fit)" in micro
    assert "8 rows x 16384 tokens, 5 screenshots of 1920x1080 (10764 patches each) per row" in out[1]
    packed = dict(report, batch=dict(report["batch"], rows=4), packed={"rows": 1, "length": 16384, "blocks": 1,
                                                                      "response": 512}, vision_images=5)
    launch.print_compiled(packed)
    batch = next(line for line in capsys.readouterr().out.splitlines() if "batch:" in line)
    assert batch == ("  batch: up to 4 steps packed into 1 row(s) x 16384 tokens, 5 screenshots of 1920x1080 "
                     "(10764 patches each) per vision layout, 512 loss positions per step")


def test_a_refusal_is_printed_with_its_figures_in_plain_words(capsys):
    error = ("RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: Ran out of memory on HBM, the total memory required for "
             "HLO temporaries (67.29G) exceeds available HBM (64.62G). HLO module: jit_step.")
    launch.print_compiled({"compiled": False, "compile_target": "tpu v5p:2x2x2 (proxy for 8 H100s)", "error": error,
                           "batch": {}, **aot._compiler_oom_figures(error)})
    out = capsys.readouterr().out
    assert "does NOT fit; the compiler refused it: RESOURCE_EXHAUSTED" in out
    assert "named 67.29 GiB per device in all (arguments included) against 64.62 GiB available" in out
    assert "compiler_memory_gib sets a budget" in out  # no budget was given: say how to give one
    roomy = error.replace("(67.29G)", "(99.00G)").replace("(64.62G)", "(95.73G)")
    launch.print_compiled({"compiled": False, "compile_target": "tpu", "error": roomy, "batch": {},
                           **aot._compiler_oom_figures(roomy), "compiler_budget_bytes": 66169 * 2 ** 20,
                           "refused_under_budget": {"error": error, **aot._compiler_oom_figures(error)}})
    out = capsys.readouterr().out
    assert "named 99.00 GiB per device in all (arguments included) against 95.73 GiB available\n" in out
    assert ("the train step was refused under the compiler's budget of 64.62 GiB, naming 67.29 GiB in all, and again "
            "with more memory") in out
    report = {"compiled": True, "compile_target": "tpu v5p:2x2x2 (proxy for 8 H100s)", "compile_s": 1.0, "note": "",
              "batch": {"rows": 8, "tokens_per_row": 16384, "screenshots_per_row": 5, "screenshot_hw": [1080, 1920],
                        "patches_per_screenshot": 10764},
              "fits": False, "capacity_bytes_per_device": 80 * 10 ** 9, "proxy_factor": 1.153,
              "peak_bytes_per_device": 93 * 2 ** 30, "param_bytes_per_device": 0, "opt_bytes_per_device": 0,
              "temp_bytes_per_device": 0, "compiler_budget_bytes": 66169 * 2 ** 20,
              "refused_under_budget": aot._compiler_oom_figures(error), "compiled_under_budget_bytes": None}
    launch.print_compiled(report)
    out = capsys.readouterr().out
    assert "(does NOT fit)" in out and ("the train step was refused under the compiler's budget of 64.62 GiB, naming "
                                        "67.29 GiB in all; its figures are from a compile under the chip's own") in out
    launch.print_compiled({**report, "compiled_under_budget_bytes": 82711 * 2 ** 20})
    assert "its figures are from a compile under a budget of 80.77 GiB" in capsys.readouterr().out


def test_the_dry_run_batch_carries_reference_log_probs_where_the_loss_reads_them():
    """SEAgent's adversarial imitation reads ref_logp with no KL term (seagent_gpu's dry run failed without it);
    the KL term needs them too; ARPO's loss neither."""
    from guijax.methods import get_method

    for recipe, want in (("seagent_gpu", True), ("evocua_gpu", True), ("arpo_gpu", False)):
        config = launch.resolve(recipe, [])
        assert aot.needs_ref_logp(config, get_method(config.method, config).loss()) is want, recipe


@pytest.mark.slow
def test_the_seagent_step_compiles_for_the_dry_run(tiny_config):
    report = aot.compile_train_step(tiny_config("seagent_cpu", "dry_run.topology="), get_preset("tiny"))
    assert report["compiled"] is True


class _Lowered:
    """A lowered program whose compile is refused for memory whenever a budget under `needs` MiB is given."""

    def __init__(self, needs: int | None = None, roomy_fits: bool = True, error: str = ""):
        self.calls, self.needs, self.roomy_fits, self.error = [], needs, roomy_fits, error

    def compile(self, **kwargs):
        import jax

        self.calls.append(kwargs)
        options = kwargs.get("compiler_options")
        if self.error:
            raise jax.errors.JaxRuntimeError(self.error)
        if (options and self.needs and options["xla_tpu_max_hbm_size_mib"] < self.needs) or \
                (not options and not self.roomy_fits):
            budget = f"{options['xla_tpu_max_hbm_size_mib']}.00M" if options else "95.73G"
            named = self.needs + (0 if options else 1000)  # the roomy compile names another figure
            raise jax.errors.JaxRuntimeError(
                f"RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: Ran out of memory on HBM, the total memory required "
                f"for HLO temporaries ({named}.00M) exceeds available HBM ({budget}).")
        return "compiled"


def test_a_compile_refused_for_memory_is_the_answer_and_any_other_error_is_raised():
    """The train step, the accumulation micro-step and the sampler all compile through `aot._compile`."""
    import jax

    lowered = _Lowered(needs=2048, roomy_fits=False)
    got, compiled, report = aot._compile(aot.Target("tpu", [], 1, True, ""), lambda: lowered)
    assert got is None and compiled is None and lowered.calls == [{"compiler_options": None}]
    assert report["compiled"] is False and report["fits"] is False and report["error"].startswith("RESOURCE_EXHAUSTED")
    assert report["required_bytes_per_device"] == 3048 * 2 ** 20 and "refused_under_budget" not in report

    with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL: something else"):
        aot._compile(aot.Target("tpu", [], 1, True, ""), lambda: _Lowered(error="INTERNAL: something else"))


def test_the_compiler_is_handed_the_targets_memory_budget():
    """Each program is compiled under the target's budget (for a GPU proxy, the GPU's memory over the proxy
    factor: left at a v5p chip's 95 GiB, the compiler keeps rematerialised activations alive that a GPU could
    not hold), less what stays on the device beside it; a CPU target gets no options."""
    assert aot.compiler_memory_budget(64 * 2 ** 30) == {"xla_tpu_max_hbm_size_mib": 65536}
    assert aot.compiler_memory_budget(10) == {"xla_tpu_max_hbm_size_mib": 1}
    budgeted = aot.Target("tpu", [], 1, True, "", memory_budget_bytes=512 * 2 ** 20)
    lowered = _Lowered()
    assert aot._compile(budgeted, lambda: lowered)[1:] == ("compiled", {"compiler_budget_bytes": 512 * 2 ** 20})
    aot._compile(budgeted, lambda: lowered, reserved=100 * 2 ** 20)
    aot._compile(aot.Target("cpu", [], None, False, ""), lambda: lowered)
    assert lowered.calls == [{"compiler_options": {"xla_tpu_max_hbm_size_mib": 512}},
                             {"compiler_options": {"xla_tpu_max_hbm_size_mib": 412}}, {"compiler_options": None}]


def test_a_refusal_under_a_budget_is_retried_with_more_then_the_chips_own_memory():
    """The compiler is not monotone in its budget (the small preset's FSDP-8 step was refused at 332.7 MiB under
    307 MiB and peaked at 260.3 MiB under 409), so a refusal under a budget is not the answer: the program is
    compiled again under 1.25 times the budget, then with the chip's own memory, and the report keeps the first
    refusal and the budget that compiled."""
    budgeted = aot.Target("tpu", [], 1, True, "", memory_budget_bytes=512 * 2 ** 20, chip_memory_bytes=2 ** 30)
    lowered = _Lowered(needs=600)
    _, compiled, entries = aot._compile(budgeted, lambda: lowered)
    assert compiled == "compiled"
    assert [c["compiler_options"] for c in lowered.calls] == [{"xla_tpu_max_hbm_size_mib": 512},
                                                              {"xla_tpu_max_hbm_size_mib": 640}]
    assert entries["compiler_budget_bytes"] == 512 * 2 ** 20 and entries["compiled_under_budget_bytes"] == 640 * 2 ** 20
    assert entries["refused_under_budget"]["required_bytes_per_device"] == 600 * 2 ** 20
    assert "compiled" not in entries["refused_under_budget"]
    lowered = _Lowered(needs=700)
    _, compiled, entries = aot._compile(budgeted, lambda: lowered)
    assert compiled == "compiled" and entries["compiled_under_budget_bytes"] is None
    assert [c["compiler_options"] for c in lowered.calls][2] is None
    # 1.25 times the budget would reach the chip's memory: straight to the chip's own
    near = aot.Target("tpu", [], 1, True, "", memory_budget_bytes=900 * 2 ** 20, chip_memory_bytes=2 ** 30)
    lowered = _Lowered(needs=2000)
    aot._compile(near, lambda: lowered)
    assert [c["compiler_options"] for c in lowered.calls] == [{"xla_tpu_max_hbm_size_mib": 900}, None]
    # refused with room too: that last refusal is the answer, the budgeted one kept beside it
    _, compiled, entries = aot._compile(budgeted, lambda: _Lowered(needs=2000, roomy_fits=False))
    assert compiled is None and entries["compiled"] is False
    assert entries["required_bytes_per_device"] == 3000 * 2 ** 20
    assert entries["refused_under_budget"]["required_bytes_per_device"] == 2000 * 2 ** 20
    # a refusal that is not for HBM is not retried
    lowered = _Lowered(error="RESOURCE_EXHAUSTED: Ran out of memory in memory space vmem.")
    _, compiled, entries = aot._compile(budgeted, lambda: lowered)
    assert compiled is None and len(lowered.calls) == 1 and "vmem" in entries["error"]


def test_a_reserve_that_leaves_no_budget_compiles_with_the_chips_memory():
    target = aot.Target("tpu", [], 1, True, "", memory_budget_bytes=512 * 2 ** 20)
    assert target.compiler_options(reserved=512 * 2 ** 20) is None
    assert target.compiler_options(reserved=511 * 2 ** 20) == {"xla_tpu_max_hbm_size_mib": 1}


def test_the_micro_step_is_compiled_under_the_budget_less_its_frozen_parameters(tiny_config, monkeypatch):
    """The frozen tower is not an argument of the micro-step but stays on the device beside it."""
    seen = []

    def fake_compile(target, lower, reserved=0):
        seen.append(reserved)
        return None, None, {"compiled": False, "fits": False, "error": "RESOURCE_EXHAUSTED"}

    for frozen in ("('visual',)", "()"):
        config = tiny_config("grpo_cpu", "dry_run.topology=", f"model.frozen={frozen}")
        target, mesh, _ = aot._target_mesh(config)
        built = aot.recipe_step(config, get_preset("tiny"), mesh)
        with monkeypatch.context() as patch:
            patch.setattr(aot, "_compile", fake_compile)
            aot.compile_empty_microstep(built, aot.abstract_state(built), target)
    assert seen[0] > 0 and seen[1] == 0  # the frozen tower's bytes per device, then nothing frozen


def _sampler_report(peak: int, fits: bool, retried: bool = False) -> dict:
    return {"compiled": True, "fits": fits, "peak_bytes_per_device": peak,
            **({"refused_under_budget": {"error": "RESOURCE_EXHAUSTED"}} if retried else {})}


@pytest.mark.parametrize("one, two, want", [
    (_sampler_report(120, False, retried=True), None, 0),  # one prompt fits no compile under the capacity
    (_sampler_report(60, True), _sampler_report(99, False, retried=True), 1),  # two rows only with room
    (_sampler_report(60, True), _sampler_report(90, False), 1),  # two rows over the capacity
])
def test_the_sampler_plan_counts_only_programs_that_fit(monkeypatch, one, two, want):
    config = launch.resolve("grpo_cpu", [])
    target = aot.Target("tpu", [object()], 100, True, "")
    monkeypatch.setattr(aot, "_target_mesh", lambda config: (target, "mesh", 1))
    monkeypatch.setattr(aot.sharding, "data_parallel_size", lambda mesh: 1)
    made = []
    monkeypatch.setattr(aot, "compile_sampler", lambda config, model_cfg, rows, tm: made.append(rows) or
                        (one if rows == 1 else two))
    plan = aot.plan_sampler_rows(config, None)
    assert plan["rows"] == want and made == ([1] if two is None else [1, 2])
    if want:
        assert plan["checked"] is one


def test_with_prefill_passes_the_sampler_plan_doubles_while_the_program_fits(monkeypatch):
    """One row 40, two 60 (20 a row): the estimate is 4 rows (80); with rollout.prefill_rows the compiled peaks
    (4: 80, 8: 88, 16: 96, 32: 104 of 100) let it double to 16; without, it stays at 4; and never past the
    prompts one sampler call holds (an iteration's episodes, at most the environment workers: 2 tasks x 4 is 8
    rows; 16 tasks x 4 with 6 workers, 8)."""
    target = aot.Target("tpu", [object()], 100, True, "")
    monkeypatch.setattr(aot, "_target_mesh", lambda config: (target, "mesh", 1))
    monkeypatch.setattr(aot.sharding, "data_parallel_size", lambda mesh: 1)
    peaks = {1: 40, 2: 60, 4: 80, 8: 88, 16: 96, 32: 104}
    made = []
    monkeypatch.setattr(aot, "compile_sampler", lambda config, model_cfg, rows, tm: made.append(rows) or
                        _sampler_report(peaks[rows], peaks[rows] <= 100))
    for overrides, want, compiled in ((["rollout.prefill_rows=4", "rollout.tasks_per_iteration=16",
                                        "env.num_workers=64"], 16, [1, 2, 4, 8, 16, 32]), ([], 4, [1, 2, 4]),
                                      (["rollout.prefill_rows=4", "rollout.tasks_per_iteration=2",
                                        "rollout.group_size=4", "env.num_workers=64"], 8, [1, 2, 4, 8]),
                                      (["rollout.prefill_rows=4", "rollout.tasks_per_iteration=16",
                                        "env.num_workers=6"], 8, [1, 2, 4, 8])):
        made.clear()
        plan = aot.plan_sampler_rows(launch.resolve("grpo_cpu", overrides), None)
        assert plan["rows"] == want and made == compiled
        assert plan["checked"]["peak_bytes_per_device"] == peaks[want]
    made.clear()  # on OSWorld servers the workers are the servers: grpo_gpu's 32
    plan = aot.plan_sampler_rows(launch.resolve("grpo_gpu", ["rollout.prefill_rows=4"]), None)
    assert plan["rows"] == 16 and plan["rows_cap"] == 32 and made == [1, 2, 4, 8, 16, 32]


def test_a_second_row_that_costs_nothing_plans_the_prompts_one_call_holds(monkeypatch):
    """Two rows compiled to no more than one (the compiler rematerialised, or reused a buffer): the estimate is
    the prompts one sampler call holds (grpo_cpu with 2 tasks x 4 episodes: 8, under its 16 workers), halved
    while the compiled program does not fit, the two-row compile reused rather than compiled again."""
    target = aot.Target("gpu", [object()], 100, True, "")
    monkeypatch.setattr(aot, "_target_mesh", lambda config: (target, "mesh", 1))
    monkeypatch.setattr(aot.sharding, "data_parallel_size", lambda mesh: 1)
    for peaks, want, compiled in (({1: 40, 2: 40, 8: 90}, 8, [1, 2, 8]),
                                  ({1: 40, 2: 38, 8: 130, 4: 101}, 2, [1, 2, 8, 4])):
        made = []
        monkeypatch.setattr(aot, "compile_sampler", lambda config, model_cfg, rows, tm: made.append(rows) or
                            _sampler_report(peaks[rows], peaks[rows] <= 100))
        plan = aot.plan_sampler_rows(launch.resolve("grpo_cpu", ["rollout.tasks_per_iteration=2",
                                                                "rollout.group_size=4"]), None)
        assert plan["rows_cap"] == 8 and plan["rows"] == want and made == compiled
        assert plan["bytes_per_row_per_device"] == peaks[2] - peaks[1]


@pytest.mark.skipif(not aot.has_libtpu(), reason="needs libtpu (pip install -e '.[tpu-compile]')")
def test_gpu_proxies_and_tpu_targets_get_their_compilers_memory_budget():
    gpu = aot.compile_target(launch.resolve("grpo_gpu", ["dry_run.compiler=tpu_proxy", "model.scan_layers=False"]), 1)
    assert gpu.compiler_options() == {"xla_tpu_max_hbm_size_mib": 66169}  # 80 GB / 1.153 in whole MiB
    assert "budget set to 66169 MiB" in gpu.note
    scanned = aot.compile_target(launch.resolve("grpo_gpu", ["dry_run.compiler=tpu_proxy"]), 1)
    assert scanned.compiler_options() == {"xla_tpu_max_hbm_size_mib": 76293}  # 80 GB in whole MiB
    told = aot.compile_target(launch.resolve("grpo_gpu", ["dry_run.compiler=tpu_proxy",
                                                          "dry_run.compiler_memory_gib=10"]), 1)
    assert told.compiler_options() == {"xla_tpu_max_hbm_size_mib": 10240}
    tpu = launch.resolve("grpo_cpu", ["dry_run.topology=v5p:1x1x1", "mesh.num_devices=1"])
    assert aot.compile_target(tpu, 1).compiler_options() is None  # a TPU chip: the compiler's own HBM
    assert aot.compile_target(launch.resolve("grpo_cpu", ["dry_run.topology=v5p:1x1x1", "mesh.num_devices=1",
                                                           "dry_run.compiler_memory_gib=0.3"]), 1).compiler_options() \
        == {"xla_tpu_max_hbm_size_mib": 307}
    with pytest.raises(ValueError, match=r"compiler_memory_gib=0.0001 is under 1 MiB"):
        aot.compile_target(launch.resolve("grpo_gpu", ["dry_run.compiler=tpu_proxy",
                                                       "dry_run.compiler_memory_gib=0.0001"]), 1)


def test_a_budget_for_a_cpu_compile_is_refused_by_name():
    config = launch.resolve("grpo_gpu", ["dry_run.compiler=cpu", "dry_run.compiler_memory_gib=10"])
    with pytest.raises(ValueError, match=r"compiler_memory_gib is the TPU compiler's budget.*dry_run.compiler='cpu'"):
        aot.compile_target(config, 1)


@pytest.mark.skipif(not aot.has_libtpu(), reason="needs libtpu (pip install -e '.[tpu-compile]')")
def test_the_tpu_compiler_refuses_a_program_over_the_budget_it_is_given():
    """The budget reaches the TPU compiler: a program of a 256 MiB argument and 272 MiB of temporaries compiles
    at the chip's own HBM and is refused under a 64 MiB budget (and 80 MiB), then compiled again with room."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import topologies

    devices = list(topologies.get_topology_desc("v5p:1x1x1", "tpu").devices)
    sharding = jax.sharding.SingleDeviceSharding(devices[0])
    x = jax.ShapeDtypeStruct((64, 1024, 1024), jnp.float32, sharding=sharding)

    def program(x):  # every slice's exp is kept until the sum of all of them
        parts = [jnp.exp(x * i) for i in range(4)]
        return sum(p.sum(axis=0) for p in parts) + parts[0][0]

    lower = lambda: jax.jit(program).trace(x).lower(lowering_platforms=("tpu",))  # noqa: E731
    _, roomy, entries = aot._compile(aot.Target("tpu", devices, None, True, ""), lower)
    assert entries == {}
    _, retried, entries = aot._compile(aot.Target("tpu", devices, None, True, "", memory_budget_bytes=64 * 2 ** 20),
                                       lower)
    refusal = entries["refused_under_budget"]
    assert "required for HLO temporaries" in refusal["error"]
    # that form's figure is the whole footprint, the argument included, not the temporaries its words name
    peak = aot.compiled_bytes(roomy)["peak_bytes_per_device"]
    assert refusal["required_bytes_per_device"] == pytest.approx(peak, rel=0.01)
    assert refusal["compiler_available_bytes"] == 64 * 2 ** 20
    assert aot.compiled_bytes(retried) == aot.compiled_bytes(roomy)


@pytest.mark.parametrize("per_device", [False, True])
def test_the_dry_run_compiles_the_sampler_with_prefill_in_chunks(per_device):
    """16 rows over 8 devices prefilled 8 at a time compile: two chunks, each with its own vision layout (or
    per-device blocks of it). (At grpo_cpu's 160-token prompts the prefill is not what fills memory; the
    saving at long prompts is tested on the sampler itself.)"""
    overrides = ["mesh.num_devices=8", f"pipeline.vision_per_device={per_device}", "dry_run.topology=",
                 "rollout.prefill_rows=8"]
    chunked = aot.compile_sampler(launch.resolve("grpo_cpu", overrides), get_preset("small"), rows=16)
    assert chunked["compiled"] is True and chunked["vision_blocks"] == (8 if per_device else 1)
    assert chunked["prefill_chunks"] == 2


def test_the_printed_sampler_plan_says_when_the_prefill_runs_in_passes(capsys):
    config = launch.resolve("grpo_cpu", ["rollout.prefill_rows=8"])
    one = {"compiled": True, "prompt_tokens": 160, "new_tokens": 48, "peak_bytes_per_device": 2 ** 30,
           "kv_cache_bytes_per_row": 2 ** 20}
    for passes, shown in ((4, "their prefill in 4 passes (rollout.prefill_rows)"), (1, None)):
        launch.print_rollout_plan({"at_one_row_per_device": one, "rows": 32,
                                   "checked": {**one, "prefill_chunks": passes}}, config)
        out = capsys.readouterr().out
        assert "32 prompts per program fit" in out
        assert (shown in out) if shown else ("passes" not in out)
    for passes in (4, 1):  # at the cap, grown with prefill passes or estimated there: more might fit
        launch.print_rollout_plan({"at_one_row_per_device": one, "rows": 32, "rows_cap": 32,
                                   "checked": {**one, "prefill_chunks": passes}}, config)
        assert "as many as one sampler call can hold; more might fit" in capsys.readouterr().out
    launch.print_rollout_plan({"at_one_row_per_device": one, "rows": 16, "rows_cap": 32,
                               "checked": {**one, "prefill_chunks": 1}}, config)
    assert "more might fit" not in capsys.readouterr().out


def test_parameters_of_a_module_naming_cudnn_or_splash_are_traced_on_any_machine():
    """Parameters do not depend on the attention backend, so a GPU recipe naming cuDNN (or a TPU one naming
    splash) has its parameter shapes traced and its parameters initialised on this CPU, where neither kernel
    applies: the same as the blockwise module's."""
    import flax.linen as nn
    import jax

    from guijax.models import weights
    from guijax.models.qwen2_5_vl import Qwen2_5_VL

    cfg = get_preset("tiny")
    shapes = lambda tree: jax.tree.map(lambda x: (x.shape, x.dtype), nn.unbox(tree))  # noqa: E731
    want = shapes(weights.abstract_params(Qwen2_5_VL(cfg)))
    for impl in ("cudnn", "splash"):
        assert shapes(weights.abstract_params(Qwen2_5_VL(cfg, attention_impl=impl))) == want
    made = weights.init_params(Qwen2_5_VL(cfg, attention_impl="cudnn"), jax.random.PRNGKey(0))
    assert shapes(made) == want


def test_a_kernel_the_target_cannot_trace_is_traced_as_the_blockwise_path(capsys):
    """cuDNN named by a GPU recipe compiled for XLA:CPU (or the v5p proxy), or splash off a TPU, is traced as
    the blockwise path, as `auto` is there, and the report and its printout say so; a kernel the target can
    trace, and `auto`, are traced as named. The small preset's step compiles with cuDNN named on this CPU."""
    cpu = aot.Target("cpu", [], None, False, "")
    gpu = aot.Target("xla:gpu", [], None, True, "", attention_platform="gpu")
    for attention, target, traced in (("cudnn", cpu, "xla"), ("splash", gpu, "xla"), ("cudnn", gpu, "cudnn"),
                                      ("auto", cpu, "auto"), ("cudnn_packed", cpu, "xla"),
                                      ("cudnn_packed", gpu, "auto")):  # no Hopper GPU here to trace it for
        config = launch.resolve("grpo_gpu", [f"model.attention={attention}"])
        assert aot.traceable(config, target).model.attention == traced
        assert config.model.attention == attention  # the recipe itself is left as it was
    report = aot.compile_train_step(launch.resolve("grpo_cpu", ["model.attention=cudnn"]), get_preset("small"))
    assert report["compiled"] and (report["attention"], report["attention_traced"]) == ("cudnn", "xla")
    launch.print_compiled(report)
    assert "attention: cudnn traced for cpu (as xla: cudnn cannot be traced for it)" in capsys.readouterr().out
