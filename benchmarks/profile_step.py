"""Profile: where one GRPO update's time goes, operation by operation, from a `jax.profiler` trace.

Why: every claim about what makes a step slow (a transpose, a copy, the optimizer's traffic, attention) should
come from a command in the repo. This compiles the same update `benchmarks/train_step.py` times (the real
`guijax.train_step` path, text-only or with screenshots), runs it once to warm up, then traces `--steps`
more under `jax.profiler.trace(create_perfetto_trace=True)` and reads the trace back: every event whose
name is an instruction of the compiled program (or, on GPU, whose `hlo_op` is one) is an operation the
device ran. Operations are ranked by their time summed over the trace's threads (XLA:CPU splits one
operation over its thread pool, so that sum can exceed the wall-clock time, which is reported beside it),
each with its opcode, fusion kind and the JAX operation it came from (the program's `op_name` metadata). On a
GPU a `while` or `conditional` event spans the kernels inside it, so the summed time counts nested events at
each level and shares are of that sum, not of the step.
A second table sums the same time by that JAX operation's primitive (`dot_general`, `exp`, ...), which is
what to read when many small fusions share one cause. The JSON keeps the top 100 operations and every
primitive.

  python benchmarks/profile_step.py --preset tiny --batch 2 --seq 256 --steps 3 --top 15 \\
      --json benchmarks/results/profile_step_cpu.json --markdown benchmarks/results/profile_step_cpu.md

The raw trace stays in --trace_dir (a temporary folder otherwise) for Perfetto (ui.perfetto.dev) or
TensorBoard. On a CPU-only machine that also has a libtpu wheel whose version does not match jaxlib's, the
profiler can end the process without a word: run with JAX_PLATFORMS=cpu there.
"""
from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys
import tempfile
import time
from typing import Any

# XLA:GPU runs loop and branch bodies as command buffers (CUDA graphs), which the trace shows as one event
# named after the while/conditional: a GPU profile then says "the layer loop took 29%" and nothing inside it.
# Without them each kernel is its own event (at some launch overhead); --gpu-command-buffers keeps them.
# The flag must be set before JAX starts, so it acts when this file runs as a script (imported, it leaves the
# process's XLA_FLAGS alone); the report says which way the profiled program ran.
NO_COMMAND_BUFFERS = "--xla_gpu_enable_command_buffer="
if __name__ == "__main__" and "--gpu-command-buffers" not in sys.argv:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + NO_COMMAND_BUFFERS).strip()
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402

import jax  # noqa: E402

from train_step import build, make_batch, model_config, screenshot_batch  # noqa: E402

_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<rest>.*)$")
_OPCODE = re.compile(r"(?:^|[\s)}])(?P<op>[a-z][\w\-]*)\(")


def hlo_instructions(hlo_text: str) -> dict[str, dict[str, str]]:
    """Every instruction of an HLO module's text by name: opcode, fusion kind, the JAX op_name it came from."""
    out = {}
    for line in hlo_text.splitlines():
        m = _INSTRUCTION.match(line)
        if m is None or line.lstrip().startswith(("HloModule", "//")):
            continue
        rest = m.group("rest")
        op = _OPCODE.search(rest)
        kind = re.search(r"\bkind=(k\w+)", rest)
        source = re.search(r'op_name="([^"]*)"', rest)
        out[m.group("name")] = {"opcode": op.group("op") if op else "", "kind": kind.group(1) if kind else "",
                                "op_name": source.group(1) if source else ""}
    return out


def primitive(op_name: str) -> str:
    """The JAX primitive at the end of an op_name path (`jit(step)/jvp(...)/dot_general` -> `dot_general`),
    with transposes of the backward pass marked."""
    if not op_name:
        return "(no JAX op)"
    last = op_name.rstrip("/").split("/")[-1]
    last = re.sub(r"\[.*$", "", last) or last
    return f"{last} (backward)" if "transpose(" in op_name else last


def read_trace(trace_dir: str) -> list[dict[str, Any]]:
    """The complete ('X') events of the newest perfetto trace under `trace_dir`, each with its thread's name."""
    paths = sorted(glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True),
                   key=os.path.getmtime)
    if not paths:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {trace_dir}: the profiler wrote no trace")
    with gzip.open(paths[-1], "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    threads = {(e.get("pid"), e.get("tid")): e.get("args", {}).get("name", "")
               for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
    return [dict(e, thread=threads.get((e.get("pid"), e.get("tid")), "")) for e in events if e.get("ph") == "X"]


def operation_times(events: list[dict[str, Any]], instructions: dict[str, dict[str, str]],
                    steps: int) -> list[dict[str, Any]]:
    """Per instruction of the program: time per step (ms, summed over threads), calls per step, share."""
    total: dict[str, float] = collections.defaultdict(float)
    calls: dict[str, int] = collections.defaultdict(int)
    for e in events:
        name = (e.get("args") or {}).get("hlo_op") or e.get("name", "")
        if name in instructions:
            total[name] += float(e.get("dur", 0.0))
            calls[name] += 1
    whole = sum(total.values()) or 1.0
    rows = [{"instruction": name, **instructions[name], "primitive": primitive(instructions[name]["op_name"]),
             "ms_per_step": us / 1e3 / steps, "calls_per_step": calls[name] / steps, "share": us / whole}
            for name, us in total.items()]
    return sorted(rows, key=lambda r: -r["ms_per_step"])


def by_primitive(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    groups: dict[str, dict[str, Any]] = {}
    for r in rows:
        g = groups.setdefault(r["primitive"], {"primitive": r["primitive"], "ms_per_step": 0.0, "share": 0.0,
                                               "instructions": 0})
        g["ms_per_step"] += r["ms_per_step"]
        g["share"] += r["share"]
        g["instructions"] += 1
    return sorted(groups.values(), key=lambda g: -g["ms_per_step"])


def profile(args: argparse.Namespace) -> dict[str, Any]:
    cfg = model_config(args.preset)
    _, step, init_state, params = build(cfg, args.dtype, args.remat, scan_layers=not args.unrolled)
    state = init_state(params)
    del params  # the step donates its state, which may share these buffers
    if args.screenshots:
        host, gui = screenshot_batch(cfg, args.batch, args.screenshots, tuple(args.screenshot_hw), args.response,
                                     args.seq or None)
        seq = gui["seq"]
    else:
        host, seq = make_batch(cfg, args.batch, args.seq), args.seq
    t0 = time.perf_counter()
    compiled = step.compile(state, host)
    compile_s = time.perf_counter() - t0
    data = compiled.place(host)
    instructions = hlo_instructions(compiled.compiled.as_text())
    state, metrics = compiled(state, data)  # warm-up: first-run allocations stay out of the trace
    jax.block_until_ready(metrics)
    trace_dir = args.trace_dir or tempfile.mkdtemp(prefix="profile_step_")
    walls = []
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        for _ in range(args.steps):
            t = time.perf_counter()
            state, metrics = compiled(state, data)
            jax.block_until_ready(metrics)
            walls.append(time.perf_counter() - t)
    rows = operation_times(read_trace(trace_dir), instructions, args.steps)
    if not rows:
        raise RuntimeError(f"the trace in {trace_dir} holds no operation of the compiled program")
    return {"command": bc.command_line("profile_step.py", args.argv), "machine": bc.machine_info(),
            "preset": args.preset, "batch": args.batch, "seq": seq, "screenshots": args.screenshots,
            "dtype": args.dtype, "remat": args.remat, "layers": "unrolled" if args.unrolled else "scan",
            "gpu_command_buffers": NO_COMMAND_BUFFERS not in os.environ.get("XLA_FLAGS", ""),
            "steps": args.steps, "compile_s": round(compile_s, 2),
            "wall_ms_per_step": 1e3 * bc.median(walls), "traced_op_ms_per_step": sum(r["ms_per_step"] for r in rows),
            "trace_dir": trace_dir, "operations_traced": len(rows), "operations": rows[:max(100, args.top)],
            "primitives": by_primitive(rows), "top": args.top}


def markdown(p: dict[str, Any]) -> str:
    shape = f"{p['batch']} x {p['seq']} tokens" + (f", {p['screenshots']} screenshots per row" if p["screenshots"] else "")
    lines = [f"# Where the update's time goes: {p['preset']} ({shape}, {p['dtype']}, remat {p['remat']}, layers "
             f"{p.get('layers', 'scan')})", "",
             f"`{p['command']}`", "", bc.machine_line(p["machine"]), "",
             f"Wall-clock {p['wall_ms_per_step']:.1f} ms per step (median of {p['steps']} traced steps); the "
             f"program's operations took {p['traced_op_ms_per_step']:.1f} ms per step summed over threads.", "",
             f"Top {p['top']} operations:", "",
             "| operation | opcode | kind | JAX op | ms per step | calls | share |", "|---|---|---|---|---|---|---|"]
    for r in p["operations"][:p["top"]]:
        source = "/".join(r["op_name"].split("/")[-3:]) or "-"
        lines.append(f"| `{r['instruction']}` | {r['opcode']} | {r['kind'] or '-'} | `{source[:90]}` | "
                     f"{r['ms_per_step']:.2f} | {r['calls_per_step']:g} | {100 * r['share']:.1f}% |")
    lines += ["", "By JAX primitive:", "", "| primitive | instructions | ms per step | share |", "|---|---|---|---|"]
    lines += [f"| {g['primitive']} | {g['instructions']} | {g['ms_per_step']:.2f} | {100 * g['share']:.1f}% |"
              for g in p["primitives"][:p["top"]]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny", help="a guijax.models.config preset or qwen2_5_0_5b")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=256, help="tokens per row (text-only); with screenshots, 0: fit")
    p.add_argument("--screenshots", type=int, default=0, help="screenshots per row (0: text-only rows)")
    p.add_argument("--screenshot-hw", type=lambda s: tuple(int(v) for v in s.split(",")), default=(1080, 1920))
    p.add_argument("--response", type=int, default=100, help="response tokens per row (with screenshots)")
    p.add_argument("--dtype", default=bc.default_dtype())
    p.add_argument("--remat", default="none")
    p.add_argument("--unrolled", action="store_true", help="one module per layer instead of the layers under scan")
    p.add_argument("--steps", type=int, default=3, help="traced steps (after one untraced warm-up)")
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--gpu-command-buffers", action="store_true",
                   help="GPU: keep XLA's command buffers (faster, but loop bodies show as one event)")
    p.add_argument("--trace_dir", default="", help="where the raw trace stays (default: a temporary folder)")
    p.add_argument("--json")
    p.add_argument("--markdown", "--md", dest="md")
    args = p.parse_args(argv)
    if args.steps < 1 or args.top < 1:
        raise SystemExit("--steps and --top must be at least 1")
    args.argv = argv
    payload = profile(args)
    text = markdown(payload)
    bc.write_outputs(args.json, args.md, payload, text)
    print(text)
    return payload


if __name__ == "__main__":
    main()
