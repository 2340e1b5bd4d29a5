"""Benchmark: the rollout side of a GRPO run: environment speed, sampler speed, and one trainer iteration.

Why: in agentic RL the update is often not the bottleneck; what users need to know is how many episodes
an hour a trainer turns over and how much of that time it sits waiting on environments.

(a) env: synthetic-desk environment steps/s on ONE core (benchmarks/desk_speed.py's loop: a random click /
    type / scroll / key per step, screenshot rendering + a11y tree included), with this process pinned to
    one CPU for the measurement and its affinity restored afterwards.
(b) sampler: guijax.sampling.Sampler tokens/s at each --batches size with --sampler-preset (weights and
    compute in --sampler-dtype), text-only prompts of --prompt-len random tokens, --new-tokens sampled per
    row (temperature 1, no stop token, so every row generates them all). tokens/s = batch * new_tokens /
    its generation program's time (prefill included); a second sampler with max_new_tokens=1 times the
    prefill, so decode tokens/s = batch * (new - 1) / (t_generate - t_prefill). Both programs are compiled
    ahead of time (their compile seconds are reported), so no untimed call runs a long prefill just to
    compile; median of --repeats. Batch sizes are powers of two (the sampler pads to one).
    On a GPU/TPU whose spec-sheet HBM bandwidth is known, decode is set against its roofline: a decode step
    reads every decoder and LM-head weight once and each row's KV cache (prompt + half the new tokens on
    average), so batch / (those bytes / bandwidth) tokens/s is the most any sampler can reach. Decode cost
    depends on the KV length, not on what the prompt holds, so a text prompt as long as a screenshot prompt
    (5 full-HD screenshots: about 13,900 tokens) measures a GUI decode; its prefill skips the vision tower.

  python benchmarks/rollout.py --parts sampler --sampler-preset qwen2_5_vl_7b --sampler-dtype bfloat16 \
      --batches 8,64 --prompt-len 13952 --new-tokens 256 --prefill-rows 8 --repeats 1
(c) e2e: a fresh tiny checkpoint, desk tasks and (optionally, --sft-steps) a scripted-expert SFT warm start
    via guijax.pipeline, then guijax.trainer.Trainer.iterate() --warmup-iterations times untimed and once
    timed. Figures come from the metrics the trainer already logs: episodes/hour = episodes * 3600 /
    time_iteration_s; the rollout engine is synchronous (the trainer thread blocks inside every EnvPool
    reset / step / evaluate call while the worker processes run), so its `time_env_s` IS the time the
    trainer waits on environments, and the wait fraction = time_env_s / time_iteration_s. The rest splits
    into time_sampling_s, time_store_s, time_old_logprobs_s, time_update_s and "other" (prompt building,
    processor, grouping; the remainder). XLA compile seconds inside the timed iteration are counted with a
    jax.monitoring listener and reported, with episodes/hour and the wait fraction recomputed without them
    (new prompt buckets, sampler batch sizes, or the first update compile on first use; a random policy's
    iterations often skip the update, so the warm-up may not have compiled it).

  python benchmarks/rollout.py --env-steps 5000 --batches 8,32,128 --repeats 5 --e2e-workers 8 \
      --e2e-group-size 4 --e2e-tasks 2 --e2e-step-limit 6 --sft-steps 300 --warmup-iterations 2
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import pathlib
import sys
import tempfile
import time
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

_COMPILE = {"seconds": 0.0, "count": 0}


def _on_event(name: str, seconds: float, **_: Any) -> None:
    if name == "/jax/core/compile/backend_compile_duration":
        _COMPILE["seconds"] += seconds
        _COMPILE["count"] += 1


jax.monitoring.register_event_duration_secs_listener(_on_event)


@contextlib.contextmanager
def one_core():
    if not hasattr(os, "sched_setaffinity"):
        yield None
        return
    before = os.sched_getaffinity(0)
    core = sorted(before)[0]
    os.sched_setaffinity(0, {core})
    try:
        yield core
    finally:
        os.sched_setaffinity(0, before)


# ---------------------------------------------------------------------------- (a) environment
def bench_env(steps: int) -> dict[str, Any]:
    import desk_speed

    with one_core() as core:
        desk_speed.measure(min(steps, 200))  # warm caches / imports
        result = desk_speed.measure(steps)
    result["core"] = core
    return result


# ---------------------------------------------------------------------------- (b) sampler
def decode_bytes_per_step(cfg, params: Any, batch: int, kv_tokens: float, cache_itemsize: int) -> dict[str, float]:
    """Bytes one decode step must read from memory at least: every decoder and LM-head weight once (the vision
    tower and the embedding table's lookup rows aside; a tied head reads the table once, as the head), and
    each row's KV cache of `kv_tokens` positions. A decode step at batch b can be no faster than that over
    the memory bandwidth: its roofline."""
    from flax import traverse_util
    import flax.linen as nn

    flat = traverse_util.flatten_dict(nn.unbox(params))
    weights = sum(v.size * v.dtype.itemsize for k, v in flat.items()
                  if k[0] != "visual" and not (k[0] == "embed_tokens" and not cfg.tie_word_embeddings))
    kv = batch * kv_tokens * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * cache_itemsize
    return {"weights": float(weights), "kv_cache": float(kv), "total": float(weights + kv)}


def bench_sampler(preset: str, batches: list[int], prompt_len: int, new_tokens: int, repeats: int,
                  dtype: str = "float32", prefill_rows: int = 0,
                  on_row: Callable[[list[dict[str, Any]]], None] = lambda rows: None) -> list[dict[str, Any]]:
    """Sampler speed per batch size; on a GPU/TPU with a known spec bandwidth, decode against its roofline.
    `on_row` gets the rows so far after each batch size (a 7B run is long: what finished is kept)."""
    from guijax.models import weights
    from guijax.models.config import get_preset
    from guijax.sampling import Sampler, SamplingConfig, vision_placeholder_ids

    cfg = get_preset(preset)
    jdtype = jnp.dtype(dtype)
    module = weights.build_module(cfg, dtype=jdtype, param_dtype=jdtype)
    with jax.default_device(jax.devices("cpu")[0]):  # XLA:GPU compiles a 7B jitted init for minutes
        params = weights.init_params(module, jax.random.PRNGKey(0))
    params = jax.device_put(params, jax.devices()[0])
    bandwidth = bc.spec_bandwidth(jax.devices()[0].device_kind) if jax.default_backend() != "cpu" else None
    common = dict(temperature=1.0, stop_token_ids=(-1,), prompt_buckets=(prompt_len,), prefill_rows=prefill_rows)
    full = Sampler(module, SamplingConfig(max_new_tokens=new_tokens, **common))
    prefill = Sampler(module, SamplingConfig(max_new_tokens=1, **common))
    rs = np.random.RandomState(0)
    rows = []
    for b in batches:
        ids = rs.randint(0, cfg.vocab_size - 16, (b, prompt_len)).astype(np.int32)
        ids[np.isin(ids, vision_placeholder_ids(cfg))] = 0  # text prompts: no image-pad token without its image
        if b & (b - 1):
            raise SystemExit(f"--batches: {b} is not a power of two (the sampler pads batches to one)")
        print(f"sampler batch {b}: compiling and timing", file=sys.stderr, flush=True)
        key = jax.random.PRNGKey(b)

        def compiled(sampler):  # compiled ahead of time, so no untimed call runs a (long) prefill to compile
            args = jax.device_put((params, *sampler.inputs(ids), key))
            t0 = time.perf_counter()
            program = sampler.program(len(ids)).lower(*args).compile()
            return (lambda: program(*args)), time.perf_counter() - t0

        try:
            run_full, compile_full = compiled(full)
            t_full = bc.time_calls(run_full, repeats, warmup=0)
            run_pre, compile_pre = compiled(prefill)
            t_pre = bc.time_calls(run_pre, repeats, warmup=0)
        except jax.errors.JaxRuntimeError as err:  # a batch too large for the device: say so, keep the others
            if "RESOURCE_EXHAUSTED" not in str(err):
                raise
            rows.append({"batch": b, "prompt_len": prompt_len, "new_tokens": new_tokens, "dtype": dtype,
                         "prefill_rows": prefill_rows, "error": str(err).splitlines()[0]})
            on_row(rows)
            continue
        generated = b * new_tokens  # no stop token: every row generates them all
        tf, tp = bc.median(t_full), bc.median(t_pre)
        decode = b * (new_tokens - 1) / (tf - tp) if tf > tp and new_tokens > 1 else None
        need = decode_bytes_per_step(cfg, params, b, prompt_len + new_tokens / 2, jnp.dtype(full.cache_dtype).itemsize)
        roofline = b * bandwidth / need["total"] if bandwidth else None
        rows.append({"batch": b, "prompt_len": prompt_len, "new_tokens": new_tokens, "generated": generated,
                     "prefill_rows": prefill_rows,
                     "dtype": dtype, "generate_s": tf, "prefill_s": tp, "times_s": [round(x, 5) for x in t_full],
                     "tokens_per_s": generated / tf, "decode_tokens_per_s": decode,
                     "compile_s": {"generate": compile_full, "prefill": compile_pre},
                     "decode_bytes_per_step": need, "hbm_bytes_per_s": bandwidth,
                     "roofline_decode_tokens_per_s": roofline,
                     "roofline_fraction": decode / roofline if decode and roofline else None})
        on_row(rows)
    return rows


# ---------------------------------------------------------------------------- (c) end to end
def e2e_config(a: argparse.Namespace):
    from configs._common import base

    c = base("bench_rollout")
    c.model.preset = a.e2e_preset
    c.model.tokenizer_vocab = 1024 if a.e2e_preset == "tiny" else 0
    c.model.image_max_pixels = 112 * 112
    c.env.families = ("click_button", "toggle_checkbox")
    c.env.num_tasks = 8
    c.env.num_workers = a.e2e_workers
    c.env.step_limit = a.e2e_step_limit
    c.rollout.prompt = "compact"
    c.rollout.max_images = 1
    c.rollout.group_size = a.e2e_group_size
    c.rollout.tasks_per_iteration = a.e2e_tasks
    c.rollout.max_new_tokens = a.e2e_max_new_tokens
    c.rollout.temperature = a.e2e_temperature
    c.rollout.backend = a.e2e_backend
    c.pipeline.length_buckets = (192, 256, 384, 512)
    c.pipeline.patch_bucket = 64
    c.train.iterations = a.warmup_iterations + 1
    c.sft.steps = a.sft_steps
    c.sft.batch_size = 4
    c.sft.learning_rate = 1e-3
    return c


def bench_e2e(a: argparse.Namespace, workdir: pathlib.Path) -> dict[str, Any]:
    from guijax.methods import get_method
    from guijax.pipeline import base_stages as stages
    from guijax.pipeline.run import Run
    from guijax.trainer import Components, Trainer

    config = e2e_config(a)
    run = Run(config, workdir)
    trainer = None
    try:
        t0 = time.perf_counter()
        stages.base_model.fn(run)
        stages.tasks.fn(run)
        if a.sft_steps:
            stages.sft.fn(run)
        setup_s = time.perf_counter() - t0
        policy = run.load_policy(stages.policy_dir(run))
        method = get_method(config.method, config)
        parts = Components(policy, run.pool(), policy.processor, run.tasks()["train"], lambda score: method.hook(
            stages.method_context(run, config, workdir, method.name)), method.objective(), run.system_prompt,
            run.mesh(), streams=run.streams)
        trainer = Trainer(config, workdir, parts)
        trainer.engine.config = dataclasses.replace(trainer.engine.config, show_progress=False)
        engine_runs: list[tuple[list, dict]] = []
        engine_run = trainer.engine.run

        def keep_engine_timings(*args, **kwargs):  # the engine's own timings, of which the trainer logs a part
            out = engine_run(*args, **kwargs)
            engine_runs.append(out)
            return out

        trainer.engine.run = keep_engine_timings
        warm = [trainer.iterate() for _ in range(a.warmup_iterations)]
        compile_before = dict(_COMPILE)
        m = trainer.iterate()
        rollouts, timing = engine_runs[-1]
        compile_s = _COMPILE["seconds"] - compile_before["seconds"]
        compiles = _COMPILE["count"] - compile_before["count"]
    finally:
        if trainer is not None:
            trainer.close()
        run.close()
    it = m["time_iteration_s"]
    parts_s = {k: m.get(k, 0.0) for k in ("time_env_s", "time_sampling_s", "time_weight_sync_s", "time_store_s",
                                          "time_old_logprobs_s", "time_update_s")}
    other = it - sum(parts_s.values())
    return {
        "preset": a.e2e_preset, "backend": a.e2e_backend, "weight_sync_bytes": m.get("weight_sync_bytes", 0),
        "workers": a.e2e_workers, "group_size": a.e2e_group_size,
        "tasks_per_iteration": a.e2e_tasks, "step_limit": a.e2e_step_limit, "max_new_tokens": a.e2e_max_new_tokens,
        "sft_steps": a.sft_steps, "warmup_iterations": a.warmup_iterations, "setup_s": setup_s,
        "episodes": m["episodes"], "time_iteration_s": it, **parts_s, "time_other_s": other,
        "episodes_per_hour": m["episodes"] * 3600.0 / it,
        "env_wait_fraction": m["time_env_s"] / it,
        "sampling_fraction": m["time_sampling_s"] / it,
        # compile time falls inside sampling / old log-probs / update; subtracting it from the wall time
        # approximates a long run's steady state, where every shape has been compiled
        "episodes_per_hour_excluding_compile": m["episodes"] * 3600.0 / max(it - compile_s, 1e-9),
        "env_wait_fraction_excluding_compile": m["time_env_s"] / max(it - compile_s, 1e-9),
        "update_ran": "time_update_s" in m, "trained_tokens": m.get("trained_tokens", 0.0),
        "compile_s_in_timed_iteration": compile_s, "compiles_in_timed_iteration": compiles,
        "env_steps": timing["steps"], "steps_per_episode": timing["steps"] / max(len(rollouts), 1),
        "sampled_tokens": timing["sampled_tokens"], "rollout_wall_s": timing["wall_s"],
        "statuses": {s: sum(t.status.value == s for t in rollouts) for s in sorted({t.status.value for t in rollouts})},
        "success_rate": m["success_rate"], "format_error_rate": m["format_error_rate"],
        "response_tokens_mean": m["response_tokens_mean"],
        "warmup_time_iteration_s": [w["time_iteration_s"] for w in warm],
        "trainer_metrics": {k: v for k, v in m.items() if isinstance(v, (int, float))},
    }


# ---------------------------------------------------------------------------- report
def markdown(res: dict[str, Any]) -> str:
    out = [f"Machine: {bc.machine_line(res['machine'])}.", ""]
    if res.get("env"):
        e = res["env"]
        out += [f"**(a) synthetic desk** {e['screen'][1]}x{e['screen'][0]}: {e['steps_per_second_per_core']:,.0f} "
                f"env steps/s on one core ({e['steps']} steps, rendering + a11y tree).", ""]
    if res.get("sampler"):
        s = res["sampler"]
        out += [f"**(b) sampler**, {res['sampler_preset']} preset, prompt {s[0]['prompt_len']} tokens, "
                f"{s[0]['new_tokens']} new tokens per row"
                + (f", prefill {s[0]['prefill_rows']} rows at a time" if s[0].get("prefill_rows") else "") + ":", "",
                "| batch | generate (s) | tokens/s | prefill (s) | decode tokens/s | decode roofline (HBM) | of roofline |",
                "|---:|---:|---:|---:|---:|---:|---:|"]
        for r in s:
            if "error" in r:
                out.append(f"| {r['batch']} | {r['error'][:120]} | | | | | |")
                continue
            dec = "–" if r["decode_tokens_per_s"] is None else f"{r['decode_tokens_per_s']:,.0f}"
            roof = r.get("roofline_decode_tokens_per_s")
            frac = r.get("roofline_fraction")
            out.append(f"| {r['batch']} | {r['generate_s']:.4f} | {r['tokens_per_s']:,.0f} | {r['prefill_s']:.4f} | {dec} | "
                       f"{'–' if roof is None else f'{roof:,.0f}'} | {'–' if frac is None else f'{100 * frac:.0f}%'} |")
        out.append("")
    if res.get("e2e"):
        e = res["e2e"]
        it = e["time_iteration_s"]
        pct = lambda x: f"{100 * x / it:.0f}%"  # noqa: E731
        out += [f"**(c) one GRPO iteration**, {e['preset']} preset, {e['episodes']} episodes "
                f"({e['tasks_per_iteration']} tasks x {e['group_size']}), {e['workers']} env workers, step limit "
                f"{e['step_limit']}, SFT warm start {e['sft_steps']} steps, after {e['warmup_iterations']} untimed "
                f"iteration(s):", "",
                "| rollout backend | episodes/hour | iteration (s) | waiting on envs | sampling | weight sync | update | "
                "old log-probs | store | other |",
                "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
                f"| {e.get('backend', 'jax')} | {e['episodes_per_hour']:,.0f} | {it:.2f} | {pct(e['time_env_s'])} | "
                f"{pct(e['time_sampling_s'])} | {pct(e.get('time_weight_sync_s', 0.0))} | "
                f"{pct(e['time_update_s'])} | {pct(e['time_old_logprobs_s'])} | {pct(e['time_store_s'])} | "
                f"{pct(e['time_other_s'])} |", "",
                f"Update ran: {e['update_ran']} ({e['trained_tokens']:.0f} tokens); XLA compile inside the timed "
                f"iteration: {e['compile_s_in_timed_iteration']:.1f}s ({e['compiles_in_timed_iteration']} programs; without "
                f"it: {e['episodes_per_hour_excluding_compile']:,.0f} episodes/hour, "
                f"{100 * e['env_wait_fraction_excluding_compile']:.0f}% waiting on envs); "
                f"{e['env_steps']} env steps ({e['steps_per_episode']:.1f} per episode), {e['sampled_tokens']} sampled "
                f"tokens; format-error rate {e['format_error_rate']:.2f}, success rate {e['success_rate']:.2f}."]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default="env,sampler,e2e", help="any of env, sampler, e2e")
    p.add_argument("--env-steps", type=int, default=3000)
    p.add_argument("--sampler-preset", default="tiny")
    p.add_argument("--sampler-dtype", default="float32", help="the sampler's weights and compute: float32 | bfloat16")
    p.add_argument("--batches", default="8,32,128")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--prefill-rows", type=int, default=0,
                   help="the sampler's prefill_rows: rows per prefill pass, every row then decoding together "
                        "(0: one pass)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--e2e-preset", default="tiny")
    p.add_argument("--e2e-workers", type=int, default=8)
    p.add_argument("--e2e-group-size", type=int, default=4)
    p.add_argument("--e2e-tasks", type=int, default=2)
    p.add_argument("--e2e-step-limit", type=int, default=6)
    p.add_argument("--e2e-max-new-tokens", type=int, default=48)
    p.add_argument("--e2e-temperature", type=float, default=1.0)
    p.add_argument("--e2e-backend", default="jax", choices=("jax", "vllm"),
                   help="what samples the e2e run's rollouts (rollout.backend; vllm: CUDA, pip install vllm)")
    p.add_argument("--sft-steps", type=int, default=300, help="scripted-expert SFT steps before GRPO (0: none; a "
                   "random policy ends every episode at its first, unparsable, action, and never updates)")
    p.add_argument("--warmup-iterations", type=int, default=2, help="untimed GRPO iterations first (compilation)")
    p.add_argument("--workdir", default=None, help="for the e2e run (default: a temporary directory)")
    p.add_argument("--json", default=str(bc.RESULTS / f"rollout_{bc.jax.default_backend()}.json"))
    p.add_argument("--markdown", default=str(bc.RESULTS / f"rollout_{bc.jax.default_backend()}.md"))
    a = p.parse_args(argv)
    parts = {x for x in a.parts.split(",") if x}
    unknown = parts - {"env", "sampler", "e2e"}
    if unknown:
        p.error(f"unknown --parts {sorted(unknown)}")
    res: dict[str, Any] = {"machine": bc.machine_info(), "command": bc.command_line("rollout.py", argv),
                           "sampler_preset": a.sampler_preset, "env": None, "sampler": None, "e2e": None}
    if "env" in parts:
        res["env"] = bench_env(a.env_steps)
        print(f"env: {res['env']['steps_per_second_per_core']:,.0f} steps/s/core", file=sys.stderr, flush=True)
    if "sampler" in parts:
        def keep(rows):
            res["sampler"] = rows
            bc.write_outputs(a.json, a.markdown, res, markdown(res))

        res["sampler"] = bench_sampler(a.sampler_preset, [int(b) for b in a.batches.split(",") if b],
                                       a.prompt_len, a.new_tokens, a.repeats, a.sampler_dtype, a.prefill_rows, keep)
        for r in res["sampler"]:
            print(f"sampler batch {r['batch']}: " + (r["error"] if "error" in r else f"{r['tokens_per_s']:,.0f} tokens/s"),
                  file=sys.stderr, flush=True)
    if "e2e" in parts:
        if a.workdir:
            res["e2e"] = bench_e2e(a, pathlib.Path(a.workdir))
        else:
            with tempfile.TemporaryDirectory(prefix="bench_rollout_") as tmp:
                res["e2e"] = bench_e2e(a, pathlib.Path(tmp))
    table = markdown(res)
    print(table)
    bc.write_outputs(a.json, a.markdown, res, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
