"""BEPA for UI-TARS-1.5-7B on OSWorld on one GPU machine (one H100 by XLA:GPU's compile: see grpo_gpu):
recorded Agent-S2 traces, plans by an OpenAI-compatible model (or `--config.bepa.plan_extractor=rule`),
LEVEL-1 then LEVEL-2 (`python -m guijax.launch --config=bepa_gpu`)."""
from configs._common import base, bepa_on_osworld, uitars_on_osworld


def get_config():
    c = bepa_on_osworld(uitars_on_osworld(base("bepa_gpu")))
    c.accelerator = "gpu"
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, -1, 1
    c.mesh.num_devices = 1
    c.train.minibatch_size = 1  # one 16k-token row per optimizer step
    c.model.scan_layers = True  # the full fine-tune fits one H100 under scan only: see grpo_gpu
    c.train.iterations = 4 * 128 // c.rollout.tasks_per_iteration  # BEPA App. E: 4 epochs over 128 tasks
    return c
