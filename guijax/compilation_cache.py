"""XLA's persistent compilation cache, so a recipe compiles each program once per machine.

Every method of a comparison, every seed and every resumed run builds fresh jitted functions for the same
shapes; without a persistent cache each of them recompiles (on 2 CPU cores a third of a short method's
time). JAX keys the cache on the program, the backend and the devices, so a hit is the same executable.
A size bound turns on JAX's least-recently-used eviction, which also takes a file lock around each read and
write: the seeds of a comparison may run as parallel processes sharing one cache.
"""
from __future__ import annotations

import os
import pathlib

import jax


MAX_BYTES = 4 << 30


def enable(directory: str, max_bytes: int = MAX_BYTES) -> pathlib.Path | None:
    """Point JAX's persistent compilation cache at `directory` (`~` expanded); "" leaves it off.
    Every program is cached, however quickly it compiled: the recipes' many small ones add up."""
    if not directory:
        return None
    path = pathlib.Path(os.path.expanduser(directory))
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OSError(f"compilation_cache_dir {directory!r} cannot be created: {e}") from e
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    jax.config.update("jax_compilation_cache_max_size", max_bytes)
    return path
