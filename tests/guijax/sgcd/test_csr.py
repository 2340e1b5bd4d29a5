"""The Continuation Success Rate: per-depth rates, their unweighted mean, Table 5's buckets, the failure-step
histogram, the markdown table and the plot."""
from __future__ import annotations

import numpy as np
import pytest

from guijax.rollout.trajectory import Status, Trajectory
from guijax.sgcd import csr


def _t(k: int, reward: float, status: Status = Status.DONE) -> Trajectory:
    return Trajectory("t", "i", [], reward, status, meta={"handoff": k})


def test_csr_is_the_unweighted_mean_over_depths_of_each_depths_rate():
    trajs = ([_t(1, 1.0)] * 3 + [_t(1, 0.0)]  # k=1: 3/4
             + [_t(2, 1.0)] + [_t(2, 0.0, Status.STEP_LIMIT)]  # k=2: 1/2
             + [_t(3, 0.9, Status.PARSE_ERROR)]  # unparsable last answer: not solved
             + [_t(3, 1.0, Status.ENV_ERROR)])  # not a trial
    r = csr.continuation_success(trajs, [1, 2, 3, 4], csr.depth_buckets(4, width=2))
    assert r["per_depth"] == {1: {"trials": 4, "success_rate": 0.75}, 2: {"trials": 2, "success_rate": 0.5},
                              3: {"trials": 1, "success_rate": 0.0}}
    assert r["csr"] == pytest.approx((0.75 + 0.5 + 0.0) / 3)  # not the pooled 4/7
    assert r["env_errors"] == 1 and r["trials"] == 7
    assert r["buckets"] == {"1-2": pytest.approx(4 / 6), "2-4": pytest.approx(1 / 3)}
    assert csr.continuation_success([_t(1, 0.85)], [1])["csr"] == 1.0  # the paper's 0.8 threshold
    with pytest.raises(ValueError, match="no handoff depth"):
        csr.continuation_success([Trajectory("x", "i", [], 1.0)], [1])


def test_depth_buckets_follow_table_5():
    assert csr.depth_buckets(20) == [(1, 5), (5, 10), (10, 15), (15, 20)]
    assert csr.depth_buckets(3) == [(1, 3)] and csr.depth_buckets(7) == [(1, 5), (5, 7)]


def test_histogram_table_and_plot(tmp_path):
    assert csr.failure_histogram([2, 1, 2, None, 10]) == {"1": 1, "2": 2, "10": 1, "none": 1}
    results = {"base": csr.continuation_success([_t(1, 0.0), _t(2, 1.0)], [1, 2], [(1, 2)]),
               "sgcd": csr.continuation_success([_t(1, 1.0), _t(2, 1.0)], [1, 2], [(1, 2)])}
    table = csr.markdown(results, [1, 2])
    assert table.splitlines()[0] == "| policy | k=1 | k=2 | k 1-2 | CSR |"
    assert "| base | 0.0 (1) | 100.0 (1) | 50.0 | 50.0 |" in table and "| sgcd | 100.0 (1) | 100.0 (1) | 100.0 | 100.0 |" in table
    path = csr.plot(results, {"1": 3, "2": 1}, tmp_path / "csr.png")
    from PIL import Image

    assert np.asarray(Image.open(path)).std() > 0


def test_compare_aggregates_the_csr_over_seeds():
    from guijax.compare import aggregate_csr, csr_markdown

    reports = [{"tasks": ["a", "b"], "results": {"base policy": {"csr": 0.2}, "sgcd": {"csr": 0.5}}},
               {"tasks": ["a"], "results": {"base policy": {"csr": 0.4}, "sgcd": {"csr": None}}}]
    result = aggregate_csr(reports)
    assert result["base policy"] == {"csr": {"mean": pytest.approx(0.3), "std": pytest.approx(0.1), "n": 2},
                                     "tasks": [2, 1]}
    assert result["sgcd"]["csr"]["n"] == 1  # a seed whose pool had no trial does not count
    assert "| base policy | 30.0 ± 10.0 | 2, 1 |" in csr_markdown(result, [0, 1])


def test_baselines_are_read_strictly_naming_the_entry(tmp_path):
    from guijax.pipeline.sgcd_stages import baselines

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    (tmp_path / "q@7B").mkdir()
    (tmp_path / "q@7B" / "config.json").write_text("{}")
    assert baselines([f"thinking={tmp_path}/m@pyautogui_think", f"other = {tmp_path}/m", f"at={tmp_path}/q@7B",
                      f"at_prompted={tmp_path}/q@7B@pyautogui"]) == {
        "thinking": (tmp_path / "m", "pyautogui_think"), "other": (tmp_path / "m", None),
        "at": (tmp_path / "q@7B", None), "at_prompted": (tmp_path / "q@7B", "pyautogui")}
    for entry, match in ((f"{tmp_path}/m", "is not NAME=DIR"), (f"x={tmp_path}/m@", "is not NAME=DIR"),
                         (f"x={tmp_path}/m@uitars", "prompt 'uitars' is not one of"),
                         (f"x={tmp_path}/none", "holds no config.json"),
                         (f"sgcd={tmp_path}/m", "the name 'sgcd' is taken")):
        with pytest.raises((ValueError, FileNotFoundError), match=match):
            baselines([entry], taken=("base policy", "sgcd"))


def test_the_csr_stage_continues_with_each_baseline_in_its_own_prompt(tiny_config, tmp_path, monkeypatch):
    """The csr stage with no trained method and one baseline prompted with the thinking variant: each model's
    engine is prompted as its entry says, and the report records each one's prompt. (The tiny untrained policy
    writes no action, so its prefixes end at once: the continuations themselves are tested in
    tests/guijax/test_handoff.py.)"""
    import contextlib
    import json

    from guijax.pipeline.registry import run_stages
    from guijax.pipeline.run import Run
    from guijax.rollout.prompt import PROMPTS

    engines = []
    opened = Run.evaluation_engine

    @contextlib.contextmanager
    def recorded(self, policy, temperature, prompt=None):
        with opened(self, policy, temperature, prompt) as engine:
            engines.append((policy.path.name, engine.config.grammar, engine.config.system_prompt))
            yield engine

    monkeypatch.setattr(Run, "evaluation_engine", recorded)

    workdir = tmp_path / "run"
    config = tiny_config("sgcd_cpu", "stages=('base_model', 'tasks', 'eval_base', 'csr')", "compare.methods=()",
                         "sft.plan_only_families=()", "sgcd.csr_max_handoff=2",
                         f"sgcd.csr_baselines=('thinking={workdir / 'base_model'}@pyautogui_think',)")
    run_stages(config, workdir)
    report = json.loads((workdir / "csr.json").read_text())
    assert set(report["results"]) == {"base policy", "thinking"}
    assert report["prompts"] == {"base policy": config.rollout.prompt, "thinking": "pyautogui_think"}
    assert "thinking" in (workdir / "csr.md").read_text()
    compact = PROMPTS[config.rollout.prompt]
    assert engines[-3:] == [("base_model", "uitars", compact), ("base_model", "uitars", compact),
                            ("base_model", "pyautogui_think", PROMPTS["pyautogui_think"])]  # prefixes, base, baseline
