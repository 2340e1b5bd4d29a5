"""Setup and postconfig steps with OSWorld's SetupController semantics, over any `Controller`.

Retry semantics kept from OSWorld:
  execute / command: re-sent until it answers (or, with `until`, until its returncode / stdout / stderr
      matches), giving up after 5 failed calls; 0.3 s between tries. guijax also stops after `max_polls`
      answered-but-unmatched polls, where OSWorld would poll forever.
  open: up to 5 tries with backoff min(3 * 2^k, 30) s on transient errors; any other error fails at once.
  download: the file comes from the local cache (see envs.desktop.cache); an upload is tried 3 times.
  launch, activate_window, close_window: a failure is logged, not raised (OSWorld only logs it).
A failing step raises `SetupError` naming the task, the step number and its type.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Any, Callable, Sequence

from envs.desktop import cache
from envs.desktop.controller import Controller, ControllerError
from envs.osworld.loader import Step

log = logging.getLogger("envs.osworld.setup")


class SetupError(RuntimeError):
    pass


class UnsupportedStep(SetupError):
    pass


class SetupContext:
    """What steps need besides the controller: the cache directory (downloads, `stdout` capture), extra
    cache folders, the task file's folder (relative download URLs), the password and the retry pacing."""

    def __init__(self, controller: Controller, cache_dir: str, cache_dirs: Sequence[str] = (),
                 base_dir: str | None = None, password: str = "password", allow_network: bool = False,
                 retry_scale: float = 1.0, max_polls: int = 200):
        self.controller = controller
        self.cache_dir = cache_dir
        self.cache_dirs = [cache_dir, *cache_dirs]
        self.base_dir = base_dir
        self.password = password
        self.allow_network = allow_network
        self.retry_scale = retry_scale  # tests shrink OSWorld's sleeps
        self.max_polls = max_polls

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds * self.retry_scale)


def fill_placeholders(command: Any, ctx: SetupContext) -> Any:
    """OSWorld's {CLIENT_PASSWORD}, {SCREEN_WIDTH(_HALF)}, {SCREEN_HEIGHT(_HALF)} substitutions."""
    h, w = ctx.controller.screen_hw
    subs = {"{CLIENT_PASSWORD}": ctx.password, "{SCREEN_WIDTH_HALF}": str(w // 2),
            "{SCREEN_HEIGHT_HALF}": str(h // 2), "{SCREEN_WIDTH}": str(w), "{SCREEN_HEIGHT}": str(h)}

    def one(s: str) -> str:
        for k, v in subs.items():
            s = s.replace(k, v)
        return s

    if isinstance(command, str):
        return one(command)
    return [one(str(c)) for c in command]


def _execute(ctx: SetupContext, command: Any = None, stdout: str = "", stderr: str = "", shell: bool = False,
             until: dict[str, Any] | None = None) -> None:
    if not command:
        raise SetupError("execute: empty command")
    command = fill_placeholders(command, ctx)
    until = until or {}
    failures, polls, last = 0, 0, None
    while True:
        try:
            result = ctx.controller.execute(command, shell=shell)
        except ControllerError as e:
            result, last = None, e
            failures += 1
        if result is not None:
            if stdout:
                with open(os.path.join(ctx.cache_dir, stdout), "w") as f:
                    f.write(result.get("output") or "")
            if stderr:
                with open(os.path.join(ctx.cache_dir, stderr), "w") as f:
                    f.write(result.get("error") or "")
            if not until:
                return
            if ("returncode" in until and result.get("returncode") == until["returncode"]
                    or "stdout" in until and until["stdout"] in (result.get("output") or "")
                    or "stderr" in until and until["stderr"] in (result.get("error") or "")):
                return
            polls += 1
            if polls >= ctx.max_polls:
                raise SetupError(f"execute: condition {until} not met after {polls} polls of {command!r}")
        if failures >= 5:
            raise SetupError(f"execute failed after {failures} attempts: {last}")
        ctx.sleep(0.3)


def _launch(ctx: SetupContext, command: Any = None, shell: bool = False) -> None:
    if not command:
        raise SetupError("launch: empty command")
    if not shell and isinstance(command, str) and len(command.split()) > 1:
        command = command.split()
    try:
        ctx.controller.launch(command, shell=shell)
    except ControllerError as e:
        log.error("launch %r failed: %s", command, e)


def _open(ctx: SetupContext, path: str = "", window_name: str | None = None) -> None:
    if not path:
        raise SetupError("open: empty path")
    last: Exception | None = None
    for attempt in range(5):
        try:
            ctx.controller.open_file(path, window_name=window_name)
            return
        except ControllerError as e:
            last = e
            if not e.transient:
                raise SetupError(f"open {path!r}: {e}") from e
        if attempt < 4:
            ctx.sleep(min(3 * 2 ** attempt, 30))
    raise SetupError(f"open {path!r} failed after 5 attempts: {last}")


def _download(ctx: SetupContext, files: list[dict[str, str]] | None = None) -> None:
    for f in files or []:
        url, path = f.get("url", ""), f.get("path", "")
        if not url or not path:
            raise SetupError(f"download: invalid url ({url!r}) or path ({path!r})")
        try:
            data = cache.fetch_bytes(url, path, ctx.cache_dirs, ctx.base_dir, ctx.allow_network)
        except (cache.CacheMiss, OSError) as e:
            raise SetupError(f"download: {e}") from e
        _upload(ctx, path, data)


def _upload(ctx: SetupContext, path: str, data: bytes) -> None:
    last: Exception | None = None
    for attempt in range(3):
        try:
            ctx.controller.upload(path, data)
            return
        except ControllerError as e:
            last = e
        if attempt < 2:
            ctx.sleep(2 ** attempt)
    raise SetupError(f"upload to {path!r} failed after 3 attempts: {last}")


def _upload_file(ctx: SetupContext, files: list[dict[str, str]] | None = None) -> None:
    for f in files or []:
        local = f.get("local_path", "")
        if not os.path.exists(local):
            raise SetupError(f"upload_file: invalid local path ({local!r})")
        with open(local, "rb") as fh:
            _upload(ctx, f["path"], fh.read())


def _sleep(ctx: SetupContext, seconds: float) -> None:
    time.sleep(float(seconds))


def _window(kind: str) -> Callable[..., None]:
    def run(ctx: SetupContext, window_name: str = "", strict: bool = False, by_class: bool = False) -> None:
        if not window_name:
            raise SetupError(f"{kind}: empty window_name")
        fn = ctx.controller.activate_window if kind == "activate_window" else ctx.controller.close_window
        try:
            if not fn(window_name, strict=strict, by_class=by_class):
                log.error("%s: no window matches %r", kind, window_name)
        except (ControllerError, OSError) as e:
            log.error("%s %r failed: %s", kind, window_name, e)

    return run


STEPS: dict[str, Callable[..., None]] = {
    "execute": _execute,
    "command": _execute,
    "launch": _launch,
    "open": _open,
    "download": _download,
    "upload_file": _upload_file,
    "sleep": _sleep,
    "activate_window": _window("activate_window"),
    "close_window": _window("close_window"),
}


def run_steps(steps: Sequence[Step], ctx: SetupContext, *, task_id: str = "?", what: str = "setup") -> None:
    for i, step in enumerate(steps):
        fn = STEPS.get(step.type)
        if fn is None:
            raise UnsupportedStep(f"task {task_id}: {what} step {i + 1} has unsupported type {step.type!r} "
                                  f"(supported: {sorted(STEPS)})")
        try:
            fn(ctx, **step.parameters)
        except SetupError as e:
            raise SetupError(f"task {task_id}: {what} step {i + 1} ({step.type}) failed: {e}") from e
        except TypeError as e:  # wrong parameter names in the task file
            raise SetupError(f"task {task_id}: {what} step {i + 1} ({step.type}) has bad parameters "
                             f"{sorted(step.parameters)}: {e}") from e
