"""A recipe stage: a named step that leaves its result in the workdir, so a rerun resumes where it stopped.

`stage(...)` builds a `Stage` from a function; stage modules define them and `guijax.pipeline.registry`
collects them explicitly (no registration as an import side effect). A stage declares the config keys it
reads, the stages it reads from and the paths it writes, so a rerun can tell whether its result was made
from the current config (`guijax.pipeline.records`).
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from guijax.pipeline.run import Run


@dataclasses.dataclass(frozen=True)
class Stage:
    """A named step of a recipe. `describe` says what it will do and how much (printed when it starts),
    `done` whether its result is complete in the workdir (None: a summary, rewritten on every run), and the
    function returns its headline figure (printed when it ends).

    `reads`: config sections or dotted keys its result depends on; `needs`: stages whose outputs it reads
    (those the recipe runs before it); `outputs`: workdir paths it writes, moved aside when its config
    changed; `trains`: the config key naming the method(s) it trains, whose own sections and required
    stages it reads as well; `eval_reads` / `eval_needs`: what the evaluation of each trained method reads,
    when the stage evaluates them too (so a changed evaluation does not retrain)."""

    name: str
    fn: Callable[["Run"], str | None]
    describe: Callable[["Run"], str]
    done: Callable[["Run"], bool] | None
    reads: tuple[str, ...] = ()
    needs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    trains: str | None = None
    eval_reads: tuple[str, ...] = ()
    eval_needs: tuple[str, ...] = ()


def stage(name: str, describe: Callable[["Run"], str], done: Callable[["Run"], bool] | None = None, *,
          reads: tuple[str, ...] = (), needs: tuple[str, ...] = (), outputs: tuple[str, ...] = (),
          trains: str | None = None, eval_reads: tuple[str, ...] = (), eval_needs: tuple[str, ...] = ()):
    """Make a function a Stage; without `done` it is a summary that is rewritten on every run."""
    if done is not None and not reads:
        raise ValueError(f"stage {name!r} keeps its result, so it must declare the config keys it reads")

    def wrap(fn: Callable[["Run"], str | None]) -> Stage:
        return Stage(name, fn, describe, done, reads, needs, outputs, trains, eval_reads, eval_needs)

    return wrap


def output_exists(relative: str) -> Callable[["Run"], bool]:
    """A stage is done when the file it writes last exists."""
    return lambda run: (run.workdir / relative).exists()
