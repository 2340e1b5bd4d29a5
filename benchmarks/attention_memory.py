"""Compiled temporaries of one attention call per backend, at the recipes' shapes, for the TPU.

The dry run compiles whole train steps; when a backend changes their memory, this says how much of that is
the attention call itself. Each shape is one chip's share of a recipe's attention (rows, tokens, query heads,
key/value heads, head_dim), compiled forward + backward (or forward only with --forward-only: a frozen
vision tower) by the TPU compiler for one v5p chip, with attention traced for the TPU so "splash" is the
Pallas kernel. Without libtpu it compiles for this CPU: the "xla" rows are then upper bounds and "splash"
runs in the Pallas interpreter, whose memory says nothing about the kernel.

    python benchmarks/attention_memory.py --json benchmarks/results/attention_memory_tpu.json \\
        --markdown benchmarks/results/attention_memory_tpu.md

Compiled alone, q, k and v are the program's arguments, so any copy the backend makes of them (splash wants
them heads-major) is a temporary. `--in-layer` compiles the attention inside its layer instead: the hidden
states through the q/k/v projections, the attention and the output projection (the layer's hidden size from
HIDDEN), as the decoder and the vision blocks call it, where the compiler may fold a layout change into the
projections; `--remat` wraps that layer in full rematerialisation, as the TPU recipes run.
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

# name: (rows, tokens, heads, kv_heads, head_dim, causal) per chip
SHAPES = {
    "bepa_tpu decoder (Qwen2.5-VL-7B, 16,384 tokens)": (1, 16384, 28, 4, 128, True),
    "evocua_tpu decoder (Qwen3-VL-32B, 12,288 tokens)": (1, 12288, 64, 8, 128, True),
    "bepa_tpu vision frames (5 x 10,764 patches, 16 x 80)": (5, 10764, 16, 16, 80, False),
}
# each shape's layer width (hidden size) for --in-layer: Qwen2.5-VL-7B's decoder, Qwen3-VL-32B's, the 7B's vision blocks
HIDDEN = dict(zip(SHAPES, (3584, 5120, 1280)))


def target_devices() -> tuple[list[Any], str, bool]:
    """One v5p chip when libtpu is installed (the TPU compiler's figures), else this machine's first CPU."""
    if importlib.util.find_spec("libtpu") is not None:
        from jax.experimental import topologies

        return list(topologies.get_topology_desc("v5p:1x1x1", "tpu").devices), "tpu v5p:1x1x1", True
    return jax.devices("cpu")[:1], "cpu (upper bound; splash interpreted)", False


def measure(name: str, shape: tuple[int, int, int, int, int, bool], implementation: str,
            forward_only: bool, hidden: int = 0, remat: bool = False) -> dict[str, Any]:
    """One compile; hidden > 0: the attention inside its layer of that width (see the module docstring)."""
    rows, tokens, heads, kv_heads, head_dim, causal = shape
    devices, target, tpu = target_devices()
    mesh = Mesh(np.asarray(devices).reshape(1, 1, 1, 1), sharding.MESH_AXES)
    whole = NamedSharding(mesh, P())
    spec = lambda *shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype, sharding=whole)  # noqa: E731
    segment_ids = spec(rows, tokens, dtype=jnp.int32)

    def attend(q, k, v, segments):
        return attention.attention(q, k, v, causal=causal, q_segment_ids=segments, kv_segment_ids=segments,
                                   implementation=implementation)

    if hidden:
        def call(x, wq, wk, wv, wo, segments):
            heads_of = lambda w: (x @ w).reshape(rows, tokens, -1, head_dim)  # noqa: E731
            out = attend(heads_of(wq), heads_of(wk), heads_of(wv), segments)
            return out.reshape(rows, tokens, heads * head_dim) @ wo

        if remat:
            call = jax.checkpoint(call, policy=jax.checkpoint_policies.nothing_saveable)
        args = [spec(rows, tokens, hidden), spec(hidden, heads * head_dim), spec(hidden, kv_heads * head_dim),
                spec(hidden, kv_heads * head_dim), spec(heads * head_dim, hidden), segment_ids]
        differentiated = (0, 1, 2, 3, 4)
    else:
        call = attend
        args = [spec(rows, tokens, n, head_dim) for n in (heads, kv_heads, kv_heads)] + [segment_ids]
        differentiated = (0, 1, 2)

    def loss(*a):
        return jnp.sum(call(*a).astype(jnp.float32))

    program = jax.jit(call if forward_only else jax.grad(loss, argnums=differentiated))
    start = time.perf_counter()
    with attention.compiling_for("tpu", interpret=not tpu), jax.set_mesh(mesh):
        compiled = program.lower(*args).compile()
    mem = compiled.memory_analysis()
    return {"shape": name, "implementation": implementation, "direction": "forward" if forward_only else
            "forward + backward", "rows": rows, "tokens": tokens, "heads": heads, "kv_heads": kv_heads,
            "head_dim": head_dim, "causal": causal, "target": target, "in_layer": bool(hidden),
            "hidden": hidden or None, "remat": remat,
            "temp_bytes": int(mem.temp_size_in_bytes), "argument_bytes": int(mem.argument_size_in_bytes),
            "compile_s": time.perf_counter() - start}


def markdown(rows: list[dict[str, Any]], command: str) -> str:
    where = ("inside its layer (q/k/v/o projections" + (", full remat)" if rows[0]["remat"] else ")")
             if rows and rows[0]["in_layer"] else "the attention call alone")
    lines = [f"`{command}`", "", f"Temporaries of {where}.", "",
             "| shape (per chip) | direction | xla | splash | splash - xla | compiled for |",
             "|---|---|---:|---:|---:|---|"]
    by_shape: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}
    for r in rows:
        by_shape.setdefault((r["shape"], r["direction"]), {})[r["implementation"]] = r
    mib = lambda b: f"{b / 2**20:,.0f} MiB"  # noqa: E731
    for (name, direction), pair in by_shape.items():
        xla, splash = pair.get("xla"), pair.get("splash")
        diff = mib(splash["temp_bytes"] - xla["temp_bytes"]) if xla and splash else "-"
        lines.append(f"| {name} | {direction} | {mib(xla['temp_bytes']) if xla else '-'} | "
                     f"{mib(splash['temp_bytes']) if splash else '-'} | {diff} | {(xla or splash)['target']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=",".join(str(i) for i in range(len(SHAPES))),
                        help="indices into SHAPES: " + "; ".join(f"{i}: {n}" for i, n in enumerate(SHAPES)))
    parser.add_argument("--custom", default="", help="rows,tokens,heads,kv_heads,head_dim,causal(0/1) instead")
    parser.add_argument("--implementations", default="xla,splash")
    parser.add_argument("--forward-only", action="store_true")
    parser.add_argument("--in-layer", action="store_true",
                        help="compile the attention inside its layer: the q/k/v/o projections around it")
    parser.add_argument("--hidden", type=int, default=0, help="with --in-layer and --custom: the layer's width")
    parser.add_argument("--remat", action="store_true", help="with --in-layer: the layer fully rematerialised")
    parser.add_argument("--json")
    parser.add_argument("--markdown")
    args = parser.parse_args(argv)
    if args.remat and not args.in_layer:
        parser.error("--remat needs --in-layer")
    if args.custom:
        r, t, h, kvh, d, c = (int(x) for x in args.custom.split(","))
        name = f"custom {r} x {t} tokens, {h}/{kvh} heads x {d}"
        shapes, hidden = {name: (r, t, h, kvh, d, bool(c))}, {name: args.hidden or h * d}
    else:
        names = list(SHAPES)
        shapes = {names[int(i)]: SHAPES[names[int(i)]] for i in args.shapes.split(",")}
        hidden = HIDDEN
    results = []
    for name, shape in shapes.items():
        for implementation in args.implementations.split(","):
            row = measure(name, shape, implementation, args.forward_only, hidden[name] if args.in_layer else 0,
                          args.remat)
            print(f"{name}, {implementation}, {row['direction']}: {row['temp_bytes'] / 2**20:,.0f} MiB of "
                  f"temporaries ({row['target']})", flush=True)
            results.append(row)
    command = command_line("attention_memory.py", argv)
    write_outputs(args.json, args.markdown, {"command": command, "machine": machine_info(), "rows": results},
                  markdown(results, command))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
