"""The README's "Limitations": each listed error is raised (or warned) with the text the README quotes."""

import re
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import splat
from jax_bindings._triton import ops as _codegen
from splat import masks

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()
B, S, H, D = 2, 64, 4, 16


def _qkv(d=D, dtype=jnp.float32):
    q, k, v = jax.random.normal(jax.random.key(0), (3, B, S, H, d), dtype)
    return q, k, v


def _per_head_mask():
    q, k, v = _qkv()
    causal = np.tril(np.ones((S, S), bool))
    per_head = np.stack([np.stack([causal] * H)] * B)  # [B, H, S, S] = (2, 4, 64, 64)
    per_head[:, 1] = np.eye(S, dtype=bool)
    return splat.attention(q, k, v, mask=per_head)


def _decorator_per_head_mask():
    @splat.sparse_attention(mask=masks.causal())
    def attn(query, key, value, bias=None, mask=None):
        return jax.nn.dot_product_attention(query, key, value, bias, mask)

    q, k, v = _qkv()
    m = np.ones((B, H, S, S), bool)
    m[:, 1] = np.eye(S, dtype=bool)
    return attn(q, k, v, mask=m)


def _traced_mask():
    q, k, v = _qkv()

    @jax.jit
    def f(q, k, v, lengths):  # a padding mask: depends on the data
        valid = jnp.arange(S)[None, :] < lengths[0]
        return splat.attention(q, k, v, mask=valid & (jnp.arange(S)[:, None] >= jnp.arange(S)[None, :]))

    return f(q, k, v, jnp.array([40]))


def _sparsify_padding():
    q, k, v = _qkv()

    @splat.sparsify
    def value_mask(q, k, v):  # a mask on positions would be runtime positions; values are not
        m = q[:, :, None, 0, 0] > k[:, None, :, 0, 0]
        return jax.nn.dot_product_attention(q, k, v, mask=m[:, None])

    return value_mask(q, k, v)


def _decorator_bias():
    @splat.sparse_attention(mask=masks.causal())
    def attn(query, key, value, bias=None, mask=None):
        return jax.nn.dot_product_attention(query, key, value, bias, mask)

    q, k, v = _qkv()
    return attn(q, k, v, bias=jnp.zeros((B, H, S, S)))


def _sparsify_soft_cap():
    q, k, v = _qkv()

    @splat.sparsify
    def soft_capped(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / 4
        i = jnp.arange(q.shape[1])
        s = jnp.where((i[:, None] >= i[None, :])[None, None], s, -1e9)  # masked inside the cap
        s = 30.0 * jnp.tanh(s / 30.0)  # Gemma 2's logit soft-cap
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v)

    return soft_capped(q, k, v)


def _triton_head_dim():
    layout = masks.causal().to_acsr(S)
    return _codegen.fwd_call(layout, (1, S, 2, 512), (1, S, 2, 512), "bfloat16", 512**-0.5)


def _float64():
    q, k, v = (np.asarray(x, np.float64) for x in _qkv())
    return splat.attention(q, k, v, mask=masks.causal())


# id -> (trigger, exception or warning class, text quoted in the README and found in the message)
RAISED = {
    "per-batch mask": (_per_head_mask, ValueError, "per-batch masks are not supported"),
    "per-batch mask, shape": (_per_head_mask, ValueError, "mask array has shape (2, 4, 64, 64)"),
    "per-head, decorator": (_decorator_per_head_mask, ValueError, "`mask` differs across batch or heads"),
    "traced mask": (_traced_mask, TypeError, "mask is a traced jax value"),
    "traced mask, advice": (_traced_mask, TypeError, "@splat.sparsify"),
    "bias": (_decorator_bias, ValueError, "`bias` (an additive bias) is not supported by splat"),
    "triton head dim": (
        _triton_head_dim,
        NotImplementedError,
        "head dim D=512 > 256 has no Triton kernel; use backend='jax' for larger heads",
    ),
    "float64": (_float64, TypeError, "query must have dtype float32, bfloat16 or float16, got float64"),
}
WARNED = {
    "data-dependent mask": (
        _sparsify_padding,
        splat.SparsifyWarning,
        "the attention mask depends on the function's inputs through `gt` on bool[2,64,64] values "
        "that vary along both query and key positions",
    ),
    "mask inside the soft cap": (
        _sparsify_soft_cap,
        splat.SparsifyWarning,
        "the `where` mask is applied before the logit soft cap (`tanh`), which maps its fill to -cap",
    ),
}


def _in_readme(text: str) -> bool:
    """The README wraps long quotes across lines: compare with whitespace collapsed."""
    return " ".join(text.split()) in " ".join(README.split())


@pytest.mark.parametrize("name", list(RAISED))
def test_listed_error_is_raised_as_the_readme_says(name):
    trigger, exc, text = RAISED[name]
    assert _in_readme(text), f"README does not quote {text!r}"
    with pytest.raises(exc, match=re.escape(text)):
        trigger()


@pytest.mark.parametrize("name", list(WARNED))
def test_listed_fallback_warns_as_the_readme_says(name):
    trigger, category, text = WARNED[name]
    assert _in_readme(text), f"README does not quote {text!r}"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = trigger()
    assert out.shape == (B, S, H, D)  # the dense original ran
    messages = [str(w.message) for w in caught if issubclass(w.category, category)]
    assert any(text in m for m in messages), messages


def test_q_offset_is_exact_and_chunked_prefill_named_as_pure_jax_only():
    """Decode through q_offset gives the full sequence's row; the README says where it runs."""
    assert _in_readme("Masks with a block-sparse residual or a grid layout are refused by the GPU kernels")
    q, k, v = _qkv()
    P = S - 1
    out = splat.attention(q[:, -1:], k, v, mask=masks.causal(), q_offset=P)
    full = splat.attention(q, k, v, mask=masks.causal())
    np.testing.assert_allclose(out[:, 0], full[:, -1], rtol=1e-5, atol=1e-5)


def test_neighbourhood_masks_are_grids_and_only_register_tokens_leave_them():
    w, r = 16, 3  # 7 x 7 windows on a 16 x 16 image, flattened

    def near(a, b):
        return (np.abs(a // w - b // w) <= r) & (np.abs(a % w - b % w) <= r)

    nb = masks.from_fn(near)
    rep = splat.report(nb, q_len=w * w)
    assert "grid product 16x16 (per-axis windows, found in function)" in rep.family
    assert _in_readme("shows `grid product 16x16 (per-axis windows, found in function)`")
    layout = splat.analyze(nb, w * w)
    assert layout.grid is not None and layout.flat.residual is not None  # the pure backend's rows
    from jax_bindings._triton import ops

    shape = (1, w * w, 2, 16)
    with pytest.raises(NotImplementedError, match="the triton grid kernels take no runtime mask"):
        ops.fwd_call(layout, shape, shape, "float32", 0.25, interpret=True, runtime="ranges")
    assert _in_readme("refuse with `the triton grid kernels take no runtime mask`")
    rep = splat.report(lambda a, b: near(a, b) | (a < 2) | (b < 2), q_len=w * w)  # register tokens
    assert "irregular (block-sparse residual)" in rep.family and rep.residual_blocks > 0
    assert _in_readme("shows `irregular (block-sparse residual)`")
