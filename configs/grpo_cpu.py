"""GRPO on the synthetic desk with the small preset, for 2 CPU cores and no downloads.

A fresh small Qwen2.5-VL (random init + local tokenizer) gets a short SFT warm start on scripted-expert
traces (the "base policy"), then GRPO; both are evaluated on the train and held-out splits.
"""
from configs._common import base


def get_config():
    c = base("grpo_cpu")
    c.stages = ("base_model", "tasks", "sft", "eval_base", "grpo", "eval_final", "report")
    c.model.preset = "small"
    c.model.image_max_pixels = 224 * 224  # 64 image tokens per screenshot for the policy
    c.env.families = ("click_button", "toggle_checkbox", "type_field", "choose_option", "set_slider")
    c.env.num_tasks = 20
    c.env.num_workers = 16  # desk workers are cheap; more of them means larger sampler batches
    c.env.step_limit = 6
    c.rollout.prompt = "compact"
    c.rollout.max_images = 1
    c.rollout.group_size = 4
    c.rollout.tasks_per_iteration = 4
    c.rollout.max_new_tokens = 40
    c.pipeline.length_buckets = (256, 320, 384, 512, 768)
    c.pipeline.patch_bucket = 256
    c.train.iterations = 8
    c.train.minibatch_size = 8
    c.train.checkpoint_every = 2
    c.optim.learning_rate = 2e-5
    c.sft.steps = 120
    c.sft.batch_size = 8
    c.sft.learning_rate = 1e-3
    c.sft.traces_per_task = 2
    c.eval.episodes_per_task = 2
    return c
