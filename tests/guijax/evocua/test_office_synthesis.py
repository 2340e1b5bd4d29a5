"""Office-app synthesis: generated documents, the architect's three streams, the written OSWorld tasks, the
closed loop's feedback, decontamination, and (on the Xvfb desktop) every capability accepted for real."""
from __future__ import annotations

import json
import random

import chex
import openpyxl
import pytest

from envs.desktop.checks import desktop_missing
from fake_chat import fake_chat_server
from guijax.chat import ChatClient
from guijax.evocua.office_chat_architect import ChatOfficeArchitect, parse_office_proposal
from envs.osworld.loader import load_osworld
from guijax.evocua.hindsight import coordinate_leaks
from guijax.evocua.office_architect import LOAD_WAIT_S, SAVE_WAIT_S, OfficeArchitect
from guijax.evocua.office_resources import CAPABILITIES, HEADER, Document, OfficeScenarioSampler
from guijax.evocua.office_synthesis import OfficeSynthesizer, decontaminate, main, write_task
from guijax.evocua.synthesis import Attempt, ProposalError, Verdict


def scenario(capability: str, seed: int = 0):
    return OfficeScenarioSampler((capability,)).sample(random.Random(seed), f"sc-{capability}-{seed}")


def waits(proposal) -> list[float]:
    return [a["amount"] for a in proposal.solution if a["kind"] == "wait"]


def test_scenarios_are_drawn_from_the_seed_and_hold_persona_content():
    a, b = (OfficeScenarioSampler().sample(random.Random(7), "x") for _ in range(2))
    assert a == b
    assert a != OfficeScenarioSampler().sample(random.Random(8), "x")
    sheet = scenario("sheet_append_row").document
    assert sheet.rows[0] == HEADER and 4 <= len(sheet.rows) <= 6 and sheet.kind == "xlsx"
    assert all(isinstance(p, int) and isinstance(q, int) for _, p, q in sheet.rows[1:])
    with pytest.raises(ValueError, match="unknown office capabilities"):
        OfficeScenarioSampler(("sheet_delete",))


@pytest.mark.parametrize("kind", ["xlsx", "csv", "txt"])
def test_documents_are_written_as_the_apps_open_them(tmp_path, kind):
    rows = (("a line",), ("another",)) if kind == "txt" else (HEADER, ("Tea", 3, 4))
    doc = Document(f"f.{kind}", rows)
    doc.write(tmp_path / doc.name)
    if kind == "xlsx":
        got = [tuple(r) for r in openpyxl.load_workbook(tmp_path / doc.name).active.iter_rows(values_only=True)]
        assert got == list(rows)
    elif kind == "csv":
        assert (tmp_path / doc.name).read_text() == "Item,Price,Quantity\nTea,3,4\n"
    else:
        assert (tmp_path / doc.name).read_text() == "a line\nanother\n"
    with pytest.raises(ValueError, match="no writer for .pdf"):
        Document("f.pdf", rows).write(tmp_path / "f.pdf")


def changed_rows(before: Document, after: Document) -> list[int]:
    return [i for i in range(max(len(before.rows), len(after.rows)))
            if i >= len(before.rows) or i >= len(after.rows) or before.rows[i] != after.rows[i]]


@pytest.mark.parametrize("capability", sorted(CAPABILITIES))
def test_the_expected_document_differs_from_the_initial_one_only_where_the_instruction_says(capability):
    sc = scenario(capability, seed=3)
    p = OfficeArchitect().propose(sc, [])
    changed = changed_rows(sc.document, p.expected)
    assert len(changed) == 1
    row = [str(x) for x in p.expected.rows[changed[0]]]
    if capability == "sheet_set_cell":  # the item stays, only its quantity changes
        assert row[0] == sc.document.rows[changed[0]][0] and row[2] in p.instruction
    else:
        assert all(x in p.instruction for x in row), (row, p.instruction)
    assert sc.document.name in p.instruction and p.instruction.startswith(f"I'm {sc.persona}.")
    assert p.solution[-2] == {"kind": "hotkey", "keys": ["ctrl", "s"], "why": "save the file"}
    assert all(a["why"] and not coordinate_leaks(a["why"]) for a in p.solution)  # the cold start's thoughts
    assert waits(p)[0] == LOAD_WAIT_S and waits(p)[-1] == SAVE_WAIT_S


def test_sheet_set_cell_moves_to_the_changed_row_and_the_quantity_column():
    sc = scenario("sheet_set_cell", seed=5)
    p = OfficeArchitect().propose(sc, [])
    (row,) = changed_rows(sc.document, p.expected)
    keys = [a["keys"][0] for a in p.solution if a["kind"] == "press"]
    assert keys == ["down"] * row + ["right"] * 2


def test_a_rejected_reference_doubles_the_waits_and_keeps_the_goal_other_failures_draw_a_new_one():
    sc = scenario("text_replace_line", seed=1)
    arch = OfficeArchitect()
    first = arch.propose(sc, [])
    slow = arch.propose(sc, [Attempt(0, "reference", "rejected")])
    assert slow.expected == first.expected and slow.instruction == first.instruction
    assert waits(slow) == [2 * w for w in waits(first)]
    redrawn = [arch.propose(sc, [Attempt(0, "initial_state", "accepted")] * k).instruction for k in range(1, 6)]
    assert any(x != first.instruction for x in redrawn)


def test_written_tasks_load_as_osworld_tasks_with_both_documents(tmp_path):
    sc = scenario("csv_append_row", seed=2)
    p = OfficeArchitect().propose(sc, [])
    path = write_task(tmp_path, sc, p, "t1")
    (task,) = load_osworld(tmp_path)
    assert task.id == "t1" and task.domain == "calc" and path == tmp_path / "calc" / "t1.json"
    url = task.setup[0].parameters["files"][0]["url"]
    assert (path.parent / url).read_text() == (tmp_path / "assets" / f"t1-{sc.document.name}").read_text()
    expected = task.evaluator.expected[0].config["path"]
    assert (path.parent / expected).read_text().splitlines()[-1].startswith(p.expected.rows[-1][0])
    assert task.task.extra["solution"] == p.solution


class ScriptedSandbox:
    """Verdicts in order; records what it was shown."""

    def __init__(self, *verdicts: Verdict):
        self.verdicts, self.seen = list(verdicts), []

    def check(self, scenario, task):
        self.seen.append(task)
        return self.verdicts.pop(0)


def test_the_loop_feeds_the_sandbox_error_back_and_keeps_every_attempt(tmp_path):
    sandbox = ScriptedSandbox(Verdict("reference", "the sheet holds [...]"), Verdict("passed"))
    synth = OfficeSynthesizer(sandbox, tmp_path, sampler=OfficeScenarioSampler(("sheet_append_row",)))
    out = synth.synthesize(scenario("sheet_append_row"), "t2")
    assert [a.check for a in out.attempts] == ["reference", "passed"]
    first, second = (t.task.extra["solution"] for t in sandbox.seen)
    assert [a["amount"] for a in second if a["kind"] == "wait"] == [2 * a["amount"] for a in first if a["kind"] == "wait"]
    saved = json.loads(out.task_file.read_text())
    assert [a["check"] for a in saved["synthesis"]["attempts"]] == ["reference", "passed"]
    assert [t.id for t in load_osworld(tmp_path)] == ["t2"]


def test_a_scenario_no_proposal_passes_is_skipped_with_the_last_error(tmp_path):
    sandbox = ScriptedSandbox(*[Verdict("initial_state", "already holds")] * 2)
    out = OfficeSynthesizer(sandbox, tmp_path, max_attempts=2).synthesize(scenario("text_append_line"), "t3")
    assert out.task_file is None and "already holds" in out.skipped and len(out.attempts) == 2
    assert not (tmp_path / "examples").exists()


def test_decontamination_removes_a_task_whose_instruction_a_held_out_task_shares(tmp_path):
    synth = OfficeSynthesizer(ScriptedSandbox(Verdict("passed"), Verdict("passed")), tmp_path)
    outs = [synth.synthesize(scenario(c, 4), f"t-{c}") for c in ("text_append_line", "sheet_set_cell")]
    held = [t for t in load_osworld(tmp_path) if t.id == "t-sheet_set_cell"]
    report = decontaminate(outs, held)
    assert report["dropped"] == ["t-sheet_set_cell"] and report["tasks"]["t-sheet_set_cell"]["dropped_by"]
    assert [t.id for t in load_osworld(tmp_path)] == ["t-text_append_line"]
    assert not list((tmp_path / "examples" / "assets").glob("t-sheet_set_cell-*"))
    chex.assert_scalar_in(report["tasks"]["t-text_append_line"]["instruction"]["overlap"], 0.0, 0.49)


def test_the_command_names_an_unknown_capability(capsys, monkeypatch):
    monkeypatch.setattr("envs.desktop.checks.desktop_missing", lambda apps=False: None)
    assert main(["--out", "/tmp/unused-office", "--capabilities", "sheet_delete"]) == 2
    assert "sheet_delete" in capsys.readouterr().err


MISSING = desktop_missing(apps=True)


@pytest.mark.desktop
@pytest.mark.skipif(MISSING is not None, reason=str(MISSING))
def test_every_capability_is_accepted_on_the_real_desktop_and_a_wrong_validator_is_not(tmp_path):
    from envs.desktop.env import DesktopEnv
    from envs.osworld.local import run_solution
    from guijax.evocua.office_synthesis import DesktopSandbox

    env = DesktopEnv((1280, 720), settle_s=0.3, step_limit=50)
    try:
        sandbox = DesktopSandbox(env)
        synth = OfficeSynthesizer(sandbox, tmp_path / "out")
        outs = {c: synth.synthesize(scenario(c, 11), f"t-{c}") for c in sorted(CAPABILITIES)}
        assert {c: [a.check for a in o.attempts] for c, o in outs.items()} == {c: ["passed"] for c in CAPABILITIES}
        kept = load_osworld(tmp_path / "out")
        assert len(kept) == len(CAPABILITIES)
        assert run_solution(env, kept[0]) == (0.0, 1.0)  # the written task, run again from its files

        class Unchanged(OfficeArchitect):  # the validator expects the document as it is set up
            def propose(self, sc, history):
                p = super().propose(sc, history)
                return type(p)(p.instruction, p.evaluator, p.solution, sc.document)

        class Misspelled(OfficeArchitect):  # the reference types something other than what the validator expects
            def propose(self, sc, history):
                p = super().propose(sc, history)
                return type(p)(p.instruction, p.evaluator, [a if a["kind"] != "type" else dict(a, text="zz" + a["text"])
                                                            for a in p.solution], p.expected)

        sc = scenario("text_append_line", 12)
        unchanged = OfficeSynthesizer(sandbox, tmp_path / "u", architect=Unchanged(), max_attempts=1).synthesize(sc, "u")
        assert [a.check for a in unchanged.attempts] == ["initial_state"]
        wrong = OfficeSynthesizer(sandbox, tmp_path / "w", architect=Misspelled(), max_attempts=1).synthesize(sc, "w")
        assert [a.check for a in wrong.attempts] == ["reference"]
        assert "zz" in wrong.attempts[0].error  # the file as the reference left it goes back to the architect
    finally:
        env.close()


# ------------------------------------------------------------------ the chat architect


def answer_from(proposal) -> str:
    """What a model that wrote the offline architect's goal would answer."""
    doc = proposal.expected
    rows = [r[0] for r in doc.rows] if doc.kind == "txt" else [list(r) for r in doc.rows]
    return json.dumps({"instruction": proposal.instruction, "expected_rows": rows, "solution": proposal.solution})


@pytest.mark.parametrize("change, problem", [
    (lambda d: d.pop("solution"), "missing \\['solution'\\]"),
    (lambda d: d.update(extra=1), "extra \\['extra'\\]"),
    (lambda d: d.update(instruction=" "), "instruction must be a non-empty string"),
    (lambda d: d.update(expected_rows=[["Item", True]]), "expected_rows\\[0\\] must be a non-empty list"),
    (lambda d: d.update(solution=[{"kind": "click", "point": [1, 2]}]), "solution\\[0\\] must be an object whose kind"),
    (lambda d: d.update(solution=[{"kind": "type"}]), "solution\\[0\\] \\(type\\) needs 'text'"),
    (lambda d: d.update(solution=[{"kind": "wait", "amount": 99}]), "waits 99 s"),
    (lambda d: d.update(solution=[{"kind": "hotkey", "keys": []}]), "non-empty list of key names"),
])
def test_the_chat_architects_answer_is_read_strictly(change, problem):
    sc = scenario("sheet_append_row", 6)
    data = json.loads(answer_from(OfficeArchitect().propose(sc, [])))
    change(data)
    with pytest.raises(ProposalError, match=problem):
        parse_office_proposal(data, sc, "here")
    unchanged = dict(json.loads(answer_from(OfficeArchitect().propose(sc, []))),
                     expected_rows=[list(r) for r in sc.document.rows])
    with pytest.raises(ProposalError, match="would change nothing"):
        parse_office_proposal(unchanged, sc, "here")


def test_the_chat_architect_retries_malformed_answers_and_hears_the_sandbox(tmp_path):
    sc = scenario("text_replace_line", 2)
    good = answer_from(OfficeArchitect().propose(sc, []))
    sandbox = ScriptedSandbox(Verdict("reference", "the file holds 'x'"), Verdict("passed"))
    with fake_chat_server([(200, "not json"), (200, good), (200, good)]) as (url, req):
        architect = ChatOfficeArchitect(ChatClient(url, "architect", api_key_env=""), retries=1)
        out = OfficeSynthesizer(sandbox, tmp_path, architect=architect).synthesize(sc, "c1")
    assert [a.check for a in out.attempts] == ["format", "reference", "passed"] and out.task_file is not None
    first = req[0]["body"]["messages"]
    assert sc.document.name in first[1]["content"] and "replace one line" in first[1]["content"]
    assert req[1]["body"]["messages"][-1]["content"].startswith("That answer is not a valid task")
    replay = req[2]["body"]["messages"]  # the rejected proposal and the sandbox's words come back
    assert replay[-2] == {"role": "assistant", "content": good} and "the file holds 'x'" in replay[-1]["content"]
    assert load_osworld(tmp_path)[0].task.extra["solution"] == json.loads(good)["solution"]


def test_a_chat_architect_without_a_readable_answer_skips_the_scenario(tmp_path):
    with fake_chat_server([(200, '{"instruction": "x"}')]) as (url, _):
        architect = ChatOfficeArchitect(ChatClient(url, "architect", api_key_env=""), retries=1)
        synth = OfficeSynthesizer(ScriptedSandbox(), tmp_path, architect=architect)
        out = synth.synthesize(scenario("csv_append_row"), "c2")
    assert out.task_file is None and "no well-formed task after 2 answers" in out.skipped
    assert [a.check for a in out.attempts] == ["format", "format"]


@pytest.mark.desktop
@pytest.mark.skipif(MISSING is not None, reason=str(MISSING))
def test_a_chat_architects_task_is_accepted_on_the_real_desktop(tmp_path):
    from envs.desktop.env import DesktopEnv
    from guijax.evocua.office_synthesis import DesktopSandbox

    sc = scenario("sheet_set_cell", 13)
    with fake_chat_server([(200, answer_from(OfficeArchitect().propose(sc, [])))]) as (url, _):
        architect = ChatOfficeArchitect(ChatClient(url, "architect", api_key_env=""))
        env = DesktopEnv((1280, 720), settle_s=0.3, step_limit=50)
        try:
            out = OfficeSynthesizer(DesktopSandbox(env), tmp_path, architect=architect).synthesize(sc, "c3")
        finally:
            env.close()
    assert [a.check for a in out.attempts] == ["passed"]
    assert json.loads(out.task_file.read_text())["synthesis"]["architect"] == "office_chat"


def test_the_read_back_names_a_file_the_app_left_unreadable(tmp_path):
    from types import SimpleNamespace

    from guijax.evocua.office_synthesis import _read_back

    sc = scenario("sheet_append_row", 1)
    env = SimpleNamespace(display=SimpleNamespace(home=tmp_path))
    assert _read_back(env, sc) == f"; ~/{sc.document.name} does not exist"
    (tmp_path / sc.document.name).write_bytes(b"not a zip")
    assert "cannot be read back: BadZipFile" in _read_back(env, sc)
    sc.document.write(tmp_path / sc.document.name)
    assert _read_back(env, sc) == f"; the sheet holds {[list(r) for r in sc.document.rows]}"
