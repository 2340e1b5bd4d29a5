"""BEPA's SFT baselines (bepa.txt §5.1, App. E.1): `sft` fine-tunes the base policy on the converted expert
traces D_conv of the training tasks for `expert_sft.epochs` epochs and stops; `sft_rl` then runs GRPO."""
from __future__ import annotations

import dataclasses
from typing import Any

from guijax.methods.base import Context, Method
from guijax.metrics import MetricsWriter
from guijax.schema import ranged


@dataclasses.dataclass(frozen=True)
class ExpertSFTOptions:
    """`expert_sft`: the sft and sft_rl baselines' epochs over D_conv and learning rate."""

    epochs: int = ranged(3, low=1)  # BEPA App. E.1: 3
    learning_rate: float = ranged(1e-6, low=0)  # fine-tuning at the RL rate (BEPA App. E: both 1e-6)


class SFT(Method):
    name = "sft"
    summary = "SFT on D_conv"
    section = "expert_sft"
    options_class = ExpertSFTOptions
    requires = ("expert",)
    rl = False

    def before_rl(self, ctx: Context, policy: Any, pipeline: Any) -> None:
        from guijax.sft import sft_steps  # here, not at the top: recipes import every method to read its section

        train_ids = {t.id for t in ctx.train_tasks}
        traces = [t for t in ctx.expert_traces().values() if t.task_id in train_ids]
        if not traces:
            raise ValueError(f"{self.name}: no converted expert trace of a training task to fine-tune on")
        batch_size = self.config.sft.batch_size
        steps = max(1, self.options.epochs * sum(len(t.steps) for t in traces) // batch_size)
        writer = MetricsWriter(ctx.workdir, "expert_sft_metrics.jsonl", console=False)
        policy.params, _ = sft_steps(policy, traces, policy.processor, self.config, pipeline, steps, batch_size,
                                     seed=ctx.streams.seed_for("sft", "data"), log=writer.write,
                                     checkpoint_dir=ctx.workdir / "expert_sft_checkpoints", desc=f"{self.name} sft",
                                     learning_rate=self.options.learning_rate)  # fine-tuning, not the warm start
        writer.close()

    def describe(self) -> str:
        return f"{self.options.epochs} SFT epochs on D_conv at lr {self.options.learning_rate:g}"


class SFTThenRL(SFT):
    name = "sft_rl"
    summary = "SFT on D_conv, then GRPO"
    rl = True

    def describe(self) -> str:
        return f"{SFT.describe(self)}; then {Method.describe(self)}"
