"""One evaluator dispatch for every environment: OSWorld-style metric functions looked up by name.

A task's `evaluator` is `{"func": name or [names], "conj": "and"|"or", "result": getter, "expected": getter,
"options": {...}}`. Environments resolve the getters (they know how to read their own state) and call
`get_metric(name)(result, expected, **options)`; each metric returns a float in [0, 1].
Modules that define metrics register them with `@register_metric("name")`.
"""
from __future__ import annotations

from typing import Any, Callable

Metric = Callable[..., float]
_METRICS: dict[str, Metric] = {}


class UnknownMetricError(KeyError):
    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0])


def register_metric(name: str) -> Callable[[Metric], Metric]:
    def wrap(fn: Metric) -> Metric:
        if name in _METRICS and _METRICS[name] is not fn:
            raise ValueError(f"metric {name!r} registered twice ({_METRICS[name].__module__} and {fn.__module__})")
        _METRICS[name] = fn
        return fn

    return wrap


def get_metric(name: str) -> Metric:
    if name not in _METRICS:
        raise UnknownMetricError(f"unknown metric {name!r}; known metrics: {sorted(_METRICS)}")
    return _METRICS[name]


def known_metrics() -> list[str]:
    return sorted(_METRICS)


def combine(scores: list[float], conj: str = "and") -> float:
    """OSWorld's `conj`: 'and' is the minimum (all must pass), 'or' the maximum."""
    if conj not in ("and", "or"):
        raise ValueError(f"evaluator 'conj' must be 'and' or 'or', got {conj!r}")
    if not scores:
        raise ValueError("no metric scores to combine")
    return float(min(scores) if conj == "and" else max(scores))


def evaluator_funcs(evaluator: dict[str, Any]) -> list[str]:
    func = evaluator.get("func")
    return list(func) if isinstance(func, list) else ([func] if func else [])


@register_metric("judged")
def judged(*_: Any, **__: Any) -> float:
    """A task with no validator, which only a trajectory judge rewards (SEAgent's generated tasks): every
    environment verifies nothing and scores it 0; the run's judge decides its outcome."""
    return 0.0
