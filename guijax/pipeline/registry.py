"""The stage registry, built explicitly from the stage modules, and `run_stages`, which runs a recipe's
stages in order, reusing those whose result is already in the workdir and was made from the current config
(`guijax.pipeline.records`); a stage whose config or upstream changed runs again, and says why.

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
from guijax.pipeline import base_stages, coldstart_stages, compare_stages, evocua_stages, expert_stages, sgcd_stages
from guijax.pipeline import synthesis_stages
from guijax.pipeline.records import Fingerprint, StageRecords, config_values
from guijax.pipeline.run import Run
from guijax.pipeline.stage import Stage

STAGES: dict[str, Stage] = {s.name: s for s in (
    base_stages.base_model, base_stages.tasks, base_stages.sft, expert_stages.expert, expert_stages.bepa_splits,
    expert_stages.level1, expert_stages.select, evocua_stages.budget, base_stages.eval_base, base_stages.rl,
    compare_stages.methods, base_stages.eval_final, compare_stages.table, sgcd_stages.csr, expert_stages.diagnostics,
    base_stages.report, coldstart_stages.coldstart, synthesis_stages.synthesis)}



def _lookup(config: ml_collections.ConfigDict, key: str):
    return functools.reduce(lambda node, part: node[part], key.split("."), config)


def trained_methods(config: ml_collections.ConfigDict, stage: Stage) -> list[str]:
    """The method names a training stage trains: one for `method`, several for `compare.methods`."""
    value = _lookup(config, stage.trains)
    return [value] if isinstance(value, str) else list(value)


def fingerprints(config: ml_collections.ConfigDict, stages: dict[str, Stage] | None = None) -> dict[str, Fingerprint]:
    """Every stage's fingerprint under `config`, in recipe order: the config it reads and the fingerprints of
    the earlier stages it reads from. A stage training several methods has one per method, keyed
    'STAGE/METHOD' (and 'STAGE/METHOD/eval' for its evaluation), and its own is made of theirs."""
    from guijax.methods import get_method

    stages = STAGES if stages is None else stages
    names = list(config.stages)
    out: dict[str, Fingerprint] = {}
    for i, name in enumerate(names):
        spec = stages[name]

        def upstream(needs: tuple[str, ...]) -> dict[str, str]:
            return {n: out[n].hash for n in names[:i] if n in needs}

        if spec.trains is None:
            out[name] = Fingerprint(config_values(config, spec.reads), upstream(spec.needs))
            continue
        units = {}
        for method_name in trained_methods(config, spec):
            method = get_method(method_name, config, key=spec.trains)
            values = config_values(config, spec.reads + method.reads) | {"method": method_name}
            units[method_name] = Fingerprint(values, upstream(spec.needs + method.requires))
        if isinstance(_lookup(config, spec.trains), str):
            out[name] = next(iter(units.values()))
            continue
        for m, fp in units.items():
            out[f"{name}/{m}"] = fp
            if spec.eval_reads:
                out[f"{name}/{m}/eval"] = Fingerprint(config_values(config, spec.eval_reads),
                                                      upstream(spec.eval_needs) | {f"{name}/{m}": fp.hash})
        out[name] = Fingerprint({"units": {k: fp.hash for k, fp in out.items() if k.startswith(f"{name}/")}}, {})
    return out


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
    for trainer_stage in names:
        key = stages[trainer_stage].trains
        if key is None:
            continue
        for name in trained_methods(config, stages[trainer_stage]):
            method = get_method(name, config, key=key)
            before = names[:names.index(trainer_stage)]
            missing = [r for r in method.requires if r not in before]
            if missing:
                raise ValueError(f"method {name!r} ({key}) reads the output of stage(s) {missing}, which config.stages "
                                 f"does not run before {trainer_stage!r}: {names}")
    if "sft" in names and config.sft.steps and config.sft.data == "coldstart" and "coldstart" not in names[
            :names.index("sft")]:
        raise ValueError(f"sft.data='coldstart' trains on the coldstart stage's traces, which config.stages does not "
                         f"run before 'sft': {names}")


def run_stages(config: ml_collections.ConfigDict, workdir: pathlib.Path,
               stages: dict[str, Stage] | None = None) -> None:
    from guijax import compilation_cache

    stages = STAGES if stages is None else stages
    check_recipe(config, stages)
    compilation_cache.enable(config.compilation_cache_dir)
    from guijax import schema
    from guijax.methods import option_sections

    records = StageRecords(pathlib.Path(workdir), fingerprints(config, stages),
                           schema.default_values(option_sections()))
    run = Run(config, pathlib.Path(workdir), records=records)
    names = list(config.stages)
    verdicts = {n: records.verdict(n, stages[n].done(run)) for n in names if stages[n].done is not None}
    found = [n for n, (reuse, _) in verdicts.items() if reuse]
    changed = [n for n, (reuse, why) in verdicts.items() if not reuse and why]
    if found:
        progress.echo(f"{config.name}: resuming in {workdir}; found done: {', '.join(found)}")
    if changed:
        progress.echo(f"{config.name}: made from another config, so run again: {', '.join(changed)}")
    try:
        for i, name in enumerate(names, 1):
            spec = stages[name]
            tag = f"[{i}/{len(names)}] {name}"
            reuse, why = verdicts.get(name, (False, ""))
            if reuse:
                progress.echo(f"{tag}: already done, skipped" + (f" ({why})" if why else ""))
                continue
            if spec.done is not None:
                note = records.restart(name, spec.outputs, why, "running it")
                if note:
                    progress.echo(f"{tag}: {note}")
            progress.echo(f"{tag}: {spec.describe(run)}")
            start = time.perf_counter()
            headline = spec.fn(run)
            if spec.done is not None:
                records.end(name)
            progress.echo(f"{tag}: done in {progress.format_duration(time.perf_counter() - start)}"
                          + (f"; {headline}" if headline else ""))
    finally:
        run.close()
        jax.effects_barrier()
