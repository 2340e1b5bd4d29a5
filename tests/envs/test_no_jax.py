"""envs/ runs on CPU hosts without JAX: importing it in a fresh interpreter must not load jax."""
from __future__ import annotations

import subprocess
import sys


def test_envs_import_without_jax():
    code = "import sys, envs, envs.desk, envs.pool, envs.tasks, envs.actions; print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
