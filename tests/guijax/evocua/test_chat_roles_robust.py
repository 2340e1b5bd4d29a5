"""Any answer a model gives EvoCUA's denoising judge either parses to step indices before the last step or
raises ValueError (which the judge asks again about, then keeps every step): never another exception."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from guijax.evocua.chat_roles import parse_redundant

pytestmark = pytest.mark.hostile  # the standing hostile-input and fault suite

BITS = ["{", "}", "[", "]", '"redundant_steps"', '"reason"', ": ", ", ", "1", "2", "3", "7", "-1", "0", "1.5", "1e999",
        "true", "null", '"2"', "```json\n", "```", "\\", '"', "\n", " "]


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from(BITS) | st.text(max_size=3), max_size=30).map("".join), st.integers(1, 6))
def test_any_denoiser_answer_gives_earlier_steps_or_a_value_error(text, steps):
    try:
        redundant = parse_redundant(text, steps)
    except ValueError:
        return
    assert redundant == sorted(set(redundant)) and all(0 <= i < steps - 1 for i in redundant)


def test_a_deeply_nested_answer_is_refused_cleanly():
    with pytest.raises(ValueError):
        parse_redundant('{"redundant_steps": ' + "[" * 100000 + "]" * 100000 + "}", 3)
