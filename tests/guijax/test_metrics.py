"""metrics.jsonl stays one record per iteration across a resume."""
import json

import pytest

from guijax.metrics import MetricsWriter, read_metrics

pytestmark = pytest.mark.hostile  # the standing hostile-input and fault suite


def test_drop_from_removes_redone_iterations_and_keeps_appending(tmp_path):
    writer = MetricsWriter(tmp_path, console=False)
    writer.write({"eval_before": 0.25})
    for i in range(4):
        writer.write({"iteration": i, "loss": float(i)})
    writer.drop_from(2)  # resumed from the checkpoint taken after iteration 1
    writer.write({"iteration": 2, "loss": 20.0})
    writer.close()
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert records == [{"eval_before": 0.25}, {"iteration": 0, "loss": 0.0}, {"iteration": 1, "loss": 1.0},
                       {"iteration": 2, "loss": 20.0}]
    assert not list(tmp_path.glob("*.tmp"))
    assert all(json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines())


def test_a_line_torn_by_a_crash_is_dropped_on_resume(tmp_path):
    """A crash mid-write leaves half a record as the last line: every resume used to fail on it."""
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"iteration": 0, "loss": 1.0}\n{"iteration": 1, "lo')
    assert read_metrics(path) == [{"iteration": 0, "loss": 1.0}]
    writer = MetricsWriter(tmp_path, console=False)  # what a resumed trainer opens
    writer.drop_from(1)
    writer.write({"iteration": 1, "loss": 2.0})
    writer.close()
    assert read_metrics(path) == [{"iteration": 0, "loss": 1.0}, {"iteration": 1, "loss": 2.0}]


def test_appending_after_a_torn_tail_does_not_glue_records(tmp_path):
    path = tmp_path / "sft_metrics.jsonl"
    path.write_text('{"sft_step": 1}\n{"sft_st')
    writer = MetricsWriter(tmp_path, "sft_metrics.jsonl", console=False)
    writer.write({"sft_step": 2})
    writer.close()
    assert read_metrics(path) == [{"sft_step": 1}, {"sft_step": 2}]


def test_a_broken_line_before_the_end_names_the_file_and_line(tmp_path):

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"iteration": 0}\nnot json\n{"iteration": 1}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl: line 2 is not a JSON record"):
        read_metrics(path)
