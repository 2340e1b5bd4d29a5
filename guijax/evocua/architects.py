"""Task architects for EvoCUA's dual-stream synthesis (evocua.txt §3.2): given a scenario they write the
instruction, the validator and the reference solution together.

- `ProceduralArchitect`: offline, composed from the desk's own parts. It reads the scenario's widgets, picks
  a goal each capability can reach from the initial state, and writes the three streams from it; two
  capabilities in one scenario become one instruction over both windows.
- `ChatTaskArchitect`: an OpenAI-compatible model (the paper uses a foundation VLM). Its answer must be one
  JSON object checked strictly by `parse_proposal`; a malformed answer is asked again, with the error, up to
  `retries` times, then the scenario is skipped with the reason. The sandbox's errors of earlier attempts are
  replayed to it as the conversation so far.
"""
from __future__ import annotations

import dataclasses
import json
import random
import re
from typing import Any, Callable, Sequence

from guijax.chat import ChatClient, ChatError, json_reply
from guijax.evocua.synthesis import ArchitectSkipped, Attempt, Proposal, ProposalError, parse_proposal
from guijax.evocua.task_space import MISSING_SETTINGS, PERSONA_BY_ROLE, Persona, Resource, Scenario

Part = tuple[str, dict[str, Any], list[dict[str, Any]]]  # (sentence, {window: expected}, subgoals)


def _widgets(window: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    return [w for w in window["widgets"] if w["kind"] == kind]


def _expect(title: str, **widgets: dict[str, Any]) -> dict[str, Any]:
    return {title: {"widgets": widgets}}


def _click(rng, res: Resource, persona: Persona) -> Part:
    (win,) = res.windows
    target = rng.choice(_widgets(win, "button"))["name"]
    return (f'click the "{target}" button', _expect(win["title"], **{target: {"clicks_at_least": 1}}),
            [{"op": "click", "window": win["title"], "target": target}])


def _toggle(rng, res, persona) -> Part:
    (win,) = res.windows
    box = rng.choice(_widgets(win, "checkbox"))
    want = not box.get("checked", False)
    return (f'turn {"on" if want else "off"} "{box["name"]}"', _expect(win["title"], **{box["name"]: {"checked": want}}),
            [{"op": "check", "window": win["title"], "target": box["name"], "value": want}])


def _type(rng, res, persona) -> Part:
    (win,) = res.windows
    field = rng.choice(_widgets(win, "field"))
    word = rng.choice([w for w in persona.words if w != field.get("text", "")])
    return (f'type "{word}" into the {field["name"]} field', _expect(win["title"], **{field["name"]: {"text": word}}),
            [{"op": "type", "window": win["title"], "target": field["name"], "text": word}])


def _choose(rng, res, persona) -> Part:
    (win,) = res.windows
    dd = rng.choice(_widgets(win, "dropdown"))
    option = rng.choice([o for o in dd["options"] if o != dd.get("value")])
    return (f"set {dd['name']} to {option}", _expect(win["title"], **{dd["name"]: {"value": option}}),
            [{"op": "select", "window": win["title"], "target": dd["name"], "option": option}])


def _slider(rng, res, persona) -> Part:
    (win,) = res.windows
    sl = rng.choice(_widgets(win, "slider"))
    value = rng.choice([v for v in range(10, 100, 10) if abs(v - (sl.get("value") or 0)) > 10])
    return (f"set {sl['name']} to {value}%", _expect(win["title"], **{sl["name"]: {"value": value}}),
            [{"op": "slider", "window": win["title"], "target": sl["name"], "value": value}])


def _list(rng, res, persona) -> Part:
    (win,) = res.windows
    lst = rng.choice(_widgets(win, "list"))
    item = rng.choice(lst["options"][4:] or lst["options"])  # below the visible rows when there are any
    return (f'select "{item}" in the {lst["name"]} list', _expect(win["title"], **{lst["name"]: {"value": item}}),
            [{"op": "list_select", "window": win["title"], "target": lst["name"], "item": item}])


def _form(rng, res, persona) -> Part:
    (win,) = res.windows
    title = win["title"]
    fields = _widgets(win, "field")
    words = rng.sample(persona.words, len(fields))
    dd = _widgets(win, "dropdown")[0]
    option = rng.choice([o for o in dd["options"] if o != dd.get("value")])
    box = _widgets(win, "checkbox")[0]
    submit = _widgets(win, "button")[-1]["name"]
    parts = [f'{f["name"]} "{w}"' for f, w in zip(fields, words)]
    expected = {f["name"]: {"text": w} for f, w in zip(fields, words)}
    expected.update({dd["name"]: {"value": option}, box["name"]: {"checked": True}, submit: {"clicks_at_least": 1}})
    steps = [{"op": "type", "window": title, "target": f["name"], "text": w} for f, w in zip(fields, words)]
    steps += [{"op": "select", "window": title, "target": dd["name"], "option": option},
              {"op": "check", "window": title, "target": box["name"], "value": True},
              {"op": "click", "window": title, "target": submit}]
    return (f'fill in the form: {", ".join(parts)}, {dd["name"]} {option}, turn on "{box["name"]}", then click {submit}',
            {title: {"widgets": expected}}, steps)


def _confirm(rng, res, persona) -> Part:
    (win,) = res.windows
    target = rng.choice([b for b in _widgets(win, "button") if b.get("confirm")])["name"]
    return (f'click "{target}" and confirm it', _expect(win["title"], **{target: {"clicks_at_least": 1}}),
            [{"op": "click", "window": win["title"], "target": target}, {"op": "confirm"}])


def _copy(rng, res, persona) -> Part:
    target, source = res.windows
    field = _widgets(target, "field")[0]["name"]
    button = _widgets(target, "button")[0]["name"]
    code = next(m.group(1) for lab in _widgets(source, "label")
                for m in [re.fullmatch(rf"{re.escape(field)} number: (\d+)", lab.get("text", ""))] if m)
    return (f'copy the {field.lower()} number from the {source["title"]} window into the {field} field of the '
            f'{target["title"]} window, then click {button}',
            _expect(target["title"], **{field: {"text": code}, button: {"clicks_at_least": 1}}),
            [{"op": "focus_window", "target": target["title"]},
             {"op": "type", "window": target["title"], "target": field, "text": code},
             {"op": "click", "window": target["title"], "target": button}])


def _save_note(rng, res, persona) -> Part:
    (win,) = res.windows
    field = _widgets(win, "field")[0]
    word = rng.choice([w for w in persona.words if w != field.get("text", "")])
    return (f'write "{word}" in the {field["name"]} field and save with Ctrl+S',
            {win["title"]: {"saved": True, "widgets": {field["name"]: {"text": word}}}},
            [{"op": "focus_window", "target": win["title"]},
             {"op": "type", "window": win["title"], "target": field["name"], "text": word},
             {"op": "hotkey", "keys": ["ctrl", "s"]}])


COMPOSERS = {"click": _click, "toggle": _toggle, "type": _type, "choose": _choose, "slider": _slider, "list": _list,
             "form": _form, "confirm": _confirm, "copy": _copy, "save_note": _save_note}


class ProceduralArchitect:
    """Writes the three streams from the scenario's own widgets; a retry after a sandbox error draws again."""

    name = "procedural"

    def propose(self, scenario: Scenario, history: Sequence[Attempt]) -> Proposal:
        rng = random.Random(f"{scenario.seed}/{len(history)}")
        persona = PERSONA_BY_ROLE[scenario.persona]
        lead = f"I'm {scenario.persona}."
        if scenario.capabilities == ("infeasible",):
            (win,) = scenario.resources[0].windows
            present = {w["name"] for w in win["widgets"]}
            missing = rng.choice([m for m in MISSING_SETTINGS if m not in present])
            return Proposal(f'{lead} In the {win["title"]} window, turn on "{missing}".', {"func": "infeasible"},
                            [{"op": "fail"}])
        sentences, expected, steps = [], {}, []
        for res in scenario.resources:
            text, want, subgoals = COMPOSERS[res.capability](rng, res, persona)
            where = res.windows[0]["title"] if res.capability != "copy" else None
            sentences.append(f"in the {where} window, {text}" if where else text)
            expected.update(want)
            if len(scenario.windows) > 1 and subgoals[0]["op"] != "focus_window":
                subgoals = [{"op": "focus_window", "target": where}] + subgoals
            steps += subgoals
        body = "; then ".join(sentences)
        return Proposal(f"{lead} {body[0].upper()}{body[1:]}.", {"func": "desk_state", "expected": expected,
                                                                  "options": {"slider_tolerance": 3}},
                        steps + [{"op": "done"}])


# The paper prints no task-architect prompt (§3.2 describes the workflow only); this one is written for the desk.
SYSTEM_PROMPT = """You are a task architect for a synthetic desktop used to train computer-use agents. Given a user persona, the atomic capabilities to exercise, and the exact initial scene (windows and their widgets), write ONE task grounded in that scene, together with its executable validator and a reference solution.

Answer with one JSON object and nothing else, with exactly these keys:
{
  "instruction": string,   // what the persona asks, clear and achievable in this scene
  "evaluator": {"func": "desk_state", "expected": {WINDOW: {"widgets": {WIDGET: {PROPERTY: VALUE}}, "saved": true}}, "options": {"slider_tolerance": 3}}
               or {"func": "infeasible"} when the request cannot be done in this scene,
  "expert": [SUBGOAL, ...] // the reference solution, ending with {"op": "done"} (or {"op": "fail"} when infeasible)
}
Widget properties: "clicks_at_least" (buttons), "checked" (checkboxes), "text" (fields), "value" (dropdowns, lists, sliders 0-100). "saved": true means Ctrl+S was pressed while that window was in front. Name only windows and widgets of the scene.
Subgoals: {"op": "click", "window", "target"}, {"op": "check", "window", "target", "value": bool}, {"op": "type", "window", "target", "text"}, {"op": "select", "window", "target", "option"}, {"op": "slider", "window", "target", "value": int}, {"op": "list_select", "window", "target", "item"}, {"op": "focus_window", "target"}, {"op": "confirm"} (OK in a confirmation dialog), {"op": "hotkey", "keys": [...]}, {"op": "done"}, {"op": "fail"}.
The validator must reject the initial scene and accept the state the reference solution reaches. Both are executed in a sandbox; if either check fails you will get the error and must answer again with a corrected JSON object."""

USER_PROMPT = """Persona: {persona}
Capabilities: {capabilities}
Initial scene (back to front; the last window is in front):
{scene}"""

FEEDBACK_PROMPT = """The sandbox rejected this task ({check} check): {error}
Answer again with one corrected JSON object."""

FORMAT_PROMPT = """That answer is not a valid task: {error}
Answer again with one JSON object with exactly the keys instruction, evaluator, expert."""


def scene_text(scenario: Scenario) -> str:
    """The scene as the architect reads it: window titles and widget specs, without layout rectangles."""
    return json.dumps([{"title": w["title"], "widgets": w["widgets"]} for w in scenario.windows], indent=1)


class ChatTaskArchitect:
    """A model behind an OpenAI-compatible endpoint writes the three streams."""

    name = "chat"

    def __init__(self, client: ChatClient, retries: int = 2):
        self.client, self.retries = client, retries

    def messages(self, scenario: Scenario, history: Sequence[Attempt]) -> list[dict[str, str]]:
        """The conversation so far: the scenario, then each earlier proposal and the sandbox's verdict on it."""
        return conversation(SYSTEM_PROMPT, USER_PROMPT.format(persona=scenario.persona,
                                                              capabilities=", ".join(scenario.capabilities),
                                                              scene=scene_text(scenario)), history, FEEDBACK_PROMPT)

    def propose(self, scenario: Scenario, history: Sequence[Attempt]) -> Proposal:
        return ask_for_proposal(self.client, self.messages(scenario, history),
                                lambda data, where, answer: parse_proposal(data, where, raw=answer), self.retries,
                                scenario.id, FORMAT_PROMPT)


def conversation(system: str, user: str, history: Sequence[Attempt], feedback: str) -> list[dict[str, str]]:
    """A chat architect's request: the scenario, then each earlier proposal (its own words) and the sandbox's
    verdict on it (`feedback` with {check} and {error})."""
    out = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    for a in history:
        if a.proposal is None:  # a malformed answer already retried within its own request
            continue
        out += [{"role": "assistant", "content": a.raw or json.dumps(a.proposal)},
                {"role": "user", "content": feedback.format(check=a.check, error=a.error)}]
    return out


def ask_for_proposal(client: ChatClient, messages: list[dict[str, str]], parse: Callable[[Any, str, str], Any],
                     retries: int, scenario_id: str, format_prompt: str) -> Any:
    """The first answer `parse(data, where, answer)` accepts, with the malformed ones before it as its
    `format_errors`; each malformed answer is asked again with its error (`format_prompt` with {error}). An
    unreachable endpoint, or no well-formed answer in `retries` + 1, skips the scenario with every reason."""
    problems: list[str] = []
    for _ in range(retries + 1):
        try:
            answer = client.complete(messages)
        except ChatError as e:
            raise ArchitectSkipped(f"scenario {scenario_id}: task architect unreachable: {e}", problems) from None
        where = f"scenario {scenario_id}, answer {len(problems) + 1}"
        try:
            data = json_reply(answer)
        except ValueError as e:
            problems.append(f"{where}: not valid JSON ({e}): {answer[:120]!r}")
        else:
            try:
                return dataclasses.replace(parse(data, where, answer), format_errors=tuple(problems))
            except ProposalError as e:
                problems.append(str(e))
        messages = messages + [{"role": "assistant", "content": answer},
                               {"role": "user", "content": format_prompt.format(error=problems[-1])}]
    raise ArchitectSkipped(f"scenario {scenario_id}: no well-formed task after {retries + 1} answers; "
                           f"last: {problems[-1]}", problems)
