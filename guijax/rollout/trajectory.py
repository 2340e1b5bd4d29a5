"""What a rollout produces and what training consumes: trajectories of (screenshot, response) steps.

A trajectory keeps everything needed to rebuild every step's prompt (instruction, optional plan, the
screenshots, earlier responses) plus the sampled tokens and their behaviour log-probs, the verifier
reward, and what went wrong if anything did. Algorithms (ARPO replay, BEPA cache, LUFFY) move whole
trajectories around; the data pipeline flattens them into per-step training examples.
"""
from __future__ import annotations

import dataclasses
import enum
from typing import Any

import numpy as np


class Status(str, enum.Enum):
    DONE = "done"  # the agent emitted finished()/DONE
    FAIL = "fail"  # the agent declared the task infeasible (FAIL)
    STEP_LIMIT = "step_limit"  # ran out of steps
    PARSE_ERROR = "parse_error"  # unparsable response: episode ended, evaluated, format penalty added
    ENV_ERROR = "env_error"  # the environment failed; dropped from its group, never scored as a failure


class Source(str, enum.Enum):
    ON_POLICY = "on_policy"
    REPLAY = "replay"  # ARPO replay buffer
    CACHE = "cache"  # BEPA LEVEL-2 cache
    EXPERT = "expert"  # converted expert trace (Trace Replacement, LUFFY, SFT)
    FAILURE = "failure"  # a step judged to have caused the failure, trained away from (SEAgent's a_F)


@dataclasses.dataclass
class Step:
    screenshot: np.ndarray  # [H, W, 3] uint8, what the agent saw before responding
    response: str  # "Thought: ...\nAction: ..."
    response_tokens: np.ndarray  # [T] int32, sampled ids (stop token included)
    behaviour_logprobs: np.ndarray  # [T] float32 under the sampling policy; empty for off-policy steps
    actions: list[str] = dataclasses.field(default_factory=list)  # parsed actions, rendered as pyautogui code
    error: str | None = None  # parse error text for this step, if any

    @classmethod
    def text(cls, screenshot: np.ndarray, response: str, actions: list[str] | None = None) -> "Step":
        """An off-policy step written as text (an expert's, or one synthesised from others): no sampled ids
        and no behaviour log-probs; the data pipeline tokenises the response."""
        return cls(screenshot, response, np.zeros(0, np.int32), np.zeros(0, np.float32), list(actions or []))


@dataclasses.dataclass
class Trajectory:
    task_id: str
    instruction: str
    steps: list[Step]
    reward: float = 0.0  # verifier score in [0, 1] plus any format penalty
    status: Status = Status.STEP_LIMIT
    source: Source = Source.ON_POLICY
    plan: tuple[str, ...] = ()  # plan the prompt was conditioned on (BEPA LEVEL-1); empty otherwise
    error: str | None = None
    # timings, seeds, episode ids; "guidance": text shown after the instruction in every step's prompt (the
    # skill-conditioned warm-start examples), "handoff": the step from which another policy or guidance acted
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def success(self) -> bool:
        """Solved, and ended by the agent's own parsable actions: an episode whose last response was
        unparsable is never a success, even when its evaluated score (part of its reward) says the task was
        already solved, since success-fed learners (BEPA's cache, offline RFT) would imitate that response."""
        return self.status not in (Status.ENV_ERROR, Status.PARSE_ERROR) and self.reward > 0.5

    @property
    def num_tokens(self) -> int:
        return int(sum(len(s.response_tokens) for s in self.steps))

    def without_plan(self) -> "Trajectory":
        """The same steps to be re-encoded under the plain instruction (BEPA injects cached LEVEL-1
        successes this way, so the policy learns to act without the plan)."""
        return dataclasses.replace(self, plan=())
