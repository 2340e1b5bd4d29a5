"""EvoCUA on the synthetic desk with the small preset (`--config=evocua_cpu`), 2 CPU cores, no downloads: the
paper's pipeline end to end, in the CPU recipes' compact UI-TARS prompt (the paper's computer_use tool calls:
--config.rollout.prompt=computer_use_compact).

1. synthesis: verifiable task synthesis (§3): scenarios -> instruction, validator and reference, checked in the
   sandbox (rejects the start state, accepts the reference's end) with errors fed back; the scripted expert's
   consistency with each validator; decontamination against the held-out split.
2. coldstart + sft: the cold start (§5.1): the scripted expert's successes with a brief hindsight thought per
   step, written in the grammar the prompt asks for; a fresh small Qwen2.5-VL fine-tuned on them.
3. budget: dynamic compute budgeting (Eq. 1): the cold-start policy rolls each training task out 2 times, topped
   up to 4 and then 8 while its success rate stays under 1.0, 0.5, 0.25.
4. methods, from the same cold-start policy: RFT on the step-denoised successes (§5.2), RFT then step-level DPO
   (§5.3), and the evolution cycle, whose rounds roll the current policy out on the training split and the
   synthesized tasks and train RFT then step-DPO on what each round finds; table: success per split.
"""
from configs._common import base, small_desk


def get_config():
    c = small_desk(base("evocua_cpu"))
    c.stages = ("base_model", "tasks", "synthesis", "coldstart", "sft", "budget", "eval_base", "methods", "table",
                "report")
    c.rollout.max_new_tokens = 112  # brief cold-start thoughts run to 96 tokens with the action
    c.synthesis.count = 12
    c.coldstart.brief = True
    c.sft.data = "coldstart"
    c.sft.steps = 100  # the cold-start loss is under 0.06 by step 100 (8.4 at the start)
    c.evocua.budgets = (2, 4, 8)
    c.evocua.thresholds = (1.0, 0.5, 0.25)
    # RFT and step-DPO as the offline comparisons of the other recipes run: 20 steps of 8 at lr 1e-5
    c.evocua.rft_steps = 20
    c.evocua.dpo_steps = 20
    c.evocua.rounds = 2
    c.evocua.synthesized = True
    c.compare.methods = ("evocua_rft", "evocua", "evocua_cycle")
    c.eval.splits = ("train", "held_out")
    c.eval.episodes_per_task = 4
    c.eval.step_limits = (3, 6)
    return c
