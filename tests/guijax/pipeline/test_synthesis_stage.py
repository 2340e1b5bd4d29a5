"""The synthesis stage on the tiny recipe: it writes tasks envs.tasks loads, a report of attempts, rejections,
quality and decontamination figures, decontaminates against the run's own held-out split, and fails naming
the key when its chat endpoint is missing."""
from __future__ import annotations

import json

import pytest

from envs.tasks import load_tasks
from guijax.pipeline import base_stages, synthesis_stages
from guijax.pipeline.registry import STAGES
from guijax.pipeline.run import Run


def _run(tiny_config, tmp_path, *overrides: str, **synthesis) -> Run:
    config = tiny_config("grpo_cpu", "env.num_tasks=8", "env.held_out_fraction=0.5", "env.step_limit=15", *overrides)
    config.synthesis.update(synthesis)
    run = Run(config, tmp_path / "run")
    run.workdir.mkdir(parents=True)
    base_stages.tasks.fn(run)
    return run


def test_stage_writes_loadable_tasks_and_the_report(tiny_config, tmp_path):
    assert STAGES["synthesis"] is synthesis_stages.synthesis
    run = _run(tiny_config, tmp_path, count=6, reference_episodes=1, compose_prob=0.5)
    summary = synthesis_stages.synthesis.fn(run)
    report = json.loads((run.workdir / "synthesis_report.json").read_text())
    tasks = load_tasks(run.workdir / "synthesized_tasks.json")
    assert report["accepted"] == 6 and report["kept"] == len(tasks) == 6 - len(report["quality"]["dropped"])
    assert report["attempts"] == sum(len(o["attempts"]) for o in report["outcomes"])
    assert set(report["rejections"]) == {"format", "structure", "initial_state", "reference"}
    assert report["held_out_tasks"] == len(run.tasks()["held_out"]) > 0
    accepted = {o["task"] for o in report["outcomes"] if o["task"]}
    assert set(report["decontamination"]["tasks"]) == set(report["quality"]["tasks"]) == accepted >= {t.id for t in tasks}
    for t in tasks:
        meta = t.extra["synthesis"]
        assert meta["attempts"][-1]["check"] == "passed" and meta["reference_pass_rate"] > 0
        assert set(meta["decontamination"]) == {"instruction", "config", "evaluator", "dropped_by"}
    assert summary == report["summary"] and summary.startswith(f"{len(tasks)} tasks kept of 6 accepted")


def test_stage_decontaminates_against_the_runs_held_out_split(tiny_config, tmp_path):
    # only click tasks, as the held-out click_button tasks: at a zero threshold any shared trigram drops
    run = _run(tiny_config, tmp_path, "env.families=('click_button',)", count=4, reference_episodes=1,
               capabilities=("click",), compose_prob=0.0, ngram=2, instruction_threshold=0.0)
    synthesis_stages.synthesis.fn(run)
    report = json.loads((run.workdir / "synthesis_report.json").read_text())
    held = {t.id for t in run.tasks()["held_out"]}
    rows = report["decontamination"]["tasks"]
    dropped = [k for k, r in rows.items() if r["instruction"]["overlap"] > 0]
    assert dropped and sorted(report["decontamination"]["dropped"]) == sorted(dropped)
    assert all(rows[k]["instruction"]["nearest"] in held for k in dropped)
    kept = {t.id for t in load_tasks(run.workdir / "synthesized_tasks.json")}
    assert kept.isdisjoint(dropped) and report["kept"] == len(kept)


def test_a_chat_architect_without_its_endpoint_fails_by_name(tiny_config, tmp_path):
    run = _run(tiny_config, tmp_path, architect="chat", count=1)
    with pytest.raises(ValueError, match="synthesis.chat_url and synthesis.chat_model"):
        synthesis_stages.synthesis.fn(run)
