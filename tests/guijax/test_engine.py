"""Rollout engine fault handling with stand-ins for the pool, sampler and processor (no model needed)."""
from __future__ import annotations

import jax
import numpy as np
import pytest

from envs.api import Observation, StepResult, Task
from envs.pool import Result
from guijax.rollout.engine import RolloutConfig, RolloutEngine
from guijax.rollout.prompt import COMPACT_PROMPT
from guijax.rollout.trajectory import Status
from rollout_fakes import FakeProcessor, FakeSampler, FakeTokenizer, Out

SHOT = np.zeros((28, 28, 3), np.uint8)


class FlakyPool:
    """Reset of task 'flaky' fails once, of task 'broken' always; every step finishes the episode."""

    num_workers = 4

    def __init__(self):
        self.resets: list[str] = []
        self.failed_once = False
        self.tasks: dict[int, Task] = {}

    def reset(self, tasks, slots=None, seeds=None, timeout_s=None):
        slots = list(range(len(tasks))) if slots is None else list(slots)
        out = {}
        for slot, task in zip(slots, tasks):
            self.resets.append(task.id)
            self.tasks[slot] = task
            if task.id == "broken" or (task.id == "flaky" and not self.failed_once):
                self.failed_once |= task.id == "flaky"
                out[slot] = Result(False, error=f"setup of {task.id} failed")
            else:
                out[slot] = Result(True, Observation(SHOT, task.id))
        return out

    def step(self, actions, timeout_s=None):
        return {s: Result(True, StepResult(Observation(SHOT, ""), True)) for s in actions}

    def evaluate(self, slots, timeout_s=None):
        return {s: Result(True, 1.0) for s in slots}


def test_failed_reset_is_retried_then_dropped_with_its_reason():
    pool = FlakyPool()
    engine = RolloutEngine(pool, FakeSampler(), FakeProcessor(), RolloutConfig(show_progress=False))
    tasks = [Task(id="ok", instruction="a"), Task(id="flaky", instruction="b"), Task(id="broken", instruction="c")]
    trajs, _ = engine.run(None, tasks, 1, jax.random.PRNGKey(0))
    by_id = {t.task_id: t for t in trajs}
    assert by_id["ok"].status == Status.DONE and by_id["ok"].reward == 1.0
    assert by_id["flaky"].status == Status.DONE  # the retry succeeded
    assert by_id["broken"].status == Status.ENV_ERROR and "setup of broken failed" in by_id["broken"].error
    assert pool.resets.count("flaky") == 2 and pool.resets.count("broken") == 2 and pool.resets.count("ok") == 1


def test_response_text_keeps_the_box_tokens_that_expert_traces_carry(tmp_path):
    """The history of later prompts replays each response: it must be the text the model wrote, box tokens
    included, and re-tokenise to the same ids the pipeline encodes for expert text (minus the stop)."""
    from guijax.models.tokenizer import build_tokenizer
    from guijax.rollout.engine import response_text

    tok = build_tokenizer(tmp_path / "tok", vocab_size=1024)
    text = "Thought: I should click the \"Light\" option.\nAction: click(start_box='<|box_start|>(172,48)<|box_end|>')"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.convert_tokens_to_ids("<|box_start|>") in ids
    sampled = np.asarray(ids + [tok.convert_tokens_to_ids("<|im_end|>")], np.int32)
    assert response_text(tok, sampled) == text
    assert tok(response_text(tok, sampled), add_special_tokens=False)["input_ids"] == ids
    assert response_text(tok, np.asarray(ids, np.int32)) == text  # cut at max_new_tokens: no stop to drop


class GrowingProcessor(FakeProcessor):
    """20 text tokens plus 10 per screenshot: the current one and one per earlier turn."""

    def __call__(self, texts, images):
        lengths = [20 + 10 * len(imgs) for imgs in images]
        mask = np.zeros((len(texts), max(lengths)), np.int64)
        for i, n in enumerate(lengths):
            mask[i, :n] = 1
        return {"rows": len(texts), "attention_mask": mask}


class NeverDonePool(FlakyPool):
    def step(self, actions, timeout_s=None):
        return {s: Result(True, StepResult(Observation(SHOT, ""), False)) for s in actions}

    def evaluate(self, slots, timeout_s=None):
        self.evaluated = sorted(slots)
        return {s: Result(True, 0.0) for s in slots}


def test_episode_whose_prompt_outgrows_the_limit_ends_as_at_the_step_limit():
    pool = NeverDonePool()

    class ClickTokenizer(FakeTokenizer):
        def decode(self, tokens, skip_special_tokens=True):
            return "Thought: go.\nAction: click(start_box='(1,1)')"

    processor = GrowingProcessor()
    processor.tokenizer = ClickTokenizer()
    engine = RolloutEngine(pool, FakeSampler(), processor, RolloutConfig(max_images=5, show_progress=False,
                                                                          max_prompt_tokens=45))
    (traj,), _ = engine.run(None, [Task(id="long", instruction="a")], 1, jax.random.PRNGKey(0))
    # prompts of 30 and 40 tokens are sampled; the third (50 > 45) is not
    assert len(traj.steps) == 2 and traj.status == Status.STEP_LIMIT and pool.evaluated == [0]
    assert "prompt of 50 tokens exceeds max_prompt_tokens=45" in traj.error and traj.reward == 0.0


def test_length_buckets_must_leave_room_for_a_prompt():
    from guijax import launch
    from guijax.trainer import rollout_config

    config = launch.resolve("grpo_cpu", [])
    assert rollout_config(config, COMPACT_PROMPT).max_prompt_tokens == max(config.pipeline.length_buckets) - 64
    config.pipeline.length_buckets = (32, 64)
    with pytest.raises(ValueError, match="rollout.max_new_tokens=64"):
        rollout_config(config, COMPACT_PROMPT)


class ByteTokenizer(FakeTokenizer):
    """Token ids are the characters of the response (ScriptedSampler writes them so)."""

    def decode(self, tokens, skip_special_tokens=True):
        return "".join(map(chr, tokens))


class ScriptedSampler:
    """Row r of the k-th call writes responses[k][r]."""

    def __init__(self, responses: list[list[str]]):
        self.responses, self.calls = responses, 0

    def generate(self, params, rng, **inputs):
        texts = self.responses[self.calls]
        self.calls += 1
        assert len(texts) == inputs["rows"]
        tokens = np.zeros((len(texts), max(map(len, texts))), np.int32)
        for row, text in enumerate(texts):
            tokens[row, :len(text)] = [ord(c) for c in text]
        return Out(tokens, np.full(tokens.shape, -0.1, np.float32), np.asarray([len(t) for t in texts]))


def test_unparsable_response_still_scores_the_environment_minus_the_format_penalty():
    """ARPO's code evaluates an environment whose episode ended on an unparsable response and adds
    0.5 * (-1) to that score. On the desk, episode 0 clicks the task's button (solving it) and episode 1
    waits; then both write an unknown action: 1 - 0.5 and 0 - 0.5."""
    from envs.actions.uitars import render_uitars
    from envs.desk import DeskEnv, ScriptedExpert, run_expert
    from envs.pool import DeskFactory, EnvPool
    from envs.tasks import generate_desk_tasks

    screen = (280, 280)
    (task,) = generate_desk_tasks(1, seed=0, families=["click_button"], screen_hw=screen)
    expert = run_expert(DeskEnv(screen, popups=False), task, ScriptedExpert())
    assert len(expert.steps) == 2 and expert.reward == 1.0  # the click solves it, finished() follows
    click = render_uitars(expert.steps[0].actions, image_hw=screen, screen_hw=screen, thought="Click it.")
    garbage = "Thought: that should do.\nAction: teleport(start_box='(1,2)')"
    sampler = ScriptedSampler([[click, "Thought: not yet.\nAction: wait()"], [garbage, garbage]])
    processor = FakeProcessor()
    processor.tokenizer = ByteTokenizer()
    with EnvPool(DeskFactory(screen, popups=False), 2, timeout_s=60) as pool:
        engine = RolloutEngine(pool, sampler, processor,
                               RolloutConfig(format_reward=-1.0, format_weight=0.5, show_progress=False))
        (solved, unsolved), _ = engine.run(None, [task], 2, jax.random.PRNGKey(0))
    for traj in (solved, unsolved):
        assert traj.status == Status.PARSE_ERROR and len(traj.steps) == 2
        assert "step 2: unknown action 'teleport'" in traj.error and traj.steps[-1].error
    assert solved.reward == 0.5 and unsolved.reward == -0.5
    assert not solved.success  # solved, but ended on garbage: nothing to imitate


def test_unparsable_episode_whose_evaluation_fails_is_dropped_with_both_reasons():
    class EvalFailsPool(FlakyPool):
        def evaluate(self, slots, timeout_s=None):
            return {s: Result(False, error="evaluator crashed") for s in slots}

    processor = FakeProcessor()
    processor.tokenizer = ByteTokenizer()
    engine = RolloutEngine(EvalFailsPool(), ScriptedSampler([["Action: teleport()"]]), processor,
                           RolloutConfig(show_progress=False))
    (traj,), _ = engine.run(None, [Task(id="t", instruction="a")], 1, jax.random.PRNGKey(0))
    assert traj.status == Status.ENV_ERROR
    assert traj.error.startswith("step 1: unknown action 'teleport'")
    assert traj.error.endswith("; then evaluation failed: evaluator crashed")


class RecordingPool(FlakyPool):
    """Every step finishes its episode; the verifier scores 0.8 and records which tasks it scored."""

    def __init__(self):
        super().__init__()
        self.scored: list[str] = []

    def evaluate(self, slots, timeout_s=None):
        self.scored += [self.tasks[s].id for s in slots]
        return {s: Result(True, 0.8) for s in slots}


@pytest.mark.parametrize("config", [RolloutConfig(show_progress=False),
                                    RolloutConfig(format_reward=-2.0, format_weight=0.4, show_progress=False),
                                    RolloutConfig(format_weight=0.0, show_progress=False)],
                         ids=["arpo_default", "custom", "weight_zero"])
def test_unparsable_response_adds_the_weighted_format_reward(config):
    """The format term is format_weight * format_reward from the config (not ARPO's -0.5 built in), added to
    the verifier's score when the episode is scored; a parsable episode gets exactly the verifier's score."""
    pool = RecordingPool()
    sampler = ScriptedSampler([["Thought: done.\nAction: finished(content='ok')", "I am not sure what to do here."]])
    processor = FakeProcessor()
    processor.tokenizer = ByteTokenizer()
    engine = RolloutEngine(pool, sampler, processor, config)
    tasks = [Task(id="clean", instruction="a"), Task(id="garbled", instruction="b")]
    (clean, garbled), _ = engine.run(None, tasks, 1, jax.random.PRNGKey(0))
    assert clean.status == Status.DONE and clean.reward == pytest.approx(0.8) and clean.steps[0].error is None
    penalty = config.format_weight * config.format_reward
    score = 0.8 if "garbled" in pool.scored else 0.0
    assert garbled.reward == pytest.approx(score + penalty)
    assert garbled.steps[0].error and not garbled.steps[0].actions  # the parse error is on the step it came from
