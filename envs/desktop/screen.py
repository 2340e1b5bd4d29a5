"""Screenshots, screen size and pointer position read through X11 directly (python-xlib).

Why not `pyautogui.screenshot()`: it shells out to scrot / gnome-screenshot and hung under Xvfb here. An X
GetImage request on the root window is all a screenshot needs. Every call runs under a deadline: a wedged
X server raises `ScreenTimeout` instead of freezing the caller, and the connection is dropped and reopened.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, TypeVar

import numpy as np

T = TypeVar("T")


class ScreenTimeout(TimeoutError):
    pass


class Screen:
    """One X connection to `display` (e.g. ':3')."""

    def __init__(self, display: str, timeout_s: float = 10.0):
        self.display_name = display
        self.timeout_s = timeout_s
        self._conn: Any = None
        self._lock = threading.Lock()

    def _connection(self):
        if self._conn is None:
            from Xlib import display as xdisplay

            self._conn = xdisplay.Display(self.display_name)
        return self._conn

    def _call(self, fn: Callable[[Any], T], what: str) -> T:
        box: dict[str, Any] = {}

        def run():
            try:
                with self._lock:
                    box["value"] = fn(self._connection())
            except BaseException as e:  # surfaced in the caller's thread
                box["error"] = e

        t = threading.Thread(target=run, daemon=True, name=f"x11-{what}")
        t.start()
        t.join(self.timeout_s)
        if t.is_alive():
            self._conn = None  # abandon the wedged connection; the next call opens a fresh one
            raise ScreenTimeout(f"X11 {what} on {self.display_name} took longer than {self.timeout_s}s")
        if "error" in box:
            self._conn = None
            raise box["error"]
        return box["value"]

    def size(self) -> tuple[int, int]:
        """(width, height) in pixels."""
        def get(d):
            s = d.screen()
            return int(s.width_in_pixels), int(s.height_in_pixels)

        return self._call(get, "screen size")

    def cursor_position(self) -> tuple[int, int]:
        def get(d):
            p = d.screen().root.query_pointer()
            return int(p.root_x), int(p.root_y)

        return self._call(get, "query_pointer")

    def grab(self) -> np.ndarray:
        """RGB uint8 [H, W, 3] of the whole screen."""
        def get(d):
            from Xlib import X

            s = d.screen()
            w, h = s.width_in_pixels, s.height_in_pixels
            raw = s.root.get_image(0, 0, w, h, X.ZPixmap, 0xFFFFFFFF)
            buf = np.frombuffer(raw.data, dtype=np.uint8)
            if buf.size != w * h * 4:
                raise RuntimeError(f"unexpected X image layout: {buf.size} bytes for {w}x{h} (depth {raw.depth})")
            bgrx = buf.reshape(h, w, 4)
            return np.ascontiguousarray(bgrx[:, :, 2::-1])

        return self._call(get, "GetImage")

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.close()
            except Exception:
                pass


def png_bytes(rgb: np.ndarray) -> bytes:
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(rgb).save(out, format="PNG", compress_level=1)
    return out.getvalue()


def decode_image(data: bytes) -> np.ndarray:
    import io

    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
