"""The World State Model's captions where no ground truth writes them (OSWorld servers, the Xvfb desktop), from
an OpenAI-compatible vision model: the dense captioning of a software's initial screen that the curriculum
generator starts from (Alg. 1 line 3, CaptionGUI(S_0): "button detection and OCR-based recognition"), and the
state-change description of one action (App. A.1's second mode: the screens before and after it), which the
generator reads as the agent's feedback each phase.

The paper prints neither prompt; the two here are ours. The screen's answer is a JSON object whose `elements`
(the names written on its controls) also place the generator's instructions on the screen they name, as the
desk's accessibility tree does (guijax.seagent.chat_curriculum.place_on_scenes).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from guijax.chat import ChatClient, UnreadableAnswer, ask_parsed, image_part, json_reply

SCREEN_PROMPT = """This is the initial screen of a software application that a computer-use agent will learn to use by exploring it. Caption the GUI densely: every menu, toolbar button, tab, panel, field, list and other control you can see, with the text written on it, and what the main area shows.
Answer with one JSON object and nothing else:
{"elements": ["<the name or visible text of each control, as written on the screen>", ...], "captions": ["<one sentence per region or control: what it is, where it is and what it shows>", ...]}"""

CHANGE_PROMPT = """The first screenshot was taken just before one action of a computer-use agent and the second just after it. The action: {action}
Describe what the action changed on the screen: windows, menus, dialogs or panels that opened or closed, text that appeared, changed or was selected, controls whose state changed. If nothing changed, answer "The screen did not change."
Answer with the description only, in one or two sentences."""

MAX_SIDE = 1280  # screenshots are sent at most this wide or tall
MAX_CAPTION_CHARS = 600  # a change description longer than this is cut (the generator reads up to 100 of them)


@dataclasses.dataclass(frozen=True)
class ScreenCaptions:
    elements: tuple[str, ...]  # names written on the screen's controls
    captions: tuple[str, ...]  # C_0: one sentence per region or control


def parse_screen_captions(text: str) -> ScreenCaptions:
    """SCREEN_PROMPT's answer, strictly: a JSON object with a non-empty `elements` list and a `captions` list,
    both of non-empty strings (ValueError naming what is wrong otherwise)."""
    value = json_reply(text)
    if not isinstance(value, dict):
        raise ValueError(f"the answer is not a JSON object: {text[:200]!r}")
    out = {}
    for key in ("elements", "captions"):
        items = value.get(key)
        if not isinstance(items, list) or not items:
            raise ValueError(f"the answer's {key!r} must be a non-empty list, got {items!r}"[:300])
        bad = [x for x in items if not isinstance(x, str) or not x.strip()]
        if bad:
            raise ValueError(f"the answer's {key!r} holds {bad[0]!r}, not a non-empty string"[:300])
        out[key] = tuple(dict.fromkeys(x.strip() for x in items))
    return ScreenCaptions(out["elements"], out["captions"])


def parse_change(text: str) -> str:
    """CHANGE_PROMPT's answer: its text, one line, at most MAX_CAPTION_CHARS (ValueError when empty)."""
    line = " ".join(text.split())
    if not line:
        raise ValueError("the answer is empty")
    return line[:MAX_CAPTION_CHARS]


class ChatStateCaptioner:
    """Both captioning modes through an OpenAI-compatible vision model; `retries` more requests on an unreadable
    answer, then guijax.chat.UnreadableAnswer."""

    def __init__(self, client: ChatClient, retries: int = 2):
        self.client, self.retries = client, retries

    def screen(self, screenshot: np.ndarray, what: str = "the initial screen") -> ScreenCaptions:
        messages = [{"role": "user", "content": [image_part(screenshot, MAX_SIDE), {"type": "text", "text": SCREEN_PROMPT}]}]
        return ask_parsed(self.client, messages, parse_screen_captions, self.retries, f"captions of {what}")

    def change(self, before: np.ndarray, after: np.ndarray, action: str) -> str:
        prompt = CHANGE_PROMPT.format(action=action)
        messages = [{"role": "user", "content": [image_part(before, MAX_SIDE), image_part(after, MAX_SIDE), {"type": "text", "text": prompt}]}]
        return ask_parsed(self.client, messages, parse_change, self.retries, "change description")


@dataclasses.dataclass
class EpisodeCaptions:
    captions: list[list[str]]  # per episode, "Step k: ..." for each step whose screens were described
    unreadable: int = 0  # steps the model gave no readable description of (left without a caption)
    requests: int = 0  # steps asked about


def action_text(step: Any) -> str:
    """The step's actions as they ran (pyautogui code), for the change prompt; a step whose answer did not
    parse ran nothing."""
    return "; ".join(step.actions) if step.actions else "none (the agent's answer could not be read)"


def episode_captions(captioner: ChatStateCaptioner, trajectories: Sequence[Any], budget: int) -> EpisodeCaptions:
    """The change descriptions of the episodes' steps, at most `budget` requests (the generator reads a bounded
    number, App. G), spread over the episodes: each episode's last step that has a screen after it (the next
    step's; a trajectory keeps none after its last action) first, then the one before, round by round, so
    every episode's end is described before any episode's start. A step the model cannot describe is counted
    and left out; each episode's captions come in step order."""
    longest = max((len(t.steps) - 1 for t in trajectories), default=0)
    order = [(i, len(t.steps) - 2 - back) for back in range(longest) for i, t in enumerate(trajectories)
             if len(t.steps) - 2 - back >= 0][:budget]  # (episode, step) pairs, every episode's end first
    found: list[dict[int, str]] = [{} for _ in trajectories]
    unreadable = 0
    for i, k in order:
        steps = trajectories[i].steps
        try:
            found[i][k] = captioner.change(steps[k].screenshot, steps[k + 1].screenshot, action_text(steps[k]))
        except UnreadableAnswer:  # a down endpoint still stops the phase, as it stops the judge
            unreadable += 1
    return EpisodeCaptions([[f"Step {k + 1}: {text}" for k, text in sorted(d.items())] for d in found],
                           unreadable, len(order))
