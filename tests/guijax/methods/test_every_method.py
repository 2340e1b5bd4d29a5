"""Every registered method trained through the real trainer for one iteration on the tiny recipe, each
checked for its own effect: the trace it injects, the rows it adds, the tasks it keeps, the fine-tuning it
does before (or instead of) RL.

The tiny base policy fails every task, so the stages that would record its successes (LEVEL-1's D_self,
ARPO's selection rollouts) are written here from the scripted expert's converted traces, as if the base
policy had rolled them. ARPO's replay of its own successes needs an on-policy success, which this policy
never samples; the replay itself is tested on the hook (test_hooks.py)."""
from __future__ import annotations

import copy
import dataclasses
import json
import pathlib

import jax
import numpy as np
import pytest

from guijax import compilation_cache
from guijax.data.store import TrajectoryStore
from guijax.methods import get_method, method_names
from guijax.pipeline import base_stages, expert_stages
from guijax.pipeline.run import Run

EVERY = ("stages=('base_model', 'tasks', 'expert', 'sft')", "env.num_tasks=6",
         "offline.steps=2", "offline.batch_trajectories=4", "expert_sft.epochs=1", "expert_sft.learning_rate=1e-3",
         "offline.learning_rate=1e-3", "evocua.rft_steps=2", "evocua.dpo_steps=2", "evocua.batch_trajectories=4",
         "evocua.rft_learning_rate=1e-3", "evocua.dpo_learning_rate=1e-3", "sgcd.rollouts_per_task=1",
         "sgcd.max_handoff=2", "sgcd.sft_steps=2", "sgcd.batch_trajectories=4", "sgcd.learning_rate=1e-3",
         "seagent.episodes_per_task=1", "seagent.group_size=2", "seagent.update_epochs=2", "seagent.batch_rows=8",
         "seagent.learning_rate=1e-3", "seagent.curriculum=desk", "seagent.tasks_per_phase=2", "evocua.rounds=1",
         "evocua.budgets=(1, 2)", "evocua.thresholds=(1.0, 0.5)")


@pytest.fixture(scope="module")
def prepared(tiny_config, tmp_path_factory):
    """A tiny run with the base policy and D_conv, plus the level1 and select outputs the methods read."""
    workdir = tmp_path_factory.mktemp("every") / "run"
    compilation_cache.enable(str(workdir.parent / "xla"))  # the methods share their compiled programs
    config = tiny_config("grpo_cpu", *EVERY)
    run = Run(config, workdir)
    for step in (base_stages.base_model, base_stages.tasks, expert_stages.expert, base_stages.sft):
        step.fn(run)
    train = run.tasks()["train"]
    d_conv = run.expert_traces()
    d_self = [dataclasses.replace(d_conv[t.id], plan=("follow the plan",)) for t in train[:2]]
    expert_stages._write_shard(workdir / "level1_trajectories", "d_self", d_self)
    splits = json.loads((workdir / "splits.json").read_text())
    (workdir / "splits.json").write_text(json.dumps(splits | {"expert_only": []}))
    fails = [dataclasses.replace(t, reward=0.0, steps=[dataclasses.replace(s, response="Thought: no.\nAction: wait()")
                                                       for s in t.steps]) for t in d_conv.values()]
    expert_stages._write_shard(workdir / "selection_rollouts", "rollouts", list(d_conv.values()) + fails)
    # the budget stage's episodes: the expert's successes, and failures that wait twice on the first screen
    # where the expert acted (a critical forking point at step 0 whose wrong action changed nothing)
    waits = [dataclasses.replace(t, reward=0.0, steps=[
        dataclasses.replace(t.steps[0], response="Thought: wait.\nAction: wait()", actions=["WAIT"])] * 2)
        for t in d_conv.values()]
    expert_stages._write_shard(workdir / "budget_rollouts", "rollouts", list(d_conv.values()) + waits)
    valuable = [train[0].id]
    (workdir / "valuable_tasks.json").write_text(json.dumps({"rollouts_per_task": 1, "valuable": valuable}))
    run.forget_tasks()
    yield config, run, {"d_self": {t.task_id for t in d_self}, "valuable": set(valuable)}
    run.close()


def _train(prepared, name: str):
    config, run, planted = prepared
    method = get_method(name, config)
    workdir = run.workdir / "methods" / name
    workdir.mkdir(parents=True, exist_ok=True)
    policy, history = base_stages.train_with(run, method, workdir, name)
    return run, workdir, policy, history, planted


def _episodes(workdir: pathlib.Path) -> list:
    return list(TrajectoryStore(workdir / "trajectories"))


def _moved(run: Run, policy) -> float:
    """Largest parameter change from the base policy."""
    base = run.load_policy(base_stages.policy_dir(run)).params
    return max(float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))))
               for a, b in zip(jax.tree.leaves(base), jax.tree.leaves(policy.params)))


# methods whose run needs its own setup, each with its own test below: seagent_s2g needs seagent.apps and a judge
# that finds successes the tiny policy never makes
OWN_TEST = {"seagent_s2g": "test_seagent_s2g_trains_a_specialist_per_application_then_the_generalist"}


def test_every_registered_method_is_covered_here():
    assert set(method_names()) == set(EFFECTS) | set(OWN_TEST)
    assert not set(EFFECTS) & set(OWN_TEST) and all(name in globals() for name in OWN_TEST.values())


def _no_expert_data(run, workdir, policy, history, planted):
    (r,) = history
    assert r["injected"] == 0 and r["episodes"] == 4
    assert all(t.source.value == "on_policy" for t in _episodes(workdir))


def _arpo(run, workdir, policy, history, planted):
    (r,) = history
    assert {t.task_id for t in _episodes(workdir)} == planted["valuable"]  # trains on the valuable task only
    assert r["replay_injections"] == 0 and r["replay_buffered"] == 0  # no success yet to replay


def _cache(seeded: str):
    def check(run, workdir, policy, history, planted):
        (r,) = history
        sampled = {t.task_id for t in _episodes(workdir)}
        seeds = planted["d_self"] if seeded == "d_self" else set(run.expert_traces())
        # every group fails, so each sampled task with a cache entry gets its cached trace in slot 0
        assert r["cache_injections"] == len(sampled & seeds) >= 1 and r["injected"] == r["cache_injections"]
        assert r["cache_size"] == len(seeds)
    return check


def _expert(count_per_task: int, extra_rows: bool):
    def check(run, workdir, policy, history, planted):
        (r,) = history
        assert r["expert_injections"] == 2 * count_per_task  # two tasks per iteration, every one has D_conv
        assert r["injected"] == 2 * count_per_task
        if extra_rows:  # RL+SFT: cross-entropy rows beside the groups, with their own loss term
            assert r["sft_ce"] > 0
    return check


def _fine_tuned(metrics_file: str, rl: bool):
    def check(run, workdir, policy, history, planted):
        lines = [json.loads(x) for x in (workdir / metrics_file).read_text().splitlines()]
        assert lines and _moved(run, policy) > 0
        assert len(history) == (1 if rl else 0) and (workdir / "trajectories").exists() == rl
    return check


def _preference(loss_key: str):
    def check(run, workdir, policy, history, planted):
        lines = [json.loads(x) for x in (workdir / "offline_metrics.jsonl").read_text().splitlines()]
        assert len(lines) == 2 and loss_key in lines[0] and history == []
        assert _moved(run, policy) > 0
    return check


def _evocua(phases: tuple[str, ...]):
    def check(run, workdir, policy, history, planted):
        lines = [json.loads(x) for x in (workdir / "offline_metrics.jsonl").read_text().splitlines()]
        assert history == [] and _moved(run, policy) > 0
        if "rft" in phases:
            (counts,) = [m for m in lines if "rft_steps_total" in m]
            assert counts["rft_trajectories"] > 0 and counts["rft_steps_total"] > 0
            assert sum("sft_loss" in m for m in lines) == 2
        if "dpo" in phases:
            pairs = json.loads((workdir / "step_dpo_pairs.json").read_text())
            # every failure waits where its task's success acted: one correction and one reflection each
            assert pairs["action_correction_pairs"] == pairs["reflection_pairs"] == pairs["failures"] > 0
            assert sum("dpo_loss" in m for m in lines) == 2
    return check


def _sgcd(continuations: bool):
    """The tiny policy fails every task: each gets a skill (unless the control), none is recoverable by this
    policy, and Stage IV trains on D_exp."""
    def check(run, workdir, policy, history, planted):
        (report,) = [json.loads(p.read_text()) for p in workdir.glob("round_*/round.json")]
        train = len(run.tasks()["train"])
        assert report["failed_tasks"] == train and report["skills"] == (train if continuations else 0)
        assert report["d_exp"] == train and report["supervised_steps"] > 0 and report["sft_loss_last"] is not None
        skills = json.loads((workdir / "round_1" / "skills.json").read_text())["skills"]
        assert all(len(s["Continuation Plans"]) > 0 for s in skills.values())
        assert history == [] and _moved(run, policy) > 0
    return check


def _seagent(run, workdir, policy, history, planted):
    """The tiny policy fails every task: the oracle judges every episode incorrect, its erring steps become
    failure rows, and the update's first pass (at θ = π_ref) pushes their log-probs below the reference's."""
    (report,) = [json.loads(p.read_text()) for p in workdir.glob("phase_*/phase.json")]
    assert report["episodes"] == len(run.tasks()["train"]) and report["verified_successes"] == 0
    assert report["judged_correct"] == 0 and report["judge_npv"] == 1.0
    assert report["a_F"] >= 1 and report["failure_rows"] == report["a_F"] and report["update_steps"] == 2
    # the state-change captions of every judged episode, one per replayed step
    assert all(j["captions"] and j["captions"][0].startswith("Step 1: ") for j in report["judgments"])
    lines = [json.loads(x) for x in (workdir / "seagent_metrics.jsonl").read_text().splitlines()]
    ratios = [m["update_failure_logratio"] for m in lines if "update_failure_logratio" in m]
    assert len(ratios) == 2 and abs(ratios[0]) < 1e-3 and ratios[1] < ratios[0]
    # the desk curriculum's next task set: a retry of a judged failure, then one new task; the guidebook
    nxt = json.loads((workdir / "phase_1" / "curriculum.json").read_text())
    assert nxt["phase"] == 2 and len(nxt["tasks"]) == 2 and nxt["tasks"][0]["id"] in {t.id for t in run.tasks()["train"]}
    assert report["next_tasks"] == 2 and "learning, judged correct 0/" in report["guidebook"]
    assert history == [] and _moved(run, policy) > 0


def _cycle(run, workdir, policy, history, planted):
    """The tiny policy fails every task: the round spends the whole ladder on each, finds no success to
    fine-tune on and no forking point, says so, and leaves the policy as it was (tests/guijax/evocua/test_cycle.py
    trains both phases on scripted rollouts)."""
    (report,) = json.loads((workdir / "rounds.json").read_text())
    train = len(run.tasks()["train"])
    assert report["start_success"] == 0.0 and report["episodes"] == 2 * train and report["exhausted"] == train
    assert "no success" in report["rft_skipped"] and "no critical forking point" in report["step_dpo_skipped"]
    assert history == [] and _moved(run, policy) == 0


EFFECTS = {
    "grpo": _no_expert_data,
    "arpo": _arpo,
    "bepa": _cache("d_self"),
    "level1_only": _cache("d_self"),
    "level2_only": _cache("d_conv"),
    "trace_replacement": _expert(1, extra_rows=False),
    "luffy": _expert(1, extra_rows=False),
    "rl_sft": _expert(1, extra_rows=True),
    "sft": _fine_tuned("expert_sft_metrics.jsonl", rl=False),
    "sft_rl": _fine_tuned("expert_sft_metrics.jsonl", rl=True),
    "rft": _fine_tuned("offline_metrics.jsonl", rl=False),
    "dpo": _preference("dpo_loss"),
    "kto": _preference("kto_z0"),
    "evocua_rft": _evocua(("rft",)),
    "evocua_dpo": _evocua(("dpo",)),
    "evocua": _evocua(("rft", "dpo")),
    "sgcd": _sgcd(True),
    "sgcd_no_continuations": _sgcd(False),
    "sgcd_full_supervision": _sgcd(True),
    "seagent": _seagent,
    "evocua_cycle": _cycle,
    "step0": _no_expert_data,
    "grpo_final_step": _no_expert_data,
}


# DPO and KTO compile their own preference step (about 20 s each): they run with -m slow, and the default suite
# checks the DPO objective in test_bepa_recipe.py and both losses in test_losses.py; SGCD's two variants differ
# from `sgcd` only in what Stage IV trains on (tests/guijax/sgcd/test_round.py); the variants of a method the
# default suite covers (LEVEL-1 / LEVEL-2 of `bepa`, trace replacement and RL+SFT of `luffy`'s expert rows, SFT
# then RL of `sft`) run with -m slow to keep CI within its budget. So do EvoCUA's methods (`evocua` alone is 100 s:
# its SFT and DPO steps compile; pair mining and denoising are tested in tests/guijax/evocua/, the cycle's rounds
# in test_cycle.py) and STEP0 and its final-step baseline, whose rows and normalisers tests/guijax/test_objectives.py
# checks (the tiny policy's groups all fail, so here they train nothing)
SLOW = {"dpo", "kto", "evocua_dpo", "sgcd_no_continuations", "sgcd_full_supervision", "level1_only", "level2_only",
        "trace_replacement", "rl_sft", "sft_rl", "evocua_rft", "evocua", "evocua_cycle", "step0", "grpo_final_step"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in sorted(EFFECTS)])
def test_method_trains_with_its_own_effect(prepared, name):
    EFFECTS[name](*_train(prepared, name))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["bepa", "luffy"])
def test_hooks_inject_their_rows_with_asynchronous_rollouts(prepared, name):
    """BEPA's cache and LUFFY's expert traces reach the groups the learner takes from the rollout stream, and
    LUFFY's injected rows keep importance weight 1 in the behaviour-corrected loss."""
    config, run, planted = prepared
    config = copy.deepcopy(config)
    with config.unlocked():
        config.rollout.mode = "async"
    method = get_method(name, config)
    workdir = run.workdir / "methods" / f"{name}_async"
    _, history = base_stages.train_with(run, method, workdir, name)
    (r,) = history
    assert r["policy_version"] == 0 and len(r["groups"]) == 2
    injected = r["cache_injections"] if name == "bepa" else r["expert_injections"]
    assert injected >= 1 and r["injected"] == injected
    assert r["behaviour_weight_mean"] > 0  # an update ran through the corrected loss
    # version 0 sampled every row with the parameters the learner scores them under, in fp32: the sampler's
    # log-probs are the learner's but for the 4 vision placeholders it never samples, which this random tiny
    # model gives ~4/vocab of its mass (measured: 0.0035 nats per token; a wrong prompt costs far more)
    assert 0 <= r["behaviour_logp_abs_diff"] < 0.01 and 0 <= r["behaviour_kl"] < 1e-4


@pytest.mark.slow
def test_sgcd_resumes_after_its_last_finished_round(prepared, capsys):
    """A second run with one more round restores round 1's policy and runs round 2 only."""
    config, run, _ = prepared
    workdir = run.workdir / "methods" / "sgcd_resume"
    workdir.mkdir(parents=True, exist_ok=True)
    first = get_method("sgcd", config)
    base_stages.train_with(run, first, workdir, "sgcd")
    written = (workdir / "round_1" / "round.json").stat().st_mtime_ns
    two = copy.deepcopy(config)
    two.sgcd.rounds = 2
    capsys.readouterr()
    policy, _ = base_stages.train_with(run, get_method("sgcd", two), workdir, "sgcd")
    assert "resuming after round 1 of 2" in capsys.readouterr().out
    assert (workdir / "round_1" / "round.json").stat().st_mtime_ns == written  # round 1 was not run again
    assert json.loads((workdir / "round_2" / "round.json").read_text())["round"] == 2
    assert _moved(run, policy) > 0


@pytest.mark.slow
def test_seagent_resumes_after_its_last_finished_phase(prepared, capsys):
    """A second run with one more phase restores phase 1's policy and runs phase 2 only."""
    config, run, _ = prepared
    workdir = run.workdir / "methods" / "seagent_resume"
    workdir.mkdir(parents=True, exist_ok=True)
    base_stages.train_with(run, get_method("seagent", config), workdir, "seagent")
    written = (workdir / "phase_1" / "phase.json").stat().st_mtime_ns
    two = copy.deepcopy(config)
    two.seagent.phases = 2
    capsys.readouterr()
    base_stages.train_with(run, get_method("seagent", two), workdir, "seagent")
    assert "resuming after phase 1 of 2" in capsys.readouterr().out
    assert (workdir / "phase_1" / "phase.json").stat().st_mtime_ns == written  # phase 1 was not run again
    assert json.loads((workdir / "phase_2" / "phase.json").read_text())["phase"] == 2


@pytest.mark.slow  # ~1 min: rollouts on fresh tasks, two judge steps, three evaluations, two phases
def test_seagent_trains_its_world_state_model_then_judges_with_it(prepared, capsys):
    """seagent.judge='trained': before phase 1 a LoRA judge is tuned on the ground truth's judgments and change
    descriptions of the base policy's episodes on fresh tasks, and scored on other fresh tasks' episodes beside
    the untrained model and the oracle; the phases judge with it; a rerun loads it instead of training again."""
    config, run, _ = prepared
    trained = copy.deepcopy(config)
    for key, value in {"judge": "trained", "judge_tasks": 2, "judge_eval_tasks": 2, "judge_episodes_per_task": 1,
                       "judge_steps": 2, "judge_batch_size": 2, "judge_lora_rank": 4, "judge_max_new_tokens": 16,
                       "judge_retries": 0, "judge_length_buckets": (512, 1024, 2048)}.items():
        setattr(trained.seagent, key, value)
    workdir = run.workdir / "methods" / "seagent_trained_judge"
    base_stages.train_with(run, get_method("seagent", trained), workdir, "seagent")
    folder = workdir / "world_state_model"
    report = json.loads((folder / "judge_eval.json").read_text())
    assert [r["judge"].split(" (")[0].split(",")[0] for r in report["rows"]] == [
        "base model", "World State Model", "desk oracle"]
    assert report["evaluation_episodes"] == 2 and len(report["losses"]) == 2
    # a judgment per episode, and a change description per step the tiny policy's parsable answers took
    assert report["training_examples"] >= report["training_episodes"] == 2
    assert report["rows"][2]["accuracy"] == 1.0 and report["rows"][1]["trajectories"] == 2
    assert (folder / "model" / "config.json").exists() and "| judge |" in (folder / "judge_eval.md").read_text()
    phase = json.loads((workdir / "phase_1" / "phase.json").read_text())
    # 16 new tokens hold no res_dict: every episode of the phase was judged by the trained model, unreadably
    assert phase["judge_unreadable"] == phase["episodes"] > 0 and phase["a_T"] == phase["a_F"] == 0
    written = (folder / "judge_eval.json").stat().st_mtime_ns
    two = copy.deepcopy(trained)
    two.seagent.phases = 2
    capsys.readouterr()
    base_stages.train_with(run, get_method("seagent", two), workdir, "seagent")
    out = capsys.readouterr().out  # loaded, not trained (nor evaluated) again
    assert "world state model: 2/2 steps" not in out  # (phase 2 judges with it)
    assert (folder / "judge_eval.json").stat().st_mtime_ns == written
    assert json.loads((workdir / "phase_2" / "phase.json").read_text())["judge_unreadable"] > 0
    # stopped during its evaluation: the next run evaluates the tuned model again, without retraining it
    (folder / "judge_eval.json").unlink()
    tuned = (folder / "model" / "model.safetensors").stat().st_mtime_ns
    longer = copy.deepcopy(two)  # a changed setting neither retrains nor renames the judge it tuned
    longer.seagent.judge_steps = 7
    base_stages.train_with(run, get_method("seagent", longer), workdir, "seagent")
    out = capsys.readouterr().out
    assert "tuned in an earlier run" in out and "world state model: judging" in out
    assert "world state model: 7/7 steps" not in out
    assert (folder / "model" / "model.safetensors").stat().st_mtime_ns == tuned
    again = json.loads((folder / "judge_eval.json").read_text())
    assert again["losses"] == report["losses"] and again["rows"] == report["rows"]
    # a folder from before training.json was written: its model and evaluation are loaded as they are
    (folder / "training.json").unlink()
    evaluated = (folder / "judge_eval.json").stat().st_mtime_ns
    base_stages.train_with(run, get_method("seagent", longer), workdir, "seagent")
    out = capsys.readouterr().out
    assert "world state model" not in out and (folder / "judge_eval.json").stat().st_mtime_ns == evaluated


def _train_with_chat_curriculum(config, run, gen_url: str, judge_url: str, name: str, env_kind: str = "desk"):
    """SEAgent with the LLM curriculum at `gen_url` and the chat judge at `judge_url`, trained into its own
    folder of the run (returned); `env_kind` is what the method is told the environments are."""
    config = copy.deepcopy(config)
    with config.unlocked():
        config.env.kind = env_kind
        config.seagent.update(curriculum="chat", curriculum_url=gen_url, curriculum_model="qwen2.5-72b",
                              curriculum_api_key_env="", judge="chat", chat_url=judge_url, chat_model="wsm",
                              chat_api_key_env="", tasks_per_phase=4)
    workdir = run.workdir / "methods" / name
    workdir.mkdir(parents=True, exist_ok=True)
    base_stages.train_with(run, get_method("seagent", config), workdir, "seagent")
    return workdir


def test_seagent_runs_the_llm_curriculums_tasks(prepared):
    """seagent.curriculum='chat': phase 1's tasks are the generator's answer to the training screens' captions,
    placed on the screen whose elements they name and judged by the chat judge alone (no validator); the phase
    then asks the generator again with its captions and judgments, and writes the next phase's tasks."""
    from desk_policies import SCREEN
    from envs.desk.a11y import parse_tree
    from envs.desk.env import DeskEnv
    from fake_chat import fake_chat_server

    config, run, _ = prepared
    train = run.tasks()["train"]
    buttons = [[n.name for n in parse_tree(DeskEnv(SCREEN, popups=False).reset(t).a11y_tree) if n.role != "window"]
               for t in train]
    named = sorted({b[-1] for b in buttons})[:2]
    first = json.dumps({"software document new": "v1", "exam new": [[f'Click "{n}"'] for n in named]
                        + [["Open the terminal"]]})
    second = json.dumps({"software document new": "v2", "exam new": [[f'Use "{named[0]}"', "report it done"]]})
    verdict = "res_dict = {'Correctness': False, 'First Error Step': 1, 'Error Type': 'wrong element'}"
    with fake_chat_server([(200, first), (200, second)]) as (gen_url, gen_requests), \
            fake_chat_server([(200, verdict)]) as (judge_url, _):
        workdir = _train_with_chat_curriculum(config, run, gen_url, judge_url, "seagent_chat")
    initial = json.loads((workdir / "curriculum.json").read_text())
    assert initial["left_out"] == ["Open the terminal"] and initial["software document new"] == "v1"
    assert [t["instruction"] for t in initial["tasks"]] == [f'Click "{n}"' for n in named]
    assert all(t["evaluator"] == {"func": "judged"} and "expert" not in t for t in initial["tasks"])
    report = json.loads((workdir / "phase_1" / "phase.json").read_text())
    assert report["episodes"] == len(named) and report["verified_episodes"] == 0
    assert report["judged_correct"] == 0 and report["a_F"] == len(named) and report["guidebook"] == "v2"
    assert report["next_tasks"] == 1 and len(gen_requests) == 2
    prompt = gen_requests[1]["body"]["messages"][0]["content"]
    assert "in the previous round:\nv1\n" in prompt and "wrong element" in prompt
    assert json.dumps(["the answer did not parse; the episode ended."]) in prompt  # the phase's captions
    nxt = json.loads((workdir / "phase_1" / "curriculum.json").read_text())
    assert [t["instruction"] for t in nxt["tasks"]] == [f'Use "{named[0]}", then report it done']


def test_seagent_runs_the_llm_curriculum_off_the_desk_from_the_chat_models_captions(prepared, monkeypatch):
    """Off the desk (env.kind='osworld'; the environments here are desk workers, which the method does not read
    the ground truth of) the World State Model's endpoint captions each training screen once, which the
    generator starts from and its tasks are placed by; each phase's change descriptions come from it too."""
    from fake_chat import fake_chat_server
    from guijax.seagent import chat_captions

    config, run, _ = prepared
    train = run.tasks()["train"]
    screens: list[int] = []

    def wsm(body):
        content = body["messages"][0]["content"]
        text = content if isinstance(content, str) else " ".join(p.get("text", "") for p in content)
        if '"elements"' in text:  # a training screen: the k-th is named Panel k
            screens.append(len(screens))
            return 200, json.dumps({"elements": [f"Panel {len(screens) - 1}"], "captions": [f"screen {len(screens) - 1}"]})
        if "just before one action" in text:
            return 200, "The screen did not change."
        return 200, "res_dict = {'Correctness': False, 'First Error Step': 1, 'Error Type': 'wrong element'}"

    described = []

    def spy(captioner, rollouts, budget):
        assert budget == config.seagent.curriculum_descriptions and len(rollouts) == 1  # the phase's episodes
        described.append(chat_captions.episode_captions.__wrapped__(captioner, rollouts, budget))
        return described[-1]

    spy.__wrapped__ = chat_captions.episode_captions
    monkeypatch.setattr(chat_captions, "episode_captions", spy)
    first = json.dumps({"software document new": "v1", "exam new": [['Open "Panel 1"'], ["Open the terminal"]]})
    second = json.dumps({"software document new": "v2", "exam new": [['Close "Panel 0"']]})
    with fake_chat_server([(200, first), (200, second)]) as (gen_url, gen_requests), \
            fake_chat_server(wsm) as (judge_url, _):
        workdir = _train_with_chat_curriculum(config, run, gen_url, judge_url, "seagent_chat_off_desk",
                                              env_kind="osworld")
    distinct, seen = [], set()
    for t in train:
        if json.dumps(t.config, sort_keys=True) not in seen:
            seen.add(json.dumps(t.config, sort_keys=True))
            distinct.append(t)
    assert len(screens) == len(distinct) >= 2  # each screen captioned once: phase 1's update reads scenes.json
    kept = json.loads((workdir / "scenes.json").read_text())
    assert (kept[distinct[1].id]["elements"], kept[distinct[1].id]["captions"]) == (["Panel 1"], ["screen 1"])
    assert json.dumps([f"screen {k}" for k in range(len(distinct))]) in gen_requests[0]["body"]["messages"][0]["content"]
    initial = json.loads((workdir / "curriculum.json").read_text())
    (task,) = initial["tasks"]
    assert initial["left_out"] == ["Open the terminal"] and task["instruction"] == 'Open "Panel 1"'
    assert task["config"] == list(distinct[1].config) and task["evaluator"] == {"func": "judged"}
    report = json.loads((workdir / "phase_1" / "phase.json").read_text())
    assert report["episodes"] == 1 and report["verified_episodes"] == 0 and report["a_F"] == 1
    (done,) = described
    assert report["captions_asked"] == done.requests and report["captions_unreadable"] == 0
    assert [j.get("captions") for j in report["judgments"]] == done.captions
    nxt = json.loads((workdir / "phase_1" / "curriculum.json").read_text())
    assert [t["instruction"] for t in nxt["tasks"]] == ['Close "Panel 0"'] and nxt["tasks"][0]["config"] == list(
        distinct[0].config)


def test_seagent_s2g_trains_a_specialist_per_application_then_the_generalist(prepared, monkeypatch, capsys):
    """Each specialist runs its phase on its own application's tasks only and keeps the episodes the judge calls
    correct; the generalist is the starting policy fine-tuned on all of them, then a phase over every task. A
    rerun trains nothing again. (The tiny policy fails every task, so the judge here calls every episode
    correct: the oracle's verdicts are tested in tests/guijax/seagent/.)"""
    from guijax.seagent.world_state import DeskOracleJudge, Judgment

    config, run, _ = prepared
    train = run.tasks()["train"]
    apps = ("click_button", "toggle_checkbox")
    assert {t.domain for t in train} == set(apps)
    config = copy.deepcopy(config)
    config.seagent.apps, config.seagent.distill_episodes, config.seagent.distill_steps = apps, 1, 2
    monkeypatch.setattr(DeskOracleJudge, "judge", lambda self, task, trajectory: Judgment(correct=True))
    workdir = run.workdir / "methods" / "seagent_s2g"
    workdir.mkdir(parents=True, exist_ok=True)
    policy, history = base_stages.train_with(run, get_method("seagent_s2g", config), workdir, "seagent_s2g")
    for app in apps:
        mine = [t.id for t in train if t.domain == app]
        phase = json.loads((workdir / f"specialist_{app}" / "phase_1" / "phase.json").read_text())
        assert phase["episodes"] == len(mine) and {j["task"] for j in phase["judgments"]} == set(mine)
        report = json.loads((workdir / f"specialist_{app}" / "specialist.json").read_text())
        assert report["episodes"] == report["judged_successes"] == len(mine)
        assert {t.task_id for t in TrajectoryStore(workdir / f"specialist_{app}" / "successes")} == set(mine)
    summary = json.loads((workdir / "specialists.json").read_text())
    assert summary["distilled_trajectories"] == len(train) and summary["distill_steps"] == 2
    generalist = json.loads((workdir / "generalist" / "phase_1" / "phase.json").read_text())
    assert {j["task"] for j in generalist["judgments"]} == {t.id for t in train}
    assert history == [] and _moved(run, policy) > 0
    written = (workdir / "generalist" / "distilled.json").stat().st_mtime_ns
    capsys.readouterr()
    base_stages.train_with(run, get_method("seagent_s2g", config), workdir, "seagent_s2g")
    out = capsys.readouterr().out
    assert all(f"specialist {app} already trained" in out for app in apps) and "resuming after phase 1 of 1" in out
    assert (workdir / "generalist" / "distilled.json").stat().st_mtime_ns == written


@pytest.mark.parametrize("apps, curriculum, match", [
    (("click_button",), "desk", "needs two or more applications"),
    (("click_button", "click_button+toggle_checkbox"), "desk", "'click_button' is in both"),
    (("click_button", "sliders"), "desk", r"names families \['sliders'\] that are not in env.families"),
    (("click_button", "toggle_checkbox"), "chat", "splits the tasks by application"),
])
def test_seagent_s2g_refuses_applications_it_cannot_split(tiny_config, apps, curriculum, match):
    config = tiny_config("grpo_cpu", f"seagent.apps={apps!r}", f"seagent.curriculum={curriculum}",
                         "seagent.judge=chat", "seagent.chat_url=http://x", "seagent.chat_model=m",
                         "seagent.curriculum_url=http://x", "seagent.curriculum_model=m")
    with pytest.raises(ValueError, match=match):
        get_method("seagent_s2g", config)
