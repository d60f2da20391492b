"""Runtime mask arguments of splat.attention (segment ids, lengths, q_offset, soft cap) vs float64.

Each case builds the per-batch dense mask from the definitions in splat.attention's docstring --
static mask at (q_offset + i, j) (nothing where that position is outside the mask's rows), AND ids
equal, AND i < query length, AND j < key length -- and
checks the forward output and the gradients against tests/reference.runtime_ref.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import assert_close, refusal_skips, rel_error, runtime_ref
from runtime_masks import packed_ids, runtime_dense

import splat
from jax_bindings import _runtime
from splat import masks


def _static(mask, rows: int, cols: int) -> np.ndarray:
    return splat.analyze(mask, rows, cols).to_dense()


def _inputs(rng, b, sq, skv, *, h=4, hk=2, d=16, dtype=jnp.float32):
    shapes = ((b, sq, h, d), (b, skv, hk, d), (b, skv, hk, d), (b, sq, h, d))
    return [jnp.asarray(rng.standard_normal(s), dtype) for s in shapes]


def _check(rng, backend, mask, sq, skv, *, b=3, dtype=jnp.float32, grads=True, cap=None, **rt):
    """splat.attention with runtime arguments ``rt`` (numpy) against the float64 reference."""
    q, k, v, do = _inputs(rng, b, sq, skv, dtype=dtype)
    rows = skv if rt.get("offset") is not None else sq
    dense = runtime_dense(_static(mask, rows, skv), b, sq, skv, **rt)
    kwargs = {
        "segment_ids": rt.get("ids"),
        "kv_segment_ids": rt.get("kv_ids"),
        "query_seq_lengths": rt.get("qlen"),
        "key_value_seq_lengths": rt.get("kvlen"),
        "q_offset": rt.get("offset"),
    }
    kwargs = {n: jnp.asarray(x) for n, x in kwargs.items() if x is not None}
    scale = 0.3

    @jax.jit
    def run(q, k, v, do, kw):
        f = lambda q, k, v: splat.attention(
            q, k, v, mask, scale=scale, logits_soft_cap=cap, backend=backend, **kw
        )
        out, vjp = jax.vjp(f, q, k, v)
        return out, vjp(do.astype(out.dtype))

    if backend == "triton" and "q_offset" in kwargs:  # the kernels' static rows are compiled in
        with pytest.raises(NotImplementedError, match="no q_offset"):
            run(q, k, v, do, kwargs)
        pytest.skip("the triton backend refuses q_offset (auto runs the pure backend)")
    with refusal_skips(backend):
        out, (dq, dk, dv) = run(q, k, v, do, kwargs)
    ref, (rdq, rdk, rdv) = runtime_ref(q, k, v, dense, scale, do, cap)
    assert_close("out", out, ref, dtype)
    empty = ~dense.any(-1)  # [b, sq]: rows that see nothing output exactly 0
    assert not np.asarray(out, np.float32)[empty].any()
    if grads:
        for name, got, want in (("dq", dq, rdq), ("dk", dk, rdk), ("dv", dv, rdv)):
            assert_close(name, got, want, dtype, factor=4.0)
        assert not np.asarray(dq, np.float32)[empty].any()
        unseen = ~dense.any(1)  # [b, skv]: keys no query sees get zero dk, dv
        assert not np.asarray(dk, np.float32)[unseen].any()
        assert not np.asarray(dv, np.float32)[unseen].any()
    return out


STATIC = {
    "full": masks.full(),
    "causal": masks.causal(),
    "causal_window": masks.sliding_window(7, 0),
    "window": masks.sliding_window(5, 3),
    "dilated": masks.dilated_window(6, 2),
    "global_window": masks.global_tokens(2) | masks.sliding_window(4, 4),
}


@pytest.mark.parametrize("name", sorted(STATIC))
def test_document_ids(rng, backend, name):
    ids = packed_ids(rng, 3, 70, 25)
    _check(rng, backend, STATIC[name], 70, 70, ids=ids)


def test_unsorted_ids_are_exact(rng, backend):
    ids = rng.integers(-2, 3, size=(3, 53)).astype(np.int32)
    _check(rng, backend, masks.causal(), 53, 53, ids=ids)


def test_rectangular_with_kv_ids(rng, backend):
    ids = packed_ids(rng, 2, 40, 12)
    kv_ids = packed_ids(rng, 2, 90, 30)
    _check(rng, backend, masks.full(), 40, 90, b=2, ids=ids, kv_ids=kv_ids)


def test_padding_lengths_with_fully_padded_rows(rng, backend):
    qlen = np.array([61, 0, 17], np.int32)
    kvlen = np.array([40, 61, 0], np.int32)
    _check(rng, backend, masks.causal(), 61, 61, qlen=qlen, kvlen=kvlen)


def test_lengths_are_clipped(rng, backend):
    qlen = np.array([-5, 1000, 30], np.int32)
    kvlen = np.array([1000, -1, 12], np.int32)
    _check(rng, backend, masks.full(), 37, 45, qlen=qlen, kvlen=kvlen)


@pytest.mark.parametrize("name", ["causal", "causal_window", "dilated", "global_window"])
def test_chunked_prefill_with_offsets(rng, backend, name):
    offset = np.array([0, 23, 64], np.int32)  # the last chunk runs past the end: those rows see nothing
    _check(rng, backend, STATIC[name], 24, 80, offset=offset)


@pytest.mark.parametrize("sq", [1, 5])
def test_decode_against_a_cache(rng, backend, sq):
    kvlen = np.array([9, 33, 70], np.int32)
    offset = kvlen - sq  # the new tokens are the last ones in the cache
    _check(rng, backend, masks.sliding_window(6, 0), sq, 70, offset=offset, kvlen=kvlen, grads=False)


def test_offset_on_a_residual_mask(rng, backend):
    pattern = rng.random((64, 64)) < 0.2
    pattern[np.arange(64), np.arange(64)] = True
    mask = masks.from_array(pattern)
    _check(rng, backend, mask, 12, 64, offset=np.array([3, 40, 52], np.int32))


def test_soft_cap(rng, backend):
    _check(rng, backend, masks.sliding_window(9, 2), 50, 50, cap=0.7)


def test_everything_together_gqa(rng, backend):
    ids = packed_ids(rng, 3, 66, 20)
    qlen = np.array([66, 50, 3], np.int32)
    kvlen = np.array([60, 66, 66], np.int32)
    _check(rng, backend, masks.sliding_window(11, 0), 66, 66, ids=ids, qlen=qlen, kvlen=kvlen, cap=1.5)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_low_precision(rng, backend, dtype):
    ids = packed_ids(rng, 2, 72, 30)
    _check(rng, backend, masks.causal(), 72, 72, b=2, dtype=dtype, grads=False, ids=ids, cap=5.0)


def test_one_trace_for_many_packings(rng):
    traces = []

    @jax.jit
    def f(q, k, v, ids, n):
        traces.append(1)
        return splat.attention(q, k, v, masks.causal(), segment_ids=ids, query_seq_lengths=n)

    q, k, v, _ = _inputs(rng, 2, 48, 48)
    outs = [f(q, k, v, jnp.asarray(packed_ids(rng, 2, 48, m)), jnp.array([48, m])) for m in (3, 10, 40)]
    assert len(traces) == 1
    assert not np.array_equal(np.asarray(outs[0]), np.asarray(outs[1]))


def test_vmap_over_packings(rng):
    q, k, v, _ = _inputs(rng, 1, 40, 40)
    ids = jnp.asarray(np.stack([packed_ids(rng, 1, 40, m) for m in (4, 9, 30)]))  # [3, 1, 40]
    f = lambda ids: splat.attention(q, k, v, masks.causal(), segment_ids=ids)
    got = jax.vmap(f)(ids)
    for i in range(3):
        np.testing.assert_allclose(np.asarray(got[i]), np.asarray(f(ids[i])), rtol=1e-6, atol=1e-6)


def test_reruns_are_bit_identical(rng, backend):
    a = _check(rng, backend, masks.causal(), 40, 40, ids=packed_ids(rng, 3, 40, 9), grads=False)
    rng2 = np.random.default_rng(0)
    q, k, v, _ = _inputs(rng2, 3, 40, 40)
    ids = jnp.asarray(packed_ids(rng2, 3, 40, 9))
    runs = [
        np.asarray(splat.attention(q, k, v, masks.causal(), segment_ids=ids, backend=backend))
        for _ in range(2)
    ]
    assert a.shape == runs[0].shape
    assert np.array_equal(runs[0], runs[1])


def test_runtime_mask_fields():
    ids = jnp.array([[0, 0, 1, 1, 1, 3], [2, 2, 2, 1, 2, 2]])
    rt = _runtime.build(2, 6, 6, segment_ids=ids, query_seq_lengths=jnp.array([9, 4]))
    assert rt.exact.tolist() == [1, 0]  # the second row's ids decrease
    assert rt.q_len.tolist() == [6, 4] and rt.kv_len.tolist() == [6, 6]
    assert rt.q_ids is rt.kv_ids and rt.q_pos is None
    rt = _runtime.build(1, 3, 8, q_offset=6, key_value_seq_lengths=jnp.array([-1]), layout_rows=8)
    assert rt.q_pos.tolist() == [[6, 7, -1]] and rt.kv_len.tolist() == [0]  # -1: outside the layout
    rt = _runtime.build(2, 3, 8, q_offset=jnp.array([-2, 5]), layout_rows=8)
    assert rt.q_pos.tolist() == [[-1, -1, 0], [5, 6, 7]]


# -- bad input ---------------------------------------------------------------------------------


def _call(**kw):
    x = jnp.zeros((2, 8, 2, 16))
    return splat.attention(x, x, x, masks.causal(), **kw)


@pytest.mark.parametrize(
    ("kw", "error", "match"),
    [
        ({"segment_ids": jnp.zeros((2, 7), jnp.int32)}, ValueError, r"segment_ids must have shape \[B, Sq\]"),
        ({"segment_ids": jnp.zeros((2, 8))}, TypeError, "segment_ids must have an integer dtype"),
        ({"segment_ids": np.zeros((2, 8), np.uint32)}, TypeError, "segment_ids must be int32 or narrower"),
        ({"kv_segment_ids": jnp.zeros((2, 8), jnp.int32)}, ValueError, "kv_segment_ids needs segment_ids"),
        (
            {"segment_ids": jnp.zeros((2, 8), jnp.int32), "kv_segment_ids": jnp.zeros((2, 9), jnp.int32)},
            ValueError,
            r"kv_segment_ids must have shape \[B, Skv\]",
        ),
        (
            {"query_seq_lengths": jnp.zeros((3,), jnp.int32)},
            ValueError,
            r"query_seq_lengths must have shape \[B\]",
        ),
        ({"key_value_seq_lengths": jnp.zeros((2,))}, TypeError, "key_value_seq_lengths must have an integer"),
        ({"q_offset": jnp.zeros((2, 1), jnp.int32)}, ValueError, "q_offset must have shape"),
        ({"q_offset": 1.5}, TypeError, "q_offset must be an integer array"),
        ({"logits_soft_cap": -1.0}, ValueError, "logits_soft_cap must be a positive finite number"),
        ({"logits_soft_cap": "big"}, TypeError, "logits_soft_cap must be a positive finite number"),
    ],
)
def test_bad_runtime_arguments_name_themselves(kw, error, match):
    with pytest.raises(error, match=match):
        _call(**kw)


def test_ids_need_kv_ids_when_lengths_differ():
    q = jnp.zeros((1, 4, 2, 16))
    kv = jnp.zeros((1, 6, 2, 16))
    with pytest.raises(ValueError, match="pass kv_segment_ids"):
        splat.attention(q, kv, kv, segment_ids=jnp.zeros((1, 4), jnp.int32))


def test_traced_soft_cap_is_refused():
    x = jnp.zeros((1, 8, 2, 16))
    with pytest.raises(TypeError, match="logits_soft_cap must be a static"):
        jax.jit(lambda c: splat.attention(x, x, x, logits_soft_cap=c))(1.0)


def test_scalar_offset_broadcasts(rng):
    q, k, v, _ = _inputs(rng, 2, 3, 20)
    a = splat.attention(q, k, v, masks.causal(), q_offset=5)
    b = splat.attention(q, k, v, masks.causal(), q_offset=jnp.array([5, 5]))
    assert rel_error(a, np.asarray(b, np.float64)) == 0.0
