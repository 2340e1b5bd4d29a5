"""Cleanup of the processes a desktop starts, on normal exit and on crash.

Every process the desktop starts runs in its own session (process group). The groups are recorded in a
`Reaper`, which kills them on `close()`, at interpreter exit (atexit) and on SIGTERM. A crash that skips
all of that (SIGKILL, a segfault) is covered by a tiny watchdog process: it holds the read end of a pipe
whose write end only this process has, so it sees end-of-file the moment this process dies, however it
dies, and then kills every group still registered with it.
"""
from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import threading
import weakref

_WATCHDOG = r"""
import json, os, signal, subprocess, sys
groups = set()
commands = []
buf = b""
while True:
    chunk = os.read(0, 4096)
    if not chunk:
        break
    buf += chunk
    *lines, buf = buf.split(b"\n")
    for line in lines:
        op, _, arg = line.decode().partition(" ")
        if op == "run":
            commands.append(json.loads(arg))
        else:
            (groups.add if op == "add" else groups.discard)(int(arg))
for cmd in commands:
    try:
        subprocess.run(cmd["argv"], env={**os.environ, **cmd["env"]}, timeout=10,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except Exception:
        pass
for sig in (signal.SIGTERM, signal.SIGKILL):
    for g in list(groups):
        try:
            os.killpg(g, sig)
        except OSError:
            groups.discard(g)
    if sig == signal.SIGTERM and groups:
        import time; time.sleep(0.5)
"""

_live: "weakref.WeakSet[Reaper]" = weakref.WeakSet()
_sigterm_installed = False


def kill_group(pgid: int, grace_s: float = 1.0) -> None:
    """SIGTERM a process group, then SIGKILL whatever is left after `grace_s`."""
    try:
        os.killpg(pgid, signal.SIGTERM)
    except OSError:
        return
    deadline = grace_s
    step = 0.05
    while deadline > 0:
        try:
            os.killpg(pgid, 0)
        except OSError:
            return
        threading.Event().wait(step)
        deadline -= step
    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError:
        pass


class Reaper:
    """Registry of process groups to kill; one per desktop."""

    def __init__(self, watchdog: bool = True):
        self._lock = threading.Lock()
        self._procs: dict[int, subprocess.Popen] = {}
        self._watch: subprocess.Popen | None = None
        if watchdog:
            self._watch = subprocess.Popen([sys.executable, "-c", _WATCHDOG], stdin=subprocess.PIPE,
                                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                           start_new_session=True, close_fds=True)
        _live.add(self)
        _install_handlers()

    def _tell(self, op: str, arg: object) -> None:
        if self._watch is not None and self._watch.stdin is not None:
            try:
                self._watch.stdin.write(f"{op} {arg}\n".encode())
                self._watch.stdin.flush()
            except (BrokenPipeError, ValueError):
                pass

    def on_crash(self, argv: list[str], env: dict[str, str] | None = None) -> None:
        """A command the watchdog runs if this process dies without `close()` (e.g. stop a daemon that left
        its process group, like a tmux server)."""
        import json

        self._tell("run", json.dumps({"argv": list(argv), "env": dict(env or {})}))

    def popen(self, args, **kwargs) -> subprocess.Popen:
        """subprocess.Popen in a new session, registered for cleanup."""
        kwargs.setdefault("start_new_session", True)
        kwargs.setdefault("close_fds", True)
        if not kwargs["start_new_session"]:
            raise ValueError("Reaper.popen needs start_new_session=True to kill the process tree")
        proc = subprocess.Popen(args, **kwargs)
        with self._lock:
            self._procs[proc.pid] = proc
        self._tell("add", proc.pid)
        return proc

    def kill(self, proc: subprocess.Popen, grace_s: float = 1.0) -> None:
        kill_group(proc.pid, grace_s)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        with self._lock:
            self._procs.pop(proc.pid, None)
        self._tell("del", proc.pid)

    def prune(self) -> None:
        """Forget processes that have exited and whose group is empty."""
        with self._lock:
            items = list(self._procs.items())
        for pid, proc in items:
            if proc.poll() is not None:
                try:
                    os.killpg(pid, 0)
                    continue  # a child of the group still runs
                except OSError:
                    pass
                with self._lock:
                    self._procs.pop(pid, None)
                self._tell("del", pid)

    def pids(self) -> list[int]:
        with self._lock:
            return list(self._procs)

    def kill_all(self, except_pids: set[int] | frozenset[int] = frozenset(), grace_s: float = 1.0) -> None:
        with self._lock:
            victims = [p for pid, p in self._procs.items() if pid not in except_pids]
        for proc in reversed(victims):  # newest first: apps before the X server they draw on
            self.kill(proc, grace_s)

    def close(self) -> None:
        self.kill_all()
        if self._watch is not None:
            try:
                if self._watch.stdin:
                    self._watch.stdin.close()
                self._watch.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                self._watch.kill()
            self._watch = None
        _live.discard(self)


def _close_all() -> None:
    for r in list(_live):
        try:
            r.close()
        except Exception:
            pass


def _install_handlers() -> None:
    """atexit always; SIGTERM only when nobody else handles it (turn it into a normal exit)."""
    global _sigterm_installed
    if _sigterm_installed:
        return
    _sigterm_installed = True
    atexit.register(_close_all)
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) in (
            signal.SIG_DFL, None):
        def on_term(signum, frame):
            _close_all()
            raise SystemExit(128 + signum)

        signal.signal(signal.SIGTERM, on_term)
