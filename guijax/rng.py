"""Named random streams: every random draw of a run comes from (seed, path of names), never from a seed plus
a hand-made offset.

`Streams(seed).key("rl", "rollout", iteration)` folds each path element into the run's root key (strings by a
stable 32-bit hash, integers as themselves), so two different paths give independent streams, and the same
path gives the same stream after a restart. `.seed(...)` turns a stream into an integer for Python's
`random`, numpy or environment resets. With offsets (`seed + 4` in one place, `seed * 7 + i` in another),
seed 0's stream of one purpose could be seed 4's stream of another; with paths they cannot meet.
"""
from __future__ import annotations

import dataclasses
import random
import zlib

import jax
import numpy as np

PathPart = str | int


def _fold_value(part: PathPart) -> int:
    if isinstance(part, bool) or not isinstance(part, (str, int)):
        raise TypeError(f"stream path parts are names (str) or indices (int), got {part!r}")
    if isinstance(part, str):
        return zlib.crc32(part.encode("utf-8"))
    if part < 0 or part >= 2 ** 32:
        raise ValueError(f"stream index {part} is outside [0, 2**32)")
    return part


@dataclasses.dataclass(frozen=True)
class Streams:
    seed: int

    def key(self, *path: PathPart) -> jax.Array:
        """A JAX PRNG key for `path`; strings are tagged so that ("a", 1) and (1, "a") differ."""
        key = jax.random.PRNGKey(self.seed)
        for part in path:
            key = jax.random.fold_in(key, 1 if isinstance(part, str) else 0)
            key = jax.random.fold_in(key, _fold_value(part))
        return key

    def seed_for(self, *path: PathPart) -> int:
        """A non-negative 31-bit integer seed for Python, numpy or environment resets, drawn from `key(path)`."""
        data = np.asarray(jax.random.key_data(self.key(*path))).ravel()
        return int(data[-1]) & 0x7FFFFFFF

    def python(self, *path: PathPart) -> random.Random:
        return random.Random(self.seed_for(*path))

    def child(self, *path: PathPart) -> "Streams":
        """The streams of a sub-run (a method of a comparison): its own root, still a function of the seed."""
        return Streams(self.seed_for("child", *path))
