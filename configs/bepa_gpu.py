"""BEPA for UI-TARS-1.5-7B on OSWorld from one H100: Agent-S2 traces from a directory (one folder per task
with trace.json + step PNGs, the layout envs.desk.expert.ExpertTrace.save writes), plans by an
OpenAI-compatible model (key in $OPENAI_API_KEY) or the rule-based extractor, LEVEL-1 then LEVEL-2."""
from configs._common import base, uitars_on_osworld


def get_config():
    c = uitars_on_osworld(base("bepa_gpu"))
    c.stages = ("base_model", "tasks", "expert", "level1", "eval_base", "grpo", "eval_final", "report")
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, -1, 1
    c.mesh.num_devices = 1
    c.algorithm.name = "bepa"
    c.algorithm.seed_cache = "level1"
    c.bepa.expert_dir = "/data/agent_s2_traces"
    c.bepa.plan_extractor = "chat"
    c.bepa.plan_url = "https://api.openai.com/v1"
    c.bepa.plan_model = "gpt-4o"
    c.bepa.base_pass_k = 5
    c.bepa.level1_rollouts = 1
    c.eval.splits = ("expert_only", "train", "held_out")
    return c
