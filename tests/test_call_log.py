"""splat.call_log / splat.call_counts: one record per front-end call, also when the call raises."""

import threading
import warnings

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import splat
import splat.flax
from splat import masks

B, S, H, D = 2, 16, 2, 8


def _qkv(seed=0, s=S):
    return jax.random.normal(jax.random.key(seed), (3, B, s, H, D))


def dense(query, key, value, bias=None, mask=None, *, is_causal=False):
    return jax.nn.dot_product_attention(query, key, value, bias, mask, is_causal=is_causal)


def windowed(q, k, v):
    i = jnp.arange(q.shape[1])
    return jax.nn.dot_product_attention(q, k, v, mask=(jnp.abs(i[:, None] - i[None, :]) <= 3)[None, None])


def no_attention(q, k, v):
    return q + k + v


@pytest.fixture(autouse=True)
def _no_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _swallowed(f, *a, **kw):
    """What Keras does: an exception from the attention function is caught and dense attention runs."""
    try:
        return f(*a, **kw)
    except Exception:
        return None


# --- sparse_attention ------------------------------------------------------------------------------------


def test_sparse_attention_outcomes():
    q, k, v = _qkv()
    attn = splat.sparse_attention(mask=masks.sliding_window(3), backend="jax")(dense)
    lenient = splat.sparse_attention(mask=masks.causal(), fallback=True)(dense)
    bias = jnp.zeros((1, 1, S, S))
    with splat.call_log() as log:
        attn(q, k, v, is_causal=True)
        lenient(q, k, v, bias=bias)
        assert _swallowed(attn, q, k, v, bias=bias) is None
    ok, fb, err = log
    assert ok == splat.CallRecord(
        front_end="sparse_attention(dense)",
        outcome="splat",
        q_shape=(B, S, H, D),
        kv_shape=(B, S, H, D),
        mask=repr(masks.sliding_window(3) & masks.causal()),
        decode=False,
        backend="jax",
    )
    assert fb.outcome == "fallback" and "`bias`" in fb.reason and fb.front_end == "sparse_attention(dense)"
    assert fb.q_shape == (B, S, H, D) and fb.backend is None  # backend="auto": not known here
    assert err.outcome == "error" and err.reason.startswith("ValueError: ") and "`bias`" in err.reason


def test_sparse_attention_detection_mode_is_named_after_the_decorator():
    q, k, v = _qkv()
    with splat.call_log() as log:
        splat.sparse_attention(windowed)(q, k, v)
    assert [(r.front_end, r.outcome) for r in log] == [("sparse_attention(windowed)", "splat")]


# --- sparsify --------------------------------------------------------------------------------------------


def test_sparsify_outcomes():
    q, k, v = _qkv()
    with splat.call_log() as log:
        splat.sparsify(windowed)(q, k, v)
        splat.sparsify(no_attention)(q, k, v)
        assert _swallowed(splat.sparsify(no_attention, fallback=False), q, k, v) is None
    ok, fb, err = log
    assert ok.front_end == "sparsify(windowed)" and ok.outcome == "splat" and ok.reason is None
    assert ok.q_shape == (B, S, H, 1, D) and ok.kv_shape == (B, S, H, D)  # as jax.nn reshapes q (GQA)
    assert "SlidingWindow" in ok.mask and ok.decode is False and (ok.replaced, ok.dense) == (1, 0)
    assert (fb.front_end, fb.outcome) == ("sparsify(no_attention)", "fallback")
    assert "no dense attention" in fb.reason and fb.q_shape is None
    assert err.outcome == "error" and "no dense attention" in err.reason


# --- flax ------------------------------------------------------------------------------------------------


def test_flax_outcomes():
    q, k, v = _qkv()
    fn = splat.flax.attention_fn(masks.sliding_window(3))
    lenient = splat.flax.attention_fn(masks.sliding_window(3), fallback=True)
    bias = jnp.zeros((1, 1, S, S))
    with splat.call_log() as log:
        fn(q, k, v)
        lenient(q, k, v, bias=bias)
        assert _swallowed(fn, q, k, v, bias=bias) is None
    assert [(r.front_end, r.outcome) for r in log] == [
        ("flax.attention_fn", "splat"),
        ("flax.attention_fn", "fallback"),
        ("flax.attention_fn", "error"),
    ]
    assert log[0].mask == repr(masks.sliding_window(3)) and log[0].decode is False
    assert "`bias`" in log[1].reason and "`bias`" in log[2].reason


def test_flax_decode_step_is_marked():
    mha = nnx.MultiHeadAttention(
        num_heads=H, in_features=16, decode=True, rngs=nnx.Rngs(0),
        attention_fn=splat.flax.attention_fn(masks.sliding_window(7, 0)),
    )  # fmt: skip
    mha.init_cache((1, S, 16))
    with splat.call_log() as log:
        mha(jnp.ones((1, 1, 16)))
    (rec,) = log
    assert rec.outcome == "splat" and rec.decode is True
    assert rec.q_shape == (1, 1, H, 16 // H) and rec.kv_shape == (1, S, H, 16 // H)


# --- logs and counts -------------------------------------------------------------------------------------


def test_nested_logs_both_receive():
    q, k, v = _qkv()
    attn = splat.sparse_attention(mask=masks.causal())(dense)
    with splat.call_log() as outer:
        attn(q, k, v)
        with splat.call_log() as inner:
            attn(q, k, v)
        attn(q, k, v)
    attn(q, k, v)  # no log open: recorded nowhere
    assert len(outer) == 3 and len(inner) == 1 and inner[0] is outer[1]


def test_counts_and_reset():
    q, k, v = _qkv()
    attn = splat.sparse_attention(mask=masks.causal())(dense)
    splat.call_counts(reset=True)
    attn(q, k, v)
    attn(q, k, v)
    splat.sparsify(no_attention)(q, k, v)
    _swallowed(attn, q, k, v, bias=jnp.zeros((1, 1, S, S)))
    assert splat.call_counts(reset=True) == {"splat": 2, "fallback": 1, "error": 1}
    assert splat.call_counts() == {}


def test_jit_records_traces_not_executions():
    q, k, v = _qkv()
    f = jax.jit(splat.sparse_attention(mask=masks.causal())(dense))
    g = jax.jit(splat.sparsify(windowed))
    with splat.call_log() as log:
        for _ in range(3):
            f(q, k, v)
            g(q, k, v)
        q2, k2, v2 = _qkv(1, s=2 * S)
        f(q2, k2, v2)  # a new shape: a new trace
    assert [r.front_end for r in log] == [
        "sparse_attention(dense)",
        "sparsify(windowed)",
        "sparse_attention(dense)",
    ]
    assert log[2].q_shape == (B, 2 * S, H, D)


def test_threads_keep_their_own_logs():
    q, k, v = _qkv()
    attn = splat.sparse_attention(mask=masks.causal())(dense)
    seen = {}

    def other():
        with splat.call_log() as log:
            attn(q, k, v)
            attn(q, k, v)
        seen["other"] = log

    with splat.call_log() as mine:
        t = threading.Thread(target=other)
        t.start()
        t.join()
    assert mine == [] and len(seen["other"]) == 2


def test_record_is_frozen():
    rec = splat.CallRecord("flax.attention_fn", "splat")
    with pytest.raises(AttributeError):
        rec.outcome = "error"
    assert np.isscalar(hash(rec))
