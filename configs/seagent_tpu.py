"""SEAgent for Qwen2.5-VL-7B on OSWorld on a TPU v5p pod slice (v5p-128: 64 chips, data 4 x FSDP 16), launched
on every host by launch/tpu_pod.sh; the settings of seagent_gpu otherwise. UI-TARS-7B-DPO:
--config.model.preset=qwen2_vl_7b --config.model.path=/models/UI-TARS-7B-DPO
--config.rollout.coordinate_model=uitars-1.0 --config.rollout.prompt=uitars_v1. `--dry_run` checks the sizes on any machine.
"""
from configs import seagent_gpu
from configs._common import v5p_128


def get_config():
    c = v5p_128(seagent_gpu.get_config())
    c.name = "seagent_tpu"
    c.model.path = "/models/Qwen2.5-VL-7B-Instruct"
    c.model.preset = "qwen2_5_vl_7b"
    c.rollout.coordinate_model = "uitars-1.5"  # Qwen2.5-VL writes pixels of the resized screenshot
    c.rollout.prompt = "uitars_official"  # UI-TARS-1.5's (a Qwen2.5-VL) prompt, not UI-TARS 1.0's
    return c
