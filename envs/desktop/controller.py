"""The controller interface the OSWorld task runner drives, and its local implementation.

`Controller` mirrors the endpoints of OSWorld's VM server (execute, launch, open_file, upload, file, ...)
with the same result shapes, so one task runner serves a local Xvfb desktop (`LocalController`, calls in
process) and a remote VM or `envs.server` (`envs.client.HttpController`, calls over HTTP).
"""
from __future__ import annotations

import os
import pathlib
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from typing import Any, Protocol, Sequence

import numpy as np

from envs.desktop import cache, windows
from envs.desktop.display import Display
from envs.desktop.screen import Screen

PYAUTOGUI_PREFIX = "import pyautogui; import time; pyautogui.FAILSAFE = False; {command}"

# File types the local desktop opens without xdg-open (not installed on a bare Debian).
_OPENERS = {
    (".xlsx", ".xls", ".ods", ".csv"): ["libreoffice", "--calc"],
    (".docx", ".doc", ".odt", ".rtf"): ["libreoffice", "--writer"],
    (".pptx", ".ppt", ".odp"): ["libreoffice", "--impress"],
    (".txt", ".md", ".py", ".json", ".sh", ".log", ".html", ".xml", ".yaml", ".yml", ".ini", ".cfg"): ["mousepad"],
}


class ControllerError(RuntimeError):
    """A controller call that failed; `transient` says whether retrying may help (OSWorld's 502/503/504)."""

    def __init__(self, message: str, status: int = 500, transient: bool = False):
        super().__init__(message)
        self.status = status
        self.transient = transient


_VAR = re.compile(r"\$(\w+|\{[^}]*\})")


def expand_vars(text: str, env: dict[str, str]) -> str:
    """os.path.expandvars against `env` instead of this process's environment."""
    def value(m: re.Match) -> str:
        name = m.group(1).strip("{}")
        return env.get(name, m.group(0))

    return _VAR.sub(value, text)


class Controller(Protocol):
    screen_hw: tuple[int, int]

    def execute(self, command: str | Sequence[str], shell: bool = False, timeout_s: float | None = None) -> dict[str, Any]: ...
    def execute_python(self, code: str) -> dict[str, Any]: ...
    def launch(self, command: str | Sequence[str], shell: bool = False) -> None: ...
    def open_file(self, path: str, window_name: str | None = None, timeout_s: float | None = None) -> None: ...
    def activate_window(self, window_name: str, strict: bool = False, by_class: bool = False) -> bool: ...
    def close_window(self, window_name: str, strict: bool = False, by_class: bool = False) -> bool: ...
    def upload(self, path: str, data: bytes) -> None: ...
    def download_file(self, url: str, path: str) -> None: ...
    def get_file(self, path: str) -> bytes | None: ...
    def list_directory(self, path: str) -> dict[str, Any] | None: ...
    def terminal_output(self) -> str | None: ...
    def screenshot(self) -> np.ndarray: ...
    def screen_size(self) -> tuple[int, int]: ...
    def cursor_position(self) -> tuple[int, int]: ...
    def platform(self) -> str: ...
    def reset(self) -> None: ...
    def close(self) -> None: ...


def expand_command(command: str | Sequence[str], shell: bool) -> str | list[str]:
    """OSWorld's argument handling: a string without shell is split like a shell would (the caller expands
    '~/' arguments on the desktop's HOME)."""
    if isinstance(command, str) and not shell:
        command = shlex.split(command)
    if isinstance(command, str):
        return command
    return [str(a) for a in command]


MAX_TREE_ENTRIES = 100_000  # a symlink farm can make a finite tree exponentially large


def directory_tree(path: str, max_entries: int = MAX_TREE_ENTRIES) -> dict[str, Any]:
    """OSWorld's /list_directory tree: {'type': 'directory', 'name', 'children': [...]}, files as {'type': 'file'}.

    Symlinked directories are followed, as OSWorld does, except into a directory already on the path (a loop
    is listed once, without children); a tree of more than `max_entries` entries is an error."""
    count = 0

    def walk(path: str, ancestors: frozenset[str]) -> dict[str, Any]:
        nonlocal count
        tree: dict[str, Any] = {"type": "directory", "name": os.path.basename(path), "children": []}
        real = os.path.realpath(path)
        if real in ancestors:
            return tree
        for entry in sorted(os.listdir(path)):
            count += 1
            if count > max_entries:
                raise OSError(f"more than {max_entries} entries under the listed directory")
            full = os.path.join(path, entry)
            tree["children"].append(walk(full, ancestors | {real}) if os.path.isdir(full)
                                    else {"type": "file", "name": entry})
        return tree

    try:
        return walk(path, frozenset())
    except (OSError, RecursionError) as e:
        return {"error": str(e)}


def run_command(command: str | list[str], *, shell: bool, env: dict[str, str], cwd: str | None, timeout_s: float,
                reaper=None, stdin_data: str | None = None, merge_stderr: bool = False) -> dict[str, Any]:
    """Run to completion in its own process group; on timeout the whole group is killed and the result says so.

    Output goes through files, not pipes, so the reply waits for the command itself and not for a child it
    left running in another session (`setsid ... &`) that still holds its output open.
    Returns OSWorld's /execute shape: status, output, error, returncode (plus `timed_out`)."""
    popen = reaper.popen if reaper is not None else (lambda a, **k: subprocess.Popen(a, **k))
    with tempfile.TemporaryFile() as stdin, tempfile.TemporaryFile() as stdout, tempfile.TemporaryFile() as stderr:
        if stdin_data is not None:
            stdin.write(stdin_data.encode())
            stdin.seek(0)
        try:
            proc = popen(command, shell=shell, env=env, cwd=cwd, start_new_session=True,
                         stdin=stdin if stdin_data is not None else subprocess.DEVNULL,
                         stdout=stdout, stderr=subprocess.STDOUT if merge_stderr else stderr)
        except OSError as e:
            return {"status": "error", "message": str(e), "output": "", "error": str(e), "returncode": -1}
        try:
            proc.wait(timeout=timeout_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            from envs.desktop.reaper import kill_group

            kill_group(proc.pid, grace_s=0.5)
            proc.wait()
            timed_out = True
        finally:
            if reaper is not None:
                reaper.prune()
        out, err = (_read_back(f) for f in (stdout, stderr))
    if timed_out:
        msg = f"command timed out after {timeout_s:g}s"
        return {"status": "error", "message": msg, "output": out, "error": err + msg, "returncode": -1,
                "timed_out": True}
    return {"status": "success" if proc.returncode == 0 else "error", "output": out, "error": err,
            "returncode": proc.returncode}


def _read_back(f) -> str:
    f.seek(0)
    return f.read().decode("utf-8", errors="replace")


class LocalController:
    """Controller over a local `Display`: commands run as child processes on that display, with a deadline."""

    def __init__(self, display: Display, command_timeout_s: float = 90.0,
                 cache_dirs: Sequence[str | os.PathLike] = (), allow_network: bool = False,
                 python: str | None = None):
        self.display = display
        self.env = dict(display.env)
        # `python` in task commands must be an interpreter that has pyautogui: put ours first on PATH.
        self.python = python or sys.executable
        bindir = pathlib.Path(display._tmp) / "bin"
        bindir.mkdir(exist_ok=True)
        for name in ("python", "python3"):
            link = bindir / name
            if not link.exists():
                link.symlink_to(self.python)
        self.env["PATH"] = f"{bindir}{os.pathsep}{self.env.get('PATH', '')}"
        self.home = str(display.home)
        self.command_timeout_s = command_timeout_s
        self.cache_dirs = list(cache_dirs)
        self.allow_network = allow_network
        self.screen = Screen(display.name)
        self.screen_hw = (display.height, display.width)

    # -- paths -------------------------------------------------------------------------------------------
    def _path(self, path: str) -> str:
        """'~' is the desktop's HOME; relative paths are relative to it (OSWorld's server runs from ~);
        $VAR and ${VAR} take the desktop's environment, not the server's (unknown ones stay as written)."""
        path = expand_vars(path, self.env)
        if path == "~" or path.startswith("~/"):
            path = self.home + path[1:]
        return path if os.path.isabs(path) else os.path.join(self.home, path)

    def _argv(self, command: str | Sequence[str], shell: bool) -> str | list[str]:
        cmd = expand_command(command, shell)
        if isinstance(cmd, list):
            cmd = [self.home + a[1:] if a.startswith("~/") else a for a in cmd]
        return cmd

    # -- commands ----------------------------------------------------------------------------------------
    def execute(self, command, shell: bool = False, timeout_s: float | None = None) -> dict[str, Any]:
        if not command:
            raise ControllerError("execute: empty command", status=400)
        return run_command(self._argv(command, shell), shell=shell, env=self.env, cwd=self.home,
                           timeout_s=timeout_s or self.command_timeout_s, reaper=self.display.reaper)

    def execute_python(self, code: str) -> dict[str, Any]:
        return self.execute(["python", "-c", PYAUTOGUI_PREFIX.format(command=code)])

    def run_python(self, code: str, timeout_s: float | None = None) -> dict[str, Any]:
        """OSWorld's /run_python shape: status, message, need_more, output, error, return_code."""
        with tempfile.NamedTemporaryFile("w", suffix=".py", dir=self.display._tmp, delete=False) as f:
            f.write(code)
        try:
            r = run_command([self.python, f.name], shell=False, env=self.env, cwd=self.home,
                            timeout_s=timeout_s or self.command_timeout_s, reaper=self.display.reaper)
        finally:
            os.unlink(f.name)
        message = r["output"] + (("\n" if r["output"] else "") + r["error"] if r["error"] else "")
        return {"status": r["status"], "message": message, "need_more": False, "output": r["output"],
                "error": r["error"], "return_code": r["returncode"], **({"timed_out": True} if r.get("timed_out") else {})}

    def run_bash_script(self, script: str, timeout_s: float | None = None, working_dir: str | None = None) -> dict[str, Any]:
        """OSWorld's /run_bash_script shape: stdout and stderr merged into `output`, `error` empty."""
        cwd = self._path(working_dir) if working_dir else self.home
        if not os.path.isdir(cwd):
            return {"status": "error", "output": f"Working directory does not exist: {working_dir}", "error": "",
                    "returncode": -1}
        r = run_command(["/bin/bash", "-s"], shell=False, env=self.env, cwd=cwd, stdin_data=script,
                        timeout_s=timeout_s or self.command_timeout_s, reaper=self.display.reaper, merge_stderr=True)
        out = r["output"] if not r.get("timed_out") else f"Script execution timed out after {timeout_s or self.command_timeout_s:g} seconds"
        return {"status": r["status"], "output": out, "error": "", "returncode": r["returncode"]}

    def launch(self, command, shell: bool = False) -> None:
        if not command:
            raise ControllerError("launch: empty command", status=400)
        try:
            self.display.reaper.popen(self._argv(command, shell), shell=shell, env=self.env, cwd=self.home,
                                      stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        except OSError as e:
            raise ControllerError(f"launch {command!r}: {e}", status=500) from e

    def open_file(self, path: str, window_name: str | None = None, timeout_s: float | None = None) -> None:
        full = self._path(path)
        if os.path.exists(full):
            ext = os.path.splitext(full)[1].lower()
            opener = next((cmd for exts, cmd in _OPENERS.items() if ext in exts), None)
            if opener is None:
                opener = ["xdg-open"] if shutil.which("xdg-open") else None
            if opener is None:
                raise ControllerError(f"open_file: no application for {ext!r} files ({path})", status=500)
            self.launch(opener + [full])
            base = os.path.basename(full)
            names = [window_name] if window_name else [base, os.path.splitext(base)[0]]
        elif shutil.which(path):
            self.launch([path])
            names = [window_name or path]
        else:
            raise ControllerError(f"Application/file not found: {path}", status=404)
        timeout = timeout_s if timeout_s is not None else self.command_timeout_s
        if windows.wait_window(self.env, names, timeout) is None:
            raise ControllerError(f"Failed to find window for {names} within {timeout:g} seconds.", status=500)

    def activate_window(self, window_name: str, strict: bool = False, by_class: bool = False) -> bool:
        return windows.activate_window(self.env, window_name, strict, by_class)

    def close_window(self, window_name: str, strict: bool = False, by_class: bool = False) -> bool:
        return windows.close_window(self.env, window_name, strict, by_class)

    # -- files -------------------------------------------------------------------------------------------
    def upload(self, path: str, data: bytes) -> None:
        full = self._path(path)
        os.makedirs(os.path.dirname(full) or ".", exist_ok=True)
        tmp = full + ".part"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, full)

    def upload_file(self, path: str, source: str | os.PathLike) -> None:
        """`upload` of a file already on this machine (a streamed upload), moved rather than read into memory."""
        full = self._path(path)
        os.makedirs(os.path.dirname(full) or ".", exist_ok=True)
        tmp = full + ".part"
        shutil.move(os.fspath(source), tmp)
        os.replace(tmp, full)

    def download_file(self, url: str, path: str, base_dir: str | None = None) -> None:
        self.upload(path, cache.fetch_bytes(url, path, self.cache_dirs, base_dir, self.allow_network))

    def get_file(self, path: str) -> bytes | None:
        full = self._path(path)
        try:
            with open(full, "rb") as f:
                return f.read()
        except OSError:
            return None

    def list_directory(self, path: str) -> dict[str, Any] | None:
        full = self._path(path)
        return directory_tree(full) if os.path.isdir(full) else None

    def terminal_output(self) -> str | None:
        """Text of the active tmux pane on this desktop (the local terminal is xterm running tmux), else None."""
        if shutil.which("tmux") is None:
            return None
        r = subprocess.run(["tmux", "capture-pane", "-p", "-J"], env=self.env, capture_output=True, text=True, timeout=10)
        return r.stdout.rstrip() if r.returncode == 0 else None

    # -- screen ------------------------------------------------------------------------------------------
    def screenshot(self) -> np.ndarray:
        return self.screen.grab()

    def screen_size(self) -> tuple[int, int]:
        return self.screen.size()

    def cursor_position(self) -> tuple[int, int]:
        return self.screen.cursor_position()

    def platform(self) -> str:
        return platform.system()

    # -- life cycle --------------------------------------------------------------------------------------
    def reset(self) -> None:
        """Close every app started on the desktop (Xvfb and the window manager stay) and reset app settings."""
        self.display.kill_apps()
        self.display.reset_app_profiles()

    def close(self) -> None:
        self.screen.close()
