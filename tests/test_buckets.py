"""splat.bucket_length / splat.pad_to_bucket: one compile per bucket, padding masked by lengths."""

import doctest

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import splat
from splat import masks
from tests.reference import attention_ref


def test_bucket_policy():
    assert [splat.bucket_length(s) for s in (1, 128, 129, 160, 161, 1000, 1025, 4096)] == [
        128, 128, 160, 160, 192, 1024, 1280, 4096,
    ]  # fmt: skip
    assert sorted({splat.bucket_length(s) for s in range(1000, 4097)}) == [
        1024, 1280, 1536, 1792, 2048, 2560, 3072, 3584, 4096,
    ]  # fmt: skip
    for per_octave in (1, 2, 4, 8):
        prev = 0
        for s in range(1, 3000):
            b = splat.bucket_length(s, min_length=16, per_octave=per_octave)
            assert b >= s and b >= prev  # covers s, monotonic
            assert s <= 16 or (b - s) < b / per_octave  # padding under 1 / per_octave
            prev = b


@pytest.mark.parametrize(
    "kw, err, match",
    [
        ({"length": 0}, ValueError, "length must be a positive int"),
        ({"length": 2.5}, TypeError, "length must be an int"),
        ({"length": 10, "min_length": 0}, ValueError, "min_length must be a positive int"),
        ({"length": 10, "per_octave": True}, ValueError, "per_octave must be a positive int"),
    ],
)
def test_bucket_length_errors_name_the_argument(kw, err, match):
    length = kw.pop("length")
    with pytest.raises(err, match=match):
        splat.bucket_length(length, **kw)


def test_pad_to_bucket_arrays():
    tok = np.arange(2 * 37).reshape(2, 37)
    w = jnp.ones((2, 37))
    (tp, wp), n = splat.pad_to_bucket(tok, w, min_length=16, fill=0)
    assert n == 37 and tp.shape == wp.shape == (2, 40)
    assert isinstance(tp, np.ndarray) and isinstance(wp, jax.Array)  # numpy stays numpy
    np.testing.assert_array_equal(tp[:, :37], tok)
    assert (tp[:, 37:] == 0).all() and float(wp[:, 37:].sum()) == 0.0
    with pytest.raises(ValueError, match="share their size along axis 1"):
        splat.pad_to_bucket(tok, tok[:, :5])
    with pytest.raises(ValueError, match="at least one array"):
        splat.pad_to_bucket()
    with pytest.raises(TypeError, match=r"arrays\[0\] must be a numpy or jax array"):
        splat.pad_to_bucket([1, 2, 3])


def test_one_trace_per_bucket_and_padding_changes_nothing():
    """Lengths 33..40 share bucket 40: one trace; every valid row equals the unpadded call."""
    h, d = 2, 8
    mask = masks.causal() & masks.sliding_window(5, 0) | masks.global_tokens(2)
    traces = []

    def loss(q, k, v, lens=None):
        return (splat.attention(q, k, v, mask, query_seq_lengths=lens, key_value_seq_lengths=lens) ** 2).sum()

    @jax.jit
    def step(q, k, v, n):
        traces.append(q.shape)
        lens = jnp.full((q.shape[0],), n, jnp.int32)
        out = splat.attention(q, k, v, mask, query_seq_lengths=lens, key_value_seq_lengths=lens)
        return out, jax.grad(loss)(q, k, v, lens)

    rng = np.random.default_rng(0)
    for s in (33, 36, 40):
        q, k, v = (jnp.asarray(rng.standard_normal((2, s, h, d)), jnp.float32) for _ in range(3))
        (qp, kp, vp), n = splat.pad_to_bucket(q, k, v, min_length=16)
        out, dq = step(qp, kp, vp, n)
        assert out.shape[1] == 40
        want, _ = attention_ref(q, k, v, mask(np.arange(s)[:, None], np.arange(s)[None, :]), d**-0.5)
        np.testing.assert_allclose(np.asarray(out[:, :s]), want, rtol=1e-4, atol=1e-5)
        assert float(jnp.abs(out[:, s:]).sum()) == 0.0  # padded queries output 0
        dq_want = jax.grad(loss)(q, k, v)
        np.testing.assert_allclose(np.asarray(dq[:, :s]), np.asarray(dq_want), rtol=1e-4, atol=1e-5)
        assert float(jnp.abs(dq[:, s:]).sum()) == 0.0  # and get zero gradients
    assert traces == [(2, 40, h, d)]


def test_docstring_examples_run():
    import splat._buckets
    import splat.flax

    for mod in (splat._buckets, splat.flax):
        result = doctest.testmod(mod, optionflags=doctest.ELLIPSIS)
        assert result.failed == 0 and result.attempted > 0, mod.__name__
