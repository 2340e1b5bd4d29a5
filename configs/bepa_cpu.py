"""BEPA against GRPO on the synthetic desk with the small preset: the embedded default, 2 CPU cores, no
downloads (`python -m guijax.launch` or `--config=bepa_cpu`).

1. A fresh small Qwen2.5-VL gets a short SFT warm start on scripted-expert traces: the base policy. It sees
   click_button / toggle_checkbox traces plain (and some with their plan), and choose_option traces only
   with the plan appended, standing in for the instruction following a pretrained VLM brings: it can
   follow a plan there but has never solved the bare instruction.
2. expert: the scripted expert (Agent S2's role) on every task; plans φ(τ^E) by the rule-based extractor.
3. level1: base pass@k plain, and plan-conditioned rollouts; their verified successes are D_self, and the
   tasks in D_self the base policy never solved form the expert-only split.
4. methods: GRPO and BEPA from the same base policy with the same budget and seeds; table: success per
   split (expert-only / train / held-out / overall) as in BEPA's Table 1.
"""
from configs._common import base, small_desk


def get_config():
    c = small_desk(base("bepa_cpu"))
    c.stages = ("base_model", "tasks", "expert", "sft", "level1", "eval_base", "methods", "table", "diagnostics",
                "report")
    c.rollout.tasks_per_iteration = 9  # every training task in every iteration
    c.train.iterations = 6
    c.train.ppo_epochs = 2
    c.train.checkpoint_every = 3
    c.sft.steps = 150
    c.sft.families = ("click_button", "toggle_checkbox")
    c.sft.plan_only_families = ("choose_option",)
    c.sft.plan_fraction = 0.25
    c.bepa.base_pass_k = 4
    c.bepa.level1_rollouts = 8
    c.compare.methods = ("grpo", "bepa")
    c.eval.splits = ("expert_only", "train", "held_out")
    c.eval.episodes_per_task = 4
    return c
