"""The World State Model's captions off the desk from a vision model: an initial screen's elements and captions
read strictly, a step's change description from the screens before and after it, unreadable answers asked
again, and a phase's captions bounded and counted."""
from __future__ import annotations

import json

import numpy as np
import pytest

from fake_chat import decoded_image, fake_chat_server
from guijax.chat import ChatClient, UnreadableAnswer
from guijax.rollout.trajectory import Step, Trajectory
from guijax.seagent.chat_captions import (ChatStateCaptioner, episode_captions, parse_change,
                                          parse_screen_captions)

SCREEN = {"elements": ["File", "Save", "File"], "captions": ["A menu bar with File and Save."]}


def _screen(fill: int) -> np.ndarray:
    return np.full((24, 32, 3), fill, np.uint8)


def test_an_initial_screens_captions_are_read_strictly():
    read = parse_screen_captions("```json\n" + json.dumps(SCREEN) + "\n```")
    assert read.elements == ("File", "Save") and read.captions == ("A menu bar with File and Save.",)
    for answer, message in [("[1, 2]", "not a JSON object"),
                            (json.dumps({"captions": ["x"]}), "'elements' must be a non-empty list"),
                            (json.dumps({"elements": ["File"], "captions": []}), "'captions' must be a non-empty"),
                            (json.dumps({"elements": ["File", " "], "captions": ["x"]}), "not a non-empty string")]:
        with pytest.raises(ValueError, match=message):
            parse_screen_captions(answer)
    assert parse_change("  A dialog\n opened.  ") == "A dialog opened."
    with pytest.raises(ValueError, match="empty"):
        parse_change(" \n ")


def test_the_captioner_sends_the_screens_and_asks_again_after_an_unreadable_answer():
    with fake_chat_server([(200, "a menu bar"), (200, json.dumps(SCREEN))]) as (url, requests):
        shown = ChatStateCaptioner(ChatClient(url, "wsm", api_key_env=""), retries=1).screen(_screen(7))
    assert shown.elements == ("File", "Save") and len(requests) == 2
    (image, text) = requests[1]["body"]["messages"][0]["content"]
    assert decoded_image(image["image_url"]["url"])[0, 0, 0] == 7 and '"elements"' in text["text"]
    with fake_chat_server([(200, ""), (200, "The Save dialog opened.")]) as (url, requests):
        said = ChatStateCaptioner(ChatClient(url, "wsm", api_key_env=""), retries=1).change(
            _screen(1), _screen(2), "pyautogui.hotkey('ctrl', 's')")
    assert said == "The Save dialog opened." and len(requests) == 2
    before, after, text = requests[0]["body"]["messages"][0]["content"]
    assert [decoded_image(p["image_url"]["url"])[0, 0, 0] for p in (before, after)] == [1, 2]
    assert "The action: pyautogui.hotkey('ctrl', 's')" in text["text"]
    with fake_chat_server([(200, "{}")]) as (url, _):
        with pytest.raises(UnreadableAnswer, match="no readable captions of the initial screen after 2 answers"):
            ChatStateCaptioner(ChatClient(url, "wsm", api_key_env=""), retries=1).screen(_screen(0))


class ScriptedCaptioner:
    """Describes a step by the fills of its two screens; unreadable for the screens in `unreadable`."""

    def __init__(self, unreadable=()):
        self.unreadable, self.asked = set(unreadable), []

    def change(self, before, after, action):
        self.asked.append((int(before[0, 0, 0]), int(after[0, 0, 0]), action))
        if int(before[0, 0, 0]) in self.unreadable:
            raise UnreadableAnswer("no readable change description")
        return f"{before[0, 0, 0]} became {after[0, 0, 0]}"


def _episode(*fills: int) -> Trajectory:
    return Trajectory("t", "do", [Step.text(_screen(f), "Action: wait()", ["WAIT"] if f % 2 else []) for f in fills])


def test_a_phase_describes_every_episodes_end_first_within_its_budget():
    captioner = ScriptedCaptioner(unreadable={2})
    episodes = [_episode(1, 2, 3), _episode(5, 6), _episode(8, 9)]
    out = episode_captions(captioner, episodes, budget=4)
    assert [a[:2] for a in captioner.asked] == [(2, 3), (5, 6), (8, 9), (1, 2)]  # last steps first, then back
    assert out.captions == [["Step 1: 1 became 2"], ["Step 1: 5 became 6"], ["Step 1: 8 became 9"]]
    assert out.requests == 4 and out.unreadable == 1  # 2 -> 3 unreadable, left out
    assert captioner.asked[0][2].startswith("none (the agent's answer") and captioner.asked[3][2] == "WAIT"
    short = episode_captions(ScriptedCaptioner(), episodes, budget=2)
    assert short.captions == [["Step 2: 2 became 3"], ["Step 1: 5 became 6"], []] and short.requests == 2


class FakePool:
    """Resets return a screen filled with the task's number; the tasks in `failing` fail `failures` times."""

    def __init__(self, num_workers: int, failing=(), failures: int = 1):
        self.num_workers, self.resets = num_workers, []
        self.left = {task_id: failures for task_id in failing}

    def reset(self, tasks, slots, seeds=None):
        from envs.api import Observation
        from envs.pool import Result

        self.resets.append([t.id for t in tasks])
        out = {}
        for slot, task in zip(slots, tasks):
            if self.left.get(task.id, 0) > 0:
                self.left[task.id] -= 1
                out[slot] = Result(False, error="setup step 1 (open) failed")
            else:
                out[slot] = Result(True, Observation(_screen(int(task.id[1:])), task.instruction))
        return out


def test_off_the_desk_each_training_screen_is_set_up_captioned_and_kept(tmp_path, caplog):
    """The scenes off the desk: resets in rounds of the pool's size with the engine's retries, one caption
    request per screen, kept in scenes.json for the same setup and model, asked again when either changes;
    a screen that cannot be set up or captioned is left out with a warning, and none left is an error."""
    import dataclasses
    import types

    from envs.api import Task
    from guijax import launch
    from guijax.methods import get_method
    from guijax.rollout.engine import RolloutConfig, RolloutEngine

    tasks = [Task(f"t{i}", f"do {i}", config=({"type": "open", "parameters": {"path": f"~/{i}.txt"}},))
             for i in range(3)]
    tasks.append(dataclasses.replace(tasks[0], id="t9"))  # the same setup as t0: one screen
    answers = {1: '"elements": ["One"]', 2: '"elements": ["Two"]', 3: '"elements": ["Three"]'}

    def wsm(body):
        (image, _) = body["messages"][0]["content"]
        n = int(decoded_image(image["image_url"]["url"])[0, 0, 0])
        return 200, "{" + answers.get(n, '"elements": []') + f', "captions": ["screen {n}"]}}'

    with fake_chat_server(wsm) as (url, requests):
        config = launch.resolve("seagent_cpu", ["seagent.judge=chat", f"seagent.chat_url={url}",
                                                "seagent.chat_model=wsm", "seagent.chat_api_key_env="])
        method = get_method("seagent", config)
        ctx = types.SimpleNamespace(workdir=tmp_path)
        engine = RolloutEngine(FakePool(2, failing={"t1"}), None, None, RolloutConfig(reset_retries=1))
        scenes = method._captioned_scenes(ctx, engine, tasks[:3])
        assert [(t.id, names, captions) for t, names, captions in scenes] == [
            ("t1", ["One"], ["screen 1"]), ("t2", ["Two"], ["screen 2"])]
        assert engine.pool.resets == [["t0", "t1"], ["t1"], ["t2"]]  # rounds of 2, t1's setup retried once
        # t0's screen (fill 0) has no element: an unreadable answer, left out with a warning
        assert [t.id for t, _, _ in scenes] == ["t1", "t2"] and "t0's screen is not captioned" in caplog.text
        kept = json.loads((tmp_path / "scenes.json").read_text())
        assert kept["t1"] == {"setup": [{"type": "open", "parameters": {"path": "~/1.txt"}}], "model": "wsm",
                              "elements": ["One"], "captions": ["screen 1"]}
        asked = len(requests)
        again = method._captioned_scenes(ctx, engine, tasks[1:3])  # kept: no reset, no request
        assert [t.id for t, _, _ in again] == ["t1", "t2"] and len(requests) == asked
        moved = dataclasses.replace(tasks[2], config=({"type": "open", "parameters": {"path": "~/3.txt"}},))
        method._captioned_scenes(ctx, engine, [tasks[1], moved])  # t2's setup changed: captioned again
        assert engine.pool.resets[-1] == ["t2"] and len(requests) == asked + 1
        config.seagent.chat_model = "wsm-2"
        engine.pool = FakePool(2, failing={"t1", "t2"}, failures=2)
        with pytest.raises(RuntimeError, match="none of the 2 training screens could be set up and captioned"):
            get_method("seagent", config)._captioned_scenes(ctx, engine, [tasks[1], moved])
        assert "t1's setup failed" in caplog.text
