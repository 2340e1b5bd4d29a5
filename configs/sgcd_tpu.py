"""SGCD for Qwen3-VL-30B-A3B on OSWorld on a TPU v5p pod slice (v5p-128: 64 chips, data 4 x FSDP 2 x expert 8),
launched on every host by launch/tpu_pod.sh; the settings of sgcd_gpu otherwise. Qwen3-VL-8B:
--config.model.preset=qwen3_vl_8b --config.model.path=/models/Qwen3-VL-8B-Instruct --config.mesh.expert=1.
`--dry_run` checks the sizes on any machine.

Expert parallelism drops what overflows 1.25 times an even share of each device's (token, choice) pairs
(`model.expert_capacity_factor`; the dropped fraction is logged as moe_dropped_fraction). Dropless, every device
reserves room for all its pairs at every destination, and the compiler refuses the step, naming 96.42 GiB per
chip in all, over a v5p chip's HBM; at 1.25 it peaks at 23.02 GiB (README).
"""
from configs import sgcd_gpu
from configs._common import v5p_128


def get_config():
    c = v5p_128(sgcd_gpu.get_config())
    c.name = "sgcd_tpu"
    c.model.path = "/models/Qwen3-VL-30B-A3B-Instruct"
    c.model.preset = "qwen3_vl_30b_a3b"
    c.mesh.expert = 8  # data 4 x FSDP 2 x expert 8
    c.model.expert_capacity_factor = 1.25  # dropless does not fit (docstring)
    return c
