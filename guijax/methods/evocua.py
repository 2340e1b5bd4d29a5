"""EvoCUA's offline evolution step (evocua.txt §5.2-5.3) as methods, trained from the base policy on the
`budget` stage's rollouts (dynamic compute budgeting, Eq. 1) and running no RL loop:

- `evocua_rft`: rejection-sampling fine-tuning on the successes, step-level denoised (redundant steps out of
  the loss; solved infeasible tasks reduced to their reasoning and terminate=failure);
- `evocua_dpo`: step-level DPO (Eq. 2) on the pairs mined at critical forking points of the failures
  (Pair I: action correction at t*; Pair II: reflection at t*+1);
- `evocua`: one evolution round, RFT then step-level DPO from the RFT policy (its own reference).

Knobs in the `evocua` section."""
from __future__ import annotations

import dataclasses
import json
from typing import Any, ClassVar

from envs.atomic import write_text_atomic
from guijax.methods.base import Context, Method, stage_rollouts
from guijax.metrics import MetricsWriter
from guijax.progress import echo
from guijax.schema import ranged


@dataclasses.dataclass(frozen=True)
class EvoCUAOptions:
    """`evocua`: the budget ladder (Eq. 1) of the budget stage, denoising, and the RFT and step-DPO runs."""

    budgets: tuple[int, ...] = ranged((2, 4, 8), low=1)  # K = {k_i}: rollouts per task, strictly increasing
    thresholds: tuple[float, ...] = ranged((1.0, 0.5, 0.25), low=0, high=1)  # Λ = {τ_i}, not increasing
    denoise: bool = True  # mask redundant steps; infeasible successes keep only reasoning + terminate=failure
    rft_steps: int = ranged(20, low=1)
    dpo_steps: int = ranged(20, low=1)
    batch_trajectories: int = ranged(8, low=1)  # RFT: step rows per batch; DPO: chosen + rejected steps per batch
    # the offline comparisons' rate (`offline.learning_rate`); DPO on a few pairs collapses the policy well above it
    rft_learning_rate: float = ranged(1e-5, low=0)
    dpo_learning_rate: float = ranged(1e-5, low=0)
    beta: float = ranged(0.1, low=0, low_open=True)  # Eq. 2's β
    window: int = ranged(2, low=0)  # reference alignment window w around t*
    reflection: bool = True  # Pair II (reflection and recovery at t*+1)


class _EvoCUA(Method):
    phases: ClassVar[tuple[str, ...]] = ()  # what before_rl runs, in order: "rft", "step_dpo"
    section = "evocua"
    options_class = EvoCUAOptions
    requires = ("budget",)
    rl = False

    def rollouts(self, ctx: Context) -> list:
        train_ids = {t.id for t in ctx.train_tasks}
        return [t for t in stage_rollouts(ctx, "budget_rollouts", "budget", self.name)
                if not train_ids or t.task_id in train_ids]

    def rft(self, ctx: Context, policy: Any, pipeline: Any, rollouts: list, writer: MetricsWriter) -> None:
        from guijax.evocua.denoise import denoise
        from guijax.data.pipeline import step_refs
        from guijax.sft import sft_steps

        o = self.options
        wins = [t for t in rollouts if t.success and t.steps]
        if not wins:
            raise ValueError(f"{self.name}: the budget stage's rollouts hold no success to fine-tune on")
        if o.denoise:
            infeasible = {t.id for t in ctx.train_tasks if t.infeasible}
            data = denoise(wins, infeasible)
            trajectories, refs = data.trajectories, data.refs
            writer.write({"rft_trajectories": len(trajectories), "rft_steps_masked": data.masked_steps,
                          "rft_steps_total": data.total_steps})
            echo(f"  {self.name}: {len(trajectories)} successes, {data.masked_steps}/{data.total_steps} steps "
                 "denoised out of the loss")
        else:
            trajectories, refs = wins, step_refs(wins)
        policy.params, history = sft_steps(policy, trajectories, policy.processor, self.config, pipeline, o.rft_steps,
                                           o.batch_trajectories, seed=ctx.streams.seed_for(self.name, "rft"),
                                           log=writer.write, desc=f"{self.name} rft", learning_rate=o.rft_learning_rate,
                                           refs=refs)
        echo(f"  {self.name} rft: loss {history[0]:.4f} -> {history[-1]:.4f} over {len(history)} steps")

    def step_dpo(self, ctx: Context, policy: Any, pipeline: Any, rollouts: list, writer: MetricsWriter) -> None:
        from guijax.evocua.step_dpo import mine_pairs
        from guijax.offline import train_preferences

        o = self.options
        pairs, counts = mine_pairs(rollouts, o.window, o.reflection, seed=ctx.streams.seed_for(self.name, "pairs"))
        write_text_atomic(ctx.workdir / "step_dpo_pairs.json", json.dumps(counts, indent=1))
        writer.write({f"dpo_{k}": v for k, v in counts.items()})
        if not pairs:
            raise ValueError(f"{self.name}: no critical forking point among the budget stage's rollouts "
                             f"({counts['failures']} failures, {counts['failures_with_reference']} with a successful "
                             "reference of their task)")
        echo(f"  {self.name}: {counts['action_correction_pairs']} action-correction and {counts['reflection_pairs']} "
             f"reflection pairs from {counts['failures_with_reference']} failures with a reference")
        policy.params, history = train_preferences(
            policy, "dpo", [[p.chosen, p.rejected] for p in pairs], self.config, pipeline, o.dpo_steps,
            o.batch_trajectories, seed=ctx.streams.seed_for(self.name, "dpo"), beta=o.beta,
            learning_rate=o.dpo_learning_rate, log=writer.write, last_step_only=True)
        echo(f"  {self.name} step-dpo: loss {history[0]:.4f} -> {history[-1]:.4f} over {len(history)} steps")

    def before_rl(self, ctx: Context, policy: Any, pipeline: Any) -> None:
        writer = MetricsWriter(ctx.workdir, "offline_metrics.jsonl", console=False)
        try:
            rollouts = self.rollouts(ctx)
            for phase in self.phases:
                getattr(self, phase)(ctx, policy, pipeline, rollouts, writer)
        finally:
            writer.close()

    def describe(self) -> str:
        o = self.options
        what = {"rft": f"{o.rft_steps} RFT steps", "step_dpo": f"{o.dpo_steps} step-DPO steps (window {o.window})"}
        return f"{self.summary}: " + " + ".join(what[p] for p in self.phases)

    def validate(self) -> None:
        super().validate()
        from guijax.evocua.budget import BudgetLadder

        BudgetLadder(tuple(self.options.budgets), tuple(self.options.thresholds))


class EvoCUARFT(_EvoCUA):
    name = "evocua_rft"
    summary = "EvoCUA RFT: budgeted rejection sampling, step-denoised SFT on the successes"
    phases = ("rft",)


class EvoCUADPO(_EvoCUA):
    name = "evocua_dpo"
    summary = "EvoCUA step-level DPO at critical forking points"
    phases = ("step_dpo",)


class EvoCUA(_EvoCUA):
    name = "evocua"
    summary = "EvoCUA round: RFT, then step-level DPO from the RFT policy"
    phases = ("rft", "step_dpo")
