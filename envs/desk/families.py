"""Task families of graded difficulty for the synthetic desk, each producing an OSWorld-shaped task:
the scene (setup step `desk_scene`), the instruction, the executable validator (`desk_state`), and the
expert's subgoals (`extra["expert"]`), from which the scripted expert writes its plan and actions.

Steps below are those of a noise-free expert without pop-ups. Every scene carries the dynamic UI that
defeats replayed actions (BEPA): a modal pop-up (30% at reset, 5% per step) and a non-modal banner over a
random strip of the screen (20% at reset, 3% per step); DeskEnv(popups=False) turns both off.
"""
from __future__ import annotations

import random
from typing import Any, Callable

BUTTONS = ("Submit", "Apply", "Export", "Refresh", "Print", "Archive", "Sync", "Share")
CHECKS = ("Dark mode", "Notifications", "Auto save", "Spell check", "Wi-Fi", "Bluetooth", "Location")
FIELDS = ("Username", "Email", "City", "Project", "Title", "Tag", "Owner")
DROPDOWNS = {"Color": ("Red", "Green", "Blue", "Black"), "Size": ("Small", "Medium", "Large"),
             "Language": ("English", "French", "German", "Spanish"), "Theme": ("Light", "Dark", "Auto")}
SLIDERS = ("Volume", "Brightness", "Zoom", "Opacity")
WORDS = ("alice", "bob", "paris", "apollo", "report", "draft", "zeta", "orbit", "maple", "delta")
FILE_STEMS = ("report", "notes", "budget", "photo", "slides", "todo", "invoice", "plan")

Family = Callable[[random.Random, tuple[int, int]], dict[str, Any]]


def _window(title: str, rect, widgets) -> dict[str, Any]:
    return {"title": title, "rect": list(rect), "widgets": widgets}


def _task(instruction: str, windows, expected: dict[str, Any], expert: list[dict[str, Any]],
          popup_prob: float = 0.3, popup_step_prob: float = 0.05, func: str = "desk_state",
          banner_prob: float = 0.2, banner_step_prob: float = 0.03) -> dict[str, Any]:
    evaluator: dict[str, Any] = {"func": func}
    if func == "desk_state":
        evaluator.update(expected=expected, options={"slider_tolerance": 3})
    return {"instruction": instruction,
            "config": [{"type": "desk_scene", "parameters": {"windows": windows, "popup_prob": popup_prob,
                                                             "popup_step_prob": popup_step_prob,
                                                             "banner_prob": banner_prob,
                                                             "banner_step_prob": banner_step_prob}}],
            "evaluator": evaluator, "expert": expert}


def _full(size) -> tuple[int, int, int, int]:
    h, w = size
    return (4, 4, w - 4, h - 4)


def click_button(rng: random.Random, size) -> dict[str, Any]:
    names = rng.sample(BUTTONS, 3)
    target = names[0]
    rng.shuffle(names)
    widgets = [{"kind": "label", "name": "Info", "text": "Choose an action"}] + [{"kind": "button", "name": n} for n in names]
    return _task(f'Click the "{target}" button.', [_window("Dialog", _full(size), widgets)],
                 {"Dialog": {"widgets": {target: {"clicks_at_least": 1}}}},
                 [{"op": "click", "window": "Dialog", "target": target}, {"op": "done"}])


def toggle_checkbox(rng: random.Random, size) -> dict[str, Any]:
    names = rng.sample(CHECKS, 3)
    states = [rng.random() < 0.5 for _ in names]
    i = rng.randrange(3)
    want = not states[i]
    widgets = [{"kind": "checkbox", "name": n, "checked": s} for n, s in zip(names, states)]
    verb = "Turn on" if want else "Turn off"
    return _task(f'{verb} "{names[i]}".', [_window("Settings", _full(size), widgets)],
                 {"Settings": {"widgets": {names[i]: {"checked": want}}}},
                 [{"op": "check", "window": "Settings", "target": names[i], "value": want}, {"op": "done"}])


def type_field(rng: random.Random, size) -> dict[str, Any]:
    names = rng.sample(FIELDS, 2)
    word = rng.choice(WORDS)
    widgets = [{"kind": "field", "name": n, "text": rng.choice(("", "old"))} for n in names]
    return _task(f'Type "{word}" into the {names[0]} field.', [_window("Profile", _full(size), widgets)],
                 {"Profile": {"widgets": {names[0]: {"text": word}}}},
                 [{"op": "type", "window": "Profile", "target": names[0], "text": word}, {"op": "done"}])


def choose_option(rng: random.Random, size) -> dict[str, Any]:
    name = rng.choice(sorted(DROPDOWNS))
    options = DROPDOWNS[name]
    start, want = rng.sample(options, 2)
    widgets = [{"kind": "dropdown", "name": name, "options": list(options), "value": start},
               {"kind": "button", "name": "OK"}]
    return _task(f"Set {name} to {want}.", [_window("Preferences", _full(size), widgets)],
                 {"Preferences": {"widgets": {name: {"value": want}}}},
                 [{"op": "select", "window": "Preferences", "target": name, "option": want}, {"op": "done"}])


def set_slider(rng: random.Random, size) -> dict[str, Any]:
    name = rng.choice(SLIDERS)
    start = rng.randrange(0, 101, 10)
    want = rng.choice([v for v in range(10, 100, 10) if abs(v - start) > 10])
    widgets = [{"kind": "label", "name": "Hint", "text": f"{name} is at {start}%"},
               {"kind": "slider", "name": name, "value": start}]
    return _task(f"Set {name} to {want}%.", [_window("Display", _full(size), widgets)],
                 {"Display": {"widgets": {name: {"value": want}}}},
                 [{"op": "slider", "window": "Display", "target": name, "value": want}, {"op": "done"}])


def pick_from_list(rng: random.Random, size) -> dict[str, Any]:
    items = [f"{stem}_{i}.txt" for i, stem in enumerate(rng.sample(FILE_STEMS * 2, 12))]
    want = items[rng.randrange(4, 12)]  # below the four visible rows: needs scrolling
    widgets = [{"kind": "list", "name": "Files", "options": items}, {"kind": "button", "name": "Open"}]
    return _task(f'Select "{want}" in the Files list.', [_window("Browser", _full(size), widgets)],
                 {"Browser": {"widgets": {"Files": {"value": want}}}},
                 [{"op": "list_select", "window": "Browser", "target": "Files", "item": want}, {"op": "done"}])


def fill_form(rng: random.Random, size) -> dict[str, Any]:
    f1, f2 = rng.sample(FIELDS, 2)
    w1, w2 = rng.sample(WORDS, 2)
    check = rng.choice(CHECKS)
    dd = rng.choice(sorted(DROPDOWNS))
    opt = rng.choice(DROPDOWNS[dd][1:])
    widgets = [{"kind": "field", "name": f1}, {"kind": "field", "name": f2},
               {"kind": "dropdown", "name": dd, "options": list(DROPDOWNS[dd]), "value": DROPDOWNS[dd][0]},
               {"kind": "checkbox", "name": check, "checked": False}, {"kind": "button", "name": "Submit"}]
    return _task(f'Fill in the form: {f1} "{w1}", {f2} "{w2}", {dd} {opt}, turn on "{check}", then submit it.',
                 [_window("Form", _full(size), widgets)],
                 {"Form": {"widgets": {f1: {"text": w1}, f2: {"text": w2}, dd: {"value": opt},
                                       check: {"checked": True}, "Submit": {"clicks_at_least": 1}}}},
                 [{"op": "type", "window": "Form", "target": f1, "text": w1},
                  {"op": "type", "window": "Form", "target": f2, "text": w2},
                  {"op": "select", "window": "Form", "target": dd, "option": opt},
                  {"op": "check", "window": "Form", "target": check, "value": True},
                  {"op": "click", "window": "Form", "target": "Submit"}, {"op": "done"}])


def settings_then_note(rng: random.Random, size) -> dict[str, Any]:
    """A workflow of 8+ steps across two overlapping windows."""
    h, w = size
    field = rng.choice(FIELDS)
    word, note = rng.sample(WORDS, 2)
    dd = rng.choice(sorted(DROPDOWNS))
    opt = rng.choice(DROPDOWNS[dd][1:])
    check = rng.choice(CHECKS)
    settings = _window("Settings", (4, 4, w - 30, h - 60), [
        {"kind": "field", "name": field}, {"kind": "dropdown", "name": dd, "options": list(DROPDOWNS[dd]),
                                           "value": DROPDOWNS[dd][0]},
        {"kind": "checkbox", "name": check, "checked": False}, {"kind": "button", "name": "Apply"}])
    notes = _window("Notes", (30, h // 2, w - 4, h - 4), [{"kind": "field", "name": "Note"}])
    return _task(f'In Settings set {field} to "{word}", {dd} to {opt} and turn on "{check}", click Apply; '
                 f'then in Notes write "{note}" and save with Ctrl+S.', [settings, notes],
                 {"Settings": {"widgets": {field: {"text": word}, dd: {"value": opt}, check: {"checked": True},
                                           "Apply": {"clicks_at_least": 1}}},
                  "Notes": {"saved": True, "widgets": {"Note": {"text": note}}}},
                 [{"op": "focus_window", "target": "Settings"},
                  {"op": "type", "window": "Settings", "target": field, "text": word},
                  {"op": "select", "window": "Settings", "target": dd, "option": opt},
                  {"op": "check", "window": "Settings", "target": check, "value": True},
                  {"op": "click", "window": "Settings", "target": "Apply"},
                  {"op": "focus_window", "target": "Notes"},
                  {"op": "type", "window": "Notes", "target": "Note", "text": note},
                  {"op": "hotkey", "keys": ["ctrl", "s"]}, {"op": "done"}], popup_prob=0.2)


def infeasible_toggle(rng: random.Random, size) -> dict[str, Any]:
    present = rng.sample(CHECKS, 2)
    missing = rng.choice(["Turbo mode", "Teleport", "Time travel", "Infinite battery"])
    widgets = [{"kind": "checkbox", "name": n, "checked": False} for n in present]
    return _task(f'Turn on "{missing}".', [_window("Settings", _full(size), widgets)], {},
                 [{"op": "fail"}], func="infeasible")


def confirm_action(rng: random.Random, size) -> dict[str, Any]:
    """A button that asks for confirmation: pressing it only counts once the dialog's OK is clicked."""
    names = rng.sample(("Delete", "Archive", "Reset", "Sign out", "Empty trash"), 3)
    target = names[0]
    rng.shuffle(names)
    widgets = [{"kind": "label", "name": "Info", "text": "Account actions"}] + [
        {"kind": "button", "name": n, "confirm": f"{n}: are you sure?"} for n in names]
    return _task(f'Click "{target}" and confirm it.', [_window("Account", _full(size), widgets)],
                 {"Account": {"widgets": {target: {"clicks_at_least": 1}}}},
                 [{"op": "click", "window": "Account", "target": target}, {"op": "confirm"}, {"op": "done"}])


def copy_between_windows(rng: random.Random, size) -> dict[str, Any]:
    """Read a code shown in one window and enter it in another (the target window starts behind)."""
    h, w = size
    code = f"{rng.randrange(1000, 10000)}"
    field = rng.choice(("Order", "Code", "Ticket"))
    mail = _window("Mail", (20, 40, w - 4, h - 4), [
        {"kind": "label", "name": "Subject", "text": "Your order is on its way"},
        {"kind": "label", "name": "Body", "text": f"{field} number: {code}"}])
    shop = _window("Shop", (4, 4, w - 40, h // 2 + 20), [
        {"kind": "field", "name": field}, {"kind": "button", "name": "Track"}])
    return _task(f'Copy the {field.lower()} number from the Mail window into the {field} field of the Shop '
                 f'window, then click Track.', [shop, mail],
                 {"Shop": {"widgets": {field: {"text": code}, "Track": {"clicks_at_least": 1}}}},
                 [{"op": "focus_window", "target": "Shop"},
                  {"op": "type", "window": "Shop", "target": field, "text": code},
                  {"op": "click", "window": "Shop", "target": "Track"}, {"op": "done"}])


def infeasible_option(rng: random.Random, size) -> dict[str, Any]:
    name = rng.choice(sorted(DROPDOWNS))
    missing = rng.choice([o for o in ("Purple", "Huge", "Klingon", "Sepia") if o not in DROPDOWNS[name]])
    widgets = [{"kind": "dropdown", "name": name, "options": list(DROPDOWNS[name]), "value": DROPDOWNS[name][0]},
               {"kind": "button", "name": "OK"}]
    return _task(f"Set {name} to {missing}.", [_window("Preferences", _full(size), widgets)], {},
                 [{"op": "fail"}], func="infeasible")


FAMILIES: dict[str, tuple[int, Family]] = {  # name -> (difficulty 1..5, generator)
    "click_button": (1, click_button),
    "toggle_checkbox": (1, toggle_checkbox),
    "set_slider": (2, set_slider),
    "type_field": (2, type_field),
    "choose_option": (2, choose_option),
    "confirm_action": (2, confirm_action),
    "copy_between_windows": (3, copy_between_windows),
    "pick_from_list": (3, pick_from_list),
    "fill_form": (4, fill_form),
    "settings_then_note": (5, settings_then_note),
    "infeasible_toggle": (1, infeasible_toggle),
    "infeasible_option": (1, infeasible_option),
}
