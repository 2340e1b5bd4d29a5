"""The streaming multipart reader gives what the email parser gives, in any chunking, with file parts on disk
and bounded memory; malformed bodies fail naming what is wrong; the server's upload streams."""
from __future__ import annotations

import hashlib
import http.client
import socket
import threading
import tracemalloc

import pytest
from hypothesis import given, settings, strategies as st

from envs import multipart

pytestmark = pytest.mark.hostile  # the standing hostile-input and fault suite

urllib3 = pytest.importorskip("urllib3")


def _reader(data: bytes, sizes: list[int]):
    """read(k) over `data` returning at most the next of `sizes` bytes each call: chunk edges anywhere."""
    pos = [0]
    turn = [0]

    def read(k: int) -> bytes:
        n = min(k, sizes[turn[0] % len(sizes)])
        turn[0] += 1
        out = data[pos[0]:pos[0] + n]
        pos[0] += len(out)
        return out

    return read


names = st.text(st.characters(codec="utf-8", exclude_characters='"\\\r\n\x00'), min_size=1, max_size=12)


@settings(max_examples=60, deadline=None)
@given(fields=st.dictionaries(names, st.text(max_size=40), max_size=3),
       files=st.dictionaries(names, st.binary(max_size=3000) | st.just(b"\r\n--x\r\n--"), max_size=3),
       sizes=st.lists(st.integers(1, 4096), min_size=1, max_size=5))
def test_streamed_form_equals_what_was_encoded(tmp_path_factory, fields, files, sizes):
    encoded = {**{k: v for k, v in fields.items() if k not in files}, **{k: ("f.bin", v) for k, v in files.items()}}
    body, ctype = urllib3.encode_multipart_formdata(encoded)
    got_fields, got_files = multipart.read_form(_reader(body, sizes), len(body), ctype, tmp_path_factory.mktemp("p"))
    assert got_fields == {k: v for k, v in fields.items() if k not in files}
    assert {k: p.read_bytes() for k, p in got_files.items()} == files


@pytest.mark.parametrize("mangle, message", [
    (lambda b: b[:-20], "ended"),  # Content-Length promises more than arrives
    (lambda b: b.replace(b"Content-Disposition", b"X-Other"), "without Content-Disposition"),
    (lambda b: b.replace(b"--", b"__"), "no opening boundary"),
])
def test_malformed_bodies_say_what_is_wrong(tmp_path, mangle, message):
    body, ctype = urllib3.encode_multipart_formdata({"file_path": "~/a", "file_data": ("a", b"x" * 100)})
    bad = mangle(body)
    with pytest.raises(multipart.MultipartError, match=message):
        multipart.read_form(_reader(bad, [1000]), len(body), ctype, tmp_path)
    with pytest.raises(multipart.MultipartError, match="boundary"):
        multipart.read_form(_reader(body, [1000]), len(body), "multipart/form-data", tmp_path)


class _Uploads:
    """A controller that records what /setup/upload hands it."""

    def __init__(self):
        self.got: dict[str, tuple[int, str]] = {}

    def upload_file(self, path: str, source) -> None:
        digest = hashlib.sha256()
        with open(source, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        self.got[path] = (source.stat().st_size, digest.hexdigest())


def test_a_large_upload_streams_to_disk_in_bounded_memory():
    from envs.server import DesktopServer

    ctl = _Uploads()
    server = DesktopServer(("127.0.0.1", 0), ctl, token="t")
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        size, block = 48 << 20, bytes(range(256)) * 4096  # 48 MiB sent 1 MiB at a time
        template, ctype = urllib3.encode_multipart_formdata({"file_path": "~/big.bin", "file_data": ("big.bin", b"@")})
        body_pre, body_post = template.split(b"@")
        length = len(body_pre) + size + len(body_post)
        digest = hashlib.sha256()
        tracemalloc.start()
        with socket.create_connection(server.server_address, timeout=60) as sock:
            sock.sendall((f"POST /setup/upload HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer t\r\n"
                          f"Content-Type: {ctype}\r\nContent-Length: {length}\r\n\r\n").encode() + body_pre)
            for _i in range(size // len(block)):
                sock.sendall(block)
                digest.update(block)
            sock.sendall(body_post)
            reply = http.client.HTTPResponse(sock)  # headers and body may arrive in separate packets
            reply.begin()
            status, body = reply.status, reply.read()
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert status == 200 and f"File Uploaded: {size} bytes".encode() in body, (status, body)
        assert ctl.got["~/big.bin"] == (size, digest.hexdigest())
        assert peak < 8 << 20, f"peak traced memory {peak / 2**20:.1f} MiB while receiving 48 MiB"
    finally:
        server.shutdown()
        server.server_close()
