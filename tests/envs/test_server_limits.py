"""The server bounds what one client can make it hold: bodies are refused by their declared size before they
are read (and before anything is read from an unauthenticated client), half-sent requests time out, and the
connections served at once are capped. Loopback only; no desktop needed."""
from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time

import pytest

from envs.server import DesktopServer

pytestmark = pytest.mark.hostile  # the standing hostile-input and fault suite


class _Echo:
    """The controller calls these tests make: /platform, and a JSON and a form endpoint that touch nothing."""

    def platform(self) -> str:
        return "Linux"

    def list_directory(self, path: str) -> dict:
        return {"name": path, "type": "directory", "children": []}

    def get_file(self, path: str) -> bytes:
        return path.encode()


@pytest.fixture
def serve():
    servers = []

    def start(**kw) -> tuple[str, int]:
        server = DesktopServer(("127.0.0.1", 0), _Echo(), **kw)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return server.server_address

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def _request(address, head: bytes, body: bytes = b"", timeout: float = 10.0) -> bytes:
    """Send raw bytes and read until the server closes or answers one response."""
    with socket.create_connection(address, timeout=timeout) as sock:
        sock.sendall(head + body)
        return _read_response(sock)


def _read_response(sock: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    length = int(next((line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")), b"0"))
    while len(rest) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        rest += chunk
    return head + b"\r\n\r\n" + rest


def _status(response: bytes) -> int:
    return int(response.split(b" ", 2)[1])


def test_an_unauthenticated_huge_body_is_refused_unread(serve):
    address = serve(token="secret")
    start = time.monotonic()
    response = _request(address, b"POST /execute HTTP/1.1\r\nHost: localhost\r\nContent-Length: 100000000000\r\n\r\n",
                        b"x" * 1000)
    assert _status(response) == 401 and b"Connection: close" in response
    assert time.monotonic() - start < 5


@pytest.mark.parametrize("header, status", [(b"Content-Length: 5000", 413), (b"Content-Length: -1", 400),
                                            (b"Content-Length: lots", 400), (b"Transfer-Encoding: chunked", 411)])
def test_bodies_without_an_acceptable_size_are_refused(serve, header, status):
    address = serve(max_body_bytes=1000)
    response = _request(address, b"POST /execute HTTP/1.1\r\nHost: localhost\r\n" + header + b"\r\n\r\n", b"x" * 10)
    assert _status(response) == status and b"Connection: close" in response


def test_a_half_sent_body_times_out(serve):
    address = serve(idle_timeout_s=0.5)
    start = time.monotonic()
    response = _request(address, b"POST /execute HTTP/1.1\r\nHost: localhost\r\nContent-Length: 100\r\n"
                                 b"Content-Type: application/json\r\n\r\n", b'{"comm')
    assert _status(response) == 408 and time.monotonic() - start < 5


def test_idle_connections_are_capped_and_closed(serve):
    address = serve(max_connections=2, idle_timeout_s=1.0)
    idle = [socket.create_connection(address, timeout=10) for _ in range(2)]  # hold both slots, send nothing
    try:
        time.sleep(0.2)
        busy = _request(address, b"GET /platform HTTP/1.1\r\nHost: localhost\r\n\r\n")
        assert _status(busy) == 503
        time.sleep(1.5)  # the idle ones time out and give their slots back
        served = _request(address, b"GET /platform HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        assert _status(served) == 200 and served.endswith(b"Linux")
    finally:
        for sock in idle:
            sock.close()


def test_a_burst_of_silent_connections_is_taken_and_closed_promptly():
    """Forty clients connect while the accept loop is not running, then send nothing: each handshake must be
    queued (a backlog of 5 drops the rest, whose clients then wait out SYN-ACK retries for up to 15 s), and
    once serving, every one is answered 503 or closed within the idle timeout."""
    server = DesktopServer(("127.0.0.1", 0), _Echo(), max_connections=4, idle_timeout_s=0.5)
    socks, serving = [], False
    try:
        for _ in range(40):
            sock = socket.socket()
            sock.settimeout(0.5)
            sock.connect(server.server_address)  # times out when the listen backlog is full
            socks.append(sock)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        serving = True
        start = time.monotonic()
        for sock in socks:
            sock.settimeout(10)
            head = sock.recv(64)
            assert head == b"" or head.startswith(b"HTTP/1.1 503"), head
        assert time.monotonic() - start < 5
    finally:
        for sock in socks:
            sock.close()
        if serving:  # shutdown() waits for a serve_forever loop to end, forever if none ran
            server.shutdown()
        server.server_close()


@pytest.mark.parametrize("path, body, ctype, status", [
    ("/list_directory", b'{"path": "~"}', "application/json", 200),
    ("/list_directory", b'{"path": "~"}', "application/json; charset=utf-8", 200),
    ("/list_directory", b'{"path": "~"}', "text/plain", 415),  # what a web page's simple POST sends
    ("/list_directory", b'{"path": "~"}', None, 415),
    ("/list_directory", b"path=~", "application/x-www-form-urlencoded", 415),  # an HTML form
    ("/file", b"file_path=%7E%2Fa.txt", "application/x-www-form-urlencoded", 200),  # OSWorld posts /file as a form
    ("/file", b'{"file_path": "~/a.txt"}', "application/json", 415),
])
def test_endpoints_take_only_their_content_type(serve, path, body, ctype, status):
    address = serve(token="secret")
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer secret\r\n"
            f"Content-Length: {len(body)}\r\n" + (f"Content-Type: {ctype}\r\n" if ctype else "") + "\r\n").encode()
    response = _request(address, head, body)
    assert _status(response) == status, response
    if status == 415:
        assert b"is not accepted here" in response


@pytest.mark.parametrize("args, message", [
    (["--no-token", "--host", "0.0.0.0"], "refusing to bind 0.0.0.0"),
    (["--no-token", "--token", "x"], "contradict"),
])
def test_serving_without_a_token_is_loopback_only_and_explicit(args, message):
    r = subprocess.run([sys.executable, "-m", "envs.server", "--port", "0", *args], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode != 0 and message in r.stderr


@pytest.mark.parametrize("path, body, key", [
    ("/list_directory", b'{"path": 5}', "'path' must be a string"),
    ("/execute", b'{"command": ["ls", 1]}', "'command' must be a string or a list of strings"),
    ("/execute", b'{"command": {"a": 1}}', "'command' must be"),
    ("/setup/activate_window", b'{"window_name": ["x"]}', "'window_name' must be a string"),
    ("/run_python", b'{"code": null}', "'code' must be a string"),
])
def test_wrong_json_types_are_the_clients_error(serve, path, body, key):
    address = serve(token="secret")
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer secret\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    response = _request(address, head, body)
    assert _status(response) == 400 and key.encode() in response, response


def test_a_client_hanging_up_mid_reply_is_a_log_line_not_a_traceback(capsys, caplog):
    """Under load, clients refused unread often reset the connection while the refusal is written."""
    server = DesktopServer.__new__(DesktopServer)  # handle_error reads nothing from the instance
    with caplog.at_level("INFO", logger="envs.server"):
        try:
            raise ConnectionResetError(104, "Connection reset by peer")
        except ConnectionResetError:
            server.handle_error(None, ("127.0.0.1", 40000))
    assert capsys.readouterr().err == ""
    assert "connection ended early (ConnectionResetError)" in caplog.text
