"""Benchmark: tokens/s and MFU of one GRPO update (forward, token log-probs, clipped loss, backward, AdamW).

Why: the update is where a GRPO run spends its accelerator time once rollouts are collected; tokens/s and
MFU (model FLOPs utilisation) say how close guijax gets to the hardware and let users compare trainers.

It times the real code path, `guijax.train_step.make_train_step(module, tx, StepConfig())` with the
optimiser of `guijax.optim.make_optimizer(configs._common.base().optim)` (global-norm clip 1.0 + AdamW, fp32
moments), on a text-only batch of random tokens (vision=None, M-RoPE positions [3, b, s] = arange on all three
axes, every position a response token but the last). One untimed call compiles; the figure is the median
of --repeats timed calls, each waited on with jax.block_until_ready.

Model FLOPs per token (PaLM appendix B convention: matmuls only, fwd + bwd = 3 x fwd, attention counted
over the full s x s square although it is causal, recomputation NOT counted):

    6 * N_nonembed  +  6 * hidden * vocab  +  12 * layers * hidden * seq

N_nonembed = all parameters minus the token embedding, an untied lm_head and the (unused, text-only)
vision tower; 6 * hidden * vocab is the LM-head matmul (2 * hidden * vocab forward, x3 for fwd + bwd; counted
once whether the head is tied or not). MFU = batch * seq * FLOPs-per-token / step time / peak, with peak
the spec-sheet dense bf16 FLOP/s on a known GPU/TPU (H100/H200 989e12, A100 312e12, TPU v6e 918e12, v5p
459e12, v5e 197e12, v4 275e12) and, on CPU, the FLOP/s of a jitted float32 2048^3 matmul measured in the
same run (best of 5), i.e. the fraction of what this machine's matmul can attain now.

Presets: any of guijax.models.config.PRESETS (tiny, small, ...) and `qwen2_5_0_5b`, a Qwen2.5-0.5B-shaped
language model (hidden 896, 24 layers, 14 heads, 2 KV heads, MLP 4864, vocab 151936, tied embeddings) with
a one-block vision tower, since the batch is text-only.

  python benchmarks/train_step.py --presets tiny,small,qwen2_5_0_5b --batch 2 --seq 256 --repeats 3

With `--screenshots K --screenshot-hw H,W` every row is a GUI step instead: K screenshots of HxW (random
pixels, resized as UI-TARS-1.5's processor does: a 1920x1080 screen is 10,764 patches and 2,691 image tokens),
64 text tokens around each, and a `--response`-token response that alone carries the loss, padded to the
smallest multiple of 1024 that holds it (or `--seq`). As in the recipes, the LM head runs at the response
positions alone (`response_positions`), and only those count its FLOPs. The vision tower runs on every screenshot, and its
FLOPs are counted too, in the same convention: 6 x its parameters per patch (the merger per merged token),
plus 12 x hidden x (attended patches) per patch and block, windows for windowed blocks, the whole image for
full-attention blocks.

  python benchmarks/train_step.py --presets small --batch 1 --screenshots 2 --screenshot-hw 1080,1920
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import traverse_util  # noqa: E402

from configs._common import base  # noqa: E402
from guijax import optim, train_step  # noqa: E402
from guijax.models import weights  # noqa: E402
from guijax.models.config import PRESETS, ModelConfig, VisionConfig, get_preset  # noqa: E402
from guijax.models.lora import is_adapter  # noqa: E402

QWEN_0_5B = "qwen2_5_0_5b"


def model_config(name: str) -> ModelConfig:
    """A preset by name, or the Qwen2.5-0.5B-shaped text model."""
    if name == QWEN_0_5B:
        return dataclasses.replace(
            get_preset("qwen2_5_vl_3b"),  # vocab 151936, tied embeddings, Qwen special-token ids
            hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
            num_key_value_heads=2, mrope_section=(8, 12, 12), max_position_embeddings=32768,
            vision=VisionConfig(depth=1, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=896,
                                fullatt_block_indexes=(0,)))
    return get_preset(name)


def param_counts(params: Any, cfg: ModelConfig) -> dict[str, int]:
    flat = traverse_util.flatten_dict(params)
    size = lambda pred: sum(math.prod(v.shape) for k, v in flat.items() if pred(k))  # noqa: E731
    total = size(lambda k: True)
    embed = size(lambda k: k[0] == "embed_tokens")
    head = size(lambda k: k[0] == "lm_head")
    vision = size(lambda k: k[0] == "visual")
    return {"total": total, "embedding": embed, "lm_head_untied": head, "vision": vision,
            "non_embedding": total - embed - head - vision, "adapters": size(is_adapter)}


def flops_per_token(cfg: ModelConfig, non_embedding: int, seq: int) -> dict[str, float]:
    dense = 6.0 * non_embedding
    head = 6.0 * cfg.hidden_size * cfg.vocab_size
    attention = 12.0 * cfg.num_hidden_layers * cfg.hidden_size * seq
    return {"dense": dense, "lm_head": head, "attention": attention, "total": dense + head + attention}


def make_batch(cfg: ModelConfig, batch: int, seq: int, seed: int = 0) -> dict[str, np.ndarray]:
    """A text-only GRPO batch in guijax.data's layout (targets = input_ids shifted left by one)."""
    rs = np.random.RandomState(seed)
    ids = rs.randint(0, cfg.vocab_size - 16, (batch, seq)).astype(np.int32)
    targets = np.concatenate([ids[:, 1:], np.zeros((batch, 1), np.int32)], axis=1)
    loss_mask = np.ones((batch, seq), np.float32)
    loss_mask[:, -1] = 0.0
    positions = np.broadcast_to(np.arange(seq, dtype=np.int32)[None, None], (3, batch, seq)).copy()
    old_logp = (-np.log(cfg.vocab_size) + 0.1 * rs.randn(batch, seq)).astype(np.float32) * loss_mask
    advantages = (rs.randn(batch, 1).astype(np.float32) * loss_mask)
    return {"input_ids": ids, "positions": positions, "attention_mask": np.ones((batch, seq), np.int32),
            "targets": targets, "loss_mask": loss_mask, "old_logp": old_logp, "advantages": advantages}


def screenshot_batch(cfg: ModelConfig, batch: int, screenshots: int, hw: tuple[int, int], response: int,
                     seq: int | None = None, seed: int = 0, hf_inputs: dict | None = None,
                     ) -> tuple[dict[str, Any], dict[str, int]]:
    """A GUI-step GRPO batch: each row holds `screenshots` images of `hw` (image-pad tokens between a vision
    start and end token, as the chat template writes them), text, and a `response`-token response (the only
    loss positions, listed in `response_positions` so the LM head runs there alone, as in the recipes); vision
    inputs from the real layout code. `hf_inputs`, if given, receives transformers' `pixel_values` (patches in
    the Qwen2-VL processor's order) and `image_grid_thw` for the same screenshots."""
    from guijax.aot import TEXT_TOKENS_PER_SCREENSHOT, UITARS_MAX_PIXELS
    from guijax.data.pipeline import response_positions
    from guijax.models.positions import mrope_positions, vision_layout
    from guijax.models.processor import smart_resize

    v = cfg.vision
    rh, rw = smart_resize(*hw, factor=v.patch_size * v.spatial_merge_size, max_pixels=UITARS_MAX_PIXELS)
    grid = (rh // v.patch_size, rw // v.patch_size)
    image_tokens = grid[0] * grid[1] // v.spatial_merge_size ** 2
    used = screenshots * (image_tokens + TEXT_TOKENS_PER_SCREENSHOT) + response
    seq = seq or -(-used // 1024) * 1024
    if used > seq:
        raise ValueError(f"{screenshots} screenshots of {hw[1]}x{hw[0]} and {response} response tokens need {used} "
                         f"tokens per row; --seq {seq} is too short")
    rs = np.random.RandomState(seed)
    ids = rs.randint(0, cfg.vocab_size - 16, (batch, seq)).astype(np.int32)
    # a random vision token outside the image spans would ask for image features no screenshot has
    ids[np.isin(ids, (cfg.image_token_id, cfg.video_token_id, cfg.vision_start_token_id,
                      cfg.vision_end_token_id))] = 0
    mask = np.zeros((batch, seq), np.int32)
    mask[:, :used] = 1
    for row in range(batch):
        for k in range(screenshots):
            start = k * (image_tokens + TEXT_TOKENS_PER_SCREENSHOT) + TEXT_TOKENS_PER_SCREENSHOT // 2
            ids[row, start:start + image_tokens] = cfg.image_token_id
            ids[row, start - 1], ids[row, start + image_tokens] = cfg.vision_start_token_id, cfg.vision_end_token_id
    ids[mask == 0] = 0
    grids = np.tile(np.asarray([[1, *grid]], np.int64), (batch * screenshots, 1))
    positions, _ = mrope_positions(ids, mask, grids, cfg)
    layout = vision_layout(grids, v)
    pixels = rs.randn(layout.num_patches, v.patch_dim).astype(np.float32)
    targets = np.concatenate([ids[:, 1:], np.zeros((batch, 1), np.int32)], axis=1)
    loss_mask = np.zeros((batch, seq), np.float32)
    loss_mask[:, used - response - 1:used - 1] = 1.0
    old_logp = (-np.log(cfg.vocab_size) + 0.1 * rs.randn(batch, seq)).astype(np.float32) * loss_mask
    advantages = rs.randn(batch, 1).astype(np.float32) * loss_mask
    data = {"input_ids": ids, "positions": np.asarray(positions, np.int32), "attention_mask": mask,
            "vision": layout.inputs(pixels), "targets": targets, "loss_mask": loss_mask, "old_logp": old_logp,
            "advantages": advantages, "response_positions": response_positions(loss_mask, budget=response)}
    if hf_inputs is not None:
        hf_inputs.update(pixel_values=pixels, image_grid_thw=grids)
    return data, {"seq": seq, "used_tokens": used, "image_tokens_per_screenshot": image_tokens,
                  "patches": int(layout.num_patches), "patch_grid": list(grid)}


def vision_flops(cfg: ModelConfig, vision_params: int, patches_per_image: int, images: int) -> float:
    """Vision-tower model FLOPs of one step (fwd + bwd) in the convention of `flops_per_token`."""
    v = cfg.vision
    unit = v.spatial_merge_size ** 2
    merger = (v.hidden_size * unit) ** 2 + v.hidden_size * unit * v.out_hidden_size
    patches = patches_per_image * images
    dense = 6.0 * (vision_params - merger) * patches + 6.0 * merger * patches / unit
    window = min((v.window_size // v.patch_size) ** 2, patches_per_image)
    attended = sum(patches_per_image if i in v.fullatt_block_indexes else window for i in range(v.depth))
    return dense + 12.0 * v.hidden_size * attended * patches


def optim_config(**overrides: Any):
    c = base("benchmark").optim
    for k, v in overrides.items():
        setattr(c, k, v)
    return c


def build(cfg: ModelConfig, dtype: str, remat: str = "none", seed: int = 0, attention_block: int = 512,
          scan_layers: bool = True, attention: str = "auto"):
    """(jitted step, fresh TrainState factory, params) on the real guijax code path; `attention` is the
    backend (guijax.models.attention.IMPLEMENTATIONS)."""
    module = weights.build_module(cfg, dtype=optim.resolve_dtype(dtype), param_dtype=jnp.float32,
                                  remat_policy=remat, attention_block=attention_block, scan_layers=scan_layers,
                                  attention_impl=attention)
    # Random init on the host: on an H100, XLA:GPU had not compiled the 0.5B model's jitted init after 2.5 min.
    with jax.default_device(jax.devices("cpu")[0]):
        params = weights.init_params(module, jax.random.PRNGKey(seed))
    params = jax.device_put(params, jax.devices()[0])
    tx, _ = optim.make_optimizer(optim_config())
    step = train_step.make_train_step(module, tx, train_step.StepConfig())
    init_state = jax.jit(lambda p: train_step.TrainState(p, tx.init(p), jnp.int32(0)))
    return module, step, init_state, params


def measure(name: str, batch: int, seq: int, dtype: str, repeats: int, peak: float, remat: str = "none",
            screenshots: int = 0, screenshot_hw: tuple[int, int] = (1080, 1920), response: int = 100,
            ) -> dict[str, Any]:
    cfg = model_config(name)
    _, step, init_state, params = build(cfg, dtype, remat)
    counts = param_counts(params, cfg)
    state = init_state(params)
    del params  # the step donates its state, which may share these buffers
    gui: dict[str, Any] = {}
    if screenshots:
        host, gui = screenshot_batch(cfg, batch, screenshots, screenshot_hw, response, seq or None)
        seq = gui["seq"]
    else:
        host = make_batch(cfg, batch, seq)
    data = jax.device_put(host)
    del host
    holder = {"state": state, "metrics": None}

    def call():
        holder["state"], holder["metrics"] = step(holder["state"], data)
        return holder["state"], holder["metrics"]

    t0 = time.perf_counter()
    jax.block_until_ready(call())  # compile + first step
    first_s = time.perf_counter() - t0
    times = bc.time_calls(call, repeats, warmup=0)
    skipped = int(holder["metrics"]["skipped"])
    loss = float(holder["metrics"]["loss"])
    holder.clear()  # the state and its buffers go now, not when the function returns
    t = bc.median(times)
    tokens = batch * seq
    fpt = flops_per_token(cfg, counts["non_embedding"], seq)
    step_flops = tokens * fpt["total"]
    if screenshots:  # the LM head runs at the response positions alone
        step_flops -= (tokens - batch * response) * fpt["lm_head"]
        gui["vision_flops"] = vision_flops(cfg, counts["vision"], gui["patches"] // (batch * screenshots),
                                           batch * screenshots)
        step_flops += gui["vision_flops"]
    model_flops_s = step_flops / t
    return {**({"screenshots": screenshots, "screenshot_hw": list(screenshot_hw), "response": response, **gui}
               if screenshots else {}),
        "preset": name, "batch": batch, "seq": seq, "tokens_per_step": tokens, "dtype": dtype, "remat": remat,
        "hidden": cfg.hidden_size, "layers": cfg.num_hidden_layers, "heads": cfg.num_attention_heads,
        "kv_heads": cfg.num_key_value_heads, "intermediate": cfg.intermediate_size, "vocab": cfg.vocab_size,
        "tied": cfg.tie_word_embeddings, "params": counts, "flops_per_token": fpt,
        "compile_and_first_step_s": round(first_s, 3), "times_s": [round(x, 5) for x in times],
        "step_s": round(t, 5), "tokens_per_s": tokens / t, "model_flops_per_s": model_flops_s,
        "mfu": model_flops_s / peak, "last_loss": loss, "last_skipped": skipped,
    }


def markdown(rows: list[dict], meta: dict) -> str:
    out = [f"Machine: {bc.machine_line(meta['machine'])}.",
           f"Peak for MFU: {meta['peak']['flops_per_s'] / 1e9:.1f} GFLOP/s ({meta['peak']['source']}).", "",
           "| preset | params (non-emb) | batch x seq | screenshots per row | dtype | step (s) | tokens/s | "
           "model TFLOP/s | MFU |",
           "|---|---:|---:|---|---|---:|---:|---:|---:|"]
    for r in rows:
        shots = (f"{r['screenshots']} x {r['screenshot_hw'][1]}x{r['screenshot_hw'][0]} ({r['patches']} patches)"
                 if r.get("screenshots") else "none")
        out.append(f"| {r['preset']} | {r['params']['total'] / 1e6:.1f}M ({r['params']['non_embedding'] / 1e6:.1f}M) | "
                   f"{r['batch']} x {r['seq']} | {shots} | {r['dtype']} | {r['step_s']:.4f} | {r['tokens_per_s']:,.0f} | "
                   f"{r['model_flops_per_s'] / 1e12:.4f} | {100 * r['mfu']:.1f}% |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", default=f"tiny,small,{QWEN_0_5B}",
                   help=f"comma-separated: {', '.join(PRESETS)}, {QWEN_0_5B}")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=None, help="tokens per row (default: 256, or with --screenshots "
                                                       "the smallest multiple of 1024 that holds the row)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default=None, help="compute dtype (default: float32 on CPU, bfloat16 else); "
                                                  "parameters and optimiser moments stay float32")
    p.add_argument("--remat", default="none", help="none | full | dots_saveable | attention_saveable")
    p.add_argument("--screenshots", type=int, default=0, help="screenshots per row (0: the text-only batch)")
    p.add_argument("--screenshot-hw", default="1080,1920", help="height,width of each screenshot")
    p.add_argument("--response", type=int, default=100, help="with --screenshots: response tokens per row")
    p.add_argument("--peak-repeats", type=int, default=5, help="CPU: timed calls of the peak matmul")
    p.add_argument("--peak-n", type=int, default=2048, help="CPU: size of the square peak matmul")
    p.add_argument("--json", default=None, help="default: results/train_step_BACKEND[_screenshots].json")
    p.add_argument("--markdown", default=None, help="default: results/train_step_BACKEND[_screenshots].md")
    a = p.parse_args(argv)
    stem = f"train_step_{bc.jax.default_backend()}" + ("_screenshots" if a.screenshots else "")
    a.json = a.json or str(bc.RESULTS / f"{stem}.json")
    a.markdown = a.markdown or str(bc.RESULTS / f"{stem}.md")
    dtype = a.dtype or bc.default_dtype()
    info = bc.machine_info()
    peak = bc.peak_flops(a.peak_n, a.peak_repeats)
    rows = []
    for name in [x for x in a.presets.split(",") if x]:
        hw = tuple(int(x) for x in a.screenshot_hw.split(","))
        r = measure(name, a.batch, a.seq or (0 if a.screenshots else 256), dtype, a.repeats, peak["flops_per_s"],
                    a.remat, a.screenshots, hw, a.response)
        print(f"{name}: {r['tokens_per_s']:,.0f} tokens/s, MFU {100 * r['mfu']:.1f}% "
              f"(step {r['step_s']:.4f}s, compile+first {r['compile_and_first_step_s']}s)", file=sys.stderr, flush=True)
        rows.append(r)
    meta = {"machine": info, "peak": peak, "command": bc.command_line("train_step.py", argv),
            "optimizer": "clip_by_global_norm(1.0) + guijax.optim.adamw, float32 moments",
            "flops_formula": "6*N_nonembed + 6*hidden*vocab + 12*layers*hidden*seq per token (with screenshots: "
                             "the 6*hidden*vocab head term at the response tokens alone, plus the vision tower)"}
    table = markdown(rows, meta)
    print(table)
    bc.write_outputs(a.json, a.markdown, {"meta": meta, "rows": rows}, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
