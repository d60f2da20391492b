"""The CUDA decode kernel (``jax_bindings._cuda.decode``) on a real Hopper GPU: ``pytest -m gpu``.

Every kind of variant (``decode_cases.CASES``) against a float64 dense reference taken at the
tokens' positions: head dims 64, 96, 128 and 256; 1, 3, 4 and 16 tokens a row; GQA groups 1, 4
and 32; one to three segments (causal, causal windows, sinks + window, dilated and strided
progressions); a contiguous cache and page pools of 16 and 64 keys a page with a shuffled page
table and NaN in the unused pages; one split and many; key lengths that are no tile multiple, a
token outside the cache and a padded token (both output 0, lse -inf); segment ids; a soft cap;
bfloat16 and float16. Reruns are bit-identical, and the public ``splat.attention(q_offset=...)`` and
``splat.attention_with_kvcache`` (contiguous and paged) run here on ``backend="cuda"``.
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

if _registry.unavailable("cuda") is not None:
    pytest.skip(f"the cuda backend cannot run here: {_registry.unavailable('cuda')}", allow_module_level=True)

from jax_bindings._cuda import backend as cb  # noqa: E402
from jax_bindings._cuda import decode  # noqa: E402


def _runtime(x: dc.Inputs) -> RuntimeMask:
    b = x.q.shape[0]
    ids, exact = (None, None), np.ones(b, np.int32)
    if x.q_ids is not None:
        ids = (jnp.asarray(x.q_ids), jnp.asarray(x.kv_ids))
        exact = ((np.diff(x.q_ids, axis=1) >= 0).all(1) & (np.diff(x.kv_ids, axis=1) >= 0).all(1)).astype(
            np.int32
        )
    return RuntimeMask(
        jnp.asarray(x.q_len), jnp.asarray(x.kv_len), jnp.asarray(exact), *ids, jnp.asarray(x.q_pos)
    )


def _check(out, lse, ref_out, ref_lse, dtype):
    out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
    assert np.isfinite(out).all()
    assert np.abs(out - ref_out).max() <= 4 * FLOORS[np.dtype(dtype)] * np.abs(ref_out).max()
    empty = ~np.isfinite(ref_lse)
    assert (out.transpose(0, 2, 1, 3)[empty] == 0).all()  # out [B, T, H, D], lse [B, H, T]
    if lse is not None:
        lse = np.asarray(lse, np.float64)
        assert (np.isneginf(lse) == empty).all()
        assert np.abs(lse[~empty] - ref_lse[~empty]).max() <= 2e-2


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("case", dc.CASES, ids=["-".join(map(str, c)) for c in dc.CASES])
def test_decode_matches_the_float64_reference(case, dtype, rng):
    name, d, t, h, hk, page, splits = case
    x = dc.inputs(rng, 3, t, h, hk, d, dc.MASKS[name])
    layout = splat.analyze(dc.MASKS[name], dc.L, dc.L)
    q, k, v = (jnp.asarray(a, dtype) for a in (x.q, x.k, x.v))
    rt, scale, sms = _runtime(x), d**-0.5, cb._sm_count()
    if page:
        kp, vp, table = dc.paged(rng, np.asarray(k, np.float32), np.asarray(v, np.float32), page)
        args = (q, jnp.asarray(kp, dtype), jnp.asarray(vp, dtype), jnp.asarray(table), rt)
        fn = jax.jit(
            lambda q, kp, vp, table, rt: decode.forward(
                q, kp, vp, rt, layout, scale, None, sms, page_table=table, splits=splits
            )
        )
    else:
        args = (q, k, v, rt)
        fn = jax.jit(lambda q, k, v, rt: decode.forward(q, k, v, rt, layout, scale, None, sms, splits=splits))
    out, lse = fn(*args)
    ref_out, ref_lse = dc.reference(
        np.asarray(q, np.float32), np.asarray(k, np.float32), np.asarray(v, np.float32), x.visible, scale
    )
    assert out.dtype == q.dtype and out.shape == q.shape and lse.shape == (3, h, t)
    _check(out, lse, ref_out, ref_lse, dtype)
    again = fn(*args)
    assert (np.asarray(again[0]) == np.asarray(out)).all() and (np.asarray(again[1]) == np.asarray(lse)).all()


@pytest.mark.parametrize("ids", ["documents", "any"])
@pytest.mark.parametrize("splits", [None, 4])
def test_segment_ids_and_soft_cap(splits, ids, rng):
    x = dc.inputs(rng, 4, 2, 8, 2, 128, masks.causal(), ids=ids)
    layout = splat.analyze(masks.causal(), dc.L, dc.L)
    q, k, v = (jnp.asarray(a, jnp.bfloat16) for a in (x.q, x.k, x.v))
    fn = jax.jit(
        lambda q, k, v, rt: decode.forward(
            q, k, v, rt, layout, 128**-0.5, 30.0, cb._sm_count(), splits=splits
        )
    )
    out, lse = fn(q, k, v, _runtime(x))
    ref_out, ref_lse = dc.reference(
        np.asarray(q, np.float32),
        np.asarray(k, np.float32),
        np.asarray(v, np.float32),
        x.visible,
        128**-0.5,
        soft_cap=30.0,
    )
    _check(out, lse, ref_out, ref_lse, jnp.bfloat16)


@pytest.mark.parametrize("page", [0, 16])
def test_public_decode_runs_the_kernel(page, rng):
    """``splat.attention(q_offset=)`` and ``splat.attention_with_kvcache`` on ``backend="cuda"``."""
    b, h, hk, d = 2, 8, 2, 128
    q = jnp.asarray(rng.standard_normal((b, 1, h, d)), jnp.bfloat16)
    k, v = (jnp.asarray(rng.standard_normal((b, dc.L, hk, d)), jnp.bfloat16) for _ in range(2))
    lens = jnp.array([dc.L, 401], jnp.int32)
    m = masks.sliding_window(255, 0)
    dense = splat.analyze(m, dc.L, dc.L).to_dense()
    vis = np.stack([dense[int(n) - 1] & (np.arange(dc.L) < int(n)) for n in lens])[:, None]
    ref_out, ref_lse = dc.reference(
        np.asarray(q, np.float32), np.asarray(k, np.float32), np.asarray(v, np.float32), vis, d**-0.5
    )
    if page:
        kp, vp, table = dc.paged(rng, np.asarray(k, np.float32), np.asarray(v, np.float32), page)
        kp, vp, table = jnp.asarray(kp, jnp.bfloat16), jnp.asarray(vp, jnp.bfloat16), jnp.asarray(table)
        out = splat.attention_with_kvcache(q, kp, vp, m, cache_seqlens=lens, page_table=table, backend="cuda")
    else:
        out = splat.attention(q, k, v, mask=m, q_offset=lens - 1, key_value_seq_lengths=lens, backend="cuda")
        again = splat.attention_with_kvcache(q, k, v, m, cache_seqlens=lens, backend="cuda")
        assert (np.asarray(again) == np.asarray(out)).all()
    _check(out, None, ref_out, ref_lse, jnp.bfloat16)


def test_refusals_name_what_they_refuse(rng):
    x = dc.inputs(rng, 1, 1, 4, 2, 128, masks.causal(), odd_rows=False)
    q, k, v = (jnp.asarray(a, jnp.bfloat16) for a in (x.q, x.k, x.v))
    rt = _runtime(x)
    residual = splat.analyze(masks.from_fn(lambda i, j: (i * 7 + j * 3) % 11 < 2), dc.L, dc.L)
    with pytest.raises(NotImplementedError, match="residual"):
        decode.forward(q, k, v, rt, residual, 1.0, None, 132)
    causal = splat.analyze(masks.causal(), dc.L, dc.L)
    with pytest.raises(NotImplementedError, match="float32"):
        decode.forward(q.astype(jnp.float32), k, v, rt, causal, 1.0, None, 132)
