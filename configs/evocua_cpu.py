"""EvoCUA's evolution step on the synthetic desk with the small preset (`--config=evocua_cpu`), 2 CPU cores,
no downloads.

1. The base policy: a fresh small Qwen2.5-VL after a short SFT warm start on scripted-expert traces.
2. budget: dynamic compute budgeting (Eq. 1): the base policy rolls each training task out 2 times, topped up to
   4 and then 8 while its success rate stays under 1.0, 0.5, 0.25; every episode is kept.
3. methods: from the same base policy, EvoCUA's RFT on the step-denoised successes, step-level DPO at the
   failures' critical forking points, and one round of both; table: success per split.
"""
from configs._common import base, small_desk


def get_config():
    c = small_desk(base("evocua_cpu"))
    c.stages = ("base_model", "tasks", "expert", "sft", "budget", "eval_base", "methods", "table", "report")
    c.sft.steps = 150
    c.evocua.budgets = (2, 4, 8)
    c.evocua.thresholds = (1.0, 0.5, 0.25)
    # RFT and step-DPO as the offline comparisons of the other recipes run: 20 steps of 8 at lr 1e-5
    c.evocua.rft_steps = 20
    c.evocua.dpo_steps = 20
    c.compare.methods = ("evocua_rft", "evocua_dpo", "evocua")
    c.eval.splits = ("train", "held_out")
    c.eval.episodes_per_task = 4
    return c
