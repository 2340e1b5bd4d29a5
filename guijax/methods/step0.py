"""EvoCUA's online step-level policy optimisation, STEP0 (evocua.txt §7, Eq. 3-6), and the trajectory-level
baseline it is compared with (its Fig. 7).

A GUI policy is rolled out with a short context (the last few steps with screenshots, older ones as text), so
the samples it is trained on are its steps, each in the context it was sampled with. STEP0 keeps GRPO's group
advantage Â_i (Eq. 3) and shares it out over the trajectory's T_i steps, Â_{i,t} = Â_i / T_i (Eq. 4); every
step is one row whose tokens are averaged (1/K_t), and the rows are summed and divided by the group's size
(1/G, Eq. 5): a trajectory pushes as much in total whatever its length, so successes are pushed to be short
and failures to explore longer. The clip is asymmetric (`train.eps_low`, `train.eps_high`) and the KL to the
reference policy is `train.kl_coef` (β).

Both methods fix Eq. 5's per-step token mean (`sequence` aggregation) whatever `train.normalization` says,
so one recipe can compare them with GRPO's token mean."""
from __future__ import annotations

import dataclasses

from guijax import objectives
from guijax.methods.base import Method


class STEP0(Method):
    name = "step0"
    summary = "EvoCUA STEP0: step-level GRPO, each step row with Â_i/T_i, per-step token mean, 1/G"
    steps = "step0"

    def loss(self):
        loss = super().loss()
        return dataclasses.replace(loss, clip=loss.clip._replace(normalization="sequence"))

    def objective(self) -> objectives.Objective:
        return objectives.Objective(self.loss(), steps=self.steps)


class FinalStepGRPO(STEP0):
    name = "grpo_final_step"
    summary = "GRPO trained on each trajectory's final step only (STEP0's trajectory-level baseline)"
    steps = "final"
