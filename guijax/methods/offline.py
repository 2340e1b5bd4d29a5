"""ARPO's offline comparisons (arpo.txt §4) as methods: each trains from the base policy on the `select`
stage's fixed rollouts and runs no RL loop. `rft`: SFT on the successes (rejection sampling); `dpo`: one
success/failure pair per task; `kto`: every rollout, desirable when its reward is at least 0.5. Knobs in the
`offline` section (steps, trajectories per batch, learning rate, β)."""
from __future__ import annotations

import dataclasses
from typing import Any

from guijax.methods.base import Context, Method, stage_rollouts
from guijax.metrics import MetricsWriter
from guijax.progress import echo
from guijax.schema import ranged


@dataclasses.dataclass(frozen=True)
class OfflineOptions:
    """`offline`: the rft, dpo and kto methods' steps, batch, learning rate and β."""

    steps: int = ranged(20, low=1)
    batch_trajectories: int = ranged(8, low=1)
    learning_rate: float = ranged(1e-5, low=0)
    beta: float = ranged(0.1, low=0, low_open=True)


class _Offline(Method):
    section = "offline"
    options_class = OfflineOptions
    requires = ("select",)
    rl = False

    def rollouts(self, ctx: Context) -> list:
        return stage_rollouts(ctx.run_dir, "selection_rollouts", "select", self.name)

    def before_rl(self, ctx: Context, policy: Any, pipeline: Any) -> None:
        writer = MetricsWriter(ctx.workdir, "offline_metrics.jsonl", console=False)
        try:
            policy.params, history = self.train(ctx, policy, pipeline, self.rollouts(ctx), writer.write)
        finally:
            writer.close()
        echo(f"  {self.name}: loss {history[0]:.4f} -> {history[-1]:.4f} over {len(history)} steps")

    def train(self, ctx: Context, policy: Any, pipeline: Any, rollouts: list, log: Any) -> tuple[Any, list[float]]:
        from guijax.offline import preference_train  # here, not at the top: recipes import every method

        o = self.options
        return preference_train(policy, self.name, rollouts, self.config, pipeline, o.steps, o.batch_trajectories,
                                seed=ctx.streams.seed_for(self.name, "data"), beta=o.beta,
                                learning_rate=o.learning_rate, log=log)

    def describe(self) -> str:
        return f"{self.summary}: {self.options.steps} steps on the select stage's rollouts"


class RFT(_Offline):
    name = "rft"
    summary = "RFT (rejection-sampling fine-tuning) on the successful rollouts"

    def train(self, ctx: Context, policy: Any, pipeline: Any, rollouts: list, log: Any) -> tuple[Any, list[float]]:
        from guijax.sft import sft_steps  # here, not at the top: recipes import every method to read its section

        wins = [t for t in rollouts if t.success]
        if not wins:
            raise ValueError("rft: the select stage's rollouts hold no success to fine-tune on")
        return sft_steps(policy, wins, policy.processor, self.config, pipeline, self.options.steps,
                         self.config.sft.batch_size, seed=ctx.streams.seed_for(self.name, "data"), log=log,
                         desc=self.name, learning_rate=self.options.learning_rate)


class DPO(_Offline):
    name = "dpo"
    summary = "DPO on one success/failure pair per task"


class KTO(_Offline):
    name = "kto"
    summary = "KTO on every rollout (desirable: reward >= 0.5)"
