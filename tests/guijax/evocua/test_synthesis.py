"""EvoCUA's verifiable task synthesis on the desk: the procedural architect's tasks pass generation-as-validation
on a real DeskEnv and round-trip through envs.tasks; a faulty architect gets the sandbox's errors back and is
asked again; the chat architect retries malformed JSON, skips with the reason, and reads the sandbox's error in
its next request."""
from __future__ import annotations

import json

import pytest

from envs.desk import DeskEnv, ScriptedExpert, run_expert
from envs.tasks import load_tasks, save_tasks
from fake_chat import fake_chat_server
from guijax.chat import ChatClient
from guijax.evocua.architects import ChatTaskArchitect, ProceduralArchitect
from guijax.evocua.synthesis import Proposal, ProposalError, Synthesizer, parse_proposal
from guijax.evocua.task_space import CAPABILITIES, PERSONAS, Resource, Scenario, ScenarioSampler, layout

SIZE = (280, 280)


def _sampler(compose_prob: float = 0.5) -> ScenarioSampler:
    return ScenarioSampler(SIZE, compose_prob=compose_prob)


def test_procedural_tasks_pass_generation_as_validation_and_round_trip(tmp_path):
    outcomes = Synthesizer(ProceduralArchitect(), _sampler(), seed=3).run(60)
    tasks = [o.task for o in outcomes]
    assert all(t is not None for t in tasks) and len(tasks) == 60
    caps = {c for t in tasks for c in t.extra["synthesis"]["capabilities"]}
    assert caps == set(CAPABILITIES)  # every capability drawn, ...
    assert any(len(t.extra["synthesis"]["capabilities"]) == 2 for t in tasks)  # ... and compositions
    assert {t.extra["synthesis"]["persona"] for t in tasks} <= {p.role for p in PERSONAS}

    save_tasks(tasks, tmp_path / "syn.json")
    loaded = load_tasks(tmp_path / "syn.json")
    assert [t.to_dict() for t in loaded] == [t.to_dict() for t in tasks]
    env = DeskEnv(SIZE, popups=False)
    for task in loaded[:20]:  # independently of the sandbox: rejects the start, accepts the reference
        (step,) = task.config
        assert step["type"] == "desk_scene" and step["parameters"]["popup_prob"] > 0
        assert task.domain.startswith("syn_") and task.extra["source"] == "evocua_synthesis"
        env.reset(task)
        assert env.evaluate() == 0.0, task.id
        assert run_expert(env, task, ScriptedExpert()).reward == 1.0, task.id
        attempts = task.extra["synthesis"]["attempts"]
        assert attempts[-1]["check"] == "passed" and task.extra["synthesis"]["architect"] == "procedural"


class FaultyArchitect:
    """First proposes a validator the initial state already satisfies, then a reference that misses the
    validator, then the procedural architect's task; records what it was shown."""

    name = "faulty"

    def __init__(self):
        self.histories = []

    def propose(self, scenario, history):
        self.histories.append(list(history))
        good = ProceduralArchitect().propose(scenario, [])
        (res,) = scenario.resources
        (win,) = res.windows
        box = next(w for w in win["widgets"] if w["kind"] == "checkbox")
        if len(history) == 0:  # what already holds
            expected = {win["title"]: {"widgets": {box["name"]: {"checked": box.get("checked", False)}}}}
            return Proposal("Leave it.", {"func": "desk_state", "expected": expected}, [{"op": "done"}])
        if len(history) == 1:  # the reference never touches what the validator checks
            expected = {win["title"]: {"widgets": {box["name"]: {"checked": not box.get("checked", False)}}}}
            return Proposal("Flip it.", {"func": "desk_state", "expected": expected}, [{"op": "done"}])
        return good


def _toggle_scenario(seed: int = 0) -> Scenario:
    import random

    return ScenarioSampler(SIZE, ("toggle",), compose_prob=0.0).sample(random.Random(seed), "sc-toggle")


def test_sandbox_errors_are_fed_back_and_the_task_regenerated():
    architect = FaultyArchitect()
    outcome = Synthesizer(architect, _sampler(), max_attempts=3).synthesize(_toggle_scenario(), "t0")
    assert [a.check for a in outcome.attempts] == ["initial_state", "reference", "passed"]
    assert "accepts the initial state" in outcome.attempts[0].error
    assert "unmet" in outcome.attempts[1].error and "checked" in outcome.attempts[1].error
    # each request saw every earlier attempt with its error
    assert [len(h) for h in architect.histories] == [0, 1, 2]
    assert architect.histories[2][1].error == outcome.attempts[1].error
    recorded = outcome.task.extra["synthesis"]["attempts"]
    assert [a["check"] for a in recorded] == ["initial_state", "reference", "passed"] and recorded[0]["error"]


def test_attempts_are_bounded_and_the_scenario_skipped_with_the_last_error():
    outcome = Synthesizer(FaultyArchitect(), _sampler(), max_attempts=2).synthesize(_toggle_scenario(), "t0")
    assert outcome.task is None and len(outcome.attempts) == 2
    assert "2 attempts" in outcome.skipped and "unmet" in outcome.skipped


def test_a_validator_naming_a_missing_widget_fails_the_structure_check():
    class Typo:
        name = "typo"

        def propose(self, scenario, history):
            title = scenario.windows[0]["title"]
            return Proposal("Click Nope.", {"func": "desk_state", "expected": {title: {"widgets": {"Nope": {"clicks_at_least": 1}}}}},
                            [{"op": "done"}])

    outcome = Synthesizer(Typo(), _sampler(), max_attempts=1).synthesize(_toggle_scenario(), "t0")
    assert outcome.attempts[0].check == "structure" and "'Nope'" in outcome.attempts[0].error


GOOD = {"instruction": "Click OK.", "evaluator": {"func": "desk_state", "expected": {"W": {"widgets": {"OK": {"clicks_at_least": 1}}}}},
        "expert": [{"op": "click", "window": "W", "target": "OK"}, {"op": "done"}]}


@pytest.mark.parametrize("change, words", [
    (lambda d: d.update(extra=1), "unknown keys ['extra']"),
    (lambda d: d.pop("instruction"), "missing key 'instruction'"),
    (lambda d: d["expert"].insert(0, {"op": "jump"}), "unknown op 'jump'"),
    (lambda d: d["expert"].reverse(), "end with exactly one 'done'"),
    (lambda d: d["expert"][0].pop("window"), "missing key 'window'"),
    (lambda d: d["evaluator"]["expected"]["W"]["widgets"]["OK"].update(pressed=1), "unknown properties ['pressed']"),
    (lambda d: d["evaluator"].update(expected={}), "accepts any state"),
    (lambda d: d.update(evaluator={"func": "infeasible"}), "end with exactly one 'fail'"),
    (lambda d: d["evaluator"].update(func="exact_match"), "'desk_state' or 'infeasible'"),
])
def test_proposals_are_checked_strictly(change, words):
    data = json.loads(json.dumps(GOOD))
    assert parse_proposal(data, "here").instruction == "Click OK."
    change(data)
    with pytest.raises(ProposalError, match="here") as err:
        parse_proposal(data, "here")
    assert words in str(err.value)


def _settings_scenario() -> Scenario:
    widgets = [{"kind": "checkbox", "name": "Wi-Fi", "checked": False}, {"kind": "checkbox", "name": "Bluetooth", "checked": True}]
    windows = layout([{"title": "Settings", "rect": [0, 0, 0, 0], "widgets": widgets}], SIZE)
    return Scenario("sc-chat", PERSONAS[0].role, (Resource("toggle", tuple(windows)),), 7)


def _answer(name: str, fenced: bool = False) -> str:
    text = json.dumps({"instruction": f'Turn on "{name}".',
                       "evaluator": {"func": "desk_state", "expected": {"Settings": {"widgets": {name: {"checked": True}}}}},
                       "expert": [{"op": "check", "window": "Settings", "target": name, "value": True}, {"op": "done"}]})
    return f"```json\n{text}\n```" if fenced else text


def test_chat_architect_retries_malformed_json_then_skips_with_the_reason():
    with fake_chat_server([(200, "Sure! Here is the task."), (200, json.dumps({"instruction": "x"}))]) as (url, requests):
        architect = ChatTaskArchitect(ChatClient(url, "m", api_key_env=""), retries=1)
        outcome = Synthesizer(architect, _sampler(), max_attempts=3).synthesize(_settings_scenario(), "t0")
    assert outcome.task is None and len(requests) == 2
    assert "no well-formed task after 2 answers" in outcome.skipped and "missing key 'evaluator'" in outcome.skipped
    assert [a.check for a in outcome.attempts] == ["format", "format"] and "not valid JSON" in outcome.attempts[0].error
    retry = requests[1]["body"]["messages"]
    assert retry[-2] == {"role": "assistant", "content": "Sure! Here is the task."} and "not valid JSON" in retry[-1]["content"]


def test_chat_architect_reads_the_sandbox_error_in_its_next_request():
    first, second = _answer("Bluetooth"), _answer("Wi-Fi", fenced=True)  # Bluetooth is already on
    with fake_chat_server([(200, first), (200, second)]) as (url, requests):
        architect = ChatTaskArchitect(ChatClient(url, "m", api_key_env=""), retries=0)
        outcome = Synthesizer(architect, _sampler(), max_attempts=3).synthesize(_settings_scenario(), "t0")
    assert [a.check for a in outcome.attempts] == ["initial_state", "passed"]
    assert outcome.task.instruction == 'Turn on "Wi-Fi".' and outcome.task.extra["synthesis"]["architect"] == "chat"
    opening = requests[0]["body"]["messages"]
    assert opening[0]["role"] == "system" and "Wi-Fi" in opening[1]["content"] and PERSONAS[0].role in opening[1]["content"]
    follow_up = requests[1]["body"]["messages"]
    assert follow_up[:2] == opening and follow_up[2] == {"role": "assistant", "content": first}
    assert "initial_state" in follow_up[3]["content"] and "accepts the initial state" in follow_up[3]["content"]


def test_a_reference_that_cannot_report_done_within_the_step_limit_is_rejected():
    import random

    sampler = ScenarioSampler(SIZE, ("save_note",), compose_prob=0.0)
    scenario = sampler.sample(random.Random(0), "sc-note")
    # type, Ctrl+S, done: two steps reach the validator's state, the third would report it
    short = Synthesizer(ProceduralArchitect(), sampler, max_attempts=1, step_limit=2).synthesize(scenario, "t0")
    assert short.task is None and short.attempts[0].check == "reference"
    assert "does not report done" in short.attempts[0].error and "step limit of 2" in short.attempts[0].error
    assert Synthesizer(ProceduralArchitect(), sampler, step_limit=3).synthesize(scenario, "t0").task is not None
