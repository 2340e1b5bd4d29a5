"""`python -m envs.server` started for a test on its own Xvfb display, as a user starts it."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from typing import Sequence


def start_server(args: Sequence[str], cache_dir: str | os.PathLike, screen: str = "640x480",
                 timeout_s: float = 30.0) -> tuple[subprocess.Popen, str, str | None]:
    """(process, url, the token it printed or None) once it serves; its log keeps being drained."""
    env = {k: v for k, v in os.environ.items() if k != "GUIJAX_SERVER_TOKEN"}
    proc = subprocess.Popen([sys.executable, "-m", "envs.server", "--port", "0", "--screen", screen,
                             "--cache-dir", str(cache_dir), *args], stderr=subprocess.PIPE, text=True,
                            cwd=os.getcwd(), env=env)
    deadline = time.monotonic() + timeout_s
    lines, token = [], None
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        lines.append(line)
        generated = re.search(r"GUIJAX_SERVER_TOKEN=(\S+?),", line)
        token = generated.group(1) if generated else token
        m = re.search(r"on http://([\d.]+):(\d+)", line)
        if m:
            threading.Thread(target=proc.stderr.read, daemon=True).start()  # keep draining the log
            return proc, f"http://{m.group(1)}:{m.group(2)}", token
        if proc.poll() is not None:
            break
    proc.kill()
    raise RuntimeError("server did not start: " + "".join(lines))
