"""The persistent compilation cache: a second process running the same program loads it instead of compiling."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax

from guijax import compilation_cache

PROGRAM = textwrap.dedent("""
    import sys
    import jax, jax.numpy as jnp
    from guijax import compilation_cache
    hits = []
    jax.monitoring.register_event_listener(lambda event, **kw: hits.append(event) if "cache_hits" in event else None)
    compilation_cache.enable(sys.argv[1])
    def f(x):
        for _ in range(4):
            x = jnp.tanh(x @ x.T) + x
        return x
    print(float(jax.jit(f)(jnp.ones((16, 16))).sum()), len(hits))
""")


def test_empty_directory_leaves_the_cache_off():
    before = jax.config.jax_compilation_cache_dir
    assert compilation_cache.enable("") is None
    assert jax.config.jax_compilation_cache_dir == before


def test_second_process_reads_what_the_first_wrote(tmp_path):
    cache = tmp_path / "nested" / "xla"
    env = {**os.environ, "XLA_FLAGS": ""}
    runs = [subprocess.run([sys.executable, "-c", PROGRAM, str(cache)], capture_output=True, text=True, env=env,
                           check=True) for _ in range(2)]
    entries = sorted(p.name for p in cache.iterdir())
    assert any(name.startswith("jit_f-") for name in entries), entries
    (value0, hits0), (value1, hits1) = (r.stdout.split() for r in runs)
    assert value0 == value1
    assert int(hits0) == 0 and int(hits1) >= 1  # the second process loaded the executable


def test_unwritable_directory_names_the_setting(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    try:
        compilation_cache.enable(str(blocker / "xla"))
    except OSError as e:
        assert "compilation_cache_dir" in str(e) and str(blocker) in str(e)
    else:
        raise AssertionError("expected an OSError")
