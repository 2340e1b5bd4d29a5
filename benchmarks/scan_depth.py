"""Benchmark: program size and compile time of the training forward+backward against depth, scanned vs
unrolled decoder layers.

For each depth it lowers `value_and_grad` of the text forward (parameters abstract, nothing allocated) and
reports the StableHLO text size and its dot_general count; depths up to --compile-max are also compiled for
the default backend and timed. Widths come from --preset, depth replaces its num_hidden_layers.

  python benchmarks/scan_depth.py --preset tiny --layers 2,8,28 --compile-max 28 --json scan_depth.json
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

try:
    from guijax.models import weights
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from guijax.models import weights
from guijax.models.config import get_preset


def lowered(preset: str, layers: int, scan: bool, remat: str, seq: int) -> Any:
    """The lowered fwd+bwd of a text batch [2, seq] at `layers` depth."""
    cfg = get_preset(preset).replace(num_hidden_layers=layers)
    module = weights.build_module(cfg, remat_policy=remat, scan_layers=scan)
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), nn.unbox(weights.abstract_params(module)))
    ids = jax.ShapeDtypeStruct((2, seq), jnp.int32)

    def loss(p, ids):
        positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (3, 2, seq))
        hidden, _ = module.apply({"params": p}, ids, positions, jnp.ones((2, seq), jnp.int32), return_logits=False)
        return jnp.mean(jnp.square(hidden))

    return jax.jit(jax.value_and_grad(loss)).lower(params, ids)


def measure(preset: str, layers: int, scan: bool, remat: str, seq: int, compile_: bool) -> dict[str, Any]:
    start = time.perf_counter()
    low = lowered(preset, layers, scan, remat, seq)
    lower_s = time.perf_counter() - start
    text = low.as_text()
    row = {"preset": preset, "layers": layers, "scan": scan, "remat": remat, "hlo_chars": len(text),
           "dot_general": len(re.findall(r"stablehlo\.dot_general", text)), "lower_s": round(lower_s, 2)}
    if compile_:
        start = time.perf_counter()
        low.compile()
        row["compile_s"] = round(time.perf_counter() - start, 2)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--layers", default="2,8,28")
    ap.add_argument("--remat", default="full")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--compile-max", type=int, default=28, help="compile (and time) depths up to this")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    rows = []
    for layers in [int(x) for x in args.layers.split(",")]:
        for scan in (True, False):
            row = measure(args.preset, layers, scan, args.remat, args.seq, layers <= args.compile_max)
            print(json.dumps(row), flush=True)
            rows.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"backend": jax.default_backend(), "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
