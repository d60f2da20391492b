"""The Triton decode kernel through JAX on a real GPU: ``pytest -m gpu``.

Every ``decode_cases`` case it takes (causal, windows, sinks + window, dilated, strided; head dims
64-256; 1-16 tokens; GQA 1-32; contiguous and paged caches with NaN pages nobody maps; one split
and several, merged in the kernel),
bfloat16 and float16, against the float64 reference at the tokens' positions; reruns bit-identical;
a soft cap; and the public ``splat.attention_with_kvcache`` on ``backend="triton"``.
"""

from __future__ import annotations

import decode_cases as dc
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import FLOORS

import splat
from jax_bindings import _registry
from jax_bindings._runtime import RuntimeMask
from splat import masks

pytestmark = pytest.mark.gpu

if _registry.unavailable("triton") is not None:
    pytest.skip(
        f"the triton backend cannot run here: {_registry.unavailable('triton')}", allow_module_level=True
    )

from jax_bindings._triton import backend as tb  # noqa: E402

TAKEN = [c for c in dc.CASES if c[1] in (64, 128, 256)]


def _runtime(x: dc.Inputs) -> RuntimeMask:
    if x.q_ids is None:
        return RuntimeMask(jnp.asarray(x.q_len), jnp.asarray(x.kv_len), jnp.ones(x.q.shape[0], jnp.int32),
                           q_pos=jnp.asarray(x.q_pos))
    exact = (np.diff(x.q_ids, axis=1) >= 0).all(1) & (np.diff(x.kv_ids, axis=1) >= 0).all(1)
    return RuntimeMask(jnp.asarray(x.q_len), jnp.asarray(x.kv_len), jnp.asarray(exact.astype(np.int32)),
                       jnp.asarray(x.q_ids), jnp.asarray(x.kv_ids), jnp.asarray(x.q_pos))


def _check(out, lse, ref_out, ref_lse, dtype):
    out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
    assert np.isfinite(out).all()
    assert np.abs(out - ref_out).max() <= 4 * FLOORS[np.dtype(dtype)] * np.abs(ref_out).max()
    empty = ~np.isfinite(ref_lse)
    assert (out.transpose(0, 2, 1, 3)[empty] == 0).all()
    lse = np.asarray(lse, np.float64)
    assert (np.isneginf(lse) == empty).all()
    assert np.abs(lse[~empty] - ref_lse[~empty]).max() <= 2e-2


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("case", TAKEN, ids=["-".join(map(str, c)) for c in TAKEN])
def test_decode_matches_the_float64_reference(case, dtype, rng):
    name, d, t, h, hk, page, _ = case
    x = dc.inputs(rng, 3, t, h, hk, d, dc.MASKS[name])
    layout = splat.analyze(dc.MASKS[name], dc.L, dc.L)
    q, k, v = (jnp.asarray(a, dtype) for a in (x.q, x.k, x.v))
    rt, scale = _runtime(x), d**-0.5
    if page:
        kp, vp, table = dc.paged(rng, np.asarray(k, np.float32), np.asarray(v, np.float32), page)
        args = (q, jnp.asarray(kp, dtype), jnp.asarray(vp, dtype), rt, jnp.asarray(table))
    else:
        args = (q, k, v, rt, None)
    fn = jax.jit(lambda q, k, v, rt, table: tb.decode_forward(q, k, v, rt, layout, scale, None, table))
    out, lse = fn(*args)
    ref_out, ref_lse = dc.reference(
        np.asarray(q, np.float32), np.asarray(k, np.float32), np.asarray(v, np.float32), x.visible, scale
    )
    assert out.dtype == q.dtype and out.shape == q.shape and lse.shape == (3, h, t)
    _check(out, lse, ref_out, ref_lse, dtype)
    again = fn(*args)
    assert (np.asarray(again[0]) == np.asarray(out)).all() and (np.asarray(again[1]) == np.asarray(lse)).all()


@pytest.mark.parametrize("ids", ["documents", "any"])
@pytest.mark.parametrize("page", [0, 16])
def test_segment_ids(ids, page, rng):
    mask = masks.sink(4) | masks.sliding_window(299, 0)
    x = dc.inputs(rng, 4, 2, 8, 2, 128, mask, ids=ids)
    layout = splat.analyze(mask, dc.L, dc.L)
    q, k, v = (jnp.asarray(a, jnp.bfloat16) for a in (x.q, x.k, x.v))
    ref = dc.reference(*(np.asarray(a, np.float32) for a in (q, k, v)), x.visible, 128**-0.5)
    table = None
    if page:
        kp, vp, t = dc.paged(rng, np.asarray(k, np.float32), np.asarray(v, np.float32), page)
        k, v, table = jnp.asarray(kp, jnp.bfloat16), jnp.asarray(vp, jnp.bfloat16), jnp.asarray(t)
    fn = jax.jit(lambda q, k, v, rt, table: tb.decode_forward(q, k, v, rt, layout, 128**-0.5, None, table))
    out, lse = fn(q, k, v, _runtime(x), table)
    _check(out, lse, *ref, jnp.bfloat16)


@pytest.mark.parametrize("splits", [3, 7])
@pytest.mark.parametrize("name", ["causal", "dilated"])
def test_splits_of_uneven_walks_merge_bit_identically(name, splits, rng):
    """Rows whose walks are 30 to 1000 keys long, in up to 7 splits: the row's last program merges
    them in split order whichever finishes last, so five reruns give the same bits."""
    mask = dc.MASKS[name]
    kv_len = np.array([1000, 30, 700, 64, 129], np.int32)
    x = dc.inputs(rng, 5, 1, 8, 2, 128, mask, odd_rows=False)
    dense = splat.analyze(mask, dc.L, dc.L).to_dense()
    vis = np.stack([dense[n - 1] & (np.arange(dc.L) < n) for n in kv_len])[:, None]
    x = x._replace(kv_len=kv_len, q_pos=(kv_len - 1)[:, None].astype(np.int32), visible=vis)
    layout = splat.analyze(mask, dc.L, dc.L)
    q, k, v = (jnp.asarray(a, jnp.bfloat16) for a in (x.q, x.k, x.v))
    fn = jax.jit(lambda q, k, v, rt: tb.decode_forward(q, k, v, rt, layout, 128**-0.5, splits=splits))
    out, lse = fn(q, k, v, _runtime(x))
    _check(out, lse, *dc.reference(*(np.asarray(a, np.float32) for a in (q, k, v)), x.visible, 128**-0.5),
           jnp.bfloat16)
    for _ in range(5):
        again = fn(q, k, v, _runtime(x))
        assert (np.asarray(again[0]) == np.asarray(out)).all()
        assert (np.asarray(again[1]) == np.asarray(lse)).all()


def test_soft_cap(rng):
    x = dc.inputs(rng, 4, 2, 8, 2, 128, masks.causal())
    layout = splat.analyze(masks.causal(), dc.L, dc.L)
    q, k, v = (jnp.asarray(a, jnp.bfloat16) for a in (x.q, x.k, x.v))
    out, lse = jax.jit(lambda q, k, v, rt: tb.decode_forward(q, k, v, rt, layout, 128**-0.5, 30.0))(
        q, k, v, _runtime(x)
    )
    ref = dc.reference(*(np.asarray(a, np.float32) for a in (q, k, v)), x.visible, 128**-0.5, soft_cap=30.0)
    _check(out, lse, *ref, jnp.bfloat16)


@pytest.mark.parametrize("page", [0, 16])
def test_public_decode_runs_the_triton_kernel(page, rng):
    b, h, hk, d = 2, 8, 2, 128
    q = jnp.asarray(rng.standard_normal((b, 1, h, d)), jnp.bfloat16)
    k, v = (jnp.asarray(rng.standard_normal((b, dc.L, hk, d)), jnp.bfloat16) for _ in range(2))
    lens = jnp.array([dc.L, 401], jnp.int32)
    m = masks.sliding_window(255, 0)
    want = splat.attention_with_kvcache(q, k, v, m, cache_seqlens=lens, backend="jax")
    if page:
        kp, vp, table = dc.paged(rng, np.asarray(k, np.float32), np.asarray(v, np.float32), page)
        pools = (jnp.asarray(kp, jnp.bfloat16), jnp.asarray(vp, jnp.bfloat16))
        got = splat.attention_with_kvcache(
            q, *pools, m, cache_seqlens=lens, page_table=jnp.asarray(table), backend="triton"
        )
    else:
        got = splat.attention_with_kvcache(q, k, v, m, cache_seqlens=lens, backend="triton")
    err = np.abs(np.asarray(got, np.float32) - np.asarray(want, np.float32)).max()
    assert err <= 4 * FLOORS[np.dtype(jnp.bfloat16)] * np.abs(np.asarray(want, np.float32)).max()


@pytest.mark.parametrize("name", ["sinks+window", "dilated"])
@pytest.mark.parametrize("backend", ["triton", "auto"])
def test_a_chunk_of_a_mask_of_no_one_band_at_an_offset(backend, name, rng):
    """Chunked prefill on a mask that is no one band (sinks + window; a dilated window, walked key
    by key): ``splat.attention`` with ``q_offset`` runs the Triton kernel's blocks of rows
    (``auto``: after the CUDA band kernel refuses the mask) against the float64 reference."""
    import prefill_cases as pc

    case = (name, [-50, 437, 800], [1000, 637, 1000], [200, 160, 200], True, 8, 2)
    x = pc.inputs(case)
    q, k, v = (jnp.asarray(a, jnp.bfloat16) for a in (x.q, x.k, x.v))
    kw = dict(segment_ids=jnp.asarray(x.runtime["ids"]), kv_segment_ids=jnp.asarray(x.runtime["kv_ids"]),
              query_seq_lengths=jnp.asarray(x.runtime["qlen"]),
              key_value_seq_lengths=jnp.asarray(x.runtime["kvlen"]))
    # traced offsets: a concrete one before the cache would be refused (ValueError) instead
    fn = jax.jit(lambda q, k, v, off, kw: splat.attention(q, k, v, pc.MASKS[name], q_offset=off,
                                                          backend=backend, **kw))
    got = fn(q, k, v, jnp.asarray(x.offsets), kw)
    ref, _ = dc.reference(*(np.asarray(a, np.float32) for a in (q, k, v)), x.dense, 128**-0.5)
    out = np.asarray(got, np.float64)
    assert np.isfinite(out).all()
    assert np.abs(out - ref).max() <= 4 * FLOORS[np.dtype(jnp.bfloat16)] * np.abs(ref).max()
