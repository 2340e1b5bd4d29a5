"""Replace a file in one step (write a sibling `.tmp`, then rename), so a crash mid-write leaves either the old
file or the new one, never half of one. Lives in `envs` so it is importable without JAX."""
from __future__ import annotations

import pathlib


def write_text_atomic(path: str | pathlib.Path, text: str) -> pathlib.Path:
    path = pathlib.Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
    return path
