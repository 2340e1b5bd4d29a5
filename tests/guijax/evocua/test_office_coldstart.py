"""EvoCUA's cold start on the desktop's office apps: references replayed with the screen recorded, thoughts
from the references' notes or a VLM, the traces in the policy's grammar, and the coldstart stage taking them
from `coldstart.traces_dir`. One test replays a synthesized task on the real Xvfb desktop."""
from __future__ import annotations

import json
import random

import numpy as np
import pytest

from envs.actions.computer_use import parse_computer_use, split_response
from envs.actions.grammar import RELATIVE
from envs.actions.model import ActionType
from envs.api import Observation, StepResult
from envs.desktop.checks import desktop_missing
from envs.osworld.loader import load_osworld
from fake_chat import fake_chat_server
from guijax.evocua.hindsight import ChatHindsight, check_thought
from guijax.evocua.office_architect import OfficeArchitect
from guijax.evocua.office_coldstart import (NoteHindsight, keyboard_semantic, main, record_coldstart, save,
                                            write_thoughts, record_reference)
from guijax.evocua.office_resources import OfficeScenarioSampler
from guijax.evocua.office_synthesis import write_task

SCREEN = (36, 64)


class ScriptedDesktop:
    """Each action changes the screen (its fill is the number of actions taken); the validator answers `score`."""

    def __init__(self, score: float = 1.0):
        self.score, self.actions = score, []

    def _obs(self) -> Observation:
        return Observation(np.full((*SCREEN, 3), len(self.actions), np.uint8), "")

    def reset(self, task):
        self.actions = []
        return self._obs()

    def step(self, action):
        self.actions.append(action)
        return StepResult(self._obs(), False)

    def evaluate(self) -> float:
        return self.score


def _tasks(tmp_path, capabilities=("text_append_line", "sheet_append_row")):
    for i, capability in enumerate(capabilities):
        sc = OfficeScenarioSampler((capability,)).sample(random.Random(i), f"s{i}")
        write_task(tmp_path / "tasks", sc, OfficeArchitect().propose(sc, []), f"task-{capability}")
    return load_osworld(tmp_path / "tasks")


def test_a_replayed_reference_becomes_a_trace_whose_every_step_explains_its_action(tmp_path):
    tasks = _tasks(tmp_path)
    record = record_coldstart(ScriptedDesktop(), tasks, NoteHindsight())
    assert record.dropped == {} and record.skipped_steps == [] and len(record.trajectories) == 2
    for task, trace in zip(tasks, record.trajectories):
        solution = task.task.extra["solution"]
        assert len(trace.steps) == len(solution) + 1 and trace.success and trace.meta["recorded_on"] == "desktop"
        # the screen before each action, then the final screen for terminate(success)
        assert [int(s.screenshot[0, 0, 0]) for s in trace.steps] == list(range(len(solution) + 1))
        for step, note in zip(trace.steps, solution):
            thought, semantic = split_response(step.response)
            assert check_thought(thought) == thought and note["why"] in thought
            (action,) = parse_computer_use(step.response, image_hw=RELATIVE, screen_hw=SCREEN)
            assert action.kind.value == note["kind"]
            assert keyboard_semantic(action) == semantic
        first = split_response(trace.steps[0].response)[0]
        assert first.startswith("The task: ") and "I'm " not in first  # the goal without the persona
        (done,) = parse_computer_use(trace.steps[-1].response, image_hw=RELATIVE, screen_hw=SCREEN)
        assert done.kind == ActionType.FINISHED and "complete" in split_response(trace.steps[-1].response)[0]


def test_references_the_desktop_does_not_confirm_are_dropped_with_the_reason(tmp_path):
    tasks = _tasks(tmp_path, ("text_append_line",))
    record = record_coldstart(ScriptedDesktop(score=0.0), tasks, NoteHindsight())
    assert record.trajectories == [] and "scores the reference's end state 0.0, not 1" in record.dropped[tasks[0].id]
    del tasks[0].task.extra["solution"]
    record = record_coldstart(ScriptedDesktop(), tasks, NoteHindsight())
    assert "key 'solution' must be a non-empty list" in record.dropped[tasks[0].id]


def test_a_step_without_a_note_is_kept_without_loss(tmp_path):
    (task,) = _tasks(tmp_path, ("text_append_line",))
    del task.task.extra["solution"][1]["why"]
    record = record_coldstart(ScriptedDesktop(), [task], NoteHindsight())
    (trace,) = record.trajectories
    assert trace.meta["coldstart_skipped"] == [1] and "step 1: the reference gave no 'why'" in record.skipped_steps[0]
    assert split_response(trace.steps[1].response)[0] == "" and "<tool_call>" in trace.steps[1].response


def test_a_vlm_writes_the_thoughts_from_the_recorded_screens(tmp_path):
    from guijax.chat import ChatClient

    (task,) = _tasks(tmp_path, ("text_append_line",))
    recorded = record_reference(ScriptedDesktop(), task)
    with fake_chat_server([(200, "I see the editor at (10, 20)."), (200, "The editor shows the list, so I act.")]) as (url, req):
        thoughts = write_thoughts(recorded, ChatHindsight(ChatClient(url, "vlm", api_key_env=""), retries=1))
    assert [t.text for t in thoughts] == ["The editor shows the list, so I act."] * (len(recorded.steps) + 1)
    assert len(req) == len(recorded.steps) + 2  # the first answer named coordinates and was asked again
    assert "Wait for the application." in req[1]["body"]["messages"][0]["content"][0]["text"]  # step 0, asked again
    assert "Press Ctrl+End." in req[2]["body"]["messages"][0]["content"][0]["text"]


def test_the_coldstart_stage_takes_recorded_traces_in_the_policys_grammar(tmp_path, tiny_config):
    from guijax.data.store import TrajectoryStore
    from guijax.pipeline import coldstart_stages as cs
    from guijax.pipeline.run import Run

    record = record_coldstart(ScriptedDesktop(), _tasks(tmp_path), NoteHindsight())
    summary = save(record, tmp_path / "recorded", grammar="computer_use")
    assert summary["traces"] == 2 and summary["grammar"] == "computer_use"
    assert "2 episode(s), 2 solved" in (tmp_path / "recorded" / "coldstart.html").read_text()  # the inspector page
    config = tiny_config("grpo_cpu", "rollout.prompt=computer_use_compact",
                         f"coldstart.traces_dir={tmp_path / 'recorded'}")
    config.env.kind = "osworld"  # recorded traces need no desk
    run = Run(config, tmp_path / "run")
    headline = cs.coldstart.fn(run)
    taken = list(TrajectoryStore(tmp_path / "run" / "coldstart_trajectories"))
    assert [t.task_id for t in taken] == [t.task_id for t in record.trajectories] and "2 recorded traces" in headline
    assert json.loads((tmp_path / "run" / "coldstart.json").read_text())["trained_steps"] == sum(
        len(t.steps) for t in taken)
    config.rollout.prompt = "compact"  # UI-TARS text: the computer_use traces would teach the wrong grammar
    with pytest.raises(ValueError, match="written in the 'computer_use' grammar, but rollout.prompt='compact'"):
        cs.coldstart.fn(run)
    config.coldstart.traces_dir = str(tmp_path / "nothing")
    with pytest.raises(FileNotFoundError, match="holds no trajectories"):
        cs.coldstart.fn(run)


def test_recorded_traces_of_tasks_held_out_for_evaluation_are_not_trained_on(tmp_path, tiny_config):
    from guijax.data.store import TrajectoryStore
    from guijax.pipeline import coldstart_stages as cs
    from guijax.pipeline.run import Run

    record = record_coldstart(ScriptedDesktop(), _tasks(tmp_path), NoteHindsight())
    save(record, tmp_path / "recorded", grammar="computer_use")
    kept, held = [t.task_id for t in record.trajectories]
    config = tiny_config("grpo_cpu", "rollout.prompt=computer_use_compact",
                         f"coldstart.traces_dir={tmp_path / 'recorded'}")
    config.env.kind = "osworld"
    run = Run(config, tmp_path / "run")
    run.workdir.mkdir(parents=True, exist_ok=True)
    (tmp_path / "run" / "splits.json").write_text(json.dumps({"train": [kept, "other"], "held_out": [held]}))
    headline = cs.coldstart.fn(run)
    assert [t.task_id for t in TrajectoryStore(tmp_path / "run" / "coldstart_trajectories")] == [kept]
    assert json.loads((tmp_path / "run" / "coldstart.json").read_text())["withheld_tasks"] == [held]
    assert "1 recorded traces" in headline and "the traces of 1 held-out task(s) left out" in headline
    (tmp_path / "run" / "splits.json").write_text(json.dumps({"train": ["other"], "held_out": [kept, held]}))
    with pytest.raises(ValueError, match="every trace is of a task the run holds out"):
        cs.coldstart.fn(run)


def test_the_command_refuses_tasks_without_references(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("envs.desktop.checks.desktop_missing", lambda apps=False: None)
    (task,) = _tasks(tmp_path, ("text_append_line",))
    data = json.loads(open(task.task.source).read())
    del data["solution"]
    open(task.task.source, "w").write(json.dumps(data))
    assert main(["--tasks", str(tmp_path / "tasks"), "--out", str(tmp_path / "out")]) == 2
    assert "none of the 1 tasks" in capsys.readouterr().err


MISSING = desktop_missing(apps=True)


@pytest.mark.desktop
@pytest.mark.skipif(MISSING is not None, reason=str(MISSING))
def test_a_synthesized_task_is_recorded_on_the_real_desktop(tmp_path):
    from guijax.data.store import TrajectoryStore

    _tasks(tmp_path, ("text_append_line",))
    assert main(["--tasks", str(tmp_path / "tasks"), "--out", str(tmp_path / "out"), "--screen", "640x360"]) == 0
    summary = json.loads((tmp_path / "out" / "coldstart.json").read_text())
    assert summary["traces"] == 1 and summary["dropped_tasks"] == {} and summary["skipped_steps"] == []
    (trace,) = TrajectoryStore(tmp_path / "out" / "coldstart_trajectories")
    assert trace.steps[0].screenshot.shape == (360, 640, 3) and (tmp_path / "out" / "coldstart.html").exists()
    assert not np.array_equal(trace.steps[1].screenshot, trace.steps[-1].screenshot)  # the typing shows
