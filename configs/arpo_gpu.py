"""ARPO for UI-TARS-1.5-7B on OSWorld on one 8-GPU node (`python -m guijax.launch --config=arpo_gpu`).

The paper's constants (arpo.txt §4.1) and its public code's (clip ratios 0.2/0.3, lr 1e-6, no KL, 15
steps per episode, 15 epochs): 16 base-policy rollouts per task select the valuable tasks (solved at least
once; 128 in the paper), GRPO with groups of 8, 32 tasks per rollout batch, temperature 1.0 for training
and 0.6 for evaluation, per-task replay of successes. Mini-batches of 8 rows (one per GPU) with 4-step
gradient accumulation. The paper feeds the whole 15-step history; five full-HD screenshots already fill
the 16k-token bucket one GPU's step holds (see grpo_gpu), so this recipe keeps the last five and the rest
as text, as the other 7B recipes do.

Every parameter trains, the vision tower included, over a mesh of 2-way data x 4-way FSDP: compiled by the
H100 proxy (`python -m guijax.launch --config=arpo_gpu --dry_run --nodry_run_sampler`) that step holds 39.67
GiB per device (45.73 GiB with the measured GPU factor, of 74.51). FSDP over all eight GPUs held 93.40 GiB
when the proxy's compiler had a v5p chip's 95 GiB to spend, and is refused under the GPU's budget of 64.62 GiB
(naming 67.29 GiB): it does not fit by the proxy (README). Compiled by XLA:GPU itself for 8 H100s without a
GPU (the `gpu-compile` extra, jax 0.11.2), the step holds 51.16 GiB per device (its accumulation micro-step
19.31 GiB): it fits. Not yet run on GPUs.
"""
from configs._common import base, gpu_node, uitars_on_osworld


def get_config():
    c = gpu_node(uitars_on_osworld(base("arpo_gpu")))
    c.mesh.data, c.mesh.fsdp = 2, 4  # 2 replicas of a 4-GPU FSDP group: fits 8 H100s, FSDP over 8 does not
    c.stages = ("base_model", "tasks", "select", "eval_base", "rl", "eval_final", "report")
    c.method = "arpo"
    c.arpo.selection_rollouts = 16
    c.arpo.buffer_size = 8
    c.rollout.group_size = 8
    c.rollout.tasks_per_iteration = 32
    c.rollout.temperature = 1.0
    c.eval.temperature = 0.6
    c.env.step_limit = 15
    c.train.eps_low, c.train.eps_high = 0.2, 0.3
    c.train.kl_coef = 0.0
    c.optim.learning_rate = 1e-6
    c.train.minibatch_size = 8
    c.optim.grad_accum_steps = 4
    c.train.iterations = 15 * 128 // 32  # 15 epochs over the 128 valuable tasks
    return c
