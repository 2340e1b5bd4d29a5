"""BEPA for UI-TARS-1.5-7B on OSWorld on a TPU v5p pod slice (64 chips, 256 environments per iteration as in
the paper), launched on every host by launch/tpu_pod.sh (`python -m guijax.launch --config=bepa_tpu`)."""
from configs._common import base, bepa_on_osworld, uitars_on_osworld, v5p_128


def get_config():
    c = v5p_128(bepa_on_osworld(uitars_on_osworld(base("bepa_tpu"))))
    c.rollout.tasks_per_iteration = 32
    c.train.iterations = 4 * 128 // c.rollout.tasks_per_iteration  # BEPA App. E: 4 epochs over 128 tasks
    return c
