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
    kw = dict(num_heads=NH, in_features=F, decode=False) | kw
    return nnx.MultiHeadAttention(attention_fn=attention_fn, rngs=nnx.Rngs(seed), **kw)


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


# -----------------------------------------------------------------------------
# decode=True: one token a call against the KV cache
# -----------------------------------------------------------------------------

_DECODE_MASKS = {
    "causal": (masks.causal(), J <= I),
    "window": (masks.sliding_window(7, 0), (I - J <= 7) & (J - I <= 0)),
    # not causal: the cache holds keys <= i only, so step i sees mask[i] & (j <= i)
    "non_causal": (
        masks.sliding_window(4) | masks.global_tokens(1),
        (np.abs(I - J) <= 4) | (I < 1) | (J < 1),
    ),
}


def _decode(mod, x, jit: bool, mask=None):
    """Feeds ``x [B, S, F]`` one token a call through ``mod`` (decode=True); ``[B, S, F]``, traces."""
    mod.init_cache(x.shape)
    traces = []

    def step(m, t, mask):
        traces.append(1)
        return m(t, mask=mask)

    run = nnx.jit(step) if jit else step
    outs = [run(mod, x[:, i : i + 1], mask) for i in range(x.shape[1])]
    return jnp.concatenate(outs, axis=1), len(traces)


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("name", list(_DECODE_MASKS))
@pytest.mark.parametrize("kv_heads", [NH, 1], ids=["mha", "gqa"])
def test_decode_steps_equal_full_sequence(name, jit, kv_heads):
    """Step i of decode=True equals row i of the full-sequence call (the mask at the token's position).

    Before, every step applied the mask's row 0 (errors up to 4.4 for sliding_window(7, 0)).
    """
    m, dense = _DECODE_MASKS[name]
    kw = dict(num_heads=4, num_kv_heads=kv_heads, qkv_features=16)
    sp = _mha(splat.flax.attention_fn(m), seed=5, decode=True, **kw)
    ref = _mha(_dense_fn(dense & (J <= I)), seed=5, **kw)  # the same parameters, full sequence
    x = _x(6)
    want = np.asarray(ref(x))
    got, traces = _decode(sp, x, jit)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-5)
    if jit:
        assert traces == 1  # one compile serves every step


def test_decode_with_a_key_padding_mask():
    """Left-padded prompts: flax ANDs the caller's [B, 1, 1, S] mask with its cache mask, per batch row."""
    m, dense = _DECODE_MASKS["window"]
    pad = np.array([0, 3])  # row b's first pad[b] tokens are padding
    valid = J[0][None] >= pad[:, None]  # [B, S]
    sp = _mha(splat.flax.attention_fn(m), seed=7, decode=True)
    x = _x(8)
    got, _ = _decode(sp, x, jit=True, mask=jnp.asarray(valid)[:, None, None, :])
    ref = _mha(_dense_fn(dense & (J <= I)), seed=7)
    for b in range(2):
        # a row's valid tokens see only valid keys: the dense twin on its valid keys' rows and columns
        ref.attention_fn = _dense_fn(dense & (J <= I) & valid[b][None, :])
        want, rows = np.asarray(ref(x[b : b + 1])), valid[b]
        np.testing.assert_allclose(np.asarray(got[b, rows]), want[0, rows], rtol=1e-4, atol=1e-5)


def test_traced_key_padding_mask_at_full_length():
    """A traced per-row key mask [B, 1, 1, S] is applied at run time (it was refused before)."""
    valid = np.ones((2, S), bool)
    valid[1, -5:] = False
    sp = _mha(splat.flax.attention_fn(masks.causal()), seed=9)
    de = _mha(_dense_fn(J <= I), seed=9)
    x = _x(10)
    got = nnx.jit(lambda mod, x, m: mod(x, mask=m))(sp, x, jnp.asarray(valid)[:, None, None, :])
    for b in range(2):
        de.attention_fn = _dense_fn((J <= I) & valid[b][None, :])
        np.testing.assert_allclose(np.asarray(got[b]), np.asarray(de(x[b : b + 1]))[0], rtol=1e-4, atol=1e-5)


def test_decode_refuses_what_it_cannot_place():
    """A traced per-head mask cannot be read as a key padding mask: a clear error, never a wrong answer."""
    sp = _mha(splat.flax.attention_fn(masks.sliding_window(7, 0)), seed=11, decode=True)
    x = _x(12)
    per_head = jnp.ones((2, NH, 1, S), bool).at[:, 1, :, 3].set(False)
    with pytest.raises(ValueError, match="per-head"):
        _decode(sp, x, jit=True, mask=per_head)
    q = jnp.ones((2, S, NH, 8))
    with pytest.raises(ValueError, match="traced array and varies along the query axis"):
        jax.jit(lambda m: splat.flax.attention_fn(masks.causal())(q, q, q, mask=m))(
            jnp.ones((2, 1, S, S), bool)
        )


@pytest.mark.parametrize("decode", [False, True])
def test_fallback_keeps_the_layer_mask(decode):
    """fallback=True runs flax's dense attention with the layer's mask, at the decode position too."""
    m, dense = _DECODE_MASKS["window"]
    fb = _mha(splat.flax.attention_fn(m, fallback=True), seed=13, decode=decode)
    ref = _mha(_dense_fn(dense & (J <= I)), seed=13)
    x = _x(14)
    want = np.asarray(ref(x))
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        if decode:  # a traced per-head mask: refused by splat, run dense
            per_head = jnp.ones((2, NH, 1, S), bool)
            got, _ = _decode(fb, x, jit=True, mask=per_head)
        else:  # sow_weights: refused by splat, run dense
            got = fb(x, is_causal=True, sow_weights=True)
    assert any("running flax.nnx.dot_product_attention" in str(w.message) for w in rec)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-5)


def test_neighborhood_mask_on_a_flattened_grid():
    """A 2-D neighborhood (dilated, causal along rows) on [B, H*W, F] tokens: outputs, grads, key padding."""
    grid = (6, 8)  # 48 tokens, row-major
    m = masks.neighborhood(grid, 3, dilation=(1, 2), is_causal=(True, False))
    dense_mask = m.to_acsr().to_dense()
    # the mask is what its definition says at one query: token (4, 4) sees rows 2..4, columns 2..6 step 2
    rows, cols = np.nonzero(dense_mask[4 * 8 + 4].reshape(grid))
    assert sorted(set(rows)) == [2, 3, 4] and sorted(set(cols)) == [2, 4, 6]
    sp, de = _mha(splat.flax.attention_fn(m)), _mha(_dense_fn(dense_mask))
    image = _x(5, (2, *grid, F))  # [B, H, W, F]
    x = image.reshape(2, 48, F)  # the flattened grid Flax attends over
    np.testing.assert_allclose(
        np.asarray(nnx.jit(lambda mod, x: mod(x))(sp, x)), np.asarray(de(x)), rtol=1e-4, atol=1e-5
    )

    def loss(mod, x):
        return (mod(x) ** 2).sum()

    for a, b in zip(
        jax.tree.leaves(nnx.grad(loss)(sp, x)), jax.tree.leaves(nnx.grad(loss)(de, x)), strict=True
    ):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=2e-5)
    # a key padding mask at call time (the last image row absent): AND-ed with the neighborhood
    valid = np.ones((2, 48), bool)
    valid[:, 40:] = False
    out = sp(x, mask=jnp.asarray(valid)[:, None, None, :])
    ref = _mha(_dense_fn(dense_mask[None, None] & valid[:, None, None, :]))(x)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-4, atol=1e-5)
    # the grid itself (unflattened) is not a sequence: the mask names the lengths it needs
    with pytest.raises(ValueError, match=r"grid \(6, 8\) has 48 tokens"):
        sp(image)
