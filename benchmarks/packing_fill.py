"""Benchmark: how full a GPU/TPU recipe's update batches are, padded to length buckets or packed.

Why: packing (`pipeline.pack_fill`) pays where steps are short against the row: several fit one row and
little is padded. A GUI step at full HD is mostly screenshot tokens (a 1920x1080 screenshot is 2,691 image
tokens for Qwen2.5-VL), its length grows with the screenshots in its history, and a row of the recipes'
16,384 tokens holds at most one step of five screenshots. Whether packing beats the recipe's length buckets
there, and what the fixed vision shape packing needs (`pipeline.vision_images`: every layout padded with
blank screenshots to one count) costs, is arithmetic on the recipe's own shapes, done here by the trainer's
own planner (`guijax.data.packing.plan_minibatches`) rather than by hand.

Model of a pass: episodes of E steps; step t shows min(t, rollout.max_images) screenshots and has
screenshots x (image tokens + guijax.aot.TEXT_TOKENS_PER_SCREENSHOT) + `--response` tokens (the dry run's
rule, with the response as given). Three layouts:

* buckets: each step alone in a row of the smallest `pipeline.length_buckets` entry that holds it, its
  screenshots' patches padded to a multiple of `pipeline.patch_bucket` (the one-GPU recipes' layout, one step
  per optimiser step; one compiled shape per (bucket, patch count) met);
* packed: the pass planned into minibatches of `--pack-rows` rows of `--pack-length` tokens with at most
  `train.minibatch_size` (or `--max-steps`) steps each (one compiled shape; a minibatch is one optimiser step,
  so a pass takes fewer, larger ones than with buckets); every minibatch's vision layout padded to the most
  screenshots any minibatch holds (what `pipeline.vision_images` must be for one shape; no screenshot is
  counted as shared between steps, so this is the most a pass can need);
* the token fill (real tokens / token slots) and the vision fill (real screenshots / screenshot slots) of
  each, and a work fill weighting the two by the model's FLOPs per token and per patch (6 x parameters of
  the decoder and of the vision tower; attention left out, and the merger counted per patch though it runs
  once per 2x2 patches).

  python benchmarks/packing_fill.py --config=grpo_gpu --episode-steps 3,8,15 --max-steps 4
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # a checkout without pip install
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_step as step_bench  # noqa: E402  (benchmarks/train_step.py: parameter counts by part)

from guijax import aot, launch  # noqa: E402
from guijax.data.packing import plan_minibatches  # noqa: E402
from guijax.models.config import get_preset  # noqa: E402
from guijax.sampling import bucket_for  # noqa: E402


def step_screenshots(episode_steps: list[int], max_images: int) -> list[int]:
    """Screenshots shown at each step of one episode of every length in `episode_steps`, in order."""
    return [min(t, max_images) for steps in episode_steps for t in range(1, steps + 1)]


def bucketed(tokens: list[int], shots: list[int], buckets: tuple[int, ...], patches: int,
             patch_bucket: int) -> dict[str, float]:
    slots = [bucket_for(n, buckets) for n in tokens]
    padded_patches = [-(-k * patches // patch_bucket) * patch_bucket for k in shots]
    return {"token_fill": sum(tokens) / sum(slots), "vision_fill": sum(shots) * patches / sum(padded_patches),
            "token_slots": sum(slots), "patch_slots": sum(padded_patches),
            "shapes": len(set(zip(slots, padded_patches)))}


def packed(tokens: list[int], shots: list[int], rows: int, length: int, max_steps: int,
           patches: int) -> dict[str, float]:
    plan = plan_minibatches(tokens, rows=rows, length=length, max_examples=max_steps, seed=0)
    per_batch = [sum(shots[i] for i in members) for members in plan]
    vision_images = max(per_batch)
    return {"token_fill": sum(tokens) / (len(plan) * rows * length),
            "vision_fill": sum(shots) / (len(plan) * vision_images), "token_slots": len(plan) * rows * length,
            "patch_slots": len(plan) * vision_images * patches, "minibatches": len(plan),
            "vision_images": vision_images, "shapes": 1}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    config = launch.resolve(args.config, list(args.override))
    cfg = get_preset(config.model.preset)
    shape = aot.batch_shape(config, cfg)
    per_screenshot = aot.step_tokens_per_screenshot(shape.patch_grid, cfg.vision)
    image_tokens = per_screenshot - aot.TEXT_TOKENS_PER_SCREENSHOT
    patches = shape.patch_grid[0] * shape.patch_grid[1]
    response = args.response or config.rollout.max_new_tokens
    decoder_params, vision_params = parameter_counts(cfg)
    token_flops, patch_flops = 6 * decoder_params, 6 * vision_params
    buckets = tuple(config.pipeline.length_buckets)
    max_steps = args.max_steps or config.train.minibatch_size
    rows = []
    for label, lengths in [(f"episodes of {e} steps", [e]) for e in args.episode_steps] + [
            ("the mix above, one episode of each length", list(args.episode_steps))]:
        shots = step_screenshots(lengths * args.episodes, config.rollout.max_images)
        tokens = [k * per_screenshot + response for k in shots]
        row = {"pass": label, "steps": len(tokens)}
        for name, result in (("buckets", bucketed(tokens, shots, buckets, patches, config.pipeline.patch_bucket)),
                             ("packed", packed(tokens, shots, args.pack_rows, args.pack_length, max_steps,
                                               patches))):
            work = sum(tokens) * token_flops + sum(shots) * patches * patch_flops
            slots = result["token_slots"] * token_flops + result["patch_slots"] * patch_flops
            row[name] = {**result, "work_fill": work / slots}
        rows.append(row)
    return {"command": "python benchmarks/packing_fill.py " + " ".join(sys.argv[1:]), "config": args.config,
            "image_tokens_per_screenshot": image_tokens, "patches_per_screenshot": patches,
            "response_tokens": response, "length_buckets": list(buckets), "patch_bucket": config.pipeline.patch_bucket,
            "pack_rows": args.pack_rows, "pack_length": args.pack_length, "max_steps_per_minibatch": max_steps,
            "decoder_params": decoder_params, "vision_params": vision_params, "rows": rows}


def parameter_counts(cfg: Any) -> tuple[int, int]:
    """Decoder (non-embedding) and vision-tower parameter counts, from the abstract model."""
    import flax.linen as nn
    import jax.numpy as jnp

    from guijax.models import weights

    module = weights.build_module(cfg, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    counts = step_bench.param_counts(nn.unbox(weights.abstract_params(module)), cfg)
    return counts["non_embedding"], counts["vision"]


def markdown(r: dict[str, Any]) -> str:
    lines = [f"# Token and vision fill of `{r['config']}`'s update batches: length buckets or packed", "",
             f"`{r['command']}`", "",
             f"A screenshot is {r['image_tokens_per_screenshot']:,} image tokens ({r['patches_per_screenshot']:,} "
             f"patches); a step's response {r['response_tokens']} tokens. Buckets {r['length_buckets']}, patches "
             f"padded to multiples of {r['patch_bucket']:,}; packed: {r['pack_rows']} row(s) of "
             f"{r['pack_length']:,} tokens, at most {r['max_steps_per_minibatch']} steps per minibatch. Work fill "
             f"weights tokens and patches by 6 x {r['decoder_params'] / 1e9:.2f}B decoder and 6 x "
             f"{r['vision_params'] / 1e9:.2f}B vision-tower parameters.", "",
             "| pass | steps | buckets: token fill | vision fill | work fill | shapes | packed: token fill | "
             "vision fill | work fill | vision_images | minibatches |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in r["rows"]:
        b, p = row["buckets"], row["packed"]
        lines.append(f"| {row['pass']} | {row['steps']} | {b['token_fill']:.3f} | {b['vision_fill']:.3f} | "
                     f"{b['work_fill']:.3f} | {b['shapes']} | {p['token_fill']:.3f} | {p['vision_fill']:.3f} | "
                     f"{p['work_fill']:.3f} | {p['vision_images']} | {p['minibatches']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="grpo_gpu", help="a recipe under configs/")
    p.add_argument("--override", action="append", default=[], help="KEY=VALUE, as guijax.launch takes them")
    p.add_argument("--episode-steps", type=lambda s: [int(x) for x in s.split(",")], default=[3, 8, 15])
    p.add_argument("--episodes", type=int, default=16, help="episodes of each length in a pass")
    p.add_argument("--response", type=int, default=0, help="response tokens per step (0: rollout.max_new_tokens)")
    p.add_argument("--pack-rows", type=int, default=1)
    p.add_argument("--pack-length", type=int, default=16384)
    p.add_argument("--max-steps", type=int, default=0, help="steps per packed minibatch (0: train.minibatch_size)")
    p.add_argument("--json")
    p.add_argument("--markdown")
    args = p.parse_args(argv)
    result = measure(args)
    text = markdown(result)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text)
    return result


if __name__ == "__main__":
    main()
