"""Defaults shared by every recipe. A recipe's get_config() starts from `base()` and sets what differs."""
from __future__ import annotations

import ml_collections

from guijax.methods import option_sections
from guijax.schema import (Coldstart, Compare, DryRun, Env, Eval, Lora, Mesh, Model, Optim, Pipeline, Rollout, Sft,
                           Synthesis, TopLevel, Train, section_defaults)


def base(name: str) -> ml_collections.ConfigDict:
    """The generic sections hold the defaults guijax.schema declares (their meaning is documented there);
    the method sections below are spelled out here."""
    c = section_defaults(TopLevel)
    c.name = name
    c.model = section_defaults(Model)
    c.lora = section_defaults(Lora)
    c.mesh = section_defaults(Mesh)
    c.env = section_defaults(Env)
    c.rollout = section_defaults(Rollout)
    c.pipeline = section_defaults(Pipeline)
    c.train = section_defaults(Train)
    c.optim = section_defaults(Optim)
    c.sft = section_defaults(Sft)
    c.coldstart = section_defaults(Coldstart)
    c.synthesis = section_defaults(Synthesis)

    for section, options in option_sections().items():  # each method's section, from its own dataclass
        c[section] = section_defaults(options)

    c.compare = section_defaults(Compare)

    c.dry_run = section_defaults(DryRun)
    c.eval = section_defaults(Eval)
    return c


def uitars_on_osworld(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """What the GPU and TPU recipes share: UI-TARS-1.5-7B (Qwen2.5-VL-7B) from a local copy, bf16 weights and
    optimiser moments with full rematerialisation, OSWorld tasks on remote desktop servers, and the papers'
    RL hyperparameters (group 8, 15 steps, ε 0.2/0.3, no KL, lr 1e-6, train T 1.0, eval T 0.6)."""
    c.model.path = "/models/UI-TARS-1.5-7B"  # a local Hugging Face directory; no downloads happen
    c.model.preset = "qwen2_5_vl_7b"  # the architecture --dry_run uses when model.path is absent
    c.model.dtype = "bfloat16"
    c.model.param_dtype = "bfloat16"
    c.model.remat = "full"
    # Unrolled, as measured on GPUs. grpo_gpu and bepa_gpu scan instead: on one H100 XLA:GPU compiles their
    # full fine-tune to 68.69 GiB scanned against 83.01 GiB unrolled; no card has run a scanned 7B step yet.
    c.model.scan_layers = False
    c.rollout.prompt = "uitars_official"  # the computer-use prompt UI-TARS-1.5 was trained on, verbatim
    c.optim.state_dtype = "bfloat16"
    c.optim.learning_rate = 1e-6
    c.env.kind = "osworld"
    c.env.osworld_dir = "/data/osworld/evaluation_examples"
    c.env.server_urls = tuple(f"http://10.0.0.{i}:5000" for i in range(1, 33))  # one per rollout worker
    c.env.server_token_env = "GUIJAX_SERVER_TOKEN"
    c.env.step_limit = 15
    c.env.timeout_s = 300.0
    c.rollout.group_size = 8
    c.rollout.tasks_per_iteration = 16
    c.rollout.max_images = 5
    c.rollout.max_new_tokens = 512
    c.pipeline.length_buckets = (4096, 8192, 12288, 16384)
    c.pipeline.patch_bucket = 4096
    c.pipeline.worker_count = 4  # grain worker processes prepare prompts and image patches off the trainer
    # each data-parallel device lays out its own rows' screenshots: the tower's gathers stay on-device (one
    # layout over a 64-chip batch replicates them, 113 GiB per chip for bepa_tpu); no change on one device
    c.pipeline.vision_per_device = True
    c.train.eps_low, c.train.eps_high = 0.2, 0.3
    c.train.kl_coef = 0.0
    c.train.minibatch_size = 8
    c.train.iterations = 200
    c.train.checkpoint_every = 5
    c.eval.episodes_per_task = 4
    return c


def small_desk(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """What the CPU recipes share: the small preset on a static synthetic desk sized for 2 cores. Screenshots
    are downscaled to 112x112 for the policy (16 image tokens); no pop-ups or banners; the compact prompt;
    groups of 4 over 4 tasks per iteration; lr 1e-4 (a randomly initialised small model, not a 7B one)."""
    c.model.preset = "small"
    c.model.image_max_pixels = 112 * 112
    c.dry_run.screenshot_hw = (280, 280)  # the desk's screen
    c.env.families = ("click_button", "toggle_checkbox", "choose_option")
    c.env.num_tasks = 12
    c.env.num_workers = 16  # desk workers are cheap; more of them means larger sampler batches
    c.env.step_limit = 6
    c.env.popups = False
    c.rollout.prompt = "compact"
    c.rollout.max_images = 1
    c.rollout.group_size = 4
    c.rollout.tasks_per_iteration = 4
    c.rollout.max_new_tokens = 64
    c.pipeline.length_buckets = (160, 192, 256, 320, 384, 512, 768)  # the last two only for long histories
    c.pipeline.patch_bucket = 64
    c.train.minibatch_size = 8
    c.optim.learning_rate = 1e-4
    c.sft.batch_size = 8
    c.sft.learning_rate = 1e-3  # the warm start of a fresh model
    c.expert_sft.learning_rate = 1e-4  # fine-tuning baselines: the RL rate, as in the paper
    c.sft.traces_per_task = 2
    return c


def gpu_node(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """One 8-GPU node: parameters, gradients and moments FSDP-sharded over all eight GPUs."""
    c.accelerator = "gpu"
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, -1, 1
    c.mesh.num_devices = 8
    return c


def v5p_128(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """A TPU v5p pod slice of 64 chips (v5p-128): 4-way data x 16-way FSDP, one 64-row minibatch per step (a
    row per chip); the dry run compiles for that topology."""
    c.accelerator = "tpu"
    c.dry_run.topology = "v5p:4x4x4"
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 4, -1, 1
    c.mesh.num_devices = 64
    c.train.minibatch_size = 64
    return c


def bepa_on_osworld(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """BEPA's accelerator settings: Agent-S2 traces from a directory (one folder per task with trace.json +
    step PNGs, the layout envs.desk.expert.ExpertTrace.save writes), plans by an OpenAI-compatible model (key
    in $OPENAI_API_KEY), base pass@5, LEVEL-1 seeds for the LEVEL-2 cache, the expert-only split reported."""
    c.stages = ("base_model", "tasks", "expert", "bepa_splits", "level1", "eval_base", "rl", "eval_final",
                "report")
    c.method = "bepa"
    c.bepa.expert_dir = "/data/agent_s2_traces"
    c.bepa.plan_extractor = "chat"
    c.bepa.plan_url = "https://api.openai.com/v1"
    c.bepa.plan_model = "gpt-4o"
    c.bepa.base_pass_k = 5
    c.bepa.level1_rollouts = 1
    c.eval.splits = ("expert_only", "train", "held_out")
    return c
