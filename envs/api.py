"""Environment API shared by the synthetic desk, the local Xvfb desktop and remote OSWorld VMs.

The trainer talks to environments only through these types. Nothing here imports JAX.
"""
from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any, Protocol, runtime_checkable

import numpy as np

from envs.actions.model import Action

DEFAULT_STEP_LIMIT = 15


class TaskError(ValueError):
    """A task file or dict that cannot be used; the message names the file / id and the key."""


def read_json(path: pathlib.Path, what: str = "task file") -> Any:
    """A JSON file's contents; anything that stops it being read (unreadable, not UTF-8, not JSON, nested
    too deep for the parser) is a TaskError naming the file."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise TaskError(f"{what} not found: {path}") from None
    except UnicodeDecodeError as e:
        raise TaskError(f"{path}: {what} is not UTF-8 text ({e})") from None
    except json.JSONDecodeError as e:
        raise TaskError(f"{path}: invalid JSON: {e}") from None
    except RecursionError:
        raise TaskError(f"{path}: JSON nested too deeply to parse") from None
    except OSError as e:
        raise TaskError(f"{path}: cannot read {what}: {e}") from None


@dataclasses.dataclass(frozen=True)
class Task:
    """A task in the OSWorld JSON shape: id, instruction, setup `config` steps, `evaluator`.

    `domain` is the OSWorld domain folder (or the synthetic desk's family); `source` is the file it was
    read from, if any, for error messages. `extra` keeps every other top-level key untouched so a task
    round-trips to JSON.
    """

    id: str
    instruction: str
    domain: str = ""
    config: tuple[dict[str, Any], ...] = ()
    evaluator: dict[str, Any] = dataclasses.field(default_factory=dict)
    source: str | None = None
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def infeasible(self) -> bool:
        func = self.evaluator.get("func")
        return func == "infeasible" or (isinstance(func, list) and "infeasible" in func)

    @classmethod
    def from_dict(cls, data: Any, *, domain: str = "", source: str | None = None) -> "Task":
        where = source or "<dict>"
        if not isinstance(data, dict):
            raise TaskError(f"{where}: a task must be a JSON object, got {type(data).__name__}")
        for key, typ in (("id", str), ("instruction", str)):
            if key not in data:
                raise TaskError(f"{where}: missing required key {key!r}")
            if not isinstance(data[key], typ):
                raise TaskError(f"{where}: key {key!r} must be {typ.__name__}, got {type(data[key]).__name__}")
        config = data.get("config", [])
        if not isinstance(config, list) or not all(isinstance(s, dict) and "type" in s for s in config):
            raise TaskError(f"{where} (task {data['id']}): key 'config' must be a list of {{'type': ..., 'parameters': ...}} steps")
        evaluator = data.get("evaluator", {})
        if not isinstance(evaluator, dict):
            raise TaskError(f"{where} (task {data['id']}): key 'evaluator' must be an object")
        known = {"id", "instruction", "config", "evaluator", "domain"}
        return cls(
            id=data["id"],
            instruction=data["instruction"],
            domain=data.get("domain", domain),
            config=tuple(config),
            evaluator=evaluator,
            source=source,
            extra={k: v for k, v in data.items() if k not in known},
        )

    @classmethod
    def from_file(cls, path: str | pathlib.Path, *, domain: str | None = None) -> "Task":
        path = pathlib.Path(path)
        data = read_json(path)
        return cls.from_dict(data, domain=domain if domain is not None else path.parent.name, source=str(path))

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "instruction": self.instruction, "domain": self.domain,
                "config": list(self.config), "evaluator": self.evaluator, **self.extra}


@dataclasses.dataclass
class Observation:
    """What the agent sees: an RGB uint8 screenshot [H, W, 3], optional accessibility tree, instruction."""

    screenshot: np.ndarray
    instruction: str
    a11y_tree: str | None = None


@dataclasses.dataclass
class StepResult:
    observation: Observation
    done: bool
    info: dict[str, Any] = dataclasses.field(default_factory=dict)


@runtime_checkable
class Env(Protocol):
    """One episode at a time. `step` executes a parsed action; WAIT/DONE/FAIL follow OSWorld semantics:
    FINISHED and FAIL end the episode, and on an infeasible task only FAIL scores 1."""

    step_limit: int

    def reset(self, task: Task) -> Observation: ...

    def step(self, action: Action) -> StepResult: ...

    def evaluate(self) -> float: ...

    def close(self) -> None: ...
