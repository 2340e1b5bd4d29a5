"""Replay branching on the real Xvfb desktop (which cannot save its state): a prefix acts on the desktop, every
depth is reached again by reset + replay with each screen checked, and a screen that differs is named."""
from __future__ import annotations

import jax
import pytest

from envs.api import Task
from envs.desktop.checks import desktop_missing
from guijax.rollout.engine import RolloutConfig, RolloutEngine
from guijax.rollout.handoff import HandoffRunner
from guijax.rollout.trajectory import Status
from rollout_fakes import PromptPolicySampler, TextProcessor

pytestmark = [pytest.mark.desktop, pytest.mark.skipif(desktop_missing() is not None, reason=str(desktop_missing()))]

TASK = Task.from_dict({
    "id": "replay-file", "instruction": "append to the file",
    "config": [{"type": "execute", "parameters": {"command": "echo -n 1 > ~/f", "shell": True}}],
    "evaluator": {"func": "exact_match", "result": {"type": "vm_command_line", "command": "cat ~/f; echo", "shell": True},
                  "expected": {"type": "rule", "rules": {"expected": "1\n"}}}})
CLICK = "Thought: I click the desktop.\nAction: click(start_box='(40,40)')"
DONE = "Thought: The file already holds it.\nAction: finished(content='ok')"


def test_replay_reaches_each_depth_of_a_desktop_prefix_and_names_a_divergence():
    from envs.desktop.env import DesktopFactory
    from envs.pool import EnvPool

    def respond(params, prompt):
        return DONE if params == "continue" else CLICK

    processor = TextProcessor()
    with EnvPool(DesktopFactory(screen_size=(320, 240)), 1, timeout_s=90) as pool:
        engine = RolloutEngine(pool, PromptPolicySampler(processor, respond), processor,
                               RolloutConfig(show_progress=False, coordinate_model="uitars-1.5"))
        runner = HandoffRunner(engine, "replay")
        (prefix,) = runner.prefixes("plain", [TASK], 2, jax.random.PRNGKey(0))
        assert prefix.open_steps == 2 and len(prefix.screens) == 3
        trajs = runner.continue_from("continue", [prefix], [1, 2], jax.random.PRNGKey(1))
        assert [(t.meta["handoff"], t.status, t.reward) for t in trajs] == [(1, Status.DONE, 1.0), (2, Status.DONE, 1.0)]
        prefix.screens[1] = 255 - prefix.screens[1]  # as if the desktop had shown something else after step 1
        trajs = runner.continue_from("continue", [prefix], [1, 2], jax.random.PRNGKey(1))
        assert all(t.status == Status.ENV_ERROR and "diverged" in t.error and "at step 1" in t.error for t in trajs)
