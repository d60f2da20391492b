"""Fused sparse attention against the dense float64 oracle, on every backend.

``TestAttention`` is the shared base: each test takes the ``backend`` fixture
(conftest: every registered backend, skipped with the registry's reason where
it cannot run). "jax" and "triton" must take every call; another backend
("cudnn") takes some masks and dtypes only, and the tests it refuses are
skipped with its reason. Tests below the base cover what is specific to the
pure-JAX backend (each piece kind forced in turn), the backend seam, and input
validation.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import (
    MASKS,
    TAKES_EVERY_CALL,
    assert_close,
    attention_dense_grads,
    attention_grads_ref,
    attention_ref,
    mask_array,
    refusal_skips,
)

import acsr
import jax_bindings
from jax_bindings import _dispatch, _pure, _registry
from splat import _attention as api
from splat import masks

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@functools.cache
def layout_of(name: str) -> acsr.ACSR:
    return acsr.from_dense(mask_array(name))


def make_inputs(rng, sq, skv, *, b=2, h=4, hk=2, d=16, dtype=jnp.float32):
    """Fresh random ``q, k, v, dout`` (never zeros) in ``dtype``."""
    q = rng.standard_normal((b, sq, h, d))
    k = rng.standard_normal((b, skv, hk, d))
    v = rng.standard_normal((b, skv, hk, d))
    do = rng.standard_normal((b, sq, h, d))
    return [jnp.asarray(x, dtype) for x in (q, k, v, do)]


def run(q, k, v, do, layout, scale, backend):
    """``out, lse, (dq, dk, dv)`` of one jitted forward + backward.

    ``lse`` is None for a backend without a logsumexp output (cudnn).
    """

    def f(q, k, v):
        return _dispatch.attention(q, k, v, layout, scale, backend)

    @jax.jit
    def go(q, k, v, do):
        out, vjp = jax.vjp(f, q, k, v)
        return out, vjp(do)

    with refusal_skips(backend):
        out, grads = go(q, k, v, do)
    try:
        _, lse = _dispatch.attention_with_lse(q, k, v, layout, scale, backend)
    except NotImplementedError:
        if backend in TAKES_EVERY_CALL:
            raise
        lse = None
    return out, lse, grads


def check_against_reference(q, k, v, do, mask, scale, backend, dtype=jnp.float32, layout=None):
    layout = acsr.from_dense(mask) if layout is None else layout
    out, lse, grads = run(q, k, v, do, layout, scale, backend)
    ref_out, ref_lse = attention_ref(q, k, v, mask, scale)
    ref_grads = attention_grads_ref(q, k, v, mask, scale, do)
    same_out, same_grads = (None, (None,) * 3)
    if dtype != jnp.float32:
        same_out, same_grads = attention_dense_grads(q, k, v, mask, scale, do)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert_close("out", out, ref_out, dtype, same_out)
    empty = ~mask.any(axis=1)
    if lse is not None:
        assert lse.dtype == jnp.float32 and lse.shape == (q.shape[0], q.shape[2], q.shape[1])
        lse = np.asarray(lse)
        assert np.all(lse[:, :, empty] == -np.inf), "lse of a fully masked row must be -inf"
        np.testing.assert_allclose(
            lse[:, :, ~empty], ref_lse[:, :, ~empty], rtol=0, atol=1e-5 if dtype == jnp.float32 else 2e-2
        )
    for name, g, r, s, x in zip(("dq", "dk", "dv"), grads, ref_grads, same_grads, (q, k, v), strict=True):
        assert g.dtype == x.dtype and g.shape == x.shape, name
        assert_close(name, g, r, dtype, s)
    if empty.any():
        assert np.all(np.asarray(out)[:, empty] == 0)
        assert np.all(np.asarray(grads[0])[:, empty] == 0)
    return out, grads


class TestAttention:
    """Shared base: every test runs on each backend the ``backend`` fixture yields."""

    @pytest.mark.parametrize("name", list(MASKS))
    def test_matches_reference_float32(self, backend, rng, name):
        mask = mask_array(name)
        q, k, v, do = make_inputs(rng, *mask.shape)
        check_against_reference(q, k, v, do, mask, 0.3, backend, layout=layout_of(name))

    @pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
    @pytest.mark.parametrize("name", ["causal", "dilated_window", "global_window", "random", "empty_rows"])
    def test_low_precision(self, backend, rng, name, dtype):
        mask = mask_array(name)
        q, k, v, do = make_inputs(rng, *mask.shape, dtype=DTYPES[dtype])
        check_against_reference(q, k, v, do, mask, 0.25, backend, DTYPES[dtype], layout=layout_of(name))

    @pytest.mark.parametrize("hk", [4, 2, 1])
    @pytest.mark.parametrize("name", ["sink_causal_window", "strided"])
    def test_gqa_mqa(self, backend, rng, name, hk):
        mask = mask_array(name)
        q, k, v, do = make_inputs(rng, *mask.shape, b=1, h=4, hk=hk)
        check_against_reference(q, k, v, do, mask, 0.25, backend, layout=layout_of(name))

    @pytest.mark.parametrize("d", [8, 40, 64])
    def test_head_dims(self, backend, rng, d):
        mask = mask_array("causal_window")
        q, k, v, do = make_inputs(rng, *mask.shape, b=1, d=d)
        check_against_reference(
            q, k, v, do, mask, 1 / math.sqrt(d), backend, layout=layout_of("causal_window")
        )

    def test_all_rows_masked(self, backend, rng):
        mask = np.zeros((40, 50), bool)
        q, k, v, do = make_inputs(rng, 40, 50)
        out, grads = check_against_reference(q, k, v, do, mask, 0.5, backend)
        assert not np.asarray(out).any()
        assert not any(np.asarray(g).any() for g in grads)

    def test_unattended_keys_have_no_influence(self, backend, rng):
        # rect_wide: keys past 2 * 99 + 12 are never attended; poison them
        mask = mask_array("rect_wide")
        unused = ~mask.any(axis=0)
        assert unused.any()
        q, k, v, do = make_inputs(rng, *mask.shape)
        layout = layout_of("rect_wide")
        out, _, grads = run(q, k, v, do, layout, 0.3, backend)
        kp = k.at[:, unused].set(1e30)
        vp = v.at[:, unused].set(-1e30)
        out_p, _, grads_p = run(q, kp, vp, do, layout, 0.3, backend)
        np.testing.assert_array_equal(np.asarray(out_p), np.asarray(out))
        np.testing.assert_array_equal(np.asarray(grads_p[0]), np.asarray(grads[0]))
        for g, gp in zip(grads[1:], grads_p[1:], strict=True):
            assert not np.asarray(gp)[:, unused].any()
            np.testing.assert_array_equal(np.asarray(gp)[:, ~unused], np.asarray(g)[:, ~unused])

    @pytest.mark.parametrize("name", ["global_window", "random"])
    def test_deterministic(self, backend, rng, name):
        mask = mask_array(name)
        q, k, v, do = make_inputs(rng, *mask.shape)
        a = run(q, k, v, do, layout_of(name), 0.3, backend)
        b = run(q, k, v, do, layout_of(name), 0.3, backend)
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))

    def test_vmap_jit_grad(self, backend, rng):
        mask = masks.sliding_window(6, 2) | masks.sink(2)
        s, n = 48, 2
        q, k, v, do = make_inputs(rng, s, s, b=2)
        q3, k3, v3 = (jnp.stack([x * (1 + 0.1 * i) for i in range(n)]) for x in (q, k, v))

        def f(q, k, v):
            return api.attention(q, k, v, mask, backend=backend)

        def loss(q, k, v):
            return (f(q, k, v) * do).sum()

        g = jax.grad(loss, argnums=(0, 1, 2))
        f_one, g_one = jax.jit(f), jax.jit(g)
        with refusal_skips(backend):
            g_one(q, k, v)
        # vmap over an extra leading axis: all batched, or k and v shared
        for axes, args in (((0, 0, 0), (q3, k3, v3)), ((0, None, None), (q3, k, v))):
            out = jax.jit(jax.vmap(f, axes))(*args)
            grads = jax.jit(jax.vmap(g, axes))(*args)
            for i in range(n):
                sl = [a if ax is None else a[i] for a, ax in zip(args, axes, strict=True)]
                np.testing.assert_allclose(out[i], f_one(*sl), atol=1e-6)
                for a, b in zip(grads, g_one(*sl), strict=True):
                    np.testing.assert_allclose(a[i], b, atol=1e-5)
        # nested vmap, and grad of a vmapped function
        out2 = jax.vmap(jax.vmap(f))(q3[:, None], k3[:, None], v3[:, None])[:, 0]
        np.testing.assert_allclose(out2, jnp.stack([f_one(q3[i], k3[i], v3[i]) for i in range(n)]), atol=1e-6)
        gq = jax.jit(jax.grad(lambda q: jax.vmap(loss)(q, k3, v3).sum()))(q3)
        for i in range(n):
            np.testing.assert_allclose(gq[i], g_one(q3[i], k3[i], v3[i])[0], atol=1e-5)

    def test_mask_forms_agree(self, backend, rng):
        s = 64
        i, j = np.arange(s)[:, None], np.arange(s)[None]
        arr = (np.abs(i - j) <= 5) | (j < 2)
        q, k, v, _ = make_inputs(rng, s, s, b=1)
        ref, _ = attention_ref(q, k, v, arr, 1 / 4)
        forms = {
            "Mask": masks.sliding_window(5) | masks.sink(2),
            "numpy": arr,
            "jax": jnp.asarray(arr),
            "4-D": arr[None, None],
            "fn": lambda i, j: (np.abs(i - j) <= 5) | (j < 2),
            "ACSR": acsr.from_dense(arr),
        }
        for name, m in forms.items():
            with refusal_skips(backend):
                out = api.attention(q, k, v, m, backend=backend)
            assert_close(f"mask as {name}", out, ref, jnp.float32)
        full = api.attention(q, k, v, backend=backend)
        assert_close("mask None", full, attention_ref(q, k, v, np.ones((s, s), bool), 1 / 4)[0], jnp.float32)

    def test_scale(self, backend, rng):
        mask = mask_array("causal")
        q, k, v, _ = make_inputs(rng, *mask.shape, b=1)
        for scale in (None, 0.05, 2.0, np.float32(0.7)):
            with refusal_skips(backend):
                out = api.attention(q, k, v, mask, scale=scale, backend=backend)
            s = 1 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
            assert_close(f"scale={scale}", out, attention_ref(q, k, v, mask, s)[0], jnp.float32)

    def test_no_nan_with_extreme_scores(self, backend, rng):
        mask = mask_array("empty_rows")
        q, k, v, do = make_inputs(rng, *mask.shape)
        out, lse, grads = run(q * 300, k * 300, v, do, layout_of("empty_rows"), 1.0, backend)
        for x in (out, *grads):
            assert np.isfinite(np.asarray(x)).all()
        assert lse is None or not np.isnan(np.asarray(lse)).any()


# -----------------------------------------------------------------------------
# pure-JAX backend: each piece kind, memory
# -----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["window", "gather"])
@pytest.mark.parametrize(
    "name",
    [
        "causal",
        "dilated_window",
        "strided",
        "global_window",
        "empty_rows",
        "rect_wide",
        "rect_causal",
        "odd_window",
    ],
)
def test_pure_piece_kinds(monkeypatch, rng, name, kind):
    """Every segment planned as ``kind`` (the cost model picks per segment otherwise)."""
    monkeypatch.setattr(_pure, "_FORCE", kind)
    layout = layout_of(name)
    plan = _pure._plan(layout)
    assert plan and all(type(p).__name__.lower() == f"_{kind}" for p in plan)
    mask = mask_array(name)
    q, k, v, do = make_inputs(rng, *mask.shape)
    check_against_reference(q, k, v, do, mask, 0.3, "jax", layout=layout)


def test_pure_residual_and_chunking(monkeypatch, rng):
    """Residual path (> 4 runs a row) and multi-chunk spans with per-block trip counts."""
    layout = layout_of("random")
    assert layout.residual is not None and not layout.segments
    monkeypatch.setattr(_pure, "_RESIDUAL_KEYS_PER_CHUNK", 64)
    monkeypatch.setattr(_pure, "_MAX_SINGLE_CHUNK", 32)
    monkeypatch.setattr(_pure, "_KEY_CHUNKS", (24,))
    monkeypatch.setattr(_pure, "_GATHER_MAX_SINGLE", 8)
    monkeypatch.setattr(_pure, "_GATHER_CHUNK", 8)
    _pure._plan_cached.cache_clear()
    try:
        for name, kind in (
            ("random", None),
            ("causal", "window"),
            ("global_window", "window"),
            ("strided", "gather"),
        ):
            monkeypatch.setattr(_pure, "_FORCE", kind)
            plan = _pure._plan(layout_of(name))
            assert any(p.n_chunks > 1 for p in plan), name
            mask = mask_array(name)
            q, k, v, do = make_inputs(rng, *mask.shape, b=1)
            check_against_reference(q, k, v, do, mask, 0.3, "jax", layout=layout_of(name))
    finally:
        _pure._plan_cached.cache_clear()


def _temp_bytes(f, *args) -> int:
    return jax.jit(f).lower(*args).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("mask", [masks.sliding_window(128), masks.causal()], ids=["window", "causal"])
def test_pure_memory_is_not_quadratic(mask):
    """XLA temp memory of forward + backward stays far below dense masked attention."""
    s, h, d = 4096, 2, 32
    layout = mask.to_acsr(s, s)
    x = jax.ShapeDtypeStruct((1, s, h, d), jnp.float32)
    dense_mask = jnp.asarray(layout.to_dense())

    def sparse(q, k, v):
        return (_dispatch.attention(q, k, v, layout, 0.1, "jax") ** 2).sum()

    def dense(q, k, v):
        return (jax.nn.dot_product_attention(q, k, v, mask=dense_mask[None, None], scale=0.1) ** 2).sum()

    grad = lambda f: jax.grad(f, argnums=(0, 1, 2))
    ratio = _temp_bytes(grad(sparse), x, x, x) / _temp_bytes(grad(dense), x, x, x)
    assert ratio < 0.25, ratio
    # O(S^2) scores would be s * s * h * 4 bytes = 128 MiB here
    assert _temp_bytes(grad(sparse), x, x, x) < s * s * h * 4 / 4


# -----------------------------------------------------------------------------
# backend seam
# -----------------------------------------------------------------------------


def test_auto_on_cpu_is_pure_jax_and_quiet(rng, recwarn):
    if jax.default_backend() == "gpu":
        pytest.skip("CPU behaviour")
    q, k, v, _ = make_inputs(rng, 16, 16, b=1)
    layout = masks.causal().to_acsr(16)
    assert jax_bindings.selected_backend("attention", q, k, v, layout, 0.25) == "jax"
    x = jax.ShapeDtypeStruct(q.shape, q.dtype)
    assert jax_bindings.selected_backend("sddmm", x, x, layout) == "jax"
    api.attention(q, k, v, masks.causal())
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]


@pytest.mark.gpu
def test_gpu_backends_import_on_gpu():
    assert jax_bindings.available_backends() == {name: None for name in _registry.names()}
    q = jax.ShapeDtypeStruct((1, 256, 4, 64), jnp.bfloat16)
    strided = masks.strided(8).to_acsr(256)
    assert jax_bindings.selected_backend("attention", q, q, q, strided, 0.125) == "triton"


@pytest.fixture
def fresh_dispatch(monkeypatch, fresh_registry):
    """``set_module(name, module_path)`` points a registry entry at another module."""
    entries = {e.name: e for e in _registry.ENTRIES}

    def set_module(name, module):
        entries[name] = dataclasses.replace(entries[name], module=module)
        monkeypatch.setattr(_registry, "ENTRIES", tuple(entries.values()))
        _registry._load.cache_clear()

    return set_module


def test_explicit_triton_unavailable_is_an_error(fresh_dispatch, monkeypatch, rng):
    fresh_dispatch("triton", "jax_bindings._no_such_backend")
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    q, k, v, _ = make_inputs(rng, 16, 16, b=1)
    with pytest.raises(_dispatch.BackendUnavailableError, match='backend="triton".*No module named'):
        api.attention(q, k, v, masks.causal(), backend="triton")
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    with pytest.raises(_dispatch.BackendUnavailableError, match="runs on gpu only"):
        api.attention(q, k, v, masks.causal(), backend="triton")


def test_auto_on_gpu_falls_back_when_triton_does_not_import(fresh_dispatch, monkeypatch, rng):
    fresh_dispatch("triton", "jax_bindings._no_such_backend")
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    mask = mask_array("causal")
    q, k, v, _ = make_inputs(rng, *mask.shape, b=1)
    with pytest.warns(RuntimeWarning, match="falls back.*triton: ModuleNotFoundError"):
        out = api.attention(q, k, v, mask)
    assert_close("fallback out", out, attention_ref(q, k, v, mask, 0.25)[0], jnp.float32)


def _fake_backend(monkeypatch, name: str, **ops):
    """A module ``name`` that is the pure backend with some ops replaced."""
    import sys
    import types

    mod = types.ModuleType(name)
    for op in _registry.CONTRACT_OPS:
        setattr(mod, op, ops.get(op, getattr(_pure, op)))
    monkeypatch.setitem(sys.modules, name, mod)
    return mod


def test_auto_falls_back_on_not_implemented(fresh_dispatch, monkeypatch, rng):
    calls = []

    def refuse(*args):
        calls.append(1)
        raise NotImplementedError("head dim not supported")

    _fake_backend(monkeypatch, "fake_triton_backend", attention_fwd=refuse)
    fresh_dispatch("triton", "fake_triton_backend")
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    mask = mask_array("causal_window")
    q, k, v, _ = make_inputs(rng, *mask.shape, b=1)
    with pytest.warns(RuntimeWarning, match="head dim not supported"):
        out = api.attention(q, k, v, mask)
    assert calls
    assert_close("fallback out", out, attention_ref(q, k, v, mask, 0.25)[0], jnp.float32)
    # explicit: the NotImplementedError reaches the caller
    with pytest.raises(NotImplementedError, match="head dim"):
        api.attention(q, k, v, mask, backend="triton")


def test_a_backend_bug_is_not_a_fallback(fresh_dispatch, monkeypatch, rng):
    def bug(*args):
        raise ValueError("planner bug")

    _fake_backend(monkeypatch, "fake_buggy_backend", attention_fwd=bug)
    fresh_dispatch("triton", "fake_buggy_backend")
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    q, k, v, _ = make_inputs(rng, 16, 16, b=1)
    with pytest.raises(ValueError, match="planner bug"):
        api.attention(q, k, v, masks.causal())


def test_backend_module_must_be_complete(fresh_dispatch, monkeypatch):
    mod = _fake_backend(monkeypatch, "fake_incomplete_backend")
    del mod.spmm_bwd
    fresh_dispatch("triton", "fake_incomplete_backend")
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert "spmm_bwd" in jax_bindings.available_backends()["triton"]
    q = jnp.zeros((1, 8, 1, 8))
    with pytest.raises(_dispatch.BackendUnavailableError, match="spmm_bwd"):
        api.attention(q, q, q, masks.causal(), backend="triton")


# -----------------------------------------------------------------------------
# validation
# -----------------------------------------------------------------------------

S, H, D = 24, 4, 8


def _qkv(b=1, sq=S, skv=S, h=H, hk=2, d=D, dtype=jnp.float32):
    rng = np.random.default_rng(0)
    mk = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)
    return mk(b, sq, h, d), mk(b, skv, hk, d), mk(b, skv, hk, d)


def _bad_attention_cases():
    q, k, v = _qkv()
    causal = masks.causal()
    cases = {
        "query rank": ((q[0], k, v), {}, ValueError, "query must be 4-D"),
        "key rank": ((q, k[..., None], v), {}, ValueError, "key must be 4-D"),
        "value not array": ((q, k, [1.0]), {}, TypeError, "value must be a jax or numpy array"),
        "empty axis": ((q[:, :0], k, v), {}, ValueError, "query must have no empty axis"),
        "batch": ((jnp.concatenate([q, q]), k, v), {}, ValueError, "key batch 1 != query batch 2"),
        "head dim": ((q, k[..., :4], v[..., :4]), {}, ValueError, "key head dim 4 != query head dim 8"),
        "gqa": ((q, *(_qkv(hk=3)[1:])), {}, ValueError, "key has 3 heads, which must divide the 4"),
        "kv shape": ((q, k, v[:, :-1]), {}, ValueError, "key and value must have the same shape"),
        "dtype int": ((q.astype(jnp.int32), k, v), {}, TypeError, "query must have dtype float32, bfloat16"),
        "dtype f64": ((np.asarray(q, np.float64), k, v), {}, TypeError, "query must have dtype"),
        "mixed": ((q, k.astype(jnp.bfloat16), v), {}, TypeError, "must share one dtype"),
        "mask size": ((q, k, v, np.ones((S, S + 1), bool)), {}, ValueError, r"mask array must have shape"),
        "mask dtype": ((q, k, v, np.ones((S, S), np.int32)), {}, TypeError, "mask array must be boolean"),
        "mask per head, wrong count": (
            (q, k, v, np.ones((1, H - 1, S, S), bool)),
            {},
            ValueError,
            "mask has 3 per-head masks",
        ),
        "mask per batch": (
            (q, k, v, np.ones((3, 1, S, S), bool)),
            {},
            ValueError,
            "one mask [q_len, kv_len] = [24, 24] shared by all heads and batch rows",
        ),
        "mask 3-D wrong size": (
            (q, k, v, np.ones((2, S, S + 1), bool)),
            {},
            ValueError,
            "mask array must have shape (q_len, kv_len) = (24, 24)",
        ),
        "mask layout size": ((q, k, v, causal.to_acsr(S, S + 2)), {}, ValueError, "mask layout is 24 x 26"),
        "mask kind": ((q, k, v, "causal"), {}, TypeError, "mask must be"),
        "backend": ((q, k, v), {"backend": "hopper"}, ValueError, "backend must be one of"),
        "scale zero": ((q, k, v), {"scale": 0.0}, ValueError, "scale must be a positive finite number"),
        "scale nan": ((q, k, v), {"scale": float("nan")}, ValueError, "scale must be a positive finite"),
        "scale inf": ((q, k, v), {"scale": math.inf}, ValueError, "scale must be a positive finite"),
        "scale negative": ((q, k, v), {"scale": -1}, ValueError, "scale must be a positive finite"),
        "scale str": ((q, k, v), {"scale": "0.1"}, TypeError, "scale must be a positive finite"),
        "scale bool": ((q, k, v), {"scale": True}, TypeError, "scale must be a positive finite"),
    }
    return cases


_ATTN_CASES = _bad_attention_cases()


@pytest.mark.parametrize("case", list(_ATTN_CASES))
def test_attention_validation(case):
    args, kwargs, exc, msg = _ATTN_CASES[case]
    with pytest.raises(exc, match=re.escape(msg) if "\\" not in msg else msg):
        api.attention(*args, **kwargs)


def test_traced_mask_and_scale_are_rejected():
    q, k, v = _qkv()
    m = jnp.ones((S, S), bool)
    with pytest.raises(TypeError, match="mask is a traced jax value") as e:
        jax.jit(lambda q, k, v, m: api.attention(q, k, v, m))(q, k, v, m)
    for advice in ("@splat.sparsify", "index comparisons", "splat.masks constructor", "numpy array"):
        assert advice in str(e.value), advice
    with pytest.raises(TypeError, match="scale must be a static Python number"):
        jax.jit(lambda q, k, v, s: api.attention(q, k, v, scale=s))(q, k, v, 0.1)


def test_rectangular_and_odd_sizes_through_api(rng):
    mask = masks.sliding_window(7, 3)
    q, k, v = _qkv(sq=33, skv=57)
    out = api.attention(q, k, v, mask, backend="jax")
    ref, _ = attention_ref(q, k, v, mask.to_acsr(33, 57), 1 / math.sqrt(D))
    assert_close("rect", out, ref, jnp.float32)


def test_s777_global_window_forward_and_grads_float32(rng):
    """A size that is a multiple of no tile: S = 777, Longformer mask, GQA, fwd and grads."""
    s, h, hk, d = 777, 4, 2, 32
    mask = masks.global_tokens(3) | masks.sliding_window(40, 40)
    q = jnp.asarray(rng.standard_normal((1, s, h, d)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((1, s, hk, d)), jnp.float32) for _ in range(2))
    do = jnp.asarray(rng.standard_normal((1, s, h, d)), jnp.float32)
    scale = 1 / math.sqrt(d)
    out, vjp = jax.vjp(lambda q, k, v: api.attention(q, k, v, mask, backend="jax"), q, k, v)
    layout = mask.to_acsr(s, s)
    ref, _ = attention_ref(q, k, v, layout, scale)
    assert_close("S=777 out", out, ref, jnp.float32)
    for name, got, want in zip(
        ("dq", "dk", "dv"), vjp(do), attention_grads_ref(q, k, v, layout, scale, do), strict=True
    ):
        assert_close(f"S=777 {name}", got, want, jnp.float32)
