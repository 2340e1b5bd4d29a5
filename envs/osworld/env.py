"""OSWorldEnv: OSWorld tasks (setup, pyautogui actions, execution-based evaluation) over any `Controller`.

The same class drives the local Xvfb desktop (envs.desktop.DesktopEnv) and a remote OSWorld VM or
`envs.server` (envs.client.RemoteEnv). Semantics follow OSWorld's DesktopEnv: an action becomes pyautogui
code run on the desktop; WAIT sleeps; DONE and FAIL end the episode; `evaluate` runs the postconfig steps,
then scores infeasible tasks 1 only if the last action was FAIL, scores 0 for FAIL on feasible tasks, and
otherwise combines the metrics (`conj` and: all must pass; or: any).
"""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from typing import Any, Sequence

from envs.actions.model import CONTROL_TYPES, Action, ActionType
from envs.api import DEFAULT_STEP_LIMIT, Observation, StepResult, Task
from envs.desktop.controller import Controller
from envs.metrics import combine, get_metric
from envs.osworld import metrics as _metrics  # noqa: F401  (registers the OSWorld metrics)
from envs.osworld.getters import GETTERS
from envs.osworld.loader import Getter, OSWorldTask, parse_task
from envs.osworld.setup import STEPS, SetupContext, run_steps

log = logging.getLogger("envs.osworld.env")


class EvaluationError(RuntimeError):
    """The evaluator could not run (unknown getter, a getter failed unexpectedly); names task and getter."""


def action_from_dict(d: dict[str, Any]) -> Action:
    """An Action from its JSON form (local task solutions): {"kind": "hotkey", "keys": ["ctrl", "s"]}, ..."""
    try:
        kind = ActionType(d["kind"])
    except (KeyError, ValueError) as e:
        raise ValueError(f"bad action {d!r}: 'kind' must be one of {[k.value for k in ActionType]}") from e
    return Action(kind=kind, point=tuple(d["point"]) if d.get("point") is not None else None,
                  end_point=tuple(d["end_point"]) if d.get("end_point") is not None else None,
                  keys=tuple(d.get("keys", ())), text=d.get("text", ""), direction=d.get("direction"),
                  amount=d.get("amount"))


class OSWorldEnv:
    def __init__(self, controller: Controller, *, step_limit: int = DEFAULT_STEP_LIMIT, cache_root: str | None = None,
                 cache_dirs: Sequence[str] = (), password: str = "password", allow_network: bool = False,
                 wait_s: float = 2.0, settle_s: float = 0.5, retry_scale: float = 1.0):
        self.controller = controller
        self.step_limit = step_limit
        self.cache_root = cache_root or tempfile.mkdtemp(prefix="guijax-osworld-cache-")
        self._own_cache_root = cache_root is None
        self.cache_dirs = list(cache_dirs)
        self.password = password
        self.allow_network = allow_network
        self.wait_s = wait_s
        self.settle_s = settle_s
        self.retry_scale = retry_scale
        self.task: OSWorldTask | None = None
        self.ctx: SetupContext | None = None
        self.steps = 0
        self.history: list[str] = []

    # -- episode -----------------------------------------------------------------------------------------
    def reset(self, task: Task | OSWorldTask, episode_seed: int | None = None) -> Observation:
        """Close the last episode's apps and run the task's setup. `episode_seed` is accepted for EnvPool's
        interface; a real desktop has no seedable randomness."""
        ot = task if isinstance(task, OSWorldTask) else parse_task(task)
        self.controller.reset()
        cache_dir = os.path.join(self.cache_root, ot.id)
        root = os.path.realpath(self.cache_root)
        if os.path.dirname(os.path.realpath(cache_dir)) != root:  # parse_task refuses such ids; never rmtree outside
            raise ValueError(f"task {ot.id!r}: its cache directory {cache_dir} is not directly under {root}")
        shutil.rmtree(cache_dir, ignore_errors=True)
        os.makedirs(cache_dir, exist_ok=True)
        base_dir = os.path.dirname(ot.task.source) if ot.task.source else None
        self.ctx = SetupContext(self.controller, cache_dir, self.cache_dirs, base_dir, self.password,
                                self.allow_network, self.retry_scale)
        self.task, self.steps, self.history = ot, 0, []
        run_steps(ot.setup, self.ctx, task_id=ot.id, what="setup")
        return self.observe()

    def observe(self) -> Observation:
        assert self.task is not None, "call reset(task) first"
        return Observation(self.controller.screenshot(), self.task.task.instruction)

    def step(self, action: Action | Sequence[Action] | str) -> StepResult:
        """One agent step: an Action, one response's list of Actions, or raw pyautogui code (OSWorld's
        'pyautogui' action space) / one of its control words 'WAIT', 'DONE', 'FAIL'."""
        if self.task is None:
            raise RuntimeError("OSWorldEnv.step before reset")
        from envs.actions.uitars import to_pyautogui

        if isinstance(action, str):
            code = action.strip()
        else:
            actions = [action] if isinstance(action, Action) else list(action)
            for a in actions:
                if not isinstance(a, Action):
                    raise TypeError(f"OSWorldEnv.step expects Action objects or pyautogui code, got {a!r}")
            # Actions before a control action still run; the control word then ends the step.
            cut = next((i for i, a in enumerate(actions) if a.kind in CONTROL_TYPES), len(actions))
            if cut < len(actions) and cut > 0:
                self._run_code(to_pyautogui(actions[:cut]), {})
            code = to_pyautogui(actions[cut:] if cut < len(actions) else actions)
            if code == "WAIT" and actions[cut].amount:
                code = f"WAIT {actions[cut].amount}"
        info: dict[str, Any] = {}
        control = code.split()[0] if code.split() and code.split()[0] in ("WAIT", "DONE", "FAIL") else None
        if control == "WAIT":
            parts = code.split()
            time.sleep(float(parts[1]) if len(parts) > 1 else self.wait_s)
        elif control is None:
            self._run_code(code, info)
        self.history.append(control or code)
        self.steps += 1
        done = control in ("DONE", "FAIL") or self.steps >= self.step_limit
        if self.steps >= self.step_limit and control not in ("DONE", "FAIL"):
            info["step_limit"] = True
        return StepResult(self.observe(), done, info)

    def _run_code(self, code: str, info: dict[str, Any]) -> None:
        result = self.controller.execute_python(code)
        if result is None or result.get("status") != "success" or result.get("returncode", 0) not in (0, None):
            info["exec_error"] = (result or {}).get("error") or (result or {}).get("message") or "execution failed"
        time.sleep(self.settle_s)

    # -- evaluation --------------------------------------------------------------------------------------
    def _get(self, getter: Getter | None) -> Any:
        if getter is None:
            return None
        fn = GETTERS.get(getter.type)
        if fn is None:
            raise EvaluationError(f"task {self.task.id}: unsupported getter type {getter.type!r} "
                                  f"(supported: {sorted(GETTERS)})")
        try:
            return fn(self.ctx, getter.config)
        except FileNotFoundError:
            raise
        except Exception as e:
            raise EvaluationError(f"task {self.task.id}: getter {getter.type!r} failed: {type(e).__name__}: {e}") from e

    def evaluate(self) -> float:
        if self.task is None or self.ctx is None:
            raise RuntimeError("OSWorldEnv.evaluate before reset")
        ev = self.task.evaluator
        run_steps(ev.postconfig, self.ctx, task_id=self.task.id, what="postconfig")
        last = self.history[-1] if self.history else None
        if ev.infeasible:
            return 1.0 if last == "FAIL" else 0.0
        if last == "FAIL":
            return 0.0
        try:
            return self._score(ev)
        except (EvaluationError, FileNotFoundError):
            raise
        except Exception as e:  # unknown metric, unsupported rule, malformed options: name the task
            raise EvaluationError(f"task {self.task.id}: evaluation failed: {type(e).__name__}: {e}") from e

    def _score(self, ev) -> float:
        scores = []
        for i, name in enumerate(ev.funcs):
            metric = get_metric(name)
            try:
                result = self._get(ev.results[i]) if ev.results else None
            except FileNotFoundError:
                if ev.conj == "and":
                    return 0.0
                scores.append(0.0)
                continue
            if ev.expected and ev.expected[i] is not None:
                try:
                    expected = self._get(ev.expected[i])
                except FileNotFoundError as e:  # the task's own reference file: a task error, not a score
                    raise EvaluationError(f"task {self.task.id}: expected file missing: {e}") from e
                score = float(metric(result, expected, **ev.options[i]))
            else:
                score = float(metric(result, **ev.options[i]))
            if ev.conj == "and" and score == 0.0:
                return 0.0
            if ev.conj == "or" and score == 1.0:
                return 1.0
            scores.append(score)
        return combine(scores, ev.conj)

    def close(self) -> None:
        self.controller.close()
        if self._own_cache_root:
            shutil.rmtree(self.cache_root, ignore_errors=True)


def supported_step_types() -> list[str]:
    return sorted(STEPS)
