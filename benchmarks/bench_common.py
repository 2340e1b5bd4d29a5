"""Helpers shared by the benchmark scripts: machine description, timing, peak FLOP/s, output files.

Not a benchmark itself. Scripts import it as `bench_common` (their own folder is on sys.path when they run
as `python benchmarks/NAME.py`; tests load the scripts by path and put the folder there first).
"""
from __future__ import annotations

import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import time
from typing import Any, Callable

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
if str(ROOT) not in sys.path:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

# Dense bf16 peak FLOP/s per chip from the vendors' spec sheets (without structured sparsity).
SPEC_PEAK_BF16 = {
    "h200": 989e12,
    "h100": 989e12,
    "a100": 312e12,
    "tpu v6e": 918e12,
    "tpu v5p": 459e12,
    "tpu v5e": 197e12,
    "tpu v4": 275e12,
}
# HBM bandwidth from the spec sheets, bytes/s: the roofline of memory-bound work such as a KV-cache decode.
SPEC_HBM_BYTES_PER_S = {
    "h200": 4.8e12,
    "h100": 3.35e12,
    "a100": 2.039e12,
    "tpu v6e": 1.64e12,
    "tpu v5p": 2.765e12,
    "tpu v5e": 0.819e12,
    "tpu v4": 1.2e12,
}
# jax's device_kind spellings -> keys above (checked in order; lower-cased substring match).
_KIND_ALIASES = (
    ("h200", "h200"), ("h100", "h100"), ("a100", "a100"),
    ("v6 lite", "tpu v6e"), ("v6e", "tpu v6e"), ("v5p", "tpu v5p"), ("v5 lite", "tpu v5e"),
    ("v5e", "tpu v5e"), ("tpu v4", "tpu v4"),
)


def source_commit() -> str | None:
    """The checkout's commit, with "+changes" when tracked files differ from it; None outside a git checkout
    (a device machine gets the working tree without its history)."""
    root = pathlib.Path(__file__).resolve().parent.parent
    try:
        top = subprocess.run(["git", "-C", str(root), "rev-parse", "--show-toplevel"], capture_output=True,
                             text=True, timeout=10)
        if top.returncode or pathlib.Path(top.stdout.strip()).resolve() != root:
            return None  # not a checkout of its own (a copy inside another repository says nothing about this one)
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10)
        if head.returncode:
            return None
        changed = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                                 capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("+changes" if changed else "")


# The vector and matrix extensions that decide which kernels XLA:CPU's and PyTorch's libraries run: the same
# benchmark on hosts with and without AVX-512 is not the same comparison.
CPU_EXTENSIONS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile")


def cpu_description(cpuinfo: pathlib.Path = pathlib.Path("/proc/cpuinfo")) -> tuple[str | None, list[str]]:
    """(the CPU's model name, which of CPU_EXTENSIONS it has), read from Linux's cpuinfo; (None, []) elsewhere."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return None, []
    model = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), None)
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return model, [ext for ext in CPU_EXTENSIONS if ext in flags]


def machine_info() -> dict[str, Any]:
    dev = jax.devices()[0]
    cpu_model, cpu_extensions = cpu_description()
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        affinity = os.cpu_count()
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = None
    return {
        "backend": jax.default_backend(), "device_kind": dev.device_kind, "device_count": jax.device_count(),
        "cpu_count": os.cpu_count(), "cpus_usable": affinity, "load_average_at_start": load,
        "machine": platform.machine(), "processor": platform.processor() or None, "host": platform.node(),
        "cpu_model": cpu_model, "cpu_extensions": cpu_extensions,
        "python": platform.python_version(), "jax": jax.__version__, "commit": source_commit(),
    }


def machine_line(info: dict[str, Any]) -> str:
    cpu = info.get("cpu_model")
    extensions = ", ".join(info.get("cpu_extensions") or []) or "none of " + "/".join(CPU_EXTENSIONS)
    return (f"{info['host']}: {info['machine']}" + (f" ({cpu}; {extensions})" if cpu else "")
            + f", {info['cpus_usable']}/{info['cpu_count']} CPUs usable, "
            f"backend {info['backend']} ({info['device_kind']} x{info['device_count']}), jax {info['jax']}, "
            f"load average at start {info['load_average_at_start']}"
            + (f", commit {info['commit']}" if info.get("commit") else ""))


def default_dtype() -> str:
    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


def time_calls(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> list[float]:
    """Seconds of each of `repeats` calls of fn() after `warmup` untimed ones (compilation happens there);
    every call is waited on with jax.block_until_ready."""
    for _ in range(warmup):
        jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return times


def median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def measure_matmul_peak(n: int = 2048, repeats: int = 5, dtype: Any = jnp.float32) -> dict[str, Any]:
    """Best FLOP/s of a jitted dense n x n @ n x n matmul: the attainable peak of this machine right now
    (used as the MFU denominator on CPU, where no spec sheet number applies)."""
    ka, kb = jax.random.split(jax.random.PRNGKey(0))
    a = jax.random.normal(ka, (n, n), jnp.float32).astype(dtype)
    b = jax.random.normal(kb, (n, n), jnp.float32).astype(dtype)
    f = jax.jit(lambda x, y: x @ y)
    times = time_calls(lambda: f(a, b), repeats, warmup=2)
    flops = 2.0 * n ** 3
    return {"n": n, "dtype": jnp.dtype(dtype).name, "best_s": min(times), "median_s": median(times),
            "flops_per_s": flops / min(times)}


def _spec(device_kind: str, table: dict[str, float]) -> float | None:
    kind = device_kind.lower()
    for alias, key in _KIND_ALIASES:
        if alias in kind:
            return table[key]
    return None


def spec_peak(device_kind: str) -> float | None:
    return _spec(device_kind, SPEC_PEAK_BF16)


def spec_bandwidth(device_kind: str) -> float | None:
    """The spec sheet's HBM bytes/s of a known GPU/TPU (None elsewhere: a CPU's has no single figure)."""
    return _spec(device_kind, SPEC_HBM_BYTES_PER_S)


def peak_flops(matmul_n: int = 2048, repeats: int = 5) -> dict[str, Any]:
    """MFU denominator: the spec bf16 peak on a known GPU/TPU, else a float32 matmul measured now."""
    info = jax.devices()[0]
    if jax.default_backend() != "cpu":
        spec = spec_peak(info.device_kind)
        if spec is not None:
            return {"source": f"spec sheet, dense bf16, {info.device_kind}", "flops_per_s": spec}
    m = measure_matmul_peak(matmul_n, repeats)
    return {"source": f"measured: jitted float32 {matmul_n}x{matmul_n} matmul, best of {repeats}",
            "flops_per_s": m["flops_per_s"], "matmul": m}


def write_outputs(json_path: str | None, md_path: str | None, payload: dict[str, Any], markdown: str) -> None:
    for path, text in ((json_path, json.dumps(payload, indent=2) + "\n"), (md_path, markdown + "\n")):
        if path:
            p = pathlib.Path(path)
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(text)


def command_line(script: str, argv: list[str] | None) -> str:
    return " ".join(["python", f"benchmarks/{script}"] + list(sys.argv[1:] if argv is None else argv))
