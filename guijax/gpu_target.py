"""Compile-only GPU devices: XLA:GPU compiling for a GPU this machine does not have.

XLA:GPU compiles for a GPU it is told about as readily as for one it finds: given a target description
(`gpu_target_config`: the device's SM count, limits, memory, CUDA and cuDNN versions) it lowers, schedules,
rematerialises and assigns buffers as it would on that device. With the CUDA plugin and cuDNN installed from
the package registries (`pip install -e '.[gpu-compile]'`, no driver or GPU needed), `jax.experimental.
topologies` gives compile-only devices of such a description, so a GPU recipe's dry run reads XLA:GPU's own
figures instead of a TPU proxy's. Nothing is timed (there is no device), so XLA picks its kernels without
autotuning; memory does not depend on that choice beyond the workspaces of a few library calls.

The plugin checks at start-up that CUDA libraries can be loaded, and without a driver that check fails and
leaves the plugin unregistered; it is skipped when `JAX_PLATFORMS` names only other platforms (`cpu`) or
with `JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1`.
"""
from __future__ import annotations

import importlib.util
from typing import Any

# What XLA:GPU needs to know of an H100 SXM (80 GB HBM3) to compile for it (the proto text of
# stream_executor's GpuTargetConfigProto): the card's published limits, as public XLA and JAX examples of
# compiling without a device give them.
H100_SXM = """
gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 3352320000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 84929347584
  shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 }
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 8 }
runtime_version { major: 12 minor: 8 }
device_description_str: "NVIDIA H100 80GB HBM3"
"""

TARGETS = {"h100": H100_SXM}
GPUS_PER_HOST = 8


def plugin_installed() -> bool:
    """Whether JAX's CUDA plugin (for CUDA 12 or 13) is installed, registered or not."""
    return importlib.util.find_spec("jax_plugins") is not None and any(
        importlib.util.find_spec(f"jax_plugins.{name}") is not None for name in ("xla_cuda12", "xla_cuda13"))


def topology_name(count: int) -> str:
    """XLA's GPU topology string (slices x hosts per slice x devices per host) for one host of `count` GPUs.
    Several hosts (each its own NVLink slice) are not offered: no program has been compiled for them here."""
    if not 1 <= count <= GPUS_PER_HOST:
        raise ValueError(f"compile-only GPUs come as one host of 1 to {GPUS_PER_HOST}, not {count}; compile a "
                         f"larger GPU mesh for the v5p proxy (dry_run.compiler='tpu_proxy')")
    return f"1x1x{count}"


def devices(gpu: str, count: int) -> list[Any]:
    """`count` compile-only devices of the GPU named `gpu` (a key of TARGETS)."""
    from jax.experimental import topologies

    if gpu not in TARGETS:
        raise ValueError(f"no XLA:GPU target description for {gpu!r}; known: {sorted(TARGETS)}")
    try:
        topology = topologies.get_topology_desc(platform="cuda", target_config=TARGETS[gpu],
                                                topology=topology_name(count))
    except NotImplementedError as err:  # what JAX raises for a platform no plugin registered
        raise RuntimeError(
            f"JAX's CUDA plugin is installed but not registered ({err}), so XLA:GPU cannot compile here: on a "
            "machine without a GPU driver its start-up check fails; run with JAX_PLATFORMS=cpu (or "
            "JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1), or set dry_run.compiler='tpu_proxy'") from err
    return list(topology.devices)
