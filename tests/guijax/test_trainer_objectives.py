"""The trainer's update with each objective setting, on converted expert traces of the tiny preset: the KL term
reads reference log-probs of the initial policy, and each normalisation divides by what it says."""
from __future__ import annotations

import dataclasses
import pathlib

import jax
import numpy as np
import pytest

from guijax import objectives
from guijax.methods import get_method
from guijax.pipeline import base_stages
from guijax.pipeline.run import Run
from guijax.trainer import Components, Trainer

OBJECTIVES = ("env.families=('click_button',)", "env.num_tasks=2", "env.step_limit=3", "rollout.max_new_tokens=24",
              "sft.traces_per_task=1", "optim.learning_rate=1e-3")


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, tiny_config):
    """A tiny base model, two tasks and their converted expert traces (text responses of 1-3 steps), and
    a function making a trainer of that model with extra overrides."""
    workdir = tmp_path_factory.mktemp("run")
    run = Run(tiny_config("grpo_cpu", *OBJECTIVES), workdir)
    base_stages.base_model.fn(run)
    base_stages.tasks.fn(run)
    return workdir, base_stages.expert_trajectories(run, run.all_tasks()), lambda *o: tiny_config("grpo_cpu", *OBJECTIVES, *o)


def _trainer(workdir: pathlib.Path, make_config, overrides: list[str], on_mesh: bool = False,
             method: str = "grpo") -> Trainer:
    config = make_config(*overrides)
    run = Run(config, workdir)
    policy = run.load_policy(run.base_model_dir)
    unit = get_method(method, config)
    parts = Components(policy, None, policy.processor, [], lambda score: unit.hook(None), unit.objective(),
                       run.system_prompt, run.mesh() if on_mesh else None, streams=run.streams)
    return Trainer(config, workdir / f"trainer_{method}", parts)


def _row_advantages(trajectories, advantages) -> np.ndarray:
    """Each step row's advantage (its trajectory's), as the pipeline lays the rows out."""
    return np.asarray([a for t, a in zip(trajectories, advantages) for _ in t.steps])


@pytest.mark.slow  # 28 s; the normalisations' arithmetic is checked in test_losses
def test_sequence_and_token_normalisation_divide_by_rows_and_tokens(prepared):
    workdir, trajectories, make_config = prepared
    advantages = np.asarray([1.5, -0.5][:len(trajectories)] + [0.25] * max(0, len(trajectories) - 2), np.float32)
    keep = list(range(len(trajectories)))
    losses = {}
    for normalization in ("token", "sequence"):
        trainer = _trainer(workdir, make_config, [f"train.normalization={normalization}", "train.minibatch_size=32",
                                     "optim.learning_rate=1e-9"])
        losses[normalization] = trainer._update(trajectories, advantages, keep)
        trainer.close()
    rows = _row_advantages(trajectories, advantages)
    # at the first epoch the ratio is 1, so the surrogate of a row's token is -A: "sequence" averages rows
    assert losses["sequence"]["loss"] == pytest.approx(-rows.mean(), rel=1e-4, abs=1e-5)
    # dividing the row sum by the token count instead (the old normaliser) would shrink it by the mean length
    assert losses["token"]["tokens"] > len(rows)
    assert -rows.max() - 1e-5 <= losses["token"]["loss"] <= -rows.min() + 1e-5  # a token-weighted mean of -A


@pytest.mark.slow  # 49 s; the KL term itself is checked in test_losses
def test_kl_coefficient_scores_the_initial_policy_and_changes_the_update(prepared):
    workdir, trajectories, make_config = prepared
    advantages = np.linspace(1.0, -1.0, len(trajectories)).astype(np.float32)
    keep = list(range(len(trajectories)))
    plain = _trainer(workdir, make_config, ["train.ppo_epochs=3"])
    with_kl = _trainer(workdir, make_config, ["train.ppo_epochs=3", "train.kl_coef=0.5"])
    assert plain.ref_params is None and with_kl.objective.reference_kl
    m_plain = plain._update(trajectories, advantages, keep)
    m_kl = with_kl._update(trajectories, advantages, keep)
    assert "ref_kl" not in m_plain and m_kl["ref_kl"] > 0  # later epochs move away from the reference
    leaves = lambda t: np.concatenate([np.ravel(np.asarray(x)) for x in jax.tree.leaves(t.state.params)])  # noqa: E731
    assert not np.allclose(leaves(plain), leaves(with_kl))  # the KL gradient changed the parameters
    for t in (plain, with_kl):
        t.close()


def test_a_kl_loss_without_reference_log_probs_is_refused():
    loss = objectives.ClippedPolicyLoss(objectives.losses.ClipConfig(kl_coef=0.1))
    batch = {k: np.zeros((1, 4), np.float32) for k in ("old_logp", "advantages", "loss_mask")}
    with pytest.raises(ValueError, match="ref_logp"):
        loss(np.zeros((1, 4), np.float32), np.zeros((1, 4), np.float32), batch)


@pytest.mark.slow
def test_per_device_vision_blocks_train_the_same_update(prepared):
    """The trainer's batches in per-device vision blocks (one per simulated device, rows padded to the mesh)
    give the update of one layout over the whole batch."""
    workdir, trajectories, make_config = prepared
    advantages = np.linspace(1.0, -1.0, len(trajectories)).astype(np.float32)
    keep = list(range(len(trajectories)))
    whole = _trainer(workdir, make_config, [], on_mesh=True)
    blocked = _trainer(workdir, make_config, ["pipeline.vision_per_device=True"], on_mesh=True)
    assert whole.pipeline.vision_blocks == 1 and blocked.pipeline.vision_blocks == jax.device_count()
    m_whole, m_blocked = whole._update(trajectories, advantages, keep), blocked._update(trajectories, advantages, keep)
    assert m_blocked["loss"] == pytest.approx(m_whole["loss"], rel=1e-4, abs=1e-6)
    leaves = lambda t: np.concatenate([np.ravel(np.asarray(x)) for x in jax.tree.leaves(t.state.params)])  # noqa: E731
    # Adam's first step moves each weight by about lr * sign(gradient) (lr = 1e-3): summation order changes a
    # few near-zero gradients (a handful of weights differ), a wrong image feature changes a large share
    moved = np.abs(leaves(blocked) - leaves(whole)) > 1e-5
    assert moved.mean() < 1e-4, f"{moved.sum()} of {moved.size} weights differ"
    for t in (whole, blocked):
        t.close()


@pytest.mark.slow  # 56 s, 67 s on the mesh; packed log-probs, loss and gradients are checked in test_packing
@pytest.mark.parametrize("on_mesh", [False, True])
def test_packed_minibatches_train_the_same_update(prepared, on_mesh):
    """The trainer's minibatches packed padding-free (on the mesh each of the 8 simulated devices packing its
    own steps) give the update of padded minibatches."""
    workdir, trajectories, make_config = prepared
    advantages = np.linspace(1.0, -1.0, len(trajectories)).astype(np.float32)
    keep = list(range(len(trajectories)))
    padded = _trainer(workdir, make_config, [], on_mesh=on_mesh)
    packed = _trainer(workdir, make_config, ["pipeline.pack=True"], on_mesh=on_mesh)
    assert packed.pipeline.pack and packed.pipeline.pack_blocks == (jax.device_count() if on_mesh else 1)
    m_padded, m_packed = padded._update(trajectories, advantages, keep), packed._update(trajectories, advantages, keep)
    assert m_packed["loss"] == pytest.approx(m_padded["loss"], rel=1e-4, abs=1e-6)
    assert m_packed["tokens"] == m_padded["tokens"] and m_packed["trained_tokens"] == m_padded["trained_tokens"]
    assert 0 < m_padded["token_fill"] < 1 and 0 < m_packed["token_fill"] <= 1
    leaves = lambda t: np.concatenate([np.ravel(np.asarray(x)) for x in jax.tree.leaves(t.state.params)])  # noqa: E731
    moved = np.abs(leaves(packed) - leaves(padded)) > 1e-5  # as with vision blocks: summation order only
    assert moved.mean() < 1e-4, f"{moved.sum()} of {moved.size} weights differ"
    for t in (padded, packed):
        t.close()


def _uneven(trajectories):
    """The traces with the first one cut to a single step, so trajectories differ in length."""
    assert all(len(t.steps) >= 2 for t in trajectories)
    return [dataclasses.replace(trajectories[0], steps=trajectories[0].steps[:1])] + list(trajectories[1:])


@pytest.mark.slow  # 60 s; the rows and normalisers are checked in tests/guijax/test_objectives.py
def test_step0_shares_each_advantage_over_its_steps_and_divides_by_the_trajectories(prepared):
    """EvoCUA Eq. 4-5 through the trainer on an 8-device mesh, one batch: at the first epoch the ratio is 1, so
    a row's per-token surrogate is −Â_i/T_i, its token mean the same, and the rows' sum over the trajectories
    in the objective is −ΣÂ_i/N whatever the lengths (GRPO's per-row mean would weigh long ones more)."""
    workdir, trajectories, make_config = prepared
    trajectories = _uneven(trajectories)
    advantages = np.linspace(1.5, -0.5, len(trajectories)).astype(np.float32)
    keep = list(range(len(trajectories)))
    trainer = _trainer(workdir, make_config, ["train.minibatch_size=32", "optim.learning_rate=1e-9"], on_mesh=True,
                       method="step0")
    scored = len(trajectories) + 2  # two more trajectories with zero advantage count in 1/G but are not rows
    m = trainer._update(trajectories, advantages, keep, scored)
    trainer.close()
    assert m["loss"] == pytest.approx(-advantages.sum() / scored, rel=1e-4, abs=1e-5)
    rows = _row_advantages(trajectories, advantages)
    assert abs(-rows.mean() - m["loss"]) > 1e-2  # what GRPO's per-row mean would have given
    with pytest.raises(ValueError, match="steps must be one of"):
        objectives.Objective(trainer.objective.loss, steps="every")


@pytest.mark.slow  # 20 s
def test_final_step_grpo_trains_one_row_per_trajectory(prepared):
    workdir, trajectories, make_config = prepared
    trajectories = _uneven(trajectories)
    advantages = np.linspace(1.5, -0.5, len(trajectories)).astype(np.float32)
    trainer = _trainer(workdir, make_config, ["train.minibatch_size=32", "optim.learning_rate=1e-9"],
                       method="grpo_final_step")
    m = trainer._update(trajectories, advantages, list(range(len(trajectories))))
    trainer.close()
    assert m["loss"] == pytest.approx(-advantages.mean(), rel=1e-4, abs=1e-5)  # one row of −Â_i per trajectory
    assert abs(-_row_advantages(trajectories, advantages).mean() - m["loss"]) > 1e-2


@pytest.mark.slow  # 40 s; the mismatch arithmetic is checked in tests/guijax/test_objectives.py
def test_sampler_mismatch_is_logged_and_its_correction_can_be_switched_on(prepared):
    """Rows whose ids a sampler produced report how far its log-probs are from the learner's; text rows do
    not count. `train.behaviour_correction` weighs synchronous runs' tokens by π_old/π_behaviour too."""
    from guijax.data.pipeline import text_response
    from guijax.rollout.trajectory import Source

    workdir, trajectories, make_config = prepared
    advantages = np.asarray([1.0, -1.0] * len(trajectories), np.float32)[:len(trajectories)]
    keep = list(range(len(trajectories)))
    out = {}
    for correction in (False, True):
        trainer = _trainer(workdir, make_config, [f"train.behaviour_correction={correction}",
                                                  "optim.learning_rate=1e-9"])
        tokenizer = trainer.parts.processor.tokenizer
        sampled = [dataclasses.replace(t, source=Source.ON_POLICY, steps=[dataclasses.replace(
            s, response_tokens=(ids := text_response(tokenizer, s.response)),
            behaviour_logprobs=np.full(len(ids), -0.05, np.float32)) for s in t.steps]) for t in trajectories]
        out[correction] = trainer._update(sampled, advantages, keep)
        text_rows = [dataclasses.replace(t, source=Source.ON_POLICY) for t in trajectories]  # no sampled ids
        text_only = trainer._update(text_rows, advantages, keep)
        trainer.close()
        assert "behaviour_logp_abs_diff" not in text_only  # no sampled rows, nothing to compare
        if correction:  # and nothing to weigh: text rows keep weight 1, outside the weight's mean
            assert text_only["behaviour_weight_mean"] == 0
    for m in out.values():  # a random policy's log-probs are far from -0.05 per token
        assert m["behaviour_logp_abs_diff"] > 0.5 and m["behaviour_kl"] > 0
    assert out[False]["behaviour_logp_abs_diff"] == pytest.approx(out[True]["behaviour_logp_abs_diff"], rel=1e-4)
    # the weight is π_old/π_behaviour = exp(log π_old + 0.05): a random 1,024-token policy's tokens, ~1e-3
    assert "behaviour_weight_mean" not in out[False] and 0 < out[True]["behaviour_weight_mean"] < 0.01
