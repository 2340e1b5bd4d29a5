"""EvoCUA's quality filters on synthesized desk tasks: the scripted expert's agreement with each validator
over episodes with pop-ups (and a policy's pass-rate outliers), and the tri-fold decontamination against
held-out tasks."""
from __future__ import annotations

import dataclasses
import random

import pytest

from envs.actions.model import Action, ActionType
from envs.tasks import generate_desk_tasks
from guijax.evocua import quality
from guijax.evocua.architects import ProceduralArchitect
from guijax.evocua.synthesis import Synthesizer
from guijax.evocua.task_space import ScenarioSampler

SIZE = (280, 280)


def _synthesized(capability: str, seed: int = 0):
    sampler = ScenarioSampler(SIZE, (capability,), compose_prob=0.0)
    outcome = Synthesizer(ProceduralArchitect(), sampler, seed=seed).synthesize(
        sampler.sample(random.Random(seed), f"sc-{capability}"), f"syn-{capability}-{seed}")
    assert outcome.task is not None
    return outcome.task


def _with_expected(task, expected):
    return dataclasses.replace(task, evaluator=dict(task.evaluator, expected=expected))


def test_consistent_tasks_keep_and_report_per_agent():
    tasks = [_synthesized(c) for c in ("form", "copy", "infeasible")]
    report = quality.consistency(tasks, episodes=2, seed=1, popups=True)
    assert set(report) == {t.id for t in tasks}
    for t in tasks:
        ref = report[t.id].agents[quality.REFERENCE]
        assert ref.episodes == 2 and ref.claimed == ref.passed == 2, report[t.id].to_dict()
        assert report[t.id].flags == [] and report[t.id].keep


def test_validator_that_rejects_the_finished_reference_is_flagged():
    task = _synthesized("type")
    (title, want), = task.evaluator["expected"].items()
    (field, props), = want["widgets"].items()
    broken = _with_expected(task, {title: {"widgets": {field: {"text": props["text"] + "x"}}}})
    row = quality.consistency([broken], episodes=2)[broken.id]
    ref = row.agents[quality.REFERENCE]
    assert ref.claimed == 2 and ref.claimed_rejected == 2 and ref.pass_rate == 0.0
    assert row.flags == ["reference_done_rejected", "reference_never_passes"] and not row.keep


def test_validator_that_accepts_an_unfinished_state_is_flagged():
    task = _synthesized("form")  # first subgoal types the first field; the validator then checks only that
    first = task.extra["expert"][0]
    loose = _with_expected(task, {first["window"]: {"widgets": {first["target"]: {"text": first["text"]}}}})
    row = quality.consistency([loose], episodes=1, step_limit=2, popups=False)[loose.id]
    ref = row.agents[quality.REFERENCE]
    assert ref.claimed == 0 and ref.accepted_unclaimed == 1 and "accepted_without_done" in row.flags and not row.keep


def test_policy_pass_rate_outliers_are_reported_but_do_not_drop():
    tasks = [_synthesized("click"), _synthesized("infeasible")]

    def quitter(task, observation, step):  # reports done at once on a feasible task, FAIL on an infeasible one
        return Action(ActionType.FAIL if task.infeasible else ActionType.FINISHED)

    report = quality.consistency(tasks, episodes=2, policies={"quitter": quitter})
    click, infeasible = (report[t.id] for t in tasks)
    assert click.agents["quitter"].claimed_rejected == 2 and "quitter_never_passes" in click.flags and click.keep
    assert infeasible.agents["quitter"].pass_rate == 1.0 and "quitter_always_passes" in infeasible.flags


def test_word_ngrams_and_jaccard():
    assert quality.word_ngrams('Click the "Print" button.', 2) == {("click", "the"), ("the", "print"), ("print", "button")}
    assert quality.word_ngrams("Stop", 3) == {("stop",)} and quality.word_ngrams("", 3) == set()
    assert quality.jaccard({1, 2}, {2, 3}) == pytest.approx(1 / 3) and quality.jaccard(set(), set()) == 0.0


def test_decontamination_reports_each_axis_with_the_nearest_held_out_task():
    held = generate_desk_tasks(6, seed=4, families=["click_button", "type_field", "infeasible_toggle"])
    target = held[1]  # a type_field task
    copy = dataclasses.replace(target, id="syn-copy")
    (step,) = target.config  # the same content laid out elsewhere is the same configuration
    moved = [dict(w, rect=[r + 10 for r in w["rect"]]) for w in step["parameters"]["windows"]]
    same_scene = dataclasses.replace(target, id="syn-scene", instruction="Please write something else entirely here.",
                                     config=({"type": "desk_scene", "parameters": {"windows": moved}},),
                                     evaluator={"func": "desk_state", "expected": {"Profile": {"saved": True}}})
    fresh = _synthesized("slider")
    infeasible = _synthesized("infeasible")
    kept, report = quality.decontaminate([copy, same_scene, fresh, infeasible], held, ngram=3)
    assert report["syn-copy"]["dropped_by"] == ["instruction", "config", "evaluator"]
    assert all(report["syn-copy"][a] == {"overlap": 1.0, "nearest": target.id} for a in ("instruction", "config", "evaluator"))
    assert report["syn-scene"]["dropped_by"] == ["config"] and report["syn-scene"]["config"]["nearest"] == target.id
    assert report["syn-scene"]["evaluator"]["overlap"] == 0.0
    assert report[fresh.id]["dropped_by"] == [] and report[fresh.id]["config"]["overlap"] < 1.0
    assert report[infeasible.id]["evaluator"] == {"overlap": 0.0, "nearest": None}  # nothing to leak
    assert [t.id for t in kept] == [fresh.id, infeasible.id]
    # thresholds and n decide: unigrams overlap more than trigrams, and a low threshold drops on them
    loose = quality.decontamination([fresh], held, ngram=1, thresholds=quality.Thresholds(instruction=0.05))
    assert loose[fresh.id]["instruction"]["overlap"] > report[fresh.id]["instruction"]["overlap"]
    assert loose[fresh.id]["dropped_by"] == ["instruction"]
