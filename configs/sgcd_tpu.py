"""SGCD for Qwen3-VL-30B-A3B on OSWorld on a TPU v5p pod slice (v5p-128: 64 chips, data 4 x FSDP 2 x expert 8),
launched on every host by launch/tpu_pod.sh; the settings of sgcd_gpu otherwise. Qwen3-VL-8B:
--config.model.preset=qwen3_vl_8b --config.model.path=/models/Qwen3-VL-8B-Instruct --config.mesh.expert=1.
`--dry_run` checks the sizes on any machine.
"""
from configs import sgcd_gpu
from configs._common import v5p_128


def get_config():
    c = v5p_128(sgcd_gpu.get_config())
    c.name = "sgcd_tpu"
    c.model.path = "/models/Qwen3-VL-30B-A3B-Instruct"
    c.model.preset = "qwen3_vl_30b_a3b"
    c.mesh.expert = 8  # data 4 x FSDP 2 x expert 8
    return c
