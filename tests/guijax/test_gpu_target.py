"""GPU recipes compiled by XLA:GPU itself for compile-only H100s, where JAX's CUDA plugin is installed."""
from __future__ import annotations

import pytest

from guijax import aot, gpu_target, launch


def test_compile_only_gpus_come_as_one_host():
    assert [gpu_target.topology_name(n) for n in (1, 4, 8)] == ["1x1x1", "1x1x4", "1x1x8"]
    for count in (0, 16):
        with pytest.raises(ValueError, match=f"one host of 1 to 8, not {count}.*tpu_proxy"):
            gpu_target.topology_name(count)
    with pytest.raises(ValueError, match=r"no XLA:GPU target description for 'b200'; known: \['h100'\]"):
        gpu_target.devices("b200", 1)


def test_a_gpu_recipe_compiles_for_xla_gpu_where_the_cuda_plugin_is_installed(monkeypatch):
    """The plugin installed: the GPU recipe's target is XLA:GPU on compile-only H100s, its attention traced for
    a GPU, no proxy factor; `dry_run.compiler=tpu_proxy` keeps the v5p proxy; a TPU compiler budget is refused
    by name; a TPU recipe is not affected."""
    made = []
    monkeypatch.setattr(gpu_target, "plugin_installed", lambda: True)
    monkeypatch.setattr(gpu_target, "devices", lambda gpu, count: made.append((gpu, count)) or ["gpu"] * count)
    target = aot.compile_target(launch.resolve("sgcd_gpu", []), 8)
    assert made == [("h100", 8)] and target.devices == ["gpu"] * 8
    assert target.name == "xla:gpu for 8 H100s (compile-only devices)" and target.exact
    assert target.attention_platform == "gpu" and target.proxy_factor == 1.0
    assert target.capacity_bytes == aot.CAPACITY["h100"] and target.compiler_options() is None
    assert target.fits(int(74 * 2 ** 30)) and not target.fits(int(75 * 2 ** 30))
    with pytest.raises(ValueError, match="compiler_memory_gib is the TPU compiler's budget.*XLA:GPU.*tpu_proxy"):
        aot.compile_target(launch.resolve("grpo_gpu", ["dry_run.compiler_memory_gib=10"]), 1)
    made.clear()
    proxy_config = launch.resolve("grpo_gpu", ["dry_run.compiler=tpu_proxy"])
    proxy = aot.compile_target(proxy_config, 1)
    if aot.has_libtpu():
        assert proxy.name == "tpu v5p:1x1x1 (proxy for one H100)"
    else:
        assert proxy.name == "cpu" and "libtpu is not installed" in proxy.note
    with pytest.raises(ValueError, match="no v5p proxy for 16 GPUs"):  # beyond one host: the proxy's rule
        aot.compile_target(launch.resolve("grpo_gpu", []), 16)
    assert aot.compile_target(launch.resolve("grpo_gpu", ["dry_run.compiler=cpu"]), 1).name == "cpu"
    tpu = launch.resolve("grpo_cpu", ["dry_run.topology=v5p:1x1x1", "mesh.num_devices=1"])
    if aot.has_libtpu():
        assert aot.compile_target(tpu, 1).name == "tpu v5p:1x1x1"
    assert made == []


def test_an_unregistered_plugin_names_the_way_out(monkeypatch):
    """Installed but unregistered (its start-up check failed without a GPU driver): the error says how to run."""
    from jax.experimental import topologies

    def unregistered(*args, **kwargs):
        raise NotImplementedError("topology not implemented for cuda")

    monkeypatch.setattr(topologies, "get_topology_desc", unregistered)
    with pytest.raises(RuntimeError, match=r"not registered \(topology not implemented for cuda\).*"
                                           r"JAX_PLATFORMS=cpu.*dry_run.compiler='tpu_proxy'"):
        gpu_target.devices("h100", 1)


def _registered() -> bool:
    if not gpu_target.plugin_installed():
        return False
    try:
        gpu_target.devices("h100", 1)
    except RuntimeError:
        return False
    return True


@pytest.mark.skipif(not _registered(), reason="needs JAX's CUDA plugin, registered (pip install -e '.[gpu-compile]' "
                                               "and JAX_PLATFORMS=cpu)")
def test_xla_gpu_compiles_a_sharded_program_for_compile_only_h100s():
    """Two compile-only H100s: a row-sharded matmul compiles by XLA:GPU (its program is for sm_90), each device
    holding half the rows, and its memory figures are the compiler's."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    devices = gpu_target.devices("h100", 2)
    assert [d.device_kind for d in devices] == ["NVIDIA H100 80GB HBM3"] * 2
    mesh = Mesh(np.asarray(devices), ("rows",))
    x = jax.ShapeDtypeStruct((4096, 1024), jnp.bfloat16, sharding=NamedSharding(mesh, P("rows")))
    w = jax.ShapeDtypeStruct((1024, 1024), jnp.bfloat16, sharding=NamedSharding(mesh, P()))
    compiled = jax.jit(lambda x, w: x @ w).lower(x, w).compile()
    assert compiled.memory_analysis().argument_size_in_bytes == 2048 * 1024 * 2 + 1024 * 1024 * 2
    assert compiled.memory_analysis().output_size_in_bytes == 2048 * 1024 * 2
    assert "gemm" in compiled.as_text()  # the GPU's matmul kernels (Triton or cuBLAS), not XLA:CPU's


@pytest.mark.skipif(not _registered(), reason="needs JAX's CUDA plugin, registered (pip install -e '.[gpu-compile]' "
                                               "and JAX_PLATFORMS=cpu)")
def test_auto_attention_on_two_compile_only_h100s_keeps_each_devices_rows():
    """XLA:GPU compiles `auto` attention over rows split across two H100s with cuDNN's fused kernel on each
    device's own row, and no device gathers the other's."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from guijax import sharding
    from guijax.models.attention import attention, compiling_for

    mesh = Mesh(np.asarray(gpu_target.devices("h100", 2)).reshape(2, 1, 1, 1), sharding.MESH_AXES)
    rows = lambda *shape: NamedSharding(mesh, P(("data", "fsdp"), *[None] * (len(shape) - 1)))  # noqa: E731
    q = jax.ShapeDtypeStruct((2, 1024, 8, 128), jnp.bfloat16, sharding=rows(2, 1024, 8, 128))
    seg = jax.ShapeDtypeStruct((2, 1024), jnp.int32, sharding=rows(2, 1024))

    def loss(q, seg):
        out = attention(q, q, q, causal=True, q_segment_ids=seg, kv_segment_ids=seg, implementation="auto")
        return jnp.sum(out.astype(jnp.float32) ** 2)

    with compiling_for("gpu"), sharding.rules_context(mesh):
        hlo = jax.jit(jax.grad(loss)).lower(q, seg).compile().as_text()
    assert "__cudnn$fmha" in hlo and "bf16[1,8,1024,128]" in hlo  # one row per device
    assert "all-gather" not in hlo


@pytest.mark.skipif(not _registered(), reason="needs JAX's CUDA plugin, registered (pip install -e '.[gpu-compile]' "
                                               "and JAX_PLATFORMS=cpu)")
def test_vision_windows_on_two_compile_only_h100s_take_cudnn_on_each_devices_rows():
    """The vision tower's windows on one layout over two H100s: `auto` takes cuDNN with no run-time check
    (the rows are right-padded by construction), called by the partitioner on each device's half of the
    windows, with no gather of the other device's."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from guijax import sharding
    from guijax.models.attention import compiling_for
    from guijax.models.positions import window_batch
    from guijax.models.vision import window_attention

    mesh = Mesh(np.asarray(gpu_target.devices("h100", 2)).reshape(2, 1, 1, 1), sharding.MESH_AXES)
    lengths = np.array([16, 9] * 32)  # 64 windows, every other one partial
    tokens, slots = window_batch(lengths, 16)
    n = int(lengths.sum())
    # the patches whole on each device, so the gather into windows needs no communication and any gather in
    # the program would be attention's
    x = jax.ShapeDtypeStruct((n, 4, 64), jnp.bfloat16, sharding=NamedSharding(mesh, P()))

    def loss(q):
        out = window_attention(q, q, q, jnp.asarray(tokens), jnp.asarray(slots), "auto")
        return jnp.sum(out.astype(jnp.float32) ** 2)

    with compiling_for("gpu"), sharding.rules_context(mesh):
        hlo = jax.jit(jax.grad(loss)).lower(x).compile().as_text()
    calls = [line for line in hlo.splitlines() if "__cudnn$fmha" in line]
    assert calls and all("bf16[32," in line and "bf16[64," not in line for line in calls), calls[:2]
    assert "all-gather" not in hlo and "conditional" not in hlo


@pytest.mark.slow
@pytest.mark.skipif(not _registered(), reason="needs JAX's CUDA plugin, registered (pip install -e '.[gpu-compile]' "
                                               "and JAX_PLATFORMS=cpu)")
@pytest.mark.parametrize("name", ["grpo_gpu", "bepa_gpu"])
def test_the_one_gpu_recipes_full_fine_tune_fits_one_h100(name):
    """The one-GPU recipes train every parameter of the 7B at one 16k-token row with five full-HD screenshots:
    XLA:GPU compiles that step for one H100 within its memory with the layers under scan, as the recipes run
    them, and not unrolled (a real H200 held 84.43 GiB for the unrolled step)."""
    from guijax.models.config import get_preset

    compiled = {}
    for scan in (True, False):
        config = launch.resolve(name, [f"model.scan_layers={scan}", "model.path="])
        compiled[scan] = aot.compile_train_step(config, get_preset("qwen2_5_vl_7b"))
    assert launch.resolve(name, []).model.scan_layers is True
    assert compiled[True]["compile_target"] == "xla:gpu for one H100 (compile-only devices)"
    assert compiled[True]["scan_layers"] is True and compiled[True]["fits"] is True
    assert compiled[False]["compiled"] is True and compiled[False]["fits"] is False
    assert compiled[True]["peak_bytes_per_device"] < compiled[False]["peak_bytes_per_device"]


@pytest.mark.skipif(not _registered(), reason="needs JAX's CUDA plugin, registered (pip install -e '.[gpu-compile]' "
                                               "and JAX_PLATFORMS=cpu)")
def test_cudnns_packed_layout_compiles_for_a_compile_only_h100(monkeypatch):
    """XLA:GPU compiles packed rows' attention, forward and backward, into cuDNN's fused kernel in its packed
    layout (runs' lengths and offsets as operands, softmax statistics per run), and `auto` holds that branch
    beside the lengths one. JAX checks for a Hopper GPU while tracing by asking the default device, which is
    this machine's CPU: the check is told the target's answer."""
    import re

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax._src.cudnn import fused_attention_stablehlo
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from guijax.models import cudnn_packed
    from guijax.models.attention import attention, compiling_for

    monkeypatch.setattr(fused_attention_stablehlo, "check_compute_capability", lambda capability: True)
    monkeypatch.setattr(cudnn_packed, "unavailable", lambda: "")
    whole = NamedSharding(Mesh(np.asarray(gpu_target.devices("h100", 1)), ("rows",)), P())
    q = jax.ShapeDtypeStruct((1, 4096, 8, 128), jnp.bfloat16, sharding=whole)
    kv = jax.ShapeDtypeStruct((1, 4096, 2, 128), jnp.bfloat16, sharding=whole)
    seg = jax.ShapeDtypeStruct((1, 4096), jnp.int32, sharding=whole)
    runs = cudnn_packed.DEFAULT_MAX_RUNS
    for impl in ("cudnn_packed", "auto"):
        def loss(q, k, v, seg):
            out = attention(q, k, v, causal=True, q_segment_ids=seg, kv_segment_ids=seg, implementation=impl)
            return jnp.sum(out.astype(jnp.float32) ** 2)

        with compiling_for("gpu"):
            hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv, seg).compile().as_text()
        forward = [line for line in hlo.splitlines() if 'custom_call_target="__cudnn$fmhaSoftmax"' in line]
        packed = [line for line in forward if f"s32[1,{runs}]" in line and f"s32[1,{runs + 1}]" in line]
        assert packed and f"f32[{runs},8,4096]" in packed[0], impl  # statistics per run, 8 heads
        assert "__cudnn$fmhaSoftmaxBackward" in hlo
        assert len(forward) == (1 if impl == "cudnn_packed" else 2), impl  # auto: lengths and packed
        assert not re.search(r"f32\[1,8,4096,4096\]", hlo)  # no dense score matrix anywhere
