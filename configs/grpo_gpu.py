"""GRPO for UI-TARS-1.5-7B on OSWorld on one GPU machine: bf16 weights and AdamW moments, full remat, FSDP
over the local GPUs.

One optimizer step is one 16k-token row with five full-HD screenshots. Run for real on one H200
(`python benchmarks/recipe_step.py --config=grpo_gpu`), it held 84.43 GiB at its peak: one H200 (141 GB),
or the FSDP axis over two or more H100s; a single H100 80GB is too small for the full fine-tune. Measured on
one H100: LoRA (`--config.lora.rank=128`) held 26.45 GiB at 1.80 s per step, and the full fine-tune with the
vision tower frozen (`--config.model.frozen='("visual",)'`) 61.60 GiB at 2.00 s. Edit (or override)
model.path, env.osworld_dir and env.server_urls for your machines; check the sizes first with
`python -m guijax.launch --config=grpo_gpu --dry_run`.
"""
from configs._common import base, uitars_on_osworld


def get_config():
    c = uitars_on_osworld(base("grpo_gpu"))
    c.accelerator = "gpu"
    c.stages = ("base_model", "tasks", "eval_base", "rl", "eval_final", "report")
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, -1, 1  # every local GPU in one FSDP axis
    c.mesh.num_devices = 1  # the dry run's mesh: one GPU
    # One 16k-token row (five full-HD screenshots) per optimizer step: bf16 weights, gradients and AdamW
    # moments of the 8.3B model alone take 62 GB; `--dry_run` compiles this step and checks it against 80 GB.
    c.train.minibatch_size = 1
    return c
