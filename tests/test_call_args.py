"""The call checker shared by @splat.sparse_attention and splat.flax.attention_fn; checks run once a call."""

import contextlib
import sys
import warnings
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import splat
import splat.flax
from jax_bindings import _dispatch
from splat import _analyzer, _attention, _call_args, masks
from splat._call_args import CallChecker, SparseAttentionFallbackWarning

B, S, H, D = 2, 24, 2, 8
I, J = np.arange(S)[:, None], np.arange(S)[None, :]  # noqa: E741


def _qkv(seed, shape=(B, S, H, D)):
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.standard_normal(shape), jnp.float32) for _ in range(3)]


def _ref64(q, k, v, mask, scale=None):
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    s = np.einsum("...qhd,...khd->...hqk", q, k) * (q.shape[-1] ** -0.5 if scale is None else scale)
    s = np.where(mask, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("...hqk,...khd->...qhd", p / p.sum(-1, keepdims=True), v)


def _checker(mask=None, fallback=False):
    return CallChecker("test", mask, "jax", fallback=fallback, dense_name="dense")


def _dense_must_not_run():
    raise AssertionError("the dense function must not run")


# -----------------------------------------------------------------------------
# what the checker honours
# -----------------------------------------------------------------------------


def test_honoured_arguments_match_dense():
    q, k, v = _qkv(0)
    chk = _checker(masks.sliding_window(5))
    static = (I + J) % 3 != 1
    call = dict(mask=static[None, None], is_causal=True, local_window_size=(4, 2), scale=0.3)
    out = chk(q, k, v, call, {}, _dense_must_not_run)
    want = (np.abs(I - J) <= 5) & static & (J <= I) & (I - J <= 4) & (J - I <= 2)
    np.testing.assert_allclose(np.asarray(out), _ref64(q, k, v, want, 0.3), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("batch", [(), (3,), (2, 3)])
def test_any_number_of_batch_axes(batch):
    q, k, v = _qkv(1, batch + (S, H, D))
    out = _checker(masks.causal())(q, k, v, {}, {}, _dense_must_not_run)
    assert out.shape == q.shape
    np.testing.assert_allclose(np.asarray(out), _ref64(q, k, v, J <= I), rtol=1e-4, atol=1e-5)


def test_array_base_mask_and_dtype():
    q, k, v = _qkv(2)
    out = _checker(np.abs(I - J) <= 3)(q, k, v, {"dtype": jnp.bfloat16}, {}, _dense_must_not_run)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(
        np.asarray(out, np.float32), _ref64(q, k, v, np.abs(I - J) <= 3), rtol=3e-2, atol=3e-2
    )


def test_flax_hook_honours_jax_nn_keywords():
    """Keywords beyond flax's own signature (scale, local_window_size) are honoured, not ignored."""
    q, k, v = _qkv(3)
    fn = splat.flax.attention_fn(masks.causal())
    out = fn(q, k, v, scale=0.25, local_window_size=(3, 0))
    want = (J <= I) & (I - J <= 3)
    np.testing.assert_allclose(np.asarray(out), _ref64(q, k, v, want, 0.25), rtol=1e-4, atol=1e-5)


# -----------------------------------------------------------------------------
# errors: each names its argument
# -----------------------------------------------------------------------------

_REFUSED = [
    ({"bias": jnp.zeros((1, 1, S, S))}, "`bias`"),
    ({"dropout_rate": 0.1, "deterministic": False}, "`dropout_rate`"),
    ({"module": object()}, "`module`"),
    ({"return_residual": True}, "`return_residual`"),
    ({"mask": np.stack([I >= J, I <= J])[None]}, "`mask` differs across batch or heads"),
    ({"soft_cap": 30.0}, "`soft_cap`=30.0 is not understood"),
]


@pytest.mark.parametrize("call, match", _REFUSED)
def test_refused_arguments_raise_naming_them(call, match):
    q, k, v = _qkv(4)
    with pytest.raises(ValueError, match=match):
        _checker(masks.causal())(q, k, v, call, {"soft_cap": None}, _dense_must_not_run)


def test_refusals_allow_what_splat_can_do():
    ok = {"dropout_rate": 0.1, "deterministic": True, "implementation": "xla", "soft_cap": None}
    assert _call_args.refusals(ok, {"soft_cap": None}) == []


def test_traced_call_mask_is_refused():
    q, k, v = _qkv(5)
    chk = _checker(masks.causal())
    with pytest.raises(ValueError, match="`mask` is a traced array"):
        jax.jit(lambda m: chk(q, k, v, {"mask": m}, {}, _dense_must_not_run))(jnp.asarray(I >= J))


@pytest.mark.parametrize("jit", [False, True])
def test_decode_step_sits_at_the_last_visible_key(jit):
    """One query against a longer key sequence with a key mask: the static mask's row is that position."""
    q, k, v = _qkv(14)
    q = q[:, :1]
    pos = np.array([5, 17])
    valid = J[0][None] <= pos[:, None]  # [B, S]: Flax's decode mask, arange(S) <= cache index
    valid[1, :3] = False  # and a left-padded row
    chk = _checker(masks.sliding_window(4, 0))
    run = jax.jit(lambda m: chk(q, k, v, {"mask": m}, {}, _dense_must_not_run)) if jit else (
        lambda m: chk(q, k, v, {"mask": m}, {}, _dense_must_not_run))  # fmt: skip
    out = run(jnp.asarray(valid)[:, None, None, :])
    for b in range(B):
        keep = ((pos[b] - J[0] <= 4) & (J[0] <= pos[b]) & valid[b])[None]
        want = _ref64(q[b : b + 1], k[b : b + 1], v[b : b + 1], keep)
        np.testing.assert_allclose(np.asarray(out[b : b + 1]), want, rtol=1e-4, atol=1e-5)
    # key_value_seq_lengths alone places it too (jax.nn's decode convention)
    out = chk(q, k, v, {"key_value_seq_lengths": jnp.asarray(pos + 1)}, {}, _dense_must_not_run)
    for b in range(B):
        keep = ((pos[b] - J[0] <= 4) & (J[0] <= pos[b]))[None]
        want = _ref64(q[b : b + 1], k[b : b + 1], v[b : b + 1], keep)
        np.testing.assert_allclose(np.asarray(out[b : b + 1]), want, rtol=1e-4, atol=1e-5)


def test_lengths_and_key_masks_per_batch_row():
    q, k, v = _qkv(15)
    chk = _checker(masks.causal())
    valid = np.ones((B, S), bool)
    valid[0, 4:9] = False  # a concrete mask that differs across rows: applied at run time
    call = {"mask": valid[:, None, None, :], "query_seq_lengths": np.array([S, 10], np.int32)}
    out = np.asarray(chk(q, k, v, call, {}, _dense_must_not_run))
    for b in range(B):
        want = _ref64(q[b : b + 1], k[b : b + 1], v[b : b + 1], (J <= I) & valid[b][None])[0]
        n = S if b == 0 else 10
        np.testing.assert_allclose(out[b, :n], want[:n], rtol=1e-4, atol=1e-5)
        assert np.abs(out[b, n:]).sum() == 0


@pytest.mark.parametrize(
    "call, match",
    [
        ({"query_seq_lengths": jnp.full((B + 1,), S)}, r"`query_seq_lengths` must have shape \(2,\)"),
        ({"key_value_seq_lengths": jnp.full((B,), 3.0)}, "`key_value_seq_lengths` must be an int array"),
        (
            {"mask": np.ones((3, 1, 1, S), bool) & (np.arange(3) > 0)[:, None, None, None]},
            "does not broadcast to the batch axes",
        ),
        ({"mask": (I >= J).astype(np.int32)}, "`mask` must be a boolean array"),
        ({"mask": np.ones((S, S + 1), bool)}, r"`mask` of shape \(24, 25\) does not broadcast"),
        ({"mask": np.ones(S, bool)}, "`mask` must be broadcastable"),
        ({"local_window_size": "wide"}, "local_window_size must be an int or a"),
        ({"local_window_size": (1, 2, 3)}, "local_window_size must be an int or a"),
        ({"scale": -1.0}, "scale must be a positive finite number"),
    ],
)
def test_malformed_arguments_raise_naming_them(call, match):
    q, k, v = _qkv(6)
    with pytest.raises(ValueError, match=match):
        _checker(masks.causal(), fallback=True)(q, k, v, call, {}, _dense_must_not_run)


def test_traced_is_causal_names_it():
    q, k, v = _qkv(7)
    chk = _checker()
    with pytest.raises(ValueError, match="is_causal must be a static Python bool"):
        jax.jit(lambda c: chk(q, k, v, {"is_causal": c}, {}, _dense_must_not_run))(True)


def test_shapes_name_query_key_value():
    q, k, v = _qkv(8)
    chk = _checker()
    with pytest.raises(ValueError, match="query must be"):
        chk(q[0, 0], k, v, {}, {}, _dense_must_not_run)
    with pytest.raises(ValueError, match="key must be .* batch axes"):
        chk(q, k[:1], v, {}, {}, _dense_must_not_run)
    with pytest.raises(ValueError, match="value must be .* batch axes"):
        chk(q, k, v[None], {}, {}, _dense_must_not_run)
    with pytest.raises(TypeError, match="query, key, value must share one dtype"):
        chk(q, k.astype(jnp.bfloat16), v, {}, {}, _dense_must_not_run)


def test_construction_errors_name_their_argument():
    with pytest.raises(ValueError, match="backend"):
        CallChecker("test", None, "hopper", fallback=False, dense_name="dense")
    with pytest.raises(TypeError, match="mask must be a splat.masks.Mask"):
        CallChecker("test", 3, "jax", fallback=False, dense_name="dense")
    with pytest.raises(ValueError, match="mask must be a boolean array"):
        CallChecker("test", np.ones((S, S)), "jax", fallback=False, dense_name="dense")
    chk = _checker(np.ones((S, S), bool))
    q, k, v = _qkv(9, (B, S + 1, H, D))
    with pytest.raises(ValueError, match="the mask given to test of shape"):
        chk(q, k, v, {}, {}, _dense_must_not_run)


def test_both_front_ends_share_the_messages():
    q, k, v = _qkv(10)
    bias = jnp.zeros((1, 1, S, S))
    dec = splat.sparse_attention(mask=masks.causal())(lambda query, key, value, bias=None: None)
    hook = splat.flax.attention_fn(masks.causal())
    for f, who in ((dec, "splat.sparse_attention"), (hook, "splat.flax.attention_fn")):
        with pytest.raises(ValueError, match=rf"^{who}.*`bias` \(an additive bias\) is not supported"):
            f(q, k, v, bias=bias)


def test_fallback_runs_dense_and_warns_once_per_reason():
    q, k, v = _qkv(11)
    chk = _checker(masks.causal(), fallback=True)
    calls = []
    dense = lambda: calls.append(1) or "dense"  # noqa: E731
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        assert chk(q, k, v, {"bias": 1.0}, {}, dense) == "dense"
        assert chk(q, k, v, {"bias": 1.0}, {}, dense) == "dense"
        assert chk(q, k, v, {"return_residual": True}, {}, dense) == "dense"
    msgs = [str(w.message) for w in rec if issubclass(w.category, SparseAttentionFallbackWarning)]
    assert len(calls) == 3 and len(msgs) == 2
    assert "`bias`" in msgs[0] and "`return_residual`" in msgs[1]


# -----------------------------------------------------------------------------
# validation once per call
# -----------------------------------------------------------------------------

_WATCHED = {
    "refusals": _call_args.refusals,
    "_check_qkv": _attention._check_qkv,
    "_layout": _attention._layout,
    "analyze": _analyzer.analyze,
    "check_backend": _dispatch.check_backend,
}


@contextlib.contextmanager
def _count_calls():
    """Counts calls of the functions in ``_WATCHED`` (by code object, whatever name they are imported as)."""
    codes = {f.__code__: name for name, f in _WATCHED.items()}
    counts: Counter = Counter()

    def profile(frame, event, arg):
        if event == "call" and frame.f_code in codes:
            counts[codes[frame.f_code]] += 1

    old = sys.getprofile()
    sys.setprofile(profile)
    try:
        yield counts
    finally:
        sys.setprofile(old)


def _dense_attn(query, key, value, bias=None, mask=None, *, is_causal=False, scale=None):
    return jax.nn.dot_product_attention(query, key, value, bias, mask, is_causal=is_causal, scale=scale)


@pytest.mark.parametrize("front", ["decorator", "flax"])
def test_one_call_checks_once(front):
    """Each check runs once per call: the call's own, splat.attention's array checks, one analysis.

    Before, a decorated call ran the front end's checks, then ``splat.attention`` checked the
    backend and the mask again (``_layout``), and the dispatcher checked the backend a third time.
    """
    q, k, v = _qkv(12)
    if front == "decorator":
        f = splat.sparse_attention(mask=masks.sliding_window(4))(_dense_attn)
    else:
        f = splat.flax.attention_fn(masks.sliding_window(4))
    f(q, k, v, is_causal=True)  # warm-up: compile
    with _count_calls() as n:
        f(q, k, v, is_causal=True)
    assert n["refusals"] == 1
    assert n["_check_qkv"] == 1  # splat.attention's array and scale checks, run once
    assert n["analyze"] == 1  # the combined mask analysed once (its layout cached by value)
    assert n["_layout"] == 0  # splat.attention's mask checks are not run again
    assert n["check_backend"] <= 1  # checked when decorated; at most the dispatcher's own resolve
    with _count_calls() as n:
        splat.attention(q, k, v, mask=masks.sliding_window(4))
    assert (n["_check_qkv"], n["_layout"], n["analyze"]) == (1, 1, 1)  # the public entry checks all


def test_sparsify_analyses_the_detected_mask_once():
    q, k, v = _qkv(13)

    @splat.sparsify
    def attn(q, k, v):
        i = jnp.arange(q.shape[1])
        return jax.nn.dot_product_attention(q, k, v, mask=(jnp.abs(i[:, None] - i[None, :]) <= 5)[None, None])

    with _count_calls() as n:
        first = attn(q, k, v)
    assert (n["analyze"], n["_check_qkv"], n["_layout"]) == (1, 1, 0)  # analysed at detection only
    with _count_calls() as n:
        attn(q, k, v)
    assert (n["analyze"], n["_check_qkv"], n["_layout"]) == (0, 1, 0)  # the plan's layout is reused
    np.testing.assert_allclose(np.asarray(first), _ref64(q, k, v, np.abs(I - J) <= 5), rtol=1e-4, atol=1e-5)
