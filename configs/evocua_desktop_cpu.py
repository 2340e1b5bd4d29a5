"""EvoCUA's cold start on the real Xvfb desktop (`--config=evocua_desktop_cpu`), 2 CPU cores, no downloads: a
fresh small Qwen2.5-VL fine-tuned on the recorded references of synthesized office tasks (§5.1: hindsight thoughts,
the paper's computer_use tool calls) and evaluated on the same desktop, on its training tasks and on held-out
ones. Three things come first (`benchmarks/evocua_desktop_policy.sh OUT` runs all four commands):

    python -m guijax.evocua.office_synthesis --out=TASKS --count=16 --seed=0   # tasks, validators, references
    python -m guijax.evocua.office_coldstart --tasks=TASKS --out=TRACES         # references replayed, thoughts
    python -m envs.server --port=5000 --no-token --screen=1280x720 &            # the desktop the policy drives
    python -m guijax.launch --config=evocua_desktop_cpu --workdir=W \\
        --config.env.osworld_dir=TASKS --config.coldstart.traces_dir=TRACES

The traces of the tasks the split holds out are left out of the cold start (the recorder replays every task).
Screenshots reach the policy at 448x252 (144 image tokens), the last two as images and older steps as text:
the references' longest step is about 950 tokens with its response, and a training step of 8 takes about 12 s
on 2 cores instead of the 35 s of two full-resolution ones.
"""
from configs._common import base, small_desk

POLICY_PIXELS = 448 * 252  # a 1280x720 screen smart-resized to 16 x 9 patches of 28 pixels


def get_config():
    c = small_desk(base("evocua_desktop_cpu"))
    c.stages = ("base_model", "tasks", "coldstart", "sft", "eval_base", "report")
    c.model.image_max_pixels = POLICY_PIXELS
    c.dry_run.screenshot_hw = (720, 1280)
    c.env.kind = "osworld"
    c.env.osworld_dir = ""  # the tasks office_synthesis wrote (required)
    c.env.server_urls = ("http://127.0.0.1:5000",)  # one `python -m envs.server` per rollout worker
    c.env.step_limit = 15  # the paper's shorter budget; the references take 6 to 12 steps
    c.env.timeout_s = 180.0
    c.env.held_out_fraction = 0.25
    c.rollout.prompt = "computer_use_compact"
    c.rollout.max_images = 2
    c.rollout.max_new_tokens = 192  # the references' answers run to 155 tokens (a thought restating the task)
    c.pipeline.length_buckets = (512, 768, 1024, 1280)  # the rollouts' prompts: up to 1,280 - 192 tokens
    c.pipeline.patch_bucket = 576
    c.coldstart.traces_dir = ""  # what office_coldstart wrote (required)
    c.sft.data = "coldstart"
    c.sft.steps = 150
    c.eval.splits = ("train", "held_out")
    c.eval.episodes_per_task = 2
    c.eval.step_limits = ()
    return c
