"""Rollout engine: G episodes per task over an EnvPool, one batched sampler call per step for all live
episodes, UI-TARS parsing, format penalties, verifier rewards at the end.

Episodes beyond the pool's size run in rounds. An environment failure ends its episode as ENV_ERROR (the
trainer drops it from its group with the logged reason). An unparsable response ends the episode as ARPO's
code ends it: the environment is still evaluated, and the reward is the evaluated score plus the weighted
format reward, score + format_weight * format_reward (ARPO: -1 with weight 0.5), so a task already solved
when the agent wrote garbage keeps score - 0.5 and an unsolved one gets -0.5.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Sequence

import jax
import numpy as np
from absl import logging

from envs.actions import ActionParseError, to_pyautogui
from envs.actions.grammar import parse_response
from envs.actions.model import Action
from envs.api import Task
from envs.pool import EnvPool
from guijax.rollout.identity import params_matcher
from guijax.rollout.prompt import SYSTEM_PROMPT, Turn, build_messages, guided_instruction
from guijax.rollout.trajectory import Status, Step, Trajectory


STOP_TOKENS = ("<|im_end|>", "<|endoftext|>")


def response_text(tokenizer: Any, tokens: np.ndarray) -> str:
    """The response exactly as the model wrote it, minus the stop token. UI-TARS writes coordinates inside
    <|box_start|>…<|box_end|>, which are special tokens: decoding with skip_special_tokens would drop them
    from the history that later prompts replay, while expert and SFT traces keep them, so every step after
    the first would be prompted off the training distribution."""
    ids = [int(t) for t in tokens]
    stops = {tokenizer.convert_tokens_to_ids(t) for t in STOP_TOKENS}
    while ids and ids[-1] in stops:
        ids.pop()
    return tokenizer.decode(ids, skip_special_tokens=False).strip()


def episode_seed(seed: int, task_index: int, member: int) -> int:
    """The environment seed of episode `member` of the `task_index`-th task of a batch drawn with `seed`."""
    return seed * 1_000_003 + task_index * 7919 + member


def _count_env_call(timings: dict[str, float], t0: float, slots: int) -> None:
    """Charge a pool call started at `t0` to the timings: its wall time (`env_s`, what the caller waited) and
    its slot-seconds (`env_slot_s`, how busy the environment workers were)."""
    elapsed = time.perf_counter() - t0
    timings["env_s"] += elapsed
    timings["env_slot_s"] = timings.get("env_slot_s", 0.0) + elapsed * slots


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    max_images: int = 5  # screenshots kept as images in the prompt (K); earlier steps stay as text
    format_reward: float = -1.0  # ARPO's format reward for an unparsable response, added to its evaluated score ...
    format_weight: float = 0.5  # ... with this weight
    coordinate_model: str = "uitars-1.5"
    system_prompt: str = SYSTEM_PROMPT  # a template of guijax.rollout.prompt.PROMPTS (`rollout.prompt`)
    grammar: str = "uitars"  # the action grammar that prompt asks for (envs.actions.grammar)
    show_progress: bool = True
    reset_retries: int = 1  # a failed reset (setup error, crashed worker: the pool restarts it) is retried
    # Longest prompt a step may have (0: no limit): prompt + response must fit the trainer's largest length
    # bucket, so an episode whose history outgrows it ends there, as at the step limit, instead of failing
    # the update that would batch it.
    max_prompt_tokens: int = 0
    # Evaluation protocols that sample an unparsable answer again (SGCD's: up to 10 times, at a reduced
    # temperature): up to `parse_retries` more draws for that step at the temperature times
    # `retry_temperature_decay` (one more temperature: the JAX sampler compiles one more program; a sampler
    # without `with_temperature` redraws at its own). The last draw stands whatever it is; a greedy sampler is
    # not asked again (its answer would not change). 0: an unparsable answer ends the episode, as the RL
    # rollouts need (a redraw would not be on-policy).
    parse_retries: int = 0
    retry_temperature_decay: float = 0.5


@dataclasses.dataclass
class _Episode:
    task: Task
    plan: tuple[str, ...]
    seed: int
    steps: list[Step] = dataclasses.field(default_factory=list)
    turns: list[Turn] = dataclasses.field(default_factory=list)
    screenshot: np.ndarray | None = None
    status: Status = Status.STEP_LIMIT
    error: str | None = None
    reward: float = 0.0
    env_seconds: float = 0.0
    versions: list[int] = dataclasses.field(default_factory=list)  # the policy version that sampled each step
    # Text appended to the instruction (an SGCD skill) from step `handoff` on (0: every step); the steps before
    # are prompted without it, so one episode can switch from the plain policy to the guided one mid-way. An
    # episode continued from another policy's first k steps has handoff k too (guijax.rollout.handoff).
    guidance: str = ""
    handoff: int = 0
    parse_redraws: int = 0  # answers drawn again because they did not parse (RolloutConfig.parse_retries)

    def guided(self) -> bool:
        return bool(self.guidance) and len(self.steps) >= self.handoff


def _generate(sampler: Any, params: Any, key: jax.Array, prompts, inputs: dict[str, Any]) -> Any:
    """One sampler call on encoded `inputs`, the screenshots of `prompts` handed over too to a sampler that
    preprocesses them itself (a serving engine)."""
    if getattr(sampler, "wants_screenshots", False):
        inputs = dict(inputs, images=[images for _, images in prompts])
    return sampler.generate(params, key, **inputs)


class RolloutEngine:
    def __init__(self, pool: EnvPool, sampler: Any, processor: Any, config: RolloutConfig = RolloutConfig()):
        self.pool, self.sampler, self.processor, self.config = pool, sampler, processor, config
        self._synced: Any = None  # tells whether parameters are those a sampler with its own weights holds

    def _sync_weights(self, params: Any, version: int, timings: dict[str, float]) -> None:
        """Hand a sampler that holds its own copy of the weights (guijax.rollout.serving) the parameters it is
        asked to sample with, when they are not those it holds; the push is counted in `weight_sync_s`."""
        if not getattr(self.sampler, "needs_weight_sync", False):
            return
        holds = getattr(self.sampler, "holds", None)  # a sampler whose engine others push to knows what it serves
        if holds(params) if holds is not None else (self._synced is not None and self._synced(params)):
            return
        pushed = self.sampler.sync_weights(params, version)
        self._synced = params_matcher(params)
        timings["weight_sync_s"] = timings.get("weight_sync_s", 0.0) + pushed.seconds
        timings["weight_sync_bytes"] = timings.get("weight_sync_bytes", 0) + pushed.bytes

    def generate(self, params: Any, rng: jax.Array, prompts: Sequence[tuple[str, list[np.ndarray]]],
                 version: int = 0) -> Any:
        """One sampler call for prompts built outside an episode (SEAgent's sampling at stored states): the
        sampler is handed `params` first if it holds weights of its own, and the screenshots if it wants them."""
        self._sync_weights(params, version, {})
        inputs = self.processor([p for p, _ in prompts], [images for _, images in prompts])
        return _generate(self.sampler, params, rng, prompts, inputs)

    def close(self) -> None:
        """Close the sampler, if it holds something to give back (a serving engine's memory)."""
        closer = getattr(self.sampler, "close", None)
        if closer is not None:
            closer()

    def _prompt(self, ep: _Episode) -> tuple[str, list[np.ndarray]]:
        instruction = guided_instruction(ep.task.instruction, ep.guidance if ep.guided() else "")
        messages, images = build_messages(instruction, ep.turns, ep.screenshot,
                                          max_images=self.config.max_images, plan=ep.plan,
                                          system_prompt=self.config.system_prompt, grammar=self.config.grammar)
        return self.processor.apply_chat_template(messages), images

    def run(self, params: Any, tasks: Sequence[Task], group_size: int, rng: jax.Array,
            plans: dict[str, Sequence[str]] | None = None, seed: int = 0,
            desc: str = "rollouts", version: int = 0) -> tuple[list[Trajectory], dict[str, float]]:
        """All G*len(tasks) episodes; returns trajectories in (task, g) order and timing metrics. `desc` names
        the episodes' progress bar; `version` is the policy version `params` are (recorded on each step)."""
        plans = plans or {}
        episodes = [_Episode(t, tuple(plans.get(t.id, ())), episode_seed(seed, i, g))
                    for i, t in enumerate(tasks) for g in range(group_size)]
        return self.run_episodes(params, episodes, rng, desc, version=version)

    def run_episodes(self, params: Any, episodes: Sequence[_Episode], rng: jax.Array, desc: str = "rollouts",
                     start: Any = None, version: int = 0) -> tuple[list[Trajectory], dict[str, float]]:
        """Run prepared episodes (`episode(...)`, possibly with guidance, a handoff step or a history already
        taken) in rounds of the pool's size; `start(episodes by slot, timings)` puts each round's episodes on
        their slots and returns those that started (default: reset each to its task)."""
        from guijax.progress import Progress

        begin = self.start if start is None else start
        episodes = list(episodes)
        timings = {"env_s": 0.0, "sample_s": 0.0, "steps": 0, "sampled_tokens": 0, "weight_sync_s": 0.0,
                   "weight_sync_bytes": 0}
        bar = Progress(len(episodes), desc, "episode", transient=True) if self.config.show_progress else None
        start = time.perf_counter()
        successes = 0
        for first in range(0, len(episodes), self.pool.num_workers):
            round_eps = episodes[first:first + self.pool.num_workers]
            rng, key = jax.random.split(rng)
            self._run_round(params, round_eps, key, timings, begin, version)
            successes += sum(e.reward > 0.5 for e in round_eps)
            if bar is not None:
                bar.update(len(round_eps), success=f"{successes}/{first + len(round_eps)}",
                           env_steps_per_s=f"{timings['steps'] / max(time.perf_counter() - start, 1e-9):.1f}")
        if bar is not None:
            bar.close()
        timings["wall_s"] = time.perf_counter() - start
        return [self.trajectory(e) for e in episodes], timings

    def _run_round(self, params, eps: list[_Episode], rng, timings, start, version: int = 0) -> None:
        live = start(dict(enumerate(eps)), timings)
        while live:
            rng = self.advance(params, live, rng, timings, version)

    def reset(self, tasks: Sequence[Task], slots: Sequence[int], seeds: Sequence[int] | None = None) -> dict:
        """Set `tasks` up on `slots` (with `seeds`), failed resets retried `reset_retries` times with a warning
        naming them; slot -> envs.pool.Result."""
        tasks, slots = list(tasks), list(slots)
        reset = self.pool.reset(tasks, slots=slots, seeds=seeds)
        for attempt in range(self.config.reset_retries):
            failed = [i for i, slot in enumerate(slots) if not reset[slot].ok]
            if not failed:
                break
            logging.warning("retrying %d failed environment reset(s) (attempt %d): %s", len(failed), attempt + 1,
                            "; ".join(f"{tasks[i].id}: {reset[slots[i]].error}" for i in failed)[:500])
            reset.update(self.pool.reset([tasks[i] for i in failed], slots=[slots[i] for i in failed],
                                         seeds=None if seeds is None else [seeds[i] for i in failed]))
        return reset

    def start(self, eps: dict[int, _Episode], timings: dict[str, float]) -> dict[int, _Episode]:
        """Reset each episode on its slot (`reset`); returns those that started, by slot. The others end as
        ENV_ERROR with the reset's error."""
        slots = list(eps)
        t0 = time.perf_counter()
        reset = self.reset([eps[s].task for s in slots], slots, [eps[s].seed for s in slots])
        _count_env_call(timings, t0, len(slots))
        live: dict[int, _Episode] = {}
        for slot, e in eps.items():
            if reset[slot].ok:
                e.screenshot = reset[slot].value.screenshot
                live[slot] = e
            else:
                e.status, e.error = Status.ENV_ERROR, reset[slot].error
        return live

    def advance(self, params: Any, live: dict[int, _Episode], rng: jax.Array, timings: dict[str, float],
                version: int = 0) -> jax.Array:
        """One step of every live episode: one sampler call for all of them, parse, one pool step, and the
        evaluation of those that ended (they leave `live`). Each new step is marked as sampled by policy
        `version`. Returns the advanced key."""
        rng, actions, ending = self.sample(params, live, rng, timings, version)
        self.act(live, actions, ending, timings)
        return rng

    def act(self, live: dict[int, _Episode], actions: dict[int, list[Action]], ending: list[int],
            timings: dict[str, float]) -> None:
        """The environment's half of a step for the episodes of `live`, as `sample` left them: one pool step
        of those with `actions`, then the evaluation of those that ended (they leave `live`)."""
        if actions:
            t0 = time.perf_counter()
            results = self.pool.step(actions)
            _count_env_call(timings, t0, len(actions))
            timings["steps"] += len(actions)
            for slot, result in results.items():
                outcome = self.record(live[slot], actions[slot], result)
                if outcome == "failed":
                    del live[slot]
                elif outcome == "ended":
                    ending.append(slot)
        self._evaluate(live, ending, timings)

    def sample(self, params: Any, live: dict[int, _Episode], rng: jax.Array, timings: dict[str, float],
               version: int = 0) -> tuple[jax.Array, dict[int, list[Action]], list[int]]:
        """The policy's half of a step for every episode in `live`: one sampler call, each response recorded
        (as sampled by policy `version`) and parsed. Returns the advanced key, the parsed actions by slot, and
        the slots that end here without a step, to be evaluated: an unparsable response, or a prompt over
        `max_prompt_tokens` (not sampled). Every slot of `live` is in exactly one of the two."""
        ending: list[int] = []
        slots = sorted(live)
        while slots:
            prompts = [self._prompt(live[s]) for s in slots]
            inputs = self.processor([p for p, _ in prompts], [imgs for _, imgs in prompts])
            if self.config.max_prompt_tokens:
                lengths = np.asarray(inputs["attention_mask"]).sum(-1)
                over = {s: int(n) for s, n in zip(slots, lengths) if n > self.config.max_prompt_tokens}
                if over:
                    self._end_overlong(live, over)
                    ending += list(over)
                    slots = [s for s in slots if s not in over]
                    continue  # re-encode the episodes still running
            break
        if not slots:
            return rng, {}, ending
        self._sync_weights(params, version, timings)
        rng, actions, unparsed = self._draw(self.sampler, params, live, slots, prompts, inputs, rng, timings,
                                            version)
        prompt_of = dict(zip(slots, prompts))  # a redraw is prompted as the draw it replaces
        base = getattr(getattr(self.sampler, "config", None), "temperature", 1.0)
        for attempt in range(1, self.config.parse_retries + 1):
            if not unparsed or base <= 0:
                break
            for slot in unparsed:  # the unparsable answer is dropped, as if never sampled
                e = live[slot]
                e.steps.pop()
                e.versions.pop()
                e.status, e.error = Status.STEP_LIMIT, None
                e.parse_redraws += 1
            timings["parse_redraws"] = timings.get("parse_redraws", 0) + len(unparsed)
            colder = getattr(self.sampler, "with_temperature", None)
            sampler = colder(base * self.config.retry_temperature_decay) if colder else self.sampler
            prompts = [prompt_of[s] for s in unparsed]
            inputs = self.processor([p for p, _ in prompts], [imgs for _, imgs in prompts])
            rng, more, unparsed = self._draw(sampler, params, live, unparsed, prompts, inputs, rng, timings,
                                             version)
            actions.update(more)
        return rng, actions, ending + unparsed

    def _draw(self, sampler: Any, params: Any, live: dict[int, _Episode], slots: list[int], prompts, inputs,
              rng: jax.Array, timings: dict[str, float], version: int
              ) -> tuple[jax.Array, dict[int, list[Action]], list[int]]:
        """One sampler call for `slots`, each answer recorded as a step and parsed: (the advanced key, the
        parsed actions by slot, the slots whose answer did not parse, marked PARSE_ERROR)."""
        rng, key = jax.random.split(rng)
        t0 = time.perf_counter()
        out = _generate(sampler, params, key, prompts, inputs)
        timings["sample_s"] += time.perf_counter() - t0
        timings["sampled_tokens"] += int(out.lengths.sum())
        actions: dict[int, list[Action]] = {}
        unparsed: list[int] = []
        for row, slot in enumerate(slots):
            e = live[slot]
            tokens = out.tokens[row, :out.lengths[row]].copy()
            text = response_text(self.processor.tokenizer, tokens)
            step = Step(e.screenshot, text, tokens.astype(np.int32), out.logprobs[row, :out.lengths[row]].copy())
            e.steps.append(step)
            e.versions.append(version)
            try:
                parsed = parse_response(text, grammar=self.config.grammar, screen_hw=e.screenshot.shape[:2],
                                        coordinate_model=self.config.coordinate_model)
                step.actions = [to_pyautogui(parsed)]
                actions[slot] = parsed
            except (ActionParseError, ValueError) as err:
                step.error = str(err)
                e.status, e.error = Status.PARSE_ERROR, f"step {len(e.steps)}: {err}"
                unparsed.append(slot)  # ends here, unstepped, and is evaluated (unless drawn again)
        return rng, actions, unparsed

    @staticmethod
    def record(e: _Episode, actions: list[Action], result: Any) -> str:
        """Apply one environment step's result to its episode: "running", "ended" (done: to be evaluated) or
        "failed" (the environment failed: ENV_ERROR, not evaluated)."""
        if not result.ok:
            e.status, e.error = Status.ENV_ERROR, result.error
            return "failed"
        e.turns.append(Turn(e.screenshot, e.steps[-1].response))
        e.screenshot = result.value.observation.screenshot
        if not result.value.done:
            return "running"
        kinds = {a.kind.value for a in actions}
        e.status = Status.DONE if "finished" in kinds else Status.FAIL if kinds & {"fail", "call_user"} \
            else Status.STEP_LIMIT
        return "ended"

    def step_one(self, slot: int, e: _Episode, actions: list[Action] | None, timings: dict[str, float]) -> bool:
        """The environment's half of one episode's step, on its own: step its slot with `actions` (None: the
        episode ends unstepped, see `sample`) and evaluate it if it ended. Returns whether it ended. Calls for
        different slots may run at once, in different threads."""
        if actions is not None:
            t0 = time.perf_counter()
            result = self.pool.step({slot: actions})[slot]
            _count_env_call(timings, t0, 1)
            timings["steps"] = timings.get("steps", 0) + 1
            outcome = self.record(e, actions, result)
            if outcome != "ended":
                return outcome == "failed"
        self._evaluate({slot: e}, [slot], timings)
        return True

    def _evaluate(self, live: dict[int, _Episode], slots: list[int], timings) -> None:
        """End the episodes in `slots` with the environment's evaluation as their reward. An unparsable last
        response adds the weighted format reward to the evaluated score, as ARPO's code does: its env worker
        turns a parse failure into format_reward = -1 and a DONE step (dvlab-research/ARPO,
        verl/trainer/gui_agent.py, EnvWorker.step), the trainer still evaluates that environment and rewards
        `eval_results + 0.5 * format_rewards` (verl/trainer/ray_trainer.py, the "reward" block of fit). DONE
        changes nothing on the desktop, so the evaluation here runs without stepping the environment."""
        if not slots:
            return
        t0 = time.perf_counter()
        scores = self.pool.evaluate(slots)
        _count_env_call(timings, t0, len(slots))
        for slot in slots:
            e = live.pop(slot)
            if not scores[slot].ok:
                reason = scores[slot].error
                e.status = Status.ENV_ERROR
                e.error = f"{e.error}; then evaluation failed: {reason}" if e.error else reason
                continue
            e.reward = float(scores[slot].value)
            if e.status == Status.PARSE_ERROR:
                e.reward += self.config.format_weight * self.config.format_reward

    def _end_overlong(self, live: dict[int, _Episode], over: dict[int, int]) -> None:
        for slot, n in over.items():
            e = live[slot]
            e.status = Status.STEP_LIMIT
            e.error = (f"step {len(e.steps) + 1}: prompt of {n} tokens exceeds max_prompt_tokens="
                       f"{self.config.max_prompt_tokens}; episode ended as at the step limit")

    @staticmethod
    def episode(task: Task, seed: int, plan: Sequence[str] = (), guidance: str = "", handoff: int = 0) -> _Episode:
        return _Episode(task, tuple(plan), seed, guidance=guidance, handoff=handoff)

    @staticmethod
    def trajectory(e: _Episode) -> Trajectory:
        """The episode as training reads it: the plain instruction (guidance is rollout-time context only);
        `meta['handoff']` records the step from which another policy or the guidance took over."""
        meta: dict[str, Any] = {"seed": e.seed, "domain": e.task.domain}
        if e.handoff:
            meta["handoff"] = e.handoff
        if e.guidance:
            meta["guided"] = True
        if e.parse_redraws:
            meta["parse_redraws"] = e.parse_redraws
        return Trajectory(e.task.id, e.task.instruction, e.steps, e.reward, e.status, plan=e.plan, error=e.error,
                          meta=meta)
