"""Any answer a large model gives the World State judge (Fig. 8) or the curriculum generator (Fig. 9) either
parses or raises their ValueError (which the callers ask again about, then refuse): never another exception."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from guijax.seagent.chat_curriculum import CurriculumAnswerError, parse_task_buffer
from guijax.seagent.world_state import JudgmentError, parse_judgment

pytestmark = pytest.mark.hostile  # the standing hostile-input and fault suite

JUDGE_BITS = ["res_dict", " = ", "{", "}", "[", "]", "(", ")", '"Correctness": ', "'Correctness': ", "True", "False",
              "true", "null", "None", '"Redundant": ', '"First Error Step": ', '"Optimized": ', '"Error Type": ',
              "<thinking>", "</thinking>", "1", "-1", "0", "1e999", '"3"', "'x'", ", ", ": ", "\n", "\\", "**", "lambda"]
BUFFER_BITS = ["{", "}", "[", "]", '"software document new"', '"exam new"', ": ", ", ", '"task"', '""', "3", "null",
               "true", "```json\n", "```", "\\", '"', "\n", " "]


def _fuzz(bits):
    return st.lists(st.sampled_from(bits) | st.text(max_size=3), max_size=30).map("".join)


@settings(max_examples=400, deadline=None)
@given(_fuzz(JUDGE_BITS))
def test_any_judge_answer_gives_a_judgment_or_a_judgment_error(text):
    try:
        parse_judgment(text)
    except JudgmentError:
        pass


@settings(max_examples=400, deadline=None)
@given(_fuzz(BUFFER_BITS))
def test_any_generator_answer_gives_a_task_buffer_or_a_curriculum_error(text):
    try:
        buffer = parse_task_buffer(text)
    except CurriculumAnswerError:
        return
    assert buffer.tasks and all(step.strip() for task in buffer.tasks for step in task)


def test_deeply_nested_answers_are_refused_cleanly():
    for text in ("res_dict = " + "[" * 5000 + "]" * 5000, "res_dict = {" + "(" * 100000):
        with pytest.raises(JudgmentError):
            parse_judgment(text)
    with pytest.raises(CurriculumAnswerError):
        parse_task_buffer('{"software document new": "d", "exam new": ' + "[" * 100000 + "]" * 100000 + "}")
