"""GRPO for UI-TARS-1.5-7B on OSWorld on a TPU v5p pod slice (v5p-128: 64 chips), launched on every host
by launch/tpu_pod.sh; `--dry_run` checks the sizes on any machine."""
from configs._common import base, uitars_on_osworld, v5p_128


def get_config():
    c = v5p_128(uitars_on_osworld(base("grpo_tpu")))
    c.stages = ("base_model", "tasks", "eval_base", "rl", "eval_final", "report")
    c.rollout.tasks_per_iteration = 32  # 256 environments per iteration, as in the BEPA paper
    return c
