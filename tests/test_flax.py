"""splat.flax.attention_fn inside flax.nnx.MultiHeadAttention."""

import warnings

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import splat.flax
from splat import masks

S, F, NH = 32, 16, 2
I, J = np.arange(S)[:, None], np.arange(S)[None, :]  # noqa: E741


def _mha(attention_fn, seed=0, **kw):
    return nnx.MultiHeadAttention(
        num_heads=NH, in_features=F, decode=False, attention_fn=attention_fn, rngs=nnx.Rngs(seed), **kw
    )


def _dense_fn(mask):
    def fn(query, key, value, bias=None, mask_arg=None, *a, is_causal=False, **kw):
        m = jnp.asarray(mask)
        if is_causal:
            m = m & jnp.asarray(J <= I)
        return nnx.dot_product_attention(query, key, value, mask=m)

    return fn


def _x(seed, shape=(2, S, F)):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


@pytest.mark.parametrize("batch", [(2,), (2, 3)])
def test_matches_dense_module_output_and_grads(batch):
    m = masks.sliding_window(4) | masks.global_tokens(1)
    dense_mask = (np.abs(I - J) <= 4) | (I < 1) | (J < 1)
    sp, de = _mha(splat.flax.attention_fn(m)), _mha(_dense_fn(dense_mask))
    x = _x(1, batch + (S, F))
    np.testing.assert_allclose(
        np.asarray(nnx.jit(lambda mod, x: mod(x))(sp, x)), np.asarray(de(x)), rtol=1e-4, atol=1e-5
    )

    def loss(mod, x):
        return (mod(x) ** 2).sum()

    gs, gd = nnx.grad(loss)(sp, x), nnx.grad(loss)(de, x)
    for a, b in zip(jax.tree.leaves(gs), jax.tree.leaves(gd), strict=False):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=2e-5)


def test_is_causal_and_call_mask():
    sp = _mha(splat.flax.attention_fn(masks.sliding_window(5)))
    de = _mha(_dense_fn(np.abs(I - J) <= 5))
    x = _x(2)
    np.testing.assert_allclose(
        np.asarray(sp(x, is_causal=True)), np.asarray(de(x, is_causal=True)), rtol=1e-4, atol=1e-5
    )
    static = (I + J) % 3 != 1
    out = sp(x, mask=jnp.asarray(static)[None, None])
    ref = _mha(_dense_fn((np.abs(I - J) <= 5) & static))(x)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-4, atol=1e-5)


def test_per_layer_masks_differ():
    x = _x(3)
    a = _mha(splat.flax.attention_fn(masks.causal()))(x)
    b = _mha(splat.flax.attention_fn(masks.causal() & masks.sliding_window(2, 0)))(x)
    assert not np.allclose(np.asarray(a), np.asarray(b))
    np.testing.assert_allclose(
        np.asarray(a[:, :3]), np.asarray(b[:, :3]), rtol=1e-5, atol=1e-6
    )  # same first rows


def test_dropout_raises_or_falls_back():
    x = _x(4)
    sp = _mha(splat.flax.attention_fn(masks.causal()), dropout_rate=0.5)
    with pytest.raises(ValueError, match="dropout"):
        sp(x, deterministic=False, rngs=nnx.Rngs(1))
    sp(x, deterministic=True)  # no dropout at eval: fine
    fb = _mha(splat.flax.attention_fn(masks.causal(), fallback=True), dropout_rate=0.5)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        fb(x, deterministic=False, rngs=nnx.Rngs(1))
        fb(x, deterministic=False, rngs=nnx.Rngs(2))
    assert len([w for w in rec if "dropout" in str(w.message)]) == 1


def test_bad_backend():
    with pytest.raises(ValueError, match="backend"):
        splat.flax.attention_fn(masks.causal(), backend="tpu")
