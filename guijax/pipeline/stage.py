"""A recipe stage: a named step that leaves its result in the workdir, so a rerun resumes where it stopped.

`stage(...)` builds a `Stage` from a function; stage modules define them and `guijax.pipeline.registry`
collects them explicitly (no registration as an import side effect).
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from guijax.pipeline.run import Run


@dataclasses.dataclass(frozen=True)
class Stage:
    """A named step of a recipe. `describe` says what it will do and how much (printed when it starts),
    `done` whether its result is already in the workdir (a resumed run skips it and says so), and the
    function returns its headline figure (printed when it ends)."""

    name: str
    fn: Callable[["Run"], str | None]
    describe: Callable[["Run"], str]
    done: Callable[["Run"], bool]


def stage(name: str, describe: Callable[["Run"], str], done: Callable[["Run"], bool] | None = None):
    """Make a function a Stage; without `done` it is a summary that is rewritten on every run."""

    def wrap(fn: Callable[["Run"], str | None]) -> Stage:
        return Stage(name, fn, describe, done or (lambda run: False))

    return wrap


def output_exists(relative: str) -> Callable[["Run"], bool]:
    """A stage is done when the file it writes last exists."""
    return lambda run: (run.workdir / relative).exists()
