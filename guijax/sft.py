"""Supervised fine-tuning steps on trajectories: the warm start, the SFT baselines and rejection-sampling
fine-tuning all use `sft_steps`."""
from __future__ import annotations

import dataclasses
import pathlib
from typing import Any, Sequence

import ml_collections
from absl import logging

from guijax import objectives, optim, train_step
from guijax.checkpoint import Checkpointer
from guijax.data.pipeline import PipelineConfig, StepRef, make_dataset, step_refs
from guijax.models.policy import Policy
from guijax.progress import Progress
from guijax.rollout.trajectory import Trajectory


def device_batch(batch: dict[str, Any]) -> dict[str, Any]:
    """The arrays a jitted step takes: everything but the host-only `meta`."""
    return {k: v for k, v in batch.items() if k != "meta"}


def sft_steps(policy: Policy, trajectories: Sequence[Trajectory] | Any, processor: Any,
              config: ml_collections.ConfigDict, pipeline: PipelineConfig, steps: int, batch_size: int, seed: int,
              log: Any = None, checkpoint_dir: str | pathlib.Path | None = None,
              checkpoint_every: int = 50, desc: str = "sft",
              learning_rate: float | None = None, refs: Sequence[StepRef] | None = None,
              encode: Any = None) -> tuple[Any, list[float]]:
    """Supervised warm start on (converted expert) trajectories: token cross-entropy on the responses.

    `trajectories` may be a list or a TrajectoryStore. With `checkpoint_dir`, parameters, optimiser state,
    the losses so far and the grain iterator's position are saved every `checkpoint_every` steps, and a
    rerun continues from the newest save with the same batches an uninterrupted run would have seen.
    `learning_rate` overrides `sft.learning_rate` (the fresh model's warm-start rate) for fine-tuning runs.
    `refs` picks the steps that carry loss (default: every step; the others still appear in later steps'
    history). `encode` replaces the step encoder (see guijax.data.pipeline.make_dataset), with `refs` then
    indexing what it encodes.
    """
    sft_optim = ml_collections.ConfigDict(config.optim.to_dict())
    sft_optim.learning_rate = config.sft.learning_rate if learning_rate is None else learning_rate
    sft_optim.total_steps = max(steps, sft_optim.warmup_steps + 1)
    tx, _ = optim.make_optimizer(sft_optim)
    step_cfg = train_step.StepConfig(objectives.CrossEntropyLoss(), impl=config.train.logprob_impl,
                                     router_aux_loss_coef=config.train.router_aux_loss_coef, dropout_seed=seed)
    step_fn = train_step.make_train_step(policy.module, tx, step_cfg, policy.mesh)
    state = train_step.init_state(policy.module, policy.params, tx, policy.mesh)
    data = make_dataset(trajectories, step_refs(trajectories) if refs is None else list(refs), processor,
                        policy.module.cfg,
                        dataclasses.replace(pipeline, batch_size=batch_size, seed=seed, num_epochs=None,
                                            pack_fill=False), encode)
    it = iter(data)
    losses_seen: list[float] = []
    ckpt = Checkpointer(checkpoint_dir, keep=1) if checkpoint_dir else None
    saved = lambda s: train_step.checkpointed(s, policy.module)  # noqa: E731
    use = lambda s, meta: (train_step.restored(state, s, policy.module), meta["data"], list(meta["losses"]))  # noqa: E731
    restored = ckpt.restore_latest(saved(state), use) if ckpt else None
    if restored is not None:
        _, (state, data_state, losses_seen) = restored
        it.set_state(data_state)
        logging.info("sft: resumed at step %d", len(losses_seen))
    bar = Progress(steps, desc, "step", initial=len(losses_seen))
    try:
        while len(losses_seen) < steps:
            state, m = step_fn(state, device_batch(next(it)))
            losses_seen.append(float(m["loss"]))
            bar.update(1, loss=round(losses_seen[-1], 4))
            if log is not None:
                log({"sft_step": len(losses_seen), "sft_loss": losses_seen[-1]})
            if ckpt is not None and len(losses_seen) % checkpoint_every == 0 and len(losses_seen) < steps:
                ckpt.save(len(losses_seen), saved(state), {"data": it.get_state(), "losses": losses_seen})
    finally:
        bar.close()
        if ckpt is not None:
            ckpt.close()
    return state.params, losses_seen
