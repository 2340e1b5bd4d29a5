"""Typed, validated run configs: each config section is a frozen dataclass, and `validate` checks a resolved
recipe against them before anything runs, so a bad choice, a value out of range or a typo fails in the first
second naming its full dotted key, instead of as a ValueError deep inside a stage an hour later.

The dataclasses are also the one home of the defaults: `configs/_common.py: base()` builds its generic
sections with `section_defaults`. Choices are `typing.Literal`s; ranges sit in the field metadata (`ranged`).
Method-specific sections (declared by the methods) reach `validate` through its `extra` argument.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import typing
from types import MappingProxyType
from typing import Any, Literal, Mapping

import ml_collections

from guijax.config import ConfigError


@dataclasses.dataclass(frozen=True)
class Range:
    """Bounds of a number (or of every item of a tuple of numbers). `also` is one value outside them that is
    allowed too: the "off" or "all remaining" sentinel many keys have (dual_clip 0, mesh axis -1)."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    also: float | None = None

    def __contains__(self, x: float) -> bool:
        if self.also is not None and x == self.also:
            return True
        if self.low is not None and (x <= self.low if self.low_open else x < self.low):
            return False
        return self.high is None or (x < self.high if self.high_open else x <= self.high)

    def __str__(self) -> str:
        left = "(" if self.low is None or self.low_open else "["
        right = ")" if self.high is None or self.high_open else "]"
        low = "-inf" if self.low is None else f"{self.low:g}"
        high = "inf" if self.high is None else f"{self.high:g}"
        interval = f"in {left}{low}, {high}{right}"
        return interval if self.also is None else f"{self.also:g} or {interval}"


def ranged(default: Any, low: float | None = None, high: float | None = None, *, low_open: bool = False,
           high_open: bool = False, also: float | None = None) -> Any:
    """A dataclass field with `default` whose value must lie in the given bounds (closed unless *_open)."""
    return dataclasses.field(default=default, metadata={"range": Range(low, high, low_open, high_open, also)})


# ---- the generic sections (configs/_common.py: base()) ----

DType = Literal["float32", "bfloat16", "float16"]  # guijax.models.policy.DTYPES
DeskFamily = Literal["click_button", "toggle_checkbox", "set_slider", "type_field", "choose_option", "confirm_action",
                     "copy_between_windows", "pick_from_list", "fill_form", "settings_then_note",
                     "infeasible_toggle", "infeasible_option"]  # envs.desk.families.FAMILIES


@dataclasses.dataclass(frozen=True)
class TopLevel:
    """The scalars at the top of a recipe."""

    name: str = ""  # set by base(name); runs/<name> is the default workdir
    seed: int = ranged(0, low=0)
    stages: tuple[str, ...] = ()  # names in guijax.pipeline.registry.STAGES, run in order
    method: str = "grpo"  # what the `rl` stage trains: a name in guijax.methods.REGISTRY (checked there)
    distributed: Literal["auto", "on", "off"] = "auto"  # jax.distributed.initialize() on TPU pods / SLURM
    accelerator: Literal["", "cpu", "gpu", "tpu"] = ""  # "": whatever jax finds; checked before any stage runs
    compilation_cache_dir: str = "~/.cache/guijax/xla"  # XLA's persistent compilation cache; "" turns it off


@dataclasses.dataclass(frozen=True)
class Model:
    # used when model.path is empty: a fresh checkpoint is created in the workdir (guijax.models.config.PRESETS)
    preset: Literal["tiny", "small", "tiny_qwen2_vl", "tiny_qwen3_vl", "tiny_qwen3_vl_moe", "qwen2_vl_7b", "qwen3_vl_8b",
                    "qwen3_vl_32b", "qwen3_vl_30b_a3b",
                    "qwen2_5_vl_3b", "qwen2_5_vl_7b", "qwen2_5_vl_32b", "qwen2_5_vl_72b"] = "small"
    path: str = ""  # a Hugging Face Qwen2.5-VL, Qwen2-VL or Qwen3-VL directory (e.g. a local UI-TARS-1.5-7B copy)
    dtype: DType = "float32"  # compute dtype
    param_dtype: Literal["", "float32", "bfloat16", "float16"] = ""  # empty: same as dtype
    # guijax.models.scan.REMAT_POLICIES
    remat: Literal["none", "full", "dots_saveable", "attention_saveable"] = "none"
    # attention backend (guijax/models/attention.py: IMPLEMENTATIONS)
    attention: Literal["auto", "reference", "xla", "cudnn", "cudnn_packed", "splash"] = "auto"
    # the blockwise ("xla") attention's query/key tile in the decoder: tiles whose pairs are all masked are
    # skipped, so smaller tiles skip more of a packed row's cross-example pairs; larger ones are fewer matmuls
    attention_block: int = ranged(512, low=16)
    scan_layers: bool = True  # decoder layers and vision blocks under scan: compile time flat in depth
    # MoE under expert parallelism (mesh.expert > 1): each device's room per destination is this factor times an
    # even share of its (token, choice) pairs, the rest dropped and reported (moe_dropped_fraction); 0: dropless
    expert_capacity_factor: float = ranged(0.0, low=0)
    # parameter groups every training stage holds fixed: no gradient, no optimiser moments, no backward pass
    # through them ("visual": the vision tower with its merger, which SGCD keeps frozen throughout)
    frozen: tuple[Literal["visual", "embed_tokens", "lm_head"], ...] = ()
    tokenizer_vocab: int = ranged(0, low=0)  # fresh checkpoints: BPE vocab size (0: the preset's vocab size)
    # 0: the checkpoint's preprocessor_config; else downscale screenshots for the policy
    image_max_pixels: int = ranged(0, low=0)


@dataclasses.dataclass(frozen=True)
class Lora:
    """Low-rank adapters on the decoder projections (guijax.models.lora), PEFT's fields: with rank > 0 every
    training stage (SFT, RL, DPO/KTO) trains the adapters alone, the base weights frozen in model.param_dtype;
    trained models are saved merged, and the adapters beside them in PEFT's format (<model dir>_adapter)."""

    rank: int = ranged(0, low=0)  # r; 0: LoRA off (full fine-tuning)
    alpha: float = ranged(16.0, low=0, low_open=True)  # lora_alpha: the update is scaled by alpha / rank
    dropout: float = ranged(0.0, low=0, high=1, high_open=True)  # lora_dropout on the adapters' input
    target_modules: tuple[Literal["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], ...] = (
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # guijax.models.lora.DECODER_TARGETS
    use_rslora: bool = False  # scale by alpha / sqrt(rank) (rank-stabilised LoRA)


@dataclasses.dataclass(frozen=True)
class Mesh:
    data: int = ranged(1, low=1, also=-1)  # -1 (on at most one axis): all remaining devices
    fsdp: int = ranged(-1, low=1, also=-1)
    tensor: int = ranged(1, low=1, also=-1)
    # expert parallelism: a MoE layer's routed experts split over this axis (tokens reach them by all-to-all);
    # elsewhere it splits batch rows and parameters like fsdp
    expert: int = ranged(1, low=1, also=-1)
    num_devices: int = ranged(0, low=0)  # 0: the devices present; set it to dry-run a pod-sized mesh on a laptop


@dataclasses.dataclass(frozen=True)
class Env:
    kind: Literal["desk", "osworld"] = "desk"  # desk (synthetic, in-process workers) | osworld (remote desktop servers)
    # osworld: one server URL per rollout worker (OSWorld VMs or `python -m envs.server`)
    server_urls: tuple[str, ...] = ()
    server_token_env: str = ""  # osworld: environment variable holding the servers' bearer token
    osworld_dir: str = ""  # osworld: OSWorld's evaluation_examples folder
    osworld_split: str = ""  # osworld: a split file ({domain: [ids]}); empty: every task in osworld_dir
    cache_dirs: tuple[str, ...] = ()  # osworld: local folders with files the tasks would download
    num_workers: int = ranged(2, low=1)
    # where the workers run: processes on this machine (envs.pool) | Ray actors on any host of a Ray cluster
    fleet: Literal["processes", "ray"] = "processes"
    ray_address: str = ""  # fleet=ray: "auto", "HEAD:6379" or "ray://HEAD:10001"; empty: a local Ray instance
    ray_cpus_per_worker: float = ranged(1.0, low=0, low_open=True)  # fleet=ray: CPUs each actor reserves
    timeout_s: float = ranged(120.0, low=0, low_open=True)
    screen: tuple[int, int] = ranged((280, 280), low=1)  # desk: (height, width)
    step_limit: int = ranged(15, low=1)
    popups: bool = True
    num_tasks: int = ranged(36, low=1)
    families: tuple[DeskFamily, ...] = ()  # desk: generated task families; empty: all
    held_out_families: tuple[str, ...] = ()  # task domains held out whole (desk families or OSWorld domains)
    held_out_fraction: float = ranged(0.2, low=0, high=1)
    # desk: seconds every reset and step waits, standing in for a VM's screenshot / settle time (benchmarks)
    step_latency_s: float = ranged(0.0, low=0)


@dataclasses.dataclass(frozen=True)
class Rollout:
    group_size: int = ranged(8, low=1)
    tasks_per_iteration: int = ranged(16, low=1)
    max_images: int = ranged(5, low=1)  # screenshots kept as images in the prompt (K); earlier steps stay as text
    temperature: float = ranged(1.0, low=0, low_open=True)  # the trainer's log-probs divide by it
    top_p: float = ranged(1.0, low=0, high=1, low_open=True)
    top_k: int = ranged(0, low=0)  # 0: off
    max_new_tokens: int = ranged(256, low=1)
    max_sampler_rows: int = ranged(0, low=0)  # rows per sampler program (0: all live episodes at once); see --dry_run
    # rows per prefill pass within a sampler program (0: all at once); every row then decodes together. Long
    # screenshot prompts make prefill's transients, not the KV cache, what stops a large batch fitting
    prefill_rows: int = ranged(0, low=0)
    # the screenshots of a sampler call (when of one size) padded with blank ones to its rows x the screenshots per
    # row rounded up: a few programs per row count | exact: one program per screenshot count
    sampler_image_buckets: Literal["rows", "exact"] = "rows"
    format_reward: float = -1.0  # reward of an unparsable response (ARPO) ...
    format_weight: float = ranged(0.5, low=0)  # ... and its weight
    # the system prompt, and with it the action grammar the policy writes: UI-TARS-1.5's own prompt | UI-TARS
    # 1.0's OSWorld prompt | a compact one (all UI-TARS text) | EvoCUA's computer_use tool calls in 0-1000
    # coordinates (full | compact) | SGCD's Fig. 9: pyautogui code in 0-1000 coordinates (plain | its variant for
    # thinking backbones, the thought in [think] ... [/think])
    prompt: Literal["uitars_official", "uitars_v1", "compact", "computer_use", "computer_use_compact",
                    "pyautogui", "pyautogui_think"] = "uitars_official"
    # UI-TARS text's coordinates: pixels of the resized screenshot (UI-TARS-1.5) | 0-1000 relative (UI-TARS 1.0,
    # e.g. UI-TARS-7B-DPO); computer_use and pyautogui are always 0-1000 relative
    coordinate_model: Literal["uitars-1.5", "uitars-1.0"] = "uitars-1.5"
    # sync: sample every group with the current parameters, then train (the papers' protocol); async: a thread
    # keeps every environment busy and the learner trains on groups as they complete (guijax.rollout.stream)
    mode: Literal["sync", "async"] = "sync"
    max_staleness: int = ranged(4, low=0)  # async: groups sampled more than this many updates ago are dropped
    async_groups_ahead: int = ranged(0, low=0)  # async: groups started and not yet trained on (0: 2 x tasks_per_iteration)
    # async: the first N devices sample (their own mesh, parameters split over them), the others train with
    # the `mesh` section's shape; parameters are copied across after each update. 0: both share every device
    sampler_devices: int = ranged(0, low=0)
    # what samples the rollouts: jax (guijax.sampling, every platform, the reference) | vllm (CUDA, an optional
    # install; it serves the learner's weights pushed after each update, guijax.rollout.serving)
    backend: Literal["jax", "vllm"] = "jax"
    engine_memory_fraction: float = ranged(0.5, low=0, high=1, low_open=True)  # vllm: its share of GPU memory


@dataclasses.dataclass(frozen=True)
class Pipeline:
    length_buckets: tuple[int, ...] = ranged((256, 512, 1024, 2048, 4096, 8192, 16384), low=1)
    patch_bucket: int = ranged(1024, low=1)
    # grain worker processes for prompt encoding + image patches (0: in-process threads)
    worker_count: int = ranged(0, low=0)
    # log-probs on response positions only, their count padded to this multiple
    response_bucket: int = ranged(64, low=0)
    dedupe_images: bool = True  # each distinct screenshot of a batch through the vision tower once
    # >1: batches of runs of consecutive steps, which share screenshots (fewer patches)
    shuffle_block: int = ranged(1, low=1)
    # vision inputs in per-device blocks (each data-parallel device lays out its own rows' screenshots), so the
    # vision tower's gathers stay on-device instead of being replicated across the mesh. Screenshots are
    # deduplicated within a block only.
    vision_per_device: bool = False
    # padding-free batches: each minibatch's steps packed end to end into rows of `pack_length` tokens (0: a
    # length bucket per minibatch, by `pack_length_rule`), `pack_rows` rows per minibatch (0: as
    # many as it needs; a number gives every minibatch that fits one shape, one compiled step, and one that does not
    # pack_rows x 2^k rows), each data-parallel device packing its own steps
    pack: bool = False
    pack_length: int = ranged(0, low=0)
    # "one_row": the smallest bucket that holds the minibatch's tokens in one row, else the largest (few shapes);
    # "fewest_slots": the bucket whose rows hold it in the fewest token slots (higher fill, more shapes)
    pack_length_rule: Literal["one_row", "fewest_slots"] = "one_row"
    pack_rows: int = ranged(0, low=0)
    # token-budget minibatches (RL updates): each pass's steps are packed into the fewest rows first-fit or
    # least-slack filling finds, and the rows fill minibatches of the one shape `pack_rows` x `pack_length` (both
    # needed), at most `train.minibatch_size` steps each, so nearly every token slot is filled and the number of
    # minibatches follows the tokens; each data-parallel device's block planned alike; one shape needs
    # `max_response_tokens` and `vision_images` fixed too; `shuffle_block`'s runs do not carry into the
    # minibatches. SFT streams keep minibatches of `minibatch_size` steps
    pack_fill: bool = False
    # the response budget: loss tokens per step (0: the longest step's, rounded up to `response_bucket`); a
    # number fixes the shape, and a step with more loss tokens is refused
    max_response_tokens: int = ranged(0, low=0)
    # > 0: every vision layout holds exactly this many screenshots (the distinct ones padded with blank ones of
    # their size; one screenshot size; x 2^k for a minibatch with more), so the vision inputs keep one shape;
    # 0: padded to `patch_bucket`
    vision_images: int = ranged(0, low=0)


@dataclasses.dataclass(frozen=True)
class Train:
    """The method-independent training keys; a method's own knobs live in its section. `loss` "" is the
    method's own loss; a named one must be among those the method can use (checked by the method)."""

    loss: Literal["", "grpo", "luffy", "sft"] = ""

    iterations: int = ranged(100, low=1)
    ppo_epochs: int = ranged(1, low=1)
    minibatch_size: int = ranged(8, low=1)
    eps_low: float = ranged(0.2, low=0, high=1, high_open=True)  # ratio clipped below at 1 - eps_low
    eps_high: float = ranged(0.3, low=0)
    dual_clip: float = ranged(0.0, low=1, low_open=True, also=0)  # c > 1 bounds negative-advantage losses; 0: off
    kl_coef: float = ranged(0.0, low=0)
    # routed-expert policies: weight of the router's load-balancing loss (0: off, as transformers fine-tunes)
    router_aux_loss_coef: float = ranged(0.0, low=0)
    normalization: Literal["token", "sequence"] = "token"  # guijax.losses.NORMALIZATIONS
    logprob_impl: Literal["auto", "pallas", "pallas_interpret", "chunked", "naive"] = "auto"  # guijax.kernels.api
    checkpoint_every: int = ranged(5, low=1)
    keep_checkpoints: int = ranged(3, low=1)
    max_nonfinite_in_row: int = ranged(3, low=1)
    # rollout.mode=async: truncation of each token's importance weight π_old / π_behaviour
    behaviour_weight_cap: float = ranged(5.0, low=1)
    # that weighting in synchronous runs too (asynchronous ones always have it): corrects the gap between the
    # sampler's log-probs and the learner's (`behaviour_kl` in the metrics), e.g. a sampler in lower precision
    behaviour_correction: bool = False


@dataclasses.dataclass(frozen=True)
class Optim:
    learning_rate: float = ranged(1e-6, low=0, low_open=True)
    warmup_steps: int = ranged(0, low=0)
    total_steps: int = ranged(1000, low=1)
    schedule: Literal["constant", "cosine"] = "constant"  # guijax.optim.make_schedule
    weight_decay: float = ranged(0.0, low=0)
    b1: float = ranged(0.9, low=0, high=1, high_open=True)
    b2: float = ranged(0.999, low=0, high=1, high_open=True)
    eps: float = ranged(1e-8, low=0, low_open=True)
    max_grad_norm: float = ranged(1.0, low=0)  # 0: no clipping
    grad_accum_steps: int = ranged(1, low=1)
    state_dtype: Literal["float32", "bfloat16"] = "float32"  # AdamW moments (guijax.optim.DTYPES)


@dataclasses.dataclass(frozen=True)
class Sft:
    steps: int = ranged(0, low=0)  # 0: no warm start (the sft stage is skipped)
    batch_size: int = ranged(8, low=1)
    learning_rate: float = ranged(1e-4, low=0, low_open=True)
    traces_per_task: int = ranged(1, low=1)
    expert_noise: float = ranged(0.0, low=0, high=1)  # scripted expert: chance of a wrong or missed action
    # what the noise's own actions train: 'train' (every step is a target, the wrong clicks too) | 'mask' (they
    # carry no loss; the expert's recovery from the states they make does, as in DART-style noise injection)
    noisy_steps: Literal["train", "mask"] = "train"
    families: tuple[DeskFamily, ...] = ()  # empty: every family of the training split
    plan_only_families: tuple[DeskFamily, ...] = ()  # families whose traces appear only plan-conditioned
    # share of SFT traces repeated with the plan appended (BEPA LEVEL-1 prompts)
    plan_fraction: float = ranged(0.0, low=0, high=1)
    # what those repeated traces carry after the instruction: BEPA's plan, or SGCD's skill for the task (the desk's
    # offline extractor without failure evidence), so the base policy can read that context
    conditioning: Literal["plan", "skill"] = "plan"
    # steps between SFT checkpoints (params, optimiser, grain iterator position)
    checkpoint_every: int = ranged(50, low=1)
    # what the warm start trains on: the scripted expert's traces (above) | the coldstart stage's hindsight-
    # annotated traces in the computer_use grammar (EvoCUA's cold start; that stage must run before sft)
    data: Literal["expert", "coldstart"] = "expert"


@dataclasses.dataclass(frozen=True)
class Coldstart:
    """EvoCUA's cold start (§5.1), the `coldstart` stage: successful scripted-expert traces of the training tasks
    (or the traces in `traces_dir`) with a hindsight thought for every step, written in the grammar
    `rollout.prompt` asks for; `sft.data='coldstart'` trains on them. How many earlier steps keep their screenshot and whole text
    is `rollout.max_images`, as in the rollouts."""

    traces_per_task: int = ranged(1, low=1)
    expert_noise: float = ranged(0.0, low=0, high=1)  # scripted expert: chance of a wrong or missed action
    hindsight: Literal["rule", "chat"] = "rule"  # the desk's accessibility-tree writer | a VLM endpoint
    # rule writer: one sentence per step (the action's reason, what remains, the verdict) without describing
    # the screen, a fifth of the tokens, for small models on CPU
    brief: bool = False
    hindsight_url: str = ""  # chat: an OpenAI-compatible base URL
    hindsight_model: str = ""
    hindsight_api_key_env: str = "OPENAI_API_KEY"  # chat: the variable holding the key ("" for none)
    hindsight_retries: int = ranged(2, low=0)  # chat: answers asked again before a step is skipped
    # a folder of cold-start traces recorded elsewhere (guijax.evocua.office_coldstart's --out: references replayed
    # on the desktop's office apps); the stage then takes them instead of running the desk's scripted expert
    traces_dir: str = ""


@dataclasses.dataclass(frozen=True)
class Compare:
    """`compare`: the methods the `methods` stage trains from one base policy (names checked by the registry)."""

    methods: tuple[str, ...] = ("grpo", "bepa")


@dataclasses.dataclass(frozen=True)
class DryRun:
    """--dry_run compiles the real train step at these shapes."""

    topology: str = ""  # a TPU topology such as "v5p:4x4x4"; GPU recipes: XLA:GPU, or one v5p chip per GPU
    screenshot_hw: tuple[int, int] = ranged((1080, 1920), low=1)  # each row's screenshots (rollout.max_images)
    # target: the recipe's own (a TPU topology; for a GPU recipe of up to 8 GPUs XLA:GPU where JAX's CUDA plugin
    # is installed, else the v5p proxy); tpu_proxy: a GPU recipe's v5p proxy even where XLA:GPU is installed (for
    # other recipes the same as target); cpu: this machine's XLA:CPU even where libtpu is installed, an upper
    # bound to set against another compiler's figures
    compiler: Literal["target", "tpu_proxy", "cpu"] = "target"
    # GiB per device the TPU compiler schedules and rematerialises against (0: the target's own, a TPU chip's
    # HBM, or for a GPU proxy the GPU's memory over the proxy factor; refused by XLA:CPU and XLA:GPU). The
    # compiler spends memory freely up to its limit, so a peak says what it chose under that limit, not the
    # least the step could need.
    compiler_memory_gib: float = ranged(0.0, low=0)


@dataclasses.dataclass(frozen=True)
class Eval:
    splits: tuple[Literal["train", "held_out", "expert_only"], ...] = ("train", "held_out")
    episodes_per_task: int = ranged(4, low=1)
    temperature: float = ranged(0.6, low=0)  # 0: greedy
    pass_k: tuple[int, ...] = ranged((1,), low=1)
    # step limits to score the same episodes under, as if cut after L steps (EvoCUA's 15 vs 50 steps); each
    # split's report gains success_at_step_limit; a limit above one an episode was cut at scores None
    step_limits: tuple[int, ...] = ranged((), low=1)
    # episodes on each evaluation's inspector page (every task's first episode, then its second, ...; the
    # stored episodes keep all of them); 0: no page. Pages embed screenshots, so full-HD desktops make them large
    inspector_episodes: int = ranged(24, low=0)
    # what samples the evaluations (eval stages, SGCD's csr): the JAX sampler | vLLM (the process's serving
    # engine, guijax.rollout.backend.shared_engine), independently of rollout.backend
    backend: Literal["jax", "vllm"] = "jax"
    # an unparsable answer drawn again up to this many times, at eval.temperature times parse_retry_decay
    # (SGCD's evaluation protocol: 10 retries at a reduced temperature); 0: it ends the episode as a parse
    # error. Evaluations only: RL rollouts stay on-policy
    parse_retries: int = ranged(0, low=0)
    parse_retry_decay: float = ranged(0.5, low=0, high=1, low_open=True)


@dataclasses.dataclass(frozen=True)
class Synthesis:
    """`synthesis`: EvoCUA's verifiable task synthesis stage (guijax.pipeline.synthesis_stages) on the desk."""

    count: int = ranged(24, low=1)  # tasks to accept from the closed loop (before the quality filters)
    max_attempts: int = ranged(3, low=1)  # proposals per scenario, each after the sandbox's error on the last
    max_scenarios: int = ranged(0, low=0)  # scenarios tried at most; 0: 4 x count
    seed: int = ranged(0, low=0)  # mixed into the run's seed for the scenario draws
    # guijax.evocua.task_space.CAPABILITIES; empty: all
    capabilities: tuple[Literal["click", "toggle", "type", "choose", "slider", "list", "form", "confirm", "copy",
                                "save_note", "infeasible"], ...] = ()
    compose_prob: float = ranged(0.3, low=0, high=1)  # chance a scenario composes two capabilities
    architect: Literal["procedural", "chat"] = "procedural"  # offline composer | an OpenAI-compatible model
    chat_url: str = ""  # architect='chat': the endpoint (OpenAI-compatible)
    chat_model: str = ""
    chat_api_key_env: str = "OPENAI_API_KEY"
    chat_retries: int = ranged(2, low=0)  # malformed answers asked again before the scenario is skipped
    reference_episodes: int = ranged(3, low=1)  # scripted-expert episodes per task, pop-ups on
    expert_noise: float = ranged(0.0, low=0, high=1)  # the reference expert's chance of a wrong or missed action
    ngram: int = ranged(3, low=1)  # instruction decontamination: word n-grams
    instruction_threshold: float = ranged(0.5, low=0, high=1)  # drop at this n-gram Jaccard with a held-out task
    config_threshold: float = ranged(1.0, low=0, high=1)  # ... at this scene-content overlap (1: identical only)
    evaluator_threshold: float = ranged(1.0, low=0, high=1)  # ... at this success-condition overlap


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig(TopLevel):
    """A validated recipe: the generic sections typed, the method-declared ones in `sections`."""

    model: Model
    lora: Lora
    mesh: Mesh
    env: Env
    rollout: Rollout
    pipeline: Pipeline
    train: Train
    optim: Optim
    sft: Sft
    coldstart: Coldstart
    synthesis: Synthesis
    eval: Eval
    dry_run: DryRun
    compare: Compare
    sections: Mapping[str, Any] = dataclasses.field(default_factory=lambda: MappingProxyType({}))


GENERIC: Mapping[str, type] = MappingProxyType(
    {name: tp for name, tp in typing.get_type_hints(RunConfig).items() if dataclasses.is_dataclass(tp)})


# ---- parsing ----

def section_defaults(cls: type) -> ml_collections.ConfigDict:
    """A config node holding `cls`'s defaults, so recipes start from the values the schema declares."""
    node = ml_collections.ConfigDict()
    for f in dataclasses.fields(cls):
        if f.default is dataclasses.MISSING:
            raise TypeError(f"{cls.__name__}.{f.name} has no default")
        node[f.name] = f.default
    return node


def default_values(extra: Mapping[str, type] = MappingProxyType({})) -> dict[str, Any]:
    """{dotted key: schema default} of every key: the top-level scalars, the generic sections and `extra`."""
    out = {f.name: f.default for f in dataclasses.fields(TopLevel)}
    for name, cls in {**GENERIC, **extra}.items():
        out.update({f"{name}.{f.name}": f.default for f in dataclasses.fields(cls)})
    return out


def parse_section(cls: type, node: ml_collections.ConfigDict, prefix: str) -> Any:
    """`node` as a `cls` instance; every problem of it in one ConfigError, each naming `prefix.key`."""
    errors: list[str] = []
    values = _parse(cls, node, prefix, errors)
    if errors:
        raise ConfigError("\n".join(errors))
    return cls(**values)


def validate(config: ml_collections.ConfigDict, extra: Mapping[str, type] = MappingProxyType({})) -> RunConfig:
    """The whole recipe checked: the generic sections, the `extra` ones (section name -> dataclass, declared
    by the methods), the top-level scalars; any other top-level section is an error."""
    clash = sorted(set(extra) & (set(GENERIC) | {f.name for f in dataclasses.fields(TopLevel)}))
    if clash:
        raise ValueError(f"extra sections {clash} clash with the generic schema")
    declared = {**GENERIC, **extra}
    errors: list[str] = []
    top = _parse(TopLevel, config, "", errors, sections=tuple(declared))
    parsed = {}
    for name, cls in declared.items():
        if name not in config:
            errors.append(f"missing config section {name!r}")
        elif not isinstance(config[name], ml_collections.ConfigDict):
            errors.append(f"{name}={config[name]!r} must be a config section, got {type(config[name]).__name__}")
        else:
            before = len(errors)
            values = _parse(cls, config[name], name, errors)
            if len(errors) == before:
                parsed[name] = cls(**values)
    if errors:
        raise ConfigError("\n".join(errors))
    generic = {name: parsed[name] for name in GENERIC}
    sections = MappingProxyType({name: parsed[name] for name in extra})
    return RunConfig(**top, **generic, sections=sections)


def _key(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _parse(cls: type, node: ml_collections.ConfigDict, prefix: str, errors: list[str],
           sections: tuple[str, ...] = ()) -> dict[str, Any]:
    """Checked values of `cls`'s fields from `node`, appending one line per problem to `errors`; keys in
    `sections` are left to the caller."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    known = names + list(sections)
    for key in node.keys():
        if key not in known:
            section = isinstance(node[key], ml_collections.ConfigDict)
            what = "undeclared config section" if section else "unknown config key"
            near = difflib.get_close_matches(key, known, n=3, cutoff=0.6)
            hint = (f"did you mean {' or '.join(repr(_key(prefix, k)) for k in near)}?" if near
                    else f"known: {', '.join(known)}")
            errors.append(f"{what} {_key(prefix, key)!r}; {hint}")
    values = {}
    for f in dataclasses.fields(cls):
        full = _key(prefix, f.name)
        if f.name not in node:
            errors.append(f"missing config key {full!r}")
        else:
            values[f.name] = _value(node[f.name], hints[f.name], f.metadata.get("range"), full, errors)
    return values


_TYPE_NAMES = {bool: "a bool", int: "an int", float: "a float", str: "a str"}


def _value(value: Any, tp: Any, bounds: Range | None, key: str, errors: list[str]) -> Any:
    """`value` checked against `tp` and `bounds` (int widened to float, list to tuple)."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        choices = typing.get_args(tp)
        if not any(type(value) is type(c) and value == c for c in choices):
            errors.append(f"{key}={value!r} is not one of {choices}")
        return value
    if origin is tuple:
        if not isinstance(value, (tuple, list)):
            errors.append(f"{key}={value!r} must be a tuple, got {type(value).__name__}")
            return value
        args = typing.get_args(tp)
        items = args[:1] * len(value) if len(args) == 2 and args[1] is Ellipsis else args
        if len(items) != len(value):
            errors.append(f"{key}={value!r} must have {len(items)} items, got {len(value)}")
            return tuple(value)
        return tuple(_value(v, t, bounds, f"{key}[{i}]", errors) for i, (v, t) in enumerate(zip(value, items)))
    if tp not in _TYPE_NAMES:
        raise TypeError(f"{key}: unsupported schema type {tp!r}")
    ok = isinstance(value, tp) and (tp is bool or not isinstance(value, bool))
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        value, ok = float(value), True
    if not ok:
        errors.append(f"{key}={value!r} must be {_TYPE_NAMES[tp]}, got {type(value).__name__}")
    elif bounds is not None and (math.isnan(value) or value not in bounds):
        errors.append(f"{key}={value!r} must be {bounds}")
    return value
