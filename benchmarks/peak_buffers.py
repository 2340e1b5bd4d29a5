"""What is alive at a TPU-compiled program's memory peak, read from the TPU compiler's own dump.

Why: `memory_analysis()` gives one number for a step's temporaries; when two meshes or two kernels differ by
gigabytes, the question is which buffers. The TPU compiler (libtpu, usable without a TPU) writes, for each
program, a table of every buffer with its size, the schedule step that defines it and the steps that use it
(`*memory-space-assignment-bufferinfo.txt`), and the scheduled program (`*-hlo.txt`). This replays that table:
a buffer is taken as alive from its definition to its last use, the peak is the step where the sum is
largest, and the buffers alive there are listed with the JAX operation each came from (the program's
`op_name` metadata). Layer and block indices in those names are folded (`layers_5` -> `layers_*`), so the
same activation kept for many layers shows as one line with its count.

It is an approximation of the compiler's heap (no aliasing between buffers, no reuse inside loops; a buffer
with no use lives one step, and arguments are freed after their last use), close enough to find what
dominates: on the small preset's FSDP-8 step it gives 602 MiB where the compiler's peak, arguments included,
is 725 MiB (217 against 249 MiB on data 2 x FSDP 4).

  LIBTPU_INIT_ARGS="--xla_jf_dump_to=DUMP --xla_jf_dump_hlo_text=true" \\
      python -m guijax.launch --config=arpo_gpu --dry_run --nodry_run_sampler ...
  python benchmarks/peak_buffers.py DUMP --top 20

The dump holds every pass's output and can take gigabytes for a small model; only the two files above are read.
"""
from __future__ import annotations

import argparse
import collections
import csv
import dataclasses
import json
import pathlib
import re
import sys


@dataclasses.dataclass(frozen=True)
class Buffer:
    instruction: str  # the HLO instruction that defines it
    size: int
    start: int  # schedule step of its definition
    end: int  # schedule step of its last use


def read_buffers(path: pathlib.Path) -> list[Buffer]:
    """The compiler's buffer table, scoped (on-chip scratch) buffers left out."""
    buffers = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            if row["is_scoped"] != "0":
                continue
            found = re.match(r"<\d+ ([^{>]+)", row["buffer_name"])
            if not found:
                raise ValueError(f"{path}: unexpected buffer_name {row['buffer_name']!r}")
            start = int(row["definition_time"])
            uses = [int(t) for t in row["use_times"].split(";") if t]
            buffers.append(Buffer(found.group(1), int(row["size"]), start, max(uses, default=start)))
    return buffers


def peak(buffers: list[Buffer]) -> tuple[int, int, list[Buffer]]:
    """(peak bytes, the schedule step where it is reached, the buffers alive there, largest first)."""
    change: dict[int, int] = collections.defaultdict(int)
    for b in buffers:
        change[b.start] += b.size
        change[b.end + 1] -= b.size
    live = top = at = 0
    for step in sorted(change):
        live += change[step]
        if live > top:
            top, at = live, step
    alive = sorted((b for b in buffers if b.start <= at <= b.end), key=lambda b: -b.size)
    return top, at, alive


def op_names(hlo_text: str) -> dict[str, str]:
    """Each instruction's JAX operation (`op_name` metadata), from the scheduled program's text."""
    names = {}
    for line in hlo_text.splitlines():
        found = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = .*?op_name=\"([^\"]+)\"", line)
        if found:
            names[found.group(1)] = found.group(2)
    return names


def fold(op_name: str) -> str:
    """The operation with layer and block indices folded, so the same tensor of every layer is one key."""
    return re.sub(r"\b(layers|blocks|layer|block)_\d+", r"\1_*", op_name)


def indices(op_name: str) -> list[int]:
    """The layer or block indices `fold` erases, kept so a group says which layers it holds."""
    return [int(i) for i in re.findall(r"\b(?:layers|blocks|layer|block)_(\d+)", op_name)]


def summarise(buffers: list[Buffer], names: dict[str, str], top: int) -> dict:
    total, at, alive = peak(buffers)
    groups: dict[str, list[Buffer]] = collections.defaultdict(list)
    layers: dict[str, set[int]] = collections.defaultdict(set)
    for b in alive:
        name = names.get(b.instruction, b.instruction)
        groups[fold(name)].append(b)
        layers[fold(name)].update(indices(name))
    ranked = sorted(groups.items(), key=lambda kv: -sum(b.size for b in kv[1]))
    named = sum(b.instruction in names for b in alive)
    return {"peak_bytes": total, "peak_step": at, "buffers": len(buffers), "alive": len(alive),
            "alive_with_op_name": named,
            "groups": [{"operation": op, "buffers": len(bs), "bytes": sum(b.size for b in bs),
                        "layers": sorted(layers[op]),
                        "defined_steps": [min(b.start for b in bs), max(b.start for b in bs)],
                        "last_use_steps": [min(b.end for b in bs), max(b.end for b in bs)]}
                       for op, bs in ranked[:top]]}


def _largest(folder: pathlib.Path, pattern: str) -> pathlib.Path:
    found = sorted(folder.glob(pattern), key=lambda p: p.stat().st_size)
    if not found:
        raise SystemExit(f"no {pattern} in {folder}: dump with LIBTPU_INIT_ARGS=\"--xla_jf_dump_to={folder} "
                         "--xla_jf_dump_hlo_text=true\"")
    return found[-1]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dump", type=pathlib.Path, help="the folder --xla_jf_dump_to wrote")
    parser.add_argument("--top", type=int, default=20, help="operations to list")
    parser.add_argument("--json", type=pathlib.Path, help="write the summary here too")
    args = parser.parse_args(argv)
    # the train step is the dump's largest program; the smaller ones are the setup's conversions
    table = _largest(args.dump, "*memory-space-assignment-bufferinfo.txt")
    hlo = _largest(args.dump, "*-hlo.txt")
    result = {"bufferinfo": table.name, "hlo": hlo.name,
              **summarise(read_buffers(table), op_names(hlo.read_text()), args.top)}
    mib = 2 ** 20
    print(f"peak {result['peak_bytes'] / mib:.1f} MiB at schedule step {result['peak_step']}: "
          f"{result['alive']} of {result['buffers']} buffers alive")
    if result["alive_with_op_name"] < result["alive"] / 2:
        print(f"warning: only {result['alive_with_op_name']} of those buffers are named in {hlo.name}; it may be "
              "another program's text (pass a dump folder holding one program's files)")
    print("| MiB | buffers | defined (steps) | last used (steps) | layers | operation |\n|---:|---:|---|---|---|---|")
    for g in result["groups"]:
        print(f"| {g['bytes'] / mib:.1f} | {g['buffers']} | {g['defined_steps'][0]}–{g['defined_steps'][1]} | "
              f"{g['last_use_steps'][0]}–{g['last_use_steps'][1]} | {','.join(map(str, g['layers'])) or '-'} | "
              f"`{g['operation']}` |")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
