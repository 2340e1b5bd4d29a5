"""DeskEnv: the synthetic desk behind the Env API (reset / step / evaluate), with OSWorld's control
semantics: FINISHED and FAIL end the episode; on an infeasible task only FAIL scores 1, and on a feasible
task FAIL scores 0; WAIT just passes a step.
"""
from __future__ import annotations

import pickle
import random
import zlib
from typing import Any, Sequence

from envs.actions.model import Action, ActionType
from envs.api import DEFAULT_STEP_LIMIT, Observation, StepResult, Task, TaskError
from envs.desk.evaluate import evaluate_state
from envs.desk.render import Renderer, a11y_tree
from envs.desk.scene import Scene, layout_window

DEFAULT_SIZE = (280, 280)  # h, w: 10x10 merged patches of 28 px = 100 image tokens, and the UI-TARS-1.5
#                            parser's minimum pixel count, so model and parser share one coordinate space


def scene_from_task(task: Task, rng: random.Random, size: tuple[int, int]) -> Scene:
    steps = [s for s in task.config if s.get("type") == "desk_scene"]
    if len(steps) != 1:
        raise TaskError(f"task {task.id} ({task.source or 'generated'}): expected exactly one 'desk_scene' setup step, "
                        f"found {len(steps)}")
    params = steps[0].get("parameters", {})
    try:
        windows = [layout_window(w["title"], tuple(w["rect"]), w["widgets"]) for w in params["windows"]]
    except KeyError as e:
        raise TaskError(f"task {task.id}: desk_scene parameters miss key {e}") from None
    return Scene(windows, size, rng, params.get("popup_prob", 0.0), params.get("popup_step_prob", 0.0),
                 params.get("banner_prob", 0.0), params.get("banner_step_prob", 0.0))


class DeskEnv:
    """One synthetic-desk episode at a time. Deterministic for (seed, task, episode number)."""

    def __init__(self, screen_hw: tuple[int, int] = DEFAULT_SIZE, step_limit: int = DEFAULT_STEP_LIMIT,
                 seed: int = 0, popups: bool = True):
        """`popups=False` turns off the stochastic pop-ups and banners (a static desk)."""
        self.screen_hw = tuple(screen_hw)
        self.step_limit = step_limit
        self.seed = seed
        self.popups = popups
        self.episode = 0
        self.renderer = Renderer()
        self.task: Task | None = None
        self.scene: Scene | None = None
        self.steps = 0
        self.last_control: ActionType | None = None

    def reset(self, task: Task, episode_seed: int | None = None) -> Observation:
        """Start an episode; pop-ups and other randomness follow `episode_seed` (default: derived from the
        env seed, the task id and the episode count, stable across processes)."""
        self.episode += 1
        seed = episode_seed if episode_seed is not None else zlib.crc32(f"{self.seed}/{task.id}/{self.episode}".encode())
        self.task = task
        self.scene = scene_from_task(task, random.Random(seed), self.screen_hw)
        if not self.popups:  # no dynamic UI at all: neither pop-ups nor banners
            self.scene.popup = self.scene.banner = None
            self.scene.popup_step_prob = self.scene.banner_step_prob = 0.0
        self.steps = 0
        self.last_control = None
        return self.observe()

    def observe(self) -> Observation:
        assert self.scene is not None and self.task is not None, "call reset(task) first"
        return Observation(self.renderer(self.scene), self.task.instruction, a11y_tree(self.scene))

    def apply(self, action: Action) -> None:
        scene, k, p = self.scene, action.kind, action.point
        if k in (ActionType.CLICK, ActionType.LONG_PRESS):
            scene.click(p)
        elif k == ActionType.LEFT_DOUBLE:
            scene.click(p, count=2)
        elif k == ActionType.LEFT_TRIPLE:
            scene.click(p, count=3)
        elif k == ActionType.RIGHT_SINGLE:
            scene.click(p, button="right")
        elif k == ActionType.MIDDLE_SINGLE:
            scene.click(p, button="middle")
        elif k == ActionType.DRAG:
            scene.drag(p, action.end_point)
        elif k == ActionType.SCROLL:
            scene.scroll(p, action.direction or "down", action.amount or 5)
        elif k == ActionType.TYPE:
            scene.type_text(action.text)
            if action.text.endswith("\n"):
                scene.key(("enter",))
        elif k in (ActionType.HOTKEY, ActionType.PRESS):
            scene.key(tuple(action.keys))
        elif k == ActionType.PRESS_ENTER:
            scene.key(("enter",))
        # HOVER, KEYDOWN/KEYUP (held modifiers), WAIT and mobile-only actions change nothing on the desk.

    def step(self, action: Action | Sequence[Action]) -> StepResult:
        """Execute one response's actions (a UI-TARS response may hold several) as one step."""
        if self.scene is None:
            raise RuntimeError("DeskEnv.step before reset")
        actions = [action] if isinstance(action, Action) else list(action)
        info: dict[str, Any] = {}
        for a in actions:
            if not isinstance(a, Action):
                raise TypeError(f"DeskEnv.step expects Action objects, got {type(a).__name__}: {a!r}")
            if a.kind in (ActionType.FINISHED, ActionType.FAIL, ActionType.CALL_USER):
                self.last_control = ActionType.FAIL if a.kind == ActionType.CALL_USER else a.kind
                break
            self.apply(a)
        self.steps += 1
        if self.last_control is None:
            self.scene.after_step()
        done = self.last_control is not None or self.steps >= self.step_limit
        if self.steps >= self.step_limit and self.last_control is None:
            info["step_limit"] = True
        return StepResult(self.observe(), done, info)

    def evaluate(self) -> float:
        if self.task is None or self.scene is None:
            raise RuntimeError("DeskEnv.evaluate before reset")
        if self.task.infeasible:
            return 1.0 if self.last_control == ActionType.FAIL else 0.0
        if self.last_control == ActionType.FAIL:
            return 0.0
        return evaluate_state(self.task, self.scene.state())

    def snapshot(self) -> bytes:
        """The whole episode state (scene, its random stream, the step count, the last control action), so
        `restore` continues exactly where this step left off: a rollout can branch several continuations
        from one prefix instead of replaying it."""
        if self.scene is None or self.task is None:
            raise RuntimeError("DeskEnv.snapshot before reset")
        return pickle.dumps((self.task, self.scene, self.steps, self.last_control))

    def restore(self, state: bytes) -> Observation:
        """Continue from a `snapshot` (of this or another DeskEnv); returns the observation at that point."""
        self.task, self.scene, self.steps, self.last_control = pickle.loads(state)
        self.renderer = Renderer()  # its cache is keyed by the scene object, which is new
        return self.observe()

    def close(self) -> None:
        self.scene = None
