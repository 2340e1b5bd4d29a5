"""Result / expected getters with OSWorld's semantics, reading state through a `Controller`.

A getter is `fn(ctx, config) -> value`; `config` is the getter object of the task without its `type`.
File getters write into the episode's cache directory and return the local path(s), as OSWorld does.
"""
from __future__ import annotations

import os
from typing import Any, Callable

from envs.desktop import cache
from envs.desktop.controller import ControllerError
from envs.osworld.setup import SetupContext

Getter = Callable[[SetupContext, dict[str, Any]], Any]


def _vm_file(ctx: SetupContext, config: dict[str, Any]) -> Any:
    """`path`/`dest` (lists when `multi`); `gives` picks which local paths reach the metric (default [0]):
    one path as a str, several as a list, None for a file that does not exist."""
    multi = config.get("multi", False)
    paths = config["path"] if multi else [config["path"]]
    dests = config["dest"] if multi else [config["dest"]]
    gives = config.get("gives", [0])
    out: list[str | None] = []
    for i, (p, d) in enumerate(zip(paths, dests)):
        data = ctx.controller.get_file(p)
        local = os.path.join(ctx.cache_dir, d)
        if data is None:
            if i in gives:
                out.append(None)
            continue
        with open(local, "wb") as f:
            f.write(data)
        if i in gives:
            out.append(local)
    return out[0] if len(out) == 1 else out


def _cloud_file(ctx: SetupContext, config: dict[str, Any]) -> Any:
    """OSWorld downloads `path` (a URL) to `dest` in the cache; here it must already be in a local cache."""
    multi = config.get("multi", False)
    urls = config["path"] if multi else [config["path"]]
    dests = config["dest"] if multi else [config["dest"]]
    gives = config.get("gives", [0])
    out: list[str] = []
    for i, (url, d) in enumerate(zip(urls, dests)):
        local = os.path.join(ctx.cache_dir, d)
        if not os.path.exists(local):
            data = cache.fetch_bytes(url, d, ctx.cache_dirs, ctx.base_dir, ctx.allow_network)
            with open(local, "wb") as f:
                f.write(data)
        if i in gives:
            out.append(local)
    return out[0] if len(out) == 1 else out


def _cache_file(ctx: SetupContext, config: dict[str, Any]) -> str:
    """A file already in the cache (or, for guijax's local tasks, beside the task file)."""
    for d in [*ctx.cache_dirs, *([ctx.base_dir] if ctx.base_dir else [])]:
        p = os.path.join(d, config["path"])
        if os.path.exists(p):
            return p
    raise FileNotFoundError(f"cache_file {config['path']!r} not in {ctx.cache_dirs + [ctx.base_dir]}")


def _command(ctx: SetupContext, config: dict[str, Any], key: str) -> str | None:
    from envs.osworld.setup import fill_placeholders

    try:
        result = ctx.controller.execute(fill_placeholders(config["command"], ctx), shell=config.get("shell", False))
    except ControllerError as e:
        if e.transient:  # an unreachable server is an environment error, not a command without output
            raise
        return None
    except Exception:
        return None
    return result.get(key)


def _vm_command_line(ctx: SetupContext, config: dict[str, Any]) -> str | None:
    return _command(ctx, config, "output")


def _vm_command_error(ctx: SetupContext, config: dict[str, Any]) -> str | None:
    return _command(ctx, config, "error")


def _vm_terminal_output(ctx: SetupContext, config: dict[str, Any]) -> str | None:
    return ctx.controller.terminal_output()


def _rule(ctx: SetupContext, config: dict[str, Any]) -> Any:
    return config["rules"]


def _list_directory(ctx: SetupContext, config: dict[str, Any]) -> Any:
    return ctx.controller.list_directory(config["path"])


def _vm_screen_size(ctx: SetupContext, config: dict[str, Any]) -> dict[str, int]:
    w, h = ctx.controller.screen_size()
    return {"width": w, "height": h}


GETTERS: dict[str, Getter] = {
    "vm_file": _vm_file,
    "cloud_file": _cloud_file,
    "cache_file": _cache_file,
    "vm_command_line": _vm_command_line,
    "vm_command_error": _vm_command_error,
    "vm_terminal_output": _vm_terminal_output,
    "rule": _rule,
    "list_directory": _list_directory,
    "vm_screen_size": _vm_screen_size,
}
