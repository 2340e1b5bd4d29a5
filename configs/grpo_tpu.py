"""GRPO for UI-TARS-1.5-7B on OSWorld on a TPU v5p pod slice (v5p-128: 64 chips), launched on every host
by launch/tpu_pod.sh; `--dry_run` checks the sizes on any machine."""
from configs._common import base, uitars_on_osworld


def get_config():
    c = uitars_on_osworld(base("grpo_tpu"))
    c.accelerator = "tpu"
    c.dry_run.topology = "v5p:4x4x4"  # 64 v5p chips (v5p-128)
    c.stages = ("base_model", "tasks", "eval_base", "rl", "eval_final", "report")
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 4, -1, 1  # 4-way data x 16-way FSDP on 64 chips
    c.mesh.num_devices = 64
    c.rollout.tasks_per_iteration = 32  # 256 environments per iteration, as in the BEPA paper
    c.train.minibatch_size = 64
    return c
