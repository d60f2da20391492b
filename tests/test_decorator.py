"""@splat.sparse_attention: an existing jax.nn-style attention function runs through splat."""

import inspect
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from splat import masks
from splat._decorator import SparseAttentionFallbackWarning, sparse_attention

B, S, H, D = 2, 40, 4, 8


def _qkv(seed, hk=H):
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.standard_normal((B, S, h, D)), jnp.float32) for h in (H, hk, hk)]


def dense(
    query,
    key,
    value,
    bias=None,
    mask=None,
    *,
    scale=None,
    is_causal=False,
    query_seq_lengths=None,
    key_value_seq_lengths=None,
    local_window_size=None,
    implementation=None,
):
    return jax.nn.dot_product_attention(
        query,
        key,
        value,
        bias,
        mask,
        scale=scale,
        is_causal=is_causal,
        query_seq_lengths=query_seq_lengths,
        key_value_seq_lengths=key_value_seq_lengths,
        local_window_size=local_window_size,
        implementation=implementation,
    )


def _ref64(q, k, v, mask, scale=None):
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    g = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, g, 2), np.repeat(v, g, 2)
    s = np.einsum("bqhd,bkhd->bhqk", q, k) * (1 / np.sqrt(q.shape[-1]) if scale is None else scale)
    s = np.where(mask, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("bhqk,bkhd->bqhd", p / p.sum(-1, keepdims=True), v)


I, J = np.arange(S)[:, None], np.arange(S)[None, :]  # noqa: E741
WINDOW = np.abs(I - J) <= 6


def test_signature_kept():
    attn = sparse_attention(mask=masks.sliding_window(6))(dense)
    assert inspect.signature(attn) == inspect.signature(dense)
    assert attn.__name__ == "dense"


@pytest.mark.parametrize("hk", [H, 2])
def test_mask_combined_with_call_arguments(hk):
    q, k, v = _qkv(0, hk)
    attn = sparse_attention(mask=masks.sliding_window(6))(dense)
    np.testing.assert_allclose(np.asarray(attn(q, k, v)), _ref64(q, k, v, WINDOW), rtol=1e-4, atol=1e-5)
    out = jax.jit(lambda q, k, v: attn(q, k, v, is_causal=True, scale=0.2))(q, k, v)
    np.testing.assert_allclose(np.asarray(out), _ref64(q, k, v, WINDOW & (J <= I), 0.2), rtol=1e-4, atol=1e-5)
    out = attn(q, k, v, local_window_size=(3, 1))
    np.testing.assert_allclose(
        np.asarray(out), _ref64(q, k, v, WINDOW & (I - J <= 3) & (J - I <= 1)), rtol=1e-4, atol=1e-5
    )
    static = (I + J) % 2 == 0
    out = attn(q, k, v, mask=static[None, None])
    np.testing.assert_allclose(np.asarray(out), _ref64(q, k, v, WINDOW & static), rtol=1e-4, atol=1e-5)


def test_grad_and_vmap_match_dense():
    q, k, v = _qkv(1)
    attn = sparse_attention(mask=masks.sliding_window(6) | masks.global_tokens(2))(dense)
    full = (np.abs(I - J) <= 6) | (I < 2) | (J < 2)
    w = jnp.asarray(np.random.default_rng(2).standard_normal((B, S, H, D)), jnp.float32)
    ga = jax.grad(lambda q, k, v: (attn(q, k, v, is_causal=True) * w).sum(), (0, 1, 2))(q, k, v)
    gb = jax.grad(
        lambda q, k, v: (dense(q, k, v, mask=jnp.asarray(full)[None, None], is_causal=True) * w).sum(),
        (0, 1, 2),
    )(q, k, v)
    for a, b in zip(ga, gb, strict=False):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=2e-5)
    out = jax.vmap(attn)(q, k, v)  # per example [S, H, D]
    np.testing.assert_allclose(np.asarray(out), _ref64(q, k, v, full), rtol=1e-4, atol=1e-5)


def test_array_and_function_masks_and_short_signature():
    q, k, v = _qkv(3)

    @sparse_attention(mask=lambda i, j: (i - j) % 2 == 0)
    def attn(q, k, v):
        raise AssertionError("the dense body must not run")

    np.testing.assert_allclose(
        np.asarray(attn(q, k, v)), _ref64(q, k, v, (I - J) % 2 == 0), rtol=1e-4, atol=1e-5
    )
    attn2 = sparse_attention(mask=WINDOW)(lambda q, k, v: None)
    np.testing.assert_allclose(np.asarray(attn2(q, k, v)), _ref64(q, k, v, WINDOW), rtol=1e-4, atol=1e-5)


def test_seq_lengths_honoured():
    """jax.nn's query_seq_lengths / key_value_seq_lengths run through splat's runtime lengths."""
    q, k, v = _qkv(5)
    attn = sparse_attention(mask=masks.causal())(dense)
    qlen, kvlen = jnp.asarray([S, 30]), jnp.asarray([20, S])
    out = np.asarray(
        jax.jit(lambda q, a, b: attn(q, k, v, query_seq_lengths=a, key_value_seq_lengths=b))(q, qlen, kvlen)
    )
    for b in range(B):
        keep = (J <= I) & (J < int(kvlen[b]))
        want = _ref64(q[b : b + 1], k[b : b + 1], v[b : b + 1], keep)[0]
        rows = slice(0, int(qlen[b]))
        np.testing.assert_allclose(out[b, rows], want[rows], rtol=1e-4, atol=1e-5)
        assert np.abs(out[b, int(qlen[b]) :]).sum() == 0  # padded queries output 0


def test_unsupported_arguments_raise_naming_them():
    q, k, v = _qkv(4)
    attn = sparse_attention(mask=masks.causal())(dense)
    with pytest.raises(ValueError, match="`bias`"):
        attn(q, k, v, bias=jnp.zeros((1, 1, S, S)))
    with pytest.raises(ValueError, match="traced"):
        jax.jit(lambda q, m: attn(q, k, v, mask=m))(q, jnp.asarray(WINDOW)[None, None])
    per_head = np.stack([WINDOW, ~WINDOW | (I == J)])[None]
    with pytest.raises(ValueError, match="differs across batch or heads"):
        attn(q, k, v, mask=per_head.repeat(2, 1))


def test_fallback_calls_original_and_warns_once():
    q, k, v = _qkv(5)
    attn = sparse_attention(mask=masks.causal(), fallback=True)(dense)
    bias = jnp.asarray(np.random.default_rng(6).standard_normal((1, 1, S, S)), jnp.float32)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        out = attn(q, k, v, bias=bias)
        attn(q, k, v, bias=bias)
    msgs = [str(w.message) for w in rec if issubclass(w.category, SparseAttentionFallbackWarning)]
    assert len(msgs) == 1 and "`bias`" in msgs[0]
    np.testing.assert_allclose(np.asarray(out), np.asarray(dense(q, k, v, bias=bias)), rtol=1e-6)


def test_no_mask_means_detection_mode():
    q, k, v = _qkv(7)

    @sparse_attention
    def attn(q, k, v):
        i = jnp.arange(q.shape[1])
        return jax.nn.dot_product_attention(q, k, v, mask=(jnp.abs(i[:, None] - i[None, :]) <= 6)[None, None])

    assert len(attn.inspect(q, k, v)) == 1
    np.testing.assert_allclose(np.asarray(attn(q, k, v)), _ref64(q, k, v, WINDOW), rtol=1e-4, atol=1e-5)

    @sparse_attention()
    def plain(x):
        return x * 2

    with pytest.raises(ValueError, match="no dense attention"):
        plain(q)


def test_bad_arguments():
    with pytest.raises(ValueError, match="backend"):
        sparse_attention(mask=masks.causal(), backend="hopper")
    with pytest.raises(TypeError, match="query, key, value"):
        sparse_attention(mask=masks.causal())(lambda q: q)
    with pytest.raises(TypeError, match="mask must be"):
        sparse_attention(mask=3)(dense)
