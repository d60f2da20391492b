"""Unfused sparse ops (SDDMM, ACSR softmax, SpMM) and their gradients, on every backend.

References are float64 numpy over ``layout.slot_columns()``; ``TestOps`` is the
shared base parameterised by the ``backend`` fixture.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import (
    assert_close,
    attention_dense,
    attention_grads_ref,
    attention_ref,
    error_bound,
    mask_array,
    rel_error,
)

import acsr
import jax_bindings
from jax_bindings import _dispatch
from splat import _attention as api
from splat import masks

NAMES = ["causal", "dilated_window", "global_window", "random", "empty_rows", "rect_wide"]


@functools.cache
def layout_of(name: str) -> acsr.ACSR:
    return acsr.from_dense(mask_array(name))


def _f64(x):
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def _arrays(rng, layout, *, b=2, h=4, hk=2, d=16, dtype=jnp.float32):
    sq, skv, n = layout.q_len, layout.kv_len, layout.nnz_max
    shapes = {
        "q": (b, sq, h, d),
        "k": (b, skv, hk, d),
        "v": (b, skv, hk, d),
        "do": (b, sq, h, d),
        "vals": (b, h, sq, n),
        "dvals": (b, h, sq, n),
    }
    return {name: jnp.asarray(rng.standard_normal(s), dtype) for name, s in shapes.items()}


def _gathered(x, cols, h):
    """``x [B, Skv, Hk, D]`` at slot columns -> ``[B, H, Sq, N, D]`` (0 at padding)."""
    x = np.repeat(_f64(x), h // x.shape[2], axis=2)
    g = x[:, np.maximum(cols, 0)]  # [B, Sq, N, H, D]
    g = np.where((cols >= 0)[None, :, :, None, None], g, 0.0)
    return g.transpose(0, 3, 1, 2, 4)


def sddmm_ref(q, k, layout):
    cols = layout.slot_columns()
    return np.einsum("bqhd,bhqnd->bhqn", _f64(q), _gathered(k, cols, q.shape[2]))


def softmax_ref(s, layout, scale):
    valid = layout.slot_columns() >= 0
    x = np.where(valid, _f64(s) * scale, -np.inf)
    m = x.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.where(valid, np.exp(x - m), 0.0)
    t = e.sum(axis=-1, keepdims=True)
    return e / np.where(t > 0, t, 1.0)


def spmm_ref(p, v, layout):
    cols = layout.slot_columns()
    p = np.where(cols >= 0, _f64(p), 0.0)
    return np.einsum("bhqn,bhqnd->bqhd", p, _gathered(v, cols, p.shape[1]))


def _scatter_kv(contrib, cols, skv, hk):
    """``contrib [B, H, Sq, N, D]`` summed into ``[B, Skv, Hk, D]`` at slot columns."""
    b, h, sq, n, d = contrib.shape
    out = np.zeros((b, skv, h, d))
    r, t = np.nonzero(cols >= 0)
    np.add.at(out, (slice(None), cols[r, t]), contrib[:, :, r, t].transpose(0, 2, 1, 3))
    return out.reshape(b, skv, hk, h // hk, d).sum(axis=3)


def sddmm_grads_ref(q, k, ds, layout):
    cols = layout.slot_columns()
    ds = np.where(cols >= 0, _f64(ds), 0.0)
    dq = np.einsum("bhqn,bhqnd->bqhd", ds, _gathered(k, cols, q.shape[2]))
    contrib = ds[..., None] * _f64(q).transpose(0, 2, 1, 3)[:, :, :, None, :]
    return dq, _scatter_kv(contrib, cols, k.shape[1], k.shape[2])


def softmax_grad_ref(p, dp, layout, scale):
    valid = layout.slot_columns() >= 0
    p, dp = np.where(valid, p, 0.0), np.where(valid, _f64(dp), 0.0)
    return scale * p * (dp - (p * dp).sum(axis=-1, keepdims=True))


def spmm_grads_ref(p, v, do, layout):
    cols = layout.slot_columns()
    p = np.where(cols >= 0, _f64(p), 0.0)
    dprobs = np.einsum("bqhd,bhqnd->bhqn", _f64(do), _gathered(v, cols, p.shape[1]))
    dprobs = np.where(cols >= 0, dprobs, 0.0)
    contrib = p[..., None] * _f64(do).transpose(0, 2, 1, 3)[:, :, :, None, :]
    return dprobs, _scatter_kv(contrib, cols, v.shape[1], v.shape[2])


def _poison_padding(x, layout, value=np.nan):
    valid = jnp.asarray(layout.slot_columns() >= 0)
    return jnp.where(valid, x, jnp.asarray(value, x.dtype))


@pytest.fixture
def backend(backend):
    """conftest's backends; one without unfused ops (cudnn) is skipped with its refusal.

    "jax" and "triton" must take every unfused op: a refusal there fails the test.
    """
    if backend not in ("jax", "triton"):
        x = jax.ShapeDtypeStruct((1, 8, 1, 8), jnp.float32)
        try:
            jax_bindings.selected_backend("sddmm", x, x, masks.causal().to_acsr(8), backend=backend)
        except NotImplementedError as e:
            pytest.skip(f"{backend} refuses the unfused ops: {e}")
    return backend


class TestOps:
    """Shared base for the unfused ops."""

    @pytest.mark.parametrize("name", NAMES)
    def test_sddmm_and_grad(self, backend, rng, name):
        layout = layout_of(name)
        a = _arrays(rng, layout)
        s, vjp = jax.vjp(lambda q, k: api.sddmm(q, k, layout, backend=backend), a["q"], a["k"])
        assert s.shape == (2, 4, layout.q_len, layout.nnz_max) and s.dtype == jnp.float32
        assert_close("sddmm", s, sddmm_ref(a["q"], a["k"], layout), jnp.float32)
        assert not np.asarray(s)[:, :, layout.slot_columns() < 0].any(), "padding slots must be 0"
        # padding slots of the cotangent are ignored, even when NaN
        dq, dk = vjp(_poison_padding(a["dvals"], layout))
        rq, rk = sddmm_grads_ref(a["q"], a["k"], a["dvals"], layout)
        assert_close("sddmm dq", dq, rq, jnp.float32)
        assert_close("sddmm dk", dk, rk, jnp.float32)

    @pytest.mark.parametrize("name", NAMES)
    def test_softmax_and_grad(self, backend, rng, name):
        layout = layout_of(name)
        a = _arrays(rng, layout)
        scores = _poison_padding(a["vals"] * 3, layout)
        p, vjp = jax.vjp(lambda s: api.softmax(s, layout, 0.7, backend=backend), scores)
        ref = softmax_ref(a["vals"] * 3, layout, 0.7)
        assert_close("softmax", p, ref, jnp.float32)
        valid = layout.slot_columns() >= 0
        assert not np.asarray(p)[:, :, ~valid].any(), "padding slots must be 0"
        rows = valid.any(axis=1)
        np.testing.assert_allclose(np.asarray(p).sum(-1)[:, :, rows], 1.0, rtol=1e-5)
        assert not np.asarray(p)[:, :, ~rows].any(), "empty rows must be 0"
        (ds,) = vjp(_poison_padding(a["dvals"], layout))
        assert_close("softmax grad", ds, softmax_grad_ref(ref, a["dvals"], layout, 0.7), jnp.float32)

    @pytest.mark.parametrize("name", NAMES)
    def test_spmm_and_grad(self, backend, rng, name):
        layout = layout_of(name)
        a = _arrays(rng, layout)
        probs = _poison_padding(a["vals"], layout)
        out, vjp = jax.vjp(lambda p, v: api.spmm(p, v, layout, backend=backend), probs, a["v"])
        assert out.shape == a["q"].shape and out.dtype == jnp.float32
        assert_close("spmm", out, spmm_ref(a["vals"], a["v"], layout), jnp.float32)
        dp, dv = vjp(a["do"])
        rp, rv = spmm_grads_ref(a["vals"], a["v"], a["do"], layout)
        assert_close("spmm dprobs", dp, rp, jnp.float32)
        assert not np.asarray(dp)[:, :, layout.slot_columns() < 0].any()
        assert_close("spmm dv", dv, rv, jnp.float32)

    @pytest.mark.parametrize("name", NAMES)
    def test_composition_equals_fused(self, backend, rng, name):
        layout = layout_of(name)
        mask = mask_array(name)
        a = _arrays(rng, layout, hk=1)
        q, k, v, do = a["q"], a["k"], a["v"], a["do"]
        scale = 0.25

        def unfused(q, k, v):
            s = api.sddmm(q, k, layout, backend=backend)
            return api.spmm(api.softmax(s, layout, scale, backend=backend), v, layout, backend=backend)

        out, vjp = jax.vjp(jax.jit(unfused), q, k, v)
        fused = _dispatch.attention(q, k, v, layout, scale, backend)
        np.testing.assert_allclose(np.asarray(out), np.asarray(fused), atol=2e-6)
        assert_close("unfused out", out, attention_ref(q, k, v, mask, scale)[0], jnp.float32)
        for n, g, r in zip(
            ("dq", "dk", "dv"), vjp(do), attention_grads_ref(q, k, v, mask, scale, do), strict=True
        ):
            assert_close(f"unfused {n}", g, r, jnp.float32)

    @pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
    def test_composition_low_precision(self, backend, rng, dtype):
        layout = layout_of("global_window")
        mask = mask_array("global_window")
        a = _arrays(rng, layout, dtype=dtype)
        q, k, v = a["q"], a["k"], a["v"]
        s = api.sddmm(q, k, layout, backend=backend)
        p = api.softmax(s, layout, 0.25, backend=backend)
        out = api.spmm(p, v, layout, backend=backend)
        assert s.dtype == p.dtype == out.dtype == dtype
        ref = attention_ref(q, k, v, mask, 0.25)[0]
        # the unfused path rounds scores and probabilities to dtype, as dense attention does
        same = attention_dense(q, k, v, mask, 0.25)
        err = rel_error(out, ref)
        assert err <= error_bound(dtype, same, ref, factor=3.0), err

    def test_ops_vmap_jit(self, backend, rng):
        layout = masks.sliding_window(4).to_acsr(40, 40)
        a = _arrays(rng, layout, b=1)
        q3, k3 = jnp.stack([a["q"], 2 * a["q"]]), jnp.stack([a["k"], -a["k"]])

        def chain(q, k, v):
            s = api.sddmm(q, k, layout, backend=backend)
            return api.spmm(api.softmax(s, layout, 0.3, backend=backend), v, layout, backend=backend)

        out = jax.jit(jax.vmap(chain, (0, 0, None)))(q3, k3, a["v"])
        g = jax.jit(jax.vmap(jax.grad(lambda q, k, v: chain(q, k, v).sum(), (0, 1, 2)), (0, 0, None)))(
            q3, k3, a["v"]
        )
        for i in range(2):
            np.testing.assert_allclose(out[i], chain(q3[i], k3[i], a["v"]), atol=1e-6)
            gi = jax.grad(lambda q, k, v: chain(q, k, v).sum(), (0, 1, 2))(q3[i], k3[i], a["v"])
            for x, y in zip(g, gi, strict=True):
                np.testing.assert_allclose(x[i], y, atol=1e-5)

    def test_deterministic(self, backend, rng):
        layout = layout_of("random")
        a = _arrays(rng, layout)

        def run():
            s, vjp = jax.vjp(lambda q, k: api.sddmm(q, k, layout, backend=backend), a["q"], a["k"])
            o, vjp2 = jax.vjp(lambda p, v: api.spmm(p, v, layout, backend=backend), a["vals"], a["v"])
            return s, vjp(a["dvals"]), o, vjp2(a["do"])

        for x, y in zip(jax.tree.leaves(run()), jax.tree.leaves(run()), strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_empty_layout_ops(rng):
    layout = acsr.from_dense(np.zeros((12, 9), bool))
    a = _arrays(rng, layout)
    s = api.sddmm(a["q"], a["k"], layout, backend="jax")
    assert s.shape == (2, 4, 12, layout.nnz_max)
    p = api.softmax(s, layout, backend="jax")
    out = api.spmm(p, a["v"], layout, backend="jax")
    assert out.shape == a["q"].shape and not np.asarray(out).any()


# -----------------------------------------------------------------------------
# validation
# -----------------------------------------------------------------------------


def _valid():
    layout = masks.causal().to_acsr(16, 16)
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((1, 16, 4, 8)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((1, 16, 2, 8)), jnp.float32)
    vals = jnp.asarray(rng.standard_normal((1, 4, 16, layout.nnz_max)), jnp.float32)
    return layout, q, k, vals


def _cases():
    layout, q, k, vals = _valid()
    other = masks.causal().to_acsr(16, 20)
    return {
        "sddmm q rank": (api.sddmm, (q[0], k, layout), {}, ValueError, "q must be 4-D"),
        "sddmm k dtype": (api.sddmm, (q, k.astype(jnp.int8), layout), {}, TypeError, "k must have dtype"),
        "sddmm mixed": (api.sddmm, (q, k.astype(jnp.float16), layout), {}, TypeError, "must share one dtype"),
        "sddmm heads": (api.sddmm, (q, k[:, :, :1].repeat(3, 2), layout), {}, ValueError, "must divide"),
        "sddmm layout type": (
            api.sddmm,
            (q, k, np.ones((16, 16), bool)),
            {},
            TypeError,
            "layout must be an acsr.ACSR",
        ),
        "sddmm layout size": (api.sddmm, (q, k, other), {}, ValueError, "layout is 16 x 20"),
        "sddmm backend": (
            api.sddmm,
            (q, k, layout),
            {"backend": "tpu"},
            ValueError,
            "backend must be one of",
        ),
        "softmax shape": (api.softmax, (vals[..., :-1], layout), {}, ValueError, "scores must be [B, H, 16"),
        "softmax scale": (api.softmax, (vals, layout, -2.0), {}, ValueError, "scale must be a positive"),
        "softmax dtype": (
            api.softmax,
            (vals.astype(jnp.int32), layout),
            {},
            TypeError,
            "scores must have dtype",
        ),
        "softmax layout": (api.softmax, (vals, "causal"), {}, TypeError, "layout must be an acsr.ACSR"),
        "spmm probs rank": (api.spmm, (vals[0], k, layout), {}, ValueError, "probs must be 4-D"),
        "spmm kv_len": (api.spmm, (vals, k[:, :-1], layout), {}, ValueError, "v has 15 keys"),
        "spmm mixed": (
            api.spmm,
            (vals, k.astype(jnp.bfloat16), layout),
            {},
            TypeError,
            "must share one dtype",
        ),
        "spmm heads": (api.spmm, (vals, k[:, :, :1].repeat(3, 2), layout), {}, ValueError, "must divide"),
        "spmm batch": (
            api.spmm,
            (vals, jnp.concatenate([k, k]), layout),
            {},
            ValueError,
            "v batch 2 != probs batch 1",
        ),
        "spmm probs shape": (
            api.spmm,
            (vals[:, :, :-1], k, layout),
            {},
            ValueError,
            "probs must be [B, H, 16",
        ),
    }


_CASES = _cases()


@pytest.mark.parametrize("case", list(_CASES))
def test_ops_validation(case):
    fn, args, kwargs, exc, msg = _CASES[case]
    with pytest.raises(exc, match=msg.replace("[", r"\[")):
        fn(*args, **kwargs)
