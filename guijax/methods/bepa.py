"""BEPA (bepa.txt) and its ablations. LEVEL-2 (§4.2, Algorithm 2): a per-task cache holding one successful
trajectory.

After a group with at least one success the cache is refreshed with U(successes); when a group has no
success and the cache is non-empty, the group's FIRST failed trajectory is replaced by the cached one,
re-encoded under the plain instruction (no plan). Its π_old log-probs are not carried over: the trainer
computes old log-probs of every row under the current θ_old, which is what separates BEPA from LUFFY's
constant off-policy probabilities. The cache is seeded by LEVEL-1's self-rolled successes (D_self).

Methods: `bepa` (LEVEL-1 seeds, refreshed by own successes), `level1_only` (the static LEVEL-1 ablation:
D_self only, never updated), `level2_only` (seeded by the converted expert traces D_conv, refreshed).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Literal, Sequence

from envs.api import Task
from guijax.data.store import TrajectoryStore
from guijax.methods.base import Context, IdentityHook, Method, Scorer
from guijax.methods.persist import TrajectoryBank
from guijax.rng import Streams
from guijax.schema import ranged
from guijax.rollout.trajectory import Source, Trajectory

UPDATE_RULES = ("random", "logprob", "shortest")


@dataclasses.dataclass(frozen=True)
class BEPAOptions:
    """`bepa`: the BEPA methods' knobs and those of the stages they read (expert, bepa_splits, level1)."""

    update_rule: Literal["random", "logprob", "shortest"] = "random"  # U: the paper's default is random
    plan_extractor: Literal["rule", "chat"] = "rule"  # chat: an OpenAI-compatible model (never used in tests)
    plan_url: str = ""
    plan_model: str = "gpt-4o"
    plan_api_key_env: str = "OPENAI_API_KEY"
    expert_dir: str = ""  # folders of recorded expert traces (trace.json + PNGs); empty: the scripted desk expert
    expert_noise: float = ranged(0.0, low=0, high=1)  # scripted expert: chance of a wrong or missed action
    # D_conv's thoughts: terse (the SFT warm start's voice) | verbose (a framework worker's narration, which
    # the base policy has never seen: the expert-to-policy distribution gap of BEPA §3)
    conversion_thoughts: Literal["terse", "verbose"] = "terse"
    base_pass_k: int = ranged(5, low=1)  # level1 / bepa_splits: plain base-policy rollouts per task
    level1_rollouts: int = ranged(1, low=1)  # level1: plan-conditioned rollouts per task
    train_fraction: float = ranged(0.8, low=0, high=1)  # bepa_splits: share of the solvable pool that trains
    extra_train_tasks: int = ranged(8, low=0)  # bepa_splits: unsolvable tasks added to the training split


class CacheHook(IdentityHook):
    def __init__(self, update_rule: str = "random", seed: int = 0, store: TrajectoryStore | None = None,
                 scorer: Scorer | None = None, refresh: bool = True):
        """update_rule U: random (the paper's default), logprob (highest mean token log-prob under the current
        policy; needs `scorer`, which the trainer provides) or shortest (fewest steps, then fewest tokens).
        refresh=False never changes the cache after seeding: no refresh, and no entry for a task without a
        seed (the static LEVEL-1 ablation keeps D_self only)."""
        if update_rule not in UPDATE_RULES:
            raise ValueError(f"unknown BEPA update_rule {update_rule!r}; choose one of {UPDATE_RULES}")
        self.update_rule, self.seed, self.scorer, self.refresh = update_rule, seed, scorer, refresh
        self.draws = 0
        self.cache: dict[str, Trajectory] = {}
        self.bank = TrajectoryBank(store)
        self._updates = self._injections = self._groups = 0

    def seed_cache(self, trajectories: Iterable[Trajectory]) -> int:
        """LEVEL-1: cache the first verified success of each task (plan-conditioned self-rolls)."""
        added = 0
        for t in trajectories:
            if t.success and t.task_id not in self.cache:
                self.cache[t.task_id] = t
                added += 1
        return added

    def _choose(self, successes: list[Trajectory]) -> Trajectory:
        if self.update_rule == "shortest":
            return min(successes, key=lambda t: (len(t.steps), t.num_tokens))
        if self.update_rule == "logprob":
            if self.scorer is None:
                raise ValueError("BEPA update_rule='logprob' needs a scorer (the trainer provides one)")
            scores = list(self.scorer(successes))
            return successes[max(range(len(successes)), key=scores.__getitem__)]
        self.draws += 1
        return Streams(self.seed).python("draw", self.draws).choice(successes)

    def observe(self, task: Task, rollouts: Sequence[Trajectory]) -> None:
        self._groups += 1
        successes = [t for t in rollouts if t.success and t.source == Source.ON_POLICY]
        if successes and self.refresh:
            self.cache[task.id] = self._choose(successes)
            self._updates += 1

    def assemble(self, task: Task, rollouts: Sequence[Trajectory]) -> list[Trajectory]:
        group = list(rollouts)
        cached = self.cache.get(task.id)
        if not group or cached is None or any(t.success for t in group):
            return group
        group[0] = dataclasses.replace(cached.without_plan(), source=Source.CACHE)  # Eq. (3): replaces τ_{x,1}
        self._injections += 1
        return group

    def metrics(self) -> dict[str, float]:
        """Per iteration: how often the cache was refreshed and injected (BEPA logs the update frequency)."""
        groups = max(self._groups, 1)
        out = {"cache_size": float(len(self.cache)), "cache_updates": float(self._updates),
               "cache_update_frequency": self._updates / groups, "cache_injections": float(self._injections)}
        self._updates = self._injections = self._groups = 0
        return out

    def state_dict(self) -> dict[str, Any]:
        refs = self.bank.refs(self.cache.values())
        return {"draws": self.draws, "cache": {k: refs[id(t)] for k, t in self.cache.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.draws = int(state["draws"])
        self.cache = {k: self.bank.load(i) for k, i in state["cache"].items()}


class BEPA(Method):
    name = "bepa"
    summary = "BEPA: LEVEL-1 self-rolled seeds (D_self) in a per-task cache refreshed by own successes"
    section = "bepa"
    options_class = BEPAOptions
    requires = ("level1",)
    refresh = True

    def seeds(self, ctx: Context) -> Iterable[Trajectory]:
        directory = ctx.run_dir / "level1_trajectories"
        if not directory.exists():
            raise FileNotFoundError(f"{self.name} seeds its cache from {directory}: add the 'level1' stage to "
                                    "config.stages before the stage that trains it")
        return TrajectoryStore(directory)

    def hook(self, ctx: Context) -> CacheHook:
        hook = CacheHook(self.options.update_rule, seed=ctx.streams.seed_for("cache"),
                         store=TrajectoryStore(ctx.workdir / "algorithm_trajectories"), scorer=ctx.score,
                         refresh=self.refresh)
        hook.seed_cache(self.seeds(ctx))
        return hook


class Level1Only(BEPA):
    name = "level1_only"
    summary = "LEVEL-1 only: the D_self cache, never updated (static)"
    refresh = False


class Level2Only(BEPA):
    name = "level2_only"
    summary = "LEVEL-2 only: a cache seeded by the converted expert traces D_conv, refreshed by own successes"
    requires = ("expert",)

    def seeds(self, ctx: Context) -> Iterable[Trajectory]:
        return ctx.expert_traces().values()
