"""Benchmark: token log-probs + entropy, forward+backward, naive vs chunked (vs Pallas on GPU/TPU).

For each implementation, token count and hidden size it jits
`value_and_grad(sum(logp * c1 + entropy * c2))` w.r.t. hidden and lm_head, reads XLA's compiled
memory analysis (temp = the working memory the op itself needs; args/outputs include lm_head and
its gradient, which every implementation must hold), and times the compiled step (median of
--repeats after one warm-up call). Rows in --mem-hidden are compiled only (memory, no timing),
so the 7B shape (hidden 3584) can be reported on a machine too small or slow to run it.

Targets from issue 4/8: temp memory <= 1/8 of naive, time <= 1.3x naive (CPU).

  python benchmarks/logprob.py --tokens 256,512,1024,2048 --hidden 512 --mem-hidden 3584 \
      --json bench_logprob.json --md bench_logprob.md
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp

try:
    from guijax.kernels import token_logprobs
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from guijax.kernels import token_logprobs

MIB = 2**20


def build(impl: str, n_tokens: int, hidden: int, vocab: int, dtype, block_v: int | None):
    """Jitted fwd+bwd step and its (abstract) arguments."""
    def step(h, w, t, m, c1, c2):
        def loss(hh, ww):
            lp, ent = token_logprobs(hh, ww, t, m, impl=impl, block_v=block_v)
            return jnp.sum(lp * c1 + ent * c2)
        return jax.value_and_grad(loss, argnums=(0, 1))(h, w)

    shapes = (
        jax.ShapeDtypeStruct((1, n_tokens, hidden), dtype),
        jax.ShapeDtypeStruct((hidden, vocab), dtype),
        jax.ShapeDtypeStruct((1, n_tokens), jnp.int32),
        jax.ShapeDtypeStruct((1, n_tokens), jnp.bool_),
        jax.ShapeDtypeStruct((1, n_tokens), jnp.float32),
        jax.ShapeDtypeStruct((1, n_tokens), jnp.float32),
    )
    return jax.jit(step), shapes


def make_args(n_tokens: int, hidden: int, vocab: int, dtype):
    k = jax.random.split(jax.random.PRNGKey(0), 5)
    h = jax.random.normal(k[0], (1, n_tokens, hidden), jnp.float32).astype(dtype)
    w = (jax.random.normal(k[1], (hidden, vocab), jnp.float32) / hidden**0.5).astype(dtype)
    t = jax.random.randint(k[2], (1, n_tokens), 0, vocab, jnp.int32)
    m = jnp.ones((1, n_tokens), jnp.bool_)
    return h, w, t, m, jax.random.normal(k[3], (1, n_tokens)), jax.random.normal(k[4], (1, n_tokens))


def measure(impl, n_tokens, hidden, vocab, dtype, block_v, repeats, timed):
    fn, shapes = build(impl, n_tokens, hidden, vocab, dtype, block_v)
    t0 = time.perf_counter()
    compiled = fn.lower(*shapes).compile()
    compile_s = time.perf_counter() - t0
    ma = compiled.memory_analysis()
    row = {
        "impl": impl, "tokens": n_tokens, "hidden": hidden, "vocab": vocab,
        "dtype": jnp.dtype(dtype).name, "block_v": block_v, "compile_s": round(compile_s, 2),
        "temp_bytes": int(ma.temp_size_in_bytes),
        "argument_bytes": int(ma.argument_size_in_bytes),
        "output_bytes": int(ma.output_size_in_bytes),
        "alias_bytes": int(ma.alias_size_in_bytes),
        "time_s": None, "times_s": None,
    }
    row["total_bytes"] = (row["temp_bytes"] + row["argument_bytes"] + row["output_bytes"]
                          - row["alias_bytes"])
    row["out_of_memory"] = False
    if timed:
        try:
            args = make_args(n_tokens, hidden, vocab, dtype)
            jax.block_until_ready(compiled(*args))  # warm-up
        except jax.errors.JaxRuntimeError as e:  # a row that does not fit is a result, not a crash
            if "RESOURCE_EXHAUSTED" not in str(e):
                raise
            row["out_of_memory"] = True
            return row
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(compiled(*args))
            times.append(time.perf_counter() - t0)
        row["times_s"] = [round(x, 4) for x in times]
        row["time_s"] = round(statistics.median(times), 4)
        del args
    return row


def add_ratios(rows):
    base = {(r["tokens"], r["hidden"]): r for r in rows if r["impl"] == "naive"}
    for r in rows:
        b = base.get((r["tokens"], r["hidden"]))
        r["temp_vs_naive"] = round(r["temp_bytes"] / b["temp_bytes"], 4) if b else None
        r["total_vs_naive"] = round(r["total_bytes"] / b["total_bytes"], 4) if b else None
        r["time_vs_naive"] = (round(r["time_s"] / b["time_s"], 3)
                              if b and r["time_s"] and b["time_s"] else None)


def markdown(rows, meta) -> str:
    def f(x, spec):
        return "–" if x is None else format(x, spec)

    out = [f"Machine: {meta['machine']}; backend {meta['backend']} ({meta['device']}); "
           f"jax {meta['jax']}; dtype {meta['dtype']}; vocab {meta['vocab']}.", "",
           "| impl | tokens | hidden | fwd+bwd time (s) | time ÷ naive | temp (MiB) | "
           "temp ÷ naive | temp+args+out (MiB) | total ÷ naive |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        out.append(
            f"| {r['impl']} | {r['tokens']} | {r['hidden']} | "
            f"{'out of memory' if r.get('out_of_memory') else f(r['time_s'], '.3f')} | "
            f"{f(r['time_vs_naive'], '.2f')} | {r['temp_bytes'] / MIB:.1f} | "
            f"{f(r['temp_vs_naive'], '.4f')} | {r['total_bytes'] / MIB:.0f} | "
            f"{f(r['total_vs_naive'], '.3f')} |")
    return "\n".join(out)


def verdict(rows) -> dict:
    fast = [r for r in rows if r["impl"] != "naive"]
    mem = [r["temp_vs_naive"] for r in fast if r["temp_vs_naive"] is not None]
    tim = [r["time_vs_naive"] for r in fast if r["time_vs_naive"] is not None]
    return {
        "temp_memory_le_1_8_of_naive": bool(mem) and max(mem) <= 1 / 8,
        "worst_temp_ratio": max(mem) if mem else None,
        "time_le_1_3x_naive": bool(tim) and max(tim) <= 1.3,
        "worst_time_ratio": max(tim) if tim else None,
    }


def main(argv=None) -> int:
    backend = jax.default_backend()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="256,512,1024,2048", help="comma-separated token counts")
    p.add_argument("--hidden", default="512", help="hidden sizes that are compiled AND timed")
    p.add_argument("--mem-hidden", default="", help="hidden sizes that are compiled only (memory)")
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--impls", default=None,
                   help="default: naive,chunked (+pallas on gpu/tpu)")
    p.add_argument("--dtype", default=None, help="float32 or bfloat16 (default: fp32 on CPU, bf16 else)")
    p.add_argument("--block-v", type=int, default=None, help="vocab tile (default: per backend)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--json", default=None, help="write rows + verdict here")
    p.add_argument("--md", default=None, help="write the markdown table here")
    a = p.parse_args(argv)

    impls = (a.impls.split(",") if a.impls else
             ["naive", "chunked"] + (["pallas"] if backend in ("gpu", "tpu") else []))
    dtype = jnp.dtype(a.dtype or ("float32" if backend == "cpu" else "bfloat16"))
    plan = [(int(h), True) for h in a.hidden.split(",") if h] + \
           [(int(h), False) for h in a.mem_hidden.split(",") if h]
    rows = []
    for hidden, timed in plan:
        for n in (int(x) for x in a.tokens.split(",")):
            for impl in impls:
                r = measure(impl, n, hidden, a.vocab, dtype, a.block_v, a.repeats, timed)
                print(f"{impl:8s} tokens={n:5d} hidden={hidden:5d} "
                      f"time={'OOM' if r['out_of_memory'] else r['time_s']} "
                      f"temp={r['temp_bytes'] / MIB:.1f}MiB total={r['total_bytes'] / MIB:.0f}MiB",
                      file=sys.stderr, flush=True)
                rows.append(r)
    add_ratios(rows)
    dev = jax.devices()[0]
    meta = {"backend": backend, "device": dev.device_kind, "jax": jax.__version__,
            "machine": f"{platform.machine()} {os.cpu_count()} cpus ({platform.node()})",
            "dtype": dtype.name, "vocab": a.vocab, "repeats": a.repeats,
            "command": " ".join(["python", "benchmarks/logprob.py"] + (argv or sys.argv[1:]))}
    table = markdown(rows, meta)
    v = verdict(rows)
    print(table)
    print(f"\ntemp memory <= 1/8 naive: {v['temp_memory_le_1_8_of_naive']} "
          f"(worst {v['worst_temp_ratio']}); time <= 1.3x naive: {v['time_le_1_3x_naive']} "
          f"(worst {v['worst_time_ratio']})")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"meta": meta, "rows": rows, "verdict": v}, fh, indent=2)
    if a.md:
        with open(a.md, "w") as fh:
            fh.write(table + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
