"""splat.sparsify on attention written the way Keras, keras-hub, penzai and flash-style code write it.

Each function here is our own minimal plain-JAX reproduction of a library's style (no library is
imported): Keras's ``Softmax(mask)`` masks the probabilities again after the softmax; keras-hub
builds its causal mask from a float ``arange`` and combines 0/1 ``int32`` masks with ``minimum``;
penzai's named axes are nested ``vmap``s, so the row max is taken on the scores as laid out and
subtracted from a transposed copy; reference code divides ``exp(s - max) @ V`` by the row sum
after the product; ``jax.nn.softmax(where=)`` masks the logits twice and sums masked
exponentials; layers run under ``jax.checkpoint`` and in a ``lax.scan`` over stacked weights.
Every substituted attention is checked against the unmodified function
(float32, error <= 1e-5, gradients too); what must not match falls back and says why.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import splat
from splat import masks
from splat._sparsify import SparsifyWarning, sparsify

B, S, H, D = 2, 24, 2, 8
TOL = {"rtol": 1e-5, "atol": 1e-5}


def _qkv(rng, s=S):
    return [jnp.asarray(rng.standard_normal((B, s, H, D)), jnp.float32) for _ in range(3)]


def _substituted(fn, *args, argnums=(0, 1, 2)):
    """The one Found attention of ``fn``; its output and gradients equal ``fn``'s."""
    sf = sparsify(fn)
    found = sf.inspect(*args)
    assert len(found) == 1 and sf.problems(*args) == [], sf.problems(*args)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a substituted attention does not warn
        out = jax.jit(sf)(*args)
    want = fn(*args)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), **TOL)
    w = jnp.asarray(np.random.default_rng(1).standard_normal(want.shape), jnp.float32)
    ga = jax.grad(lambda *a: (sf(*a) * w).sum(), argnums=argnums)(*args)
    gb = jax.grad(lambda *a: (fn(*a) * w).sum(), argnums=argnums)(*args)
    for x, y in zip(ga, gb, strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), **TOL)
    return found[0]


def _falls_back(fn, args, reason=None):
    """``fn`` stays dense (with ``reason`` among the problems when given) and is unchanged."""
    sf = sparsify(fn)
    assert sf.inspect(*args) == []
    problems = sf.problems(*args)
    if reason is not None:
        assert len(problems) == 1 and reason in problems[0], problems
    with pytest.warns(SparsifyWarning):
        out = sf(*args)
    np.testing.assert_allclose(np.asarray(out), np.asarray(fn(*args)), rtol=1e-6)
    return problems


def _grid(q_len, kv_len=None, xp=np):
    """Query and key indices ``[q_len, 1]``, ``[1, kv_len]`` (``xp=jnp`` inside traced code)."""
    return xp.arange(q_len)[:, None], xp.arange(q_len if kv_len is None else kv_len)[None, :]


# --- Keras: Softmax(mask) masks the probabilities again after the softmax -------------------


def keras_softmax(scores, mask, post="mul"):
    """``keras.layers.Softmax(mask)``: an integer mask is read as ``> 0.5``, masked logits get
    -1e9, and the output is masked again (``mul`` as Keras 3 writes it, or ``where``)."""
    if mask.dtype != jnp.bool_:
        mask = jnp.greater(mask, jnp.asarray(0.5).astype(mask.dtype))
    out = jax.nn.softmax(jnp.where(mask, scores, -1e9), axis=-1)
    return out * mask.astype(out.dtype) if post == "mul" else jnp.where(mask, out, 0.0)


def keras_mha(q, k, v, attention_mask, post="mul"):
    """``keras.layers.MultiHeadAttention`` on [B, S, H, D] projections; mask [B, T, S]."""
    q = q * (1.0 / np.sqrt(q.shape[-1]))
    scores = jnp.einsum("aecd,abcd->acbe", k, q)  # key first, as Keras's equation
    probs = keras_softmax(scores, attention_mask[:, None], post)  # _masked_softmax: heads axis
    return jnp.einsum("acbe,aecd->abcd", probs, v)


def compute_causal_mask(batch_size, input_length, output_length, cache_index=0):
    """keras-hub's causal mask: positions from a float32 arange."""
    i = jnp.arange(output_length, dtype="float32") + jnp.asarray(cache_index, "float32")
    j = jnp.arange(input_length, dtype="float32")
    mask = jnp.expand_dims(i[:, None] >= j, axis=0)
    return jnp.broadcast_to(mask, (batch_size, output_length, input_length))


def merge_padding_and_attention_mask(padding_mask, attention_mask):
    """keras-hub: masks combined as 0/1 int32 with ``minimum``."""
    mask = None if padding_mask is None else jnp.expand_dims(padding_mask, axis=1).astype("int32")
    if attention_mask is not None:
        attention_mask = attention_mask.astype("int32")
        return attention_mask if mask is None else jnp.minimum(mask, attention_mask)
    return mask


def keras_hub_decoder(q, k, v, padding_mask, post="mul"):
    """keras-hub's TransformerDecoder self-attention mask, then Keras's MultiHeadAttention."""
    mask = merge_padding_and_attention_mask(padding_mask, None)
    causal = compute_causal_mask(q.shape[0], k.shape[1], q.shape[1])
    return keras_mha(q, k, v, jnp.minimum(mask, causal), post)


@pytest.mark.parametrize("post", ["mul", "where"])
def test_keras_softmax_masks_again_after_the_softmax(rng, post):
    q, k, v = _qkv(rng)
    found = _substituted(lambda q, k, v: keras_mha(q, k, v, compute_causal_mask(B, S, S), post), q, k, v)
    assert found.mask == masks.causal()

    def strict(q, k, v):  # query 0 sees no key: 0 in this form as in splat, so no fallback
        i, j = _grid(S, xp=jnp)
        return keras_mha(q, k, v, jnp.broadcast_to(j < i, (B, S, S)), post)

    assert _substituted(strict, q, k, v).mask(*_grid(S))[0].sum() == 0
    np.testing.assert_array_equal(np.asarray(strict(q, k, v))[:, 0], 0.0)


@pytest.mark.parametrize("dtype", ["int32", "bool"])
@pytest.mark.parametrize("side", ["right", "left"])
def test_keras_hub_decoder_with_padding(rng, side, dtype):
    """An integer padding input of unknown values is read as ``mask > 0``; left padding leaves
    query rows with no key, which the second masking zeroes in the dense function too."""
    q, k, v = _qkv(rng)
    i = np.arange(S)[None, :]
    valid = i < np.array([[S], [17]]) if side == "right" else i >= np.array([[0], [5]])
    pad = jnp.asarray(valid, dtype)
    for post in ("mul", "where"):
        found = _substituted(functools.partial(keras_hub_decoder, post=post), q, k, v, pad)
        assert found.mask == masks.causal() and found.runtime == ("kv_padding",)
    if side == "left":
        np.testing.assert_array_equal(np.asarray(keras_hub_decoder(q, k, v, pad))[1, :5], 0.0)


def test_mask_after_the_softmax_must_be_the_one_before(rng):
    q, k, v = _qkv(rng)

    def different(q, k, v):
        i, j = _grid(S, xp=jnp)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k)
        probs = jax.nn.softmax(jnp.where(j <= i, scores, -1e9), axis=-1)
        return jnp.einsum("bhqk,bkhd->bqhd", jnp.where(i - j < 4, probs, 0.0), v)

    def after_only(q, k, v):
        i, j = _grid(S, xp=jnp)
        probs = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k), axis=-1)
        return jnp.einsum("bhqk,bkhd->bqhd", probs * (j <= i).astype(probs.dtype), v)

    def rebuilt(q, k, v):  # the same constant, built twice
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k)
        probs = jax.nn.softmax(jnp.where(jnp.tril(jnp.ones((S, S), bool)), scores, -1e9), axis=-1)
        return jnp.einsum("bhqk,bkhd->bqhd", jnp.where(jnp.arange(S)[:, None] >= jnp.arange(S), probs, 0), v)

    _falls_back(different, (q, k, v), "masked after the softmax with a different mask")
    _falls_back(after_only, (q, k, v), "masked only after the softmax")
    assert _substituted(rebuilt, q, k, v).mask == masks.causal()


# --- penzai: named axes are nested vmaps --------------------------------------------------


class Named:
    """A penzai-style named array: ``data`` with a name per axis (None: positional, in ``pos``)."""

    def __init__(self, data, names, pos=()):
        self.data, self.names, self.pos = data, tuple(names), tuple(pos)

    def untag(self, *names):
        return Named(
            self.data, [None if n in names else n for n in self.names], [self.names.index(n) for n in names]
        )

    def tag(self, *names):
        out = list(self.names)
        for n, a in zip(names, self.pos, strict=True):
            out[a] = n
        return Named(self.data, out)


def nmap(fun):
    """penzai's ``nmap``: one ``vmap`` per axis name, over that name's data axis in each argument
    (names in order of first appearance); positional axes last in the result."""

    def wrapped(*args, **kwargs):
        named = [a for a in args if isinstance(a, Named)]
        order = list(dict.fromkeys(n for a in named for n in a.names if n is not None))

        def step(views, remaining):
            if not remaining:
                it = iter(views)
                real = []
                for a in args:
                    if isinstance(a, Named):
                        data, _, pos = next(it)
                        real.append(jnp.transpose(data, pos) if pos else data)
                    else:
                        real.append(a)
                return fun(*real, **kwargs)
            name, axes, inner = remaining[0], [], []
            for _data, names, pos in views:
                if name in names:
                    a = names.index(name)
                    axes.append(a)
                    inner.append((names[:a] + names[a + 1 :], tuple(p - (p > a) for p in pos)))
                else:
                    axes.append(None)
                    inner.append((names, pos))
            return jax.vmap(
                lambda datas: step([(d, *m) for d, m in zip(datas, inner, strict=True)], remaining[1:]),
                in_axes=(axes,),
            )([v[0] for v in views])

        out = step([(a.data, a.names, a.pos) for a in named], order)
        npos = out.ndim - len(order)
        return Named(out, order + [None] * npos, range(len(order), out.ndim))

    return wrapped


def penzai_attention(q, k, v, window=None, softmax_axis="kv_seq"):
    """penzai's Attention: NamedEinsum logits, ApplyCausal(SlidingWindow)AttentionMask with
    ``nmap(jnp.where)``, ``Softmax("kv_seq")`` as ``nmap(jax.nn.softmax)`` on the untagged axis."""
    q = Named(q, ["batch", "seq", "heads", "proj"])
    k = Named(k, ["batch", "kv_seq", "heads", "proj"])
    v = Named(v, ["batch", "kv_seq", "heads", "proj"])
    logits = nmap(jnp.dot)(q.untag("proj"), k.untag("proj"))
    logits = nmap(lambda x: x / np.sqrt(D))(logits)
    qpos, kpos = Named(jnp.arange(S), ["seq"]), Named(jnp.arange(S), ["kv_seq"])
    if window is None:
        mask = nmap(lambda a, b: (a >= b) & (b >= 0))(qpos, kpos)
    else:
        mask = nmap(lambda a, b: (a >= b) & (a - b < window) & (b >= 0))(qpos, kpos)
    logits = nmap(jnp.where)(mask, logits, -2.3819763e38)
    probs = nmap(functools.partial(jax.nn.softmax, axis=0))(logits.untag(softmax_axis)).tag(softmax_axis)
    out = nmap(jnp.dot)(probs.untag("kv_seq"), v.untag("kv_seq"))
    return jnp.transpose(out.data, [out.names.index(n) for n in ("batch", "seq", "heads", "proj")])


@pytest.mark.parametrize("window", [None, 6])
def test_penzai_named_axis_attention(rng, window):
    found = _substituted(functools.partial(penzai_attention, window=window), *_qkv(rng))
    assert found.mask == (masks.causal() if window is None else masks.sliding_window(window - 1, 0))
    assert found.scale == pytest.approx(1 / np.sqrt(D))


def _shifted(max_axis, sum_axis):
    def fn(q, k, v):
        i, j = _grid(S, xp=jnp)
        s = jnp.where(j <= i, jnp.einsum("bqhd,bkhd->bhqk", q, k), -1e9)
        e = jnp.exp(s - jnp.max(s, axis=max_axis, keepdims=True))
        return jnp.einsum("bhqk,bkhd->bqhd", e / jnp.sum(e, axis=sum_axis, keepdims=True), v)

    return fn


def flattened_rows(q, k, v):
    """Row statistics on views: the max of the scores flattened to [B*H*T, S] (reshaped back),
    the sum of a transposed copy of the exponentials."""
    i, j = _grid(S, xp=jnp)
    s = jnp.where(j <= i, jnp.einsum("bqhd,bkhd->bhqk", q, k), -1e9)
    m = jnp.max(s.reshape(-1, S), axis=-1).reshape(B, H, S, 1)
    e = jnp.exp(s - m)
    z = jnp.sum(e.transpose(3, 0, 2, 1), axis=0).transpose(0, 2, 1)[..., None]
    return jnp.einsum("bhqk,bkhd->bqhd", e / z, v)


def test_row_reductions_through_views(rng):
    assert _substituted(flattened_rows, *_qkv(rng)).mask == masks.causal()


def test_row_reductions_must_be_over_the_key_axis(rng):
    """A max or sum over the query axis is not a softmax over keys: nothing is substituted."""
    q, k, v = _qkv(rng)
    assert _substituted(_shifted(-1, -1), q, k, v).mask == masks.causal()
    for fn in (_shifted(-2, -1), _shifted(-1, -2), functools.partial(penzai_attention, softmax_axis="seq")):
        assert sparsify(fn).inspect(q, k, v) == []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SparsifyWarning)
            np.testing.assert_allclose(np.asarray(sparsify(fn)(q, k, v)), np.asarray(fn(q, k, v)), rtol=1e-6)


# --- integer mask algebra ------------------------------------------------------------------


def _as(b, dtype=jnp.int32):
    return b.astype(dtype)


INT_MASKS = {  # name: (mask of (i, j), constructor type)
    "min_and": (lambda i, j: jnp.minimum(_as(j <= i), _as(i - j < 8)) != 0, "SlidingWindow"),
    "mul_and": (lambda i, j: (_as(j <= i) * _as(j < 5)) > 0, "Intersection"),
    "max_or": (
        lambda i, j: jnp.maximum(jnp.minimum(_as(j <= i), _as(i - j < 8)), _as(j < 4)).astype(bool),
        "Union",
    ),
    "add_or": (lambda i, j: (_as(j <= i, jnp.float32) + _as(j < 4, jnp.float32)) > 0, "Union"),
    "one_minus_not": (lambda i, j: jax.lax.convert_element_type(1 - _as(j > i), jnp.bool_), "Causal"),
    "min_three": (
        lambda i, j: jnp.minimum(jnp.minimum(_as(j <= i), _as(i - j < 9)), _as(i - j != 3)) > 0,
        None,
    ),
    # not 0/1: evaluated as written, never assumed to be AND / OR
    "min_two_three": (lambda i, j: jnp.minimum(2 * _as(j <= i), 3 * _as(j < 6)) > 1, "Intersection"),
    "min_two_one": (
        lambda i, j: jnp.maximum(jnp.minimum(2 * _as(j <= i), _as(j < 6)), _as(i == j)) > 1,
        None,
    ),
    "xor": (lambda i, j: (_as(j <= i) + _as(j < 4)) == 1, "FromFn"),
}


def _attn_with(pat):
    def fn(q, k, v):
        i, j = jnp.arange(q.shape[1])[:, None], jnp.arange(k.shape[1])[None, :]
        return jax.nn.dot_product_attention(q, k, v, mask=pat(i, j)[None, None])

    return fn


@pytest.mark.parametrize("name", list(INT_MASKS))
def test_integer_mask_algebra_is_exact(name):
    pat, kind = INT_MASKS[name]
    n = 64
    i, j = _grid(n)
    want = np.broadcast_to(np.asarray(pat(jnp.asarray(i), jnp.asarray(j))), (n, n))
    x = jnp.zeros((1, n, 1, 4), jnp.float32)
    sf = sparsify(_attn_with(pat), empty_rows="zero")
    found = sf.inspect(x, x, x)
    assert len(found) == 1, sf.problems(x, x, x)
    np.testing.assert_array_equal(splat.analyze(found[0].mask, n, n).to_dense(), want)
    if kind is not None:
        assert type(found[0].mask).__name__ == kind, found[0].mask


def test_integer_padding_of_unknown_values_is_not_misread(rng):
    """``minimum(pad, causal) != 0`` equals ``pad != 0 and causal`` only for pad >= 0, which an
    int32 input does not promise: refused. ``> 0`` (Keras's own test) is exact for any values."""
    q, k, v = _qkv(rng)
    pad = jnp.asarray(np.where(np.arange(S) < 20, 1, np.where(np.arange(S) % 2, 0, -1))[None].repeat(B, 0))

    def cast_to_bool(q, k, v, pad):
        i, j = _grid(S, xp=jnp)
        mask = jnp.minimum(pad[:, None, :], jnp.asarray(j <= i).astype(jnp.int32)).astype(bool)
        return jax.nn.dot_product_attention(q, k, v, mask=mask[:, None])

    _falls_back(cast_to_bool, (q, k, v, pad), "depends on the function's inputs through `min`")
    found = _substituted(keras_hub_decoder, q, k, v, pad)
    assert found.runtime == ("kv_padding",)


# --- float index arrays ---------------------------------------------------------------------


def _keras_hub_masked(mask_fn):
    def fn(q, k, v):
        return keras_mha(q, k, v, mask_fn(q.shape[1]))

    return fn


def test_float_arange_masks_are_the_int_masks(rng):
    q, k, v = _qkv(rng)

    def window(dtype):
        def mask(n):
            i, j = jnp.arange(n, dtype=dtype)[:, None], jnp.arange(n, dtype=dtype)[None, :]
            return jnp.broadcast_to((j <= i) & (i - j < 6), (B, n, n))

        return mask

    float_causal = _substituted(_keras_hub_masked(lambda n: compute_causal_mask(B, n, n)), q, k, v).mask
    int_causal = _substituted(
        _keras_hub_masked(lambda n: jnp.broadcast_to(jnp.tri(n, dtype=bool), (B, n, n))), q, k, v
    )
    assert float_causal == int_causal.mask == masks.causal()
    assert splat.report(float_causal, S).family == splat.report(int_causal.mask, S).family
    float_window = _substituted(_keras_hub_masked(window(jnp.float32)), q, k, v).mask
    assert float_window == _substituted(_keras_hub_masked(window(jnp.int32)), q, k, v).mask
    assert float_window == masks.sliding_window(5, 0)


def test_float_indices_past_exact_integers_stay_exact():
    """bfloat16 holds integers exactly only up to 256: beyond, the mask is evaluated as written."""
    n = 320
    x = jnp.zeros((1, n, 1, 4), jnp.float32)

    def fn(q, k, v):
        i, j = jnp.arange(n, dtype=jnp.bfloat16)[:, None], jnp.arange(n, dtype=jnp.bfloat16)[None, :]
        return jax.nn.dot_product_attention(q, k, v, mask=(j <= i)[None, None])

    (found,) = sparsify(fn).inspect(x, x, x)
    i, j = jnp.arange(n, dtype=jnp.bfloat16)[:, None], jnp.arange(n, dtype=jnp.bfloat16)[None, :]
    want = np.asarray(j <= i)
    assert not np.array_equal(want, np.tril(np.ones((n, n), bool)))  # rounding merged some positions
    np.testing.assert_array_equal(splat.analyze(found.mask, n, n).to_dense(), want)


# --- constant masks are not reported as input-dependent ----------------------------------


def _attn(q, k, v, mask):
    s = jnp.where(mask, jnp.einsum("bqhd,bkhd->bhqk", q, k), -1e9)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v)


def _causal():
    i = jnp.arange(S)
    return i[:, None] >= i[None, :]


def via_custom_jvp(q, k, v):  # jax.nn.relu is a custom_jvp function: several results in the jaxpr
    i = jnp.arange(S)
    return _attn(q, k, v, jax.nn.relu(i[:, None] - i[None, :] + 1) > 0)


def via_sort(q, k, v):  # argsort sorts two operands together
    i = jnp.argsort(-jnp.arange(S))[::-1]
    return _attn(q, k, v, i[:, None] >= i[None, :])


def test_constant_masks_are_not_reported_as_input_dependent(rng):
    """A constant through a multiple-result primitive, or built by an enclosing jit (closed over
    or passed in): all substituted, no "depends on the function's inputs"."""
    q, k, v = _qkv(rng)
    for fn in (via_custom_jvp, via_sort):
        assert _substituted(fn, q, k, v).mask(*_grid(S)).sum() == S * (S + 1) // 2

    @jax.jit
    def model(q, k, v):  # the mask is built by the model, outside the sparsified function
        mask = _causal()
        closed = sparsify(lambda q, k, v: _attn(q, k, v, mask))(q, k, v)
        return closed + sparsify(_attn)(q, k, v, mask)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = model(q, k, v)
    np.testing.assert_allclose(np.asarray(out), 2 * np.asarray(_attn(q, k, v, _causal())), **TOL)
    g = jax.grad(lambda q: model(q, k, v).sum())(q)
    np.testing.assert_allclose(
        np.asarray(g), np.asarray(jax.grad(lambda q: 2 * _attn(q, k, v, _causal()).sum())(q)), **TOL
    )


def test_input_dependent_masks_still_say_so(rng):
    q, k, v = _qkv(rng)

    def from_inputs(q, k, v):  # compares values of q and k: varies along queries and keys
        keep = q[:, :, None, 0, 0] > k[:, None, :, 0, 0]
        return _attn(q, k, v, (keep | jnp.eye(S, dtype=bool))[:, None])

    _falls_back(from_inputs, (q, k, v), "depends on the function's inputs")

    @jax.jit
    def model(q, k, v):
        mask = _causal() & (q[:, None, :, 0, 0] > 0)  # computed from the model's inputs
        return sparsify(lambda q, k, v: _attn(q, k, v, mask[:, None]))(q, k, v)

    with pytest.warns(SparsifyWarning, match="closed over from an enclosing trace"):
        model(q, k, v)
    # a constant mask that differs per batch row (a concrete argument) is named a constant
    per_row = np.stack(
        [np.tril(np.ones((S, S), bool)), np.tril(np.ones((S, S), bool), -1) | np.eye(S, dtype=bool)[::-1]]
    )
    problems = _falls_back(lambda q, k, v, m: _attn(q, k, v, m[:, None]), (q, k, v, per_row))
    assert "is a constant" in problems[0] and "inputs" not in problems[0], problems


# --- normalising after the product (flash-style reference code) ----------------------------


def flash_reference(q, k, v, form="where"):
    """``exp(s - max) @ V / rowsum``: the normalisation applied to the product."""
    i, j = _grid(q.shape[1], xp=jnp)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * D**-0.5
    if form == "where":
        s = jnp.where(j <= i, s, -jnp.inf)
    elif form == "bias":
        s = s + jnp.where(j <= i, 0.0, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.exp(s - jax.lax.stop_gradient(m))
    if form == "after_exp":  # masked after the exp: a mask with fill -inf
        p = jnp.where(j <= i, p, 0.0)
    out = jnp.einsum("bhqk,bkhd->bhqd", p, v) / jnp.sum(p, axis=-1)[..., None]
    return out.transpose(0, 2, 1, 3)


@pytest.mark.parametrize("form", ["where", "bias", "after_exp"])
def test_normalised_after_the_product(rng, form):
    found = _substituted(functools.partial(flash_reference, form=form), *_qkv(rng))
    assert found.mask == masks.causal()
    assert found.scale == pytest.approx(D**-0.5)


def test_division_by_another_sum_is_not_attention(rng):
    q, k, v = _qkv(rng)

    def wrong_sum(q, k, v):
        i, j = _grid(S, xp=jnp)
        s = jnp.where(j <= i, jnp.einsum("bqhd,bkhd->bhqk", q, k), -jnp.inf)
        p = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True))
        return jnp.einsum("bhqk,bkhd->bhqd", p, v) / jnp.sum(p, axis=-2)[..., None]  # a column sum

    assert sparsify(wrong_sum).inspect(q, k, v) == []


# --- jax.nn.softmax(where=), jax.checkpoint and lax.scan -------------------------------------


def _window_logits(q, k):
    """Scores [B, H, T, S] and a causal window of 5 (built inside, from iota)."""
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * D**-0.5
    i, j = _grid(q.shape[1], k.shape[1], xp=jnp)
    return s, (j <= i) & (i - j < 5)


def softmax_where(q, k, v):
    """``jax.nn.softmax(where=)``: the logits masked for the max and again for the shift, the
    exponentials masked in the sum, the probabilities masked after it."""
    s, m = _window_logits(q, k)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1, where=m), v)


def test_softmax_where_is_found(rng):
    q, k, v = _qkv(rng)
    assert _substituted(softmax_where, q, k, v).mask == masks.sliding_window(4, 0)


def test_a_sum_over_masked_exponentials_of_unmasked_logits_stays_dense(rng):
    """``exp(s - max) / sum(where(m, exp, 0))`` with ``s`` unmasked is no masked softmax (the
    dropped entries keep their exponentials in the numerator): not substituted."""
    q, k, v = _qkv(rng)

    def fn(q, k, v):
        s, m = _window_logits(q, k)
        e = jnp.exp(s - s.max(-1, keepdims=True))
        p = e / jnp.where(m, e, 0.0).sum(-1, keepdims=True)
        return jnp.einsum("bhqk,bkhd->bqhd", p, v)

    _falls_back(fn, (q, k, v))


def test_a_checkpointed_attention_is_found_and_stays_checkpointed(rng):
    q, k, v = _qkv(rng)
    fn = jax.checkpoint(softmax_where)
    assert _substituted(fn, q, k, v).mask == masks.sliding_window(4, 0)
    eqns = jax.make_jaxpr(sparsify(fn))(q, k, v).jaxpr.eqns
    names = [e.primitive.name for e in eqns]
    assert len(names) == 1 and "remat" in names[0], "the substituted attention runs under jax.checkpoint"


def _layers(rng, n=2, width=H * D):
    return [jnp.asarray(rng.standard_normal((n, width, width)) * width**-0.5, jnp.float32) for _ in range(3)]


def scanned_model(x, wq, wk, wv, remat=False):
    """A layer scanned over stacked weights [L, W, W] (as ``nn.scan`` / ``lax.scan`` models
    write it), its attention's mask built inside the body; ``remat``: the layer checkpointed."""

    def layer(h, w):
        q, k, v = ((h @ m).reshape(*h.shape[:2], H, D) for m in w)
        return h + softmax_where(q, k, v).reshape(h.shape), None

    step = jax.checkpoint(layer) if remat else layer
    return jax.lax.scan(step, x, (wq, wk, wv))[0]


@pytest.mark.parametrize("remat", [False, True], ids=["scan", "scan_checkpoint"])
def test_a_layer_scanned_over_stacked_weights_is_found(rng, remat):
    x = jnp.asarray(rng.standard_normal((B, S, H * D)), jnp.float32)
    wq, wk, wv = _layers(rng)
    fn = functools.partial(scanned_model, remat=remat)
    found = _substituted(fn, x, wq, wk, wv, argnums=(1, 2, 3))
    assert found.mask == masks.sliding_window(4, 0)
    before = splat.call_counts().get("splat", 0)
    jax.jit(sparsify(fn))(x, wq, wk, wv)
    assert splat.call_counts().get("splat", 0) == before + 1


def test_an_attention_split_across_a_checkpoint_is_found(rng):
    """The projections and the softmax checkpointed, the product outside: splat's call reads Q and
    K made inside the checkpointed call."""
    x = jnp.asarray(rng.standard_normal((B, S, H * D)), jnp.float32)
    wq, wk, wv = (m[0] for m in _layers(rng))

    def fn(x, wq, wk, wv):
        def probs(x):
            q, k = ((x @ w).reshape(B, S, H, D) for w in (wq, wk))
            s, m = _window_logits(q, k)
            return jax.nn.softmax(jnp.where(m, s, -jnp.inf), axis=-1)

        return jnp.einsum("bhqk,bkhd->bqhd", jax.checkpoint(probs)(x), (x @ wv).reshape(B, S, H, D))

    assert _substituted(fn, x, wq, wk, wv, argnums=(1, 2, 3)).mask == masks.sliding_window(4, 0)
