"""Compiled memory of the vision tower's window gathers as the data-parallel mesh grows.

`guijax.models.vision.window_attention` gathers each window's patches with indices into the whole batch's
patch array. Compiled for a mesh whose devices each hold one row (five 1920x1080 screenshots of Qwen2.5-VL-7B:
16 heads x 80, 8x8-patch windows), this measures the forward+backward temporaries of that gather (one
attention group, q, k and v) against a block-local gather of the same data, where each device's windows
index only its own patches (vmapped over the device blocks). The global one grows with the number of devices,
the block-local one does not: the SPMD partitioner replicates a gather whose indices may reach any shard.

    python benchmarks/vision_gather_memory.py --devices 1,8,64 --json benchmarks/results/vision_gather_memory.json \\
        --markdown benchmarks/results/vision_gather_memory.md

Compiled for TPU v5p topologies when libtpu is installed (the TPU compiler's own figures), else for this
machine's CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=N; an upper bound).
"""
from __future__ import annotations

import argparse
import importlib.util
import time
from typing import Any

from bench_common import command_line, machine_info, write_outputs

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from guijax import sharding
from guijax.models import attention
from guijax.models.vision import window_attention

TOPOLOGIES = {1: "v5p:1x1x1", 2: "v5p:1x1x2", 4: "v5p:1x2x2", 8: "v5p:2x2x2", 16: "v5p:2x2x4", 32: "v5p:2x4x4",
              64: "v5p:4x4x4"}


def devices_for(n: int) -> tuple[list[Any], str]:
    if importlib.util.find_spec("libtpu") is not None:
        from jax.experimental import topologies

        return list(topologies.get_topology_desc(TOPOLOGIES[n], "tpu").devices), f"tpu {TOPOLOGIES[n]}"
    cpus = jax.devices("cpu")
    if len(cpus) < n:
        raise SystemExit(f"{n} devices asked, {len(cpus)} CPU devices here: install libtpu or set "
                         f"XLA_FLAGS=--xla_force_host_platform_device_count={n}")
    return cpus[:n], "cpu (upper bound)"


def block_local_attention(q, k, v, window_tokens, window_slots, blocks: int, implementation: str):
    """The same attention with each device block's windows indexing only that block's patches."""
    n, heads, hd = q.shape
    per, windows = n // blocks, window_tokens.shape[0] // blocks
    local = lambda x: x.reshape(blocks, per, heads, hd)  # noqa: E731
    idx = jnp.maximum(window_tokens, 0).reshape(blocks, windows, -1)
    take = jax.vmap(lambda x, i: jnp.take(x, i, axis=0))
    qw, kw, vw = (take(local(x), idx).reshape(blocks * windows, -1, heads, hd) for x in (q, k, v))
    valid = (window_tokens >= 0).astype(jnp.int32)
    out = attention.attention(qw, kw, vw, q_segment_ids=valid, kv_segment_ids=valid, implementation=implementation)
    out = out.reshape(blocks, windows * out.shape[1], heads, hd)
    return take(out, window_slots.reshape(blocks, per)).reshape(n, heads, hd)


def measure(n_devices: int, layout: str, per_device: int, heads: int, head_dim: int, window: int) -> dict[str, Any]:
    devices, target = devices_for(n_devices)
    mesh = Mesh(np.asarray(devices).reshape(1, n_devices, 1, 1), sharding.MESH_AXES)
    n = per_device * n_devices
    w = n // window
    patches = NamedSharding(mesh, P(sharding.DATA_AXES, None, None))
    rows = NamedSharding(mesh, P(sharding.DATA_AXES, None))
    flat = NamedSharding(mesh, P(sharding.DATA_AXES))

    def loss(q, k, v, window_tokens, window_slots):
        if layout == "global":
            out = window_attention(q, k, v, window_tokens, window_slots, "xla")
        else:
            out = block_local_attention(q, k, v, window_tokens, window_slots, n_devices, "xla")
        return jnp.sum(out.astype(jnp.float32))

    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)), in_shardings=(patches, patches, patches, rows, flat))
    args = [jax.ShapeDtypeStruct((n, heads, head_dim), jnp.bfloat16, sharding=patches)] * 3 + [
        jax.ShapeDtypeStruct((w, window), jnp.int32, sharding=rows), jax.ShapeDtypeStruct((n,), jnp.int32, sharding=flat)]
    start = time.perf_counter()
    with sharding.rules_context(mesh):
        compiled = step.lower(*args).compile()
    mem = compiled.memory_analysis()
    return {"devices": n_devices, "layout": layout, "target": target, "patches": n, "windows": w,
            "temp_bytes_per_device": int(mem.temp_size_in_bytes),
            "argument_bytes_per_device": int(mem.argument_size_in_bytes), "compile_s": time.perf_counter() - start}


def markdown(rows: list[dict[str, Any]], command: str) -> str:
    lines = [f"`{command}`", "", "| devices | patches (all rows) | layout | temporaries per device | compiled for |",
             "|---:|---:|---|---:|---|"]
    for r in rows:
        lines.append(f"| {r['devices']} | {r['patches']:,} | {r['layout']} | "
                     f"{r['temp_bytes_per_device'] / 2**30:.2f} GiB | {r['target']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", default="1,8,64")
    parser.add_argument("--per-device-patches", type=int, default=53824,  # 5 x 10,764, padded to whole windows
                        help="patches each device holds (one row of five 1920x1080 screenshots)")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=80)
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--json")
    parser.add_argument("--markdown")
    args = parser.parse_args(argv)
    rows = []
    for n in (int(x) for x in args.devices.split(",")):
        for layout in ("global", "block-local"):
            row = measure(n, layout, args.per_device_patches, args.heads, args.head_dim, args.window)
            print(f"{n} devices, {layout}: {row['temp_bytes_per_device'] / 2**30:.2f} GiB of temporaries per device "
                  f"({row['target']})", flush=True)
            rows.append(row)
    command = command_line("vision_gather_memory.py", argv)
    write_outputs(args.json, args.markdown, {"command": command, "machine": machine_info(), "rows": rows},
                  markdown(rows, command))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
