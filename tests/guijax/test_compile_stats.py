"""The compilation counter behind the `compiles` / `time_compile_s` iteration metrics."""
import numpy as np

import jax

from guijax import compile_stats


def test_a_window_counts_each_new_shape_once():
    double = jax.jit(lambda x: 2 * x)
    window = compile_stats.Window()
    double(np.ones(3, np.float32))
    double(np.ones(3, np.float32))  # cached: no compilation
    double(np.ones(5, np.float32))  # a new shape compiles again
    seen = window.read()
    assert seen["compiles"] == 2 and seen["time_compile_s"] > 0
    assert compile_stats.Window().read() == {"compiles": 0, "time_compile_s": 0.0}
