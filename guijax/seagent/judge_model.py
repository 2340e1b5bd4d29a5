"""SEAgent's World State Model trained in guijax (App. A.2): a vision-language model of any supported family,
LoRA-tuned (or tuned whole) to write Fig. 8 judgments of whole episodes, co-trained on state-change descriptions.

Training data, as the paper builds it with GPT-4o annotations kept only where they match the verifier, comes
here from ground truth (`judge_examples`):

* judgment examples: the episode's keyframes (the screen before each action, then the final screen) under
  Fig. 8's prompt, answered with the ground-truth judgment (`DeskOracleJudge`, whose correctness is the
  verifier's), its reasoning the step-by-step captions of what each action changed (A.1: "short captions
  for each screenshot, the reasoning process, and a structured judgment dictionary");
* change-description examples (the paper's CD data): a before/after pair of one step's screens under
  `CHANGE_PROMPT`, answered with what changed (`guijax.seagent.captions`).

`TrainedWorldStateJudge` asks the trained model the same Fig. 8 request the chat judge gets (greedy, as the
paper samples at t=0); an answer without a readable res_dict is asked again with sampling, then counted as
unreadable: judged incorrect with no error step, which labels no step (A.3).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import numpy as np

from envs.api import Task
from guijax.data.chat_examples import ChatExample, chat_prompt
from guijax.progress import Progress
from guijax.rollout.engine import response_text
from guijax.rollout.trajectory import Trajectory
from guijax.sampling import Sampler, SamplingConfig
from guijax.seagent.captions import EpisodeRecord
from guijax.seagent.world_state import (Judgment, JudgmentError, episode_frames, judgment_answer, keyframe_parts,
                                        parse_judgment)

# Ours: the paper's change-description prompt is not printed (A.2 points to figures that are not in the text).
CHANGE_PROMPT = ("The two screenshots were taken before and after one action of a UI agent. Describe the "
                 "visual differences between them: which windows, dialogs and controls appeared, closed or "
                 "changed state, or that the screen did not change.")


def judgment_example(task: Task, trajectory: Trajectory, judgment: Judgment, record: EpisodeRecord,
                     name: str) -> ChatExample:
    """Fig. 8's request for the episode, answered with `judgment` reasoned by the record's captions."""
    frames = episode_frames(trajectory, record.final_screenshot)
    reasoned = dataclasses.replace(judgment, reasoning=" ".join(record.captions) or "No action was taken.")
    return ChatExample(name, tuple(keyframe_parts(trajectory.instruction or task.instruction, frames)),
                       judgment_answer(reasoned))


def change_examples(record: EpisodeRecord, name: str) -> list[ChatExample]:
    """One change-description example per replayed step of the record."""
    return [ChatExample(f"{name} step {c.index}", ("Before:", c.before, "After:", c.after, CHANGE_PROMPT), c.change)
            for c in record.changes]


def judge_examples(episodes: Sequence[tuple[Task, Trajectory, Judgment, EpisodeRecord]],
                   change_descriptions: bool = True) -> list[ChatExample]:
    """The World State Model's training set: a judgment example per episode, plus (with `change_descriptions`)
    its steps' change descriptions, combined without re-weighting as A.2 does."""
    out: list[ChatExample] = []
    for i, (task, traj, judgment, record) in enumerate(episodes):
        name = f"task {task.id} episode {i}"
        out.append(judgment_example(task, traj, judgment, record, name))
        if change_descriptions:
            out += change_examples(record, name)
    return out


class TrainedWorldStateJudge:
    """Fig. 8 answered by a guijax model (`module` with `params`, sampled with `sampling`'s settings but its
    temperature): greedy first, then `retries` answers sampled at temperature 1 for an unreadable one, then an
    unreadable judgment whose error type quotes the greedy answer. `max_rows` episodes per sampler call."""

    def __init__(self, module: Any, params: Any, processor: Any, sampling: SamplingConfig, *, mesh: Any = None,
                 retries: int = 2, seed: int = 0, max_rows: int = 32):
        self.params, self.processor, self.retries, self.max_rows = params, processor, retries, max_rows
        self.samplers = {greedy: Sampler(module, dataclasses.replace(sampling, temperature=0.0 if greedy else 1.0),
                                         mesh=mesh) for greedy in (True, False)}
        self._rng = jax.random.PRNGKey(seed)

    def judge(self, task: Task, trajectory: Trajectory, final_screenshot: np.ndarray | None = None) -> Judgment:
        return self.judge_all([(task, trajectory, final_screenshot)])[0]

    def judge_all(self, episodes: Sequence[tuple[Task, Trajectory, np.ndarray | None]]) -> list[Judgment]:
        """Every episode judged, in batched sampler calls."""
        prompts = [chat_prompt(self.processor, keyframe_parts(t.instruction or task.instruction,
                                                              episode_frames(t, final)))
                   for task, t, final in episodes]
        out: list[Judgment | None] = [None] * len(prompts)
        errors: list[str] = [""] * len(prompts)
        for attempt in range(self.retries + 1):
            todo = [i for i, j in enumerate(out) if j is None]
            if not todo:
                break
            desc = "world state model: judging" + (f" (sampled retry {attempt})" if attempt else "")
            with Progress(len(todo), desc, "episode") as bar:
                for first in range(0, len(todo), self.max_rows):
                    rows = todo[first:first + self.max_rows]
                    for i, text in zip(rows, self._answers([prompts[i] for i in rows], greedy=attempt == 0)):
                        try:
                            out[i] = parse_judgment(text)
                        except JudgmentError as err:
                            if not attempt:  # the greedy answer, the paper's decoding, says most
                                errors[i] = f"{err}; greedy answer: {text[:600]!r}"
                    bar.update(len(rows), readable=sum(out[i] is not None for i in todo))
        again = f", and {self.retries} sampled retries" if self.retries else ""
        return [j if j is not None else Judgment(False, optimized=False,
                                                 error_type=f"unreadable judgment{again} ({errors[i]})",
                                                 readable=False)
                for i, j in enumerate(out)]

    def _answers(self, prompts: Sequence[tuple[str, list[np.ndarray]]], greedy: bool) -> list[str]:
        inputs = self.processor([p for p, _ in prompts], [images for _, images in prompts])
        self._rng, key = jax.random.split(self._rng)
        out = self.samplers[greedy].generate(self.params, key, **inputs)
        return [response_text(self.processor.tokenizer, np.asarray(out.tokens[r, :out.lengths[r]]))
                for r in range(len(prompts))]
