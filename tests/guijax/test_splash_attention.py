"""Splash attention (the TPU kernel) against the dense reference, run in the Pallas interpreter on CPU; on a
mesh inside shard_map; chosen by "auto" only where it applies; and compiled by the TPU compiler when libtpu
is installed."""
from __future__ import annotations

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from guijax import aot, sharding
from guijax.models import splash_attention
from guijax.models.attention import attention, compiling_for, target_platform
from guijax.models.config import PRESETS
from guijax.models.qwen2_5_vl import Qwen2_5_VL

TOL = dict(atol=3e-5, rtol=3e-5)


def _qkv(seed: int, b: int, s: int, h: int, kvh: int, d: int):
    rs = np.random.RandomState(seed)
    return tuple(jnp.asarray(rs.randn(b, s, n, d), jnp.float32) for n in (h, kvh, kvh))


def _segments(b: int, s: int, lengths: tuple[int, ...], left_pad: bool = False) -> jax.Array:
    """[b, s]: runs of ids 1, 2, ... of the given lengths, then padding (first row) or padding first (second)."""
    row = np.concatenate([np.full(n, i + 1, np.int32) for i, n in enumerate(lengths)])
    rows = np.zeros((b, s), np.int32)
    rows[:, :row.size] = row
    if left_pad and b > 1:
        rows[1] = np.concatenate([np.zeros(s - row.size, np.int32), row])
    return jnp.asarray(rows)


def _values_and_grads(impl: str, q, k, v, **kw):
    ct = jnp.asarray(np.random.RandomState(99).randn(*q.shape), jnp.float32)

    def f(q, k, v):
        out = attention(q, k, v, implementation=impl, **kw)
        return jnp.sum(out * ct), out

    (_, out), grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return out, grads


@pytest.mark.parametrize("causal", [True, False])
def test_splash_equals_the_reference_on_packed_padded_rows(causal):
    """Grouped heads, three packed segments, right and left padding, a length (200) that is no multiple of
    the 128-token tile: values and gradients as the dense definition's; padding queries exactly 0."""
    q, k, v = _qkv(0, 2, 200, 4, 2, 32)
    seg = _segments(2, 200, (70, 50, 40), left_pad=True)
    kw = dict(causal=causal, q_segment_ids=seg, kv_segment_ids=seg, block_q=128, block_k=128)
    with compiling_for("tpu", interpret=True):
        out, grads = _values_and_grads("splash", q, k, v, **kw)
    ref, ref_grads = _values_and_grads("reference", q, k, v, **kw)
    chex.assert_tree_all_finite((out, grads))
    chex.assert_trees_all_close(out, ref, **TOL)
    chex.assert_trees_all_close(grads, ref_grads, **TOL)
    assert not np.asarray(out[0, 160:]).any() and not np.asarray(out[1, :40]).any()


def test_on_a_mesh_auto_runs_splash_inside_shard_map_with_the_same_values():
    """8 devices as data 2 x fsdp 2 x tensor 2: rows split over data x fsdp, heads over tensor."""
    q, k, v = _qkv(1, 4, 256, 4, 2, 32)
    seg = _segments(4, 256, (100, 100))
    kw = dict(causal=True, q_segment_ids=seg, kv_segment_ids=seg)
    mesh = sharding.make_mesh(sharding.MeshConfig(data=2, fsdp=2, tensor=2))

    def loss(q, k, v):
        return jnp.sum(attention(q, k, v, implementation="auto", **kw) ** 2)

    with compiling_for("tpu", interpret=True), sharding.rules_context(mesh):
        jaxpr = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v))
        grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    assert "shard_map" in jaxpr and "pallas_call" in jaxpr
    assert "in_specs=(P(('data', 'fsdp'), None, 'tensor', None)" in jaxpr
    ref = jax.grad(lambda q, k, v: jnp.sum(attention(q, k, v, implementation="reference", **kw) ** 2),
                   argnums=(0, 1, 2))(q, k, v)
    chex.assert_trees_all_close(grads, ref, atol=1e-4, rtol=1e-4)


def test_inside_a_vmap_over_per_device_blocks_the_blocks_carry_the_split():
    """The vision tower's layout: rows of windows vmapped over per-device blocks with `spmd_axis_name`, the
    windows' own axis left whole by the rules inside. The kernel's shard_map then splits the blocks alone."""
    import flax.linen as nn

    q, k, v = _qkv(3, 8, 128, 2, 2, 16)  # 4 blocks of 2 rows
    blocks = lambda x: x.reshape(4, 2, *x.shape[1:])  # noqa: E731
    seg = _segments(8, 128, (100,))
    mesh = sharding.make_mesh(sharding.MeshConfig(data=2, fsdp=2, tensor=2))
    inner = tuple((name, None if name == "vision_windows" else axes) for name, axes in sharding.LOGICAL_RULES)

    def tower(q, k, v, seg):
        def one_block(q, k, v, seg):
            return attention(q, k, v, q_segment_ids=seg, kv_segment_ids=seg, row_axis="vision_windows")
        with nn.logical_axis_rules(inner):
            return jax.vmap(one_block, spmd_axis_name=("data", "fsdp"))(q, k, v, seg)

    with compiling_for("tpu", interpret=True), sharding.rules_context(mesh):
        args = (blocks(q), blocks(k), blocks(v), blocks(seg))
        jaxpr = str(jax.make_jaxpr(tower)(*args))
        out = jax.jit(tower)(*args)
    # q, k, v: the blocks split over data x fsdp, a block's rows whole, heads over tensor
    in_specs = re.search(r"in_specs=\(([^\n]*)\)", jaxpr).group(1)
    assert in_specs.count("P(('data', 'fsdp'), None, None, 'tensor', None)") == 3
    ref = attention(q, k, v, q_segment_ids=seg, kv_segment_ids=seg, implementation="reference")
    chex.assert_trees_all_close(out.reshape(ref.shape), ref, **TOL)


def test_auto_keeps_the_blockwise_path_where_splash_does_not_apply():
    q, k, v = _qkv(2, 1, 256, 2, 2, 16)

    def backend(fn) -> str:
        jaxpr = str(jax.make_jaxpr(fn)(q, k, v))
        return "splash" if "pallas_call" in jaxpr else "xla"

    with compiling_for("tpu", interpret=True):
        assert backend(lambda q, k, v: attention(q, k, v, causal=True)) == "splash"
        # a KV-cache decode's explicit positions; a sequence shorter than one 128-token tile
        decode = lambda q, k, v: attention(q[:, :1], k, v, causal=True,  # noqa: E731
                                           q_positions=jnp.full((1, 1), 255), kv_positions=jnp.arange(256)[None])
        assert backend(decode) == "xla"
        assert backend(lambda q, k, v: attention(q[:, :64], k[:, :64], v[:, :64])) == "xla"
        with pytest.raises(ValueError, match="splash attention does not apply: explicit positions"):
            attention(q[:, :1], k, v, causal=True, implementation="splash",
                      q_positions=jnp.full((1, 1), 255), kv_positions=jnp.arange(256)[None])
    assert backend(lambda q, k, v: attention(q, k, v, causal=True)) == "xla"  # the context is gone: CPU again


def test_compiling_for_sets_and_restores_the_target():
    default = (jax.default_backend(), False)
    assert target_platform() == default
    with compiling_for("tpu", interpret=True):
        assert target_platform() == ("tpu", True)
        with compiling_for("gpu"):
            assert target_platform() == ("gpu", False)
        assert target_platform() == ("tpu", True)
    assert target_platform() == default


@pytest.mark.parametrize("block, sq, sk, tile", [(512, 200, 200, 256), (512, 4096, 4096, 512), (100, 50, 300, 128),
                                                 (1, 1, 1, 128)])
def test_tile_is_whole_lanes_no_longer_than_the_sequence_needs(block, sq, sk, tile):
    assert splash_attention.tile_size(block, sq, sk) == tile


def test_the_decoder_on_splash_equals_the_blockwise_decoder():
    """The tiny model over a row of three packed examples and padding: same logits either way."""
    cfg = PRESETS["tiny"]
    rs = np.random.RandomState(9)
    ids = jnp.asarray(rs.randint(0, 900, (1, 160)), jnp.int32)
    segments = jnp.asarray(np.concatenate([np.repeat([1, 2, 3], [60, 50, 30]), np.zeros(20)])[None], jnp.int32)
    positions = jnp.asarray(np.broadcast_to(np.concatenate([np.arange(n) for n in (60, 50, 30, 20)]), (3, 1, 160)),
                            jnp.int32)
    params = Qwen2_5_VL(cfg).init(jax.random.PRNGKey(0), ids, positions, segments)
    blockwise = Qwen2_5_VL(cfg, attention_impl="xla").apply(params, ids, positions, segments)[0]
    with compiling_for("tpu", interpret=True):
        module = Qwen2_5_VL(cfg, attention_impl="auto")
        jaxpr = str(jax.make_jaxpr(lambda p: module.apply(p, ids, positions, segments)[0])(params))
        splashed = module.apply(params, ids, positions, segments)[0]
    assert "pallas_call" in jaxpr
    real = np.asarray(segments[0]) > 0
    chex.assert_trees_all_close(np.asarray(splashed)[0, real], np.asarray(blockwise)[0, real], atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not aot.has_libtpu(), reason="needs libtpu (pip install -e '.[tpu-compile]')")
def test_the_tpu_compiler_builds_the_kernel_on_a_topology():
    """Forward and backward lowered for 4 v5p chips and compiled by libtpu: the Mosaic kernel is in the
    program (three calls: forward, dq, dkv) and no [s, s] score array is."""
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    devices = np.asarray(topologies.get_topology_desc("v5p:2x2x1", "tpu").devices).reshape(4, 1, 1, 1)
    mesh = Mesh(devices, sharding.MESH_AXES)
    rows = NamedSharding(mesh, P("data"))
    b, s, h, kvh, d = 4, 2048, 8, 2, 128
    args = [jax.ShapeDtypeStruct((b, s, n, d), jnp.bfloat16, sharding=rows) for n in (h, kvh, kvh)]
    seg = jax.ShapeDtypeStruct((b, s), jnp.int32, sharding=rows)

    def loss(q, k, v, seg):
        out = attention(q, k, v, causal=True, q_segment_ids=seg, kv_segment_ids=seg)
        return jnp.sum(out.astype(jnp.float32))

    with compiling_for("tpu"), jax.set_mesh(mesh):
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args, seg).compile()
    text = compiled.as_text()
    assert text.count("tpu_custom_call") >= 3
    per_device_scores = (b // 4) * h * s * s * 4
    assert compiled.memory_analysis().temp_size_in_bytes < per_device_scores / 4
