"""Scripted policies on real desk tasks for the handoff and SGCD tests: a plain policy that only waits and a
policy that clicks the task's button then reports done, chosen by the parameters or by a skill in the prompt."""
from __future__ import annotations

import contextlib
import re

from envs.actions.grammar import render_response
from envs.actions.model import Action, ActionType
from envs.desk import DeskEnv
from envs.desk.a11y import parse_tree

SCREEN = (280, 280)
WAIT = "Thought: I wait for the screen.\nAction: wait()"
DONE = "Thought: The task is complete.\nAction: finished(content='done')"


def button_center(task, screen=SCREEN, name: str | None = None) -> tuple[int, int, str]:
    """Where a button (default: the click_button task's target) is on the task's (pop-up free) desk."""
    name = name or re.search(r'"([^"]+)"', task.instruction).group(1)
    env = DeskEnv(screen, popups=False)
    tree = env.reset(task).a11y_tree
    (node,) = [n for n in parse_tree(tree) if n.role == "button" and n.name == name]
    x1, y1, x2, y2 = node.rect
    return (x1 + x2) // 2, (y1 + y2) // 2, name


def solver(tasks, screen=SCREEN, repeat_click: int = 1):
    """respond(params, prompt) -> the solving response for the task whose instruction is in the prompt:
    click its button (`repeat_click` times), then finished()."""
    targets = {t.instruction: button_center(t, screen) for t in tasks}

    def respond(prompt: str) -> str:
        (x, y, name), = [v for k, v in targets.items() if k in prompt]
        clicks = prompt.count("Action: click(")
        if clicks < repeat_click:
            return f"Thought: I should click the \"{name}\" button.\nAction: click(start_box='({x},{y})')"
        return DONE
    return respond


def plain_or_trained(tasks, screen=SCREEN, skill_marker: str = "Continuation Plans:", repeat_click: int = 1):
    """params 'trained', or a skill in the prompt: solve; otherwise wait."""
    solve = solver(tasks, screen, repeat_click)

    def respond(params, prompt: str) -> str:
        return solve(prompt) if params == "trained" or skill_marker in prompt else WAIT
    return respond


class _NoSnapshot:
    """A desk that cannot save its state (like a remote desktop)."""

    def __init__(self, env):
        self.env = env

    def reset(self, task, episode_seed=None):
        return self.env.reset(task, episode_seed)

    def step(self, action):
        return self.env.step(action)

    def evaluate(self):
        return self.env.evaluate()

    def close(self):
        self.env.close()


class NoSnapshotDeskFactory:
    def __init__(self, screen=SCREEN, popups=False):
        self.screen, self.popups = screen, popups

    def __call__(self):
        return _NoSnapshot(DeskEnv(self.screen, popups=self.popups))


def buttons(task, screen=SCREEN) -> list[str]:
    tree = DeskEnv(screen, popups=False).reset(task).a11y_tree
    return [n.name for n in parse_tree(tree) if n.role == "button"]


def click(task, name: str, thought_name: str | None = None, screen=SCREEN) -> str:
    x, y, _ = button_center(task, screen, name)
    return f"Thought: I should click the \"{thought_name or name}\" button.\nAction: click(start_box='({x},{y})')"


class StepsIn:
    """The scripted policies' steps written in `grammar` (envs.actions.grammar.render_response), for the tests
    that run one trajectory in every grammar."""

    def __init__(self, grammar: str, task, screen=SCREEN):
        self.grammar, self.task, self.screen = grammar, task, screen
        self.wait = self.respond("I wait for the screen.", "Wait", Action(ActionType.WAIT))
        self.done = self.respond("The task is complete.", "Report the task done", Action(ActionType.FINISHED))

    def respond(self, thought: str, semantic: str, *actions: Action) -> str:
        return render_response(thought, semantic, actions, grammar=self.grammar, screen_hw=self.screen)

    def click(self, name: str, thought_name: str | None = None) -> str:
        """A click on button `name` whose thought names `thought_name` (default: the same button)."""
        x, y, _ = button_center(self.task, self.screen, name)
        shown = thought_name or name
        return self.respond(f'I should click the "{shown}" button.', f'Click the "{shown}" button',
                            Action(ActionType.CLICK, point=(x, y)))

    def typed(self, text: str, quoted: str) -> str:
        """Typing `text` while the thought quotes `quoted`."""
        return self.respond(f'I type "{quoted}".', f'Type "{quoted}"', Action(ActionType.TYPE, text=text))


def scripted(responses_by_step):
    """respond(params, prompt) answering the i-th step of an episode with responses_by_step[i]."""
    def respond(params, prompt):
        i = prompt.count("assistant:")
        return responses_by_step[min(i, len(responses_by_step) - 1)]
    return respond


@contextlib.contextmanager
def scripted_episodes(task, screen=SCREEN, step_limit: int = 6):
    """Yields run(responses, grammar="uitars") -> the trajectory of a scripted policy on `task` writing
    `grammar`, rolled out on a real desk (episode seed 3, no pop-ups); the desk pool is closed on exit."""
    import jax

    from envs.pool import DeskFactory, EnvPool
    from guijax.rollout.engine import RolloutConfig, RolloutEngine
    from rollout_fakes import PromptPolicySampler, TextProcessor

    pool = EnvPool(DeskFactory(screen, step_limit=step_limit, popups=False), 1, timeout_s=60)

    def run(responses, grammar: str = "uitars"):
        processor = TextProcessor()
        engine = RolloutEngine(pool, PromptPolicySampler(processor, scripted(responses)), processor,
                               RolloutConfig(show_progress=False, grammar=grammar))
        (traj,), _ = engine.run(None, [task], 1, jax.random.PRNGKey(0), seed=3)
        return traj

    try:
        yield run
    finally:
        pool.close()


def click_task(seed: int = 5, screen=SCREEN):
    """One click_button desk task (the judge and skill tests' task)."""
    from envs.tasks import generate_desk_tasks

    return generate_desk_tasks(1, seed=seed, families=["click_button"], screen_hw=screen)[0]
