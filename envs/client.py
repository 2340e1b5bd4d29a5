"""Client for an OSWorld VM server (or `envs.server`), and an `Env` over it.

`HttpController` speaks the endpoints of OSWorld's server with the retry and timeout behaviour of OSWorld's
PythonController: 3 tries 5 s apart for screenshots (10 s timeout, PNG/JPEG payload checked), files,
terminal output and pyautogui commands (120 s timeout; a read timeout is not retried, since the command may
still be running); setup calls are made once and retried by the setup runner (envs.osworld.setup) exactly as
OSWorld's SetupController does; `wait_until_ready` polls /terminal and /screenshot up to 20 times 5 s apart.
Deviation: a 404 from /file means the file does not exist and returns None at once instead of 3 tries.

`RemoteEnv` is `OSWorldEnv` over an `HttpController`, so the same rollout code drives a real OSWorld VM, a
remote `envs.server`, or (through `DesktopEnv`) the local desktop.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Sequence

import numpy as np

from envs.api import DEFAULT_STEP_LIMIT
from envs.desktop.controller import PYAUTOGUI_PREFIX, ControllerError
from envs.osworld.env import OSWorldEnv

log = logging.getLogger("envs.client")

TRANSIENT = {502, 503, 504}


def _valid_image(data: bytes, content_type: str) -> bool:
    if data[:8] == b"\x89PNG\r\n\x1a\n" or data[:3] == b"\xff\xd8\xff":
        return True
    return bool(data) and any(t in content_type for t in ("image/png", "image/jpeg", "image/jpg"))


class HttpController:
    """The `Controller` interface over HTTP (see envs.desktop.controller)."""

    def __init__(self, base_url: str, token: str | None = None, *, retry_times: int = 3, retry_interval_s: float = 5.0,
                 screenshot_timeout_s: float = 10.0, execute_timeout_s: float = 120.0, setup_timeout_s: float = 600.0,
                 ready_retries: int = 20, ready_interval_s: float = 5.0):
        import requests

        self._requests = requests
        self.base_url = base_url.rstrip("/")
        self.session = requests.Session()
        if token:
            self.session.headers["Authorization"] = f"Bearer {token}"
        self.retry_times = retry_times
        self.retry_interval_s = retry_interval_s
        self.screenshot_timeout_s = screenshot_timeout_s
        self.execute_timeout_s = execute_timeout_s
        self.setup_timeout_s = setup_timeout_s
        self.ready_retries = ready_retries
        self.ready_interval_s = ready_interval_s
        self._screen_hw: tuple[int, int] | None = None

    # -- plumbing ----------------------------------------------------------------------------------------
    def _url(self, path: str) -> str:
        return self.base_url + path

    def _once(self, method: str, path: str, *, timeout: float, **kw: Any):
        """One request; a non-200 answer or a connection failure becomes ControllerError."""
        try:
            r = self.session.request(method, self._url(path), timeout=timeout, **kw)
        except self._requests.RequestException as e:
            raise ControllerError(f"{method} {path}: {e}", status=503, transient=True) from e
        if r.status_code != 200:
            raise ControllerError(f"{method} {path}: HTTP {r.status_code}: {r.text[:500]}", status=r.status_code,
                                  transient=r.status_code in TRANSIENT)
        return r

    def _retried(self, method: str, path: str, *, timeout: float, retry_read_timeout: bool = True,
                 none_on: tuple[int, ...] = (), raise_on_failure: bool = False, **kw: Any):
        """PythonController's loop: up to `retry_times` tries `retry_interval_s` apart. Returns the response,
        or None when every try failed (or at once on a status in `none_on`, or a read timeout when
        `retry_read_timeout` is False). With `raise_on_failure`, every try failing raises a transient
        ControllerError instead: for calls whose None would mean an answer ("no such file"). A server that
        never answered at all (every try a connection error or timeout) always raises: its None would be
        taken for an answer about the desktop (no terminal, no accessibility tree) and score the task."""
        answered = False
        for attempt in range(self.retry_times):
            try:
                r = self.session.request(method, self._url(path), timeout=timeout, **kw)
                answered = True
                if r.status_code == 200:
                    return r
                if r.status_code in none_on:
                    return None
                log.warning("%s %s: HTTP %d (try %d/%d)", method, path, r.status_code, attempt + 1, self.retry_times)
            except self._requests.exceptions.ReadTimeout:
                if not retry_read_timeout:
                    log.error("%s %s: read timeout after %ss, not retried", method, path, timeout)
                    return None
                log.warning("%s %s: read timeout (try %d/%d)", method, path, attempt + 1, self.retry_times)
            except self._requests.RequestException as e:
                log.warning("%s %s: %s (try %d/%d)", method, path, e, attempt + 1, self.retry_times)
            if attempt < self.retry_times - 1:
                time.sleep(self.retry_interval_s)
        if raise_on_failure or not answered:
            raise ControllerError(f"{method} {path}: no answer from {self.base_url} in {self.retry_times} tries",
                                  status=503, transient=True)
        return None

    # -- readiness ---------------------------------------------------------------------------------------
    def wait_until_ready(self) -> bool:
        for _ in range(self.ready_retries):
            try:
                if all(self.session.get(self._url(p), timeout=(5, 10)).status_code == 200
                       for p in ("/terminal", "/screenshot")):
                    return True
            except self._requests.RequestException:
                pass
            time.sleep(self.ready_interval_s)
        return False

    # -- observation -------------------------------------------------------------------------------------
    def screenshot_bytes(self) -> bytes | None:
        for attempt in range(self.retry_times):
            try:
                r = self.session.get(self._url("/screenshot"), timeout=self.screenshot_timeout_s)
                if r.status_code == 200 and _valid_image(r.content, r.headers.get("Content-Type", "")):
                    return r.content
                log.warning("screenshot: HTTP %d or invalid payload (try %d/%d)", r.status_code, attempt + 1,
                            self.retry_times)
            except self._requests.RequestException as e:
                log.warning("screenshot: %s (try %d/%d)", e, attempt + 1, self.retry_times)
            if attempt < self.retry_times - 1:
                time.sleep(self.retry_interval_s)
        return None

    def screenshot(self) -> np.ndarray:
        from envs.desktop.screen import decode_image

        data = self.screenshot_bytes()
        if data is None:
            raise ControllerError(f"no screenshot from {self.base_url} after {self.retry_times} tries", status=503,
                                  transient=True)
        return decode_image(data)

    @property
    def screen_hw(self) -> tuple[int, int]:
        if self._screen_hw is None:
            w, h = self.screen_size()
            self._screen_hw = (h, w)
        return self._screen_hw

    def screen_size(self) -> tuple[int, int]:
        d = self._once("POST", "/screen_size", timeout=30).json()
        return int(d["width"]), int(d["height"])

    def cursor_position(self) -> tuple[int, int]:
        x, y = self._once("GET", "/cursor_position", timeout=30).json()
        return int(x), int(y)

    def platform(self) -> str:
        return self._once("GET", "/platform", timeout=30).text

    def terminal_output(self) -> str | None:
        r = self._retried("GET", "/terminal", timeout=30)
        return None if r is None else r.json().get("output")

    def accessibility_tree(self) -> str | None:
        r = self._retried("GET", "/accessibility", timeout=60)
        return None if r is None else r.json().get("AT")

    # -- commands ----------------------------------------------------------------------------------------
    def execute(self, command: str | Sequence[str], shell: bool = False, timeout_s: float | None = None) -> dict[str, Any]:
        cmd = command if isinstance(command, str) else list(command)
        return self._once("POST", "/setup/execute", json={"command": cmd, "shell": shell},
                          timeout=timeout_s or self.execute_timeout_s).json()

    def execute_python(self, code: str) -> dict[str, Any] | None:
        """PythonController.execute_python_command: pyautogui code via /execute, retried except on read timeout."""
        payload = {"command": ["python", "-c", PYAUTOGUI_PREFIX.format(command=code)], "shell": False}
        r = self._retried("POST", "/execute", json=payload, timeout=self.execute_timeout_s, retry_read_timeout=False)
        return None if r is None else r.json()

    def run_python(self, code: str) -> dict[str, Any]:
        r = self._retried("POST", "/run_python", json={"code": code}, timeout=90, retry_read_timeout=False)
        if r is None:
            return {"status": "error", "message": "Failed to execute command.", "output": "", "error": "no answer",
                    "return_code": -1}
        return r.json()

    def run_bash_script(self, script: str, timeout_s: float = 100, working_dir: str | None = None) -> dict[str, Any]:
        payload = {"script": script, "timeout": timeout_s, "working_dir": working_dir}
        r = self._retried("POST", "/run_bash_script", json=payload, timeout=timeout_s + 100, retry_read_timeout=False)
        if r is None:
            return {"status": "error", "output": "Failed to execute script", "error": "", "returncode": -1}
        return r.json()

    # -- setup -------------------------------------------------------------------------------------------
    def launch(self, command: str | Sequence[str], shell: bool = False) -> None:
        cmd = command if isinstance(command, str) else list(command)
        self._once("POST", "/setup/launch", json={"command": cmd, "shell": shell}, timeout=60)

    def open_file(self, path: str, window_name: str | None = None, timeout_s: float | None = None) -> None:
        payload: dict[str, Any] = {"path": path}
        if window_name:
            payload["window_name"] = window_name
        if timeout_s is not None:
            payload["timeout_seconds"] = timeout_s
        self._once("POST", "/setup/open_file", json=payload, timeout=(timeout_s or 1800) + 10)

    def _window(self, path: str, name: str, strict: bool, by_class: bool) -> bool:
        try:
            self._once("POST", path, json={"window_name": name, "strict": strict, "by_class": by_class}, timeout=60)
            return True
        except ControllerError as e:
            if e.status == 404:
                return False
            raise

    def activate_window(self, window_name: str, strict: bool = False, by_class: bool = False) -> bool:
        return self._window("/setup/activate_window", window_name, strict, by_class)

    def close_window(self, window_name: str, strict: bool = False, by_class: bool = False) -> bool:
        return self._window("/setup/close_window", window_name, strict, by_class)

    def upload(self, path: str, data: bytes) -> None:
        import os

        self._once("POST", "/setup/upload", data={"file_path": path},
                   files={"file_data": (os.path.basename(path) or "file", data)}, timeout=self.setup_timeout_s)

    def download_file(self, url: str, path: str) -> None:
        self._once("POST", "/setup/download_file", json={"url": url, "path": path}, timeout=self.setup_timeout_s)

    # -- files -------------------------------------------------------------------------------------------
    def get_file(self, path: str) -> bytes | None:
        # None means the file is missing (404); a server that does not answer is an error, not a missing
        # file, or the episode would be scored 0 as if the agent had failed
        r = self._retried("POST", "/file", data={"file_path": path}, timeout=self.setup_timeout_s, none_on=(404,),
                          raise_on_failure=True)
        return None if r is None else r.content

    def list_directory(self, path: str) -> dict[str, Any] | None:
        try:
            return self._once("POST", "/list_directory", json={"path": path}, timeout=60).json()["directory_tree"]
        except ControllerError as e:
            if e.transient:  # the server is unreachable: not an answer about the directory
                raise
            return None

    # -- life cycle --------------------------------------------------------------------------------------
    def reset(self) -> None:
        """Close the apps of the last episode (envs.server's /guijax/reset). A real OSWorld VM has no such
        endpoint: its provider reverts a snapshot, so a 404 is logged and ignored."""
        try:
            self._once("POST", "/guijax/reset", timeout=60)
        except ControllerError as e:
            if e.status not in (404, 405):
                raise
            log.info("server has no /guijax/reset (an OSWorld VM): revert its snapshot between episodes")

    def close(self) -> None:
        self.session.close()


class RemoteEnv(OSWorldEnv):
    """OSWorld tasks on a remote desktop server (an OSWorld VM at http://IP:5000, or `envs.server`)."""

    def __init__(self, base_url: str, token: str | None = None, *, step_limit: int = DEFAULT_STEP_LIMIT,
                 cache_dirs: Sequence[str] = (), wait_ready: bool = True, controller_kwargs: dict[str, Any] | None = None,
                 **env_kwargs: Any):
        controller = HttpController(base_url, token, **(controller_kwargs or {}))
        if wait_ready and not controller.wait_until_ready():
            raise ControllerError(f"desktop server at {base_url} did not become ready", status=503, transient=True)
        super().__init__(controller, step_limit=step_limit, cache_dirs=cache_dirs, **env_kwargs)


@dataclasses.dataclass(frozen=True)
class RemoteFactory:
    """Picklable factory for EnvPool workers: each worker drives the server at `base_url` (one server per worker)."""

    base_url: str
    token: str | None = None
    step_limit: int = DEFAULT_STEP_LIMIT
    cache_dirs: tuple[str, ...] = ()

    def __call__(self) -> RemoteEnv:
        return RemoteEnv(self.base_url, self.token, step_limit=self.step_limit, cache_dirs=self.cache_dirs)
