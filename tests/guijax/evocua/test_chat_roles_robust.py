"""Any answer a model gives EvoCUA's denoising judge or office task architect either parses (to step indices
before the last step; to a proposal that changes the document) or raises ValueError, which the caller asks again
about: never another exception."""
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


OFFICE_BITS = ["{", "}", "[", "]", '"instruction"', '"expected_rows"', '"solution"', '"kind"', '"wait"', '"type"',
               '"press"', '"hotkey"', '"keys"', '"text"', '"amount"', '"Tea"', ": ", ", ", "1", "-1", "1e999", "true",
               "null", '""', "\n"]


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from(OFFICE_BITS) | st.text(max_size=3), max_size=40).map("".join),
       st.sampled_from(["sheet_append_row", "csv_append_row", "text_append_line"]))
def test_any_office_architect_answer_gives_a_proposal_or_a_value_error(text, capability):
    import random

    from guijax.chat import json_reply
    from guijax.evocua.office_chat_architect import parse_office_proposal
    from guijax.evocua.office_resources import OfficeScenarioSampler

    sc = OfficeScenarioSampler((capability,)).sample(random.Random(0), "fuzz")
    try:
        proposal = parse_office_proposal(json_reply(text), sc, "fuzz")
    except ValueError:
        return
    assert proposal.solution and proposal.expected.rows != sc.document.rows
