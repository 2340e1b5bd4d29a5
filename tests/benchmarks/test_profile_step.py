"""The profile script: the compiled program's instructions are read from its HLO text, the trace's events are
summed per instruction (other events and the trace's end markers left out) and per JAX primitive, and the
whole script, run as users run it, profiles the tiny model's update and names its top operations."""
from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys

import pytest

from benchmark_scripts import BENCH, load as load_script

HLO = """HloModule jit_step, entry_computation_layout={(f32[4,4]{1,0})->f32[]}

%fused_computation (param_0: f32[4,4]) -> f32[4,4] {
  %param_0 = f32[4,4]{1,0} parameter(0)
  ROOT %exponential.1 = f32[4,4]{1,0} exponential(%param_0), metadata={op_name="jit(step)/exp"}
}

ENTRY %main (p: f32[4,4]) -> (f32[], s32[]) {
  %p = f32[4,4]{1,0} parameter(0)
  %dot.3 = f32[4,4]{1,0} dot(%p, %p), lhs_contracting_dims={1}, metadata={op_name="jit(step)/transpose(jvp(model))/dot_general" source_line=12}
  %loop_fusion = f32[4,4]{1,0} fusion(%dot.3), kind=kLoop, calls=%fused_computation, metadata={op_name="jit(step)/exp"}
  ROOT %tuple.9 = (f32[], s32[]) tuple(%loop_fusion, %dot.3)
}
"""


def test_instructions_events_and_primitives_are_read_and_summed(tmp_path):
    mod = load_script("profile_step")
    instructions = mod.hlo_instructions(HLO)
    assert instructions["dot.3"] == {"opcode": "dot", "kind": "",
                                     "op_name": "jit(step)/transpose(jvp(model))/dot_general"}
    assert instructions["loop_fusion"]["kind"] == "kLoop" and instructions["loop_fusion"]["opcode"] == "fusion"
    assert instructions["tuple.9"]["opcode"] == "tuple" and "HloModule" not in instructions
    trace = {"traceEvents": [
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 2, "args": {"name": "tf_XLAEigen"}},
        {"ph": "X", "name": "dot.3", "pid": 1, "tid": 2, "ts": 0, "dur": 3000.0},
        {"ph": "X", "name": "dot.3", "pid": 1, "tid": 3, "ts": 0, "dur": 1000.0},  # the same op on another thread
        {"ph": "X", "name": "kernel_17", "pid": 1, "tid": 4, "ts": 0, "dur": 2000.0, "args": {"hlo_op": "loop_fusion"}},
        {"ph": "X", "name": "end: dot.3", "pid": 1, "tid": 2, "ts": 3000, "dur": 1.0},
        {"ph": "X", "name": "$profiler.py:307 trace", "pid": 1, "tid": 9, "ts": 0, "dur": 9000.0},
    ]}
    folder = tmp_path / "plugins" / "profile" / "run"
    folder.mkdir(parents=True)
    with gzip.open(folder / "perfetto_trace.json.gz", "wt") as f:
        json.dump(trace, f)
    events = mod.read_trace(str(tmp_path))
    assert events[0]["thread"] == "tf_XLAEigen" and len(events) == 5
    rows = mod.operation_times(events, instructions, steps=2)
    assert [(r["instruction"], r["ms_per_step"], r["calls_per_step"]) for r in rows] == [
        ("dot.3", 2.0, 1.0), ("loop_fusion", 1.0, 0.5)]
    assert rows[0]["primitive"] == "dot_general (backward)" and rows[1]["primitive"] == "exp"
    assert sum(r["share"] for r in rows) == pytest.approx(1.0)
    assert [g["primitive"] for g in mod.by_primitive(rows)] == ["dot_general (backward)", "exp"]
    with pytest.raises(FileNotFoundError, match="no perfetto_trace.json.gz"):
        mod.read_trace(str(tmp_path / "empty"))


def test_the_script_profiles_the_tiny_update(tmp_path):
    """Run as a user runs it (its own process: the profiler's state and a stale libtpu stay out of the tests)."""
    out = tmp_path / "profile"
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    proc = subprocess.run([sys.executable, str(BENCH / "profile_step.py"), "--preset", "tiny", "--batch", "1",
                           "--seq", "32", "--steps", "2", "--top", "5", "--trace_dir", str(tmp_path / "trace"), "--unrolled",
                           "--json", f"{out}.json", "--markdown", f"{out}.md"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    payload = json.loads(out.with_suffix(".json").read_text())
    rows = payload["operations"]
    assert rows and payload["wall_ms_per_step"] > 0 and payload["traced_op_ms_per_step"] > 0
    assert all(r["ms_per_step"] >= rows[i + 1]["ms_per_step"] for i, r in enumerate(rows[:-1]))
    assert any(r["primitive"].startswith("dot_general") for r in rows)  # the model's matmuls are in the trace
    assert payload["layers"] == "unrolled" and any("/layers_1/" in r["op_name"] for r in payload["operations"])
    table = out.with_suffix(".md").read_text()
    assert "Top 5 operations:" in table and f"`{rows[0]['instruction']}`" in table
