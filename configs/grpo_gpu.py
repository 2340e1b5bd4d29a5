"""GRPO for UI-TARS-1.5-7B on OSWorld from one H100 (80 GB): bf16 weights and AdamW moments, full remat.

Edit (or override) model.path, env.osworld_dir and env.server_urls for your machines; check the sizes
first with `python -m guijax.launch --config=grpo_gpu --dry_run`.
"""
from configs._common import base, uitars_on_osworld


def get_config():
    c = uitars_on_osworld(base("grpo_gpu"))
    c.accelerator = "gpu"
    c.stages = ("base_model", "tasks", "eval_base", "rl", "eval_final", "report")
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, -1, 1  # every local GPU in one FSDP axis
    c.mesh.num_devices = 1  # the dry run's mesh: one H100
    # One 16k-token row (five full-HD screenshots) per optimizer step: bf16 weights, gradients and AdamW
    # moments of the 8.3B model take 62 GB of the 80; `--dry_run` compiles this step and checks it fits.
    c.train.minibatch_size = 1
    return c
