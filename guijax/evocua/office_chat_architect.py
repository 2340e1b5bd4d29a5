"""The task architect for office scenarios as a model behind an OpenAI-compatible endpoint (evocua.txt §3.2's
dual stream): given the persona, the capability and the document as generated, it writes the instruction, the
document the validator expects after the task, and a keyboard-only reference solution.

The validator's function is fixed by the document's kind (the whole expected file compared, as the offline
architect's); the model writes its data. Answers are one JSON object, checked strictly; a malformed one is asked
again with the error, up to `retries` times, then the scenario is skipped with every reason. The sandbox's
earlier verdicts are replayed as the conversation so far. The paper prints no architect prompt; this one is
written for the desktop's apps.
"""
from __future__ import annotations

import json
from typing import Any, Sequence

from guijax.chat import ChatClient
from guijax.evocua.architects import ask_for_proposal, conversation
from guijax.evocua.office_architect import EXPECTED, METRIC, OfficeProposal
from guijax.evocua.office_resources import CAPABILITIES, OfficeScenario
from guijax.evocua.synthesis import Attempt, ProposalError

CAPABILITY_TEXT = {
    "sheet_append_row": "add one row below the last row of the spreadsheet",
    "sheet_set_cell": "change one cell of an existing row of the spreadsheet",
    "csv_append_row": "add one record at the end of the CSV file (LibreOffice Calc asks for import settings first)",
    "text_append_line": "add one line at the end of the text file",
    "text_replace_line": "replace one line of the text file with another"}

SYSTEM_PROMPT = """You are a task architect for a Linux desktop used to train computer-use agents. A document is already open in its application (LibreOffice Calc for .xlsx and .csv, a text editor for .txt). Write ONE task a user with the given persona would ask for, exercising the given capability on that document, together with the document as it must be after the task and a reference solution.

Answer with one JSON object and nothing else, with exactly these keys:
{
  "instruction": string,        // the request, naming the file (~/NAME) and every value to enter
  "expected_rows": [...],       // the whole document after the task: for .xlsx and .csv a list of rows (each a list of cells, header first); for .txt a list of lines
  "solution": [ACTION, ...]     // keyboard-only actions that perform the task and save the file
}
ACTION is one of {"kind": "wait", "amount": SECONDS}, {"kind": "press", "keys": ["down"]}, {"kind": "hotkey", "keys": ["ctrl", "s"]}, {"kind": "type", "text": "..."} ("\\t" moves to the next cell, "\\n" ends a row or a line); give each action a "why", its purpose in a few words ("move to the empty row below the last one"). The application has just opened the file with the cursor at its start; wait about a second first, save with ctrl+s and wait again at the end."""

USER_PROMPT = """Persona: {persona}
Capability: {capability}
File: ~/{name}
Its content (rows or lines):
{content}"""

FEEDBACK_PROMPT = """The sandbox ran this task on the desktop and rejected it ({check} check): {error}
Answer again with one corrected JSON object."""

FORMAT_PROMPT = """That answer is not a valid task: {error}
Answer again with one JSON object with exactly the keys instruction, expected_rows, solution."""

ACTION_KINDS = {"wait": {"amount": (int, float)}, "press": {"keys": list}, "hotkey": {"keys": list}, "type": {"text": str}}


def _cell_ok(value: Any) -> bool:
    return isinstance(value, (str, int, float)) and not isinstance(value, bool)


def parse_office_proposal(data: Any, scenario: OfficeScenario, where: str, raw: str = "") -> OfficeProposal:
    """The proposal in `data`, or ProposalError naming `where` and what is wrong."""
    if not isinstance(data, dict):
        raise ProposalError(f"{where}: the answer must be a JSON object, got {type(data).__name__}")
    extra = sorted(set(data) - {"instruction", "expected_rows", "solution"})
    missing = sorted({"instruction", "expected_rows", "solution"} - set(data))
    if missing or extra:
        raise ProposalError(f"{where}: keys must be instruction, expected_rows, solution (missing {missing}, extra {extra})")
    instruction = data["instruction"]
    if not isinstance(instruction, str) or not instruction.strip():
        raise ProposalError(f"{where}: instruction must be a non-empty string")
    doc = scenario.document
    rows = data["expected_rows"]
    if not isinstance(rows, list) or not rows:
        raise ProposalError(f"{where}: expected_rows must be a non-empty list")
    if doc.kind == "txt":
        if not all(isinstance(line, str) and "\n" not in line for line in rows):
            raise ProposalError(f"{where}: expected_rows of a .txt file must be single-line strings")
        expected = doc.with_rows([(line,) for line in rows])
    else:
        for i, row in enumerate(rows):
            if not isinstance(row, list) or not row or not all(_cell_ok(c) for c in row):
                raise ProposalError(f"{where}: expected_rows[{i}] must be a non-empty list of strings or numbers")
        expected = doc.with_rows(rows)
    if expected.rows == doc.rows:
        raise ProposalError(f"{where}: expected_rows equal the document as it is: the task would change nothing")
    solution = data["solution"]
    if not isinstance(solution, list) or not solution:
        raise ProposalError(f"{where}: solution must be a non-empty list of actions")
    for i, action in enumerate(solution):
        kind = action.get("kind") if isinstance(action, dict) else None
        if kind not in ACTION_KINDS:
            raise ProposalError(f"{where}: solution[{i}] must be an object whose kind is one of {sorted(ACTION_KINDS)}")
        for key, typ in ACTION_KINDS[kind].items():
            value = action.get(key)
            if not isinstance(value, typ) or isinstance(value, bool):
                raise ProposalError(f"{where}: solution[{i}] ({kind}) needs {key!r} of type {typ}")
        if kind in ("press", "hotkey") and not (action["keys"] and all(isinstance(k, str) and k for k in action["keys"])):
            raise ProposalError(f"{where}: solution[{i}] ({kind}) needs a non-empty list of key names")
        if "why" in action and not isinstance(action["why"], str):
            raise ProposalError(f"{where}: solution[{i}] ({kind}) has a 'why' that is not a string")
        if kind == "wait" and not 0 <= action["amount"] <= 30:
            raise ProposalError(f"{where}: solution[{i}] waits {action['amount']} s (0 to 30)")
    evaluator = {"func": METRIC[doc.kind], "result": {"type": "vm_file", "path": f"~/{doc.name}", "dest": doc.name},
                 "expected": {"type": "cache_file", "path": EXPECTED}}
    return OfficeProposal(instruction.strip(), evaluator, [dict(a) for a in solution], expected, raw)


class ChatOfficeArchitect:
    """A model writes the instruction, the expected document and the reference for an office scenario."""

    name = "office_chat"

    def __init__(self, client: ChatClient, retries: int = 2):
        self.client, self.retries = client, retries

    def messages(self, scenario: OfficeScenario, history: Sequence[Attempt]) -> list[dict[str, str]]:
        """The scenario, then each earlier proposal and the sandbox's verdict on it."""
        doc = scenario.document
        content = json.dumps([r[0] if doc.kind == "txt" else list(r) for r in doc.rows], indent=1)
        return conversation(SYSTEM_PROMPT, USER_PROMPT.format(persona=scenario.persona, name=doc.name, content=content,
                                                              capability=CAPABILITY_TEXT[scenario.capability]),
                            history, FEEDBACK_PROMPT)

    def propose(self, scenario: OfficeScenario, history: Sequence[Attempt]) -> OfficeProposal:
        return ask_for_proposal(self.client, self.messages(scenario, history),
                                lambda data, where, answer: parse_office_proposal(data, scenario, where, raw=answer),
                                self.retries, scenario.id, FORMAT_PROMPT)

assert set(CAPABILITY_TEXT) == set(CAPABILITIES)
