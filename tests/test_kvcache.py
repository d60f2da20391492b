"""splat.attention_with_kvcache and splat.update_kvcache, contiguous and paged, against float64.

The reference is the dense definition in attention_with_kvcache's docstring: query ``i`` of row
``b`` at position ``q_offset[b] + i`` sees key ``j`` where the static mask (taken at ``L x L``)
holds at (position, j), ``j < cache_seqlens[b]``, and ids agree; a position outside ``[0, L)``
sees nothing. Paged caches are built from the same logical cache: each row's pages at shuffled,
non-contiguous page ids of a pool whose unused pages, the slots past each row's length and the
page table's entries past its valid pages (NaN pages, or ids outside the pool) are never read.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import assert_close, runtime_ref
from runtime_masks import packed_ids

import jax_bindings
import splat
from jax_bindings import _dispatch
from splat import masks

L = 128  # logical cache length of every case: Lmax, or max_pages * page_size
SCALE = 0.3


def _irregular(i, j):
    """Causal, hashed: no progression holds it, so the layout is a block-sparse residual."""
    return (j <= i) & ((((i * 7919) ^ (j * 104729)) % 7 < 2) | (i - j < 2))


MASKS = {
    "causal": masks.causal(),
    "causal_window": masks.sliding_window(15, 0),
    "sinks_window": masks.sink(4) | masks.sliding_window(15, 0),
    "dilated_window": masks.dilated_window(6, 2),
    "strided": masks.strided(3),
    "from_fn_residual": masks.from_fn(_irregular),
}

LAYOUTS = ("contiguous", "paged16", "paged64")


def test_from_fn_case_has_a_residual():
    assert splat.analyze(MASKS["from_fn_residual"], L, L).residual is not None


# -----------------------------------------------------------------------------
# building caches and the reference
# -----------------------------------------------------------------------------


def _logical(rng, b, hk, d, lens, dtype):
    """Keys and values ``[B, L, Hk, D]``, NaN at and past each row's length (never to be read)."""
    k, v = (rng.standard_normal((b, L, hk, d)).astype(np.float32) for _ in range(2))
    tail = np.arange(L)[None, :] >= np.asarray(lens)[:, None]
    k[tail], v[tail] = np.nan, np.nan
    return jnp.asarray(k, dtype), jnp.asarray(v, dtype)


def _paged(rng, k, v, lens, page_size):
    """``(k_pool, v_pool, page_table)`` holding the logical ``k, v`` ``[B, L, Hk, D]``.

    Valid pages sit at shuffled pool ids; spare pool pages hold NaN; the table's entries past a
    row's valid pages point at NaN pages (row 0) or outside the pool (other rows).
    """
    b, _, hk, d = k.shape
    max_pages = L // page_size
    n_pages = b * max_pages + 3
    order = rng.permutation(n_pages)
    table = order[: b * max_pages].reshape(b, max_pages).astype(np.int32)
    kp = np.full((n_pages, page_size, hk, d), np.nan, np.float32)
    vp = kp.copy()
    kn, vn = np.asarray(k, np.float32), np.asarray(v, np.float32)
    for r in range(b):
        used = -(-int(lens[r]) // page_size)
        for j in range(max_pages):
            if j < used:
                kp[table[r, j]] = kn[r, j * page_size : (j + 1) * page_size]
                vp[table[r, j]] = vn[r, j * page_size : (j + 1) * page_size]
            elif r > 0:
                table[r, j] = [-1, n_pages, 10**6][j % 3]
    return jnp.asarray(kp, k.dtype), jnp.asarray(vp, k.dtype), jnp.asarray(table)


def _caches(rng, layout, k, v, lens):
    """``(k_cache, v_cache, page_table or None)`` of the logical cache in ``layout``."""
    if layout == "contiguous":
        return k, v, None
    return _paged(rng, k, v, lens, int(layout.removeprefix("paged")))


def _dense(mask, pos, lens, ids=None, kv_ids=None):
    """``[B, Sq, L]``: what each query sees (the docstring's definition)."""
    static = splat.analyze(mask, L, L).to_dense()
    pos = np.asarray(pos)
    inside = (pos >= 0) & (pos < L)
    m = static[np.where(inside, pos, 0)] & inside[..., None]
    m &= np.arange(L)[None, None, :] < np.asarray(lens)[:, None, None]
    if ids is not None:
        m &= np.asarray(ids)[:, :, None] == np.asarray(kv_ids)[:, None, :]
    return m


def _reference(q, k, v, dense, cap=None, dout=None):
    """float64 ``(out, grads)``; NaN keys are never seen, so they are zeroed for the oracle."""
    k0, v0 = (jnp.nan_to_num(x.astype(jnp.float32)) for x in (k, v))
    dout = jnp.zeros(q.shape, jnp.float32) if dout is None else dout
    return runtime_ref(q, k0, v0, dense, SCALE, dout, cap)


def _query(rng, b, sq, h, d, dtype=jnp.float32):
    return jnp.asarray(rng.standard_normal((b, sq, h, d)), dtype)


def _run(q, kc, vc, mask, table, **kw):
    return splat.attention_with_kvcache(q, kc, vc, mask, page_table=table, scale=SCALE, **kw)


def _check(
    rng,
    layout,
    mask,
    sq,
    *,
    lens,
    h=4,
    hk=2,
    d=16,
    dtype=jnp.float32,
    offset=None,
    jit=False,
    ids=False,
    cap=None,
):
    b = len(lens)
    lens = np.asarray(lens, np.int32)
    q = _query(rng, b, sq, h, d, dtype)
    k, v = _logical(rng, b, hk, d, lens, dtype)
    kc, vc, table = _caches(rng, layout, k, v, lens)
    pos = (lens - sq if offset is None else np.broadcast_to(offset, (b,)))[:, None] + np.arange(sq)
    kw = {"cache_seqlens": jnp.asarray(lens)}
    if offset is not None:
        kw["q_offset"] = jnp.asarray(offset, jnp.int32)
    qids = kvids = None
    if ids:
        kvids = packed_ids(rng, b, L, 20)
        qids = np.take_along_axis(kvids, np.clip(pos, 0, L - 1), axis=1)
        kw.update(segment_ids=jnp.asarray(qids), kv_segment_ids=jnp.asarray(kvids))
    call = lambda q, kc, vc, table, kw: _run(q, kc, vc, mask, table, logits_soft_cap=cap, **kw)  # noqa: E731
    out = (jax.jit(call) if jit else call)(q, kc, vc, table, kw)
    dense = _dense(mask, pos, lens, qids, kvids)
    ref, _ = _reference(q, k, v, dense, cap)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert_close("out", out, ref, dtype)
    empty = ~dense.any(-1)  # [B, Sq]: rows that see nothing give exactly 0
    assert not np.asarray(out, np.float32)[empty].any()
    return out, empty


# -----------------------------------------------------------------------------
# results against the float64 reference
# -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(MASKS))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_masks_gqa_decode_of_three(rng, layout, name):
    _check(rng, layout, MASKS[name], 3, lens=[5, 77, 128])


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("sq", [1, 16])
def test_query_counts(rng, layout, sq):
    _check(rng, layout, MASKS["sinks_window"], sq, lens=[16, 100, 128], h=8, hk=1)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_chunk_of_prefill_at_an_offset(rng, layout):
    """40 queries at positions 60..99 of caches holding 100 keys (chunked prefill)."""
    _check(rng, layout, masks.causal(), 40, lens=[100, 100], offset=np.array([60, 60]), jit=True)


@pytest.mark.parametrize("layout", ["contiguous", "paged16"])
def test_packed_documents_and_soft_cap(rng, layout):
    _check(rng, layout, masks.causal(), 3, lens=[40, 128, 77], ids=True, cap=0.7)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("layout", ["contiguous", "paged16"])
def test_low_precision(rng, layout, dtype):
    _check(rng, layout, MASKS["causal_window"], 3, lens=[9, 128], dtype=dtype)


# -----------------------------------------------------------------------------
# rows that see nothing, positions outside the layout
# -----------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["contiguous", "paged64"])
def test_window_past_the_cache_sees_nothing(rng, layout):
    """Queries at 40..42 with a causal window of 4 and 5 keys in the cache: output exactly 0."""
    out, empty = _check(rng, layout, masks.sliding_window(3, 0), 3, lens=[5, 50], offset=np.array([40, 40]))
    assert empty[0].all() and not empty[1].any()


@pytest.mark.parametrize("layout", ["contiguous", "paged16"])
def test_traced_positions_outside_the_layout_give_zero(rng, layout):
    """Under jit a chunk running past L, or starting before 0, leaves those rows at 0 (not clipped)."""
    out, empty = _check(
        rng, layout, masks.causal(), 8, lens=[128, 128, 30], offset=np.array([124, -3, 20]), jit=True
    )
    assert empty[0, 4:].all() and empty[1, :3].all() and not empty[2].any()


def test_contiguous_gradients_against_the_reference(rng):
    b, sq, lens = 2, 3, np.array([20, 128], np.int32)
    q = _query(rng, b, sq, 4, 16)
    k, v = _logical(rng, b, 2, 16, lens, jnp.float32)
    k, v = jnp.nan_to_num(k), jnp.nan_to_num(v)  # gradients reach every cache entry: keep them finite
    dout = _query(rng, b, sq, 4, 16)
    mask = MASKS["sinks_window"]
    f = lambda q, k, v: _run(q, k, v, mask, None, cache_seqlens=jnp.asarray(lens))  # noqa: E731
    out, vjp = jax.vjp(f, q, k, v)
    dense = _dense(mask, (lens - sq)[:, None] + np.arange(sq), lens)
    ref, grads = _reference(q, k, v, dense, dout=dout)
    assert_close("out", out, ref, jnp.float32)
    for name, got, want in zip(("dq", "dk", "dv"), vjp(dout), grads, strict=True):
        assert_close(name, got, want, jnp.float32, factor=4.0)


# -----------------------------------------------------------------------------
# determinism, tracing, vmap, gradients of the paged op
# -----------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["contiguous", "paged16"])
def test_reruns_are_bit_identical(rng, layout):
    lens = np.array([33, 128], np.int32)
    q = _query(rng, 2, 3, 4, 16)
    kc, vc, table = _caches(rng, layout, *_logical(rng, 2, 2, 16, lens, jnp.float32), lens)
    runs = [
        np.asarray(_run(q, kc, vc, masks.causal(), table, cache_seqlens=jnp.asarray(lens))) for _ in range(2)
    ]
    assert np.array_equal(runs[0], runs[1])


@pytest.mark.parametrize("layout", ["contiguous", "paged16"])
def test_no_retrace_when_positions_lengths_or_tables_change(rng, layout):
    traces = []

    @jax.jit
    def step(q, kc, vc, table, lens, off):
        traces.append(1)
        return _run(q, kc, vc, MASKS["causal_window"], table, cache_seqlens=lens, q_offset=off)

    outs = []
    for lens in (np.array([10, 128], np.int32), np.array([64, 99], np.int32)):
        q = _query(rng, 2, 2, 4, 16)
        kc, vc, table = _caches(rng, layout, *_logical(rng, 2, 2, 16, lens, jnp.float32), lens)
        outs.append(step(q, kc, vc, table, jnp.asarray(lens), jnp.asarray(lens - 2)))
        outs.append(step(q, kc, vc, table, jnp.asarray(lens), jnp.asarray(lens - 5)))
    assert len(traces) == 1
    assert all(np.isfinite(np.asarray(o)).all() for o in outs)


def test_grad_through_the_paged_cache_raises_clearly(rng):
    lens = np.array([30], np.int32)
    q = _query(rng, 1, 1, 4, 16)
    kp, vp, table = _paged(rng, *_logical(rng, 1, 2, 16, lens, jnp.float32), lens, 16)
    f = lambda q: _run(q, kp, vp, masks.causal(), table, cache_seqlens=jnp.asarray(lens)).sum()  # noqa: E731
    with pytest.raises(TypeError, match="attention_with_kvcache.*use a contiguous cache"):
        jax.grad(f)(q)
    with pytest.raises(TypeError, match="forward only"):
        jax.jit(jax.grad(f))(q)


def test_vmap_over_the_paged_op(rng):
    """A batched page pool (one pool per mapped row, page ids offset), a shared pool, batched tables."""
    lens = np.array([20, 90], np.int32)
    mask = MASKS["causal_window"]
    f = lambda q, kp, vp, t, n: _run(q, kp, vp, mask, t, cache_seqlens=n)  # noqa: E731
    items = []
    for _ in range(3):
        q = _query(rng, 2, 2, 4, 16)
        items.append(
            (q, *_paged(rng, *_logical(rng, 2, 2, 16, lens, jnp.float32), lens, 16), jnp.asarray(lens))
        )
    stacked = [jnp.stack(x) for x in zip(*items, strict=True)]
    want = [np.asarray(f(*it)) for it in items]
    got = jax.jit(jax.vmap(f))(*stacked)
    for i in range(3):
        np.testing.assert_allclose(np.asarray(got[i]), want[i], rtol=1e-6, atol=1e-6)
    q0, kp0, vp0, t0, n0 = items[0]
    qs = jnp.stack([it[0] for it in items])
    got = jax.vmap(f, in_axes=(0, None, None, None, None))(qs, kp0, vp0, t0, n0)  # one shared pool
    for i in range(3):
        np.testing.assert_allclose(
            np.asarray(got[i]), np.asarray(f(qs[i], kp0, vp0, t0, n0)), rtol=1e-6, atol=1e-6
        )


def test_selected_backend_takes_the_paged_op(rng):
    from jax_bindings import _runtime

    x = jax.ShapeDtypeStruct((2, 1, 4, 16), jnp.float32)
    pool = jax.ShapeDtypeStruct((9, 16, 2, 16), jnp.float32)
    table = jax.ShapeDtypeStruct((2, 4), jnp.int32)
    rt = _runtime.build(
        2, 1, 64, key_value_seq_lengths=jnp.array([3, 60]), q_offset=jnp.array([2, 59]), layout_rows=64
    )
    layout = splat.analyze(masks.causal(), 64, 64)
    got = jax_bindings.selected_backend("attention_paged", x, pool, pool, table, layout, 0.25, runtime=rt)
    assert got == "jax" if jax.default_backend() != "gpu" else got in jax_bindings.BACKENDS
    with pytest.raises(TypeError, match="needs runtime"):
        jax_bindings.selected_backend("attention_paged", x, pool, pool, table, layout, 0.25)


# -----------------------------------------------------------------------------
# update_kvcache, and decoding token by token
# -----------------------------------------------------------------------------


@pytest.mark.parametrize("page_size", [None, 8])
def test_update_round_trip(rng, page_size):
    b, hk, d, total = 2, 2, 4, 32
    new = [rng.standard_normal((b, n, hk, d)).astype(np.float32) for n in (5, 1, 3, 7)]
    if page_size is None:
        kc = vc = jnp.zeros((b, total, hk, d))
        table = None
    else:
        kc = vc = jnp.zeros((b * total // page_size + 2, page_size, hk, d))
        table = jnp.asarray(
            rng.permutation(kc.shape[0])[: b * total // page_size].reshape(b, -1).astype(np.int32)
        )
    lens = np.array([0, 10], np.int32)
    start = lens.copy()
    for x in new:
        kc, vc = splat.update_kvcache(
            kc, vc, jnp.asarray(x), jnp.asarray(-x), jnp.asarray(lens), page_table=table
        )
        lens += x.shape[1]
    want = np.concatenate(new, axis=1)
    for r in range(b):
        j = np.arange(start[r], lens[r])
        if table is None:
            got_k, got_v = np.asarray(kc[r, j]), np.asarray(vc[r, j])
        else:
            pages = np.asarray(table)[r, j // page_size]
            got_k, got_v = np.asarray(kc[pages, j % page_size]), np.asarray(vc[pages, j % page_size])
        np.testing.assert_array_equal(got_k, want[r])
        np.testing.assert_array_equal(got_v, -want[r])
    written = sum(x.shape[1] for x in new) * b * hk * d
    assert int((np.asarray(kc) != 0).sum()) == written  # nothing else was touched


def test_traced_writes_past_the_cache_are_dropped():
    kc = vc = jnp.zeros((1, 8, 1, 2))
    new = jnp.ones((1, 3, 1, 2))
    upd = jax.jit(lambda kc, vc, n: splat.update_kvcache(kc, vc, new, new, n))
    k, _ = upd(kc, vc, jnp.array([6]))
    assert np.asarray(k)[0, :, 0, 0].tolist() == [0, 0, 0, 0, 0, 0, 1, 1]
    k, _ = upd(kc, vc, jnp.array([-2]))  # positions -2, -1 dropped (not written at the end)
    assert np.asarray(k)[0, :, 0, 0].tolist() == [1, 0, 0, 0, 0, 0, 0, 0]


@pytest.mark.parametrize("page_size", [None, 8])
def test_greedy_decode_equals_full_causal_attention(rng, page_size):
    """A prompt of 5, then one token a step: each step's output is the full sequence's row."""
    b, s, h, hk, d = 2, 24, 4, 2, 16
    q, k, v = (jnp.asarray(rng.standard_normal((b, s, n, d)), jnp.float32) for n in (h, hk, hk))
    full = np.asarray(splat.attention(q, k, v, masks.causal()))
    cap = 32
    if page_size is None:
        kc = vc = jnp.zeros((b, cap, hk, d))
        table = None
    else:
        kc = vc = jnp.full((b * cap // page_size + 1, page_size, hk, d), jnp.nan)
        table = jnp.asarray(
            rng.permutation(kc.shape[0])[: b * cap // page_size].reshape(b, -1).astype(np.int32)
        )

    @jax.jit
    def step(kc, vc, q_new, k_new, v_new, lens):
        kc, vc = splat.update_kvcache(kc, vc, k_new, v_new, lens, page_table=table)
        n = lens + q_new.shape[1]
        return (
            kc,
            vc,
            splat.attention_with_kvcache(q_new, kc, vc, masks.causal(), cache_seqlens=n, page_table=table),
        )

    p = 5
    kc, vc, out = step(kc, vc, q[:, :p], k[:, :p], v[:, :p], jnp.zeros((b,), jnp.int32))
    np.testing.assert_allclose(np.asarray(out), full[:, :p], rtol=1e-5, atol=1e-5)
    for t in range(p, s):
        kc, vc, out = step(
            kc, vc, q[:, t : t + 1], k[:, t : t + 1], v[:, t : t + 1], jnp.full((b,), t, jnp.int32)
        )
        np.testing.assert_allclose(np.asarray(out[:, 0]), full[:, t], rtol=1e-5, atol=1e-5)


# -----------------------------------------------------------------------------
# bad input: static values raise, naming the argument
# -----------------------------------------------------------------------------


def _bad_call(paged: bool, **change):
    b, sq = 2, 2
    args = {
        "query": jnp.zeros((b, sq, 4, 16)),
        "k_cache": jnp.zeros((6, 16, 2, 16) if paged else (b, 64, 2, 16)),
        "v_cache": jnp.zeros((6, 16, 2, 16) if paged else (b, 64, 2, 16)),
        "mask": masks.causal(),
        "cache_seqlens": jnp.array([3, 40]),
        "page_table": jnp.array([[0, 1, 2, 3], [4, 5, 0, 0]], jnp.int32) if paged else None,
    }
    args.update(change)
    return splat.attention_with_kvcache(**args)


@pytest.mark.parametrize(
    ("paged", "change", "match"),
    [
        (False, {"q_offset": jnp.array([-1, 0])}, "q_offset must be >= 0"),
        (False, {"q_offset": jnp.array([0, 63])}, r"q_offset \+ Sq must be at most 64"),
        (False, {"cache_seqlens": jnp.array([0, 5])}, r"cache_seqlens must lie in \[1, 64\]"),
        (False, {"cache_seqlens": jnp.array([3, 65])}, r"cache_seqlens must lie in \[1, 64\]"),
        (False, {"cache_seqlens": 1}, "cache_seqlens = 1 .* is below Sq = 2"),
        (False, {"v_cache": jnp.zeros((2, 32, 2, 16))}, "k_cache and v_cache must have the same shape"),
        (False, {"segment_ids": jnp.zeros((2, 2), jnp.int32)}, "segment_ids was given alone"),
        (
            False,
            {"segment_ids": jnp.zeros((2, 2), jnp.int32), "kv_segment_ids": jnp.zeros((2, 63), jnp.int32)},
            r"kv_segment_ids must have shape \[B, L\]",
        ),
        (True, {"page_table": jnp.array([[0, 1, 2, 3], [4, 6, 0, 0]], jnp.int32)}, r"page_table\[1, 1\] = 6"),
        (
            True,
            {
                "page_table": jnp.array([[0, -1, 2, 3], [4, 5, 0, 0]], jnp.int32),
                "cache_seqlens": jnp.array([20, 40]),
            },
            r"page_table\[0, 1\] = -1",
        ),
        (True, {"page_table": np.zeros((2, 4), np.int64)}, "page_table must have dtype int32"),
        (True, {"page_table": jnp.zeros((3, 4), jnp.int32)}, r"page_table must have shape \[B, max_pages\]"),
        (True, {"page_table": jnp.zeros((2,), jnp.int32)}, r"page_table must have shape \[B, max_pages\]"),
        (True, {"cache_seqlens": jnp.array([3, 65])}, r"cache_seqlens must lie in \[1, 64\]"),
        (True, {"q_offset": 63}, r"q_offset \+ Sq must be at most 64"),
        (
            True,
            {"k_cache": jnp.zeros((6, 0, 2, 16)), "v_cache": jnp.zeros((6, 0, 2, 16))},
            "page size .* must be a positive int",
        ),
        (True, {"v_cache": jnp.zeros((6, 8, 2, 16))}, "k_cache and v_cache must have the same shape"),
    ],
)
def test_bad_static_values_name_themselves(paged, change, match):
    with pytest.raises(ValueError, match=match):
        _bad_call(paged, **change)


def test_unchecked_entries_past_the_valid_pages_pass():
    table = jnp.array([[0, 1, 2, 3], [4, 5, -7, 10**6]], jnp.int32)  # row 1 holds 40 keys: pages 0..2
    with pytest.raises(ValueError, match=r"page_table\[1, 2\] = -7"):
        _bad_call(True, page_table=table)
    assert _bad_call(True, page_table=table, cache_seqlens=jnp.array([3, 32])).shape == (2, 2, 4, 16)


def test_traced_page_ids_outside_the_pool_hide_their_keys(rng):
    """Under jit a bad page id is neither checked nor read: its keys are not seen."""
    lens = np.array([64], np.int32)
    q = _query(rng, 1, 1, 4, 16)
    k, v = _logical(rng, 1, 2, 16, lens, jnp.float32)
    kp, vp, table = _paged(rng, k, v, lens, 16)
    bad = table.at[0, 1].set(10**6).at[0, 2].set(-1)
    out = jax.jit(lambda t: _run(q, kp, vp, masks.causal(), t, cache_seqlens=jnp.asarray(lens)))(bad)
    dense = _dense(masks.causal(), np.array([[63]]), lens)
    dense[:, :, 16:48] = False
    assert_close("out", out, _reference(q, k, v, dense)[0], jnp.float32)


def test_update_bad_values_name_themselves():
    kc = jnp.zeros((2, 8, 1, 4))
    new = jnp.zeros((2, 3, 1, 4))
    with pytest.raises(ValueError, match=r"cache_seqlens \+ Sn must lie in \[Sn, 8\]"):
        splat.update_kvcache(kc, kc, new, new, jnp.array([0, 6]))
    with pytest.raises(ValueError, match=r"page_table\[0, 1\] = 9"):
        splat.update_kvcache(
            kc, kc, new, new, jnp.array([6, 0]), page_table=jnp.array([[0, 9], [1, 0]], jnp.int32)
        )
    with pytest.raises(TypeError, match="must share one dtype"):
        splat.update_kvcache(kc, kc, new.astype(jnp.bfloat16), new.astype(jnp.bfloat16), 0)


def test_attention_q_offset_past_the_keys_raises_when_concrete(rng):
    """The same rule in splat.attention: concrete offsets are checked, traced ones give 0 rows."""
    q, k = _query(rng, 1, 4, 2, 8), _query(rng, 1, 20, 2, 8)
    with pytest.raises(ValueError, match=r"q_offset \+ Sq must be at most 20"):
        splat.attention(q, k, k, masks.causal(), q_offset=17)
    with pytest.raises(ValueError, match="q_offset must be >= 0"):
        splat.attention(q, k, k, masks.causal(), q_offset=jnp.array([-1]))
    out = jax.jit(lambda o: splat.attention(q, k, k, masks.causal(), q_offset=o))(jnp.array([17]))
    assert not np.asarray(out)[0, 3:].any() and np.asarray(out)[0, :3].any()


def test_docstring_examples_run():
    import doctest

    from splat import _kvcache

    result = doctest.testmod(_kvcache)
    assert result.failed == 0 and result.attempted > 0


def test_dispatch_exports_the_paged_op():
    assert "attention_paged" in jax_bindings.__all__
    assert jax_bindings.attention_paged is _dispatch.attention_paged
