"""Stages know what they were made from: a rerun reuses a stage only when the config it reads and the
stages it reads from are unchanged; otherwise it runs again, with everything downstream, and its old
outputs are kept under stale/."""
from __future__ import annotations

import json
import pathlib

import pytest

from guijax import launch
from guijax.pipeline import records as records_lib
from guijax.pipeline.registry import fingerprints, run_stages
from guijax.pipeline.stage import Stage, output_exists


class Boom(RuntimeError):
    pass


def _stages(log: list[str], fail: set[str] = frozenset()) -> dict[str, Stage]:
    """Three cheap stages: `first` reads sft.steps, `second` reads eval and the output of `first`, `third`
    reads only the seed. Each appends its name to `log` and writes NAME.txt from what it read."""

    def make(name: str, reads: tuple[str, ...], needs: tuple[str, ...]) -> Stage:
        def fn(run) -> str:
            log.append(name)
            (run.workdir / f"{name}.partial").write_text("half")
            if name in fail:
                raise Boom(name)
            upstream = "".join((run.workdir / f"{n}.txt").read_text() for n in needs)
            values = records_lib.config_values(run.config, reads)
            (run.workdir / f"{name}.txt").write_text(upstream + json.dumps(values, sort_keys=True))
            (run.workdir / f"{name}.partial").unlink()
            return name

        return Stage(name, fn, lambda run: name, output_exists(f"{name}.txt"), reads, needs,
                     outputs=(f"{name}.txt", f"{name}.partial"))

    return {"first": make("first", ("sft.steps",), ()), "second": make("second", ("eval",), ("first",)),
            "third": make("third", ("seed",), ())}


def _config(*overrides: str):
    return launch.resolve("grpo_cpu", ['stages=("first", "second", "third")', 'compilation_cache_dir=',
                                       *overrides])


def test_unchanged_rerun_reuses_every_stage(tmp_path: pathlib.Path):
    log: list[str] = []
    run_stages(_config(), tmp_path, _stages(log))
    assert log == ["first", "second", "third"]
    ledger = json.loads((tmp_path / "stages.json").read_text())
    assert {k: v["state"] for k, v in ledger.items()} == {"first": "done", "second": "done", "third": "done"}
    assert ledger["second"]["upstream"] == {"first": ledger["first"]["hash"]}
    run_stages(_config(), tmp_path, _stages(log))
    assert log == ["first", "second", "third"]


def test_changed_key_reruns_its_stage_and_what_reads_it(tmp_path: pathlib.Path, capsys):
    log: list[str] = []
    run_stages(_config(), tmp_path, _stages(log))
    old_first = (tmp_path / "first.txt").read_text()
    old_hash = json.loads((tmp_path / "stages.json").read_text())["first"]["hash"]
    capsys.readouterr()
    log.clear()
    run_stages(_config("sft.steps=3"), tmp_path, _stages(log))
    assert log == ["first", "second"]  # third reads neither sft nor first
    assert '"sft.steps": 3' in (tmp_path / "first.txt").read_text()
    assert (tmp_path / "stale" / f"first-{old_hash}" / "first.txt").read_text() == old_first
    out = capsys.readouterr().out
    assert "sft.steps 60 -> 3" in out
    assert "it reads from first, which changed" in out


def test_keys_that_cannot_change_a_result_reuse_everything(tmp_path: pathlib.Path):
    log: list[str] = []
    run_stages(_config(), tmp_path, _stages(log))
    log.clear()
    run_stages(_config("env.num_workers=7", "train.checkpoint_every=1"), tmp_path, _stages(log))
    assert log == []


def test_workdir_without_records_is_adopted_once(tmp_path: pathlib.Path, capsys):
    log: list[str] = []
    run_stages(_config(), tmp_path, _stages(log))
    (tmp_path / "stages.json").unlink()  # a workdir made before records were kept
    log.clear()
    run_stages(_config(), tmp_path, _stages(log))
    assert log == []
    assert "made before stage records were kept" in capsys.readouterr().out
    run_stages(_config("eval.temperature=0.3"), tmp_path, _stages(log))
    assert log == ["second"]


def test_crashed_stage_resumes_under_its_config_and_is_moved_aside_under_another(tmp_path: pathlib.Path, capsys):
    log: list[str] = []
    with pytest.raises(Boom):
        run_stages(_config(), tmp_path, _stages(log, fail={"second"}))
    started = json.loads((tmp_path / "stages.json").read_text())["second"]
    assert started["state"] == "started"
    with pytest.raises(Boom):  # same config: the partial output is left for the stage to resume from
        run_stages(_config(), tmp_path, _stages(log, fail={"second"}))
    assert (tmp_path / "second.partial").exists()
    assert not (tmp_path / "stale").exists()
    log.clear()
    capsys.readouterr()
    run_stages(_config("eval.episodes_per_task=9"), tmp_path, _stages(log))
    assert log == ["second", "third"]
    assert "an unfinished run under another config left second.partial" in capsys.readouterr().out
    assert (tmp_path / "stale" / f"second-{started['hash']}" / "second.partial").read_text() == "half"


def _forget_key(workdir: pathlib.Path, key: str) -> None:
    """Rewrite the ledger as a guijax before `key` existed would have: without the key, and every hash (with
    the upstream hashes that name them) recomputed in stage order."""
    ledger = json.loads((workdir / "stages.json").read_text())
    for record in ledger.values():
        record["config"].pop(key, None)
        record["upstream"] = {n: ledger[n]["hash"] for n in record["upstream"]}
        record["hash"] = records_lib.Fingerprint(record["config"], record["upstream"]).hash
    (workdir / "stages.json").write_text(json.dumps(ledger))


def test_a_key_added_since_at_its_default_reruns_nothing(tmp_path: pathlib.Path):
    """Upgrading guijax adds config keys; while they hold their schema default a finished stage (and what
    reads from it) stays finished, and the ledger takes the new fingerprint."""
    log: list[str] = []
    run_stages(_config(), tmp_path, _stages(log))
    _forget_key(tmp_path, "eval.pass_k")  # as if eval.pass_k were new; grpo_cpu leaves it at its default
    log.clear()
    run_stages(_config(), tmp_path, _stages(log))
    assert log == []
    current = fingerprints(_config(), _stages([]))
    assert json.loads((tmp_path / "stages.json").read_text())["second"]["hash"] == current["second"].hash


def test_a_key_added_since_away_from_its_default_reruns_its_stage(tmp_path: pathlib.Path):
    log: list[str] = []
    run_stages(_config("sft.steps=3"), tmp_path, _stages(log))
    _forget_key(tmp_path, "sft.steps")  # the record cannot say it ran with 3: it may not have
    log.clear()
    run_stages(_config("sft.steps=3"), tmp_path, _stages(log))
    assert log == ["first", "second"]


def test_corrupt_ledger_names_the_file(tmp_path: pathlib.Path):
    (tmp_path / "stages.json").write_text("{not json")
    with pytest.raises(ValueError, match="stages.json is not valid JSON"):
        run_stages(_config(), tmp_path, _stages([]))


def test_config_values_flatten_sections_and_skip_keys_outside_results():
    values = records_lib.config_values(_config(), ("env", "sft.steps"))
    assert values["sft.steps"] == 60
    assert values["env.families"] == list(_config().env.families)
    assert "env.num_workers" not in values and "env.step_limit" in values
    with pytest.raises(KeyError, match="'sft.stepz'"):
        records_lib.config_values(_config(), ("sft.stepz",))


def _changed(overrides: list[str]) -> set[str]:
    before = fingerprints(launch.resolve("bepa_cpu", []))
    after = fingerprints(launch.resolve("bepa_cpu", overrides))
    assert before.keys() == after.keys()
    return {k for k in before if before[k].hash != after[k].hash}


def test_real_stages_rerun_only_what_a_key_reaches():
    methods = {"methods/grpo", "methods/bepa"}
    evals = {f"{m}/eval" for m in methods}
    assert _changed(["eval.temperature=0.7"]) == {"eval_base", "methods", "diagnostics"} | evals
    assert _changed(["train.iterations=3"]) == {"methods", "diagnostics"} | methods | evals
    # LEVEL-1 feeds BEPA's cache and the expert-only split everyone is evaluated on, not GRPO's training
    assert _changed(["bepa.level1_rollouts=4"]) == {"level1", "eval_base", "methods/bepa", "methods",
                                                   "diagnostics"} | evals
    assert _changed(["sft.steps=3"]) == {"sft", "level1", "eval_base", "methods", "diagnostics"} | methods | evals
    assert _changed(["bepa.update_rule='shortest'"]) == {"methods/bepa", "methods/bepa/eval", "methods", "diagnostics"}
    assert _changed(["env.num_workers=3"]) == set()


def test_stage_that_keeps_a_result_must_declare_its_reads():
    from guijax.pipeline.stage import stage

    with pytest.raises(ValueError, match="'lonely' keeps its result"):
        stage("lonely", lambda run: "", done=output_exists("x"))(lambda run: None)
