"""Defaults shared by every recipe. A recipe's get_config() starts from `base()` and sets what differs."""
from __future__ import annotations

import ml_collections


def base(name: str) -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.name = name
    c.seed = 0
    c.stages = ()
    c.distributed = "auto"  # auto | on | off: jax.distributed.initialize() on TPU pods / SLURM

    c.model = ml_collections.ConfigDict()
    c.model.preset = "small"  # used when model.path is empty: a fresh checkpoint is created in the workdir
    c.model.path = ""  # a Hugging Face Qwen2.5-VL directory (e.g. a local UI-TARS-1.5-7B copy)
    c.model.dtype = "float32"  # compute dtype
    c.model.param_dtype = ""  # empty: same as dtype
    c.model.remat = "none"  # none | full | dots_saveable
    c.model.tokenizer_vocab = 0  # fresh checkpoints: BPE vocab size (0: the preset's vocab size)

    c.mesh = ml_collections.ConfigDict()
    c.mesh.data = 1
    c.mesh.fsdp = -1  # -1: all remaining devices
    c.mesh.tensor = 1
    c.mesh.num_devices = 0  # 0: the devices present; set it to dry-run a pod-sized mesh on a laptop
    return c
