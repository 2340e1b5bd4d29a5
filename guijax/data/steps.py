"""Trajectories -> per-step training examples -> padded, bucketed batches, as a grain pipeline.

Each step of a trajectory becomes one example: the prompt the agent saw at that step (rebuilt from the
instruction, the trajectory's plan if any, earlier turns and the current screenshot) followed by the
response tokens. Convention: position t predicts token t+1, so `targets = input_ids[1:]` and
`loss_mask[t] = 1` exactly when token t+1 belongs to the response.

Encoding (chat template, image preprocessing) runs inside grain `map`, so a grain worker pool can take it
off the trainer's thread; batches are padded to a few length and patch buckets so XLA compiles a handful
of programs.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import grain
import numpy as np

from guijax.models.config import ModelConfig
from guijax.models.positions import mrope_positions, vision_layout
from guijax.rollout.prompt import Turn, build_messages
from guijax.rollout.trajectory import Trajectory
from guijax.sampling import bucket_for, pad_images


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    max_images: int = 5
    length_buckets: tuple[int, ...] = (256, 512, 1024, 2048, 4096, 8192)
    patch_bucket: int = 1024
    system_prompt: str | None = None


@dataclasses.dataclass(frozen=True)
class StepRef:
    """Which step of which trajectory, with the trajectory's scalar advantage and whether it is off-policy."""

    trajectory: int
    step: int
    advantage: float
    expert: bool = False


def step_refs(trajectories: Sequence[Trajectory], advantages: Sequence[float],
              expert: Sequence[bool] | None = None) -> list[StepRef]:
    if len(advantages) != len(trajectories):
        raise ValueError(f"{len(advantages)} advantages for {len(trajectories)} trajectories")
    expert = expert or [False] * len(trajectories)
    return [StepRef(i, j, float(a), bool(x)) for i, (t, a, x) in enumerate(zip(trajectories, advantages, expert))
            for j in range(len(t.steps))]


class StepEncoder:
    """Builds one example (token ids, masks, images) for a StepRef. Picklable for grain workers."""

    def __init__(self, trajectories: Sequence[Trajectory], processor: Any, config: PipelineConfig):
        self.trajectories, self.processor, self.config = trajectories, processor, config
        tok = processor.tokenizer
        self.im_end = tok.convert_tokens_to_ids("<|im_end|>")

    def __call__(self, ref: StepRef) -> dict[str, Any]:
        traj = self.trajectories[ref.trajectory]
        step = traj.steps[ref.step]
        turns = [Turn(s.screenshot, s.response) for s in traj.steps[:ref.step]]
        kwargs = {} if self.config.system_prompt is None else {"system_prompt": self.config.system_prompt}
        messages, images = build_messages(traj.instruction, turns, step.screenshot, max_images=self.config.max_images,
                                          plan=traj.plan, **kwargs)
        prompt = self.processor(self.processor.apply_chat_template(messages), [images])
        prompt_ids = prompt["input_ids"][0]
        if len(step.response_tokens):
            response = np.asarray(step.response_tokens, np.int64)
            behaviour = np.asarray(step.behaviour_logprobs, np.float32)
        else:  # off-policy text (expert / converted trace): tokenise and close the turn
            response = np.asarray(self.processor.tokenizer(step.response)["input_ids"] + [self.im_end], np.int64)
            behaviour = np.zeros(len(response), np.float32)
        ids = np.concatenate([prompt_ids, response])
        loss_mask = np.zeros(len(ids), np.float32)
        loss_mask[len(prompt_ids) - 1:len(ids) - 1] = 1.0
        behaviour_lp = np.zeros(len(ids), np.float32)
        behaviour_lp[len(prompt_ids) - 1:len(ids) - 1] = behaviour[:len(response)]
        return {"input_ids": ids, "loss_mask": loss_mask, "behaviour_logprobs": behaviour_lp,
                "pixel_values": prompt["pixel_values"], "image_grid_thw": prompt["image_grid_thw"],
                "advantage": np.float32(ref.advantage), "expert": np.float32(ref.expert),
                "task_id": traj.task_id, "step": ref.step}


def collate(examples: Sequence[dict[str, Any]], cfg: ModelConfig, pipeline: PipelineConfig) -> dict[str, Any]:
    """Right-pad to the smallest length bucket, pad image patches to the patch bucket, compute positions
    and the vision layout: exactly the arrays the forward and the train step take."""
    longest = max(len(e["input_ids"]) for e in examples)
    try:
        length = bucket_for(longest, pipeline.length_buckets)
    except ValueError:
        worst = max(examples, key=lambda e: len(e["input_ids"]))
        raise ValueError(f"task {worst['task_id']} step {worst['step']}: {longest} tokens exceed the largest "
                         f"length bucket {max(pipeline.length_buckets)}") from None
    b = len(examples)
    ids = np.zeros((b, length), np.int32)
    mask = np.zeros((b, length), np.int32)
    loss_mask = np.zeros((b, length), np.float32)
    behaviour = np.zeros((b, length), np.float32)
    for i, e in enumerate(examples):
        n = len(e["input_ids"])
        ids[i, :n], mask[i, :n] = e["input_ids"], 1
        loss_mask[i, :n], behaviour[i, :n] = e["loss_mask"], e["behaviour_logprobs"]
    targets = np.concatenate([ids[:, 1:], np.zeros((b, 1), np.int32)], axis=1)
    grids = np.concatenate([e["image_grid_thw"] for e in examples]).reshape(-1, 3)
    positions, _ = mrope_positions(ids, mask, grids if len(grids) else None, cfg)
    vision = None
    if len(grids):
        pix, padded_grid = pad_images(np.concatenate([e["pixel_values"] for e in examples]).astype(np.float32), grids,
                                      pipeline.patch_bucket, cfg.vision.spatial_merge_size)
        layout = vision_layout(padded_grid, cfg.vision)
        vision = layout.inputs(pix)
    return {"input_ids": ids, "attention_mask": mask, "positions": positions, "vision": vision, "targets": targets,
            "loss_mask": loss_mask, "behaviour_logprobs": behaviour,
            "advantages": np.asarray([e["advantage"] for e in examples], np.float32),
            "expert": np.asarray([e["expert"] for e in examples], np.float32),
            "off_policy": np.asarray([e["expert"] > 0 for e in examples], bool)}


def batches(trajectories: Sequence[Trajectory], refs: Sequence[StepRef], processor: Any, cfg: ModelConfig,
            pipeline: PipelineConfig, batch_size: int, seed: int, shuffle: bool = True) -> grain.MapDataset:
    """A grain dataset of collated batches over the step examples (deterministic order for a seed)."""
    ds = grain.MapDataset.source(list(refs))
    if shuffle:
        ds = ds.shuffle(seed=seed)
    encoder = StepEncoder(trajectories, processor, pipeline)
    return ds.map(encoder).batch(batch_size, batch_fn=lambda xs: collate(xs, cfg, pipeline))
