"""splat.sparsify on attention written the way the gemma library writes it.

Grouped KV heads as 5-D einsums with reshapes of the scores, a tanh soft cap, ``jnp.where`` with
a large finite fill, and masks that AND a static index comparison with an input-dependent
padding or segment-id term. Each function here is our own, in that style; outputs and gradients
are checked against a float64 dense reference and against the unmodified function.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import splat
from splat._sparsify import SparsifyWarning, sparsify

B, T, H, HK, D = 2, 40, 4, 2, 16
CAP = 30.0
FILL = -2.3819763e38  # a finite fill near -float32.max, as gemma uses
WIN = 6


def _inputs(seed, t=T):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((B, t, H, D)) * 2, jnp.float32)
    k = jnp.asarray(rng.standard_normal((B, t, HK, D)) * 2, jnp.float32)
    v = jnp.asarray(rng.standard_normal((B, t, HK, D)), jnp.float32)
    return q, k, v


def _gqa_logits(q, k, scale):
    """Gemma's layout: queries [B, T, K, G, H] against keys [B, S, K, H], scores [B, T, K*G, S]."""
    b, t, n, h = q.shape
    kh = k.shape[2]
    qs = (q * scale).reshape(b, t, kh, n // kh, h)
    s = jnp.einsum("BTKGH,BSKH->BTKGS", qs, k)
    return s.reshape(b, t, n, k.shape[1])


def _gqa_out(probs, v):
    b, t, n, s = probs.shape
    kh = v.shape[2]
    p = probs.reshape(b, t, kh, n // kh, s)
    return jnp.einsum("BTKGS,BSKH->BTKGH", p, v).reshape(b, t, n, v.shape[-1])


def _causal(t, window=None):
    i = jnp.arange(t)
    m = i[:, None] >= i[None, :]
    if window is not None:
        m = m & (i[:, None] - i[None, :] < window)
    return m


def gemma_padded(q, k, v, lengths):
    """GQA, soft cap, causal AND a key padding mask built from an input ([B, 1, S])."""
    logits = _gqa_logits(q, k, D**-0.5)
    logits = jnp.tanh(logits / CAP) * CAP
    valid = jnp.arange(k.shape[1])[None, :] < lengths[:, None]  # [B, S]
    mask = valid[:, None, :] & _causal(q.shape[1])[None]  # [B, T, S]
    logits = jnp.where(mask[:, :, None, :], logits, FILL)
    return _gqa_out(jax.nn.softmax(logits, axis=-1), v)


def gemma_segments(q, k, v, seg):
    """GQA, sliding window AND equality of segment ids (packed documents)."""
    logits = _gqa_logits(q, k, 0.2)
    same = seg[:, :, None] == seg[:, None, :]  # [B, T, S]
    mask = same & _causal(q.shape[1], WIN)[None]
    logits = jnp.where(mask[:, :, None, :], logits, FILL)
    return _gqa_out(jax.nn.softmax(logits, axis=-1), v)


def mha_capped_padding(q, k, v, valid):
    """4-D einsums (one kv head per query head), cap with its own divisor, padding given as [B, S]."""
    k, v = jnp.repeat(k, H // HK, axis=2), jnp.repeat(v, H // HK, axis=2)
    logits = jnp.einsum("BTNH,BSNH->BTNS", q * 0.25, k)
    logits = jnp.tanh(logits / 20.0) * 50.0  # cap 50, inner scale 0.25 / 20
    mask = _causal(q.shape[1], WIN)[None, :, None, :] & valid[:, None, None, :]
    logits = jnp.where(mask, logits, -0.7 * float(jnp.finfo(jnp.float32).max))
    return jnp.einsum("BTNS,BSNH->BTNH", jax.nn.softmax(logits, axis=-1), v)


def _ref64(q, k, v, mask, scale, cap=None, inner=None):
    """Dense attention in float64: mask [B, T, S]; logits cap * tanh(inner * q.k) when capped."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    g = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", q, k)
    s = cap * np.tanh(s * inner) if cap is not None else s * scale
    s = np.where(mask[:, None], s, -np.inf)
    e = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("bhqk,bkhd->bqhd", e / e.sum(-1, keepdims=True), v)


def _check(fn, args, want_mask, want_runtime, ref, soft_cap=None):
    sf = sparsify(fn, backend="jax")
    assert sf.problems(*args) == []
    (found,) = sf.inspect(*args)
    assert found.mask == want_mask
    assert found.runtime == want_runtime
    assert found.heads == (HK, H // HK) or found.heads == (H, 1)
    if soft_cap is not None:
        assert found.soft_cap == pytest.approx(soft_cap)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a detected attention must not warn
        out = jax.jit(sf)(*args)
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-4, atol=2e-5)
    np.testing.assert_allclose(np.asarray(out), np.asarray(fn(*args)), rtol=1e-4, atol=2e-5)
    w = jnp.asarray(np.random.default_rng(1).standard_normal(out.shape), jnp.float32)
    ga = jax.grad(lambda *a: (sf(*a) * w).sum(), argnums=(0, 1, 2))(*args)
    gb = jax.grad(lambda *a: (fn(*a) * w).sum(), argnums=(0, 1, 2))(*args)
    for x, y in zip(ga, gb, strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=2e-4, atol=2e-5)
    return sf


def test_gqa_soft_cap_causal_and_input_padding():
    q, k, v = _inputs(0)
    lengths = jnp.asarray([T, 29], jnp.int32)
    i = np.arange(T)
    mask = (i[None, None, :] < np.asarray(lengths)[:, None, None]) & (i[:, None] >= i[None, :])[None]
    ref = _ref64(q, k, v, mask, None, cap=CAP, inner=D**-0.5 / CAP)
    _check(gemma_padded, (q, k, v, lengths), splat.masks.causal(), ("kv_padding",), ref, soft_cap=CAP)


def test_gqa_window_and_segment_ids():
    q, k, v = _inputs(2)
    seg = jnp.asarray([[0] * 13 + [1] * 20 + [2] * 7, [5] * 40], jnp.int32)
    i = np.arange(T)
    s = np.asarray(seg)
    mask = (s[:, :, None] == s[:, None, :]) & ((i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < WIN))
    ref = _ref64(q, k, v, mask, 0.2)
    _check(gemma_segments, (q, k, v, seg), splat.masks.sliding_window(WIN - 1, 0), ("segment_ids",), ref)


@pytest.mark.parametrize("concrete", [False, True], ids=["traced", "concrete"])
def test_mha_cap_with_own_divisor_and_bool_padding(concrete):
    """A [B, S] bool argument: traced it is an input; concrete it is a constant varying over B."""
    q, k, v = _inputs(3)
    valid_np = np.arange(T)[None, :] < np.asarray([[37], [T]])  # every row keeps a key
    valid = valid_np if concrete else jnp.asarray(valid_np)
    i = np.arange(T)
    mask = valid_np[:, None, :] & ((i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < WIN))[None]
    ref = _ref64(q, k, v, mask, None, cap=50.0, inner=0.25 / 20.0)
    sf = _check(
        mha_capped_padding,
        (q, k, v, valid),
        splat.masks.sliding_window(WIN - 1, 0),
        ("kv_padding",),
        ref,
        soft_cap=50.0,
    )
    # splat's scale is that of q.k inside cap * tanh(scale * q.k / cap); the 0.25 scales q itself
    assert sf.inspect(q, k, v, valid)[0].scale == pytest.approx(50.0 / 20.0)


def test_rows_emptied_at_run_time_give_zero():
    """Documented difference: a row whose window holds only padding outputs 0 (dense: mean(V))."""
    q, k, v = _inputs(6)
    valid = jnp.asarray(np.arange(T)[None, :] < np.asarray([[33], [T]]))  # rows 38, 39 of b=0 see no key
    out = np.asarray(jax.jit(sparsify(mha_capped_padding, backend="jax"))(q, k, v, valid))
    dense = np.asarray(mha_capped_padding(q, k, v, valid))
    np.testing.assert_array_equal(out[0, 38:], 0.0)
    np.testing.assert_allclose(
        dense[0, 38:], np.broadcast_to(np.asarray(v).mean(1)[0].repeat(2, 0), (2, H, D)), rtol=1e-5, atol=1e-6
    )
    np.testing.assert_allclose(out[:, :38], dense[:, :38], rtol=1e-4, atol=2e-5)
    np.testing.assert_allclose(out[1], dense[1], rtol=1e-4, atol=2e-5)


# --- what stays dense says why (problems() names the reason and the operation) ----------------


def mask_inside_cap(q, k, v):
    logits = jnp.where(_causal(q.shape[1])[None, None], jnp.einsum("bqhd,bkhd->bhqk", q, k), FILL)
    logits = jnp.tanh(logits / CAP) * CAP
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, -1), v)


def clipped_logits(q, k, v):
    logits = jnp.clip(jnp.einsum("bqhd,bkhd->bhqk", q, k), -5.0, 5.0)
    logits = jnp.where(_causal(q.shape[1])[None, None], logits, FILL)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, -1), v)


def head_mask(q, k, v, valid):
    """A padding mask that differs per head: not a runtime argument splat has."""
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k)
    logits = jnp.where(_causal(q.shape[1])[None, None] & valid[:, :, None, :], logits, FILL)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, -1), v)


def _full_heads(q, k, v):
    return q, jnp.repeat(k, H // HK, axis=2), jnp.repeat(v, H // HK, axis=2)


FALLBACKS = [
    (mask_inside_cap, _full_heads, "before the logit soft cap (`tanh`)"),
    (clipped_logits, _full_heads, "logits pass through `min`"),
    (
        head_mask,
        lambda *a: (*_full_heads(*a), jnp.asarray(np.arange(T) < np.arange(20, 20 + H)[:, None])[None]),
        "across heads",
    ),
]


@pytest.mark.parametrize("fn,args,reason", FALLBACKS, ids=[f[0].__name__ for f in FALLBACKS])
def test_unsupported_attention_names_the_reason(fn, args, reason):
    a = args(*_inputs(5))
    sf = sparsify(fn)
    problems = sf.problems(*a)
    assert len(problems) == 1 and reason in problems[0], problems
    assert sf.inspect(*a) == []
    with pytest.warns(SparsifyWarning, match="running the original dense function"):
        out = sf(*a)
    np.testing.assert_allclose(np.asarray(out), np.asarray(fn(*a)), rtol=1e-6)


def test_padding_ids_sit_above_every_id_so_right_padding_stays_sorted():
    """Sorted ids are the kernels' fast case: right padding (ids then padding) must keep them sorted,
    and padded queries and keys must match nothing."""
    from splat._sparsify import runtime as rt_ops

    valid = jnp.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], bool)
    seg = jnp.array([[0, 0, 4, 4, 4], [0, 1, 1, 2, 2]], jnp.int32)
    sizes = {"b": 2, "t": 5, "s": 5}
    alone = rt_ops.Runtime(kv_valid=((0, ("b", "s"), False),))
    both = rt_ops.Runtime(kv_valid=((0, ("b", "s"), False),), q_valid=((1, ("b", "t"), False),),
                          ids=((2, ("b", "t")), (3, ("b", "s"))))
    for rt, vals in ((alone, [valid]), (both, [valid, valid, seg, seg])):
        q, kv = (np.asarray(x) for x in rt_ops.segment_arrays(rt, vals, ["b"], "t", "s", sizes))
        assert (np.diff(q, axis=1) >= 0).all() and (np.diff(kv, axis=1) >= 0).all(), (q, kv)
        sees = q[:, :, None] == kv[:, None, :]
        ok, ids = np.asarray(valid), np.asarray(seg)
        same = ok[:, :, None] & (ids[:, :, None] == ids[:, None, :])
        want = ok[:, None, :] & (True if rt.ids is None else same)
        assert np.array_equal(sees, np.broadcast_to(want, sees.shape)), (q, kv)
