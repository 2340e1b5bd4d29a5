"""SEAgent for UI-TARS-7B-DPO on OSWorld from one 8-GPU node (`python -m guijax.launch --config=seagent_gpu`).

The paper's settings where they apply (seagent.txt §4, Sup.): the actor is UI-TARS-7B-DPO (UI-TARS 1.0 on
Qwen2-VL-7B), whose UI-TARS text uses 0-1000 coordinates (`rollout.coordinate_model=uitars-1.0`); the World
State Model judges every episode through an OpenAI-compatible vision endpoint with Fig. 8's prompt (serve
the paper's released judge there; key in $OPENAI_API_KEY if it needs one); three phases, each an update of
L_GRPO + γ·L_AI (γ 0.2) at lr 2e-5 in batches of 16 (the paper's 1k iterations over about 1.4k judged pairs
per phase are about 12 passes); sampling at temperature 1.0 (the paper's t=0, stated for its sensitivity
analysis, would give state-level groups of one answer). Edit model.path, env.osworld_dir, env.osworld_split (the
paper trains specialists on VS Code, GIMP, LibreOffice Impress, VLC and LibreOffice Writer), env.server_urls
and seagent.chat_url for your machines; Qwen2.5-VL-7B (seagent_tpu's policy):
--config.model.preset=qwen2_5_vl_7b --config.model.path=/models/Qwen2.5-VL-7B-Instruct
--config.rollout.coordinate_model=uitars-1.5 --config.rollout.prompt=uitars_official.
The policy is prompted with UI-TARS 1.0's OSWorld prompt (`rollout.prompt=uitars_v1`: its action space
with call_user(), 0-1000 coordinates). Specialist to generalist: --config.method=seagent_s2g
--config.seagent.curriculum=none with --config.seagent.apps naming the applications (task domains). The curriculum is the paper's: an LLM at
seagent.curriculum_url (the paper: Qwen2.5-72B) answers Fig. 9 from the World State Model's captions (of each
training task's initial screen, set up once on the servers, then of each phase's steps), and its instructions run
from the setup of the training task whose screen names their elements, judged by the World State Model alone;
100 tasks and 100 change descriptions per phase, where Table 7's success plateaus (`--config.seagent.curriculum=none`
rolls out the training split every phase instead). Check the sizes with --dry_run.

Every parameter trains, the vision tower included, over 2-way data x 4-way FSDP: compiled by the H100 proxy
(`python -m guijax.launch --config=seagent_gpu --dry_run --nodry_run_sampler`), the step holds 31.68 GiB per
device (36.53 GiB with the measured GPU factor, of 74.51), where FSDP over all eight GPUs held 91.79 GiB
(105.83: it does not fit) when the proxy's compiler had a v5p chip's 95 GiB to spend; under the GPU's budget
it is refused (naming 65.32 GiB), and under the next budget tried, 80.77 GiB, it peaks at 80.44 GiB: it does not
fit by the proxy (README). Compiled by XLA:GPU itself for 8 H100s without a GPU (the `gpu-compile` extra, jax
0.11.2), the step holds 43.22 GiB per device: it fits. (It held 87.29 GiB while the vision tower's `auto`
attention checked its rows at run time inside the vmap over per-device blocks, running both branches; the
tower's rows are right-padded by construction, so it now takes cuDNN unchecked, and the empty rows that pad
per-device blocks attend one stand-in token; README.)
Not yet run on GPUs.
"""
from configs._common import base, gpu_node, uitars_on_osworld


def get_config():
    c = gpu_node(uitars_on_osworld(base("seagent_gpu")))
    c.mesh.data, c.mesh.fsdp = 2, 4  # 2 replicas of a 4-GPU FSDP group: fits 8 H100s, FSDP over 8 does not
    c.model.path = "/models/UI-TARS-7B-DPO"
    c.model.preset = "qwen2_vl_7b"
    c.rollout.coordinate_model = "uitars-1.0"
    c.rollout.prompt = "uitars_v1"  # UI-TARS 1.0's OSWorld prompt, as its agent there fills it for Qwen2-VL
    c.rollout.temperature = 1.0
    c.stages = ("base_model", "tasks", "eval_base", "methods", "table", "report")
    c.method = "seagent"
    c.train.normalization = "sequence"  # Eq. 5: mean over each response's tokens, then over responses
    c.seagent.phases = 3
    c.seagent.episodes_per_task = 4
    c.seagent.group_size = 8
    c.seagent.gamma = 0.2
    c.seagent.judge = "chat"
    c.seagent.chat_url = "http://localhost:8001/v1"  # the World State Model, served (e.g. by vLLM)
    c.seagent.chat_model = "world-state-model"
    c.seagent.chat_api_key_env = "OPENAI_API_KEY"
    c.seagent.curriculum = "chat"
    c.seagent.curriculum_url = "http://localhost:8002/v1"  # the task generator, served (e.g. by vLLM)
    c.seagent.curriculum_model = "Qwen2.5-72B-Instruct"
    c.seagent.curriculum_api_key_env = "OPENAI_API_KEY"
    c.seagent.tasks_per_phase = 100
    c.seagent.curriculum_descriptions = 100
    c.seagent.learning_rate = 2e-5
    c.seagent.batch_rows = 16
    c.seagent.update_epochs = 12
    c.compare.methods = ("seagent",)
    c.eval.splits = ("train", "held_out")
    return c
