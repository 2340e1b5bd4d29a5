"""What a method is: one unit that owns its config section, its trajectory hook, its objective, the stages
whose outputs it reads, and any training it does before (or instead of) the RL loop.

The RL loop (`guijax.trainer`) and the jitted step know only this interface. A method is registered by name
in `guijax.methods` (its `REGISTRY`); adding one touches its own module and that registry.

Hooks: `observe(task, rollouts)` sees a task's raw on-policy group (to update replay buffers or caches);
`assemble(task, rollouts)` returns the group that is trained on, possibly with injected trajectories;
`auxiliary(task)` returns rows that join the batch with zero advantage for a term of the method's own loss
(RL+SFT's cross-entropy rows). Hooks keep JSON-serialisable state, checkpointed with the run.
"""
from __future__ import annotations

import dataclasses
import pathlib
from typing import Any, Callable, ClassVar, Mapping, Protocol, Sequence

import ml_collections

from envs.api import Task
from guijax import objectives
from guijax.data.store import TrajectoryStore
from guijax.rng import Streams
from guijax.rollout.trajectory import Trajectory

Scorer = Callable[[Sequence[Trajectory]], Sequence[float]]


class Hook(Protocol):
    def observe(self, task: Task, rollouts: Sequence[Trajectory]) -> None: ...

    def assemble(self, task: Task, rollouts: Sequence[Trajectory]) -> list[Trajectory]: ...

    def auxiliary(self, task: Task) -> list[Trajectory]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def metrics(self) -> dict[str, float]:
        """Counters since the last call (injections, cache updates), logged with the iteration."""
        ...


class IdentityHook:
    """Train on the on-policy group as it is (GRPO); the base of hooks that change only some of it."""

    def observe(self, task: Task, rollouts: Sequence[Trajectory]) -> None:
        return None

    def assemble(self, task: Task, rollouts: Sequence[Trajectory]) -> list[Trajectory]:
        return list(rollouts)

    def auxiliary(self, task: Task) -> list[Trajectory]:
        return []

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            raise ValueError(f"{type(self).__name__} has no state, got keys {sorted(state)}")

    def metrics(self) -> dict[str, float]:
        return {}


@dataclasses.dataclass(frozen=True)
class Context:
    """What a method may read from its run. The pipeline fills it, so methods never import the pipeline.

    `run_dir` holds the outputs of earlier stages (the method names the ones it reads in `requires`);
    `workdir` is the method's own directory; `streams` its random streams; `expert_traces` loads the
    converted expert traces on first use; `train_tasks` is the training split; `score` is the trainer's mean response log-prob of trajectories
    under the current policy (bound when the trainer builds the hook); `rollout_engine(policy, temperature)`
    builds a rollout engine over the run's environments for methods that roll out before (or instead of) RL;
    `load_policy(path, config)` loads a checkpoint as the run loads its policies (with `config`'s LoRA when it
    trains, the plain model for None)."""

    config: ml_collections.ConfigDict
    run_dir: pathlib.Path
    workdir: pathlib.Path
    streams: Streams
    expert_traces: Callable[[], Mapping[str, Trajectory]] = dict
    train_tasks: Sequence[Task] = ()
    score: Scorer | None = None
    rollout_engine: Callable[[Any, float], Any] | None = None
    # the run's policy loader: (checkpoint directory, config it trains under or None) -> policy
    load_policy: Callable[[pathlib.Path, Any], Any] | None = None


def stage_rollouts(run_dir: pathlib.Path, folder: str, stage: str, method: str) -> list[Trajectory]:
    """The trajectories an earlier stage left in `run_dir / folder`; a missing or empty folder names the stage
    to add before the one that trains `method`."""
    source = run_dir / folder
    if not any(source.glob("*.array_record")):
        raise FileNotFoundError(f"{source} is empty: {method} trains on the {stage} stage's trajectories; add "
                                f"'{stage}' to config.stages before the stage that trains it")
    return list(TrajectoryStore(source))


class Method:
    """A training method. Subclasses set the class attributes and override what differs from GRPO."""

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    section: ClassVar[str | None] = None  # the config section this method owns (its knobs)
    options_class: ClassVar[type | None] = None  # the typed dataclass of that section (guijax.schema)
    requires: ClassVar[tuple[str, ...]] = ()  # stages whose outputs it reads, in any order before it runs
    losses: ClassVar[tuple[str, ...]] = ("grpo",)  # losses it can train with; the first is its default
    normalizations: ClassVar[tuple[str, ...]] = ("token", "sequence")
    rl: ClassVar[bool] = True  # False: trains only in `before_rl` (offline methods, the SFT baseline)

    def __init__(self, config: ml_collections.ConfigDict):
        self.config = config

    @property
    def reads(self) -> tuple[str, ...]:
        """Config sections its results depend on beyond the generic training ones (its own section)."""
        return (self.section,) if self.section else ()

    @property
    def options(self) -> Any:
        """The method's own config section."""
        if self.section is None:
            raise AttributeError(f"method {self.name!r} has no config section")
        return self.config[self.section]

    def validate(self) -> None:
        """Reject a combination this method cannot train with, naming the config key."""
        train = self.config.train
        if train.loss and train.loss not in self.losses:
            raise ValueError(f"method {self.name!r} cannot train with train.loss={train.loss!r}; it uses "
                             f"{' or '.join(repr(x) for x in self.losses)} (or leave train.loss empty for its default)")
        if train.normalization not in self.normalizations:
            raise ValueError(f"method {self.name!r} does not support train.normalization={train.normalization!r}; "
                             f"choose one of {self.normalizations}")

    def loss(self) -> Any:
        return objectives.make_loss(self.config.train.loss or self.losses[0], self.config.train)

    def objective(self) -> objectives.Objective:
        return objectives.Objective(self.loss())

    def hook(self, ctx: Context) -> Hook:
        return IdentityHook()

    def training_tasks(self, ctx: Context, tasks: Sequence[Task]) -> list[Task]:
        """The tasks the RL loop samples from (ARPO keeps its valuable ones)."""
        return list(tasks)

    def before_rl(self, ctx: Context, policy: Any, pipeline: Any) -> None:
        """Training before the RL loop, in place on `policy.params` (SFT baselines, offline methods)."""
        return None

    def describe(self) -> str:
        train = self.config.train
        if not self.rl:
            return self.summary
        return (f"{self.summary}; {train.iterations} iterations of {self.config.rollout.tasks_per_iteration} tasks "
                f"x {self.config.rollout.group_size} episodes, {train.ppo_epochs} PPO epoch(s) each")


@dataclasses.dataclass(frozen=True)
class Round:
    """What one round of a self-rolling method works with: its number, its folder (`<noun>_<index>`, created),
    its random streams, a rollout engine over the run's environments for the current policy, and the writer
    of the method's metrics file."""

    index: int
    folder: pathlib.Path
    streams: Streams
    engine: Any
    writer: Any


def resumable_rounds(ctx: Context, policy: Any, method: str, count: int, noun: str, metrics: str,
                     run_one: Callable[[Round], str], keep: int = 1) -> None:
    """Rounds 1..count of a method that rolls its policy out and trains `policy.params` in place (SGCD's
    rounds, SEAgent's phases): the policy is checkpointed after each in `ctx.workdir/<noun>s` (the newest
    `keep` checkpoints stay), and a rerun restores the last finished one and continues after it.
    `run_one(round)` runs one round (engine at `rollout.temperature`, logging to the `metrics` file) and
    returns its one-line summary."""
    from guijax.checkpoint import Checkpointer
    from guijax.metrics import MetricsWriter
    from guijax.progress import echo

    if ctx.rollout_engine is None:
        raise ValueError(f"{method} rolls its policy out; train it through a recipe's methods or rl stage")
    ckpt = Checkpointer(ctx.workdir / f"{noun}s", keep=keep, async_save=False)
    writer = MetricsWriter(ctx.workdir, metrics, console=False)
    restored = ckpt.restore_latest(policy.params, lambda params, meta: (params, meta))
    done = 0
    if restored is not None:
        done, (policy.params, _) = restored
        echo(f"  {method}: resuming after {noun} {done} of {count}")
    try:
        for r in range(done + 1, count + 1):
            folder = ctx.workdir / f"{noun}_{r}"
            folder.mkdir(parents=True, exist_ok=True)
            engine = ctx.rollout_engine(policy, ctx.config.rollout.temperature)
            summary = run_one(Round(r, folder, ctx.streams.child(noun, r), engine, writer))
            ckpt.save(r, policy.params, {noun: r})
            ckpt.manager.wait_until_finished()
            echo(f"  {method} {noun} {r}/{count}: {summary}")
    finally:
        writer.close()
        ckpt.close()
