"""Benchmark: the train step's time on packed rows for each attention backend and blockwise tile.

Why: packed rows hold several examples end to end, kept apart by segment ids. The blockwise attention skips a
[tile x tile] block only when every pair in it is masked, so with 512-token tiles a row of 256-token examples
computes each example against its neighbours and masks the result; smaller tiles skip more of that work but
run more, smaller matmuls. On a Hopper GPU `auto` gives packed rows to cuDNN's packed layout instead
(`guijax.models.cudnn_packed`; the tile then plays no part), so `--attention auto,xla` sets that kernel against
the blockwise path on the same rows. This measures which wins, on the real step.

Each row of `--seq` tokens holds examples of `--example` tokens (0: one example per row, nothing packed),
each with its own segment id and M-RoPE positions from 0, every token but an example's last carrying the
loss. The batch, parameters and optimiser are the same for every tile; one untimed call compiles, the figure
is the median of --repeats timed calls (`benchmarks/train_step.py`'s build and optimiser).

  python benchmarks/attention_tile.py --preset small --rows 4 --seq 1024 --examples 0,128,256 \\
      --blocks 128,256,512 --repeats 5 --json benchmarks/results/attention_tile_step_cpu.json \\
      --markdown benchmarks/results/attention_tile_step_cpu.md
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from train_step import build, make_batch, model_config  # noqa: E402


def packed_batch(cfg: Any, rows: int, seq: int, example: int, seed: int = 0) -> dict[str, np.ndarray]:
    """make_batch's rows cut into examples of `example` tokens: segment ids 1, 2, ... (the decoder's
    attention_mask), positions restarting at each example, no loss on an example's last token."""
    batch = make_batch(cfg, rows, seq, seed)
    if not example:
        return batch
    if seq % example:
        raise SystemExit(f"--seq {seq} is not a multiple of the example length {example}")
    index = np.arange(seq)
    batch["attention_mask"] = np.broadcast_to((index // example + 1).astype(np.int32), (rows, seq)).copy()
    batch["positions"] = np.broadcast_to((index % example).astype(np.int32), (3, rows, seq)).copy()
    last = (index % example) == example - 1
    for key in ("loss_mask", "old_logp", "advantages"):
        batch[key] = np.where(last[None], 0.0, batch[key]).astype(np.float32)
    return batch


def measure(preset: str, rows: int, seq: int, example: int, block: int, dtype: str, repeats: int,
            attention: str = "auto") -> dict[str, Any]:
    cfg = model_config(preset)
    _, step, init_state, params = build(cfg, dtype, attention_block=block, attention=attention)
    holder = {"state": init_state(params)}
    del params  # the step donates its state
    data = jax.device_put(packed_batch(cfg, rows, seq, example))

    def call():
        holder["state"], metrics = step(holder["state"], data)
        return metrics

    t0 = time.perf_counter()
    metrics = jax.block_until_ready(call())
    first = time.perf_counter() - t0
    times = bc.time_calls(call, repeats, warmup=0)
    return {"preset": preset, "rows": rows, "seq": seq, "example": example, "block": block, "dtype": dtype,
            "attention": attention,
            "compile_and_first_s": round(first, 2), "times_s": [round(t, 4) for t in times],
            "step_s": bc.median(times), "tokens_per_s": rows * seq / bc.median(times),
            "loss": float(metrics["loss"])}


def markdown(payload: dict[str, Any]) -> str:
    r0 = payload["rows"][0]
    lines = [f"# Packed rows and the attention tile ({r0['preset']}, {r0['rows']} rows x {r0['seq']} tokens, "
             f"{r0['dtype']})", "", f"`{payload['command']}`", "", bc.machine_line(payload["machine"]), "",
             "| examples per row | attention | tile | step s | tokens/s | step time vs tile 512 |",
             "|---|---|---|---|---|---|"]
    base = {(r["example"], r.get("attention", "auto")): r["step_s"] for r in payload["rows"] if r["block"] == 512}
    for r in payload["rows"]:
        per_row = r["seq"] // r["example"] if r["example"] else 1
        key = (r["example"], r.get("attention", "auto"))
        rel = f"{r['step_s'] / base[key]:.2f}x" if key in base else "-"
        lines.append(f"| {per_row} of {r['example'] or r['seq']} tokens | {key[1]} | {r['block']} | "
                     f"{r['step_s']:.3f} | {r['tokens_per_s']:,.0f} | {rel} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="small")
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--examples", default="0,128,256", help="comma-separated example lengths (0: unpacked rows)")
    p.add_argument("--blocks", default="128,256,512", help="comma-separated attention tiles")
    p.add_argument("--attention", default="auto",
                   help="comma-separated attention backends (guijax.models.attention.IMPLEMENTATIONS)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dtype", default=None)
    p.add_argument("--json")
    p.add_argument("--markdown", "--md", dest="md")
    a = p.parse_args(argv)
    dtype = a.dtype or bc.default_dtype()
    rows = []
    for example in [int(x) for x in a.examples.split(",") if x]:
        for attention in [x for x in a.attention.split(",") if x]:
            for block in [int(x) for x in a.blocks.split(",") if x]:
                r = measure(a.preset, a.rows, a.seq, example, block, dtype, a.repeats, attention)
                print(f"example {example}, {attention}, tile {block}: {r['step_s']:.3f} s", file=sys.stderr,
                      flush=True)
                rows.append(r)
    payload = {"command": bc.command_line("attention_tile.py", argv), "machine": bc.machine_info(), "rows": rows}
    text = markdown(payload)
    bc.write_outputs(a.json, a.md, payload, text)
    print(text)
    return payload


if __name__ == "__main__":
    main()
