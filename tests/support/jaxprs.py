"""Walking a jaxpr: what tests of compiled structure (which primitives, which matmul shapes) read."""
from __future__ import annotations

from typing import Iterator

import jax


def equations(jaxpr) -> Iterator:
    """Every equation of a jaxpr, those of nested calls, loops and branches included."""
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jax.core.jaxprs_in_params(eqn.params):
            yield from equations(sub)
