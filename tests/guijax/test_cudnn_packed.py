"""cuDNN's packed layout: segment ids as runs in cuDNN's form, and attention through it equal to the reference.

On CPU cuDNN is stood in for by the packed layout's own semantics (each run attends only itself, causally from
its start; tokens outside every run come back NaN, as cuDNN leaves them unwritten), so what is tested is what
guijax gives cuDNN and what it does with the answer. The `gpu` tests run the real kernel on a Hopper GPU."""
from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import guijax.models.attention as attention_lib
from guijax.models import cudnn_packed
from guijax.models.attention import attention, compiling_for


def _runs_numpy(row: np.ndarray, max_runs: int):
    """The plain definition: maximal runs of equal ids, their starts and lengths, and whether they fit."""
    starts = [0] + [i for i in range(1, len(row)) if row[i] != row[i - 1]]
    ends = starts[1:] + [len(row)]
    ids = [row[s] for s in starts]
    real = [i for i in ids if i != 0]
    fits = len(starts) <= max_runs and len(real) == len(set(real))
    pad = lambda xs, n: (xs + [-1] * n)[:n]  # noqa: E731
    return pad(starts, max_runs) + [-1], pad([e - s for s, e in zip(starts, ends)], max_runs), fits


@pytest.mark.parametrize("row, starts, lengths, fits", [
    ([1, 1, 2, 2, 2, 0, 0], [0, 2, 5, -1, -1], [2, 3, 2, -1], True),   # packed, padding at the end
    ([1, 1, 1, 1, 1, 1, 1], [0, -1, -1, -1, -1], [7, -1, -1, -1], True),
    ([0, 0, 0, 0, 0, 0, 0], [0, -1, -1, -1, -1], [7, -1, -1, -1], True),  # all padding: one run
    ([1, 1, 0, 2, 2, 0, 0], [0, 2, 3, 5, -1], [2, 1, 2, 2], True),        # padding between examples
    ([1, 1, 2, 2, 1, 1, 0], [0, 2, 4, 6, -1], [2, 2, 2, 1], False),       # id 1 in two runs
    ([1, 2, 3, 4, 5, 5, 5], [0, 1, 2, 3, -1], [1, 1, 1, 1], False),       # 5 runs, room for 4
])
def test_segment_runs_in_cudnns_form(row, starts, lengths, fits):
    got = cudnn_packed.segment_runs(jnp.asarray([row], jnp.int32), max_runs=4)
    chex.assert_trees_all_equal(tuple(np.asarray(x)[0].tolist() for x in got), (starts, lengths, fits))


def test_segment_runs_equal_the_plain_definition_on_random_rows():
    rs = np.random.RandomState(0)
    rows = np.stack([np.repeat(rs.randint(0, 4, 12), rs.randint(2, 5, 12))[:24] for _ in range(64)])
    starts, lengths, fits = (np.asarray(x) for x in cudnn_packed.segment_runs(jnp.asarray(rows), max_runs=6))
    for i, row in enumerate(rows):
        assert (starts[i].tolist(), lengths[i].tolist(), bool(fits[i])) == _runs_numpy(row, 6), row
    assert 0 < fits.sum() < len(rows)  # both kinds of row were drawn


def test_fits_needs_the_same_ids_for_queries_and_keys():
    seg = jnp.asarray([[1, 1, 2, 0], [1, 1, 2, 0]], jnp.int32)
    other = seg.at[1, 2].set(1)
    assert np.asarray(cudnn_packed.fits(seg, other)).tolist() == [True, False]
    assert np.asarray(cudnn_packed.fits(seg, seg[:, :3])).tolist() == [False, False]


def packed_stand_in(q, k, v, *, q_seqlen, kv_seqlen, q_offsets, kv_offsets, scale, mask_type, qkv_layout):
    """cuDNN's packed layout as JAX's binding describes it: each (offset, length) is a sequence of its own,
    causal from its own start under PADDING_CAUSAL; the outputs and gradients of tokens in no sequence are
    left unwritten (NaN here)."""
    assert qkv_layout == "BTNH" and q_offsets.shape[1] == q_seqlen.shape[1] + 1
    assert q_seqlen is kv_seqlen and q_offsets is kv_offsets  # self-attention: one layout for both
    b, s, h, d = q.shape
    pos = jnp.arange(s)
    starts, lengths = q_offsets[:, :-1], q_seqlen
    inside = (starts[:, :, None] <= pos) & (pos < starts[:, :, None] + lengths[:, :, None]) & (lengths[:, :, None] > 0)
    run = jnp.where(jnp.any(inside, 1), jnp.argmax(inside, 1), -1)  # [b, s]: each token's sequence
    mask = (run[:, :, None] == run[:, None, :]) & (run[:, :, None] >= 0)
    if mask_type.name == "PADDING_CAUSAL":
        mask &= pos[None, None, :] <= pos[None, :, None]
    return _unwritten_outside_runs(q, k, v, mask, run < 0, scale)


def _dense(q, k, v, mask, scale):
    groups = q.shape[2] // k.shape[2]
    kf, vf = (jnp.repeat(x.astype(jnp.float32), groups, axis=2) for x in (k, v))
    scores = jnp.einsum("bqhd,bshd->bhqs", q.astype(jnp.float32), kf) * scale
    probs = jax.nn.softmax(jnp.where(mask[:, None], scores, -1e30), axis=-1)
    return jnp.einsum("bhqs,bshd->bqhd", probs, vf).astype(q.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _unwritten_outside_runs(q, k, v, mask, unwritten, scale):
    return jnp.where(unwritten[:, :, None, None], jnp.nan, _dense(q, k, v, mask, scale)).astype(q.dtype)


def _unwritten_fwd(q, k, v, mask, unwritten, scale):
    return _unwritten_outside_runs(q, k, v, mask, unwritten, scale), (q, k, v, mask, unwritten)


def _unwritten_bwd(scale, res, d_out):
    q, k, v, mask, unwritten = res
    grads = jax.vjp(lambda q, k, v: _dense(q, k, v, mask, scale), q, k, v)[1](d_out)
    return tuple(jnp.where(unwritten[:, :, None, None], jnp.nan, g).astype(g.dtype) for g in grads) + (None, None)


_unwritten_outside_runs.defvjp(_unwritten_fwd, _unwritten_bwd)


@pytest.fixture
def stand_in(monkeypatch):
    """The packed kernel stood in for, traced as for a Hopper GPU; returns the list of runs taken."""
    taken = []

    def recorded(*args, **kw):
        jax.debug.callback(lambda: taken.append("packed"))
        return packed_stand_in(*args, **kw)

    monkeypatch.setattr(cudnn_packed, "_fused", lambda: recorded)
    monkeypatch.setattr(cudnn_packed, "unavailable", lambda: "")
    return taken


def _qkv(seed: int, b: int, s: int, h: int = 4, kvh: int = 2, d: int = 16):
    rs = np.random.RandomState(seed)
    return tuple(jnp.asarray(rs.randn(b, s, n, d), jnp.bfloat16) for n in (h, kvh, kvh))


def _values_and_grads(impl, q, k, v, seg, causal):
    ct = jnp.asarray(np.random.RandomState(7).randn(*q.shape), jnp.float32)

    def loss(q, k, v):
        out = attention(q, k, v, causal=causal, q_segment_ids=seg, kv_segment_ids=seg, implementation=impl)
        return jnp.sum(out.astype(jnp.float32) * ct), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return out, grads


PACKED = [[1] * 20 + [2] * 30 + [3] * 10 + [0] * 4, [1] * 64, [1] * 5 + [2] * 50 + [0] * 9]


@pytest.mark.parametrize("causal", [False, True])
def test_packed_rows_on_the_kernel_equal_the_reference(stand_in, causal):
    """Values and gradients of the packed path equal the reference's; padding tokens get exactly 0 in both,
    though cuDNN is given them as runs of their own (their slots would otherwise be left unwritten)."""
    q, k, v = _qkv(1, 3, 64)
    seg = jnp.asarray(PACKED, jnp.int32)
    with compiling_for("gpu"):
        out, grads = _values_and_grads("cudnn_packed", q, k, v, seg, causal)
    as_f32 = tuple(x.astype(jnp.float32) for x in (q, k, v))
    ref_out, ref_grads = _values_and_grads("reference", *as_f32, seg, causal)
    chex.assert_tree_all_finite((out, grads))
    chex.assert_trees_all_close(out.astype(jnp.float32), ref_out, atol=2e-2, rtol=2e-2)
    chex.assert_trees_all_close(tuple(g.astype(jnp.float32) for g in grads), ref_grads, atol=5e-2, rtol=5e-2)
    padding = np.asarray(seg) == 0
    for x in (out, *grads):
        assert not np.asarray(x, np.float32)[padding].any()
    jax.effects_barrier()
    assert stand_in


def test_rows_the_layout_cannot_hold_come_back_nan_when_named(stand_in):
    q, k, v = _qkv(2, 2, 16)
    seg = jnp.asarray([[1] * 8 + [2] * 8, [1] * 4 + [2] * 4 + [1] * 8], jnp.int32)
    with compiling_for("gpu"):
        out = attention(q, k, v, causal=True, q_segment_ids=seg, kv_segment_ids=seg, implementation="cudnn_packed")
    assert np.isfinite(np.asarray(out[0], np.float32)).all() and np.isnan(np.asarray(out[1], np.float32)).all()


def test_auto_on_a_hopper_gpu_takes_the_packed_kernel_for_packed_rows_only(stand_in, monkeypatch):
    """Right-padded rows keep cuDNN with lengths, packed rows take the packed layout, rows with more runs than
    it has room for the blockwise path; each is the reference's attention."""
    lengths_taken = []

    def lengths_stand_in(q, k, v, q_seg, kv_seg, causal, scale):
        jax.debug.callback(lambda: lengths_taken.append("lengths"))
        n = lambda seg: jnp.sum(seg != 0, 1).astype(jnp.int32)  # noqa: E731
        return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=causal, implementation="xla",
                                            query_seq_lengths=n(q_seg), key_value_seq_lengths=n(kv_seg))

    monkeypatch.setattr(attention_lib, "_cudnn", lengths_stand_in)
    q, k, v = _qkv(3, 2, 64)
    many = np.repeat(np.arange(1, 12), 6)[:64]  # 11 runs: over the room for 8
    cases = {"right-padded": ([[1] * 64, [1] * 50 + [0] * 14], (["lengths"], [])),
             "packed": ([[1] * 30 + [2] * 30 + [0] * 4, [1] * 64], ([], ["packed"])),
             "too many runs": ([many.tolist(), [1] * 64], ([], []))}
    for name, (rows, want) in cases.items():
        seg = jnp.asarray(rows, jnp.int32)
        lengths_taken.clear(), stand_in.clear()
        with compiling_for("gpu"):
            out, _ = _values_and_grads("auto", q, k, v, seg, True)
        jax.effects_barrier()
        ref, _ = _values_and_grads("reference", *(x.astype(jnp.float32) for x in (q, k, v)), seg, True)
        chex.assert_trees_all_close(out.astype(jnp.float32), ref, atol=2e-2, rtol=2e-2)
        assert (sorted(set(lengths_taken)), sorted(set(stand_in))) == want, name


def test_the_packed_kernel_is_not_traced_without_a_hopper_gpu():
    assert cudnn_packed.unavailable()  # this machine's default device is not a GPU
    q, k, v = _qkv(4, 1, 16)
    seg = jnp.ones((1, 16), jnp.int32)
    with compiling_for("gpu"), pytest.raises(ValueError, match="cudnn_packed attention does not apply"):
        attention(q, k, v, q_segment_ids=seg, kv_segment_ids=seg, implementation="cudnn_packed")
    with compiling_for("gpu"), pytest.raises(ValueError, match="self-attention"):
        attention(q, k[:, :8], v[:, :8], implementation="cudnn_packed")


def test_the_key_offsets_cudnn_reads_count_the_keys_own_heads(monkeypatch):
    """JAX's binding turns each run's token offset into an element offset. With grouped heads the keys' must
    count the keys' own heads; JAX before 0.11 counted the queries', so there guijax repeats the keys' heads.
    Checked on JAX's own fix-up of exactly what guijax passes it, two rows of 8 tokens."""
    from jax._src.cudnn.fused_attention_stablehlo import _fix_seqlen_offsets

    seen = {}

    def binding(q, k, v, *, q_seqlen, kv_seqlen, q_offsets, kv_offsets, **kw):
        q_elements, kv_elements = _fix_seqlen_offsets(q_seqlen, kv_seqlen, q_offsets, kv_offsets, q, k)[2:]
        seen.update(q=np.asarray(q_elements).reshape(-1), kv=np.asarray(kv_elements).reshape(-1), k=k, v=v)
        return jnp.zeros_like(q)

    monkeypatch.setattr(cudnn_packed, "_fused", lambda: binding)
    q, k, v = _qkv(0, 2, 8, h=4, kvh=2, d=16)
    seg = jnp.asarray([[1, 1, 1, 2, 2, 0, 0, 0], [1] * 8], jnp.int32)
    cudnn_packed.attention(q, k, v, seg, causal=True, scale=1.0)
    tokens = [0, 3, 5, 8]  # row 0's three runs, then row 1's one, which starts at token 8 of the flattened rows
    kv_heads = seen["k"].shape[2]
    assert seen["q"][:4].tolist() == [t * 4 * 16 for t in tokens]
    assert seen["kv"][:4].tolist() == [t * kv_heads * 16 for t in tokens]
    if kv_heads == 4:  # repeated: query head i still reads key head i // 2, as grouped attention does
        chex.assert_trees_all_equal(seen["k"][:, :, ::2], k, seen["k"][:, :, 1::2], k)
        chex.assert_trees_all_equal(seen["v"][:, :, ::2], v)


def test_a_named_packed_kernel_gives_right_padded_rows_to_plain_cudnn(stand_in, monkeypatch):
    """Rows right-padded by construction (the vision tower's windows, one group each, vmapped over per-device
    blocks, which JAX's packed binding cannot batch) take cuDNN with lengths when cudnn_packed is named; other
    calls take the packed layout."""
    from guijax.models import vision

    lengths_taken = []

    def lengths_stand_in(q, k, v, q_seg, kv_seg, causal, scale):
        jax.debug.callback(lambda: lengths_taken.append("lengths"))
        return jnp.zeros_like(q)

    monkeypatch.setattr(attention_lib, "_cudnn", lengths_stand_in)
    q = jnp.zeros((6, 2, 8), jnp.bfloat16)
    with compiling_for("gpu"):
        vision.window_attention(q, q, q, jnp.asarray([[0, 1, 2], [3, 4, -1]]), jnp.arange(6), "cudnn_packed")
        jax.effects_barrier()
        assert (lengths_taken, stand_in) == (["lengths"], [])
        rows = q.reshape(2, 3, 2, 8)
        seg = jnp.asarray([[1, 1, 2], [1, 1, 0]], jnp.int32)
        attention(rows, rows, rows, q_segment_ids=seg, kv_segment_ids=seg, implementation="cudnn_packed")
        jax.effects_barrier()
    assert (lengths_taken, stand_in) == (["lengths"], ["packed"])


def _hopper() -> bool:
    return jax.default_backend() == "gpu" and not cudnn_packed.unavailable()


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_cudnn_packed_equals_reference_on_a_hopper_gpu(causal):
    if not _hopper():
        pytest.skip(cudnn_packed.unavailable())
    rs = np.random.RandomState(5)
    q, k, v = (jnp.asarray(rs.randn(2, 512, n, 128), jnp.bfloat16) for n in (8, 2, 2))
    seg = jnp.asarray([[1] * 200 + [2] * 250 + [0] * 62, [1] * 100 + [2] * 100 + [3] * 312], jnp.int32)
    out, grads = _values_and_grads("cudnn_packed", q, k, v, seg, causal)
    auto_out, _ = _values_and_grads("auto", q, k, v, seg, causal)
    ref_out, ref_grads = _values_and_grads("reference", *(x.astype(jnp.float32) for x in (q, k, v)), seg, causal)
    hlo = jax.jit(lambda q, k, v: attention(q, k, v, causal=causal, q_segment_ids=seg, kv_segment_ids=seg,
                                            implementation="cudnn_packed")).lower(q, k, v).as_text()
    assert "__cudnn$fmha" in hlo
    chex.assert_tree_all_finite((out, grads))
    chex.assert_trees_all_close(out.astype(jnp.float32), ref_out, atol=3e-2, rtol=3e-2)
    chex.assert_trees_all_close(auto_out.astype(jnp.float32), ref_out, atol=3e-2, rtol=3e-2)
    for g, r in zip(grads, ref_grads):
        g = np.asarray(g, np.float32)
        assert np.linalg.norm(g - np.asarray(r)) <= 3e-2 * np.linalg.norm(np.asarray(r))
        assert not g[np.asarray(seg) == 0].any()
