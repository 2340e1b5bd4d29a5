"""The standing hostile-input and fault campaigns (benchmarks/hostile.py) at their smoke budget: nothing
escapes and nothing is lost. The campaigns themselves are checked to notice a planted defect."""
from __future__ import annotations

import json

import pytest

from benchmark_scripts import load, outputs, read

pytestmark = pytest.mark.hostile
hostile = load("hostile")


@pytest.mark.parametrize("name", sorted(hostile.CAMPAIGNS))
def test_the_campaign_finds_nothing_escaped_or_lost(name):
    tally = hostile.CAMPAIGNS[name](hostile.BUDGETS["smoke"][name], 0)
    assert tally.inputs > 0
    assert tally.escaped == [] and tally.lost == [], tally.summary()
    assert tally.accepted + tally.refused > 0


def test_the_parser_campaign_reports_an_exception_other_than_a_parse_error(monkeypatch):
    from envs import actions

    real = actions.parse_s2

    def overflowing(text):
        if "99999" in text:
            raise OverflowError("int too large")
        return real(text)

    monkeypatch.setattr(actions, "parse_s2", overflowing)
    tally = hostile.parsers(400, 0)
    assert any(e.startswith("s2: OverflowError") for e in tally.escaped)


def test_the_store_campaign_reports_a_read_error_that_names_no_shard(monkeypatch):
    from guijax.data import store

    def bare(self, path, records=None):
        raise RuntimeError("chunk data hash mismatch")

    monkeypatch.setattr(store.TrajectoryStore, "_read", bare)
    tally = hostile.store(2, 0)
    assert tally.escaped and "RuntimeError" in tally.escaped[0]


def test_the_checkpoint_campaign_reports_wrong_weights_restored_silently(monkeypatch):
    from guijax import checkpoint

    real = checkpoint.Checkpointer.restore

    def corrupting(self, step, abstract_state):
        state, meta = real(self, step, abstract_state)
        return {**state, "w": state["w"] + 1}, meta

    monkeypatch.setattr(checkpoint.Checkpointer, "restore", corrupting)
    tally = hostile.checkpoints(2, 0)
    assert len(tally.lost) == 2 and "different contents" in tally.lost[0]


def test_the_runner_writes_the_table(tmp_path):
    hostile.main(["--only", "parsers,task_files", *outputs(tmp_path, "hostile")])
    payload = read(tmp_path, "hostile")
    assert [c["campaign"] for c in payload["campaigns"]] == ["action parsers", "task loaders"]
    assert {"inputs", "faults", "accepted", "refused", "escaped", "lost"} <= set(payload["campaigns"][0])
    assert "| **all** |" in (tmp_path / "hostile.md").read_text()
    json.dumps(payload)
