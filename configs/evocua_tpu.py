"""EvoCUA for Qwen3-VL-32B on OSWorld on a TPU v5p pod slice (v5p-128: 64 chips, data 4 x FSDP 16), launched on
every host by launch/tpu_pod.sh; the settings of evocua_gpu otherwise, its frozen vision tower included (whether
the 32B step would fit with the tower trained is not compiled; --config.model.frozen="()" trains it). Qwen3-VL-8B:
--config.model.preset=qwen3_vl_8b --config.model.path=/models/Qwen3-VL-8B-Instruct. `--dry_run` checks the
sizes on any machine.
"""
from configs import evocua_gpu
from configs._common import v5p_128


def get_config():
    c = v5p_128(evocua_gpu.get_config())
    c.name = "evocua_tpu"
    c.model.path = "/models/Qwen3-VL-32B-Instruct"
    c.model.preset = "qwen3_vl_32b"
    return c
