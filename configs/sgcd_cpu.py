"""SGCD on the synthetic desk with the small preset (`--config=sgcd_cpu`), 2 CPU cores, no downloads.

1. The base policy: a fresh small Qwen2.5-VL after a short SFT warm start on scripted-expert traces. It sees
   click_button / toggle_checkbox traces plain (a quarter also with their skill after the instruction), and
   choose_option traces only with the skill: it can use a skill in its context there, but has never solved the
   bare instruction. A pretrained VLM reads a skill as ordinary instruction text; a fresh model has to have seen
   one (SGCD's skill-guided policy relies on that context). The scripted expert's traces carry noise (a quarter
   of its actions a random click or a missed step, then its recovery), four per task; the noise's own actions
   carry no loss (`sft.noisy_steps=mask`), so the policy has seen recoveries from off-track states without
   learning the mistakes. Without them it never recovered from its own first wrong step, and SGCD had no
   continuation to distil (README).
2. methods, from the same base policy: `sgcd` (one round: M=4 plain rollouts per training task, a skill per
   failed task from the desk's ground truth and the failed references, skill-guided recoverability, handoffs
   at k = 1..4 branched from one prefix per task, the rule judge, SFT on D_exp ∪ D⁺ ∪ D_cont with the prefix
   unsupervised) and `sgcd_no_continuations` (the same round trained on D_exp ∪ D⁺ alone).
3. table: plain success per split; csr: the Continuation Success Rate of the base policy and both methods on
   the evaluation tasks the base policy fails, base-policy prefixes of k = 1..4 steps.
"""
from configs._common import base, small_desk


def get_config():
    c = small_desk(base("sgcd_cpu"))
    c.stages = ("base_model", "tasks", "expert", "sft", "eval_base", "methods", "table", "csr", "report")
    c.sft.steps = 150
    c.sft.families = ("click_button", "toggle_checkbox")
    c.sft.plan_only_families = ("choose_option",)
    c.sft.plan_fraction = 0.25
    c.sft.conditioning = "skill"
    c.sft.expert_noise = 0.25
    c.sft.noisy_steps = "mask"
    c.sft.traces_per_task = 4
    c.sgcd.rounds = 1
    c.sgcd.rollouts_per_task = 4
    c.sgcd.skill_rollouts = 2
    # The warm start showed skills written without failure evidence, so the fresh model has never read a Failure
    # Traps field, and with one in its context it mostly writes broken actions. The traps are still extracted
    # (skills.json); they stay out of the skill-guided policy's context here.
    c.sgcd.skill_fields = ("Continuation Plans", "Critical Targets", "Success Criteria")
    c.sgcd.max_handoff = 4
    c.sgcd.continuations_per_state = 4  # the desk's failed episodes end early: few depths per prefix
    c.sgcd.sft_steps = 40
    c.sgcd.batch_trajectories = 8
    c.sgcd.learning_rate = 1e-4  # the desk's fine-tuning rate (expert_sft.learning_rate)
    c.sgcd.csr_max_handoff = 4
    c.sgcd.csr_per_state = 4
    c.compare.methods = ("sgcd_no_continuations", "sgcd")
    c.eval.splits = ("train", "held_out")
    c.eval.episodes_per_task = 4
    return c
