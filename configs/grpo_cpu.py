"""GRPO on the synthetic desk with the small preset, for 2 CPU cores and no downloads.

A fresh small Qwen2.5-VL (random init + local tokenizer) gets a short SFT warm start on scripted-expert
traces of the training tasks (the "base policy": partial competence, many unparsable or misplaced actions
at temperature 1), then GRPO; both are evaluated on the train and held-out splits at temperature 0.6 with
6 episodes per task.
"""
from configs._common import base, small_desk


def get_config():
    c = small_desk(base("grpo_cpu"))
    c.stages = ("base_model", "tasks", "sft", "eval_base", "rl", "eval_final", "report")
    c.train.iterations = 10
    c.train.checkpoint_every = 5
    c.sft.steps = 60
    c.eval.episodes_per_task = 6
    return c
