"""Chunked prefill on the cuda band kernel on a real Hopper GPU: ``pytest -m gpu``.

A chunk of queries longer than the decode kernel's tokens, at a traced offset into the keys
(``q_offset``), runs on the forward band kernel shifted to the chunk's rows (``shifted``
variants). Each case is checked against the float64 reference of the per-batch dense mask the
runtime arguments define: causal, causal windows and a band that looks ahead; offsets that are
no tile multiple, differ per batch row, and put rows outside the layout (before it and past it:
out 0, lse -inf); key lengths; query padding; packed documents; GQA; bfloat16 and float16. Also:
reruns are bit-identical, one compile serves every offset, and the public
``splat.attention(q_offset=)`` and ``splat.attention_with_kvcache`` (contiguous and paged,
pages mapped nowhere hidden) run here on ``backend="cuda"``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import prefill_cases as pc
import pytest
from reference import assert_close, runtime_ref
from runtime_masks import runtime_dense

import splat
from jax_bindings import _registry, _runtime
from splat import masks

pytestmark = pytest.mark.gpu

if _registry.unavailable("cuda") is not None:
    pytest.skip(f"the cuda backend cannot run here: {_registry.unavailable('cuda')}", allow_module_level=True)

from jax_bindings._cuda import backend as cb  # noqa: E402
from jax_bindings._cuda import decode  # noqa: E402

assert pc.SQ > decode.MAX_TOKENS
L, SQ = pc.L, pc.SQ


def _case(case, dtype, seed=0):
    x = pc.inputs(case, seed)
    q, k, v = (jnp.asarray(a, dtype) for a in (x.q, x.k, x.v))
    kwargs = {pc.BUILD_NAMES[n]: jnp.asarray(a) for n, a in x.runtime.items()}
    runtime = _runtime.build(len(x.offsets), SQ, L, q_offset=jnp.asarray(x.offsets), layout_rows=L, **kwargs)
    return pc.MASKS[case[0]].to_acsr(L), x.dense, runtime, (q, k, v)


def _lse_ref(q, k, mask_b, scale):
    q64, k64 = (np.asarray(x, np.float64) for x in (q, k))
    ke = np.repeat(k64, q64.shape[2] // k64.shape[2], axis=2)
    z = np.einsum("bqhd,bkhd->bhqk", q64, ke) * scale
    s = np.where(mask_b[:, None], z, -np.inf)
    mx = np.max(s, axis=-1, keepdims=True)
    safe = np.where(np.isfinite(mx), mx, 0.0)
    with np.errstate(divide="ignore"):
        return (np.log(np.exp(s - safe).sum(-1, keepdims=True)) + safe)[..., 0]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("case", pc.CASES, ids=pc.case_id)
def test_a_chunk_at_an_offset_matches_the_float64_reference(case, dtype):
    layout, dense, runtime, (q, k, v) = _case(case, dtype)
    scale = 128**-0.5
    fwd = jax.jit(lambda q, k, v, rt: cb.attention_fwd(q, k, v, rt, layout, scale))
    out, lse = fwd(q, k, v, runtime)
    ref, _ = runtime_ref(q, k, v, dense, scale, np.zeros(q.shape))
    assert_close("out", out, ref, dtype)
    empty = ~dense.any(-1)  # [B, Sq]: rows that see nothing
    assert np.all(np.asarray(out, np.float32)[empty] == 0)
    lse_ref = _lse_ref(q, k, dense, scale)
    got = np.asarray(lse)
    assert np.all(np.isneginf(got) == np.isneginf(lse_ref))
    seen = np.isfinite(lse_ref)
    np.testing.assert_allclose(got[seen], lse_ref[seen], atol=2e-2, rtol=0)
    again = fwd(q, k, v, runtime)
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip((out, lse), again, strict=True))


def test_one_compile_serves_every_offset():
    layout, _, runtime, (q, k, v) = _case(pc.CASES[0], jnp.bfloat16)
    traces = []

    @jax.jit
    def fwd(q, k, v, off):
        traces.append(1)
        rt = _runtime.build(q.shape[0], SQ, L, q_offset=off, layout_rows=L)
        return cb.attention_fwd(q, k, v, rt, layout, 0.1)[0]

    for off in ([0, 1, 2], [5, 700, 800], [-3, 999, 1]):
        fwd(q, k, v, jnp.asarray(off, jnp.int32)).block_until_ready()
    assert len(traces) == 1


def test_splat_attention_and_the_kvcache_api_run_chunks_on_cuda(rng):
    b, h, hk, page = 2, 8, 2, 16
    q = jnp.asarray(rng.standard_normal((b, SQ, h, 128)), jnp.bfloat16)
    k, v = (jnp.asarray(rng.standard_normal((b, L, hk, 128)), jnp.bfloat16) for _ in range(2))
    off = np.array([123, 800])
    mask = masks.sliding_window(255, 0)
    got = splat.attention(q, k, v, mask, q_offset=jnp.asarray(off), backend="cuda")
    dense = runtime_dense(mask.to_acsr(L).to_dense(), b, SQ, L, offset=off)
    ref, _ = runtime_ref(q, k, v, dense, 128**-0.5, np.zeros(q.shape))
    assert_close("attention", got, ref, jnp.bfloat16)

    # the same cache paged: shuffled pages, NaN in pages mapped nowhere and in a page the table
    # maps past the pool (hidden)
    lens = jnp.asarray(off + SQ, jnp.int32)
    contiguous = splat.attention_with_kvcache(q, k, v, mask, cache_seqlens=lens, backend="cuda")
    n = -(-L // page)
    order = rng.permutation(b * n + 3)
    pool_k = np.full((b * n + 3, page, hk, 128), np.nan, np.float32)
    pool_v = pool_k.copy()
    table = np.zeros((b, n), np.int32)
    kp = np.pad(np.asarray(k, np.float32), ((0, 0), (0, n * page - L), (0, 0), (0, 0)))
    vp = np.pad(np.asarray(v, np.float32), ((0, 0), (0, n * page - L), (0, 0), (0, 0)))
    for r in range(b):
        for p in range(n):
            table[r, p] = order[r * n + p]
            pool_k[table[r, p]] = kp[r, p * page:(p + 1) * page]
            pool_v[table[r, p]] = vp[r, p * page:(p + 1) * page]
    table[0, -1] = 10**6  # past the pool, and past row 0's length: never read
    paged = splat.attention_with_kvcache(
        q, jnp.asarray(pool_k, jnp.bfloat16), jnp.asarray(pool_v, jnp.bfloat16), mask, cache_seqlens=lens,
        page_table=jnp.asarray(table), backend="cuda")
    cached = runtime_dense(mask.to_acsr(L).to_dense(), b, SQ, L, offset=off, kvlen=np.asarray(lens))
    ref, _ = runtime_ref(q, k, v, cached, 128**-0.5, np.zeros(q.shape))
    assert_close("contiguous cache", contiguous, ref, jnp.bfloat16)
    assert not np.isnan(np.asarray(paged, np.float32)).any()
    assert_close("paged cache", paged, ref, jnp.bfloat16)
