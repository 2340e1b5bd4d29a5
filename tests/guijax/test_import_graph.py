"""The package's import rules: no two modules import each other (function-local imports included), in
guijax/ or in envs/, and the loop, step and trainer name no method."""
from __future__ import annotations

import ast
import pathlib

import pytest

from guijax.methods import REGISTRY

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: pathlib.Path, modules: set[str]) -> set[str]:
    """Every project module `path` imports anywhere in its body (a package import counts as its __init__)."""
    tree = ast.parse(path.read_text(), str(path))
    me = _module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
            subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules]
            names = subs if len(subs) == len(node.names) else [base] + subs
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != me and not me.startswith(name + "."):  # a package's own __init__ runs anyway
                found.add(name)
    return found


def _graph() -> dict[str, set[str]]:
    files = [p for top in ("guijax", "envs") for p in (ROOT / top).rglob("*.py")]
    modules = {_module_name(p) for p in files}
    return {_module_name(p): _imports(p, modules) for p in files}


def test_no_two_modules_import_each_other():
    graph = _graph()
    pairs = sorted({tuple(sorted((a, b))) for a, deps in graph.items() for b in deps if a in graph.get(b, set())})
    assert not pairs, f"modules that import each other: {pairs}"


def test_envs_never_imports_guijax():
    offenders = {m: sorted(d for d in deps if d.startswith("guijax")) for m, deps in _graph().items()
                 if m.startswith("envs") and any(d.startswith("guijax") for d in deps)}
    assert not offenders


def test_methods_sit_below_the_pipeline():
    """methods -> rl/rollout/data -> models; the pipeline drives methods, never the other way."""
    bad = {m: sorted(d for d in deps if d.startswith("guijax.pipeline")) for m, deps in _graph().items()
           if m.startswith("guijax.methods") and any(d.startswith("guijax.pipeline") for d in deps)}
    assert not bad
    loop = {m: sorted(d for d in deps if d.startswith("guijax.methods")) for m, deps in _graph().items()
            if m in ("guijax.trainer", "guijax.train_step", "guijax.objectives", "guijax.sft")
            and any(d.startswith("guijax.methods") for d in deps)}
    assert not loop


@pytest.mark.parametrize("module", ["guijax/trainer.py", "guijax/train_step.py"])
def test_the_loop_and_the_step_name_no_method(module):
    source = (ROOT / module).read_text()
    named = [name for name in REGISTRY if f'"{name}"' in source or f"'{name}'" in source]
    assert not named, f"{module} names methods {named}"
    for attribute in ("update_rule", "sft_only", '"expert" in batch', "algorithm"):
        assert attribute not in source, f"{module} checks {attribute!r}"
