"""splat.sparsify: trace-time detection of constant masks in dense attention."""

import time
import warnings

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import splat
from splat._sparsify import SparsifyWarning, sparsify

B, S, H, D = 2, 48, 4, 16


def _qkv(seed, b=B, s=S, h=H, hk=None, d=D):
    rng = np.random.default_rng(seed)
    hk = h if hk is None else hk
    shapes = [(b, s, h, d), (b, s, hk, d), (b, s, hk, d)]
    return [jnp.asarray(rng.standard_normal(sh), jnp.float32) for sh in shapes]


def _ref64(q, k, v, mask, scale):
    """Dense masked attention in float64 (GQA by repeating kv heads); fully masked rows -> 0."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    g = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", q, k) * scale
    s = np.where(mask, s, -np.inf)
    m = np.max(s, -1, keepdims=True)
    e = np.where(mask, np.exp(s - np.where(np.isfinite(m), m, 0)), 0)
    z = e.sum(-1, keepdims=True)
    return np.einsum("bhqk,bkhd->bqhd", e / np.where(z == 0, 1, z), v)


def _check_grads(f, g, args, seed=1, rtol=2e-4, atol=2e-5):
    w = jnp.asarray(np.random.default_rng(seed).standard_normal(f(*args).shape), jnp.float32)
    ga = jax.grad(lambda *a: (f(*a) * w).sum(), argnums=(0, 1, 2))(*args)
    gb = jax.grad(lambda *a: (g(*a) * w).sum(), argnums=(0, 1, 2))(*args)
    for x, y in zip(ga, gb, strict=False):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


# --- the functions to detect ---------------------------------------------------------

WIN, NGLOBAL = 5, 3


def longformer(q, k, v):
    """Hand-written einsum attention; mask from jnp.arange: window + global tokens."""
    i = jnp.arange(q.shape[1])
    local = jnp.abs(i[:, None] - i[None, :]) <= WIN
    glob = (i[:, None] < NGLOBAL) | (i[None, :] < NGLOBAL)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(q.shape[-1]).astype(q.dtype)
    s = jnp.where(local | glob, s, -1e9)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


def longformer_mask(n):
    i = np.arange(n)
    return (np.abs(i[:, None] - i[None, :]) <= WIN) | (i[:, None] < NGLOBAL) | (i[None, :] < NGLOBAL)


def mistral(q, k, v):
    """Matmul form, causal sliding window as an additive 0/-inf bias."""
    n = q.shape[1]
    i, j = jnp.arange(n)[:, None], jnp.arange(n)[None, :]
    bias = jnp.where((j <= i) & (i - j < 8), 0.0, -jnp.inf)
    s = (q.transpose(0, 2, 1, 3) @ k.transpose(0, 2, 3, 1)) * q.shape[-1] ** -0.5 + bias
    return (jax.nn.softmax(s, -1) @ v.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)


def mistral_mask(n):
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    return (j <= i) & (i - j < 8)


def jnn_dilated(q, k, v):
    """jax.nn.dot_product_attention with a constant mask and is_causal, GQA (fewer kv heads)."""
    i = jnp.arange(q.shape[1])
    m = (i[:, None] - i[None, :]) % 3 == 0
    return jax.nn.dot_product_attention(q, k, v, mask=m[None, None], is_causal=True, scale=0.3)


def jnn_dilated_mask(n):
    i = np.arange(n)
    return ((i[:, None] - i[None, :]) % 3 == 0) & (i[None, :] <= i[:, None])


def input_dependent(q, k, v):
    keep = (q[:, :, 0, 0] > 0)[:, None, None, :] | jnp.eye(q.shape[1], dtype=bool)
    return jax.nn.dot_product_attention(q, k, v, mask=keep)


CASES = [
    (longformer, longformer_mask, None, 1 / np.sqrt(D)),
    (mistral, mistral_mask, None, 1 / np.sqrt(D)),
    (jnn_dilated, jnn_dilated_mask, 2, 0.3),
]


@pytest.mark.parametrize("fn,mask_fn,hk,scale", CASES, ids=[c[0].__name__ for c in CASES])
def test_detects_mask_and_matches(fn, mask_fn, hk, scale):
    q, k, v = _qkv(0, hk=hk)
    sf = sparsify(fn)
    found = sf.inspect(q, k, v)
    assert len(found) == 1, sf.problems(q, k, v)
    f = found[0]
    assert (f.q_len, f.kv_len) == (S, S)
    assert f.scale == pytest.approx(scale, rel=1e-6)
    want = mask_fn(S)
    got = splat.analyze(f.mask, S, S).to_dense()
    np.testing.assert_array_equal(got, want)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a detected attention must not warn
        out = jax.jit(sf)(q, k, v)
    np.testing.assert_allclose(
        np.asarray(out), _ref64(q, k, v, want[None, None], scale), rtol=1e-4, atol=1e-5
    )
    np.testing.assert_allclose(np.asarray(out), np.asarray(fn(q, k, v)), rtol=1e-4, atol=1e-5)
    _check_grads(sf, fn, (q, k, v))


def test_vmap_and_jit_grad():
    q, k, v = _qkv(3)
    sf = sparsify(longformer)
    # vmap over an extra leading axis: the function sees [B, S, H, D] per example
    qs, ks, vs = (jnp.stack([x, x[::-1]]) for x in (q, k, v))
    out = jax.vmap(sf)(qs, ks, vs)
    ref = jax.vmap(longformer)(qs, ks, vs)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-4, atol=1e-5)
    # grad inside jit
    g = jax.jit(jax.grad(lambda q: sf(q, k, v).sum()))(q)
    gr = jax.grad(lambda q: longformer(q, k, v).sum())(q)
    np.testing.assert_allclose(np.asarray(g), np.asarray(gr), rtol=2e-4, atol=2e-5)


def test_unbatched_layout_under_vmap():
    """vmap over the batch axis: inside, q is [S, H, D]; the einsum has no batch label."""
    q, k, v = _qkv(4)

    def attn3(q, k, v):
        i = jnp.arange(q.shape[0])
        s = jnp.einsum("qhd,khd->hqk", q, k) * 0.25
        s = jnp.where(i[:, None] >= i[None, :], s, -jnp.inf)
        return jnp.einsum("hqk,khd->qhd", jax.nn.softmax(s), v)

    out = jax.vmap(sparsify(attn3))(q, k, v)
    i = np.arange(S)
    ref = _ref64(q, k, v, (i[:, None] >= i[None, :])[None, None], 0.25)
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-4, atol=1e-5)


def test_flax_nnx_dot_product_attention():
    q, k, v = _qkv(5)

    def fn(q, k, v):
        i = jnp.arange(q.shape[1])
        m = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - 6)
        return nnx.dot_product_attention(q, k, v, mask=m[None, None])

    sf = sparsify(fn)
    assert len(sf.inspect(q, k, v)) == 1
    np.testing.assert_allclose(np.asarray(sf(q, k, v)), np.asarray(fn(q, k, v)), rtol=1e-4, atol=1e-5)


def test_input_dependent_mask_falls_back_with_one_warning():
    q, k, v = _qkv(6)
    sf = sparsify(input_dependent)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        out1 = sf(q, k, v)
        out2 = jax.jit(sf)(q, k, v)
        g = jax.grad(lambda q: sf(q, k, v).sum())(q)
    msgs = [str(w.message) for w in rec if issubclass(w.category, SparsifyWarning)]
    assert len(msgs) == 1, msgs
    assert "depends on the function's inputs" in msgs[0]
    ref = input_dependent(q, k, v)
    np.testing.assert_allclose(np.asarray(out1), np.asarray(ref), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(out2), np.asarray(ref), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        np.asarray(g), np.asarray(jax.grad(lambda q: input_dependent(q, k, v).sum())(q)), rtol=1e-5, atol=1e-6
    )


def test_nothing_found_warns_and_fallback_false_raises():
    x = jnp.asarray(np.random.default_rng(7).standard_normal((4, 8)), jnp.float32)

    def mlp(x):
        return jnp.tanh(x @ x.T)

    with pytest.warns(SparsifyWarning, match="no dense attention"):
        np.testing.assert_allclose(np.asarray(sparsify(mlp)(x)), np.asarray(mlp(x)))
    with pytest.raises(ValueError, match="no dense attention"):
        sparsify(mlp, fallback=False)(x)


def test_learned_bias_is_reported():
    q, k, v = _qkv(8)
    bias = jnp.asarray(np.random.default_rng(9).standard_normal((S, S)), jnp.float32)

    def fn(q, k, v, bias):
        return jax.nn.dot_product_attention(q, k, v, bias=bias[None, None], is_causal=True)

    with pytest.warns(SparsifyWarning, match="bias depends on the function's inputs"):
        out = sparsify(fn)(q, k, v, bias)
    np.testing.assert_allclose(np.asarray(out), np.asarray(fn(q, k, v, bias)), rtol=1e-6)


def test_layers_share_one_mask_and_cache():
    q, k, v = _qkv(10)
    calls = []

    def model(q, k, v):
        calls.append(1)
        x = q
        for _ in range(3):
            x = longformer(x, k, v)
        return x

    sf = sparsify(model)
    found = sf.inspect(q, k, v)
    assert len(found) == 3
    assert found[0].mask is found[1].mask is found[2].mask
    n = len(calls)
    sf(q, k, v)
    assert len(calls) == n  # same shapes: the cached plan is reused, no re-trace
    np.testing.assert_allclose(np.asarray(sf(q, k, v)), np.asarray(model(q, k, v)), rtol=2e-4, atol=2e-5)


def test_mask_predicate_never_materialises_full_grid():
    """The predicate is evaluated on row chunks: ask for 3 rows of a 4096 x 4096 mask."""
    n = 4096
    q = jax.ShapeDtypeStruct((1, n, 1, 8), jnp.float32)
    jaxpr_args = [jnp.zeros(q.shape, q.dtype)] * 3
    sf = sparsify(longformer)
    t0 = time.perf_counter()
    (f,) = sf.inspect(*jaxpr_args)
    rows = np.array([[0], [100], [4095]])
    got = f.mask(rows, np.arange(n)[None, :])
    assert got.shape == (3, n)
    np.testing.assert_array_equal(got, longformer_mask(n)[[0, 100, 4095]])
    assert time.perf_counter() - t0 < 30


# --- symbolic recognition: iota masks -> constructors, exact on the whole grid ----------

_W, _L, _R, _N, _P = 16, 7, 3, 4, 3
RECOGNISED = {
    "causal": (lambda i, j: j <= i, "Causal"),
    "causal_ge": (lambda i, j: i >= j, "Causal"),
    "not_above": (lambda i, j: ~(j > i), "Causal"),
    "scaled_causal": (lambda i, j: 2 * i - 2 * j >= 0, "Causal"),
    "causal_window": (lambda i, j: (j <= i) & (i - j < _W), "SlidingWindow"),
    "abs_band": (lambda i, j: jnp.abs(i - j) <= _L, "SlidingWindow"),
    "two_sided_band": (lambda i, j: (i - j <= _L) & (j - i <= _R), "SlidingWindow"),
    "one_sided_left": (lambda i, j: i - j < _W, "SlidingWindow"),
    "one_sided_right": (lambda i, j: j - i <= _R, "SlidingWindow"),
    "union_of_bands": (lambda i, j: (jnp.abs(i - j) <= 2) | ((j <= i) & (i - j < _W)), "SlidingWindow"),
    "sink": (lambda i, j: j < _N, "Sink"),
    "global_tokens": (lambda i, j: (i < _N) | (j < _N), "GlobalTokens"),
    "longformer": (lambda i, j: (jnp.abs(i - j) <= _L) | (i < _N) | (j < _N), "Union"),
    "window_or_sink": (lambda i, j: ((j <= i) & (i - j < _W)) | (j < _N), "Union"),
    "window_and_sink": (lambda i, j: (i - j >= 0) & (j < 50), "Intersection"),
    "dilated": (lambda i, j: ((i - j) % _P == 0) & (jnp.abs(i - j) <= 12), "DilatedWindow"),
    "dilated_asym": (lambda i, j: ((i - j) % _P == 0) & (i - j <= 12) & (j - i <= 6), "Intersection"),
    "strided": (lambda i, j: ((i - j) % _P == 0) & (j <= i), "Strided"),
    "strided_window": (lambda i, j: ((i - j) % _P == 0) & (j <= i) & (i - j < 20), "Intersection"),
    "logical_fns": (lambda i, j: jnp.logical_and(jnp.logical_not(j > i), i - j <= _L), "SlidingWindow"),
}
UNRECOGNISED = {  # kept on the exact from_fn path
    "parity": lambda i, j: (i + j) % 2 == 0,
    "block_local": lambda i, j: (i // 8 >= j // 8) & (i // 8 - 1 <= j // 8),
}


def _attn_with(pat, form):
    def fn(q, k, v):
        i, j = jnp.arange(q.shape[1])[:, None], jnp.arange(k.shape[1])[None, :]
        m = pat(i, j)
        if form == "jnn":
            return jax.nn.dot_product_attention(q, k, v, mask=m[None, None])
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k)
        s = (
            s + jnp.where(m, 0.0, -jnp.inf)[None, None]
            if form == "bias"
            else jnp.where(m[None, None], s, -1e9)
        )
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v)

    return fn


def _detected(fn, q_len, kv_len):
    q = jnp.zeros((1, q_len, 1, 4), jnp.float32)
    k = jnp.zeros((1, kv_len, 1, 4), jnp.float32)
    sf = sparsify(fn)
    found = sf.inspect(q, k, k)
    assert len(found) == 1, sf.problems(q, k, k)
    return found[0].mask


@pytest.mark.parametrize("q_len,kv_len", [(200, 200), (150, 230)])
@pytest.mark.parametrize("name", list(RECOGNISED) + list(UNRECOGNISED))
def test_recognised_masks_are_exact(name, q_len, kv_len):
    pat, kind = RECOGNISED.get(name, (UNRECOGNISED.get(name), "FromFn"))
    want = np.broadcast_to(pat(jnp.arange(q_len)[:, None], jnp.arange(kv_len)[None, :]), (q_len, kv_len))
    I, J = np.arange(q_len)[:, None], np.arange(kv_len)[None, :]  # noqa: E741
    for form in ("where", "bias", "jnn") if q_len == kv_len else ("where",):
        m = _detected(_attn_with(pat, form), q_len, kv_len)
        assert type(m).__name__ == kind, (form, m)
        np.testing.assert_array_equal(np.broadcast_to(m(I, J), want.shape), want)
        np.testing.assert_array_equal(splat.analyze(m, q_len, kv_len).to_dense(), want)


def test_jnn_window_arguments_are_recognised():
    """is_causal + local_window_size: jax builds the window from constant aranges."""

    def fn(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=(7, 0))

    assert _detected(fn, 64, 64) == splat.masks.sliding_window(7, 0)


def _gemma(n_layers, window):
    def attn(x, layer):
        i, j = jnp.arange(x.shape[1])[:, None], jnp.arange(x.shape[1])[None, :]
        m = (j <= i) & (i - j < window) if layer % 2 == 0 else j <= i
        s = jnp.where(m[None, None], jnp.einsum("bqhd,bkhd->bhqk", x, x) * 0.25, -1e9)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), x)

    def model(x):
        for layer in range(n_layers):
            x = x + attn(x, layer)
        return x

    return model


def test_detection_is_fast_at_long_sequences():
    """12 Gemma-style layers at S = 8192: constructors, O(S) analysis, well under a second."""
    x = jnp.zeros((1, 8192, 1, 8), jnp.float32)
    sf = sparsify(_gemma(12, 1024), backend="jax")
    t0 = time.perf_counter()
    found = sf.inspect(x)
    elapsed = time.perf_counter() - t0
    assert [f.mask for f in found[:2]] == [splat.masks.sliding_window(1023, 0), splat.masks.causal()]
    assert len({id(f.mask) for f in found}) == 2
    assert elapsed < 3.0, elapsed  # measured ~0.05 s on 2 CPU cores; from_fn took 2+ s


def test_recognised_mask_runs_and_matches_dense():
    q, k, v = _qkv(11)
    fn = _attn_with(RECOGNISED["dilated_asym"][0], "bias")
    out = jax.jit(sparsify(fn))(q, k, v)
    i = np.arange(S)
    d = i[:, None] - i[None, :]
    want = (d % _P == 0) & (d <= 12) & (-d <= 6)
    np.testing.assert_allclose(np.asarray(out), _ref64(q, k, v, want[None, None], 1.0), rtol=1e-4, atol=1e-5)


# --- fully masked rows: never change results silently -------------------------------------


def _strict_causal(fill):
    def fn(q, k, v):
        i = jnp.arange(q.shape[1])
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.25
        s = jnp.where((i[None, :] < i[:, None])[None, None], s, fill)  # row 0 sees no key
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v)

    return fn


@pytest.mark.parametrize("fill,dense_row0", [(-1e9, "mean(V)"), (-np.inf, "NaN")])
def test_empty_rows_fall_back_with_one_warning(fill, dense_row0):
    q, k, v = _qkv(12)
    fn = _strict_causal(fill)
    sf = sparsify(fn)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        out = sf(q, k, v)
        sf(q, k, v)
    msgs = [str(w.message) for w in rec if issubclass(w.category, SparsifyWarning)]
    assert len(msgs) == 1 and "fully masked" in msgs[0] and dense_row0 in msgs[0], msgs
    ref = np.asarray(fn(q, k, v))
    np.testing.assert_array_equal(np.isnan(np.asarray(out)), np.isnan(ref))
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-6)
    if dense_row0 == "mean(V)":
        np.testing.assert_allclose(np.asarray(out)[:, 0], np.asarray(v).mean(1), rtol=1e-4, atol=1e-5)


def test_empty_rows_zero_opt_in():
    q, k, v = _qkv(13)
    fn = _strict_causal(-1e9)
    sf = sparsify(fn, empty_rows="zero")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = np.asarray(jax.jit(sf)(q, k, v))
    assert len(sf.inspect(q, k, v)) == 1
    i = np.arange(S)
    np.testing.assert_array_equal(out[:, 0], 0.0)
    np.testing.assert_allclose(
        out, _ref64(q, k, v, (i[None, :] < i[:, None])[None, None], 0.25), rtol=1e-4, atol=1e-5
    )
    with pytest.raises(ValueError, match="empty_rows"):
        sparsify(fn, empty_rows="nan")
