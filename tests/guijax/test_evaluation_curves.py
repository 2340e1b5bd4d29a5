"""The evaluation's pass@k curve, success under smaller step limits (checked against real runs with that limit
on the desk), the checkpoint differential, the curve figure, and the eval stage's stored episodes and page."""
from __future__ import annotations

import contextlib
import itertools
import json
import types

import chex
import numpy as np
import pytest
from PIL import Image

from desk_policies import DONE, SCREEN, WAIT, click, click_task, scripted_episodes
from guijax.evaluation import (checkpoint_diff, desk_replay_scorer, diff_markdown, evaluate,
                               evaluate_with_trajectories, pass_at_k, pass_curve, plot_curves,
                               success_at_step_limits)
from guijax.rollout.trajectory import Status, Step, Trajectory

SHOT = np.zeros((4, 4, 3), np.uint8)


def traj(task: str, success: bool, steps: int = 1, status: Status | None = None, domain: str = "d") -> Trajectory:
    status = status or (Status.DONE if success else Status.FAIL)
    return Trajectory(task, f"do {task}", [Step.text(SHOT, WAIT) for _ in range(steps)], 1.0 if success else 0.0,
                      status, meta={"domain": domain})


class ReplayEngine:
    """engine.run answering each split with prepared trajectories (no model, no environment)."""

    def __init__(self, by_task: dict[str, list[Trajectory]]):
        self.by_task = by_task

    def run(self, params, tasks, group_size, rng, seed=0, desc=""):
        assert all(len(self.by_task[t.id]) == group_size for t in tasks)
        return [tr for t in tasks for tr in self.by_task[t.id]], {}


def test_pass_at_k_with_fewer_samples_than_k():
    """Episodes lost to environment errors leave n < k: pass@n, never 1 for a task with no success."""
    assert pass_at_k(2, 0, 4) == 0.0
    assert pass_at_k(2, 1, 4) == 1.0
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)


def test_pass_curve_equals_the_mean_over_all_k_subsets():
    outcomes = {"a": [True, False, False, True, False], "b": [False] * 5, "c": [False, True, False, False, False]}
    curve = pass_curve(outcomes, 5)
    assert list(curve) == ["1", "2", "3", "4", "5"]
    for k in range(1, 6):
        brute = np.mean([np.mean([any(s) for s in itertools.combinations(o, k)]) for o in outcomes.values()])
        chex.assert_trees_all_close(curve[str(k)], brute, atol=1e-12)


def test_evaluate_keeps_its_keys_and_adds_the_curve():
    by_task = {"t1": [traj("t1", True, domain="x"), traj("t1", False, domain="x"), traj("t1", False, domain="x")],
               "t2": [traj("t2", False, domain="y")] * 2 + [traj("t2", True, status=Status.ENV_ERROR, domain="y")],
               "t3": [traj("t3", True, domain="y")] * 3}
    tasks = {"train": [types.SimpleNamespace(id=t) for t in ("t1", "t2")],
             "held_out": [types.SimpleNamespace(id="t3")], "empty": []}
    engine = ReplayEngine(by_task)
    report, kept = evaluate_with_trajectories(engine, None, tasks, 3, seed=0, ks=(1, 3))
    assert report == evaluate(engine, None, tasks, 3, seed=0, ks=(1, 3))
    train = report["splits"]["train"]
    assert train["tasks"] == 2 and train["env_errors"] == 1
    chex.assert_trees_all_close(train["success_rate"], (1 / 3 + 0) / 2)
    assert train["per_task"] == {"t1": pytest.approx(1 / 3), "t2": 0.0}
    assert train["per_domain"] == {"x": pytest.approx(1 / 3), "y": 0.0}
    chex.assert_trees_all_close(train["pass@1"], train["success_rate"])
    chex.assert_trees_all_close(train["pass@3"], 0.5)
    chex.assert_trees_all_close([train["pass_curve"][k] for k in "123"], [1 / 6, (2 / 3) / 2, 0.5])
    assert report["splits"]["held_out"]["pass_curve"] == {"1": 1.0, "2": 1.0, "3": 1.0}
    assert report["splits"]["empty"] == {"tasks": 0}
    assert kept["train"] == by_task["t1"] + by_task["t2"] and set(kept) == {"train", "held_out"}
    assert "success_at_step_limit" not in train  # only when asked for


def test_success_at_step_limits_from_recorded_episodes():
    episodes = [
        traj("a", True, steps=2),  # done in 2: a success at every limit >= 2, cut at 1
        traj("b", True, steps=5),  # done in 5: cut below 5
        traj("c", False, steps=3, status=Status.PARSE_ERROR),  # garbage at step 3
        traj("d", False, steps=4, status=Status.ENV_ERROR),  # the environment broke at step 4
    ]
    got = success_at_step_limits(episodes, [1, 2, 3, 5])
    # L=1: all four cut (d's error came later), L=2: a; b, c, d cut; L=3: c failed itself, d cut;
    # L=5: d dropped (its error happens within 5 steps).
    chex.assert_trees_all_close([got[k] for k in ("1", "2", "3", "5")], [0.0, 1 / 4, 1 / 4, 2 / 3])
    # an episode the evaluation itself cut at 4 steps says nothing about a limit of 6
    assert success_at_step_limits(episodes + [traj("e", False, steps=4, status=Status.STEP_LIMIT)], [4, 6]) == \
        {"4": pytest.approx(1 / 4), "6": None}
    with pytest.raises(ValueError, match="step limit 0"):
        success_at_step_limits(episodes, [0])


def test_step_limits_equal_runs_with_that_limit():
    """A click_button desk task solved at step 2 (the click), declared done at step 4: recorded under a limit
    of 6 and scored at limits 1..4 with the desk replay, it gives what the engine gives when run with those
    limits; without the replay, the episode cut at 2 or 3 steps counts as a failure (the lower bound)."""
    task = click_task()
    responses = [WAIT, click(task, task.instruction.split('"')[1]), WAIT, DONE]
    actual = {}
    for limit in (6, 1, 2, 3, 4):
        with scripted_episodes(task, step_limit=limit) as run:
            actual[limit] = run(responses)
    full = actual[6]
    assert full.status == Status.DONE and len(full.steps) == 4 and full.success
    scorer = desk_replay_scorer([task], SCREEN, popups=False)
    exact = success_at_step_limits([full], [1, 2, 3, 4], scorer)
    assert exact == {str(L): float(actual[L].success) for L in (1, 2, 3, 4)}
    assert exact == {"1": 0.0, "2": 1.0, "3": 1.0, "4": 1.0}
    assert success_at_step_limits([full], [1, 2, 3, 4]) == {"1": 0.0, "2": 0.0, "3": 0.0, "4": 1.0}
    # a desk that is not the evaluation's is an error naming the task, not a wrong number
    tampered = Trajectory(full.task_id, full.instruction, [Step.text(full.steps[0].screenshot[::-1], WAIT)]
                          + full.steps[1:], full.reward, full.status, meta=full.meta)
    with pytest.raises(ValueError, match=f"task {task.id} .*step 1"):
        scorer(tampered, 3)


def test_checkpoint_diff_and_its_markdown():
    a = {"splits": {"train": {"per_task": {"t1": 0.0, "t2": 0.5, "t3": 0.25, "t4": 0.0, "t5": 1.0}},
                    "held_out": {"tasks": 0}, "only_a": {"per_task": {"x": 1.0}}}}
    b = {"splits": {"train": {"per_task": {"t1": 0.25, "t2": 0.0, "t3": 1.0, "t4": 0.0, "t6": 0.0}},
                    "held_out": {"per_task": {"h": 1.0}}}}
    diff = checkpoint_diff(a, b)
    assert set(diff) == {"train", "held_out"}
    assert diff["train"] == {"gained": ["t1"], "lost": ["t2"], "both_solved": ["t3"], "both_failed": ["t4"],
                             "only_in_a": ["t5"], "only_in_b": ["t6"]}
    assert diff["held_out"]["only_in_b"] == ["h"] and not diff["held_out"]["gained"]
    md = diff_markdown(diff, "base", "trained")
    assert "| train | 1 | 1 | 1 | 1 |" in md and "| held_out | 0 | 0 | 0 | 0 |" in md
    assert "**train, gained:** `t1`" in md and "**train, lost:** `t2`" in md
    assert "scored only in base:** `t5`" in md and "scored only in trained:** `t6`" in md


def _color_pixels(png: np.ndarray, hex_color: str) -> int:
    rgb = np.array([int(hex_color[i:i + 2], 16) for i in (1, 3, 5)])
    return int((np.abs(png[..., :3].astype(int) - rgb).max(-1) <= 8).sum())


def test_plot_curves_draws_one_line_per_report(tmp_path):
    base = {"splits": {"train": {"pass_curve": {"1": 0.2, "2": 0.3, "3": 0.35}}, "held_out": {"tasks": 0}}}
    trained = {"splits": {"train": {"pass_curve": {"1": 0.4, "2": 0.55, "3": 0.6},
                                    "success_at_step_limit": {"15": 0.3, "50": 0.5, "100": None}}}}
    path = plot_curves({"base": base, "trained": trained}, tmp_path / "pass.png")
    img = np.asarray(Image.open(path).convert("RGB"))
    assert img.shape == (360, 450, 3)  # one panel: held_out has no curve
    assert _color_pixels(img, "#1f77b4") > 50 and _color_pixels(img, "#ff7f0e") > 50  # matplotlib's C0, C1
    only_base = np.asarray(Image.open(plot_curves({"base": base}, tmp_path / "b.png")).convert("RGB"))
    assert _color_pixels(only_base, "#ff7f0e") == 0
    steps = plot_curves({"trained": trained}, tmp_path / "steps.png", key="success_at_step_limit",
                        xlabel="max steps", ylabel="success")
    assert steps.exists()
    with pytest.raises(ValueError, match="'success_at_step_limit'"):
        plot_curves({"base": base}, tmp_path / "none.png", key="success_at_step_limit")


def test_evaluate_into_keeps_episodes_page_and_step_limits(tmp_path):
    """The eval stage on a real desk with a scripted policy: the report keeps its keys and gains the pass
    curve and exact step-limit scores; the episodes land in a store beside it, one shard per split, and the
    inspector page beside that."""
    from envs.pool import DeskFactory, EnvPool
    from envs.tasks import generate_desk_tasks
    from guijax.data.store import TrajectoryStore
    from guijax.pipeline.base_stages import evaluate_into
    from guijax.rollout.engine import RolloutConfig, RolloutEngine
    from rollout_fakes import PromptPolicySampler, TextProcessor

    tasks = generate_desk_tasks(2, seed=5, families=["click_button"], screen_hw=SCREEN)
    solve = {t.instruction: [WAIT, click(t, t.instruction.split('"')[1]), DONE] for t in tasks[:1]}

    def respond(params, prompt):
        for instruction, responses in solve.items():
            if instruction in prompt:
                return responses[min(prompt.count("assistant:"), len(responses) - 1)]
        return WAIT

    pool = EnvPool(DeskFactory(SCREEN, step_limit=4, popups=False), 1, timeout_s=60)
    processor = TextProcessor()
    engine = RolloutEngine(pool, PromptPolicySampler(processor, respond), processor,
                           RolloutConfig(show_progress=False))
    config = types.SimpleNamespace(
        name="t", eval=types.SimpleNamespace(splits=("train", "held_out"), episodes_per_task=2, temperature=0.6,
                                             pass_k=(1,), step_limits=(2, 3, 4, 8), inspector_episodes=3),
        env=types.SimpleNamespace(kind="desk", screen=SCREEN, popups=False))
    run = types.SimpleNamespace(config=config, load_policy=lambda d: types.SimpleNamespace(params=None),
                                tasks=lambda: {"train": tasks[:1], "held_out": tasks[1:], "other": tasks},
                                evaluation_engine=lambda policy, temperature: contextlib.nullcontext(engine),
                                streams=types.SimpleNamespace(seed_for=lambda name: 7))
    try:
        headline = evaluate_into(run, tmp_path / "model", tmp_path / "eval_final.json")
        (tmp_path / "eval_final_trajectories" / "stale.array_record").write_bytes(b"")  # replaced by a rerun
        evaluate_into(run, tmp_path / "model", tmp_path / "eval_final.json")
    finally:
        pool.close()
    assert headline == "train 100.0%, held_out 0.0%"
    report = json.loads((tmp_path / "eval_final.json").read_text())
    train, held = report["splits"]["train"], report["splits"]["held_out"]
    assert {"tasks", "env_errors", "success_rate", "pass@1", "per_domain", "per_task"} <= set(train)
    assert train["pass_curve"] == {"1": 1.0, "2": 1.0} and held["pass_curve"] == {"1": 0.0, "2": 0.0}
    # solved by the click at step 2 (replayed exactly), declared done at 3; the held-out task waits until cut
    # at 4 steps, so a limit of 8 cannot be told from these episodes
    assert train["success_at_step_limit"] == {"2": 1.0, "3": 1.0, "4": 1.0, "8": 1.0}
    assert held["success_at_step_limit"] == {"2": 0.0, "3": 0.0, "4": 0.0, "8": None}
    assert train["step_limit_scoring"] == "replayed"
    assert report["trajectories"] == "eval_final_trajectories" and report["inspector"] == "eval_final.html"
    store = TrajectoryStore(tmp_path / "eval_final_trajectories")
    assert [p.name for p in store.shards] == ["held_out.array_record", "train.array_record"]
    assert sorted(t.meta["eval_split"] for t in store) == ["held_out"] * 2 + ["train"] * 2
    page = (tmp_path / "eval_final.html").read_text()
    # 3 of the 4 episodes: each task's first, then the train task's second
    assert page.count('class="episode"') == 3 and tasks[0].id in page and tasks[1].id in page
    assert "(3 of 4 episodes)" in page
    assert report["sampling"]["sampler"] == "PromptPolicySampler" and report["sampling"]["sample_s"] > 0
