"""EvoCUA's cold start: the expert's successes written in the computer_use grammar with a hindsight thought
per step; the data pipeline makes one row per step whose prompt keeps the recent steps whole and older ones
as their semantic action, with the loss on that step alone (the rollouts build the same prompt); the written
responses replay the expert's episode; the rollout engine runs an episode in the grammar; the stage writes
the traces and the sft stage trains on them."""
from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from envs.actions import parse_thought, parse_uitars
from envs.actions.computer_use import parse_computer_use, render_computer_use, split_response
from envs.desk import DeskEnv, ScriptedExpert, run_expert
from envs.desk.expert import expert_subgoals
from envs.tasks import generate_desk_tasks
from guijax.data.pipeline import EncodeStep, PipelineConfig
from guijax.evocua.hindsight import RuleHindsight, Thought
from guijax.pipeline import coldstart_stages as cs
from guijax.rollout.prompt import PROMPTS
from guijax.rollout.trajectory import Source, Status

SCREEN = (280, 280)
REL = (1000, 1000)


def _trace(family: str = "settings_then_note", seed: int = 4):
    task = next(t for t in generate_desk_tasks(24, seed=0, families=[family]) if t.domain == family)
    trace = run_expert(DeskEnv(SCREEN, step_limit=15, seed=seed, popups=True), task, ScriptedExpert(seed=5))
    assert trace.reward == 1.0
    return task, trace


@pytest.fixture(scope="module")
def traced():
    task, trace = _trace()
    thoughts = RuleHindsight().thoughts(task.instruction, cs.hindsight_steps(trace, REL), subgoals=expert_subgoals(task))
    return task, trace, thoughts


def test_every_step_is_written_whole_and_replays_the_expert_episode(traced):
    task, trace, thoughts = traced
    written = cs.coldstart_trajectory(trace, thoughts)
    assert written.source == Source.EXPERT and written.status == Status.DONE and len(written.steps) >= 8
    assert written.meta["coldstart_skipped"] == [] and written.meta["grammar"] == "computer_use"
    env = DeskEnv(SCREEN, step_limit=15, seed=4, popups=True)  # the expert's desk, same episode seed
    obs = env.reset(task)
    for step, thought in zip(written.steps, thoughts):
        reasoning, semantic = split_response(step.response)
        assert reasoning == thought.text and semantic and "<tool_call>" in step.response
        np.testing.assert_array_equal(obs.screenshot, step.screenshot)
        result = env.step(parse_computer_use(step.response, image_hw=REL, screen_hw=SCREEN))
        obs = result.observation
    assert result.done and env.evaluate() == 1.0


def test_a_skipped_step_trains_nothing_and_stays_in_history(traced):
    task, trace, thoughts = traced
    gapped = list(thoughts)
    gapped[1] = Thought(None, "step 1: no usable thought")
    written = cs.coldstart_trajectory(trace, gapped)
    assert written.meta["coldstart_skipped"] == [1]
    assert split_response(written.steps[1].response)[0] == ""  # its action, without reasoning
    refs = cs.coldstart_refs([written])
    assert [r.step for r in refs] == [0] + list(range(2, len(trace.steps)))
    with pytest.raises(ValueError, match="2 thoughts for"):
        cs.coldstart_trajectory(trace, thoughts[:2])


def test_the_pipeline_encodes_the_paper_shape(traced, proc):
    """Loss on the current step's response tokens only; the current and two earlier screenshots; older steps
    present as their semantic action, their reasoning absent; recent ones whole."""
    task, trace, thoughts = traced
    written = cs.coldstart_trajectory(trace, thoughts)
    pipeline = PipelineConfig(length_buckets=(16384,), max_images=3, system_prompt=PROMPTS["computer_use_compact"],
                              grammar="computer_use")
    encode = EncodeStep([written], proc, pipeline)
    refs = cs.coldstart_refs([written])
    tok = proc.tokenizer
    for ref in (refs[0], refs[2], refs[-1]):
        example = encode.map(ref)
        current = written.steps[ref.step].response
        expected = tok(current, add_special_tokens=False)["input_ids"] + [tok.convert_tokens_to_ids("<|im_end|>")]
        mask = example["loss_mask"] > 0
        assert int(mask.sum()) == len(expected) and mask[-len(expected):].all()
        np.testing.assert_array_equal(example["input_ids"][mask], expected)
        assert len(example["image_grid_thw"]) == min(ref.step + 1, 3)
        prompt = tok.decode(example["input_ids"][~mask])
        for j in range(ref.step):
            reasoning, semantic = split_response(written.steps[j].response)
            assert f"Action: {semantic}" in prompt
            assert (reasoning in prompt) == (j >= ref.step - 2)


def test_the_engine_rolls_out_in_the_computer_use_grammar():
    """A desk episode prompted with the computer_use prompt, answered in tool calls, parsed in 0-1000
    coordinates and executed: the task is solved, and the prompt of the last step shows the first step as
    its semantic action only (one screenshot kept)."""
    from envs.actions.model import Action, ActionType
    from envs.pool import DeskFactory, EnvPool
    from guijax.rollout.engine import RolloutConfig, RolloutEngine
    from desk_policies import button_center
    from rollout_fakes import PromptPolicySampler, TextProcessor

    task = generate_desk_tasks(1, seed=5, families=["click_button"], screen_hw=SCREEN)[0]
    x, y, name = button_center(task, SCREEN)
    click = render_computer_use([Action(ActionType.CLICK, point=(x, y))], image_hw=REL, screen_hw=SCREEN)
    done = render_computer_use([Action(ActionType.FINISHED)], image_hw=REL, screen_hw=SCREEN)
    answers = [f"The {name} button is what the task asks for.\n\nAction: click {name}\n{click}",
               f"It was clicked.\n\nAction: report success\n{done}"]
    processor = TextProcessor()
    sampler = PromptPolicySampler(processor, lambda params, prompt: answers[min(prompt.count("assistant:"), 1)])
    pool = EnvPool(DeskFactory(SCREEN, step_limit=4, popups=False), 1, timeout_s=60)
    engine = RolloutEngine(pool, sampler, processor, RolloutConfig(
        max_images=1, system_prompt=PROMPTS["computer_use_compact"], grammar="computer_use", show_progress=False))
    try:
        (episode,), _ = engine.run(None, [task], 1, jax.random.PRNGKey(0), seed=3)
    finally:
        pool.close()
    assert episode.success and episode.status == Status.DONE and len(episode.steps) == 2
    last_prompt = sampler.prompts[-1]
    assert "computer_use" in last_prompt and f"assistant: Action: click {name}\n" in last_prompt
    assert "is what the task asks for" not in last_prompt  # the first step's reasoning left with its screenshot


def test_the_stage_writes_the_traces_in_the_prompts_grammar(tmp_path, tiny_config):
    from guijax.data.store import TrajectoryStore
    from guijax.pipeline.base_stages import tasks
    from guijax.pipeline.run import Run

    config = tiny_config("grpo_cpu", "env.step_limit=15", "env.popups=True", "rollout.prompt=computer_use_compact")
    run = Run(config, tmp_path)
    tasks.fn(run)
    headline = cs.coldstart.fn(run)
    summary = json.loads((tmp_path / "coldstart.json").read_text())
    store = list(TrajectoryStore(tmp_path / "coldstart_trajectories"))
    train = {t.id for t in run.tasks()["train"]}
    assert summary["traces"] == len(store) == len(train) and {t.task_id for t in store} == train
    assert summary["trained_steps"] == summary["steps"] == sum(len(t.steps) for t in store)
    assert summary["skipped_steps"] == [] and f"{len(store)} successful traces" in headline
    for trace in store:
        assert all(split_response(s.response)[0] and "<tool_call>" in s.response for s in trace.steps)
        assert parse_computer_use(trace.steps[-1].response, image_hw=REL, screen_hw=SCREEN)
    config.coldstart.hindsight = "chat"
    with pytest.raises(ValueError, match="hindsight_url"):
        cs.coldstart.fn(run)
    config.coldstart.hindsight = "rule"
    config.coldstart.brief = True  # one sentence per step, in UI-TARS text for a UI-TARS prompt
    config.rollout.prompt = "compact"
    (tmp_path / "coldstart.json").unlink()
    cs.coldstart.fn(run)
    store = list(TrajectoryStore(tmp_path / "coldstart_trajectories"))
    assert len(store) == len(train) and json.loads((tmp_path / "coldstart.json").read_text())["grammar"] == "uitars"
    for trace in store:
        for step in trace.steps:
            thought = parse_thought(step.response)
            assert step.response.startswith("Thought: ") and thought.count(".") <= 2 and "window is in front" not in thought
            assert parse_uitars(step.response, image_hw=SCREEN, screen_hw=SCREEN)
    config.rollout.prompt = "computer_use"
    config.env.kind = "osworld"
    with pytest.raises(ValueError, match="env.kind is 'osworld'"):
        cs.coldstart.fn(run)


@pytest.mark.slow  # 40 s: the tiny model's SFT step compiles
def test_the_sft_stage_trains_on_the_cold_start_traces(tmp_path, tiny_config):
    from guijax.pipeline.base_stages import base_model, sft, tasks
    from guijax.pipeline.run import Run

    config = tiny_config("grpo_cpu", "env.step_limit=15", "rollout.prompt=computer_use_compact", "sft.steps=2",
                         "sft.data=coldstart", "pipeline.length_buckets=(1024, 2048)")
    run = Run(config, tmp_path)
    base_model.fn(run)
    tasks.fn(run)
    with pytest.raises(FileNotFoundError, match="add 'coldstart' to config.stages"):
        sft.fn(run)
    cs.coldstart.fn(run)
    headline = sft.fn(run)
    assert "cold-start trajectories" in headline and (tmp_path / "sft_model" / "config.json").exists()
    assert len((tmp_path / "sft_metrics.jsonl").read_text().splitlines()) == 2
