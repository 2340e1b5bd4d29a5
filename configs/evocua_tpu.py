"""EvoCUA for Qwen3-VL-32B on OSWorld on a TPU v5p pod slice (v5p-128: 64 chips, data 4 x FSDP 16), launched on
every host by launch/tpu_pod.sh; the settings of evocua_gpu otherwise, its frozen vision tower included. Compiled
at these shapes (64 rows x 12,288 tokens, 5 screenshots each) the step peaks at 58.51 GiB of a v5p chip's 95 GiB
with splash attention (37.26 GiB when the compiler is given a 55 GiB budget; README); with the tower trained (--config.model.frozen="()") it is not compiled. Qwen3-VL-8B:
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
