"""Telling whether parameters are the very ones seen before, without keeping them alive: what decides when a
sampler with weights of its own (a serving engine) must be handed them again."""
from __future__ import annotations

import weakref
from typing import Any, Callable

import jax


def params_matcher(params: Any) -> Callable[[Any], bool]:
    """A test of whether other parameters are `params`: weak references to every array (an object's id could be
    reused once it is freed, and a push then silently skipped; the first array alone would miss new LoRA
    adapters beside a frozen base, which stays the same object)."""
    leaves = jax.tree.leaves(params)
    try:
        refs = [weakref.ref(x) for x in leaves]
    except TypeError:  # leaves that take no weak reference (Python numbers): hold the parameters
        return lambda other: other is params
    return lambda other: len(refs) == len(now := jax.tree.leaves(other)) and all(
        r() is x for r, x in zip(refs, now))
