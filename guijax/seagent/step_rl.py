"""SEAgent's step-level RL from judged trajectories (§3.2, Alg. 1): no environment is needed after the
rollouts, every update works on stored states.

1. The judge's labels (A.3) pick states: a_T steps (positives) and a_F steps (failures).
2. State-level sampling: at each positive state s (the instruction, the episode's history and screenshot up
   to that step, prompted exactly as the rollout prompted it) the policy samples G responses.
3. Each sample is scored against the state's correct action by Eq. 4 (`guijax.seagent.rewards`), and the
   group's advantages are Eq. 3's (r − mean) / std (0 when the G rewards are equal: such a group teaches
   nothing and is left out).
4. Training rows: every sample of a kept group as the last step of its state's history (its sampled ids and
   behaviour log-probs, the group advantage), and every failure step as the episode wrote it, flagged
   `failure` (source failure). The loss is `objectives.WithAdversarialImitation`: the clipped surrogate with
   a per-sequence mean and KL to the reference (Eq. 5) on the samples, γ·L_AI on the failure steps.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import numpy as np

from envs.actions import ActionParseError
from envs.actions.grammar import parse_response
from guijax.data.pipeline import PipelineConfig, StepRef, make_dataset
from guijax.rollout.engine import response_text
from guijax.rollout.prompt import Turn, build_messages
from guijax.rollout.trajectory import Source, Step, Trajectory
from guijax.seagent.rewards import step_reward
from guijax.seagent.world_state import Label


@dataclasses.dataclass(frozen=True)
class State:
    """Step `step` (0-based) of judged trajectory `trajectory`."""

    trajectory: int
    step: int


def labelled_states(labels: Sequence[Sequence[Label | None]]) -> tuple[list[State], list[State]]:
    """(a_T states, a_F states) of trajectories' step labels, in trajectory then step order."""
    positives = [State(i, k) for i, row in enumerate(labels) for k, label in enumerate(row) if label == Label.CORRECT]
    failures = [State(i, k) for i, row in enumerate(labels) for k, label in enumerate(row) if label == Label.FAILURE]
    return positives, failures


def state_prompt(traj: Trajectory, k: int, rollout_config: Any, processor: Any) -> tuple[str, list[np.ndarray]]:
    """The prompt the rollout showed at step k: instruction (and plan), earlier turns, step k's screenshot."""
    history = [Turn(s.screenshot, s.response) for s in traj.steps[:k]]
    messages, images = build_messages(traj.instruction, history, traj.steps[k].screenshot,
                                      max_images=rollout_config.max_images, plan=traj.plan,
                                      system_prompt=rollout_config.system_prompt, grammar=rollout_config.grammar)
    return processor.apply_chat_template(messages), images


def sample_at_states(engine: Any, params: Any, trajectories: Sequence[Trajectory], states: Sequence[State],
                     group_size: int, rng: jax.Array, max_rows: int = 64) -> list[list[Step]]:
    """G sampled steps at each state, with the rollout engine's sampler and processor (`max_rows` prompts per
    sampler call; a serving engine is handed `params` first)."""
    prompts = [state_prompt(trajectories[s.trajectory], s.step, engine.config, engine.processor)
               for s in states for _ in range(group_size)]
    screens = [trajectories[s.trajectory].steps[s.step].screenshot for s in states for _ in range(group_size)]
    steps: list[Step] = []
    for first in range(0, len(prompts), max_rows):
        chunk = prompts[first:first + max_rows]
        rng, key = jax.random.split(rng)
        out = engine.generate(params, key, chunk)
        for row in range(len(chunk)):
            tokens = np.asarray(out.tokens[row, :out.lengths[row]], np.int32)
            steps.append(Step(screens[first + row], response_text(engine.processor.tokenizer, tokens), tokens,
                              np.asarray(out.logprobs[row, :out.lengths[row]], np.float32)))
    return [steps[i * group_size:(i + 1) * group_size] for i in range(len(states))]


def _actions(response: str, screen_hw: tuple[int, int], coordinate_model: str, grammar: str):
    try:
        return parse_response(response, grammar=grammar, screen_hw=screen_hw, coordinate_model=coordinate_model)
    except (ActionParseError, ValueError):
        return None


def parsable_states(trajectories: Sequence[Trajectory], states: Sequence[State], coordinate_model: str = "uitars-1.5",
                    grammar: str = "uitars") -> tuple[list[State], list[State]]:
    """(states whose a_T response parses, states whose does not). A judge can call an episode correct whose
    step has no readable action (a chat judge errs); such a step has no action to score samples against, so it
    is left out and counted rather than failing the phase."""
    kept, dropped = [], []
    for state in states:
        step = trajectories[state.trajectory].steps[state.step]
        ok = _actions(step.response, step.screenshot.shape[:2], coordinate_model, grammar)
        (kept if ok else dropped).append(state)
    return kept, dropped


def sample_rewards(trajectories: Sequence[Trajectory], states: Sequence[State], samples: Sequence[Sequence[Step]],
                   coordinate_model: str = "uitars-1.5", grammar: str = "uitars") -> np.ndarray:
    """[states, G] Eq. 4 rewards of each sample against its state's correct (a_T) response, both read in
    `grammar` (the rollout's, envs.actions.grammar), so r_dist compares screen-pixel actions in either."""
    out = np.zeros((len(states), max((len(g) for g in samples), default=0)), np.float32)
    for i, (state, group) in enumerate(zip(states, samples)):
        truth_step = trajectories[state.trajectory].steps[state.step]
        screen = truth_step.screenshot.shape[:2]
        truth = _actions(truth_step.response, screen, coordinate_model, grammar)
        if not truth:
            raise ValueError(f"state {state}: its a_T response does not parse: {truth_step.response[:200]!r}")
        for g, sample in enumerate(group):
            out[i, g] = step_reward(_actions(sample.response, screen, coordinate_model, grammar), truth, screen).total
    return out


def group_advantages(rewards: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """Eq. 3 per row of [states, G] rewards: (r − mean) / std; a group with equal rewards gets zeros."""
    if rewards.size == 0:
        return np.zeros(rewards.shape, np.float32)
    mean = rewards.mean(axis=1, keepdims=True)
    std = rewards.std(axis=1, keepdims=True)
    return np.where(std > eps, (rewards - mean) / np.maximum(std, eps), 0.0).astype(np.float32)


@dataclasses.dataclass
class StepRows:
    """What one update trains on: rows as trajectories (the last step of each carries the loss) and their refs."""

    rows: list[Trajectory]
    refs: list[StepRef]
    groups_kept: int = 0
    groups_flat: int = 0
    failure_rows: int = 0


def training_rows(trajectories: Sequence[Trajectory], positives: Sequence[State], samples: Sequence[Sequence[Step]],
                  advantages: np.ndarray, failures: Sequence[State]) -> StepRows:
    """Rows of the kept groups' samples (history + the sample, with its group advantage) and of the failure
    steps (history + a_F as written, source failure, advantage 0)."""
    out = StepRows([], [])
    for state, group, adv in zip(positives, samples, advantages):
        if not np.any(adv):
            out.groups_flat += 1
            continue
        out.groups_kept += 1
        traj = trajectories[state.trajectory]
        for sample, a in zip(group, adv):
            out.refs.append(StepRef(len(out.rows), state.step, float(a)))
            out.rows.append(dataclasses.replace(traj, steps=[*traj.steps[:state.step], sample],
                                                source=Source.ON_POLICY))
    for state in failures:
        traj = trajectories[state.trajectory]
        out.refs.append(StepRef(len(out.rows), state.step, 0.0))
        out.rows.append(dataclasses.replace(traj, steps=list(traj.steps[:state.step + 1]), source=Source.FAILURE))
        out.failure_rows += 1
    return out


def update(policy: Any, reference_params: Any, data: StepRows, loss: Any, config: Any, pipeline: PipelineConfig,
           batch_rows: int, epochs: int, learning_rate: float, seed: int,
           log: Callable[[dict], None] | None = None) -> tuple[Any, list[dict[str, float]]]:
    """`epochs` passes of the SEAgent loss over `data` (a fresh AdamW at `learning_rate`): each batch's
    π_old log-probs under the parameters the update starts from and π_ref's under `reference_params`, as the
    trainer's update computes them. Returns the new parameters and each step's metrics."""
    import ml_collections

    from guijax import accumulation, optim, sharding, train_step
    from guijax.sft import device_batch

    batches = list(make_dataset(data.rows, data.refs, policy.processor, policy.module.cfg,
                                dataclasses.replace(pipeline, batch_size=batch_rows, seed=seed, num_epochs=1)))
    opt_config = ml_collections.ConfigDict(config.optim.to_dict())
    opt_config.learning_rate = learning_rate
    accumulate = int(opt_config.grad_accum_steps)
    # a schedule (warmup, cosine) spans this update's own optimiser updates (accumulation groups), as the SFT
    # runs' do; the minibatches are counted as planned (token-budget minibatches follow the tokens)
    opt_config.total_steps = max(-(-len(batches) // accumulate) * epochs, opt_config.warmup_steps + 1)
    tx, _ = optim.make_optimizer(opt_config)
    step_cfg = train_step.StepConfig(loss, config.rollout.temperature, impl=config.train.logprob_impl,
                                     router_aux_loss_coef=config.train.router_aux_loss_coef)
    step_fn = train_step.make_train_step(policy.module, tx, step_cfg, policy.mesh)
    logprob_fn = train_step.make_logprob_fn(policy.module, config.rollout.temperature, config.train.logprob_impl,
                                            policy.mesh)
    state = train_step.init_state(policy.module, policy.params, tx, policy.mesh)
    prepared = []
    for batch in batches:
        batch = device_batch(batch)
        if policy.mesh is not None:  # global arrays over the data-parallel devices, as the trainer places them
            batch = sharding.place_batch(batch, policy.mesh, pad=True, image_token_id=policy.module.cfg.image_token_id)
        old, _ = logprob_fn(state.params, batch)
        ref, _ = logprob_fn(reference_params, batch)
        prepared.append(dict(batch, old_logp=old, ref_logp=ref))
    history: list[dict[str, float]] = []
    empty_microstep = (train_step.make_empty_microstep(policy.module, tx, policy.mesh) if accumulate > 1 else None)
    groups = list(accumulation.scaled_groups(prepared, accumulate, config.train.normalization))  # every epoch's
    for _ in range(epochs):
        for batch, ends_group in groups:
            state, metrics = step_fn(state, batch)
            if ends_group and empty_microstep is not None:
                state, _ = accumulation.flush(state, empty_microstep)
            row = {k: float(v) for k, v in metrics.items()}
            history.append(row)
            if log is not None:
                log({f"update_{k}": v for k, v in row.items()})
    return state.params, history
