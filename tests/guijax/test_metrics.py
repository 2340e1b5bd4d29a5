"""metrics.jsonl stays one record per iteration across a resume."""
import json

from guijax.metrics import MetricsWriter, read_metrics


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
