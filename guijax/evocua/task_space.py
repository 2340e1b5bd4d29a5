"""EvoCUA's structured task space (evocua.txt §3.1) on the synthetic desk: a scenario is a sampled tuple
(persona, capabilities, resources).

- Capabilities are the desk's atomic widget skills (click, toggle, type, choose, slider, list, form, confirm,
  copy between windows, save with a hotkey, infeasible requests); two of them may be composed in one
  scenario, because atomic skills recombine into longer tasks.
- Personas are short role strings with their own vocabulary (window titles, words, file names, actions), so
  the same capability appears in varied content.
- Resources are parametric scene content (the paper's "parametric synthesis"): windows and widgets whose
  names, texts, states and values are drawn per scenario, laid out as the `desk_scene` setup step reads them.

Nothing here decides the goal: the task architect reads the scenario and writes instruction, validator and
reference solution (guijax.evocua.architects).
"""
from __future__ import annotations

import dataclasses
import random
from typing import Any, Callable

from envs.desk.families import CHECKS, DROPDOWNS, SLIDERS


@dataclasses.dataclass(frozen=True)
class Persona:
    """A user role and the content its applications hold."""

    role: str
    titles: tuple[str, ...]  # window titles of its applications
    words: tuple[str, ...]  # short texts it reads and types
    files: tuple[str, ...]  # file stems in its lists
    actions: tuple[str, ...]  # button names


PERSONAS: tuple[Persona, ...] = (
    Persona("a school teacher preparing a quiz", ("Gradebook", "Quiz Maker", "Class Roster"),
            ("algebra", "essay", "quiz", "grades", "semester", "homework"),
            ("lesson", "quiz", "rubric", "roster", "syllabus"), ("Publish", "Grade", "Share", "Print", "Export")),
    Persona("an accountant closing the month", ("Ledger", "Invoices", "Payroll"),
            ("invoice", "ledger", "audit", "refund", "tax", "budget"),
            ("invoice", "ledger", "receipt", "payroll", "statement"), ("Reconcile", "Post", "Export", "Approve", "Print")),
    Persona("a nurse on the night shift", ("Ward", "Charts", "Shift Log"),
            ("ward", "dose", "triage", "vitals", "rounds", "oncall"),
            ("chart", "admission", "handover", "labs", "discharge"), ("Page", "Sign", "Refresh", "Print", "Submit")),
    Persona("an algorithm engineer surveying papers", ("Reader", "Library", "Experiments"),
            ("transformer", "survey", "baseline", "ablation", "dataset", "gradient"),
            ("paper", "notes", "results", "draft", "figures"), ("Cite", "Download", "Sync", "Export", "Archive")),
    Persona("a travel agent booking a tour", ("Bookings", "Itinerary", "Customers"),
            ("lisbon", "kyoto", "ferry", "hostel", "visa", "museum"),
            ("ticket", "voucher", "itinerary", "passport", "receipt"), ("Book", "Hold", "Refund", "Email", "Print")),
    Persona("a shop owner updating stock", ("Inventory", "Orders", "Storefront"),
            ("apples", "coffee", "candles", "mugs", "socks", "tea"),
            ("stock", "order", "supplier", "price", "catalog"), ("Restock", "Ship", "Apply", "Sync", "Print")),
    Persona("a student planning a thesis", ("Planner", "Thesis", "Notebook"),
            ("chapter", "deadline", "abstract", "method", "outline", "defense"),
            ("chapter", "outline", "draft", "references", "slides"), ("Save draft", "Submit", "Share", "Export", "Print")),
    Persona("a system administrator on call", ("Console", "Accounts", "Backups"),
            ("server", "backup", "firewall", "cron", "kernel", "proxy"),
            ("syslog", "backup", "config", "cert", "audit"), ("Restart", "Deploy", "Sync", "Archive", "Refresh")),
)
PERSONA_BY_ROLE = {p.role: p for p in PERSONAS}

FIELD_NAMES = ("Name", "Email", "City", "Project", "Title", "Tag", "Owner", "Subject", "Reference", "Comment")
MISSING_SETTINGS = ("Turbo mode", "Teleport", "Time travel", "Infinite battery", "Mind reading", "Weather control")
CONFIRM_ACTIONS = ("Delete", "Reset", "Sign out", "Empty trash", "Revoke", "Close account")
GENERIC_TITLES = ("Settings", "Preferences", "Notes", "Dashboard", "Messages", "Files", "Profile", "Tools")


@dataclasses.dataclass(frozen=True)
class Resource:
    """The windows one capability acts on (scene dicts: title, rect, widgets), in back-to-front order."""

    capability: str
    windows: tuple[dict[str, Any], ...]


@dataclasses.dataclass(frozen=True)
class Scenario:
    """A sampled (persona, capabilities, resources) tuple; `windows` is the scene, back to front."""

    id: str
    persona: str
    resources: tuple[Resource, ...]
    seed: int

    @property
    def capabilities(self) -> tuple[str, ...]:
        return tuple(r.capability for r in self.resources)

    @property
    def windows(self) -> list[dict[str, Any]]:
        return [w for r in self.resources for w in r.windows]

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "persona": self.persona, "capabilities": list(self.capabilities),
                "windows": self.windows, "seed": self.seed}


def _window(title: str, widgets: list[dict[str, Any]]) -> dict[str, Any]:
    return {"title": title, "rect": [0, 0, 0, 0], "widgets": widgets}  # rect set by layout()


Builder = Callable[[random.Random, Persona, Callable[[], str]], list[dict[str, Any]]]


def _click(rng, persona, title):
    names = rng.sample(persona.actions, 3)
    return [_window(title(), [{"kind": "label", "name": "Info", "text": "Choose an action"}]
                    + [{"kind": "button", "name": n} for n in names])]


def _toggle(rng, persona, title):
    names = rng.sample(CHECKS, 3)
    return [_window(title(), [{"kind": "checkbox", "name": n, "checked": rng.random() < 0.5} for n in names])]


def _type(rng, persona, title):
    names = rng.sample(FIELD_NAMES, rng.choice((2, 3)))
    return [_window(title(), [{"kind": "field", "name": n, "text": rng.choice(("",) + persona.words)} for n in names])]


def _choose(rng, persona, title):
    name = rng.choice(sorted(DROPDOWNS))
    options = list(DROPDOWNS[name])
    return [_window(title(), [{"kind": "dropdown", "name": name, "options": options, "value": rng.choice(options)},
                              {"kind": "button", "name": "OK"}])]


def _slider(rng, persona, title):
    name = rng.choice(SLIDERS)
    start = rng.randrange(0, 101, 10)
    return [_window(title(), [{"kind": "label", "name": "Hint", "text": f"{name} is at {start}%"},
                              {"kind": "slider", "name": name, "value": start}])]


def _list(rng, persona, title):
    stems = [rng.choice(persona.files) for _ in range(rng.randrange(8, 13))]
    ext = rng.choice((".txt", ".pdf", ".csv", ".docx"))
    items = [f"{stem}_{i}{ext}" for i, stem in enumerate(stems)]
    return [_window(title(), [{"kind": "list", "name": "Files", "options": items}, {"kind": "button", "name": "Open"}])]


def _form(rng, persona, title):
    f1, f2 = rng.sample(FIELD_NAMES, 2)
    dd = rng.choice(sorted(DROPDOWNS))
    return [_window(title(), [
        {"kind": "dropdown", "name": dd, "options": list(DROPDOWNS[dd]), "value": DROPDOWNS[dd][0]},
        {"kind": "field", "name": f1}, {"kind": "field", "name": f2},
        {"kind": "checkbox", "name": rng.choice(CHECKS), "checked": False}, {"kind": "button", "name": "Submit"}])]


def _confirm(rng, persona, title):
    names = rng.sample(CONFIRM_ACTIONS, 3)
    return [_window(title(), [{"kind": "label", "name": "Info", "text": "Account actions"}]
                    + [{"kind": "button", "name": n, "confirm": f"{n}: are you sure?"} for n in names])]


def _copy(rng, persona, title):
    """The target window first (behind), the window showing the code in front."""
    field = rng.choice(("Order", "Code", "Ticket", "Case"))
    code = str(rng.randrange(1000, 10000))
    button = rng.choice(("Track", "Look up"))
    target = _window(title(), [{"kind": "field", "name": field}, {"kind": "button", "name": button}])
    source = _window(title(), [{"kind": "label", "name": "Subject", "text": rng.choice(persona.words).capitalize()},
                               {"kind": "label", "name": "Body", "text": f"{field} number: {code}"}])
    return [target, source]


def _save_note(rng, persona, title):
    return [_window(title(), [{"kind": "field", "name": "Note", "text": rng.choice(("",) + persona.words)}])]


def _infeasible(rng, persona, title):
    names = rng.sample(CHECKS, 2)
    return [_window(title(), [{"kind": "checkbox", "name": n, "checked": rng.random() < 0.5} for n in names])]


CAPABILITIES: dict[str, Builder] = {
    "click": _click, "toggle": _toggle, "type": _type, "choose": _choose, "slider": _slider, "list": _list,
    "form": _form, "confirm": _confirm, "copy": _copy, "save_note": _save_note, "infeasible": _infeasible}
ALONE = ("infeasible",)  # never composed: the whole task is infeasible or none of it is


def layout(windows: list[dict[str, Any]], size: tuple[int, int]) -> list[dict[str, Any]]:
    """Stagger the windows so a part of every title bar stays visible whichever window is in front: window i
    starts 30 px right of and 26 px below window i-1 (below its title bar) and ends 30 px further right."""
    h, w = size
    k = len(windows)
    return [dict(win, rect=[4 + 30 * i, 4 + 26 * i, w - 4 - 30 * (k - 1 - i), h - 4]) for i, win in enumerate(windows)]


class ScenarioSampler:
    """Draws scenarios: a persona, one capability (or, with `compose_prob`, two), their resources."""

    def __init__(self, size: tuple[int, int], capabilities: tuple[str, ...] = tuple(CAPABILITIES),
                 compose_prob: float = 0.3, personas: tuple[Persona, ...] = PERSONAS):
        unknown = sorted(set(capabilities) - set(CAPABILITIES))
        if unknown:
            raise ValueError(f"unknown capabilities {unknown}; known: {sorted(CAPABILITIES)}")
        if not capabilities:
            raise ValueError("ScenarioSampler needs at least one capability")
        self.size, self.capabilities = tuple(size), tuple(capabilities)
        self.compose_prob, self.personas = compose_prob, personas

    def sample(self, rng: random.Random, scenario_id: str) -> Scenario:
        persona = rng.choice(self.personas)
        first = rng.choice(self.capabilities)
        chosen = [first]
        composable = [c for c in self.capabilities if c not in ALONE and c != first]
        if first not in ALONE and composable and rng.random() < self.compose_prob:
            chosen.append(rng.choice(composable))
        titles = list(persona.titles + GENERIC_TITLES)
        rng.shuffle(titles)
        pool = iter(titles)
        resources = [(cap, CAPABILITIES[cap](rng, persona, lambda: next(pool))) for cap in chosen]
        placed = iter(layout([w for _, ws in resources for w in ws], self.size))
        return Scenario(scenario_id, persona.role,
                        tuple(Resource(cap, tuple(next(placed) for _ in ws)) for cap, ws in resources),
                        rng.randrange(2 ** 31))
