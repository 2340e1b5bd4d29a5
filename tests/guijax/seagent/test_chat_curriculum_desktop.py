"""SEAgent's LLM curriculum on a real desktop server (env.kind='osworld'): the training task is set up on the Xvfb
desktop and its screenshot captioned by the World State Model's endpoint, the generator's instructions run from
that task's setup (its document found beside the task's own file, in every phase), and the tasks, which no
validator checks, score 0 and are judged."""
from __future__ import annotations

import json
import random

import numpy as np
import pytest

from envs.desktop.checks import desktop_missing

MISSING = desktop_missing(apps=True)


@pytest.mark.desktop
@pytest.mark.skipif(MISSING is not None, reason=str(MISSING))
def test_the_generators_tasks_run_from_a_training_tasks_setup_on_a_desktop_server(tmp_path, tiny_config):
    from desktop_server import start_server
    from fake_chat import decoded_image, fake_chat_server
    from guijax.evocua.office_architect import OfficeArchitect
    from guijax.evocua.office_resources import OfficeScenarioSampler
    from guijax.evocua.office_synthesis import write_task
    from guijax.methods import get_method
    from guijax.pipeline import base_stages
    from guijax.pipeline.run import Run

    scenario = OfficeScenarioSampler(("text_append_line",)).sample(random.Random(0), "s0")
    write_task(tmp_path / "tasks", scenario, OfficeArchitect().propose(scenario, []), "notes")
    screens = []

    def wsm(body):
        parts = body["messages"][0]["content"]
        text = " ".join(p.get("text", "") for p in parts)
        if '"elements"' in text:
            screens.append(decoded_image(parts[0]["image_url"]["url"]))
            return 200, json.dumps({"elements": ["Mousepad", "File"], "captions": ["A text editor shows a file."]})
        if "just before one action" in text:
            return 200, "The screen did not change."
        return 200, "res_dict = {'Correctness': False, 'First Error Step': 1, 'Error Type': 'no edit'}"

    answer = json.dumps({"software document new": "v1", "exam new": [["Open the File menu of Mousepad"]]})
    proc, url, _ = start_server(["--no-token"], tmp_path / "cache", screen="640x360")
    try:
        with fake_chat_server([(200, answer)]) as (gen_url, gen_requests), fake_chat_server(wsm) as (wsm_url, _):
            config = tiny_config("grpo_cpu", "env.kind=osworld", f"env.osworld_dir={tmp_path / 'tasks'}",
                                 f"env.server_urls=('{url}',)", "env.held_out_fraction=0.0", "env.timeout_s=120",
                                 "seagent.judge=chat", f"seagent.chat_url={wsm_url}", "seagent.chat_model=wsm",
                                 "seagent.chat_api_key_env=", "seagent.curriculum=chat",
                                 f"seagent.curriculum_url={gen_url}", "seagent.curriculum_model=gen",
                                 "seagent.curriculum_api_key_env=", "seagent.episodes_per_task=1",
                                 "seagent.phases=2",
                                 "seagent.group_size=2", "seagent.learning_rate=1e-3")
            run = Run(config, tmp_path / "run")
            base_stages.base_model.fn(run)
            base_stages.tasks.fn(run)
            workdir = tmp_path / "run" / "methods" / "seagent"
            workdir.mkdir(parents=True)
            base_stages.train_with(run, get_method("seagent", config), workdir, "seagent")
    finally:
        proc.terminate()
        proc.wait(timeout=15)
    (train,) = run.tasks()["train"]
    (shot,) = screens  # the desktop as the task's setup left it: the document open in the editor
    assert shot.shape == (360, 640, 3) and len(np.unique(shot.reshape(-1, 3), axis=0)) > 16
    assert "A text editor shows a file." in gen_requests[0]["body"]["messages"][0]["content"]
    (task,) = json.loads((workdir / "curriculum.json").read_text())["tasks"]
    assert task["config"] == list(train.config) and task["evaluator"] == {"func": "judged"}
    assert "solution" not in task
    for p, task_id in ((1, task["id"]), (2, "seagent-p2-000")):  # phase 2's task read back from phase 1's folder
        report = json.loads((workdir / f"phase_{p}" / "phase.json").read_text())
        assert report["episodes"] == 1 and report["verified_episodes"] == 0  # set up on the server, scored 0
        assert [j["task"] for j in report["judgments"]] == [task_id] and report["a_F"] == 1
