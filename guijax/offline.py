"""ARPO's offline comparisons on a fixed set of rollouts (arpo.txt §4): rejection-sampling SFT on the
successes (RFT), DPO on one success/failure pair per task, and KTO with rewards thresholded at 0.5.

Preferences are over whole trajectories: log π(τ) is the sum of the step responses' log-probs (each step's
prompt rebuilt as in training). The reference policy is the starting policy, frozen. A minibatch holds every
step of its trajectories in one padded batch; its rows are summed into trajectories with a segment sum.
"""
from __future__ import annotations

import dataclasses
import functools
import random
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from guijax import losses, optim, sharding, train_step
from guijax.data.pipeline import PipelineConfig, StepRef, make_dataset, step_refs
from guijax.models.trained import TrainedPart
from guijax.models.policy import Policy
from guijax.progress import Progress
from guijax.rollout.trajectory import Trajectory


def dpo_pairs(rollouts: Sequence[Trajectory], seed: int = 0) -> list[tuple[Trajectory, Trajectory]]:
    """One (success, failure) pair per task that has both, chosen at random (ARPO's offline DPO data)."""
    rng = random.Random(seed)
    by_task: dict[str, list[Trajectory]] = {}
    for t in rollouts:
        if t.steps:
            by_task.setdefault(t.task_id, []).append(t)
    pairs = []
    for task_id in sorted(by_task):
        wins = [t for t in by_task[task_id] if t.reward >= 0.5]
        losses_ = [t for t in by_task[task_id] if t.reward < 0.5]
        if wins and losses_:
            pairs.append((rng.choice(wins), rng.choice(losses_)))
    return pairs


def _steps_batch(trajectories: Sequence[Trajectory], processor: Any, model_cfg: Any,
                 pipeline: PipelineConfig, last_step_only: bool = False) -> tuple[dict[str, Any], np.ndarray]:
    """All steps of `trajectories` (or each one's last step alone) as one batch (rows padded to a power of
    two, and packed to a multiple of the packing blocks, with rows of segment len(trajectories), which the
    segment sum drops) and each row's trajectory index."""
    refs = ([StepRef(i, len(t.steps) - 1, 1.0) for i, t in enumerate(trajectories)] if last_step_only
            else step_refs(list(trajectories)))
    rows = len(refs)
    padded = 1 << max(rows - 1, 0).bit_length()
    if pipeline.pack:  # a packed batch's steps divide into its per-device blocks
        padded = -(-padded // pipeline.pack_blocks) * pipeline.pack_blocks
    refs = refs + [refs[0]] * (padded - rows)
    data = make_dataset(list(trajectories), refs, processor, model_cfg,
                        dataclasses.replace(pipeline, batch_size=len(refs), shuffle=False, num_epochs=1,
                                            pack_fill=False))  # one batch of every step, not token-budget ones
    batch = next(iter(data))
    segments = np.asarray(batch.pop("meta")["trajectory"], np.int32)
    segments[rows:] = len(trajectories)
    return batch, segments


def trajectory_logps(module: Any, params: Any, batch: dict[str, Any], segments: jax.Array, n: int,
                     temperature: float = 1.0, impl: str = "auto", dropout_key: jax.Array | None = None) -> jax.Array:
    """log π(τ) of each of `n` trajectories: the batch rows' response log-probs summed per segment."""
    logp, _ = train_step.batch_logprobs(module, params, batch, temperature, impl, dropout_key=dropout_key)
    return jax.ops.segment_sum(losses.sequence_logp(logp, batch["loss_mask"]), segments, n)


def preference_train(policy: Policy, kind: str, rollouts: Sequence[Trajectory], config: ml_collections.ConfigDict,
                     pipeline: PipelineConfig, steps: int, batch_trajectories: int, seed: int = 0,
                     beta: float = 0.1, learning_rate: float = 1e-5,
                     log: Callable[[dict], None] | None = None) -> tuple[Any, list[float]]:
    """DPO (`kind="dpo"`) or KTO (`kind="kto"`) over whole trajectories, from the policy's current parameters,
    which are also the frozen reference. Returns the trained parameters and the loss per step."""
    if kind == "dpo":
        pairs = dpo_pairs(rollouts, seed)
        if not pairs:
            raise ValueError("DPO: no task has both a success and a failure among the rollouts")
        units: list[list[Trajectory]] = [[w, l] for w, l in pairs]
    elif kind == "kto":
        units = [[t] for t in rollouts if t.steps]
        if not units:
            raise ValueError("KTO: no rollouts with steps")
    else:
        raise ValueError(f"unknown preference method {kind!r}; choose dpo or kto")
    return train_preferences(policy, kind, units, config, pipeline, steps, batch_trajectories, seed, beta,
                             learning_rate, log)


def train_preferences(policy: Policy, kind: str, units: Sequence[Sequence[Trajectory]],
                      config: ml_collections.ConfigDict, pipeline: PipelineConfig, steps: int, batch_trajectories: int,
                      seed: int = 0, beta: float = 0.1, learning_rate: float = 1e-5,
                      log: Callable[[dict], None] | None = None,
                      last_step_only: bool = False) -> tuple[Any, list[float]]:
    """DPO on [chosen, rejected] units or KTO on [trajectory] units (desirable: reward >= 0.5). log π of a
    trajectory is the sum over its steps, or with `last_step_only` its last step's alone (step-level pairs
    that share their history). The starting parameters are the frozen reference."""
    if not units:
        raise ValueError(f"{kind}: nothing to train on")
    temperature, impl = config.rollout.temperature, config.train.logprob_impl
    seq_logp = jax.jit(functools.partial(trajectory_logps, policy.module, temperature=temperature, impl=impl),
                       static_argnums=(3,))
    ref_params = policy.params
    opt_cfg = ml_collections.ConfigDict(config.optim.to_dict())
    opt_cfg.learning_rate = learning_rate
    opt_cfg.total_steps = max(steps, opt_cfg.warmup_steps + 1)
    tx, _ = optim.make_optimizer(opt_cfg)
    lora, part = policy.module.lora, TrainedPart.of(policy.module)  # what trains (guijax.models.trained)
    params = policy.params
    opt_state = sharding.init_opt_state(tx, part.trainable(params), policy.mesh)
    dropout_key = jax.random.PRNGKey(seed) if lora is not None and lora.dropout > 0 else None

    def loss_of(params, batch, segments, n, ref, desirable, key):
        logp = trajectory_logps(policy.module, params, batch, segments, n, temperature, impl, key)
        if kind == "dpo":
            return losses.dpo_loss(logp[0::2], logp[1::2], ref[0::2], ref[1::2], beta=beta)
        return losses.kto_loss(logp, ref, desirable, beta=beta)

    @jax.jit
    def update(params, opt_state, batch, segments, ref, desirable, step):
        n = ref.shape[0]
        key = None if dropout_key is None else jax.random.fold_in(dropout_key, step)
        trained = part.trainable(params)
        objective = lambda t: loss_of(part.with_trainable(params, t), batch, segments, n, ref,  # noqa: E731
                                      desirable, key)
        (loss, metrics), grads = jax.value_and_grad(objective, has_aux=True)(trained)
        updates, opt_state = tx.update(grads, opt_state, trained)
        params = part.with_trainable(params, optax.apply_updates(trained, updates))
        return params, opt_state, loss, metrics

    rng = random.Random(seed)
    per_batch = max(1, batch_trajectories // len(units[0]))
    history: list[float] = []
    bar = Progress(steps, kind, "step")
    while len(history) < steps:
        order = list(range(len(units)))
        rng.shuffle(order)
        for start in range(0, len(order), per_batch):
            chosen = [units[i] for i in order[start:start + per_batch]]
            trajectories = [t for unit in chosen for t in unit]
            batch, segments = _steps_batch(trajectories, policy.processor, policy.module.cfg, pipeline,
                                           last_step_only)
            n = len(trajectories)
            ref = seq_logp(ref_params, batch, segments, n)
            desirable = jnp.asarray([t.reward >= 0.5 for t in trajectories])
            params, opt_state, loss, metrics = update(params, opt_state, batch, segments, ref, desirable, len(history))
            history.append(float(loss))
            bar.update(1, loss=round(history[-1], 4))
            if log is not None:
                log({f"{kind}_step": len(history), f"{kind}_loss": history[-1],
                     **{k: float(v) for k, v in metrics.items()}})
            if len(history) >= steps:
                break
    bar.close()
    return params, history
