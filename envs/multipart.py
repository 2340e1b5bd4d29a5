"""A streaming multipart/form-data reader: file parts go to disk as they arrive, so an upload of any allowed
size costs the server a few chunks of memory, not the body (the `email` parser holds the body several times
over while it splits it).

Only what HTML forms and `requests` send is read: parts with a `Content-Disposition: form-data; name=...`
header (and `filename=...` for files), no nested multiparts, no transfer encodings.
"""
from __future__ import annotations

import email.parser
import email.policy
import os
import pathlib
from typing import Callable

CHUNK = 1 << 16
MAX_HEADER_BYTES = 16 << 10  # one part's headers
MAX_FIELD_BYTES = 1 << 20  # one non-file field's value, held in memory


class MultipartError(ValueError):
    """A body that is not the multipart/form-data its Content-Type announced; the message says where."""


def boundary_of(content_type: str) -> bytes:
    """The boundary parameter of a multipart/form-data Content-Type."""
    msg = email.parser.HeaderParser(policy=email.policy.HTTP).parsestr(f"Content-Type: {content_type}\r\n\r\n")
    boundary = msg.get_param("boundary")
    if not boundary or not isinstance(boundary, str) or len(boundary) > 70:
        raise MultipartError(f"Content-Type {content_type!r} has no valid boundary parameter")
    return boundary.encode("latin-1")


class _Body:
    """Exactly `length` bytes of `read`, in chunks, with a look-ahead buffer."""

    def __init__(self, read: Callable[[int], bytes], length: int):
        self.read, self.left, self.buf = read, length, b""

    def fill(self) -> bool:
        """Append the next chunk to the buffer; False when the body is exhausted."""
        if self.left <= 0:
            return False
        data = self.read(min(CHUNK, self.left))
        if not data:
            raise MultipartError(f"body ended {self.left} bytes before its Content-Length")
        self.left -= len(data)
        self.buf += data
        return True

    def until(self, marker: bytes, emit: Callable[[bytes], None], what: str) -> None:
        """Pass everything before the next `marker` to `emit` and drop the marker; memory stays within a chunk
        plus the marker's length."""
        while True:
            at = self.buf.find(marker)
            if at >= 0:
                emit(self.buf[:at])
                self.buf = self.buf[at + len(marker):]
                return
            keep = len(marker) - 1
            if len(self.buf) > keep:
                emit(self.buf[:len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep:]
            if not self.fill():
                raise MultipartError(f"body ended inside {what}")

    def take(self, n: int) -> bytes:
        while len(self.buf) < n and self.fill():
            pass
        out, self.buf = self.buf[:n], self.buf[n:]
        return out


def read_form(read: Callable[[int], bytes], length: int, content_type: str,
              directory: str | os.PathLike) -> tuple[dict[str, str], dict[str, pathlib.Path]]:
    """(fields, files) of a multipart/form-data body of `length` bytes read through `read`: field values as
    text, each file part written to its own file under `directory` (returned by field name)."""
    delimiter = b"--" + boundary_of(content_type)
    body = _Body(read, length)
    body.until(delimiter, lambda _: None, "the preamble (no opening boundary)")
    fields: dict[str, str] = {}
    files: dict[str, pathlib.Path] = {}
    while True:
        after = body.take(2)
        if after == b"--":  # the closing boundary; an epilogue, if any, is read and dropped
            while body.fill():
                body.buf = b""
            return fields, files
        if after != b"\r\n":
            raise MultipartError(f"boundary followed by {after!r}, not CRLF or --")
        raw: list[bytes] = []
        size = [0]

        def header_bytes(data: bytes) -> None:
            size[0] += len(data)
            if size[0] > MAX_HEADER_BYTES:
                raise MultipartError(f"a part's headers exceed {MAX_HEADER_BYTES} bytes")
            raw.append(data)

        body.until(b"\r\n\r\n", header_bytes, "a part's headers")
        headers = email.parser.BytesHeaderParser(policy=email.policy.HTTP).parsebytes(b"".join(raw) + b"\r\n\r\n")
        name = headers.get_param("name", header="content-disposition")
        if not isinstance(name, str) or not name:
            raise MultipartError("a part without Content-Disposition: form-data; name=...")
        end = b"\r\n" + delimiter
        if headers.get_filename() is not None:
            path = pathlib.Path(directory) / f"part-{len(files)}"
            with open(path, "wb") as f:
                body.until(end, f.write, f"file part {name!r}")
            files[name] = path
        else:
            value = bytearray()

            def field_bytes(data: bytes, value=value, name=name) -> None:
                if len(value) + len(data) > MAX_FIELD_BYTES:
                    raise MultipartError(f"field {name!r} exceeds {MAX_FIELD_BYTES} bytes")
                value.extend(data)

            body.until(end, field_bytes, f"field {name!r}")
            try:
                fields[name] = value.decode()
            except UnicodeDecodeError:
                raise MultipartError(f"field {name!r} is not UTF-8 text") from None
