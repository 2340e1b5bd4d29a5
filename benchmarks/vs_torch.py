"""Benchmark: guijax vs PyTorch (transformers) on the same GRPO update, same model, same machine, same run.

Why: users choosing a trainer want to know what JAX buys on their hardware. The verdict printed checks
guijax >= 1.5x the tokens/s of PyTorch (the aim on accelerators; on a 2-core CPU the aim is >= 1.0x, read off
the ratio). The ratio depends on the host CPU: the machine line names its model and vector extensions.

Both sides train the same text-only Qwen2.5-VL (guijax.models.config preset -> `to_hf_dict()` ->
transformers `Qwen2_5_VLForConditionalGeneration`; the guijax parameters are converted from the torch
model's weights, and the two initial losses are compared as a check that the same computation runs):

  guijax:  guijax.train_step.make_train_step (fused chunked log-prob kernel, clipped GRPO loss) +
           guijax.optim.make_optimizer (clip_by_global_norm 1.0 + AdamW), jitted, float32.
  PyTorch: eager transformers forward (attention per --attn, default sdpa) -> logits -> log_softmax + gather,
           ratio = exp(logp - old), loss = -token-mean over the mask of min(r*A, clip(r, 1-0.2, 1+0.3)*A),
           backward, clip_grad_norm_(1.0), torch.optim.AdamW; float32, torch.set_num_threads(os.cpu_count()).

Both get identical batches (random tokens, every position a response token but the last) and the same
AdamW hyper-parameters. On text rows torch's vision tower gets no gradient and its AdamW skips it, so
guijax holds the tower frozen (`model.frozen`): the same update. One untimed step each (compilation /
optimiser-state creation), then --repeats timed steps, alternating guijax and torch so a change in machine
load hits both alike; the figure is the median. tokens/s = batch * seq / step time. Process CPU seconds per
step are recorded too (less sensitive to other load, but they include spin-waiting threads). Measure on a
quiet machine: under load, torch's OpenMP threads stall at barriers (seen on a shared 2-core box: 0.7 s to
9 s for the same step) and the ratio means nothing; `--threads 1` under `taskset -c 0` gives a per-core comparison.

  python benchmarks/vs_torch.py --preset small --batch 4 --seq 256 --repeats 7

On a GPU both run there (`--device cuda`), normally with `--dtype bfloat16`: guijax computes in bf16 with
(by default) fp32 parameters and moments, torch runs its forward under `torch.autocast(bfloat16)` with the same;
each timed torch step ends with `torch.cuda.synchronize()`.

GUI rows (`--screenshots K`): each row holds K screenshots with their image tokens, text and a response that
alone carries the loss (benchmarks/train_step.py's GUI batch); transformers gets the screenshots' patches and
grids and computes its own M-RoPE positions, so the initial losses agreeing checks both sides see the same
rows. Torch takes each row's real tokens only and runs its head on the response (`logits_to_keep`); guijax
pads rows to its length bucket and runs its head at the response positions. Models of 3B and more do not fit
one GPU twice in fp32: `--param-dtype bfloat16` keeps parameters and AdamW moments in bf16 on both sides and
`--sequential` times torch first, gives its memory back, then guijax.

  python benchmarks/vs_torch.py --device cuda --dtype bfloat16 --preset qwen2_5_0_5b --batch 1 \
      --screenshots 3 --remat full --repeats 4
  python benchmarks/vs_torch.py --device cuda --dtype bfloat16 --param-dtype bfloat16 --sequential \
      --preset qwen2_5_vl_3b --batch 1 --screenshots 5 --remat full --torch-checkpointing --repeats 3
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import os
import sys
import time
from typing import Any

# On a GPU both frameworks share the card: without this, JAX takes 75% of its memory up front (the 0.5B torch
# step then ran out of memory on an H100).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402
import train_step as ts_bench  # noqa: E402  (benchmarks/train_step.py)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from guijax import optim, train_step  # noqa: E402
from guijax.models import weights  # noqa: E402
from guijax.models.config import ModelConfig  # noqa: E402

EPS_LOW, EPS_HIGH = 0.2, 0.3  # guijax.losses.ClipConfig defaults
TARGET_RATIO = 1.5


def torch_model(cfg: ModelConfig, attn: str, seed: int = 0):
    import torch
    import transformers

    torch.manual_seed(seed)
    hf_cfg = transformers.Qwen2_5_VLConfig(**cfg.to_hf_dict())
    hf_cfg._attn_implementation = attn
    model = transformers.Qwen2_5_VLForConditionalGeneration(hf_cfg).float().train()
    return model


def params_from_torch(model, module) -> Any:
    """guijax parameters holding the torch model's weights (transformers 5 in-memory names; per-layer
    tensors stacked into the scanned layers by the checkpoint loader)."""
    sd = {k: v.detach().cpu().numpy() for k, v in model.state_dict().items()}
    return weights.load_tensors(weights.ArrayReader(sd), module, origin="torch model")


def torch_grpo_loss(model, batch: dict):
    """Text rows: logits at every position, the loss where `loss_mask` says. GUI rows (`pixel_values` in the
    batch) carry only their real tokens (no padding) and the head runs on the response alone
    (`logits_to_keep`), the strongest way transformers offers to do the same work."""
    import torch

    if "pixel_values" in batch:
        extra = {k: batch[k] for k in ("pixel_values", "image_grid_thw", "mm_token_type_ids") if k in batch}
        width = batch["targets"].shape[1]  # the response, at the end of each row
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], **extra,
                       logits_to_keep=width + 1).logits[:, :width]
    else:
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, batch["targets"].unsqueeze(-1)).squeeze(-1)
    mask, adv = batch["loss_mask"], batch["advantages"]
    ratio = torch.exp((logp - batch["old_logp"]) * mask)
    surrogate = torch.minimum(ratio * adv, torch.clamp(ratio, 1 - EPS_LOW, 1 + EPS_HIGH) * adv)
    return -(surrogate * mask).sum() / mask.sum().clamp(min=1.0)


def torch_gui_batch(model, np_batch: dict, hf: dict, used: int, response: int) -> dict[str, np.ndarray]:
    """The GUI rows as transformers takes them: the `used` real tokens of each row, the screenshots' patches
    and grids, and the loss inputs of the `response` positions that end each row."""
    import inspect

    loss = slice(used - response - 1, used - 1)  # where screenshot_batch puts the loss mask
    out = {"input_ids": np_batch["input_ids"][:, :used], "attention_mask": np_batch["attention_mask"][:, :used],
           "pixel_values": hf["pixel_values"], "image_grid_thw": hf["image_grid_thw"],
           **{k: np_batch[k][:, loss] for k in ("targets", "loss_mask", "old_logp", "advantages")}}
    if not (out["loss_mask"] == 1).all() or np_batch["loss_mask"].sum() != out["loss_mask"].size:
        raise AssertionError("the GUI batch's loss positions are not the last response tokens of each row")
    if "mm_token_type_ids" in inspect.signature(model.forward).parameters:  # transformers >= 5.2x asks for it
        out["mm_token_type_ids"] = (out["input_ids"] == model.config.image_token_id).astype(np.int64)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="small", help="a guijax preset or qwen2_5_0_5b")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=0, help="tokens per row (default: 256, or with --screenshots the "
                                                      "smallest multiple of 1024 that holds the row)")
    p.add_argument("--screenshots", type=int, default=0, help="screenshots per row (0: the text-only batch)")
    p.add_argument("--screenshot-hw", default="1080,1920", help="height,width of each screenshot")
    p.add_argument("--response", type=int, default=100, help="with --screenshots: response tokens per row")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--remat", default="none", help="guijax's remat policy: none | full | dots_saveable | ...")
    p.add_argument("--torch-checkpointing", action="store_true",
                   help="torch recomputes each decoder layer in the backward (transformers' gradient checkpointing)")
    p.add_argument("--attn", default="sdpa", help="transformers attention implementation: sdpa | eager")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: os.cpu_count())")
    p.add_argument("--device", default="cpu", help="torch device: cpu | cuda (guijax uses jax's default backend)")
    p.add_argument("--dtype", default="float32", help="compute dtype of both sides: float32 | bfloat16")
    p.add_argument("--param-dtype", default="float32",
                   help="parameters and AdamW moments on both sides: float32 | bfloat16 (what a 3B/7B needs on one GPU)")
    p.add_argument("--sequential", action="store_true",
                   help="torch's timed steps first, its device memory freed, then guijax's (models too large to "
                        "share one GPU); default: the two alternate step by step")
    p.add_argument("--attention", default="auto", choices=("auto", "cudnn", "xla"),
                   help="guijax's attention backend (the recipes' model.attention): auto on a GPU checks at run time, "
                        "in a lax.cond per call, that the rows suit cuDNN; cudnn skips that check (rows that do not "
                        "suit it give NaN)")
    p.add_argument("--layers", default="scan", choices=("scan", "unrolled"),
                   help="guijax's decoder layers under scan or unrolled (the recipes' model.scan_layers)")
    p.add_argument("--json", default=str(bc.RESULTS / f"vs_torch_{bc.jax.default_backend()}.json"))
    p.add_argument("--markdown", default=str(bc.RESULTS / f"vs_torch_{bc.jax.default_backend()}.md"))
    a = p.parse_args(argv)

    import torch
    import transformers

    threads = a.threads or os.cpu_count()
    torch.set_num_threads(threads)
    info = bc.machine_info()
    cfg = ts_bench.model_config(a.preset)
    hf: dict[str, np.ndarray] = {}
    if a.screenshots:
        hw = tuple(int(x) for x in a.screenshot_hw.split(","))
        np_batch, gui = ts_bench.screenshot_batch(cfg, a.batch, a.screenshots, hw, a.response, a.seq or None,
                                                  hf_inputs=hf)
        seq, used = gui["seq"], gui["used_tokens"]
    else:
        seq, gui = a.seq or 256, {}
        np_batch = ts_bench.make_batch(cfg, a.batch, seq)
        used = seq
    tokens = a.batch * used  # real tokens: guijax's rows are padded to `seq`, torch's are not

    # ---------------------------------------------------------------- models with the same weights
    if a.dtype not in ("float32", "bfloat16") or a.param_dtype not in ("float32", "bfloat16"):
        raise SystemExit(f"--dtype and --param-dtype take float32 or bfloat16, got {a.dtype!r}, {a.param_dtype!r}")
    if a.device == "cuda" and info["backend"] != "gpu":
        raise SystemExit(f"--device cuda needs jax on a GPU too (jax backend: {info['backend']})")
    optim_cfg = ts_bench.optim_config(state_dtype=a.param_dtype)
    model = torch_model(cfg, a.attn)
    torch_params = sum(q.numel() for q in model.parameters())
    # On text rows torch's vision tower gets no gradient, and torch's AdamW skips a parameter without one (no
    # moment update, no weight decay); the same update in guijax holds the tower frozen. GUI rows train it on
    # both sides.
    frozen = () if a.screenshots else ("visual",)
    module = weights.build_module(cfg, dtype=jnp.dtype(a.dtype), param_dtype=jnp.dtype(a.param_dtype),
                                  scan_layers=a.layers == "scan", remat_policy=a.remat, attention_impl=a.attention,
                                  frozen=frozen)
    host_params = params_from_torch(model, module)  # on the host: the torch model may leave the device first
    if a.param_dtype == "bfloat16":  # torch's AdamW keeps its moments in the parameters' dtype, as guijax does here
        model = model.to(torch.bfloat16)
    model = model.to(a.device)
    autocast = (torch.autocast(a.device, dtype=torch.bfloat16) if a.dtype == "bfloat16"
                else contextlib.nullcontext())
    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)
    if a.torch_checkpointing:
        model.gradient_checkpointing_enable()
    torch_np = (torch_gui_batch(model, np_batch, hf, used, a.response) if a.screenshots
                else {k: v for k, v in np_batch.items() if k != "positions"})
    t_batch = {k: torch.from_numpy(v.astype(np.int64) if v.dtype == np.int32 else v).to(a.device)
               for k, v in torch_np.items()}
    del torch_np, hf
    with torch.no_grad(), autocast:
        loss0_torch = float(torch_grpo_loss(model, t_batch))

    # ---------------------------------------------------------------- torch step
    opt = torch.optim.AdamW(model.parameters(), lr=optim_cfg.learning_rate, betas=(optim_cfg.b1, optim_cfg.b2),
                            eps=optim_cfg.eps, weight_decay=optim_cfg.weight_decay)
    trainable = [q for q in model.parameters() if q.requires_grad]

    def torch_step():
        opt.zero_grad(set_to_none=True)
        with autocast:
            loss = torch_grpo_loss(model, t_batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, optim_cfg.max_grad_norm)
        opt.step()
        sync()
        return loss

    def torch_timed(times: list, cpu: list) -> None:
        t0, c0 = time.perf_counter(), time.process_time()
        torch_step()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)

    jax_times, torch_times, jax_cpu, torch_cpu = [], [], [], []
    t0 = time.perf_counter()
    torch_step()
    torch_first = time.perf_counter() - t0
    if a.sequential:  # torch's steps first, then its memory goes back to the device for guijax's
        for _ in range(a.repeats):
            torch_timed(torch_times, torch_cpu)
        del model, opt, trainable, t_batch
        gc.collect()
        if a.device == "cuda":
            torch.cuda.empty_cache()

    # ---------------------------------------------------------------- guijax step
    step_cfg = train_step.StepConfig()
    params = jax.device_put(host_params, jax.devices()[0])
    del host_params
    loss0_jax = float(jax.jit(lambda p, b: train_step.loss_fn(p, b, module, step_cfg)[0])(params, np_batch))
    tx, _ = optim.make_optimizer(optim_cfg)
    step = train_step.make_train_step(module, tx, step_cfg)
    holder = {"state": train_step.init_state(module, params, tx)}
    del params
    j_batch = jax.device_put(np_batch)

    def jax_step():
        holder["state"], m = step(holder["state"], j_batch)
        return m

    def jax_timed(times: list, cpu: list) -> None:
        c0 = time.process_time()
        times += bc.time_calls(jax_step, 1, warmup=0)
        cpu.append(time.process_time() - c0)

    t0 = time.perf_counter()
    jax.block_until_ready(jax_step())
    jax_first = time.perf_counter() - t0
    for _ in range(a.repeats):
        jax_timed(jax_times, jax_cpu)
        if not a.sequential:  # alternate, so load changes on a shared machine hit both sides alike
            torch_timed(torch_times, torch_cpu)

    jt, tt = bc.median(jax_times), bc.median(torch_times)
    ratio = tt / jt
    target_applies = a.preset == "small" and info["backend"] == "cpu"
    result = {
        "guijax_tokens_per_s": tokens / jt, "torch_tokens_per_s": tokens / tt, "ratio": ratio,
        "target": f">= {TARGET_RATIO}x torch on CPU, small preset",
        "target_met": (ratio >= TARGET_RATIO) if target_applies else None,
        "preset": a.preset, "batch": a.batch, "seq": seq, "tokens_per_step": tokens, "dtype": a.dtype,
        **({"screenshots": a.screenshots, "screenshot_hw": list(hw), "response": a.response,
            "used_tokens_per_row": used, "patches": gui["patches"], "image_tokens_per_screenshot":
            gui["image_tokens_per_screenshot"]} if a.screenshots else {}),
        "layers": a.layers, "guijax_frozen": list(frozen), "remat": a.remat, "attention": a.attention,
        "torch_checkpointing": a.torch_checkpointing,
        "param_dtype": a.param_dtype, "sequential": a.sequential,
        "torch_device": a.device,
        "model": {"hidden": cfg.hidden_size, "layers": cfg.num_hidden_layers, "heads": cfg.num_attention_heads,
                  "kv_heads": cfg.num_key_value_heads, "intermediate": cfg.intermediate_size,
                  "vocab": cfg.vocab_size, "tied": cfg.tie_word_embeddings,
                  "torch_params": torch_params},
        "guijax_step_s": jt, "torch_step_s": tt, "guijax_times_s": [round(x, 5) for x in jax_times],
        "torch_times_s": [round(x, 5) for x in torch_times],
        # process CPU seconds per step (all threads): less sensitive to other load than wall time, but
        # includes spin-waiting threads
        "guijax_cpu_s_per_step": bc.median(jax_cpu), "torch_cpu_s_per_step": bc.median(torch_cpu), "guijax_first_step_s": round(jax_first, 3),
        "torch_first_step_s": round(torch_first, 3), "initial_loss_guijax": loss0_jax,
        "initial_loss_torch": loss0_torch, "initial_loss_abs_diff": abs(loss0_jax - loss0_torch),
        "torch_threads": threads, "torch_attn": a.attn, "torch": torch.__version__,
        "transformers": transformers.__version__, "machine": info, "repeats": a.repeats,
        "command": bc.command_line("vs_torch.py", argv),
    }
    verdict = ("n/a (target is for the small preset on CPU)" if result["target_met"] is None
               else "MET" if result["target_met"] else "NOT met")
    table = "\n".join([
        f"Machine: {bc.machine_line(info)}; torch {torch.__version__} ({threads} threads, attn {a.attn}).",
        f"Preset {a.preset}, batch {a.batch} x seq {seq}, {a.dtype} compute, {a.param_dtype} parameters and "
        f"moments, torch on {a.device}, GRPO update incl. AdamW; median of {a.repeats}"
        f"{', torch first then guijax' if a.sequential else ', the two alternating'}." + (
            f" Each row a GUI step: {a.screenshots} screenshots of {hw[1]}x{hw[0]} ({gui['patches']} patches, "
            f"{gui['image_tokens_per_screenshot']} image tokens each), {used} real tokens, a {a.response}-token "
            f"response; guijax pads rows to {seq}, torch takes the {used} real tokens; tokens/s counts real tokens; "
            f"both run the LM head on the response alone." if a.screenshots else ""),
        "",
        "| trainer | step (s) | tokens/s | CPU s per step |",
        "|---|---:|---:|---:|",
        f"| guijax (JAX {jax.__version__}, layers {a.layers}, remat {a.remat}"
        f"{'' if a.attention == 'auto' else ', attention ' + a.attention}) | {jt:.4f} | {tokens / jt:,.0f} | "
        f"{bc.median(jax_cpu):.3f} |",
        f"| PyTorch {torch.__version__} + transformers {transformers.__version__}"
        f"{', gradient checkpointing' if a.torch_checkpointing else ''} | {tt:.4f} | {tokens / tt:,.0f} | "
        f"{bc.median(torch_cpu):.3f} |",
        "",
        f"guijax / torch = {ratio:.2f}x; target >= {TARGET_RATIO}x: {verdict}. "
        f"Initial losses agree to {result['initial_loss_abs_diff']:.1e}.",
    ])
    print(table)
    bc.write_outputs(a.json, a.markdown, result, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
