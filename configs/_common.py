"""Defaults shared by every recipe. A recipe's get_config() starts from `base()` and sets what differs."""
from __future__ import annotations

import ml_collections


def base(name: str) -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.name = name
    c.seed = 0
    c.stages = ()
    c.distributed = "auto"  # auto | on | off: jax.distributed.initialize() on TPU pods / SLURM
    c.accelerator = ""  # "" (whatever jax finds) | cpu | gpu | tpu: checked before any stage runs
    c.compilation_cache_dir = "~/.cache/guijax/xla"  # XLA's persistent compilation cache; "" turns it off

    c.model = ml_collections.ConfigDict()
    c.model.preset = "small"  # used when model.path is empty: a fresh checkpoint is created in the workdir
    c.model.path = ""  # a Hugging Face Qwen2.5-VL directory (e.g. a local UI-TARS-1.5-7B copy)
    c.model.dtype = "float32"  # compute dtype
    c.model.param_dtype = ""  # empty: same as dtype
    c.model.remat = "none"  # none | full | dots_saveable | attention_saveable (guijax.models.scan)
    c.model.attention = "auto"  # auto | xla | cudnn | reference: attention backend (guijax/models/attention.py)
    c.model.scan_layers = True  # decoder layers and vision blocks under scan: compile time flat in depth
    c.model.tokenizer_vocab = 0  # fresh checkpoints: BPE vocab size (0: the preset's vocab size)
    c.model.image_max_pixels = 0  # 0: the checkpoint's preprocessor_config; else downscale screenshots for the policy

    c.mesh = ml_collections.ConfigDict()
    c.mesh.data = 1
    c.mesh.fsdp = -1  # -1: all remaining devices
    c.mesh.tensor = 1
    c.mesh.num_devices = 0  # 0: the devices present; set it to dry-run a pod-sized mesh on a laptop

    c.env = ml_collections.ConfigDict()
    c.env.kind = "desk"  # desk (synthetic, in-process workers) | osworld (remote desktop servers)
    c.env.server_urls = ()  # osworld: one server URL per rollout worker (OSWorld VMs or `python -m envs.server`)
    c.env.server_token_env = ""  # osworld: environment variable holding the servers' bearer token
    c.env.osworld_dir = ""  # osworld: OSWorld's evaluation_examples folder
    c.env.osworld_split = ""  # osworld: a split file ({domain: [ids]}); empty: every task in osworld_dir
    c.env.cache_dirs = ()  # osworld: local folders with files the tasks would download
    c.env.num_workers = 2
    c.env.timeout_s = 120.0
    c.env.screen = (280, 280)
    c.env.step_limit = 15
    c.env.popups = True
    c.env.num_tasks = 36
    c.env.families = ()
    c.env.held_out_families = ()
    c.env.held_out_fraction = 0.2

    c.rollout = ml_collections.ConfigDict()
    c.rollout.group_size = 8
    c.rollout.tasks_per_iteration = 16
    c.rollout.max_images = 5
    c.rollout.temperature = 1.0
    c.rollout.top_p = 1.0
    c.rollout.top_k = 0
    c.rollout.max_new_tokens = 256
    c.rollout.max_sampler_rows = 0  # rows per sampler program (0: all live episodes at once); see --dry_run
    c.rollout.format_reward = -1.0
    c.rollout.format_weight = 0.5
    c.rollout.prompt = "uitars_official"  # uitars_official (UI-TARS-1.5's own) | compact (guijax.rollout.prompt)

    c.pipeline = ml_collections.ConfigDict()
    c.pipeline.length_buckets = (256, 512, 1024, 2048, 4096, 8192, 16384)
    c.pipeline.patch_bucket = 1024
    c.pipeline.worker_count = 0  # grain worker processes for prompt encoding + image patches (0: in-process threads)
    c.pipeline.response_bucket = 64  # log-probs on response positions only, their count padded to this multiple
    c.pipeline.dedupe_images = True  # each distinct screenshot of a batch through the vision tower once
    c.pipeline.shuffle_block = 1  # >1: batches of runs of consecutive steps, which share screenshots (fewer patches)

    c.train = ml_collections.ConfigDict()
    c.train.iterations = 100
    c.train.ppo_epochs = 1
    c.train.minibatch_size = 8
    c.train.loss = "grpo"  # grpo | luffy | sft
    c.train.eps_low = 0.2
    c.train.eps_high = 0.3
    c.train.dual_clip = 0.0
    c.train.kl_coef = 0.0
    c.train.normalization = "token"
    c.train.luffy_gamma = 0.1
    c.train.sft_coef = 0.0
    c.train.logprob_impl = "auto"
    c.train.checkpoint_every = 5
    c.train.keep_checkpoints = 3
    c.train.max_nonfinite_in_row = 3
    c.train.task_filter = ""  # "valuable": train only on the tasks the select stage kept (ARPO)

    c.optim = ml_collections.ConfigDict()
    c.optim.learning_rate = 1e-6
    c.optim.warmup_steps = 0
    c.optim.total_steps = 1000
    c.optim.schedule = "constant"
    c.optim.weight_decay = 0.0
    c.optim.b1 = 0.9
    c.optim.b2 = 0.999
    c.optim.eps = 1e-8
    c.optim.max_grad_norm = 1.0
    c.optim.grad_accum_steps = 1
    c.optim.state_dtype = "float32"

    c.sft = ml_collections.ConfigDict()
    c.sft.steps = 0
    c.sft.batch_size = 8
    c.sft.learning_rate = 1e-4
    c.sft.traces_per_task = 1
    c.sft.expert_noise = 0.0
    c.sft.families = ()  # empty: every family of the training split
    c.sft.plan_only_families = ()  # families whose traces appear only plan-conditioned
    c.sft.plan_fraction = 0.0  # share of SFT traces repeated with the plan appended (BEPA LEVEL-1 prompts)
    c.sft.checkpoint_every = 50  # steps between SFT checkpoints (params, optimiser, grain iterator position)

    c.algorithm = ml_collections.ConfigDict()
    c.algorithm.name = "grpo"  # grpo | arpo | bepa | trace_replacement | luffy | rl_sft
    c.algorithm.seed_cache = ""  # bepa: "level1" (D_self from the level1 stage) | "conv" (D_conv) | "" (empty)

    c.bepa = ml_collections.ConfigDict()
    c.bepa.update_rule = "random"  # U: random | logprob | shortest
    c.bepa.plan_extractor = "rule"  # rule | chat (OpenAI-compatible; never used in tests)
    c.bepa.plan_url = ""
    c.bepa.plan_model = "gpt-4o"
    c.bepa.plan_api_key_env = "OPENAI_API_KEY"
    c.bepa.expert_dir = ""  # folders of recorded expert traces (trace.json + PNGs); empty: the scripted desk expert
    c.bepa.expert_noise = 0.0  # scripted expert: chance of a wrong or missed action per step
    # D_conv's thoughts: terse (the SFT warm start's voice) | verbose (a framework worker's narration, which
    # the base policy has never seen: the expert-to-policy distribution gap of BEPA §3)
    c.bepa.conversion_thoughts = "terse"
    c.bepa.base_pass_k = 5  # level1: plain base-policy rollouts per task (its pass@k)
    c.bepa.level1_rollouts = 1  # level1: plan-conditioned rollouts per task
    c.bepa.train_fraction = 0.8  # bepa_splits: share of the solvable pool that trains
    c.bepa.extra_train_tasks = 8  # bepa_splits: unsolvable tasks added to the training split

    c.arpo = ml_collections.ConfigDict()
    c.arpo.buffer_size = 8
    c.arpo.selection_rollouts = 16  # select stage: base-policy rollouts per task
    c.arpo.offline_methods = ()  # offline stage: any of rft, dpo, kto (on the select stage's rollouts)
    c.arpo.offline_steps = 20
    c.arpo.offline_batch_trajectories = 8
    c.arpo.offline_learning_rate = 1e-5
    c.arpo.offline_beta = 0.1

    c.compare = ml_collections.ConfigDict()
    c.compare.methods = ("grpo", "bepa")  # the methods stage trains each from the same base policy
    c.compare.sft_epochs = 3  # SFT / SFT+RL baselines: epochs over D_conv
    c.compare.sft_learning_rate = 1e-6  # SFT / SFT+RL baselines fine-tune at the RL rate (BEPA App. E: both 1e-6)

    c.dry_run = ml_collections.ConfigDict()  # --dry_run compiles the real train step at these shapes
    c.dry_run.topology = ""  # a TPU topology such as "v5p:4x4x4"; GPU recipes are compiled for one v5p chip
    c.dry_run.screenshot_hw = (1080, 1920)  # each row's screenshots (rollout.max_images of them)

    c.eval = ml_collections.ConfigDict()
    c.eval.splits = ("train", "held_out")
    c.eval.episodes_per_task = 4
    c.eval.temperature = 0.6
    c.eval.pass_k = (1,)
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
    # Unrolled: at 16k-token rows the scanned step's compiled temporaries are several times the unrolled
    # one's (3B, one row, TPU compiler: 39.7 GiB against 8.6 GiB), so the 7B step fits only unrolled.
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
    c.compare.sft_learning_rate = 1e-4  # fine-tuning baselines: the RL rate, as in the paper
    c.sft.traces_per_task = 2
    return c


def bepa_on_osworld(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """BEPA's accelerator settings: Agent-S2 traces from a directory (one folder per task with trace.json +
    step PNGs, the layout envs.desk.expert.ExpertTrace.save writes), plans by an OpenAI-compatible model (key
    in $OPENAI_API_KEY), base pass@5, LEVEL-1 seeds for the LEVEL-2 cache, the expert-only split reported."""
    c.stages = ("base_model", "tasks", "expert", "bepa_splits", "level1", "eval_base", "grpo", "eval_final",
                "report")
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
