"""Recipe stages run in order by `guijax.launch`. Each stage leaves its result in the workdir and is skipped
when that result already exists, so re-running a command with the same --workdir resumes where it stopped.

    base_model   fresh preset checkpoint (random init + local tokenizer), unless model.path is given
    tasks        synthetic-desk tasks (generation-as-validation) and their train / held-out splits
    sft          short supervised warm start on scripted-expert traces -> the base policy (sft_model/)
    eval_base    success of the base policy per split (eval_base.json)
    grpo         the RL loop with the recipe's algorithm hook (checkpoints/, metrics.jsonl)
    eval_final   success of the trained policy (eval_final.json)
    report       report.md with the results table and curves.png

The expert-guided stages (expert, level1, select, methods, table) live in guijax/stages_bepa.py.
"""
from __future__ import annotations

import dataclasses
import json
import pathlib
import random
from typing import Any, Callable

import jax
import ml_collections
from absl import logging

from guijax.rollout.prompt import COMPACT_PROMPT

STAGES: dict[str, Callable[["Run"], None]] = {}


def stage(name: str):
    def wrap(fn):
        STAGES[name] = fn
        return fn

    return wrap


@dataclasses.dataclass
class Run:
    config: ml_collections.ConfigDict
    workdir: pathlib.Path
    _cache: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def system_prompt(self) -> str | None:
        return COMPACT_PROMPT if self.config.rollout.prompt == "compact" else None

    def mesh(self):
        if "mesh" not in self._cache:
            from guijax.sharding import MeshConfig, make_mesh

            m = self.config.mesh
            self._cache["mesh"] = make_mesh(MeshConfig(m.data, m.fsdp, m.tensor))
        return self._cache["mesh"]

    @property
    def base_model_dir(self) -> pathlib.Path:
        return pathlib.Path(self.config.model.path) if self.config.model.path else self.workdir / "base_model"

    def load_policy(self, path: pathlib.Path):
        from guijax.models.policy import from_pretrained

        policy = from_pretrained(path, dtype=self.config.model.dtype,
                                 param_dtype=self.config.model.param_dtype or None, mesh=self.mesh(),
                                 remat_policy=self.config.model.remat,
                                 attention_impl=self.config.model.get("attention", "auto"))
        processor = policy.processor
        if self.config.model.image_max_pixels:
            processor.image_processor = dataclasses.replace(processor.image_processor,
                                                            max_pixels=self.config.model.image_max_pixels)
        return policy

    def tasks(self) -> dict[str, list]:
        from envs.tasks import load_tasks

        if "tasks" not in self._cache:
            data = json.loads((self.workdir / "splits.json").read_text())
            tasks = {t.id: t for t in load_tasks(self.workdir / "tasks.json")}
            self._cache["tasks"] = {name: [tasks[i] for i in ids] for name, ids in data.items()}
        return self._cache["tasks"]

    def pool(self):
        if "pool" not in self._cache:
            from envs.pool import DeskFactory, EnvPool

            e = self.config.env
            if e.kind == "desk":
                factories = DeskFactory(tuple(e.screen), e.step_limit, self.config.seed, e.popups)
                workers = e.num_workers
            elif e.kind == "osworld":
                import os

                from envs.client import RemoteFactory

                if not e.server_urls:
                    raise ValueError("env.kind='osworld' needs env.server_urls: one desktop server (an OSWorld VM "
                                     "or `python -m envs.server`) per rollout worker")
                token = os.environ.get(e.server_token_env) if e.server_token_env else None
                factories = [RemoteFactory(url, token, e.step_limit, tuple(e.cache_dirs)) for url in e.server_urls]
                workers = len(factories)
            else:
                raise ValueError(f"unknown env.kind {e.kind!r}; choose 'desk' or 'osworld'")
            self._cache["pool"] = EnvPool(factories, workers, timeout_s=e.timeout_s)
        return self._cache["pool"]

    def engine(self, policy, temperature: float):
        from guijax.rollout.engine import RolloutEngine
        from guijax.sampling import Sampler
        from guijax.trainer import rollout_config, sampling_config

        sampler = Sampler(policy.module, sampling_config(self.config, policy.processor, temperature), mesh=self.mesh())
        return RolloutEngine(self.pool(), sampler, policy.processor, rollout_config(self.config, self.system_prompt))

    def close(self) -> None:
        if "pool" in self._cache:
            self._cache["pool"].close()


@stage("base_model")
def base_model(run: Run) -> None:
    from guijax.models.fresh import create_checkpoint

    if run.config.model.path:
        if not (run.base_model_dir / "config.json").exists():
            raise FileNotFoundError(f"model.path {run.base_model_dir} has no config.json")
        return
    if (run.base_model_dir / "config.json").exists():
        return
    logging.info("creating a fresh %s checkpoint in %s", run.config.model.preset, run.base_model_dir)
    create_checkpoint(run.base_model_dir, run.config.model.preset, seed=run.config.seed,
                      tokenizer_vocab=run.config.model.tokenizer_vocab, mesh=run.mesh())


@stage("tasks")
def tasks(run: Run) -> None:
    from envs.tasks import generate_desk_tasks, save_tasks, split_tasks

    if (run.workdir / "splits.json").exists():
        return
    e = run.config.env
    if e.kind == "osworld":
        from envs.osworld.loader import load_osworld, load_split

        if not e.osworld_dir:
            raise ValueError("env.kind='osworld' needs env.osworld_dir (OSWorld's evaluation_examples folder)")
        loaded = load_split(e.osworld_split, e.osworld_dir) if e.osworld_split else load_osworld(e.osworld_dir)
        generated = [t.task for t in loaded]
    else:
        generated = generate_desk_tasks(e.num_tasks, seed=run.config.seed, families=list(e.families) or None,
                                        screen_hw=tuple(e.screen))
    splits = split_tasks(generated, held_out_families=list(e.held_out_families), held_out_fraction=e.held_out_fraction,
                         seed=run.config.seed)
    save_tasks(generated, run.workdir / "tasks.json")
    (run.workdir / "splits.json").write_text(json.dumps({k: [t.id for t in v] for k, v in splits.items()}, indent=1))
    print(f"tasks: {len(splits['train'])} train, {len(splits['held_out'])} held-out")


def expert_trajectories(run: Run, task_list) -> list:
    """Converted successful scripted-expert traces (`sft.traces_per_task` per task); each carries the plan
    φ(τ) of the rule-based extractor in meta["phi_plan"] for plan-conditioned SFT examples."""
    from envs.desk import DeskEnv, ScriptedExpert, run_expert
    from guijax.plans import RulePlanExtractor
    from guijax.rollout.conversion import convert_trace

    e = run.config.env
    env = DeskEnv(tuple(e.screen), e.step_limit, seed=run.config.seed, popups=e.popups)
    extractor = RulePlanExtractor()
    out = []
    for i, task in enumerate(task_list):
        for k in range(run.config.sft.traces_per_task):
            trace = run_expert(env, task, ScriptedExpert(noise=run.config.sft.expert_noise, seed=run.config.seed + 97 * i + k))
            if trace.reward >= 1.0:
                converted = convert_trace(trace)
                converted.meta["phi_plan"] = extractor(trace)
                out.append(converted)
    return out


def sft_trajectories(run: Run) -> list:
    """The warm start's data: expert traces of the training tasks (of `sft.families` when set), plus a
    `sft.plan_fraction` share repeated with the plan appended to the instruction, so the base policy knows
    what a plan is (a released UI-TARS model reads one as ordinary instruction text). Families in
    `sft.plan_only_families` appear only with their plan: the base policy can follow a plan there but
    has never solved the bare instruction, the situation BEPA's LEVEL-1 is built for."""
    s = run.config.sft
    unknown = sorted(set(s.plan_only_families) - set(run.config.env.families)) if run.config.env.families else []
    if unknown:
        raise ValueError(f"sft.plan_only_families {unknown} are not in env.families {list(run.config.env.families)}")
    tasks = [t for t in run.tasks()["train"]
             if not s.families or t.domain in s.families or t.domain in s.plan_only_families]
    trajectories = expert_trajectories(run, tasks)
    domain = {t.id: t.domain for t in tasks}
    rng = random.Random(run.config.seed + 5)
    plain, planned = [], []
    for t in trajectories:
        plan_only = domain[t.task_id] in s.plan_only_families
        if not plan_only:
            plain.append(t)
        if plan_only or rng.random() < s.plan_fraction:
            planned.append(dataclasses.replace(t, plan=tuple(t.meta["phi_plan"])))
    return plain + planned


@stage("sft")
def sft(run: Run) -> None:
    from guijax.metrics import MetricsWriter
    from guijax.models.policy import save_pretrained
    from guijax.trainer import pipeline_config, sft_steps

    out = run.workdir / "sft_model"
    if (out / "config.json").exists() or run.config.sft.steps == 0:
        return
    policy = run.load_policy(run.base_model_dir)
    trajectories = sft_trajectories(run)
    writer = MetricsWriter(run.workdir, "sft_metrics.jsonl", console=False)
    params, losses_seen = sft_steps(policy, trajectories, policy.processor, run.config,
                                    pipeline_config(run.config, run.system_prompt), run.config.sft.steps,
                                    run.config.sft.batch_size, seed=run.config.seed, log=writer.write,
                                    checkpoint_dir=run.workdir / "sft_checkpoints",
                                    checkpoint_every=run.config.sft.checkpoint_every)
    writer.close()
    policy.params = params
    save_pretrained(policy, out)
    print(f"sft: {len(trajectories)} expert trajectories, loss {losses_seen[0]:.3f} -> {losses_seen[-1]:.3f}")


def policy_dir(run: Run) -> pathlib.Path:
    sft_dir = run.workdir / "sft_model"
    return sft_dir if (sft_dir / "config.json").exists() else run.base_model_dir


def _evaluate(run: Run, model_dir: pathlib.Path, name: str) -> None:
    from guijax.evaluation import evaluate, write_report

    if (run.workdir / f"{name}.json").exists():
        return
    policy = run.load_policy(model_dir)
    ev = run.config.eval
    splits = {k: v for k, v in run.tasks().items() if k in ev.splits}
    report = evaluate(run.engine(policy, ev.temperature), policy.params, splits, ev.episodes_per_task,
                      seed=run.config.seed + 12345, ks=tuple(ev.pass_k))
    write_report(run.workdir, name, report)
    print(f"{name}: " + ", ".join(f"{s} {100 * r.get('success_rate', 0):.1f}%" for s, r in report["splits"].items()))


@stage("eval_base")
def eval_base(run: Run) -> None:
    _evaluate(run, policy_dir(run), "eval_base")


@stage("grpo")
def grpo(run: Run) -> None:
    from guijax.models.policy import save_pretrained
    from guijax.trainer import Components, Trainer

    if (run.workdir / "trained_model" / "config.json").exists():
        return
    from guijax.stages_bepa import make_hook, training_tasks

    policy = run.load_policy(policy_dir(run))
    hook = make_hook(run, run.workdir, {"algorithm": run.config.algorithm.name,
                                        "seed_cache": run.config.algorithm.seed_cache}, run.config)
    parts = Components(policy, run.pool(), policy.processor, training_tasks(run, run.config), hook,
                       run.system_prompt, run.mesh())
    trainer = Trainer(run.config, run.workdir, parts)
    trainer.maybe_restore()
    trainer.fit()
    trainer.close()
    policy.params = trainer.state.params
    save_pretrained(policy, run.workdir / "trained_model")


@stage("eval_final")
def eval_final(run: Run) -> None:
    _evaluate(run, run.workdir / "trained_model", "eval_final")


@stage("report")
def report(run: Run) -> None:
    from guijax.evaluation import markdown_table
    from guijax.metrics import read_metrics
    from guijax.report import plot_curves

    reports = {}
    for label, name in (("base policy", "eval_base"), ("after RL", "eval_final")):
        path = run.workdir / f"{name}.json"
        if path.exists():
            reports[label] = json.loads(path.read_text())
    table = markdown_table(reports) if reports else "(no evaluations)"
    plot = plot_curves(read_metrics(run.workdir / "metrics.jsonl"), run.workdir / "curves.png")
    text = f"# {run.config.name}\n\nSuccess rate (tasks per split in parentheses):\n\n{table}\n"
    if plot:
        text += f"\n![training curves]({plot.name})\n"
    (run.workdir / "report.md").write_text(text)
    print(text)


def run_stages(config: ml_collections.ConfigDict, workdir: pathlib.Path) -> None:
    import guijax.stages_bepa  # noqa: F401  (registers the expert-guided stages)
    from guijax import compilation_cache

    unknown = [s for s in config.stages if s not in STAGES]
    if unknown:
        raise ValueError(f"unknown stages {unknown} in config.stages; available: {list(STAGES)}")
    compilation_cache.enable(config.compilation_cache_dir)
    run = Run(config, pathlib.Path(workdir))
    try:
        for name in config.stages:
            logging.info("stage %s", name)
            STAGES[name](run)
    finally:
        run.close()
        jax.effects_barrier()
