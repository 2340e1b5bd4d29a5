"""GRPO for UI-TARS-1.5-7B on OSWorld on one GPU machine: bf16 weights and AdamW moments, full remat, the
decoder layers under scan, FSDP over the local GPUs.

One optimizer step is one 16k-token row with five full-HD screenshots. With the layers under scan, XLA:GPU
compiles the full fine-tune for one H100 80GB to a 68.69 GiB peak (`python -m guijax.launch
--config=grpo_gpu --dry_run`, with the `gpu-compile` extra); not yet run on a card. Unrolled
(`--config.model.scan_layers=False`) it compiles to 83.01 GiB, and run for real on one H200 (`python
benchmarks/recipe_step.py --config=grpo_gpu --config.model.scan_layers=False`) it held 84.43 GiB: too much for
one H100. Measured on one H100 (unrolled): LoRA (`--config.lora.rank=128`) held 26.45 GiB at 1.80 s per step,
and the full fine-tune with the vision tower frozen (`--config.model.frozen='("visual",)'`) 61.60 GiB at 2.00 s.
Edit (or override) model.path, env.osworld_dir and env.server_urls for your machines; check the sizes first
with `python -m guijax.launch --config=grpo_gpu --dry_run`.
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
    # Under scan XLA:GPU keeps one layer's rematerialised activations at a time; unrolled, it keeps more
    # (compiled for one H100: 68.69 GiB against 83.01 GiB, the sampler's program 16 prompts either way).
    c.model.scan_layers = True
    return c
