"""The stage registry, built explicitly from the stage modules, and `run_stages`, which runs a recipe's
stages in order, skipping those whose result is already in the workdir.

Before any stage runs, the recipe is checked as a whole: every stage name exists, and every method the
recipe trains (`method` for the `rl` stage, `compare.methods` for the `methods` stage) is registered, accepts
the recipe's loss and normalisation, and finds the stages it reads listed before the stage that trains it.
"""
from __future__ import annotations

import functools
import pathlib
import time

import jax
import ml_collections

from guijax import progress
from guijax.pipeline import base_stages, compare_stages, expert_stages
from guijax.pipeline.run import Run
from guijax.pipeline.stage import Stage

STAGES: dict[str, Stage] = {s.name: s for s in (
    base_stages.base_model, base_stages.tasks, base_stages.sft, expert_stages.expert, expert_stages.bepa_splits,
    expert_stages.level1, expert_stages.select, base_stages.eval_base, base_stages.rl, compare_stages.methods,
    base_stages.eval_final, compare_stages.table, expert_stages.diagnostics, base_stages.report)}

# which stage trains which methods (config key naming them)
TRAINING_STAGES = {"rl": "method", "methods": "compare.methods"}


def check_recipe(config: ml_collections.ConfigDict, stages: dict[str, Stage] | None = None) -> None:
    """Fail before any work if the recipe names an unknown stage or method, or a method cannot run where it is."""
    from guijax import schema
    from guijax.methods import get_method, option_sections

    schema.validate(config, option_sections())  # types, choices and ranges of every key, before any work
    stages = STAGES if stages is None else stages
    names = list(config.stages)
    unknown = [s for s in names if s not in stages]
    if unknown:
        raise ValueError(f"unknown stages {unknown} in config.stages; available: {list(stages)}")
    for trainer_stage, key in TRAINING_STAGES.items():
        if trainer_stage not in names:
            continue
        value = functools.reduce(lambda node, part: node[part], key.split("."), config)
        for name in ([value] if isinstance(value, str) else list(value)):
            method = get_method(name, config, key=key)
            before = names[:names.index(trainer_stage)]
            missing = [r for r in method.requires if r not in before]
            if missing:
                raise ValueError(f"method {name!r} ({key}) reads the output of stage(s) {missing}, which config.stages "
                                 f"does not run before {trainer_stage!r}: {names}")


def run_stages(config: ml_collections.ConfigDict, workdir: pathlib.Path,
               stages: dict[str, Stage] | None = None) -> None:
    from guijax import compilation_cache

    stages = STAGES if stages is None else stages
    check_recipe(config, stages)
    compilation_cache.enable(config.compilation_cache_dir)
    run = Run(config, pathlib.Path(workdir))
    names = list(config.stages)
    found = [n for n in names if stages[n].done(run)]
    if found:
        progress.echo(f"{config.name}: resuming in {workdir}; found done: {', '.join(found)}")
    try:
        for i, name in enumerate(names, 1):
            spec = stages[name]
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
