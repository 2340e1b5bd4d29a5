"""Multi-process start-up: `jax.distributed.initialize()` must run before anything touches devices.

On a TPU pod slice every worker runs the same command; under SLURM every task does. JAX auto-detects both
clusters, so all this decides is whether this process is part of one.
"""
from __future__ import annotations

import os

import jax
from absl import logging

_TPU_MULTIHOST_VARS = ("TPU_WORKER_HOSTNAMES", "CLOUD_TPU_TASK_ID", "MEGASCALE_COORDINATOR_ADDRESS")


def detect_cluster(environ: dict[str, str] | None = None) -> str | None:
    """'coordinator' | 'slurm' | 'tpu' when this process is one of several, else None (single process)."""
    env = os.environ if environ is None else environ
    if env.get("JAX_COORDINATOR_ADDRESS"):
        return "coordinator"
    if int(env.get("SLURM_NTASKS", "1") or 1) > 1:
        return "slurm"
    hosts = env.get("TPU_WORKER_HOSTNAMES", "")
    if len([h for h in hosts.split(",") if h]) > 1 or any(env.get(v) for v in _TPU_MULTIHOST_VARS[1:]):
        return "tpu"
    return None


def maybe_initialize(mode: str = "auto") -> bool:
    """mode: 'auto' (initialize when a cluster is detected), 'on' (always), 'off' (never). Returns whether
    jax.distributed was initialised."""
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"distributed must be 'auto', 'on' or 'off', got {mode!r}")
    cluster = detect_cluster() if mode == "auto" else ("forced" if mode == "on" else None)
    if cluster is None:
        return False
    logging.info("initialising jax.distributed (%s cluster)", cluster)
    if cluster == "coordinator":
        jax.distributed.initialize(
            coordinator_address=os.environ["JAX_COORDINATOR_ADDRESS"],
            num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
            process_id=int(os.environ["JAX_PROCESS_ID"]),
        )
    else:
        jax.distributed.initialize()
    return True
