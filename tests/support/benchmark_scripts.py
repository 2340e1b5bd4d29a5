"""Loading the benchmark scripts (benchmarks/*.py, not a package) by path, and reading what they write."""
from __future__ import annotations

import importlib.util
import json
import pathlib
import sys
from types import ModuleType

BENCH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"


def load(name: str) -> ModuleType:
    """benchmarks/NAME.py as a module, with its folder on sys.path for its `bench_common` import."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the script is executed
    spec.loader.exec_module(module)
    return module


def outputs(tmp_path: pathlib.Path, name: str) -> list[str]:
    return ["--json", str(tmp_path / f"{name}.json"), "--markdown", str(tmp_path / f"{name}.md")]


def read(tmp_path: pathlib.Path, name: str) -> dict:
    assert (tmp_path / f"{name}.md").read_text().strip()
    return json.loads((tmp_path / f"{name}.json").read_text())
