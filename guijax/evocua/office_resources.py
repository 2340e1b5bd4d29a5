"""EvoCUA's parametric resources (evocua.txt §3.1) for the local desktop's office apps: spreadsheets and text
documents whose content is drawn from a persona's vocabulary with a seed, so every value a validator checks
is known when the task is written.

A scenario here is (persona, capability, document). Capabilities are what LibreOffice Calc and the text editor
do with such a document: append a row, set one cell, append a CSV record, append or replace a line. The task
architect (guijax.evocua.office_architect) reads the scenario and writes instruction, validator and reference.
"""
from __future__ import annotations

import csv
import dataclasses
import io
import pathlib
import random
from typing import Any

from guijax.evocua.task_space import PERSONAS, Persona

HEADER = ("Item", "Price", "Quantity")
# capability -> (OSWorld domain, document kind)
CAPABILITIES: dict[str, tuple[str, str]] = {
    "sheet_append_row": ("calc", "xlsx"), "sheet_set_cell": ("calc", "xlsx"), "csv_append_row": ("calc", "csv"),
    "text_append_line": ("editor", "txt"), "text_replace_line": ("editor", "txt")}


@dataclasses.dataclass(frozen=True)
class Document:
    """A file's content: for sheets the header then one tuple per row, for text one 1-tuple per line."""

    name: str  # file name in the desktop user's home, e.g. "stock.xlsx"
    rows: tuple[tuple[Any, ...], ...]

    @property
    def kind(self) -> str:
        return self.name.rsplit(".", 1)[-1]

    def write(self, path: pathlib.Path) -> None:
        """The file as the app opens it: xlsx through openpyxl, CSV with a header, text ending in a newline."""
        if self.kind == "xlsx":
            import openpyxl

            book = openpyxl.Workbook()
            sheet = book.active
            for row in self.rows:
                sheet.append(list(row))
            book.save(path)
        elif self.kind == "csv":
            buf = io.StringIO()
            csv.writer(buf, lineterminator="\n").writerows(self.rows)
            path.write_text(buf.getvalue())
        elif self.kind == "txt":
            path.write_text("".join(f"{line}\n" for (line,) in self.rows))
        else:
            raise ValueError(f"{self.name}: no writer for .{self.kind} (xlsx, csv, txt)")

    def with_rows(self, rows) -> "Document":
        return dataclasses.replace(self, rows=tuple(tuple(r) for r in rows))


@dataclasses.dataclass(frozen=True)
class OfficeScenario:
    id: str
    persona: str
    capability: str
    document: Document
    seed: int

    @property
    def domain(self) -> str:
        return CAPABILITIES[self.capability][0]

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "persona": self.persona, "capability": self.capability, "file": self.document.name,
                "rows": [list(r) for r in self.document.rows], "seed": self.seed}


def _stem(rng: random.Random, persona: Persona) -> str:
    return f"{rng.choice(persona.files)}_{rng.randrange(100, 1000)}"


def spreadsheet(rng: random.Random, persona: Persona, kind: str) -> Document:
    """3-5 rows of the persona's words with a price (1-99) and a quantity (1-20)."""
    items = rng.sample(persona.words, rng.randint(3, 5))
    rows = [(w.capitalize(), rng.randint(1, 99), rng.randint(1, 20)) for w in items]
    return Document(f"{_stem(rng, persona)}.{kind}", (HEADER, *rows))


def text_document(rng: random.Random, persona: Persona) -> Document:
    """3-6 distinct lines, each a short phrase of the persona's words and files."""
    lines: list[str] = []
    while len(lines) < rng.randint(3, 6):
        line = f"{rng.choice(persona.actions).lower()} the {rng.choice(persona.words)} {rng.choice(persona.files)}"
        if line not in lines:
            lines.append(line)
    return Document(f"{_stem(rng, persona)}.txt", tuple((x,) for x in lines))


class OfficeScenarioSampler:
    """Draws (persona, capability, document) with the document's content from the persona."""

    def __init__(self, capabilities: tuple[str, ...] = tuple(CAPABILITIES), personas: tuple[Persona, ...] = PERSONAS):
        unknown = sorted(set(capabilities) - set(CAPABILITIES))
        if unknown:
            raise ValueError(f"unknown office capabilities {unknown}; known: {sorted(CAPABILITIES)}")
        if not capabilities:
            raise ValueError("OfficeScenarioSampler needs at least one capability")
        self.capabilities, self.personas = tuple(capabilities), personas

    def sample(self, rng: random.Random, scenario_id: str) -> OfficeScenario:
        persona = rng.choice(self.personas)
        capability = rng.choice(self.capabilities)
        kind = CAPABILITIES[capability][1]
        doc = text_document(rng, persona) if kind == "txt" else spreadsheet(rng, persona, kind)
        return OfficeScenario(scenario_id, persona.role, capability, doc, rng.randrange(2 ** 31))
