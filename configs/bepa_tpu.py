"""BEPA for UI-TARS-1.5-7B on OSWorld on a TPU v5p pod slice (64 chips, 256 environments per iteration as in
the paper), launched by launch/tpu_pod.sh (`python -m guijax.launch --config=bepa_tpu`)."""
from configs._common import base, uitars_on_osworld


def get_config():
    c = uitars_on_osworld(base("bepa_tpu"))
    c.stages = ("base_model", "tasks", "expert", "level1", "eval_base", "grpo", "eval_final", "report")
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 4, -1, 1
    c.mesh.num_devices = 64
    c.rollout.tasks_per_iteration = 32
    c.train.minibatch_size = 64
    c.algorithm.name = "bepa"
    c.algorithm.seed_cache = "level1"
    c.bepa.expert_dir = "/data/agent_s2_traces"
    c.bepa.plan_extractor = "chat"
    c.bepa.plan_url = "https://api.openai.com/v1"
    c.bepa.plan_model = "gpt-4o"
    c.bepa.base_pass_k = 5
    c.eval.splits = ("expert_only", "train", "held_out")
    return c
