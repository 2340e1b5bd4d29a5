"""The desk's executable validator: `desk_state` compares the final widget state with the expected one (a task
no validator checks has envs.metrics' `judged`, scored 0 everywhere, its outcome left to a judge).

expected = {"Window title": {"saved": true, "widgets": {"Widget name": {"value": ..., "checked": ...,
"text": ..., "clicks_at_least": 1}}}, "front": "Window title"}; sliders match within
`options.slider_tolerance` (default 3).
"""
from __future__ import annotations

from typing import Any

from envs.api import Task, TaskError
from envs.metrics import combine, evaluator_funcs, get_metric, register_metric


_PROPERTIES = {"clicks_at_least", "checked", "text", "value"}


def _match_widget(actual: dict[str, Any], expected: dict[str, Any], tolerance: float) -> bool:
    for key, want in expected.items():
        if key not in _PROPERTIES:
            raise TaskError(f"desk_state: unknown widget property {key!r}; known: {sorted(_PROPERTIES)}")
        if key == "clicks_at_least":
            if actual.get("clicks", 0) < want:
                return False
        elif key == "value" and isinstance(want, (int, float)) and not isinstance(want, bool):
            got = actual.get("value")
            if not isinstance(got, (int, float)) or abs(got - want) > tolerance:
                return False
        elif actual.get(key) != want:
            return False
    return True


@register_metric("desk_state")
def desk_state(result: dict[str, Any], expected: dict[str, Any], slider_tolerance: float = 3) -> float:
    for title, want in expected.items():
        if title == "front":
            if result["front"] != want:
                return 0.0
            continue
        window = result["windows"].get(title)
        if window is None:  # windows never close on the desk: this is a typo in the task, not a failure
            raise TaskError(f"desk_state: expected names window {title!r}, the desk has {sorted(result['windows'])}")
        if "saved" in want and bool(window["saved"]) != want["saved"]:
            return 0.0
        for name, props in want.get("widgets", {}).items():
            if name not in window["widgets"]:
                raise TaskError(f"desk_state: window {title!r} has no stateful widget {name!r}; "
                                f"it has {sorted(window['widgets'])}")
            if not _match_widget(window["widgets"][name], props, slider_tolerance):
                return 0.0
    return 1.0


def evaluate_state(task: Task, state: dict[str, Any]) -> float:
    evaluator = task.evaluator
    funcs = evaluator_funcs(evaluator)
    if not funcs:
        raise TaskError(f"task {task.id}: evaluator has no 'func'")
    expected = evaluator.get("expected")
    expected = expected if isinstance(expected, list) else [expected] * len(funcs)
    options = evaluator.get("options", {})
    options = options if isinstance(options, list) else [options] * len(funcs)
    try:
        scores = [get_metric(f)(state, e, **o) for f, e, o in zip(funcs, expected, options)]
    except TaskError as e:
        raise TaskError(f"task {task.id} ({task.source or 'generated'}): evaluator: {e}") from None
    return combine(scores, evaluator.get("conj", "and"))
