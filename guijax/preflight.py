"""Checks a recipe's needs before any stage runs, so a missing package, accelerator, file or key fails in the
first second with one line saying what to install or set, instead of as a traceback deep inside a stage an
hour later."""
from __future__ import annotations

import importlib.util
import os
import pathlib

import ml_collections

from guijax.rollout.prompt import prompt_template

INSTALL = {
    "desktop": "pip install -e '.[desktop]'",
    "gpu": "pip install -e '.[gpu]'",
    "tpu": "pip install -e '.[tpu]'",
}


def _has_module(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def _has_platform(platform: str) -> bool:
    import jax

    try:
        return bool(jax.devices(platform))
    except RuntimeError:  # this jaxlib has no such backend
        return False


def problems(config: ml_collections.ConfigDict) -> list[str]:
    """One line per unmet need of `config`; empty when the run can start."""
    out = []
    accelerator = config.get("accelerator", "")
    if accelerator in ("gpu", "tpu") and not _has_platform(accelerator):
        out.append(f"{config.name} runs on a {accelerator.upper()} and jax finds none: install jax's "
                   f"{'CUDA' if accelerator == 'gpu' else 'TPU'} build with `{INSTALL[accelerator]}` on a machine "
                   f"that has one (or `--config.accelerator=` to run on what jax finds)")
    elif accelerator not in ("", "cpu", "gpu", "tpu"):
        out.append(f"accelerator={accelerator!r} is not one of '', cpu, gpu, tpu")
    attention = config.model.get("attention", "auto")
    from guijax.models.attention import KERNEL_PLATFORMS

    needs = KERNEL_PLATFORMS.get(attention)
    if needs and not _has_platform(needs):
        out.append(f"model.attention={attention!r} is a {needs.upper()} kernel and jax finds no {needs.upper()}: "
                   "use --config.model.attention=auto (it takes that kernel where one is, the blockwise path "
                   "elsewhere)")
    try:
        prompt_template(config.rollout.prompt)
    except ValueError as e:
        out.append(str(e))
    pipe = config.pipeline
    if pipe.get("pack_fill", False):
        from guijax.data.pipeline import pack_fill_unset

        unset = pack_fill_unset(pipe.get("pack"), pipe.get("pack_length"), pipe.get("pack_rows"))
        if unset:
            out.append(unset)
    backend = config.rollout.get("backend", "jax")
    served = {key: b for key, b in (("rollout.backend", backend), ("eval.backend", config.eval.get("backend", "jax")))
              if b != "jax"}  # who samples with a serving engine
    for key, b in served.items():
        if b == "vllm" and not _has_module("vllm"):
            from guijax.rollout.vllm_engine import INSTALL as VLLM_INSTALL

            what = "the rollouts" if key == "rollout.backend" else "the evaluations"
            out.append(f"{key}='vllm' samples {what} with vLLM, which is not installed: `{VLLM_INSTALL}` "
                       f"(or --config.{key}=jax, the JAX sampler)")
    if "vllm" in served.values():
        share = float(config.rollout.engine_memory_fraction)
        jax_share = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75"))
        if os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE", "true").lower() != "false" and jax_share + share > 0.98:
            out.append(f"{next(k for k, b in served.items() if b == 'vllm')}='vllm' takes "
                       f"rollout.engine_memory_fraction={share:g} of the GPU and JAX "
                       f"preallocates {jax_share:g} of it: start the run with XLA_PYTHON_CLIENT_MEM_FRACTION="
                       f"{max(0.95 - share, 0.05):.2f} in the environment (or lower the engine's share)")
    for key, b in served.items():
        if config.rollout.top_k or config.rollout.top_p < 1.0:
            out.append(f"{key}={b!r} returns log-probs of the top-k/top-p-truncated distribution, the "
                       "learner scores the whole one: set rollout.top_k=0 and rollout.top_p=1.0")
    stages = set(config.stages)
    if config.env.kind == "osworld":
        if not _has_module("requests"):
            out.append(f"env.kind='osworld' talks to desktop servers with the 'requests' package, which is not "
                       f"installed: `{INSTALL['desktop']}`")
        if "tasks" in stages and not config.env.osworld_dir:
            out.append("env.kind='osworld' needs env.osworld_dir: a folder of OSWorld task files (OSWorld's "
                       "evaluation_examples, or what python -m guijax.evocua.office_synthesis --out= wrote)")
        elif "tasks" in stages and not pathlib.Path(config.env.osworld_dir).is_dir():
            out.append(f"env.osworld_dir {config.env.osworld_dir} is not a directory (OSWorld's evaluation_examples)")
    traces = config.get("coldstart", {}).get("traces_dir", "") if "coldstart" in stages else ""
    if traces and not any((pathlib.Path(traces) / "coldstart_trajectories").glob("*.array_record")):
        out.append(f"coldstart.traces_dir={traces} holds no coldstart_trajectories/ (record them with "
                   "python -m guijax.evocua.office_coldstart --out=...)")
    if config.model.path and not (pathlib.Path(config.model.path) / "config.json").exists():
        out.append(f"model.path {config.model.path} has no config.json (a local Hugging Face Qwen2.5-VL directory)")
    if "csr" in stages and config.get("sgcd") is not None and config.sgcd.get("csr_baselines"):
        from guijax.pipeline.sgcd_stages import baselines

        try:  # checked now, not after the hours of training that come before the csr stage
            baselines(config.sgcd.csr_baselines, ("base policy", *config.compare.methods))
        except (ValueError, FileNotFoundError) as e:
            out.append(str(e))
    if "expert" in stages:
        b = config.bepa
        if b.expert_dir and not pathlib.Path(b.expert_dir).is_dir():
            out.append(f"bepa.expert_dir {b.expert_dir} is not a directory of recorded expert traces")
        if b.plan_extractor == "chat" and b.plan_api_key_env and not os.environ.get(b.plan_api_key_env):
            out.append(f"bepa.plan_extractor='chat' reads its API key from ${b.plan_api_key_env}, which is not set "
                       "(or use --config.bepa.plan_extractor=rule)")
    return out
