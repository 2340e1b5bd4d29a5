"""A local OpenAI-compatible /chat/completions server for the large-model roles' tests: it answers from a
script of (HTTP status, assistant text) and records every request body it got."""
from __future__ import annotations

import contextlib
import http.server
import json
import threading
from typing import Callable


@contextlib.contextmanager
def fake_chat_server(replies: list[tuple[int, str]] | Callable[[dict], tuple[int, str]]):
    """Yields (base URL, requests). Each request takes the next reply; the last one repeats. `replies` may
    instead be a function of the request body (for a server that plays several roles)."""
    requests: list[dict] = []
    script = replies if callable(replies) else list(replies)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            requests.append({"path": self.path, "body": body, "auth": self.headers.get("Authorization")})
            if callable(script):
                status, text = script(body)
            else:
                status, text = script.pop(0) if len(script) > 1 else script[0]
            payload = (json.dumps({"choices": [{"message": {"role": "assistant", "content": text}}]})
                       if status == 200 else json.dumps({"error": text})).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1", requests
    finally:
        server.shutdown()
        server.server_close()


def decoded_image(data_url: str):
    """The [H, W, 3] array a PNG data URL (as guijax.chat.png_data_url writes it) holds."""
    import base64
    import io

    import numpy as np
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(base64.b64decode(data_url.split(",", 1)[1]))))
