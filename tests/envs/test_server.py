"""envs.server (OSWorld's VM endpoints on a local Xvfb) and envs.client over loopback."""
import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from envs.desktop.checks import desktop_missing

MISSING = desktop_missing()
needs_desktop = pytest.mark.skipif(MISSING is not None, reason=str(MISSING))
requests = pytest.importorskip("requests")


# requests to the module's server, carrying the token it generated at start
AUTH = requests.Session()


def _start(args, cache_dir):
    """(process, url, the token it printed or None)."""
    from desktop_server import start_server

    return start_server(args, cache_dir)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The server as a user starts it (no --token): it generates a token and prints it."""
    cache = tmp_path_factory.mktemp("cache")
    (cache / "report.txt").write_text("from the cache\n")
    proc, url, token = _start(["--timeout", "2"], cache)
    assert token and len(token) >= 24
    AUTH.headers["Authorization"] = f"Bearer {token}"
    yield url, cache
    proc.terminate()
    assert proc.wait(timeout=15) == 0


def _token() -> str:
    return AUTH.headers["Authorization"].removeprefix("Bearer ")


@pytest.fixture(scope="module")
def client(server):
    from envs.client import HttpController

    c = HttpController(server[0], _token(), retry_interval_s=0.1)
    assert c.wait_until_ready()
    yield c
    c.close()


# -- real server ----------------------------------------------------------------------------------------------
@pytest.mark.desktop
@needs_desktop
def test_endpoints_have_osworld_shapes(server):
    url, _ = server
    assert requests.get(url + "/platform").status_code == 401  # the generated token is required
    r = AUTH.post(url + "/execute", json={"command": ["bash", "-c", "echo hi; exit 2"], "shell": False})
    assert r.status_code == 200 and r.json() == {"status": "success", "output": "hi\n", "error": "", "returncode": 2}
    r = AUTH.post(url + "/setup/execute", json={"command": "echo $((6*7))", "shell": True})
    assert r.json()["output"] == "42\n"
    r = AUTH.get(url + "/screenshot")
    assert r.status_code == 200 and r.headers["Content-Type"] == "image/png" and r.content[:4] == b"\x89PNG"
    assert AUTH.get(url + "/platform").text == "Linux"
    assert AUTH.post(url + "/screen_size").json() == {"width": 640, "height": 480}
    assert len(AUTH.get(url + "/cursor_position").json()) == 2
    r = AUTH.post(url + "/setup/upload", data={"file_path": "~/d/a.txt"}, files={"file_data": ("a.txt", b"xyz")})
    assert r.status_code == 200 and r.text == "File Uploaded: 3 bytes"
    r = AUTH.post(url + "/file", data={"file_path": "~/d/a.txt"})
    assert r.status_code == 200 and r.content == b"xyz"
    r = AUTH.post(url + "/file", data={"file_path": "~/d/missing.txt"})
    assert r.status_code == 404 and r.json() == {"error": "File not found"}
    r = AUTH.post(url + "/list_directory", json={"path": "~/d"})
    assert r.json() == {"directory_tree": {"type": "directory", "name": "d", "children": [{"type": "file", "name": "a.txt"}]}}
    assert AUTH.post(url + "/list_directory", json={"path": "~/nope"}).status_code == 400
    r = AUTH.post(url + "/run_python", json={"code": "print(1 + 1)"})
    assert r.json()["status"] == "success" and r.json()["output"] == "2\n" and r.json()["return_code"] == 0
    r = AUTH.post(url + "/run_bash_script", json={"script": "echo a; echo b >&2; exit 1"})
    assert r.json() == {"status": "error", "output": "a\nb\n", "error": "", "returncode": 1}
    assert AUTH.get(url + "/terminal").json()["status"] == "success"
    assert AUTH.post(url + "/nope").status_code == 404
    assert AUTH.get(url + "/execute").status_code == 405


@pytest.mark.desktop
@needs_desktop
def test_hanging_command_times_out_and_server_keeps_serving(server):
    url, _ = server
    box = {}

    def hang():
        t = time.monotonic()
        box["r"] = AUTH.post(url + "/execute", json={"command": "sleep 30", "shell": True}, timeout=20)
        box["dt"] = time.monotonic() - t

    th = threading.Thread(target=hang)
    th.start()
    time.sleep(0.3)
    assert AUTH.get(url + "/platform", timeout=5).text == "Linux"  # answered while the command hangs
    th.join(15)
    assert box["r"].status_code == 500 and "timed out after 2s" in box["r"].json()["message"]
    assert box["dt"] < 8
    r = AUTH.post(url + "/run_python", json={"code": "import time; time.sleep(30)"}, timeout=20)
    assert r.status_code == 500 and r.json()["error"] == "TimeoutExpired"
    assert AUTH.get(url + "/platform", timeout=5).status_code == 200


@pytest.mark.desktop
@needs_desktop
def test_download_file_from_cache_and_file_url(server, tmp_path):
    url, cache = server
    r = AUTH.post(url + "/setup/download_file", json={"url": "https://example.org/x/report.txt", "path": "~/dl/r.txt"})
    assert r.status_code == 200, r.text
    assert AUTH.post(url + "/file", data={"file_path": "~/dl/r.txt"}).content == b"from the cache\n"
    src = tmp_path / "local.bin"
    src.write_bytes(b"\x00\x01")
    r = AUTH.post(url + "/setup/download_file", json={"url": src.as_uri(), "path": "~/dl/l.bin"})
    assert r.status_code == 200 and AUTH.post(url + "/file", data={"file_path": "~/dl/l.bin"}).content == b"\x00\x01"
    r = AUTH.post(url + "/setup/download_file", json={"url": "https://example.org/not-cached.zip", "path": "~/z"})
    assert r.status_code == 500 and "not in the local cache" in r.text


@pytest.mark.desktop
@needs_desktop
def test_windows_launch_activate_close(client):
    client.launch(["xterm", "-title", "srv-term"])
    deadline = time.monotonic() + 10
    while not client.activate_window("srv-term") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert client.activate_window("srv-term")
    assert not client.activate_window("no-such-window")
    assert client.close_window("srv-term")


@pytest.mark.desktop
@needs_desktop
def test_client_execute_python_screenshot_and_files(client):
    r = client.execute_python("pyautogui.moveTo(40, 30)")
    assert r["returncode"] == 0
    assert client.cursor_position() == (40, 30)
    shot = client.screenshot()
    assert shot.shape == (480, 640, 3)
    assert client.screen_hw == (480, 640)
    client.upload("~/c/t.txt", b"hello")
    assert client.get_file("~/c/t.txt") == b"hello"
    assert client.get_file("~/c/none.txt") is None
    assert client.list_directory("~/c")["children"] == [{"type": "file", "name": "t.txt"}]
    assert client.execute("cat ~/c/t.txt", shell=True)["output"] == "hello"


@pytest.mark.desktop
@needs_desktop
def test_remote_env_runs_an_osworld_task_end_to_end(server):
    """Setup (execute, launch, activate), a pyautogui step typed into a terminal, evaluation over HTTP."""
    from envs.actions.model import Action, ActionType
    from envs.api import Task
    from envs.client import RemoteEnv

    task = Task.from_dict({
        "id": "remote-mkdir", "instruction": "Create the folder ~/made",
        "config": [{"type": "launch", "parameters": {"command": ["xterm", "-title", "Terminal", "-e", "tmux", "new", "-s", "t"]}},
                   {"type": "sleep", "parameters": {"seconds": 1}},
                   {"type": "activate_window", "parameters": {"window_name": "Terminal"}}],
        "evaluator": {"func": "exact_match",
                      "result": {"type": "vm_command_line", "command": "[ -d ~/made ] && echo yes || echo no", "shell": True},
                      "expected": {"type": "rule", "rules": {"expected": "yes\n"}}}})
    env = RemoteEnv(server[0], _token(), controller_kwargs={"retry_interval_s": 0.1}, settle_s=0.2)
    try:
        obs = env.reset(task)
        assert obs.screenshot.shape == (480, 640, 3)
        assert env.evaluate() == 0.0
        env.step(Action(ActionType.TYPE, text="mkdir ~/made\n"))
        time.sleep(0.5)
        res = env.step(Action(ActionType.FINISHED))
        assert res.done
        assert env.evaluate() == 1.0
        assert "mkdir ~/made" in env.controller.terminal_output()
    finally:
        env.close()


@pytest.mark.hostile
def test_non_loopback_bind_without_token_is_refused():
    r = subprocess.run([sys.executable, "-m", "envs.server", "--host", "0.0.0.0", "--port", "0"], capture_output=True,
                       text=True, timeout=30)
    assert r.returncode != 0 and "--token" in r.stderr


@pytest.mark.desktop
@needs_desktop
def test_token_is_enforced_on_every_request(tmp_path):
    proc, url, printed = _start(["--token", "s3cret"], tmp_path)
    assert printed is None  # a token the user chose is not echoed
    try:
        assert requests.get(url + "/platform").status_code == 401
        assert requests.get(url + "/platform", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert requests.get(url + "/platform", headers={"Authorization": "Bearer s3cret"}).text == "Linux"
        from envs.client import HttpController

        assert HttpController(url, token="s3cret").platform() == "Linux"
    finally:
        proc.terminate()
        proc.wait(timeout=15)


# -- client retry semantics against a scripted stub server (no desktop needed) ----------------------------------
class _Stub(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    hits: dict = {}
    delay = 0.0

    def log_message(self, *a):
        pass

    def _reply(self, status, body=b"", ctype="application/json"):
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _handle(self):
        n = int(self.headers.get("Content-Length") or 0)
        if n:
            self.rfile.read(n)
        _Stub.hits[self.path] = _Stub.hits.get(self.path, 0) + 1
        if self.path == "/screenshot":
            self._reply(200, b"not an image", "text/plain")
        elif self.path == "/execute":
            time.sleep(1.0)
            self._reply(200, b"{}")
        elif self.path == "/file":
            self._reply(500, b"{}")
        elif self.path == "/setup/open_file":
            self._reply(503 if _Stub.hits[self.path] < 3 else 200, b"ok", "text/plain")
        elif self.path == "/setup/execute":
            ok = _Stub.hits[self.path] >= 4
            self._reply(200, json.dumps({"status": "success", "output": "ready" if ok else "", "error": "",
                                         "returncode": 0}).encode())
        else:
            self._reply(404, b"{}")

    do_GET = do_POST = _handle


@pytest.fixture()
def stub():
    _Stub.hits = {}
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Stub)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def test_client_retries_like_osworld(stub):
    from envs.client import HttpController
    from envs.desktop.controller import ControllerError

    c = HttpController(stub, retry_interval_s=0.01, execute_timeout_s=0.3)
    assert c.screenshot_bytes() is None and _Stub.hits["/screenshot"] == 3  # invalid payload: retried
    with pytest.raises(ControllerError, match="no screenshot"):
        c.screenshot()
    with pytest.raises(ControllerError, match="/file: no answer") as err:  # 5xx: retried, then an error, not
        c.get_file("/x")  # "no such file" (OSWorld returns None here and scores the episode 0)
    assert err.value.transient and _Stub.hits["/file"] == 3
    assert c.execute_python("pass") is None and _Stub.hits["/execute"] == 1  # read timeout: not retried
    c.reset()  # 404: an OSWorld VM without /guijax/reset is fine


def test_setup_runner_retries_open_and_polls_execute_until(stub, tmp_path):
    from envs.client import HttpController
    from envs.osworld.loader import Step
    from envs.osworld.setup import SetupContext, run_steps

    c = HttpController(stub, retry_interval_s=0.01)
    c._screen_hw = (480, 640)
    ctx = SetupContext(c, str(tmp_path), retry_scale=0.01)
    run_steps([Step("open", {"path": "~/a.xlsx"})], ctx, task_id="t")
    assert _Stub.hits["/setup/open_file"] == 3  # two 503s, then success
    run_steps([Step("execute", {"command": "check", "shell": True, "until": {"stdout": "ready"}, "stdout": "o.txt"})],
              ctx, task_id="t")
    assert _Stub.hits["/setup/execute"] == 4 and (tmp_path / "o.txt").read_text() == "ready"


class _PlatformOnly:
    """Enough of a controller for requests that only ask the platform (no desktop needed)."""

    def platform(self) -> str:
        return "Linux"


@pytest.fixture
def loopback_server():
    from envs.server import DesktopServer

    server = DesktopServer(("127.0.0.1", 0), _PlatformOnly())
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("headers, status", [
    ({}, 200),
    ({"Host": "localhost:5000"}, 200),
    ({"Origin": "https://evil.example"}, 403),  # a cross-site request from a web page
    ({"Origin": "null"}, 403),
    ({"Host": "evil.example:5000"}, 403),  # DNS rebinding: the page's own name resolves to 127.0.0.1
    ({"Host": "evil.example"}, 403),
])
@pytest.mark.hostile
def test_loopback_server_refuses_requests_from_web_pages(loopback_server, headers, status):
    r = requests.post(loopback_server + "/platform", headers=headers, data="x", timeout=10) if status == 403 else \
        requests.get(loopback_server + "/platform", headers=headers, timeout=10)
    assert r.status_code == status
    if status == 403:
        assert "refused" in r.json()["message"] or "loopback" in r.json()["message"]
    else:
        assert r.text == "Linux"


@pytest.mark.hostile
@pytest.mark.desktop
@needs_desktop
def test_a_server_killed_mid_episode_is_an_environment_error_not_an_observation_or_a_score(tmp_path):
    """The desktop's server dies between steps (a VM that crashed): the next step and the evaluation raise,
    so the pool drops the episode instead of training on a stale screen or a 0 that was never scored."""
    from envs.actions.model import Action, ActionType
    from envs.api import Task
    from envs.client import RemoteEnv
    from envs.desktop.controller import ControllerError
    from envs.osworld.env import EvaluationError

    proc, url, token = _start([], tmp_path)
    task = Task.from_dict({"id": "remote-killed", "instruction": "Create the folder ~/made",
                           "evaluator": {"func": "exact_match",
                                         "result": {"type": "vm_command_line", "command": "echo no", "shell": True},
                                         "expected": {"type": "rule", "rules": {"expected": "yes\n"}}}})
    env = RemoteEnv(url, token, controller_kwargs={"retry_times": 2, "retry_interval_s": 0.1}, settle_s=0.1)
    try:
        assert env.reset(task).screenshot.shape == (480, 640, 3)
        proc.kill()
        proc.wait(timeout=15)
        with pytest.raises(ControllerError, match="no answer from"):
            env.step(Action(ActionType.CLICK, point=(10, 10)))
        with pytest.raises(EvaluationError):
            env.evaluate()
    finally:
        env.close()
        proc.kill()
