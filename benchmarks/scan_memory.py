"""Compiled train-step temporaries with layers under scan against unrolled, at one GUI row.

Why: a scanned step should need about what the unrolled one does. At long rows it once needed several times
as much, because attention masks computed from the loop-invariant segment ids were hoisted out of the layer
loop, every tile at once. This compares the two with the TPU compiler (needs libtpu: pip install -e
'.[tpu-compile]'), for one v5p chip, on any machine. The preset may be the benchmarks' `qwen2_5_0_5b`.

  python benchmarks/scan_memory.py --preset qwen2_5_vl_3b --screenshots 5 --text-only
  python benchmarks/scan_memory.py --preset qwen2_5_0_5b --screenshots 5
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from guijax import aot, launch, optim, sharding, train_step  # noqa: E402
from guijax.models import weights  # noqa: E402
from train_step import model_config  # noqa: E402  (benchmarks/train_step.py: presets and the 0.5B shape)


def temp_gib(preset: str, screenshots: int, text_only: bool, scan: bool, remat: str) -> float | str:
    config = launch.resolve("grpo_gpu", ["train.minibatch_size=1", f"model.remat={remat}",
                                         f"rollout.max_images={screenshots}", "dry_run.compiler=tpu_proxy"])
    cfg = model_config(preset)
    _, mesh, _ = aot._target_mesh(config)
    module = weights.build_module(cfg, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, remat_policy=remat,
                                  scan_layers=scan)
    tx, _ = optim.make_optimizer(config.optim)
    shards = train_step.state_shardings(module, tx, mesh)
    params = nn.unbox(weights.abstract_params(module))
    state = train_step.TrainState(aot._abstract(params, shards.params),
                                  aot._abstract(jax.eval_shape(tx.init, params), shards.opt_state),
                                  jax.ShapeDtypeStruct((), jnp.int32, sharding=shards.step))
    batch = aot.host_batch(aot.batch_shape(config, cfg), cfg)
    if text_only:
        batch.pop("vision")
    batch = aot._abstract(batch, sharding.batch_shardings(batch, mesh))
    step = train_step.make_train_step(module, tx, train_step.StepConfig(impl="chunked"), mesh)
    try:
        return step.lower_abstract(state, batch).compile().memory_analysis().temp_size_in_bytes / 2 ** 30
    except jax.errors.JaxRuntimeError as err:
        return str(err).splitlines()[0]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="qwen2_5_vl_3b", help="a guijax preset or qwen2_5_0_5b")
    p.add_argument("--screenshots", type=int, default=5, help="sets the row length (the bucket that holds them)")
    p.add_argument("--text-only", action="store_true", help="drop the vision inputs: the decoder alone")
    p.add_argument("--remat", default="full")
    a = p.parse_args(argv)
    if not aot.has_libtpu():
        raise SystemExit("needs libtpu: pip install -e '.[tpu-compile]'")
    for scan in (True, False):
        result = temp_gib(a.preset, a.screenshots, a.text_only, scan, a.remat)
        shown = f"{result:.2f} GiB" if isinstance(result, float) else result
        print(f"{a.preset} scan_layers={scan}: temporaries {shown}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
