"""The expert-guided recipe end to end on the tiny preset: expert stage (D_E, plans, D_conv), LEVEL-1 with
the expert-only split, several methods trained from one base policy, and the Table-1-style table."""
from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

from guijax import launch
from guijax.pipeline import base_stages as stages
from guijax.pipeline.registry import run_stages
from guijax.pipeline.run import Run
from guijax.data.store import TrajectoryStore
from guijax.plans import RulePlanExtractor, parse_numbered_plan

BEPA = ("stages=('base_model', 'tasks', 'expert', 'sft', 'level1', 'eval_base', 'methods', 'table', "
        "'diagnostics')", "sft.plan_fraction=0.5", "bepa.base_pass_k=1", "bepa.level1_rollouts=1",
        "arpo.selection_rollouts=2", "offline.steps=2", "offline.batch_trajectories=4", "sft.traces_per_task=1",
        "expert_sft.learning_rate=0.0",  # the SFT baseline must fine-tune at this rate, not sft.learning_rate
        "eval.splits=('expert_only', 'train', 'held_out')")
RL_METHODS = ("level2_only", "luffy")  # every method's own effect is checked in methods/test_every_method.py


@pytest.fixture(scope="module")
def make_config(tiny_config):
    def make(methods: tuple[str, ...], *overrides: str):
        return tiny_config("grpo_cpu", *BEPA, f"compare.methods={methods!r}", *overrides)

    return make


def _iterations(path: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if '"iteration"' in line]


@pytest.fixture(scope="module")
def expert_run(make_config, tmp_path_factory):
    """The tiny expert-guided recipe run once: two RL methods that bring expert data into their groups and
    the SFT baseline, all from one base policy."""
    config = make_config(RL_METHODS + ("sft",))
    workdir = tmp_path_factory.mktemp("bepa") / "run"
    run_stages(config, workdir)
    return config, workdir


@pytest.mark.slow
def test_expert_stage_solves_converts_and_plans_every_task(expert_run):
    _, workdir = expert_run
    expert = json.loads((workdir / "expert.json").read_text())["tasks"]
    assert len(expert) == 4 and all(v["success"] and v["plan"] for v in expert.values())
    converted = list(TrajectoryStore(workdir / "expert_traces"))
    assert sorted(t.task_id for t in converted) == sorted(expert)
    assert all(len(t.steps) == expert[t.task_id]["steps"] and t.reward == 1.0 for t in converted)


@pytest.mark.slow
def test_level1_expert_only_split_is_plan_solved_minus_base_solved(expert_run):
    _, workdir = expert_run
    level1 = json.loads((workdir / "level1.json").read_text())
    splits = json.loads((workdir / "splits.json").read_text())
    assert set(splits) == {"train", "held_out", "expert_only"} and level1["expert_only"] == splits["expert_only"]
    expected = sorted(k for k, n in level1["plan_conditioned_successes"].items()
                      if n > 0 and level1["base_successes"].get(k, 0) == 0)
    assert splits["expert_only"] == expected
    assert level1["d_self"] == len(TrajectoryStore(workdir / "level1_trajectories"))
    assert level1["d_self"] == sum(level1["plan_conditioned_successes"].values())


@pytest.mark.slow
def test_expert_mixing_methods_train_one_iteration_with_their_expert_data(expert_run):
    _, workdir = expert_run
    for name in RL_METHODS:
        records = _iterations(workdir / "methods" / name / "metrics.jsonl")
        assert [r["iteration"] for r in records] == [0], name
    # a random tiny policy fails everything: level2_only's cache (seeded with D_conv) must be injected
    l2 = _iterations(workdir / "methods/level2_only/metrics.jsonl")[0]
    assert l2["cache_injections"] >= 1 and l2["injected"] == l2["cache_injections"]
    assert l2["logp_injected"] < 0
    luffy = _iterations(workdir / "methods/luffy/metrics.jsonl")[0]
    assert luffy["injected"] == 2  # LUFFY adds the converted expert trace to every group (2 tasks)


@pytest.mark.slow
def test_table_rows_are_the_evaluations(expert_run):
    config, workdir = expert_run
    data = json.loads((workdir / "table.json").read_text())
    assert list(data) == ["base policy", *config.compare.methods]
    splits = json.loads((workdir / "splits.json").read_text())
    for name in config.compare.methods:
        report = json.loads((workdir / "methods" / name / "eval.json").read_text())["splits"]
        for split in ("train", "held_out"):  # a split without tasks has no rate
            expected = report[split]["success_rate"] if report[split]["tasks"] else None
            assert data[name][split] == pytest.approx(expected), (name, split)
        weights = {s: len(splits[s]) for s in ("train", "held_out") if report[s]["tasks"]}
        overall = sum(report[s]["success_rate"] * w for s, w in weights.items()) / sum(weights.values())
        assert data[name]["overall"] == pytest.approx(overall)
    table = (workdir / "table.md").read_text()
    assert all(f"| {name} |" in table for name in data) and "expert_only (" in table


@pytest.mark.slow
def test_sft_baseline_fine_tunes_at_its_own_rate(expert_run):
    _, workdir = expert_run
    sft = (workdir / "methods/sft/expert_sft_metrics.jsonl").read_text().splitlines()  # SFT baseline: 3 epochs, no RL
    assert len(sft) >= 3 and not (workdir / "methods/sft/metrics.jsonl").exists()
    from safetensors.numpy import load_file
    base, tuned = load_file(workdir / "sft_model/model.safetensors"), load_file(workdir / "methods/sft/trained_model/model.safetensors")
    assert base.keys() == tuned.keys() and all(np.array_equal(base[k], tuned[k]) for k in base)  # lr 0


@pytest.mark.slow
def test_diagnostics_compare_token_probabilities_to_the_base_policy(expert_run):
    _, workdir = expert_run
    diag = json.loads((workdir / "diagnostics.json").read_text())
    assert diag["D_conv"]["tokens"] > 0 and 0.0 <= diag["D_conv"]["tail_mass_p_lt_0.2"] <= 1.0
    assert diag["on_policy"]["js_to_on_policy"] == pytest.approx(0.0, abs=1e-12)
    during = diag["_expert_only_on_policy_during_training"]
    assert set(during) == set(RL_METHODS)  # the RL methods; sft has no rollouts
    assert all(0 <= n["successes"] <= n["episodes"] for n in during.values())
    same = diag["_D_self_vs_D_conv"]
    assert 0 <= same["same_as_reference"] <= same["trajectories"] <= len(TrajectoryStore(workdir / "level1_trajectories"))
    assert (workdir / "diagnostics.png").exists() and (workdir / "curves_methods.png").exists()


@pytest.mark.slow
def test_changed_evaluation_re_evaluates_without_retraining(expert_run, make_config, capsys):
    config, workdir = expert_run
    model = workdir / "methods/luffy/trained_model/model.safetensors"
    trained_at = model.stat().st_mtime_ns
    old_eval = (workdir / "methods/luffy/eval.json").read_text()
    capsys.readouterr()
    run_stages(make_config(config.compare.methods, "eval.episodes_per_task=2"), workdir)
    out = capsys.readouterr().out
    assert "eval.episodes_per_task 1 -> 2" in out and "training it again" not in out
    assert model.stat().st_mtime_ns == trained_at  # the trained policy is reused
    assert json.loads((workdir / "methods/luffy/eval.json").read_text())["episodes_per_task"] == 2
    stale = sorted((workdir / "stale").glob("methods_luffy_eval-*/methods/luffy/eval.json"))
    assert len(stale) == 1 and stale[0].read_text() == old_eval


def test_divergence_and_tail_mass():
    from guijax import diagnostics as diag

    p = diag.histogram(np.array([0.01, 0.02, 0.96, 0.97]))
    assert p.sum() == pytest.approx(1.0) and p[0] == pytest.approx(0.5) and p[-1] == pytest.approx(0.5)
    assert diag.tail_mass(np.array([0.1, 0.3, 0.15, 0.9])) == 0.5
    assert diag.js_divergence(p, p) == pytest.approx(0.0)
    disjoint = diag.js_divergence(np.array([1.0, 0.0]), np.array([0.0, 1.0]))
    assert disjoint == pytest.approx(np.log(2))


def test_same_responses_and_on_policy_successes():
    from guijax import diagnostics as diag
    from guijax.rollout.trajectory import Source, Step, Trajectory

    def traj(task: str, *responses: str) -> Trajectory:
        empty = np.zeros((0,), np.int32)
        return Trajectory(task, "i", [Step(np.zeros((1, 1, 3), np.uint8), r, empty, empty.astype(np.float32))
                                      for r in responses])

    refs = {"a": traj("a", "x", "y"), "b": traj("b", "z")}
    rolled = [traj("a", "x", "y"), traj("a", "x", "q"), traj("a", "x"), traj("b", "z"), traj("c", "z")]
    assert diag.same_responses(rolled, refs) == {"trajectories": 4, "same_as_reference": 2}
    assert diag.same_responses([], refs) == {"trajectories": 0, "same_as_reference": 0}

    won, lost, injected = traj("a", "x"), traj("a", "x"), traj("a", "x")
    won.reward = injected.reward = 1.0
    injected.source = Source.CACHE
    other = traj("c", "x")
    other.reward = 1.0
    assert diag.on_policy_successes([won, lost, injected, other], {"a", "b"}) == {"episodes": 2, "successes": 1}


def test_recipe_errors_name_the_key_before_any_work(tmp_path, make_config):
    from guijax.pipeline.registry import check_recipe

    with pytest.raises(ValueError, match=r"unknown method 'bepa3' in compare.methods; did you mean bepa"):
        check_recipe(make_config(("grpo", "bepa3")))
    config = make_config(("luffy",))
    config.unlock()
    config.train.loss = "grpo"  # LUFFY's groups with the GRPO loss: refused, not silently trained
    with pytest.raises(ValueError, match=r"'luffy' cannot train with train.loss='grpo'"):
        check_recipe(config)
    config.train.loss = ""
    config.stages = tuple(s for s in config.stages if s != "expert")
    with pytest.raises(ValueError, match=r"method 'luffy' \(compare.methods\) reads the output of stage\(s\) \['expert'\]"):
        check_recipe(config)
    arpo = launch.resolve("grpo_cpu", ["method=arpo"])
    with pytest.raises(ValueError, match=r"'arpo' \(method\) reads the output of stage\(s\) \['select'\]"):
        check_recipe(arpo)


def test_rule_plan_extractor_drops_dynamic_ui_and_keeps_effective_steps():
    from envs.desk import DeskEnv, ScriptedExpert, run_expert
    from envs.tasks import generate_desk_tasks

    task = generate_desk_tasks(1, seed=3, families=["choose_option"])[0]
    env = DeskEnv(seed=1, popups=True)
    plans = []
    for seed in range(6):  # some episodes open with a pop-up the expert closes first
        trace = run_expert(env, task, ScriptedExpert(seed=seed))
        assert trace.reward == 1.0
        plans.append(RulePlanExtractor()(trace))
    assert all(p == plans[0] for p in plans), plans  # pop-ups never reach the plan
    assert len(plans[0]) == 2 and plans[0][0].startswith("Click") and "pop-up" not in " ".join(plans[0])
    assert parse_numbered_plan("Task: x\n1. Click A\n2) Type \"b\"\nnot a step") == ["Click A", 'Type "b"']


def test_expert_stage_reads_recorded_traces(tmp_path, make_config):
    from envs.desk import DeskEnv, ScriptedExpert, run_expert

    config = make_config(("grpo",))
    run = Run(config, tmp_path / "run")
    stages.tasks.fn(run)
    from guijax.pipeline.expert_stages import expert

    tasks = run.all_tasks()
    env = DeskEnv(seed=0, popups=False)
    for task in tasks[:3]:  # the fourth task has no recorded trace
        run_expert(env, task, ScriptedExpert(seed=1)).save(tmp_path / "traces" / task.id)
    config.unlock()
    config.bepa.expert_dir = str(tmp_path / "traces")
    expert.fn(run)
    results = json.loads((tmp_path / "run" / "expert.json").read_text())["tasks"]
    assert [results[t.id]["success"] for t in tasks] == [True, True, True, False]
    assert len(TrajectoryStore(tmp_path / "run" / "expert_traces")) == 3
    config.bepa.expert_dir = str(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="nowhere"):
        from guijax.pipeline.expert_stages import load_recorded_traces

        load_recorded_traces(config.bepa.expert_dir)


def test_expert_stage_writes_the_grammar_the_policy_is_prompted_in(tmp_path, make_config):
    from guijax.pipeline.expert_stages import expert

    config = make_config(("grpo",), "rollout.prompt=computer_use_compact")
    run = Run(config, tmp_path / "run")
    stages.tasks.fn(run)
    expert.fn(run)
    converted = list(TrajectoryStore(tmp_path / "run" / "expert_traces"))
    assert converted and all("<tool_call>" in s.response and "Thought:" not in s.response
                             for t in converted for s in t.steps)


@pytest.mark.parametrize("name,devices", [("grpo_gpu", 1), ("grpo_tpu", 64), ("bepa_gpu", 1), ("bepa_tpu", 64)])
def test_accelerator_recipes_dry_run(name, devices):
    from guijax.launch import dry_run

    report = dry_run(launch.resolve(name, []))
    assert report["params"] == 8_292_166_656 and report["param_dtype"] == "bfloat16"
    assert report["mesh"]["data"] * report["mesh"]["fsdp"] * report["mesh"]["tensor"] == devices


def test_osworld_env_without_servers_is_refused(tmp_path):
    config = launch.resolve("grpo_gpu", ["env.server_urls=()"])
    with pytest.raises(ValueError, match="server_urls"):
        Run(config, tmp_path).pool()


def test_compare_aggregates_mean_and_std_over_seeds():
    from guijax.compare import aggregate, markdown

    tables = [{"base policy": {"train": 0.2, "overall": 0.1, "expert_only": None},
               "bepa": {"train": 0.6, "overall": 0.4}},
              {"base policy": {"train": 0.4, "overall": 0.3}, "bepa": {"train": 0.8, "overall": 0.5}}]
    result = aggregate(tables)
    assert result["base policy"]["train"] == {"mean": pytest.approx(0.3), "std": pytest.approx(0.1), "n": 2}
    assert "expert_only" not in result["base policy"]
    text = markdown(result, [0, 1])
    assert "| bepa | – | 70.0 ± 10.0 | – | 45.0 ± 5.0 |" in text


def test_compare_cli_names_unknown_methods(tmp_path):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "guijax.compare", "--config=bepa_cpu", "--seeds=0",
                           "--methods=grpo,bepa9", f"--workdir={tmp_path}"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "bepa9" in proc.stderr


@pytest.mark.slow  # 27 s: DPO's objective is checked in the default suite (test_losses)
def test_dpo_starts_at_log2_and_learns_the_preference(tmp_path, make_config):
    import dataclasses as dc

    from guijax.offline import dpo_pairs, preference_train
    from guijax.trainer import pipeline_config

    config = make_config(("grpo",))
    run = Run(config, tmp_path / "run")
    stages.base_model.fn(run)
    stages.tasks.fn(run)
    wins = stages.expert_trajectories(run, run.tasks()["train"][:2])
    fails = [dc.replace(t, reward=0.0, steps=[dc.replace(s, response="Thought: no.\nAction: wait()") for s in t.steps])
             for t in wins]
    rollouts = wins + fails
    assert [(w.task_id, l.reward) for w, l in dpo_pairs(rollouts)] == [(w.task_id, 0.0) for w in wins]
    policy = run.load_policy(run.base_model_dir)
    config.unlock()
    _, history = preference_train(policy, "dpo", rollouts, config, pipeline_config(config, run.system_prompt), 6, 4,
                                  learning_rate=3e-3)
    assert history[0] == pytest.approx(np.log(2), abs=1e-4)  # policy == reference: margin 0
    assert history[-1] < history[0] - 0.05
    with pytest.raises(ValueError, match="no task has both"):
        preference_train(policy, "dpo", wins, config, pipeline_config(config, run.system_prompt), 1, 4)
    run.close()


@pytest.mark.slow
def test_bepa_splits_train_on_the_solvable_pool(tmp_path, make_config):
    config = make_config(("grpo",))
    config.unlock()
    config.env.num_tasks = 6
    config.bepa.train_fraction = 0.5
    config.bepa.extra_train_tasks = 0
    run = Run(config, tmp_path / "run")
    from guijax.pipeline.expert_stages import bepa_splits, expert

    for step in (stages.base_model, stages.tasks, expert, bepa_splits):
        step.fn(run)
    info = json.loads((tmp_path / "run" / "bepa_splits.json").read_text())
    splits = json.loads((tmp_path / "run" / "splits.json").read_text())
    assert len(info["solvable_pool"]) == 6  # the scripted expert solves every desk task
    assert len(splits["train"]) == 3 and len(splits["held_out"]) == 3
    assert set(splits["train"]) | set(splits["held_out"]) == set(info["solvable_pool"])
    assert (tmp_path / "run" / "splits_initial.json").exists()
    run.close()


@pytest.mark.slow
def test_trajectory_scores_are_mean_token_logprobs(tmp_path, make_config):
    from guijax import diagnostics as diag
    from guijax.train_step import make_logprob_fn
    from guijax.trainer import pipeline_config

    config = make_config(("grpo",))
    run = Run(config, tmp_path / "run")
    stages.base_model.fn(run)
    stages.tasks.fn(run)
    trajs = stages.expert_trajectories(run, run.tasks()["train"][:2])
    policy = run.load_policy(run.base_model_dir)
    fn, pipe = make_logprob_fn(policy.module), pipeline_config(config, run.system_prompt)
    args = (policy.processor, policy.module.cfg, pipe)
    scores = diag.mean_trajectory_logps(fn, policy.params, trajs, *args)
    for traj, score in zip(trajs, scores):  # each equals the log of its tokens' geometric-mean probability
        probs = diag.token_probabilities(fn, policy.params, [traj], *args)
        assert score == pytest.approx(float(np.mean(np.log(probs))), rel=1e-4) and score < 0
    assert scores[0] != pytest.approx(scores[1])
    run.close()


def test_compare_all_means_every_method_the_recipes_stages_can_feed():
    from guijax import launch
    from guijax.compare import feedable_methods
    from guijax.methods import REGISTRY

    stages = launch.resolve("bepa_cpu", []).stages
    plain = feedable_methods(stages, REGISTRY)
    assert "bepa" in plain and not {"arpo", "rft", "dpo", "kto"} & set(plain)  # bepa_cpu runs no select stage
    with_select = feedable_methods(tuple(stages) + ("select",), REGISTRY)
    assert {"arpo", "rft", "dpo", "kto"} <= set(with_select) and set(plain) < set(with_select)


def test_compare_aggregates_tables_already_run_without_running(tmp_path):
    """`--aggregate_only`: the seeds' tables as they lie in WORKDIR/seed_N, nothing run; a missing seed or a
    table without one of the methods is named."""
    import json

    from guijax import compare

    for seed, rate in ((0, 0.5), (1, 1.0)):
        (tmp_path / f"seed_{seed}").mkdir()
        (tmp_path / f"seed_{seed}" / "table.json").write_text(json.dumps(
            {"base policy": {"train": 0.25, "held_out": 0.0, "overall": 0.2}, "grpo": {"train": rate, "overall": rate}}))
    assert compare.tabled_methods(tmp_path, [0, 1]) == ["grpo"]  # `--methods=all` with --aggregate_only
    result = compare.run("grpo_cpu", [], [0, 1], ["grpo"], tmp_path, aggregate_only=True)
    assert result["grpo"]["train"] == {"mean": 0.75, "std": 0.25, "n": 2}
    assert "| grpo | – | 75.0 ± 25.0 |" in (tmp_path / "compare.md").read_text()
    with pytest.raises(ValueError, match="no .*seed_2/table.json"):
        compare.run("grpo_cpu", [], [0, 2], ["grpo"], tmp_path, aggregate_only=True)
    with pytest.raises(ValueError, match=r"has no row for \['bepa'\]"):
        compare.run("grpo_cpu", [], [0, 1], ["grpo", "bepa"], tmp_path, aggregate_only=True)
