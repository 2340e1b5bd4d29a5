"""An OSWorld-compatible VM server for a local X display: `python -m envs.server --port 5000 [--display :N]`.

It answers the HTTP endpoints OSWorld's PythonController and SetupController call (same paths, request and
response shapes): /screenshot, /execute, /setup/execute, /setup/launch, /setup/open_file, /setup/upload,
/setup/download_file, /setup/activate_window, /setup/close_window, /file, /list_directory, /platform,
/cursor_position, /screen_size, /run_python, /run_bash_script, /terminal, /accessibility; plus /guijax/reset
(close the apps this server started), which OSWorld VMs lack (there the provider reverts a snapshot).

SECURITY: this server runs arbitrary commands and code sent to it. Every request must carry
`Authorization: Bearer <token>`: the token is --token (or $GUIJAX_SERVER_TOKEN), or one generated at start
and printed, so no other local process or web page can drive it. `--no-token` (loopback only) opts out, for
clients that cannot send a header, such as OSWorld's own controller. It binds 127.0.0.1 by default. JSON
endpoints take only `Content-Type: application/json` bodies, so a web form cannot post to them. Without
--display it starts its own Xvfb desktop with a private HOME; with --display it drives that existing display
and the real HOME.

Each request runs in its own thread; a command that hangs is killed after --timeout seconds (default 90)
and answered with HTTP 500, so it never takes the server down. One client cannot make it hold unbounded
memory or threads: bodies over --max-body-mb are refused unread, uploads stream to disk, idle connections
close after 60 s, and at most 64 connections are served at once.
"""
from __future__ import annotations

import argparse
import email.parser
import email.policy
import hmac
import ipaddress
import json
import logging
import math
import os
import pathlib
import secrets
import signal
import sys
import tempfile
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

from envs import multipart
from envs.desktop.controller import ControllerError, LocalController
from envs.desktop.display import Display

log = logging.getLogger("envs.server")


class Reply(Exception):
    """Raised by a handler to answer right away (status + body)."""

    def __init__(self, status: int, body: Any, content_type: str | None = None):
        self.status, self.body, self.content_type = status, body, content_type


class BodyRefused(Reply):
    """A request body that is not read (too large, of no stated size, cut short): answered, then the
    connection is closed, since what is left of the body would be read as the next request."""

    def __init__(self, status: int, message: str):
        super().__init__(status, {"status": "error", "message": message})


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


MAX_BODY_BYTES = 1 << 30  # an upload larger than this is refused (413) before any of it is read
MAX_CONNECTIONS = 64  # connections served at once; more are answered 503 and closed
IDLE_TIMEOUT_S = 60.0  # a connection that sends nothing for this long is closed


def _text(value: Any) -> bool:
    return isinstance(value, str)


def _optional_text(value: Any) -> bool:
    return value is None or isinstance(value, str)


def _flag(value: Any) -> bool:
    return isinstance(value, (bool, int)) and not isinstance(value, float)


def _command(value: Any) -> bool:
    return isinstance(value, str) or (isinstance(value, list) and all(isinstance(a, str) for a in value))


# The JSON fields the endpoints read: (check, what the check wants). Timeouts are checked by `_timeout`.
JSON_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "command": (_command, "a string or a list of strings"), "shell": (_flag, "a boolean"),
    "path": (_text, "a string"), "url": (_text, "a string"), "code": (_text, "a string"),
    "script": (_text, "a string"), "window_name": (_optional_text, "a string"),
    "working_dir": (_optional_text, "a string"), "strict": (_flag, "a boolean"), "by_class": (_flag, "a boolean"),
}


class DesktopServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    # The listen backlog. socketserver's default of 5 drops handshakes whenever more clients connect at once
    # than the accept loop has just taken; a client that then sends nothing is not seen for up to 15 s of
    # SYN-ACK retries. Connections past the cap are still answered 503 as soon as they are accepted.
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], controller: LocalController, token: str | None = None,
                 timeout_s: float = 90.0, max_body_bytes: int = MAX_BODY_BYTES,
                 max_connections: int = MAX_CONNECTIONS, idle_timeout_s: float = IDLE_TIMEOUT_S):
        host = address[0]
        if not _is_loopback(host) and not token:
            raise ValueError(f"refusing to bind {host}: the server runs arbitrary code; pass --token to bind a "
                             f"non-loopback address")
        self.controller = controller
        self.token = token
        self.timeout_s = timeout_s
        self.loopback = _is_loopback(host)
        self.max_body_bytes = max_body_bytes
        self.idle_timeout_s = idle_timeout_s
        self.max_connections = max_connections
        self._slots_lock = threading.Lock()
        self.active_connections = 0  # connections holding a slot now (a thread lingers a moment after release)
        super().__init__(address, Handler)

    def _take_slot(self) -> bool:
        with self._slots_lock:
            if self.active_connections >= self.max_connections:
                return False
            self.active_connections += 1
            return True

    def _give_slot(self) -> None:
        with self._slots_lock:
            self.active_connections -= 1

    def process_request(self, request, client_address) -> None:
        """One thread per connection, up to `max_connections` at once: beyond that the connection is answered
        503 and closed at once, so half-sent or idle connections cannot pile up threads without bound."""
        if not self._take_slot():
            try:
                body = b'{"status": "error", "message": "too many connections"}'
                request.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                                b"Connection: close\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._give_slot()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._give_slot()

    def handle_error(self, request, client_address) -> None:
        """A client that hangs up mid-reply is one log line, not a traceback on stderr; anything else is
        logged with its traceback."""
        error = sys.exc_info()[1]
        if isinstance(error, (ConnectionError, TimeoutError)):
            log.info("%s: connection ended early (%s)", client_address[0], type(error).__name__)
        else:
            log.exception("%s: request failed", client_address[0])


class Handler(BaseHTTPRequestHandler):
    server: DesktopServer
    protocol_version = "HTTP/1.1"

    def setup(self) -> None:
        self.timeout = self.server.idle_timeout_s  # the socket timeout while reading a request or its body
        super().setup()

    def log_message(self, fmt: str, *args: Any) -> None:  # route through logging, not stderr
        log.info("%s %s", self.address_string(), fmt % args)

    # -- plumbing ----------------------------------------------------------------------------------------
    def _send(self, status: int, body: Any, content_type: str | None = None, headers: dict[str, str] | None = None) -> None:
        if isinstance(body, (dict, list)):
            data, content_type = json.dumps(body).encode(), content_type or "application/json"
        elif isinstance(body, str):
            data, content_type = body.encode(), content_type or "text/html; charset=utf-8"
        else:
            data, content_type = bytes(body), content_type or "application/octet-stream"
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _body_length(self) -> int:
        """The declared body size, refused (before any of it is read) when it is not a size or too large."""
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            raise BodyRefused(411, "chunked bodies are not accepted; send Content-Length")
        raw = self.headers.get("Content-Length") or "0"
        if not raw.strip().isdigit():
            raise BodyRefused(400, f"invalid Content-Length {raw!r}")
        n = int(raw)
        if n > self.server.max_body_bytes:
            raise BodyRefused(413, f"body of {n} bytes exceeds the server's limit of {self.server.max_body_bytes} bytes")
        return n

    def _body(self) -> bytes:
        n = self._body_length()
        try:
            data = self.rfile.read(n) if n > 0 else b""
        except TimeoutError:
            raise BodyRefused(408, f"body not received: nothing for {self.server.idle_timeout_s:g} s") from None
        if len(data) < n:
            raise BodyRefused(400, f"body ended after {len(data)} of {n} bytes")
        return data

    def _refuse(self, status: int, message: str) -> None:
        """Answer without reading the body (it may be large and is unwanted) and close the connection, since
        the unread body would otherwise be taken for the next request."""
        self.close_connection = True
        self._send(status, {"status": "error", "message": message}, headers={"Connection": "close"})

    def _content_type(self, allowed: tuple[str, ...]) -> str:
        """The body's media type, refused (415, unread) unless it is one of `allowed`: browsers send only
        text/plain, urlencoded and multipart bodies without asking first, so a JSON endpoint that insists on
        application/json cannot be driven by a web page's form. An empty body needs no type."""
        ctype = self.headers.get("Content-Type", "")
        media = ctype.split(";", 1)[0].strip().lower()
        if self._body_length() and media not in allowed:
            raise BodyRefused(415, f"Content-Type {ctype or '(none)'!r} is not accepted here; send {' or '.join(allowed)}")
        return media

    def _json(self) -> dict[str, Any]:
        self._content_type(("application/json",))
        raw = self._body()
        try:
            data = json.loads(raw or b"{}")
        except json.JSONDecodeError as e:
            raise Reply(400, {"status": "error", "message": f"invalid JSON body: {e}"})
        if not isinstance(data, dict):
            raise Reply(400, {"status": "error", "message": "JSON body must be an object"})
        wrong = [f"{key!r} must be {JSON_FIELDS[key][1]}, got {type(value).__name__}" for key, value in data.items()
                 if key in JSON_FIELDS and not JSON_FIELDS[key][0](value)]
        if wrong:  # a client's mistake, answered as such, not a server error from deep inside a handler
            raise Reply(400, {"status": "error", "message": "; ".join(wrong)})
        return data

    def _form(self) -> tuple[dict[str, str], dict[str, bytes]]:
        """Fields and files of an urlencoded or multipart/form-data body."""
        media = self._content_type(("multipart/form-data", "application/x-www-form-urlencoded"))
        ctype = self.headers.get("Content-Type", "")
        raw = self._body()
        if media == "multipart/form-data":
            msg = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
                b"Content-Type: " + ctype.encode() + b"\r\n\r\n" + raw)
            fields: dict[str, str] = {}
            files: dict[str, bytes] = {}
            for part in msg.iter_parts():
                name = part.get_param("name", header="content-disposition")
                payload = part.get_payload(decode=True) or b""
                if part.get_filename() is not None:
                    files[name] = payload
                else:
                    fields[name] = payload.decode()
            return fields, files
        return {k: v[0] for k, v in urllib.parse.parse_qs(raw.decode()).items()}, {}

    def _form_to_disk(self, directory: str) -> tuple[dict[str, str], dict[str, pathlib.Path]]:
        """Fields and files of a multipart/form-data body, the files streamed into `directory` as they arrive:
        an upload costs a few chunks of memory however large it is (up to --max-body-mb)."""
        self._content_type(("multipart/form-data",))
        n = self._body_length()

        def read(k: int) -> bytes:
            try:
                return self.rfile.read(k)
            except TimeoutError:
                raise BodyRefused(408, f"body not received: nothing for {self.server.idle_timeout_s:g} s") from None

        try:
            return multipart.read_form(read, n, self.headers.get("Content-Type", ""), directory)
        except multipart.MultipartError as e:
            raise BodyRefused(400, f"malformed multipart body: {e}") from None

    def _authorized(self) -> bool:
        token = self.server.token
        if not token:
            return True
        got = self.headers.get("Authorization", "")
        got = got[7:] if got.startswith("Bearer ") else self.headers.get("X-Guijax-Token", "")
        return hmac.compare_digest(got.encode(), token.encode())

    def _cross_site(self) -> str | None:
        """Why a request looks like it came from a web page rather than an agent client: browsers add an
        Origin header to cross-site POSTs, and a DNS-rebinding page reaches a loopback server under its own
        host name. Clients (requests, OSWorld's controller) send neither."""
        if self.headers.get("Origin") is not None:
            return "requests carrying an Origin header (from a web page) are refused"
        if self.server.loopback:
            host = self.headers.get("Host", "")
            name = host[1:host.find("]")] if host.startswith("[") else host.rsplit(":", 1)[0]
            if not _is_loopback(name):
                return f"Host {host!r} is not a loopback name; this server answers only 127.0.0.1 / localhost"
        return None

    def _dispatch(self, method: str) -> None:
        path = urllib.parse.urlparse(self.path).path.rstrip("/") or "/"
        refused = self._cross_site()
        if refused:
            self._refuse(403, refused)
            return
        if not self._authorized():
            self._refuse(401, "missing or wrong token (Authorization: Bearer ...)")
            return
        route = ROUTES.get((method, path))
        if route is None:
            known = any(p == path for _, p in ROUTES)
            self._refuse(405 if known else 404, f"no route {method} {path}")
            return
        try:
            self._body_length()  # a bad or oversized body is refused before the route reads any of it
            status, body, ctype = route(self)
        except BodyRefused as r:
            self._refuse(r.status, r.body["message"])
            return
        except Reply as r:
            status, body, ctype = r.status, r.body, r.content_type
        except ControllerError as e:
            status, body, ctype = e.status, {"status": "error", "message": str(e)}, None
        except Exception as e:  # a handler bug must not kill the server
            log.exception("handler %s %s failed", method, path)
            status, body, ctype = 500, {"status": "error", "message": f"{type(e).__name__}: {e}"}, None
        try:
            self._send(status, body, ctype)
        except (BrokenPipeError, ConnectionResetError):
            pass

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    @property
    def ctl(self) -> LocalController:
        return self.server.controller


# -- endpoints (each returns status, body, content type) ------------------------------------------------------
def _timeout(h: Handler, requested: Any = None) -> float:
    limit = h.server.timeout_s
    if requested is None:
        return limit
    try:
        value = float(requested)
    except (TypeError, ValueError, OverflowError):
        value = math.nan
    if not (math.isfinite(value) and value > 0) or isinstance(requested, bool):  # NaN would disable the limit
        raise Reply(400, {"status": "error", "message": f"invalid timeout {requested!r}: a positive number of seconds"})
    return min(value, limit)


def screenshot(h: Handler):
    from envs.desktop.screen import png_bytes

    return 200, png_bytes(h.ctl.screenshot()), "image/png"


def execute(h: Handler):
    data = h._json()
    shell = bool(data.get("shell", False))
    command = data.get("command", "" if shell else [])
    if not command:
        return 400, {"status": "error", "message": "command is required"}, None
    r = h.ctl.execute(command, shell=shell, timeout_s=_timeout(h))
    if r.get("timed_out") or r.get("message"):
        return 500, {"status": "error", "message": r.get("message") or r["error"]}, None
    return 200, {"status": "success", "output": r["output"], "error": r["error"], "returncode": r["returncode"]}, None


def launch(h: Handler):
    data = h._json()
    shell = bool(data.get("shell", False))
    command = data.get("command", "" if shell else [])
    if not command:
        return 400, {"status": "error", "message": "command is required"}, None
    h.ctl.launch(command, shell=shell)
    shown = command if shell or isinstance(command, str) else " ".join(command)
    return 200, f"{shown} launched successfully", None


def open_file(h: Handler):
    data = h._json()
    if not data.get("path"):
        return 400, "Path not supplied!", None
    h.ctl.open_file(data["path"], window_name=data.get("window_name"),
                    timeout_s=_timeout(h, data.get("timeout_seconds")))
    return 200, "File opened and window activated successfully", None


def upload(h: Handler):
    with tempfile.TemporaryDirectory(prefix="guijax-upload-") as tmp:
        fields, files = h._form_to_disk(tmp)
        if "file_path" not in fields or "file_data" not in files:
            return 400, {"error": "file_path and file_data are required"}, None
        size = files["file_data"].stat().st_size
        h.ctl.upload_file(fields["file_path"], files["file_data"])
    return 200, f"File Uploaded: {size} bytes", None


def download_file(h: Handler):
    data = h._json()
    if not data.get("url") or not data.get("path"):
        return 400, "Path or URL not supplied!", None
    try:
        h.ctl.download_file(data["url"], data["path"])
    except OSError as e:
        return 500, f"Failed to download {data['url']}. Error: {e}", None
    size = len(h.ctl.get_file(data["path"]) or b"")
    return 200, f"File downloaded successfully: {size} bytes", None


def _window(kind: str) -> Callable[[Handler], tuple]:
    def run(h: Handler):
        data = h._json()
        if not data.get("window_name"):
            return 400, "window_name required", None
        fn = h.ctl.activate_window if kind == "activate" else h.ctl.close_window
        if not fn(data["window_name"], strict=bool(data.get("strict", False)), by_class=bool(data.get("by_class", False))):
            return 404, f"Window {data['window_name']} not found", None
        return 200, ("Window activated successfully" if kind == "activate" else "Window closed successfully."), None

    return run


def get_file(h: Handler):
    fields, _ = h._form()
    if "file_path" not in fields:
        return 400, {"error": "file_path is required"}, None
    data = h.ctl.get_file(fields["file_path"])
    if data is None:
        return 404, {"error": "File not found"}, None
    return 200, data, "application/octet-stream"


def list_directory(h: Handler):
    data = h._json()
    if "path" not in data:
        return 400, {"error": "Missing 'path' parameter"}, None
    tree = h.ctl.list_directory(data["path"])
    if tree is None:
        return 400, {"error": "The provided path is not a directory"}, None
    return 200, {"directory_tree": tree}, None


def platform_(h: Handler):
    return 200, h.ctl.platform(), None


def cursor_position(h: Handler):
    return 200, list(h.ctl.cursor_position()), None


def screen_size(h: Handler):
    h._body()
    w, hh = h.ctl.screen_size()
    return 200, {"width": w, "height": hh}, None


def run_python(h: Handler):
    data = h._json()
    if not data.get("code"):
        return 400, {"status": "error", "message": "Code not supplied!"}, None
    r = h.ctl.run_python(data["code"], timeout_s=_timeout(h, data.get("timeout")))
    if r.pop("timed_out", False):
        return 500, {"status": "error", "message": "Execution timeout: Code took too long to execute",
                     "error": "TimeoutExpired", "need_more": False, "output": None}, None
    return 200, r, None


def run_bash_script(h: Handler):
    data = h._json()
    if not data.get("script"):
        return 400, {"status": "error", "output": "Script not supplied!", "error": "", "returncode": -1}, None
    timeout = _timeout(h, data.get("timeout"))
    r = h.ctl.run_bash_script(data["script"], timeout_s=timeout, working_dir=data.get("working_dir"))
    if r["returncode"] == -1 and r["output"].startswith(("Script execution timed out", "Working directory")):
        return (500 if "timed out" in r["output"] else 400), r, None
    return 200, r, None


def terminal(h: Handler):
    return 200, {"output": h.ctl.terminal_output(), "status": "success"}, None


def accessibility(h: Handler):
    """The local desktop exposes no AT-SPI tree: AT is null (agents fall back to screenshots)."""
    return 200, {"AT": None}, None


def reset(h: Handler):
    h._body()
    h.ctl.reset()
    return 200, {"status": "success"}, None


ROUTES: dict[tuple[str, str], Callable[[Handler], tuple]] = {
    ("GET", "/screenshot"): screenshot,
    ("POST", "/execute"): execute,
    ("POST", "/setup/execute"): execute,
    ("POST", "/setup/launch"): launch,
    ("POST", "/setup/open_file"): open_file,
    ("POST", "/setup/upload"): upload,
    ("POST", "/setup/download_file"): download_file,
    ("POST", "/setup/activate_window"): _window("activate"),
    ("POST", "/setup/close_window"): _window("close"),
    ("POST", "/file"): get_file,
    ("POST", "/list_directory"): list_directory,
    ("GET", "/platform"): platform_,
    ("GET", "/cursor_position"): cursor_position,
    ("POST", "/screen_size"): screen_size,
    ("GET", "/screen_size"): screen_size,
    ("POST", "/run_python"): run_python,
    ("POST", "/run_bash_script"): run_bash_script,
    ("GET", "/terminal"): terminal,
    ("GET", "/accessibility"): accessibility,
    ("POST", "/guijax/reset"): reset,
}


def _refuse_open_bind_without_token(host: str, token: str | None) -> None:
    if not _is_loopback(host) and not token:
        raise SystemExit(f"refusing to bind {host}: this server runs arbitrary code; pass --token TOKEN")


def _cli_token(token: str | None, no_token: bool, host: str) -> str | None:
    """The token the command line serves with: the given one, a fresh random one (loopback), or none
    (`--no-token`, loopback). Another bind address needs a token the user chose, a sign they meant it."""
    if no_token and token:
        raise SystemExit("--no-token and --token (or GUIJAX_SERVER_TOKEN) contradict each other")
    _refuse_open_bind_without_token(host, token)
    return None if no_token else token or secrets.token_urlsafe(24)


def serve(host: str = "127.0.0.1", port: int = 5000, display: str | None = None, token: str | None = None,
          timeout_s: float = 90.0, screen_size: tuple[int, int] = (1920, 1080), cache_dirs: tuple[str, ...] = (),
          allow_network: bool = False, ready: Callable[[DesktopServer], None] | None = None,
          max_body_bytes: int = MAX_BODY_BYTES) -> None:
    """Run until SIGINT/SIGTERM; `ready` is called with the bound server (tests read its port)."""
    _refuse_open_bind_without_token(host, token)
    disp = Display.attach(display) if display else Display(screen_size)
    controller = LocalController(disp, timeout_s, cache_dirs, allow_network)
    server = DesktopServer((host, port), controller, token, timeout_s, max_body_bytes=max_body_bytes)
    stop = threading.Event()

    def on_signal(signum, frame):
        stop.set()
        threading.Thread(target=server.shutdown, daemon=True).start()

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
    log.info("serving %s on http://%s:%d (display %s)", "with token" if token else "without token",
             host, server.server_address[1], disp.name)
    if ready:
        ready(server)
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        server.server_close()
        controller.close()
        disp.close()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m envs.server", description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, default=5000)
    p.add_argument("--host", default="127.0.0.1", help="bind address; anything but loopback needs --token")
    p.add_argument("--token", default=os.environ.get("GUIJAX_SERVER_TOKEN"),
                   help="shared secret every request must carry (Authorization: Bearer TOKEN); "
                        "default: $GUIJAX_SERVER_TOKEN, else a random one, printed at start")
    p.add_argument("--no-token", action="store_true",
                   help="serve without a token (loopback only): any local process can then run commands")
    p.add_argument("--display", default=None, help="existing X display to drive (default: start an Xvfb)")
    p.add_argument("--timeout", type=float, default=90.0, help="seconds before a command is killed")
    p.add_argument("--screen", default="1920x1080", help="size of the Xvfb screen started without --display")
    p.add_argument("--cache-dir", action="append", default=[], help="local cache for /setup/download_file")
    p.add_argument("--allow-network", action="store_true", help="let /setup/download_file fetch http(s) URLs")
    p.add_argument("--max-body-mb", type=float, default=MAX_BODY_BYTES / 2**20,
                   help="largest request body (an upload) accepted; larger ones are refused unread")
    p.add_argument("--log-level", default="INFO")
    a = p.parse_args(argv)
    from envs.desktop.checks import server_missing

    token = _cli_token(a.token, a.no_token, a.host)
    missing = server_missing(own_display=a.display is None)
    if missing:
        raise SystemExit(f"error: the desktop server cannot start here: {missing}")
    logging.basicConfig(level=a.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    if token is None:
        log.warning("serving WITHOUT a token (--no-token): any process on this machine can run commands here")
    elif token != a.token:
        print(f"generated token (clients: export GUIJAX_SERVER_TOKEN={token}, or Authorization: Bearer {token})",
              file=sys.stderr, flush=True)
    w, h = (int(x) for x in a.screen.lower().split("x"))
    serve(a.host, a.port, a.display, token, a.timeout, (w, h), tuple(a.cache_dir), a.allow_network,
          max_body_bytes=int(a.max_body_mb * 2**20))


if __name__ == "__main__":
    main()
