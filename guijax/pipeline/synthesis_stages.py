"""EvoCUA's verifiable task synthesis as a stage:

    synthesis   scenarios (persona, capabilities, desk resources) -> the task architect's instruction,
                validator and reference, checked in the sandbox with the errors fed back (evocua.txt §3.2);
                then the scripted expert's consistency with each validator over episodes with pop-ups and
                the tri-fold decontamination against the run's held-out split (§3.3).
                synthesized_tasks.json (the kept tasks, loadable by envs.tasks.load_tasks) and
                synthesis_report.json (attempts, rejections by check, quality and decontamination figures)
"""
from __future__ import annotations

import collections
import json
from typing import Any

from envs.atomic import write_text_atomic
from guijax.pipeline.base_stages import SPLITS
from guijax.pipeline.run import Run
from guijax.pipeline.stage import output_exists, stage

OUTPUTS = ("synthesized_tasks.json", "synthesis_report.json")


def options(run: Run):
    """The recipe's `synthesis` section, checked against guijax.schema.Synthesis."""
    from guijax import schema

    return schema.parse_section(schema.Synthesis, run.config.synthesis, "synthesis")


def architect(o):
    """The task architect `synthesis.architect` names."""
    from guijax.evocua.architects import ChatTaskArchitect, ProceduralArchitect

    if o.architect == "procedural":
        return ProceduralArchitect()
    if not (o.chat_url and o.chat_model):
        raise ValueError("synthesis.architect is 'chat': set synthesis.chat_url and synthesis.chat_model (an "
                         "OpenAI-compatible endpoint; the key is read from $" + o.chat_api_key_env + ")")
    from guijax.chat import ChatClient

    return ChatTaskArchitect(ChatClient(o.chat_url, o.chat_model, o.chat_api_key_env), retries=o.chat_retries)


def _describe(run: Run) -> str:
    o = run.config.synthesis
    return (f"synthesize {o.count} desk tasks with the {o.architect} architect ({o.max_attempts} attempts each), "
            f"check them with {o.reference_episodes} expert episodes and decontaminate against the held-out split")


@stage("synthesis", _describe, done=output_exists("synthesis_report.json"), reads=("seed", "env", "synthesis"),
       needs=SPLITS, outputs=OUTPUTS)
def synthesis(run: Run) -> str:
    import dataclasses

    from envs.tasks import save_tasks
    from guijax.evocua import quality
    from guijax.evocua.synthesis import Synthesizer, rejection_counts
    from guijax.evocua.task_space import CAPABILITIES, ScenarioSampler

    o, e = options(run), run.config.env
    if e.kind != "desk":
        raise ValueError(f"the synthesis stage writes synthetic-desk tasks; env.kind is {e.kind!r}")
    size = tuple(e.screen)
    seed = run.streams.seed_for("synthesis", o.seed)
    sampler = ScenarioSampler(size, tuple(o.capabilities) or tuple(CAPABILITIES), o.compose_prob)
    synthesizer = Synthesizer(architect(o), sampler, max_attempts=o.max_attempts, step_limit=e.step_limit, seed=seed)
    outcomes = synthesizer.run(o.count, o.max_scenarios or None)
    accepted = [x.task for x in outcomes if x.task is not None]

    checks = quality.consistency(accepted, episodes=o.reference_episodes, size=size, step_limit=e.step_limit,
                                 seed=seed, popups=True, expert_noise=o.expert_noise)
    held_out = run.tasks().get("held_out", [])
    thresholds = quality.Thresholds(o.instruction_threshold, o.config_threshold, o.evaluator_threshold)
    overlap = quality.decontamination(accepted, held_out, ngram=o.ngram, thresholds=thresholds)
    kept = []
    for task in accepted:
        if checks[task.id].keep and not overlap[task.id]["dropped_by"]:
            record = dict(task.extra["synthesis"], reference_pass_rate=checks[task.id].agents[quality.REFERENCE].pass_rate,
                          flags=checks[task.id].flags, decontamination=overlap[task.id])
            kept.append(dataclasses.replace(task, extra=dict(task.extra, synthesis=record)))
    save_tasks(kept, run.workdir / "synthesized_tasks.json")

    rejections = rejection_counts(outcomes)
    quality_dropped = [t.id for t in accepted if not checks[t.id].keep]
    contaminated = [t.id for t in accepted if overlap[t.id]["dropped_by"]]
    report: dict[str, Any] = {
        "architect": synthesizer.architect.name, "count": o.count, "scenarios": len(outcomes),
        "accepted": len(accepted), "kept": len(kept), "held_out_tasks": len(held_out),
        "attempts": sum(len(x.attempts) for x in outcomes), "rejections": rejections,
        "skipped": [{"scenario": x.scenario.id, "reason": x.skipped} for x in outcomes if x.task is None],
        "capabilities": dict(collections.Counter("+".join(t.extra["synthesis"]["capabilities"]) for t in kept)),
        "quality": {"episodes": o.reference_episodes, "dropped": quality_dropped,
                    "tasks": {k: v.to_dict() for k, v in checks.items()}},
        "decontamination": {"ngram": o.ngram, "thresholds": dataclasses.asdict(thresholds), "dropped": contaminated,
                            "dropped_by": dict(collections.Counter(a for r in overlap.values() for a in r["dropped_by"])),
                            "tasks": overlap},
        "outcomes": [x.to_dict() for x in outcomes]}
    summary = (f"{len(kept)} tasks kept of {len(accepted)} accepted from {len(outcomes)} scenarios "
               f"({report['attempts']} attempts; rejected: "
               + (", ".join(f"{k} {v}" for k, v in rejections.items() if v) or "none")
               + f"); {len(quality_dropped)} failed the reference check, {len(contaminated)} overlapped the held-out split")
    report["summary"] = summary
    write_text_atomic(run.workdir / "synthesis_report.json", json.dumps(report, indent=1))
    return summary
