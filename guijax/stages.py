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
import time
from typing import Any, Callable

import jax
import ml_collections

from envs.atomic import write_text_atomic
from guijax import progress
from guijax.rollout.prompt import prompt_template

@dataclasses.dataclass(frozen=True)
class Stage:
    """A named step of a recipe. `describe` says what it will do and how much (printed when it starts),
    `done` whether its result is already in the workdir (a resumed run skips it and says so), and the
    function returns its headline figure (printed when it ends)."""

    name: str
    fn: Callable[["Run"], str | None]
    describe: Callable[["Run"], str]
    done: Callable[["Run"], bool]


STAGES: dict[str, Stage] = {}


def stage(name: str, describe: Callable[["Run"], str], done: Callable[["Run"], bool] | None = None):
    """Register a stage; without `done` it is a summary that is rewritten on every run."""

    def wrap(fn):
        STAGES[name] = Stage(name, fn, describe, done or (lambda run: False))
        return fn

    return wrap


def output_exists(relative: str) -> Callable[["Run"], bool]:
    """A stage is done when the file it writes last exists."""
    return lambda run: (run.workdir / relative).exists()


@dataclasses.dataclass
class Run:
    config: ml_collections.ConfigDict
    workdir: pathlib.Path
    _cache: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def system_prompt(self) -> str:
        return prompt_template(self.config.rollout.prompt)

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
                                 attention_impl=self.config.model.get("attention", "auto"),
                                 scan_layers=self.config.model.scan_layers)
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


def _describe_base_model(run: Run) -> str:
    if run.config.model.path:
        return f"check the checkpoint at model.path {run.config.model.path}"
    return f"a fresh {run.config.model.preset} checkpoint with a locally trained tokenizer"


@stage("base_model", _describe_base_model,
       done=lambda run: not run.config.model.path and (run.base_model_dir / "config.json").exists())
def base_model(run: Run) -> str:
    from guijax.models.fresh import create_checkpoint

    if run.config.model.path:
        if not (run.base_model_dir / "config.json").exists():
            raise FileNotFoundError(f"model.path {run.base_model_dir} has no config.json")
        return f"{run.base_model_dir} has a config.json"
    create_checkpoint(run.base_model_dir, run.config.model.preset, seed=run.config.seed,
                      tokenizer_vocab=run.config.model.tokenizer_vocab, mesh=run.mesh())
    return f"written to {run.base_model_dir}"


def _describe_tasks(run: Run) -> str:
    e = run.config.env
    if e.kind == "osworld":
        return f"load the OSWorld tasks of {e.osworld_split or e.osworld_dir} and split them"
    families = ", ".join(e.families) if e.families else "every family"
    return f"generate {e.num_tasks} synthetic-desk tasks ({families}) and split them train / held-out"


@stage("tasks", _describe_tasks, done=output_exists("splits.json"))
def tasks(run: Run) -> str:
    from envs.tasks import generate_desk_tasks, save_tasks, split_tasks

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
    return f"{len(splits['train'])} train, {len(splits['held_out'])} held-out"


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


def _describe_sft(run: Run) -> str:
    s = run.config.sft
    return (f"warm start: {s.steps} steps of {s.batch_size} expert-trace steps at lr {s.learning_rate:g} "
            f"({s.traces_per_task} scripted-expert traces per training task)")


@stage("sft", _describe_sft,
       done=lambda run: run.config.sft.steps == 0 or (run.workdir / "sft_model" / "config.json").exists())
def sft(run: Run) -> str:
    from guijax.metrics import MetricsWriter
    from guijax.models.policy import save_pretrained
    from guijax.trainer import pipeline_config, sft_steps

    out = run.workdir / "sft_model"
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
    return f"{len(trajectories)} expert trajectories, loss {losses_seen[0]:.3f} -> {losses_seen[-1]:.3f}"


def policy_dir(run: Run) -> pathlib.Path:
    sft_dir = run.workdir / "sft_model"
    return sft_dir if (sft_dir / "config.json").exists() else run.base_model_dir


def evaluate_into(run: Run, model_dir: pathlib.Path, report_path: pathlib.Path) -> str:
    """Evaluate the policy in `model_dir` on the recipe's eval splits; write the report; return its headline."""
    from guijax.evaluation import evaluate, write_report

    ev = run.config.eval
    policy = run.load_policy(model_dir)
    splits = {k: v for k, v in run.tasks().items() if k in ev.splits}
    report = evaluate(run.engine(policy, ev.temperature), policy.params, splits, ev.episodes_per_task,
                      seed=run.config.seed + 12345, ks=tuple(ev.pass_k))
    write_report(report_path.parent, report_path.stem, report)
    return ", ".join(f"{s} {100 * r.get('success_rate', 0):.1f}%" for s, r in report["splits"].items())


def describe_eval(run: Run) -> str:
    ev = run.config.eval
    try:
        sizes = {k: len(v) for k, v in run.tasks().items() if k in ev.splits}
    except FileNotFoundError:
        sizes = {k: "?" for k in ev.splits}
    return (f"{ev.episodes_per_task} episode(s) per task at temperature {ev.temperature} on "
            + ", ".join(f"{k} ({n} tasks)" for k, n in sizes.items()))


@stage("eval_base", describe_eval, done=output_exists("eval_base.json"))
def eval_base(run: Run) -> str:
    return evaluate_into(run, policy_dir(run), run.workdir / "eval_base.json")


def describe_rl(config: ml_collections.ConfigDict) -> str:
    r = config.rollout
    return (f"{config.train.iterations} iterations of {r.tasks_per_iteration} tasks x {r.group_size} episodes, "
            f"{config.train.ppo_epochs} PPO epoch(s) each")


@stage("grpo", lambda run: f"RL ({run.config.algorithm.name}): {describe_rl(run.config)}",
       done=output_exists("trained_model/config.json"))
def grpo(run: Run) -> str:
    from guijax.models.policy import save_pretrained
    from guijax.trainer import Components, Trainer
    from guijax.stages_bepa import make_hook, training_tasks

    policy = run.load_policy(policy_dir(run))
    hook = make_hook(run, run.workdir, {"algorithm": run.config.algorithm.name,
                                        "seed_cache": run.config.algorithm.seed_cache}, run.config)
    parts = Components(policy, run.pool(), policy.processor, training_tasks(run, run.config), hook,
                       run.system_prompt, run.mesh())
    trainer = Trainer(run.config, run.workdir, parts)
    trainer.maybe_restore()
    history = trainer.fit(desc=run.config.algorithm.name)
    trainer.close()
    policy.params = trainer.state.params
    save_pretrained(policy, run.workdir / "trained_model")
    return rl_headline(history)


def rl_headline(history: list[dict[str, Any]]) -> str:
    if not history:
        return "no iteration left to run (resumed at the last one)"
    first, last = history[0], history[-1]
    return (f"training success {100 * first['success_rate']:.1f}% (iteration {first['iteration']}) -> "
            f"{100 * last['success_rate']:.1f}% (iteration {last['iteration']})")


@stage("eval_final", describe_eval, done=output_exists("eval_final.json"))
def eval_final(run: Run) -> str:
    return evaluate_into(run, run.workdir / "trained_model", run.workdir / "eval_final.json")


@stage("report", lambda run: "report.md with the results table and training curves")
def report(run: Run) -> str:
    from guijax.evaluation import markdown_table
    from guijax.metrics import read_metrics
    from guijax.report import plot_curves

    text = f"# {run.config.name}\n"
    reports = {}
    for label, name in (("base policy", "eval_base"), ("after RL", "eval_final")):
        path = run.workdir / f"{name}.json"
        if path.exists():
            reports[label] = json.loads(path.read_text())
    methods_table = run.workdir / "table.md"  # an expert-guided recipe's methods, base policy included
    if methods_table.exists():
        text += f"\nSuccess rate by split, every method from the same base policy:\n\n{methods_table.read_text()}"
    elif reports:
        text += f"\nSuccess rate (tasks per split in parentheses):\n\n{markdown_table(reports)}\n"
    else:
        text += "\n(no evaluations)\n"
    plot = plot_curves(read_metrics(run.workdir / "metrics.jsonl"), run.workdir / "curves.png")
    if plot:
        text += f"\n![training curves]({plot.name})\n"
    for name, caption in (("curves_methods.png", "the methods' training curves"),
                          ("diagnostics.png", "token probabilities under the base policy")):
        if (run.workdir / name).exists():
            text += f"\n![{caption}]({name})\n"
    write_text_atomic(run.workdir / "report.md", text)
    return f"{run.workdir / 'report.md'}"


def run_stages(config: ml_collections.ConfigDict, workdir: pathlib.Path) -> None:
    import guijax.stages_bepa  # noqa: F401  (registers the expert-guided stages)
    from guijax import compilation_cache

    unknown = [s for s in config.stages if s not in STAGES]
    if unknown:
        raise ValueError(f"unknown stages {unknown} in config.stages; available: {list(STAGES)}")
    compilation_cache.enable(config.compilation_cache_dir)
    run = Run(config, pathlib.Path(workdir))
    names = list(config.stages)
    found = [n for n in names if STAGES[n].done(run)]
    if found:
        progress.echo(f"{config.name}: resuming in {workdir}; found done: {', '.join(found)}")
    try:
        for i, name in enumerate(names, 1):
            spec = STAGES[name]
            tag = f"[{i}/{len(names)}] {name}"
            if name in found:
                progress.echo(f"{tag}: already done, skipped")
                continue
            progress.echo(f"{tag}: {spec.describe(run)}")
            start = time.perf_counter()
            headline = spec.fn(run)
            progress.echo(f"{tag}: done in {progress.format_duration(time.perf_counter() - start)}"
                          + (f"; {headline}" if headline else ""))
    finally:
        run.close()
        jax.effects_barrier()
