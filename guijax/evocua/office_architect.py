"""The offline task architect for office scenarios (evocua.txt §3.2's dual stream on the local desktop): from
a generated document it writes the instruction, an OSWorld validator with the expected file, and a
keyboard-only reference solution, all three from the same goal. Each reference action carries `why`, its
purpose in words, which the cold start's rule writer turns into the step's thought
(guijax.evocua.office_coldstart); the replay ignores it.

The sandbox's errors come back as the attempt history. A reference the validator rejects on a real desktop is
most often a timing problem (the app had not finished loading or saving), so the next proposal waits twice as
long; any other failure draws a new goal. A model can play the same role (guijax.evocua.office_chat_architect).
"""
from __future__ import annotations

import dataclasses
import random
from typing import Any, Sequence

from guijax.evocua.office_resources import CAPABILITIES, Document, OfficeScenario
from guijax.evocua.synthesis import Attempt
from guijax.evocua.task_space import PERSONA_BY_ROLE

LOAD_WAIT_S, SAVE_WAIT_S = 1.0, 1.5
EXPECTED = "expected"  # the evaluator's `expected` getter path is filled in when the task is written


@dataclasses.dataclass(frozen=True)
class OfficeProposal:
    instruction: str
    evaluator: dict[str, Any]  # OSWorld evaluator; `expected` names the file EXPECTED until written
    solution: list[dict[str, Any]]  # Action dicts, one per env step (envs.osworld.env.action_from_dict)
    expected: Document
    raw: str = ""  # a model architect's own answer, replayed to it with the sandbox's verdict
    format_errors: tuple[str, ...] = ()  # malformed answers it retried before this one

    def to_dict(self) -> dict[str, Any]:
        return {"instruction": self.instruction, "evaluator": self.evaluator, "solution": self.solution,
                "expected_rows": [list(r) for r in self.expected.rows]}


def _press(key: str, times: int = 1, *, why: str) -> list[dict[str, Any]]:
    return [{"kind": "press", "keys": [key], "why": why} for _ in range(times)]


def _hotkey(*keys: str, why: str) -> dict[str, Any]:
    return {"kind": "hotkey", "keys": list(keys), "why": why}


def _type(text: str, why: str) -> dict[str, Any]:
    return {"kind": "type", "text": text, "why": why}


def _wait(seconds: float, why: str) -> dict[str, Any]:
    return {"kind": "wait", "amount": seconds, "why": why}


def _fresh_item(rng: random.Random, doc: Document, persona) -> str:
    present = {str(r[0]).lower() for r in doc.rows}
    choices = [w for w in persona.files + persona.words if w.lower() not in present]
    return rng.choice(choices).capitalize()


def _sheet_append(rng, scenario: OfficeScenario, persona, load: list) -> tuple[str, Document, list]:
    doc = scenario.document
    item, price, qty = _fresh_item(rng, doc, persona), rng.randint(1, 99), rng.randint(1, 20)
    text = (f"In the open spreadsheet ~/{doc.name}, add a row below the last one for {item} with price {price} and "
            f"quantity {qty}, and save it as xlsx.")
    steps = load + [_hotkey("ctrl", "home", why="go to the first cell of the sheet"),
                    _hotkey("ctrl", "down", why="jump to the last filled row of the first column"),
                    *_press("down", why="move to the empty row below it"),
                    _type(f"{item}\t{price}\t{qty}\n", why=f"enter {item}, its price and its quantity across the row")]
    return text, doc.with_rows(doc.rows + ((item, price, qty),)), steps


def _sheet_set(rng, scenario: OfficeScenario, persona, load: list) -> tuple[str, Document, list]:
    doc = scenario.document
    index = rng.randrange(1, len(doc.rows))
    item, price, qty = doc.rows[index]
    new = rng.choice([q for q in range(1, 31) if q != qty])
    text = f"In ~/{doc.name}, change the quantity of {item} to {new} and save the file, keeping the xlsx format."
    rows = list(doc.rows)
    rows[index] = (item, price, new)
    steps = load + [_hotkey("ctrl", "home", why="go to the first cell of the sheet"),
                    *_press("down", index, why=f"move down towards the row of {item}"),
                    *_press("right", 2, why="move right towards the quantity column"),
                    _type(f"{new}\n", why=f"replace the quantity of {item} with the new value")]
    return text, doc.with_rows(rows), steps


def _csv_append(rng, scenario: OfficeScenario, persona, load: list) -> tuple[str, Document, list]:
    doc = scenario.document
    item, price, qty = _fresh_item(rng, doc, persona), rng.randint(1, 99), rng.randint(1, 20)
    text = (f"Open ~/{doc.name} (accept the import settings), add a record for {item} with price {price} and "
            f"quantity {qty} at the end, and save it, keeping the CSV format.")
    steps = load + [*_press("enter", why="accept the import settings dialog"),
                    _wait(2 * load[0]["amount"], "let the imported sheet appear"),
                    _hotkey("ctrl", "end", why="jump to the last filled cell"),
                    *_press("down", why="move to the empty row below it"),
                    *_press("home", why="go to the first column of that row"),
                    _type(f"{item}\t{price}\t{qty}\n", why=f"enter {item}, its price and its quantity across the row")]
    return text, doc.with_rows(doc.rows + ((item, str(price), str(qty)),)), steps


def _text_append(rng, scenario: OfficeScenario, persona, load: list) -> tuple[str, Document, list]:
    doc = scenario.document
    present = {r[0] for r in doc.rows}
    line = next(x for x in iter(lambda: f"{rng.choice(persona.actions).lower()} the {rng.choice(persona.files)} "
                                        f"by {rng.choice(('monday', 'friday', 'noon', 'tonight'))}", None)
                if x not in present)
    text = f"In the open text editor, add '{line}' as a new last line of ~/{doc.name} and save the file."
    return text, doc.with_rows(doc.rows + ((line,),)), load + [
        _hotkey("ctrl", "end", why="move the cursor to the end of the file"),
        _type(f"{line}\n", why="type the new line")]


def _text_replace(rng, scenario: OfficeScenario, persona, load: list) -> tuple[str, Document, list]:
    doc = scenario.document
    index = rng.randrange(len(doc.rows))
    (old,) = doc.rows[index]
    present = {r[0] for r in doc.rows}
    new = next(x for x in iter(lambda: f"{rng.choice(persona.actions).lower()} the {rng.choice(persona.words)} "
                                       f"{rng.choice(persona.files)} again", None) if x not in present)
    text = f"In the open text editor, replace the line '{old}' of ~/{doc.name} with '{new}' and save the file."
    rows = list(doc.rows)
    rows[index] = (new,)
    steps = load + [_hotkey("ctrl", "home", why="move the cursor to the start of the file"),
                    *_press("down", index, why="move down towards the line to replace"),
                    *_press("home", why="go to the start of that line"),
                    _hotkey("shift", "end", why="select the whole line"),
                    _type(new, why="type the new text over the selected line")]
    return text, doc.with_rows(rows), steps


COMPOSERS = {"sheet_append_row": _sheet_append, "sheet_set_cell": _sheet_set, "csv_append_row": _csv_append,
             "text_append_line": _text_append, "text_replace_line": _text_replace}
assert set(COMPOSERS) == set(CAPABILITIES)
METRIC = {"xlsx": "compare_table", "csv": "compare_csv", "txt": "compare_text_file"}


class OfficeArchitect:
    """Writes instruction, validator (the whole expected file) and reference from one drawn goal."""

    name = "office_procedural"

    def propose(self, scenario: OfficeScenario, history: Sequence[Attempt]) -> OfficeProposal:
        timing = sum(a.check == "reference" for a in history)
        slower = 2 ** timing  # each reference the desktop rejected doubles the waits
        rng = random.Random(f"{scenario.seed}/{len(history) - timing}")  # a new goal only after other failures
        persona = PERSONA_BY_ROLE[scenario.persona]
        load = [_wait(LOAD_WAIT_S * slower, "wait for the document to finish opening")]
        text, expected, steps = COMPOSERS[scenario.capability](rng, scenario, persona, load)
        steps += [_hotkey("ctrl", "s", why="save the file"), _wait(SAVE_WAIT_S * slower, "let the save finish")]
        doc = scenario.document
        evaluator = {"func": METRIC[doc.kind],
                     "result": {"type": "vm_file", "path": f"~/{doc.name}", "dest": doc.name},
                     "expected": {"type": "cache_file", "path": EXPECTED}}
        return OfficeProposal(f"I'm {scenario.persona}. {text}", evaluator, steps, expected)
