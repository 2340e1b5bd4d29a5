"""Handoff rollouts: one policy acts the first k steps of an episode, then a policy (another model, or the same
one with guidance in its context) continues from exactly the state those steps reached. SGCD builds its
continuations this way (Stage III) and measures its Continuation Success Rate.

Running every depth k from a fresh reset, as the SGCD paper does, re-runs the prefix once per depth. Here a
prefix is run once, up to the deepest k, and every depth branches from it:

- `snapshot`: the environment saves its whole state after every prefix step and restores it on any slot
  (`snapshot()` / `restore(state)`, which the synthetic desk has);
- `replay`: the slot is reset with the prefix's seed and the prefix's actions are stepped again; each
  screenshot reached must equal the one the prefix saw (within `replay_tolerance` mean absolute difference
  per pixel), otherwise the branch ends as ENV_ERROR naming the step that diverged. For environments without
  snapshots whose state follows from their actions (a local Xvfb desktop).

`live` (the paper's way) needs no prefix: each depth is one episode from a reset in which the guidance starts
at step k (`RolloutEngine.episode(..., guidance=..., handoff=k)`); the prefix is then sampled once per depth and
the prefix and the continuation share one set of parameters.

A prefix ends where its policy ends the episode (its own DONE / FAIL / CALL_USER, or an unparsable answer), so a
policy that stops right after its first wrong step leaves no state deeper than k = 1. `stop_retries` samples
such an answer again (the environment is not stepped in between), so the prefix is the policy's behaviour
given that it keeps acting for k steps, which is what a handoff at depth k asks of it.
"""
from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Mapping, Sequence

import jax
import numpy as np

from envs.actions import ActionParseError
from envs.actions.model import TERMINAL_TYPES
from envs.actions.grammar import convert_response, parse_response
from envs.api import Task
from guijax.rollout.engine import RolloutEngine, _count_env_call, _Episode, episode_seed
from guijax.rollout.prompt import Turn
from guijax.rollout.trajectory import Status, Step, Trajectory

BRANCHING = ("snapshot", "replay", "live")


@dataclasses.dataclass
class Prefix:
    """The first steps of one episode of the prefix policy, with what every depth needs to branch from it.

    `screens[j]` and `states[j]` are the screenshot and (snapshot branching) the environment state after j
    steps; `open_steps` counts the steps after which the episode was still running (a depth k can branch only
    if k <= open_steps: after the agent's own DONE / FAIL, or an unparsable response, there is nothing to
    continue)."""

    task: Task
    seed: int
    steps: list[Step] = dataclasses.field(default_factory=list)
    turns: list[Turn] = dataclasses.field(default_factory=list)
    screens: list[np.ndarray] = dataclasses.field(default_factory=list)
    states: list[Any] = dataclasses.field(default_factory=list)
    open_steps: int = 0
    error: str | None = None
    grammar: str = ""  # the grammar the prefix policy wrote in ("": the continuing engine's)
    coordinate_model: str = "uitars-1.5"
    resampled: int = 0  # answers that would have ended the prefix, sampled again (`stop_retries`)

    def depths(self, ks: Sequence[int]) -> list[int]:
        """The depths of `ks` this prefix can hand off at."""
        return [k for k in ks if 1 <= k <= self.open_steps]


def _parsed(step: Step, screen_hw: tuple[int, int], model: str, grammar: str):
    return parse_response(step.response, grammar=grammar, screen_hw=screen_hw, coordinate_model=model)


class HandoffRunner:
    """Prefixes of one policy and continuations of another from every depth, over a `RolloutEngine`."""

    def __init__(self, engine: RolloutEngine, branching: str = "snapshot", replay_tolerance: float = 0.0):
        if branching not in BRANCHING:
            raise ValueError(f"handoff branching {branching!r} is not one of {', '.join(BRANCHING)}")
        self.engine, self.branching, self.replay_tolerance = engine, branching, replay_tolerance

    @property
    def pool(self):
        return self.engine.pool

    # ------------------------------------------------------------------ prefixes
    def prefixes(self, params: Any, tasks: Sequence[Task], max_depth: int, rng: jax.Array, seed: int = 0,
                 desc: str = "handoff prefixes", stop_retries: int = 0) -> list[Prefix]:
        """One prefix per task: the policy of `params` acts up to `max_depth` steps (no guidance); with
        snapshot branching the environment's state is saved after each step. An answer that would end the
        episode is sampled again up to `stop_retries` times per step before it is taken."""
        if self.branching == "live":
            raise ValueError("live handoff runs each depth from a reset and keeps no prefix; use snapshot or replay "
                             "branching to continue another policy's prefix")
        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth}")
        if stop_retries < 0:
            raise ValueError(f"stop_retries must be >= 0, got {stop_retries}")
        c = self.engine.config
        out = [Prefix(t, episode_seed(seed, i, 0), grammar=c.grammar, coordinate_model=c.coordinate_model)
               for i, t in enumerate(tasks)]
        timings = {"env_s": 0.0, "sample_s": 0.0, "steps": 0, "sampled_tokens": 0}
        for first in range(0, len(out), self.pool.num_workers):
            rng, key = jax.random.split(rng)
            self._prefix_round(params, out[first:first + self.pool.num_workers], max_depth, key, timings,
                               stop_retries)
        return out

    def _prefix_round(self, params, prefixes: list[Prefix], max_depth: int, rng, timings, stop_retries: int) -> None:
        eps = {slot: self.engine.episode(p.task, p.seed) for slot, p in enumerate(prefixes)}
        live = self.engine.start(dict(eps), timings)
        for slot, p in enumerate(prefixes):
            if slot not in live:
                p.error = eps[slot].error
        self._record(prefixes, eps, list(live), timings)
        while live:
            rng = self._advance(params, live, prefixes, rng, timings, stop_retries)
            for slot, e in eps.items():
                p = prefixes[slot]
                p.steps, p.turns = list(e.steps), list(e.turns)
                if slot not in live and e.status == Status.ENV_ERROR:
                    p.error = e.error
            self._record(prefixes, eps, list(live), timings)
            for slot in [s for s in live if len(eps[s].steps) >= max_depth]:
                del live[slot]  # deep enough: the slot is simply reset or restored by the next call

    def _advance(self, params, live: dict[int, _Episode], prefixes: list[Prefix], rng: jax.Array, timings,
                 retries: int) -> jax.Array:
        """One prefix step of every live episode, as `RolloutEngine.advance`, except that an answer that would
        end the episode (a terminal action, or unparsable) is dropped and sampled again, up to `retries` times;
        the last draw is taken whatever it is. An engine that draws unparsable answers again itself
        (`parse_retries`) is left to: only terminal actions are redrawn here then."""
        engine = self.engine
        rng, actions, ending = engine.sample(params, live, rng, timings)
        redraws_unparsed = not engine.config.parse_retries  # else the engine has drawn them again already
        for _ in range(retries):
            again = [s for s in ending if live[s].status == Status.PARSE_ERROR] if redraws_unparsed else []
            again += [s for s, acts in actions.items() if any(a.kind in TERMINAL_TYPES for a in acts)]
            if not again:
                break
            for slot in again:
                e = live[slot]
                e.steps.pop()
                e.versions.pop()
                e.status, e.error = Status.STEP_LIMIT, None
                actions.pop(slot, None)
                prefixes[slot].resampled += 1
            ending = [s for s in ending if s not in again]
            rng, more, more_ending = engine.sample(params, {s: live[s] for s in again}, rng, timings)
            actions.update(more)
            ending += more_ending
        engine.act(live, actions, ending, timings)
        return rng

    def _record(self, prefixes: list[Prefix], eps: dict[int, _Episode], slots: list[int], timings) -> None:
        """After the latest step of the episodes still running on `slots`: their screenshot and state."""
        for slot in slots:
            prefixes[slot].screens.append(eps[slot].screenshot)
            prefixes[slot].open_steps = len(eps[slot].steps)
        if self.branching != "snapshot" or not slots:
            return
        t0 = time.perf_counter()
        saved = self.pool.call("snapshot", {s: () for s in slots})
        _count_env_call(timings, t0, len(slots))
        for slot in slots:
            if saved[slot].ok:
                prefixes[slot].states.append(saved[slot].value)
            else:
                raise RuntimeError(f"snapshot branching: the environment of task {prefixes[slot].task.id} cannot "
                                   f"save its state ({saved[slot].error.splitlines()[0]}); use replay branching")

    # ------------------------------------------------------------------ continuations
    def continue_from(self, params: Any, prefixes: Sequence[Prefix], depths: Sequence[int], rng: jax.Array,
                      guidance: Mapping[str, str] | None = None, per_state: int = 1,
                      desc: str = "continuations") -> list[Trajectory]:
        """For every prefix and every depth k it reaches: `per_state` episodes that take the prefix's first k
        steps as history and continue with the policy of `params` (with the task's guidance, when given, from
        step k on). Trajectories hold all steps; `meta['handoff']` is k. Order: prefix, depth, member."""
        guidance = guidance or {}
        eps: list[_Episode] = []
        sources: dict[int, tuple[Prefix, int]] = {}  # id(episode) -> where it branches from
        for p in prefixes:
            for k in p.depths(depths):
                for _ in range(per_state):
                    # the environment's state (pop-ups to come included) follows the prefix's seed, so the
                    # continuation replays from a reset with it
                    e = self.engine.episode(p.task, p.seed, guidance=guidance.get(p.task.id, ""), handoff=k)
                    e.steps, e.turns, e.screenshot = list(p.steps[:k]), self._shown(p, k), p.screens[k]
                    e.versions = [0] * k
                    sources[id(e)] = (p, k)
                    eps.append(e)
        if not eps:
            return []
        start = functools.partial(self._restore if self.branching == "snapshot" else self._replay, sources)
        trajectories, _ = self.engine.run_episodes(params, eps, rng, desc, start=start)
        return trajectories

    def _shown(self, prefix: Prefix, k: int) -> list[Turn]:
        """The prefix's first k turns as the continuing policy is shown them: rewritten into its grammar when
        the prefix policy wrote another (a baseline prompted otherwise continuing the plain policy's episode);
        the trajectory keeps the steps as they were written."""
        target = self.engine.config
        if not prefix.grammar or (prefix.grammar, prefix.coordinate_model) == (target.grammar,
                                                                              target.coordinate_model):
            return list(prefix.turns[:k])
        return [Turn(t.screenshot, convert_response(t.response, source=prefix.grammar, target=target.grammar,
                                                    screen_hw=t.screenshot.shape[:2],
                                                    coordinate_model=prefix.coordinate_model,
                                                    target_coordinate_model=target.coordinate_model))
                for t in prefix.turns[:k]]

    def _restore(self, sources, eps: dict[int, _Episode], timings) -> dict[int, _Episode]:
        t0 = time.perf_counter()
        restored = self.pool.call("restore", {s: (sources[id(e)][0].states[sources[id(e)][1]],)
                                              for s, e in eps.items()})
        _count_env_call(timings, t0, len(eps))
        live = {}
        for slot, e in eps.items():
            if restored[slot].ok:
                e.screenshot = restored[slot].value.screenshot
                live[slot] = e
            else:
                e.status, e.error = Status.ENV_ERROR, f"restoring the state after step {e.handoff}: {restored[slot].error}"
        return live

    def _replay(self, by_episode, eps: dict[int, _Episode], timings) -> dict[int, _Episode]:
        sources = {s: by_episode[id(e)] for s, e in eps.items()}
        reset_eps = {s: self.engine.episode(p.task, p.seed) for s, (p, _) in sources.items()}
        live = {s: eps[s] for s in self.engine.start(reset_eps, timings)}
        for slot in set(eps) - set(live):
            eps[slot].status, eps[slot].error = Status.ENV_ERROR, f"replay: reset failed: {reset_eps[slot].error}"
        for slot in list(live):
            self._check_screen(live, slot, sources[slot][0], 0, reset_eps[slot].screenshot)
        depth = max((k for _, k in sources.values()), default=0)
        for j in range(1, depth + 1):
            actions = {}
            for slot in [s for s in live if sources[s][1] >= j]:
                p = sources[slot][0]
                try:
                    actions[slot] = _parsed(p.steps[j - 1], p.screens[j - 1].shape[:2],
                                            p.coordinate_model if p.grammar else self.engine.config.coordinate_model,
                                            p.grammar or self.engine.config.grammar)
                except (ActionParseError, ValueError) as err:
                    self._fail(live, slot, f"replay: step {j} of the prefix no longer parses: {err}")
            if not actions:
                continue
            t0 = time.perf_counter()
            results = self.pool.step(actions)
            _count_env_call(timings, t0, len(actions))
            for slot, r in results.items():
                if not r.ok:
                    self._fail(live, slot, f"replay: step {j} failed: {r.error}")
                elif r.value.done:
                    self._fail(live, slot, f"replay: the environment ended the episode at step {j}, which the "
                                           "prefix did not")
                else:
                    self._check_screen(live, slot, sources[slot][0], j, r.value.observation.screenshot)
        for slot, e in live.items():
            e.screenshot = sources[slot][0].screens[sources[slot][1]]
        return live

    def _check_screen(self, live: dict[int, _Episode], slot: int, prefix: Prefix, j: int, screen: np.ndarray) -> None:
        if slot not in live:
            return
        want = prefix.screens[j]
        same = screen.shape == want.shape and (
            float(np.abs(screen.astype(np.int16) - want.astype(np.int16)).mean()) <= self.replay_tolerance)
        if not same:
            self._fail(live, slot, f"replay diverged from the prefix of task {prefix.task.id} at step {j}: the "
                                   "screen differs from the one the prefix saw")

    @staticmethod
    def _fail(live: dict[int, _Episode], slot: int, error: str) -> None:
        e = live.pop(slot)
        e.status, e.error = Status.ENV_ERROR, error
