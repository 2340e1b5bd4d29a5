"""Which OSWorld tasks the local desktop can run end to end, and what each other task is missing.

    python -m envs.osworld.coverage ../shared/osworld [--cache-dir DIR ...] [--tasks] [--json out.json]

A static check per task: every setup / postconfig step type, getter and metric is implemented here (and, for
compare_table, every rule type and check_cell method); every program a `launch` (or a list-form `execute` /
`vm_command_line`) starts is installed; every file a `download` step or `cloud_file` getter needs is in a
local cache (there is no internet); every file an `open` step opens has an application. It cannot see inside
shell scripts, so a task it counts as runnable may still fail at run time; it flags what a GNOME VM has and a
bare Xvfb desktop lacks (gsettings/dconf, GNOME shortcuts, sudo, HOME=/home/user) from the task's text.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import shlex
import shutil
import sys
from typing import Any, Iterable, Sequence

from envs.desktop import cache
from envs.desktop.controller import _OPENERS
from envs.metrics import known_metrics
from envs.osworld import metrics as _metrics  # noqa: F401  (registers the OSWorld metrics)
from envs.osworld.getters import GETTERS
from envs.osworld.loader import OSWorldTask, Step, load_osworld
from envs.osworld.setup import STEPS

_SHELL_WORDS = {"echo", "export", "cd", "[", "[[", "test", "if", "for", "while", "true", "false", "printf", "source",
                ".", "exit", "set", "unset", "read", "eval", "exec", "{", "(", "!", "then", "do", "case", "function"}
_TABLE_RULES = {"sheet_name", "sheet_data", "check_cell"}
_CELL_METHODS = ("eq", "ne", "approx", "str_eq", "str_contains")
_APP_PROGRAMS = {"chrome": ("google-chrome", "chromium"), "gimp": ("gimp",), "vlc": ("vlc",),
                 "thunderbird": ("thunderbird",), "vs_code": ("code",), "libreoffice_calc": ("libreoffice",),
                 "libreoffice_writer": ("libreoffice",), "libreoffice_impress": ("libreoffice",)}


def _program(command: Any, shell: bool) -> str | None:
    """The program a command starts, when it can be told without running a shell."""
    if isinstance(command, list):
        return str(command[0]) if command else None
    if not isinstance(command, str):
        return None
    try:
        words = shlex.split(command)
    except ValueError:
        return None
    if not words:
        return None
    first = words[0]
    if shell and (first in _SHELL_WORDS or "=" in first or first.startswith("$")):
        return None
    return first


def _step_needs(step: Step, where: str, cache_dirs: Sequence[str], base_dir: str | None) -> Iterable[str]:
    if step.type not in STEPS:
        yield f"{where} step '{step.type}'"
        return
    p = step.parameters
    if step.type in ("launch", "execute", "command"):
        prog = _program(p.get("command"), bool(p.get("shell", False)))
        if prog and not prog.startswith(("./", "/tmp", "~")) and shutil.which(prog) is None:
            yield f"program '{prog}'"
    elif step.type == "download":
        for f in p.get("files", []):
            if cache.locate(f.get("url", ""), f.get("path", ""), cache_dirs, base_dir) is None:
                yield "cached download"
    elif step.type == "open":
        path = str(p.get("path", ""))
        ext = os.path.splitext(path)[1].lower()
        if ext:
            opener = next((cmd for exts, cmd in _OPENERS.items() if ext in exts), None)
            if opener is None and shutil.which("xdg-open") is None:
                yield f"opener for '{ext}'"
            elif opener is not None and shutil.which(opener[0]) is None:
                yield f"program '{opener[0]}'"
        elif shutil.which(path) is None:
            yield f"program '{path}'"


# Things an OSWorld Ubuntu VM has that a bare Xvfb desktop does not, spotted in a task's command text.
_ENVIRONMENT_HINTS = (
    ("gsettings", "GNOME session (gsettings/dconf)"),
    ("'ctrl', 'alt', 't'", "GNOME shortcut ctrl+alt+t"),
    ("gnome-", "GNOME session (gsettings/dconf)"),
    ("DBUS_SESSION_BUS_ADDRESS", "GNOME session (gsettings/dconf)"),
)


def _environment_needs(t: OSWorldTask, home: str | None) -> Iterable[str]:
    text = json.dumps([t.task.config, t.task.evaluator])
    for needle, need in _ENVIRONMENT_HINTS:
        if needle in text:
            yield need
    if "sudo" in text and shutil.which("sudo") is None:
        yield "program 'sudo'"
    if "/home/user" in text and home != "/home/user":
        yield "HOME=/home/user (DesktopEnv(home='/home/user'))"


def task_needs(t: OSWorldTask, cache_dirs: Sequence[str] = (), home: str | None = None) -> list[str]:
    """What this machine lacks to run `t` end to end (empty: runnable). `home`: the desktop's HOME."""
    base = os.path.dirname(t.task.source) if t.task.source else None
    missing: list[str] = list(_environment_needs(t, home))
    for s in t.setup:
        missing += _step_needs(s, "setup", cache_dirs, base)
    ev = t.evaluator
    for s in ev.postconfig:
        missing += _step_needs(s, "postconfig", cache_dirs, base)
    if not ev.infeasible:
        metrics = set(known_metrics())
        for f in ev.funcs:
            if f not in metrics:
                missing.append(f"metric '{f}'")
        for g in (*ev.results, *ev.expected):
            if g is None:
                continue
            if g.type not in GETTERS:
                missing.append(f"getter '{g.type}'")
            elif g.type == "cloud_file":
                urls = g.config.get("path")
                dests = g.config.get("dest")
                urls, dests = (urls, dests) if g.config.get("multi") else ([urls], [dests])
                for u, d in zip(urls, dests):
                    if cache.locate(str(u), str(d), cache_dirs, base) is None:
                        missing.append("cached expected file")
            elif g.type in ("vm_command_line", "vm_command_error"):
                prog = _program(g.config.get("command"), bool(g.config.get("shell", False)))
                if prog and shutil.which(prog) is None:
                    missing.append(f"program '{prog}'")
        for f, opts in zip(ev.funcs, ev.options):
            if f == "compare_table":
                for rule in opts.get("rules", []) or []:
                    kind = rule.get("type")
                    if kind not in _TABLE_RULES:
                        missing.append(f"compare_table rule '{kind}'")
                    elif kind == "check_cell":
                        for prop, r in rule.get("props", {}).items():
                            method = str(r.get("method", "eq")) if isinstance(r, dict) else "?"
                            if prop != "value" or not method.startswith(_CELL_METHODS):
                                missing.append(f"compare_table check_cell '{prop}:{method}'")
    for app in t.related_apps:
        progs = _APP_PROGRAMS.get(app)
        if progs and not any(shutil.which(p) for p in progs):
            missing.append(f"program '{progs[0]}'")
    return sorted(set(missing))


def report(tasks: Sequence[OSWorldTask], cache_dirs: Sequence[str] = (), home: str | None = None) -> dict[str, Any]:
    by_domain: dict[str, dict[str, Any]] = {}
    for t in tasks:
        d = by_domain.setdefault(t.domain, {"total": 0, "runnable": 0, "missing": collections.Counter(), "tasks": {}})
        needs = task_needs(t, cache_dirs, home)
        d["total"] += 1
        d["runnable"] += not needs
        d["missing"].update(needs)
        d["tasks"][t.id] = needs
    return by_domain


def format_report(rep: dict[str, Any], per_task: bool = False, top: int = 6) -> str:
    lines = [f"{'domain':20s} {'runnable':>9s} {'total':>6s}  most common missing (tasks)"]
    tot = run = 0
    for name in sorted(rep):
        d = rep[name]
        tot += d["total"]
        run += d["runnable"]
        common = ", ".join(f"{k} ({v})" for k, v in d["missing"].most_common(top))
        lines.append(f"{name:20s} {d['runnable']:>9d} {d['total']:>6d}  {common}")
    lines.append(f"{'all':20s} {run:>9d} {tot:>6d}")
    if per_task:
        for name in sorted(rep):
            for tid, needs in sorted(rep[name]["tasks"].items()):
                lines.append(f"{name}/{tid}: {'runnable' if not needs else 'missing ' + '; '.join(needs)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m envs.osworld.coverage", description=__doc__.split("\n\n")[0])
    p.add_argument("root", help="OSWorld task folder (holding examples/<domain>/<id>.json)")
    p.add_argument("--cache-dir", action="append", default=[], help="local cache of downloaded task files")
    p.add_argument("--home", default=None, help="the desktop's HOME (OSWorld tasks assume /home/user)")
    p.add_argument("--tasks", action="store_true", help="also print one line per task")
    p.add_argument("--json", help="write the full report as JSON here")
    a = p.parse_args(argv)
    tasks = load_osworld(a.root)
    rep = report(tasks, a.cache_dir, a.home)
    print(format_report(rep, a.tasks))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({k: {**v, "missing": dict(v["missing"])} for k, v in rep.items()}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
