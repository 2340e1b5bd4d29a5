"""The RL loop shared by every method: sample tasks -> rollouts -> the method's hook assembles groups ->
the objective's advantages -> old log-probs under θ_old (and reference log-probs when the loss has a KL
term) -> minibatch updates for `ppo_epochs` -> metrics, checkpoints. It names no method: a method reaches it
as a hook factory and an `objectives.Objective`.

Every iteration draws its tasks, environment seeds and sampling key from named streams of (seed, iteration),
so a run resumed from a checkpoint repeats exactly the iterations an uninterrupted run would have done.
"""
from __future__ import annotations

import dataclasses
import pathlib
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging

from envs.api import Task
from guijax import accumulation, compile_stats, objectives, optim, sharding, train_step
from guijax.checkpoint import Checkpointer
from guijax.data.pipeline import PipelineConfig, make_dataset, step_refs
from guijax.data.store import SUFFIX as STORE_SUFFIX, TrajectoryStore
from guijax.metrics import MetricsWriter
from guijax.models.policy import Policy
from guijax.models.trained import TrainedPart
from guijax.progress import Progress
from guijax.rng import Streams
from guijax.rollout.backend import make_sampler
from guijax.rollout.engine import RolloutConfig, RolloutEngine, episode_seed
from guijax.rollout.prompt import grammar_of
from guijax.rollout.stream import RolloutStream, group_index, sampling_version, shard_name
from guijax.rollout.trajectory import Status, Trajectory
from guijax.sampling import SamplingConfig, images_padded_with_rows
from guijax.sft import device_batch

Scorer = Callable[[Sequence[Trajectory]], list[float]]


class TrainingError(RuntimeError):
    pass


def _compress(indices: set[int]) -> dict[str, Any]:
    """A set of group indices as {"below": n, "also": [...]}: every index < n, plus the listed ones."""
    below = 0
    while below in indices:
        below += 1
    return {"below": below, "also": sorted(i for i in indices if i > below)}


def _expand(saved: dict[str, Any]) -> set[int]:
    return set(range(int(saved.get("below", 0)))) | {int(i) for i in saved.get("also", ())}


def rollout_config(config: ml_collections.ConfigDict, system_prompt: str) -> RolloutConfig:
    """The engine settings of a run; a step's prompt plus its longest response must fit the largest
    training length bucket."""
    r = config.rollout
    if max(config.pipeline.length_buckets) <= r.max_new_tokens:
        raise ValueError(f"pipeline.length_buckets (largest {max(config.pipeline.length_buckets)}) leave no room for a "
                         f"prompt beside rollout.max_new_tokens={r.max_new_tokens}")
    return RolloutConfig(max_images=r.max_images, format_reward=r.format_reward, format_weight=r.format_weight,
                         system_prompt=system_prompt, grammar=grammar_of(r.prompt), coordinate_model=r.coordinate_model,
                         max_prompt_tokens=max(config.pipeline.length_buckets) - r.max_new_tokens)


def sampling_config(config: ml_collections.ConfigDict, processor: Any, temperature: float,
                    mesh: jax.sharding.Mesh | None = None) -> SamplingConfig:
    """The sampler's settings; on `mesh` (the sampler's) `pipeline.vision_per_device` lays the screenshots out
    in per-device blocks, as the training batches are."""
    tok = processor.tokenizer
    stops = tuple(i for i in (tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>"))
                  if i is not None)
    return SamplingConfig(temperature=temperature, top_p=config.rollout.top_p, top_k=config.rollout.top_k,
                          max_new_tokens=config.rollout.max_new_tokens, stop_token_ids=stops,
                          prompt_buckets=tuple(config.pipeline.length_buckets),
                          patch_bucket=config.pipeline.patch_bucket, max_rows=config.rollout.max_sampler_rows,
                          prefill_rows=config.rollout.get("prefill_rows", 0),
                          pad_images_with_rows=images_padded_with_rows(config),
                          vision_blocks=sharding.local_vision_blocks(config, mesh))


def pipeline_config(config: ml_collections.ConfigDict, system_prompt: str,
                    mesh: jax.sharding.Mesh | None = None) -> PipelineConfig:
    """The batch pipeline of a recipe; `mesh` (the one the batches are placed on) sets the per-device vision
    blocks of `pipeline.vision_per_device` and the blocks a packed minibatch is cut into."""
    blocks = sharding.local_data_blocks(mesh)
    if config.pipeline.get("pack", False) and (config.train.minibatch_size % blocks
                                                or config.pipeline.get("pack_rows", 0) % blocks):
        raise ValueError(f"pipeline.pack: train.minibatch_size={config.train.minibatch_size} and pipeline.pack_rows="
                         f"{config.pipeline.get('pack_rows', 0)} must be multiples of the {blocks} data-parallel "
                         "devices each packing its own steps")
    return PipelineConfig(batch_size=config.train.minibatch_size, max_images=config.rollout.max_images,
                          length_buckets=tuple(config.pipeline.length_buckets),
                          patch_bucket=config.pipeline.patch_bucket, system_prompt=system_prompt,
                          grammar=grammar_of(config.rollout.prompt),
                          seed=config.seed, worker_count=config.pipeline.worker_count,
                          response_bucket=config.pipeline.get("response_bucket", 64),
                          dedupe_images=config.pipeline.get("dedupe_images", True),
                          shuffle_block=config.pipeline.get("shuffle_block", 1),
                          vision_blocks=sharding.local_vision_blocks(config, mesh),
                          max_response_tokens=config.pipeline.get("max_response_tokens", 0) or None,
                          pack=config.pipeline.get("pack", False),
                          pack_length=config.pipeline.get("pack_length", 0) or None,
                          pack_length_rule=config.pipeline.get("pack_length_rule", "one_row"),
                          pack_rows=config.pipeline.get("pack_rows", 0) or None,
                          pack_fill=config.pipeline.get("pack_fill", False),
                          pack_blocks=blocks, vision_images=config.pipeline.get("vision_images", 0))


@dataclasses.dataclass
class Components:
    """What the loop needs, built once per run by the pipeline. `make_hook` builds the method's trajectory
    hook given the trainer's scorer (mean response log-prob under the current policy); `objective` is the
    method's loss and advantage estimator."""

    policy: Policy
    pool: Any
    processor: Any
    train_tasks: list[Task]
    make_hook: Callable[[Scorer], Any]
    objective: objectives.Objective
    system_prompt: str  # the template `rollout.prompt` names (Run.system_prompt)
    mesh: jax.sharding.Mesh | None
    streams: Streams = Streams(0)
    sampler_mesh: jax.sharding.Mesh | None = None  # asynchronous rollouts on devices of their own


class Trainer:
    def __init__(self, config: ml_collections.ConfigDict, workdir: pathlib.Path, parts: Components):
        self.config, self.workdir, self.parts = config, pathlib.Path(workdir), parts
        self.policy = parts.policy
        self.module = parts.policy.module
        self.tx, self.schedule = optim.make_optimizer(config.optim)
        self.objective = parts.objective
        self.asynchronous = config.rollout.get("mode", "sync") == "async"
        loss = parts.objective.loss
        if self.asynchronous or config.train.behaviour_correction:  # weigh each token by π_old / π_behaviour:
            # rows sampled by older parameters, or by a sampler whose log-probs differ from the learner's
            loss = objectives.BehaviourCorrected(loss, config.train.behaviour_weight_cap)
        step_cfg = train_step.StepConfig(loss, config.rollout.temperature, config.train.logprob_impl,
                                         config.train.router_aux_loss_coef, parts.streams.seed_for("lora_dropout"))
        self.mesh = parts.mesh
        self.streams = parts.streams
        self.step_fn = train_step.make_train_step(self.module, self.tx, step_cfg, self.mesh)
        self.accumulate = int(config.optim.grad_accum_steps)  # micro-batches per update (1: none)
        self.empty_microstep = (train_step.make_empty_microstep(self.module, self.tx, self.mesh)
                                if self.accumulate > 1 else None)
        self.logprob_fn = train_step.make_logprob_fn(self.module, config.rollout.temperature, config.train.logprob_impl,
                                                     self.mesh)
        self.state = train_step.init_state(self.module, self.policy.params, self.tx, self.mesh)
        # the frozen reference policy of a KL term: the parameters the run starts from. The trained ones are
        # copied (each step donates their buffers); under LoRA the frozen base is shared, not copied
        self.ref_params = (train_step.reference_params(self.state.params, TrainedPart.of(self.module))
                           if parts.objective.reference_kl else None)
        sampler_mesh = parts.sampler_mesh or parts.mesh
        self.sampler = make_sampler(config, self.module, sampling_config(config, parts.processor,
                                                                          config.rollout.temperature, sampler_mesh),
                                    sampler_mesh, parts.processor.tokenizer, parts.policy.path,
                                    adapter_root=self.workdir / "engine_adapters")
        self.engine = RolloutEngine(parts.pool, self.sampler, parts.processor,
                                    rollout_config(config, parts.system_prompt))
        self.pipeline = pipeline_config(config, parts.system_prompt, parts.mesh)
        self.ckpt = Checkpointer(self.workdir / "checkpoints", keep=config.train.keep_checkpoints)
        self.metrics = MetricsWriter(self.workdir)
        self.store = TrajectoryStore(self.workdir / "trajectories")
        self.iteration = 0
        self.nonfinite_in_row = 0
        self.hook = parts.make_hook(self.score_trajectories)
        self.stream: RolloutStream | None = None  # the asynchronous mode's rollout thread, while fit() runs
        self.consumed: set[int] = set()  # asynchronous mode: groups the learner has taken (trained or too stale)
        self._stream_mark: dict[str, float] = {}  # the rollout thread's counters when last read

    def _place(self, batch: dict[str, Any]) -> dict[str, Any]:
        """Global arrays split over the data-parallel devices (padded to divide); as-is without a mesh."""
        if self.mesh is None:
            return batch
        return sharding.place_batch(batch, self.mesh, pad=True, image_token_id=self.module.cfg.image_token_id)

    def score_trajectories(self, trajectories: Sequence[Trajectory]) -> list[float]:
        """Mean response-token log-prob of each trajectory under the current policy (for hooks that rank
        trajectories by it)."""
        from guijax.diagnostics import mean_trajectory_logps

        return mean_trajectory_logps(self.logprob_fn, self.state.params, trajectories, self.parts.processor,
                                     self.module.cfg, self.pipeline)

    # ------------------------------------------------------------------ checkpoints
    def save(self) -> None:
        meta = {"iteration": self.iteration, "hook": self.hook.state_dict(),
                "nonfinite_in_row": self.nonfinite_in_row}
        if self.asynchronous:
            meta["consumed_groups"] = _compress(self.consumed)
        self.ckpt.save(self.iteration, train_step.checkpointed(self.state, self.module), meta)

    def maybe_restore(self) -> bool:
        def use(saved, meta):
            iteration, nonfinite = int(meta["iteration"]), int(meta.get("nonfinite_in_row", 0))
            self.hook.load_state_dict(meta["hook"])
            self.consumed = _expand(meta.get("consumed_groups", {}))
            return train_step.restored(self.state, saved, self.module), iteration, nonfinite

        restored = self.ckpt.restore_latest(train_step.checkpointed(self.state, self.module), use)
        if restored is not None:
            _, (self.state, self.iteration, self.nonfinite_in_row) = restored
            logging.info("resumed from checkpoint at iteration %d", self.iteration)
        # what iterations after the checkpoint (all of them, without one) left is rewritten when they are redone
        self._drop_shards_from(self.iteration)
        self.metrics.drop_from(self.iteration)
        return restored is not None

    def _drop_shards_from(self, iteration: int) -> None:
        """Trajectories written after the restored checkpoint are rewritten (identically) by the rerun."""
        for path in self.store.shards:
            stem = path.name.split(".")[0]
            if stem.startswith("iter-") and stem[5:].isdigit() and int(stem[5:]) >= iteration:
                path.unlink()
        self.store.refresh()

    # ------------------------------------------------------------------ one iteration
    def _tasks_for(self, iteration: int) -> list[Task]:
        rng = self.streams.python("tasks", iteration)
        return rng.sample(self.parts.train_tasks, self.groups_per_iteration)

    def iterate(self) -> dict[str, float]:
        """One iteration: rollouts (synchronous: sampled now with the current parameters; asynchronous: the
        next complete groups from the rollout stream), then the update. Its metrics count the XLA compilations
        that happened meanwhile (`compiles`, `time_compile_s`; any thread's, the rollout thread's included)."""
        window = compile_stats.Window()
        metrics = self._iterate_async() if self.stream is not None else self._iterate_sync()
        metrics.update(window.read())
        return metrics

    def _iterate_sync(self) -> dict[str, float]:
        cfg = self.config
        t_start = time.perf_counter()
        tasks = self._tasks_for(self.iteration)
        rollouts, timing = self.engine.run(self.state.params, tasks, cfg.rollout.group_size,
                                           self.streams.key("sampling", self.iteration),
                                           seed=self.streams.seed_for("episodes", self.iteration),
                                           version=self.iteration)
        g = cfg.rollout.group_size
        task_groups = [(task, rollouts[i * g:(i + 1) * g]) for i, task in enumerate(tasks)]
        t_store = time.perf_counter()
        self.store.append(rollouts, name=f"iter-{self.iteration:06d}")  # every episode, failures included
        timing = dict(timing, store_s=time.perf_counter() - t_store)
        metrics = self._learn(task_groups, t_start)
        self._add_rollout_metrics(metrics, timing)
        # rollouts are synchronous: every second in env calls is a second the trainer waits on environments
        metrics["env_wait_fraction"] = timing["env_s"] / max(metrics["time_iteration_s"], 1e-9)
        return metrics

    def _learn(self, task_groups: Sequence[tuple[Task, Sequence[Trajectory]]], t_start: float) -> dict[str, float]:
        """The method's hook assembles each task's group, then advantages, metrics and the update."""
        groups: list[list[Trajectory]] = []
        auxiliary: list[Trajectory] = []  # rows for a term of the method's loss, outside every group
        dropped = []
        rollouts = [t for _, group in task_groups for t in group]
        for task, group in task_groups:
            dropped += [f"{t.task_id}: {t.error}" for t in group if t.status == Status.ENV_ERROR]
            group = [t for t in group if t.status != Status.ENV_ERROR]
            self.hook.observe(task, group)
            groups.append(self.hook.assemble(task, group))
            auxiliary += self.hook.auxiliary(task)
        for reason in dropped:
            logging.warning("dropped an episode whose environment failed: %s", reason)
        trajectories = [t for g in groups for t in g] + auxiliary
        group_ids = np.concatenate([np.full(len(g), i) for i, g in enumerate(groups)] + [np.zeros(0)]).astype(np.int32)
        rewards = np.asarray([t.reward for g in groups for t in g], np.float32)
        stats = self.objective.advantages(rewards, group_ids, len(groups))
        scored = len(rewards)
        advantages = np.concatenate([np.asarray(stats.advantages), np.zeros(len(auxiliary), np.float32)])
        keep = [i for i, a in enumerate(advantages) if a != 0.0 or i >= scored]
        on_policy = [t for t in rollouts if t.status != Status.ENV_ERROR]
        metrics: dict[str, float] = {
            "iteration": self.iteration,
            "reward_mean": float(np.mean([t.reward for t in on_policy])) if on_policy else 0.0,
            "success_rate": float(np.mean([t.success for t in on_policy])) if on_policy else 0.0,
            "format_error_rate": float(np.mean([t.status == Status.PARSE_ERROR for t in on_policy])) if on_policy else 0.0,
            "env_errors": len(dropped), "zero_variance_groups": int(stats.zero_variance_groups),
            "episodes": len(rollouts),
            "response_tokens_mean": float(np.mean([len(s.response_tokens) for t in on_policy for s in t.steps]))
            if on_policy else 0.0,
            "behaviour_logprob_mean": float(np.mean(np.concatenate(
                [s.behaviour_logprobs for t in on_policy for s in t.steps] or [np.zeros(1)]))),
        }
        metrics["injected"] = sum(t.source.value != "on_policy" for t in trajectories)
        won = [s.behaviour_logprobs for t in on_policy if t.success for s in t.steps if len(s.behaviour_logprobs)]
        metrics["logp_success_on_policy"] = float(np.mean(np.concatenate(won))) if won else None
        metrics.update(self.hook.metrics())
        update = self._update(trajectories, advantages, keep, scored) if keep else {}
        metrics.update(update)
        metrics["time_iteration_s"] = wall = time.perf_counter() - t_start
        metrics["tokens_per_s"] = metrics.get("trained_tokens", 0) / max(metrics.get("time_update_s", 0.0), 1e-9)
        metrics["learner_busy_fraction"] = (metrics.get("time_old_logprobs_s", 0.0)
                                            + metrics.get("time_update_s", 0.0)) / max(wall, 1e-9)
        self.iteration += 1
        return metrics

    def _add_rollout_metrics(self, metrics: dict[str, Any], timing: dict[str, float]) -> None:
        """The rollouts' share of the iteration: time in environment calls and sampling, steps, and how busy
        the environment workers were (slot-seconds in their calls over the workers' time)."""
        metrics.update(time_env_s=timing["env_s"], time_sampling_s=timing["sample_s"],
                       time_store_s=timing.get("store_s", 0.0), time_rollout_s=timing["wall_s"],
                       env_steps=timing["steps"], sampled_tokens=timing["sampled_tokens"],
                       # pushing the learner's parameters to a sampler that holds its own (a serving engine)
                       time_weight_sync_s=timing.get("weight_sync_s", 0.0),
                       weight_sync_bytes=timing.get("weight_sync_bytes", 0),
                       env_busy_fraction=timing.get("env_slot_s", 0.0) / max(
                           self.parts.pool.num_workers * metrics["time_iteration_s"], 1e-9))

    def _update(self, trajectories: Sequence[Trajectory], advantages: np.ndarray,
                keep: Sequence[int], scored: int | None = None) -> dict[str, float]:
        """PPO epochs over the kept trajectories' step rows; `scored` is how many on-policy trajectories the
        iteration's objective averages over (the zero-advantage ones, not trained on, included; default: the
        kept ones)."""
        cfg = self.config
        scored = len(keep) if scored is None else scored
        refs = self.objective.step_rows(step_refs(trajectories, {i: float(advantages[i]) for i in keep}))
        t0 = time.perf_counter()  # batches, token-budget planning included, and their old log-probs
        data = make_dataset(trajectories, refs, self.parts.processor, self.module.cfg,
                            dataclasses.replace(self.pipeline, seed=self.streams.seed_for("batches", self.iteration)))
        prepared, injected_logp, screenshots, rows, fills, mismatch = [], [], np.zeros(2), [], [], []
        for batch in data:  # old log-probs under θ_old, fixed for every epoch
            screenshots += [batch["meta"].get("unique_screenshots", 0), batch["meta"].get("screenshots", 0)]
            fills.append(float(batch["meta"]["token_fill"]))
            rows.append(int(np.any(np.asarray(batch["loss_mask"]) > 0, axis=-1).sum()))
            batch = self._place(device_batch(batch))
            old, _ = self.logprob_fn(self.state.params, batch)
            extra = {"old_logp": old}
            mismatch.append(objectives.behaviour_mismatch(old, batch["behaviour_logprobs"], batch["loss_mask"],
                                                          objectives.sampled_rows(batch)))
            if self.ref_params is not None:  # the KL term's reference policy, frozen at the start
                extra["ref_logp"], _ = self.logprob_fn(self.ref_params, batch)
            # injected traces (replay, cache, expert) as the current θ_old sees them; sums over the global batch
            off_mask = batch["loss_mask"] * jnp.asarray(batch["off_policy"], jnp.float32)[:, None]
            if float(jnp.sum(off_mask)) > 0:
                injected_logp.append((float(jnp.sum(old * off_mask)), float(jnp.sum(off_mask))))
            prepared.append(dict(batch, **extra))
        t_old = time.perf_counter() - t0
        if self.objective.trajectory_normalized:  # each batch stands for its share of the trajectories
            prepared = [dict(b, normalizer=np.float32(z))
                        for b, z in zip(prepared, objectives.trajectory_normalizers(rows, scored))]
        total_tokens = sum(float(jnp.sum(b["loss_mask"])) for b in prepared)
        collected: dict[str, list[float]] = {}
        t0 = time.perf_counter()
        applied = train_step.applied_updates(self.state.opt_state)
        # each loss normalises over its own batch (token or sequence); with accumulation each epoch's batches
        # form groups of their own, weighted so a group updates as one batch (guijax.accumulation); the weights
        # are the same every epoch
        groups = list(accumulation.scaled_groups(prepared, self.accumulate, cfg.train.normalization))
        for _ in range(cfg.train.ppo_epochs):
            for batch, ends_group in groups:
                self.state, m = self.step_fn(self.state, batch)
                if ends_group and self.empty_microstep is not None:
                    self.state, _ = accumulation.flush(self.state, self.empty_microstep)
                for k, v in m.items():
                    collected.setdefault(k, []).append(float(v))
                if m["skipped"]:
                    self.nonfinite_in_row += 1
                    logging.warning("non-finite loss or gradient: update skipped (%d in a row)", self.nonfinite_in_row)
                    if self.nonfinite_in_row >= cfg.train.max_nonfinite_in_row:
                        raise TrainingError(f"{self.nonfinite_in_row} non-finite updates in a row at iteration "
                                            f"{self.iteration}; stopping (lower optim.learning_rate or check the data)")
                else:
                    self.nonfinite_in_row = 0
        out = {k: float(np.mean(v)) for k, v in collected.items()}
        # optimiser updates this iteration applied (accumulation groups; else one per minibatch and epoch)
        out.update(minibatches=len(prepared), optimizer_updates=(
            train_step.applied_updates(self.state.opt_state) - applied if applied is not None
            else len(prepared) * cfg.train.ppo_epochs))
        if screenshots[1]:  # distinct / all screenshots of the batches: what the vision tower was spared
            out["screenshot_dedupe_ratio"] = float(screenshots[0] / screenshots[1])
        if fills:  # real tokens / token slots of the model's input rows: what padding (or packing) leaves
            out["token_fill"] = float(np.mean(fills))
        sums = jax.device_get(mismatch)
        tokens = sum(float(m["tokens"]) for m in sums)
        if tokens:  # the sampler's log-probs against the learner's, per sampled token
            out["behaviour_logp_abs_diff"] = sum(float(m["abs_sum"]) for m in sums) / tokens
            out["behaviour_kl"] = sum(float(m["kl_sum"]) for m in sums) / tokens
        if injected_logp:
            out["logp_injected"] = sum(a for a, _ in injected_logp) / max(sum(n for _, n in injected_logp), 1.0)
        out.update(time_old_logprobs_s=t_old, time_update_s=time.perf_counter() - t0, trained_tokens=total_tokens,
                   learning_rate=float(self.schedule(self._schedule_step())))
        return out

    def _schedule_step(self) -> int:
        """The step the learning-rate schedule is at: optimiser updates applied (under accumulation the
        schedule inside `optax.MultiSteps` counts those, not micro-steps)."""
        applied = train_step.applied_updates(self.state.opt_state)
        return int(self.state.step) if applied is None else applied

    def fit(self, desc: str = "rl") -> list[dict[str, float]]:
        """Iterate up to `train.iterations` from where the run stands (a restored checkpoint's iteration)."""
        history = []
        total = self.config.train.iterations
        if self.asynchronous and self.iteration < total:
            self._start_stream()
        try:
            with Progress(total, desc, "iteration", initial=self.iteration) as bar:
                while self.iteration < total:
                    metrics = self.iterate()
                    self.metrics.write(metrics)
                    history.append(metrics)
                    bar.update(1, success=f"{100 * metrics['success_rate']:.0f}%",
                               reward=round(metrics["reward_mean"], 3))
                    if self.iteration % self.config.train.checkpoint_every == 0 or self.iteration == total:
                        self.save()
        finally:
            if self.stream is not None:
                self.stream.close()
                self.stream = None
        self.ckpt.wait()
        return history

    # ------------------------------------------------------------------ asynchronous mode
    @property
    def groups_per_iteration(self) -> int:
        return min(self.config.rollout.tasks_per_iteration, len(self.parts.train_tasks))

    def group_spec(self, index: int) -> tuple[Task, list[int]]:
        """Group `index` of the asynchronous stream: the task and episode seeds the synchronous mode gives the
        same position (iteration index // k, task index % k), so both modes draw the same episodes."""
        block, position = divmod(index, self.groups_per_iteration)
        seed = self.streams.seed_for("episodes", block)
        return (self._tasks_for(block)[position],
                [episode_seed(seed, position, g) for g in range(self.config.rollout.group_size)])

    def _start_stream(self) -> None:
        r = self.config.rollout
        self.store.refresh()
        stored = sorted(i for i in (group_index(p.name) for p in self.store.shards) if i is not None)
        pending = [i for i in stored if i not in self.consumed]  # completed, never trained on: first in line
        ahead = r.async_groups_ahead or 2 * self.groups_per_iteration
        self.stream = RolloutStream(self.engine, self.group_spec, r.group_size, self.store.directory,
                                    self.streams.key("sampling_async", len(self.consumed)),
                                    max_groups_ahead=max(ahead, len(pending)), skip=self.consumed | set(pending),
                                    first=_compress(self.consumed)["below"])
        self.stream.preload([shard_name(i) for i in pending])
        if pending:
            logging.info("resuming with %d completed group(s) not yet trained on: %s", len(pending), pending)
        self.stream.publish(self._sampler_params(), self.iteration)
        self._stream_mark = dict(self.stream.timings)
        self.stream.start()

    def _iterate_async(self) -> dict[str, float]:
        cfg = self.config
        t_start = time.perf_counter()
        task_groups, lags, taken, stale, waited = [], [], [], [], 0.0
        while len(task_groups) < self.groups_per_iteration:
            t0 = time.perf_counter()
            shard = self.stream.get()
            waited += time.perf_counter() - t0
            self.stream.release()
            index = group_index(shard)
            trajectories = [self.store.at(shard + STORE_SUFFIX, m) for m in range(cfg.rollout.group_size)]
            self.consumed.add(index)
            # parameters lost with a crash may have sampled a group a resumed run reads: never negative
            lag = max(0, self.iteration - sampling_version(trajectories, self.iteration))
            if lag > cfg.rollout.max_staleness:
                stale.append(index)
                logging.info("dropped group %d (task %s): sampled %d versions ago, rollout.max_staleness=%d",
                             index, trajectories[0].task_id, lag, cfg.rollout.max_staleness)
                continue
            lags.append(lag)
            taken.append(index)
            task_groups.append((self.group_spec(index)[0], trajectories))
        version = self.iteration
        metrics = self._learn(task_groups, t_start)
        # the rollout thread works through the whole iteration, the update included: its counters are read
        # once the update is done, from where the previous iteration's reading left them
        now = dict(self.stream.timings)
        timing = {k: now[k] - self._stream_mark[k] for k in now}
        self._stream_mark = now
        self._add_rollout_metrics(metrics, dict(timing, wall_s=waited))
        metrics.update(policy_version=version, groups=taken, staleness_mean=float(np.mean(lags)),
                       staleness_max=int(max(lags)), stale_groups=stale,
                       stale_dropped=len(stale) * cfg.rollout.group_size,
                       # what the learner spent waiting for complete groups
                       env_wait_fraction=waited / max(metrics["time_iteration_s"], 1e-9))
        self.stream.publish(self._sampler_params(), self.iteration)
        return metrics

    def _sampler_params(self) -> Any:
        """The parameters the rollout thread samples with until the next update: copied onto the sampler's own
        devices when it has them, else a copy on the training devices that the next update cannot donate."""
        if self.parts.sampler_mesh is None:
            return train_step.reference_params(self.state.params, TrainedPart.of(self.module))
        from guijax.models.weights import abstract_params

        return jax.device_put(self.state.params,
                              sharding.param_shardings(abstract_params(self.module), self.parts.sampler_mesh))

    def close(self) -> None:
        closer = getattr(self.sampler, "close", None)
        if closer is not None:
            closer()
        self.ckpt.close()
        self.metrics.close()
