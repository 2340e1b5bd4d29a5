"""Replace a file in one step (write a uniquely named sibling, fsync it, rename it over the target, fsync the
directory), so a crash or power loss mid-write leaves either the old file or the new one, never half of one,
and two writers of the same file never share a temporary. Lives in `envs` so it is importable without JAX."""
from __future__ import annotations

import os
import pathlib
import tempfile


def write_text_atomic(path: str | pathlib.Path, text: str) -> pathlib.Path:
    path = pathlib.Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        pathlib.Path(tmp).unlink(missing_ok=True)
        raise
    try:  # the rename itself survives a power loss only once the directory entry is on disk
        directory = os.open(path.parent, os.O_RDONLY)
    except OSError:
        return path
    try:
        os.fsync(directory)
    except OSError:
        pass  # some filesystems do not fsync directories
    finally:
        os.close(directory)
    return path
