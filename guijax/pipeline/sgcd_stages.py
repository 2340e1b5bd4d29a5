"""SGCD's evaluation stage:

    csr   the Continuation Success Rate (sgcd.txt §5.3, Tables 4-6) of the base policy and of every method of
          compare.methods: on the eval tasks the base (plain) policy fails, the base policy acts k steps
          (k = 1..sgcd.csr_max_handoff; one prefix per task, every depth branched from it), then the evaluated
          policy continues with no skill; so do the checkpoints of sgcd.csr_baselines, each in its own prompt
          (Table 6's baselines); csr.json, csr.md and csr.png (per-depth curves and, on the desk, the
          plain policy's failure-step histogram of Fig. 1a)
"""
from __future__ import annotations

import json
import pathlib
from typing import Sequence

from envs.atomic import write_text_atomic
from guijax.pipeline.base_stages import BASE_POLICY, EVAL_READS, SPLITS, policy_dir
from guijax.pipeline.run import Run
from guijax.pipeline.stage import output_exists, stage

CSR_READS = EVAL_READS + ("sgcd.csr_max_handoff", "sgcd.csr_splits", "sgcd.csr_per_state",
                          "sgcd.csr_prefix_stop_retries", "sgcd.csr_baselines", "sgcd.replay_tolerance",
                          "compare.methods")


def failed_tasks(run: Run) -> list:
    """The tasks of sgcd.csr_splits the base policy never solved in its evaluation (eval_base.json)."""
    path = run.workdir / "eval_base.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} missing: the csr stage reads which tasks the base policy fails; add "
                                "'eval_base' to config.stages before 'csr'")
    report = json.loads(path.read_text())
    out = []
    for split in run.config.sgcd.csr_splits:
        entry = report["splits"].get(split)
        if entry == {"tasks": 0}:  # an empty split: evaluated, nothing failed
            continue
        rates = (entry or {}).get("per_task")
        if rates is None:
            raise ValueError(f"sgcd.csr_splits names {split!r}, which eval_base.json does not hold; add it to "
                             "eval.splits")
        out += [t for t in run.tasks()[split] if rates.get(t.id, 1.0) == 0.0]
    return out


def baselines(entries: Sequence[str], taken: Sequence[str] = ()) -> dict[str, tuple[pathlib.Path, str | None]]:
    """`sgcd.csr_baselines` read: {name: (checkpoint directory, prompt or None for rollout.prompt)}; an entry
    that is malformed, names a missing checkpoint or prompt, or repeats a name is refused naming it."""
    from guijax.rollout.prompt import PROMPTS

    out: dict[str, tuple[pathlib.Path, str | None]] = {}
    for entry in entries:
        name, sep, rest = (part.strip() for part in entry.partition("="))
        where, at, prompt = (part.strip() for part in rest.rpartition("@"))
        if not at or (prompt not in PROMPTS and (pathlib.Path(rest) / "config.json").exists()):
            where, at, prompt = rest, "", ""  # no prompt: an '@' in the directory's own name
        if not sep or not name or not where or (at and not prompt):
            raise ValueError(f"sgcd.csr_baselines entry {entry!r} is not NAME=DIR or NAME=DIR@PROMPT")
        if name in out or name in taken:
            raise ValueError(f"sgcd.csr_baselines entry {entry!r}: the name {name!r} is taken (by the base policy, a "
                             "method of compare.methods or another baseline)")
        if prompt and prompt not in PROMPTS:
            raise ValueError(f"sgcd.csr_baselines entry {entry!r}: prompt {prompt!r} is not one of {', '.join(PROMPTS)}")
        if not (pathlib.Path(where) / "config.json").exists():
            raise FileNotFoundError(f"sgcd.csr_baselines entry {entry!r}: {where} holds no config.json (a Hugging "
                                    "Face checkpoint directory)")
        out[name] = (pathlib.Path(where), prompt or None)
    return out


def _models(run: Run) -> dict[str, tuple[pathlib.Path, str | None]]:
    """Every model the stage evaluates: {name: (checkpoint directory, prompt or None for rollout.prompt)}."""
    models: dict[str, tuple[pathlib.Path, str | None]] = {"base policy": (policy_dir(run), None)}
    for name in run.config.compare.methods:
        path = run.workdir / "methods" / name / "trained_model"
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path} missing: the csr stage evaluates every method of compare.methods; run "
                                    "the 'methods' stage first")
        models[name] = (path, None)
    return models | baselines(run.config.sgcd.get("csr_baselines", ()), tuple(models))


@stage("csr", lambda run: (f"Continuation Success Rate at handoff depths 1..{run.config.sgcd.csr_max_handoff} of the "
                           f"base policy and {', '.join(run.config.compare.methods) or 'no method'}"),
       done=output_exists("csr.json"), reads=CSR_READS, needs=BASE_POLICY + SPLITS + ("eval_base", "methods"),
       outputs=("csr.json", "csr.md", "csr.png"))
def csr(run: Run) -> str:
    from guijax.rollout.handoff import HandoffRunner
    from guijax.sgcd import csr as metric

    o = run.config.sgcd
    # two policies share each episode, so a depth is reached by snapshot (the desk) or by replaying the prefix
    branching = "snapshot" if run.config.env.kind == "desk" else "replay"
    depths = list(range(1, o.csr_max_handoff + 1))
    buckets = metric.depth_buckets(o.csr_max_handoff)
    tasks = failed_tasks(run)
    models = _models(run)
    if not tasks:
        write_text_atomic(run.workdir / "csr.json", json.dumps({"tasks": [], "results": {}}, indent=1))
        write_text_atomic(run.workdir / "csr.md", "The base policy solves every evaluated task: no CSR pool.\n")
        return "the base policy fails no task: nothing to continue"
    temperature = run.config.eval.temperature
    base = run.load_policy(models["base policy"][0])
    with run.evaluation_engine(base, temperature) as engine:
        prefixes = HandoffRunner(engine, branching, o.replay_tolerance).prefixes(
            base.params, tasks, max(depths), run.streams.key("csr", "prefix"),
            seed=run.streams.seed_for("csr", "prefix"), desc="csr prefixes", stop_retries=o.csr_prefix_stop_retries)
    histogram = metric.failure_histogram(_off_track_steps(run, prefixes)) if run.config.env.kind == "desk" else {}
    results = {}
    for name, (path, prompt) in models.items():
        policy = base if name == "base policy" else run.load_policy(path)
        with run.evaluation_engine(policy, temperature, prompt=prompt) as engine:
            trajectories = HandoffRunner(engine, branching, o.replay_tolerance).continue_from(
                policy.params, prefixes, depths, run.streams.key("csr", name), per_state=o.csr_per_state,
                desc=f"csr {name}")
        results[name] = metric.continuation_success(trajectories, depths, buckets)
    report = {"tasks": [t.id for t in tasks], "depths": depths, "per_state": o.csr_per_state,
              "prompts": {n: prompt or run.config.rollout.prompt for n, (_, prompt) in models.items()},
              "open_prefix_steps": {p.task.id: p.open_steps for p in prefixes},
              "prefix_resamples": {p.task.id: p.resampled for p in prefixes}, "results": results,
              "failure_steps": histogram}
    write_text_atomic(run.workdir / "csr.json", json.dumps(report, indent=1))
    write_text_atomic(run.workdir / "csr.md", metric.markdown(results, depths) + "\n")
    metric.plot(results, histogram, run.workdir / "csr.png")
    return ", ".join(f"{n} {100 * r['csr']:.1f}%" if r["csr"] is not None else f"{n} –" for n, r in results.items())


def _off_track_steps(run: Run, prefixes) -> list[int | None]:
    """Where each base-policy prefix first left its task's path (desk replay against the accessibility tree)."""
    from guijax.rollout.trajectory import Trajectory
    from guijax.sgcd.desk_skills import first_off_track_step

    env, grammar = run.config.env, run.grammar
    return [first_off_track_step(p.task, Trajectory(p.task.id, p.task.instruction, p.steps, meta={"seed": p.seed}),
                                 tuple(env.screen), env.popups, grammar=grammar) for p in prefixes if p.steps]
