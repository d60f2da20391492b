"""The cuDNN backend's mask translation, checked on a CPU.

There is no cuDNN here: the tests set ``_cudnn.IMPLEMENTATION = "xla"`` so the
same ``jax.nn.dot_product_attention`` arguments run through XLA, and compare
against the float64 dense reference (forward and gradients, odd S, GQA). The
translation tests also let float32 through (``DTYPES``: cuDNN's restriction,
not XLA's), so an off-by-one in a window cannot hide under bfloat16 rounding;
XLA on CPU has no float16 dot with float32 accumulation, so float16 is GPU-only
here. Every other catalogue mask must be refused with a reason. On a GPU the shared base in
``test_attention.py`` runs the real cuDNN backend on the masks it takes.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import assert_close, attention_dense_grads, attention_grads_ref, attention_ref

import acsr
import jax_bindings
from jax_bindings import _cudnn, _registry, _runtime, _tuning
from splat import _attention as api
from splat import catalogue, masks

TAKEN = {"full", "causal", "causal_window"}
REFUSAL = "cudnn takes full, causal and causal-window masks only"


@pytest.fixture
def xla(monkeypatch):
    monkeypatch.setattr(_cudnn, "IMPLEMENTATION", "xla")


@pytest.fixture
def xla_f32(monkeypatch, xla):
    monkeypatch.setattr(_cudnn, "DTYPES", (*_cudnn.DTYPES, "float32"))


@pytest.fixture
def fake_gpu(monkeypatch, xla, fresh_registry):
    """A "gpu" platform where cudnn is available (through XLA) and triton is not (no jax_triton here)."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")


def _inputs(rng, sq, skv, *, h=4, hk=2, d=16, dtype=jnp.bfloat16):
    q = jnp.asarray(rng.standard_normal((2, sq, h, d)), dtype)
    k, v = (jnp.asarray(rng.standard_normal((2, skv, hk, d)), dtype) for _ in range(2))
    do = jnp.asarray(rng.standard_normal((2, sq, h, d)), dtype)
    return q, k, v, do


def _check(rng, mask, sq, skv, *, hk=2, dtype=jnp.float32, attention=None):
    """Forward and gradients of the cudnn translation against the float64 dense reference."""
    layout = mask.to_acsr(sq, skv)
    q, k, v, do = _inputs(rng, sq, skv, hk=hk, dtype=dtype)
    scale = 0.3
    attention = attention or (lambda q, k, v: _cudnn.attention(q, k, v, None, layout, scale))
    out, vjp = jax.vjp(jax.jit(attention), q, k, v)
    grads = vjp(do)
    same_out, same_grads = attention_dense_grads(q, k, v, layout, scale, do)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert_close("out", out, attention_ref(q, k, v, layout, scale)[0], dtype, same_out)
    refs = attention_grads_ref(q, k, v, layout, scale, do)
    for name, g, r, s, x in zip(("dq", "dk", "dv"), grads, refs, same_grads, (q, k, v), strict=True):
        assert g.dtype == x.dtype and g.shape == x.shape, name
        assert_close(name, g, r, dtype, s)


# -----------------------------------------------------------------------------
# the translation is exact
# -----------------------------------------------------------------------------

WINDOWS = {
    "full": masks.full(),
    "causal": masks.causal(),
    "causal_window_0": masks.sliding_window(0, 0),  # the diagonal only
    "causal_window_1": masks.sliding_window(1, 0),
    "causal_window_9": masks.sliding_window(9, 0),
    "causal_window_35": masks.sliding_window(35, 0),  # = causal at S = 37, not at 130
}


@pytest.mark.parametrize("s", [37, 130])
@pytest.mark.parametrize("name", list(WINDOWS))
def test_translation_matches_reference(xla_f32, rng, name, s):
    _check(rng, WINDOWS[name], s, s)


@pytest.mark.parametrize("hk", [4, 1])
@pytest.mark.parametrize("name", ["causal", "causal_window_9"])
def test_gqa_mqa(xla_f32, rng, name, hk):
    _check(rng, WINDOWS[name], 37, 37, hk=hk)


@pytest.mark.parametrize("name", ["full", "causal", "causal_window_9"])
def test_bfloat16(xla, rng, name):
    _check(rng, WINDOWS[name], 130, 130, dtype=jnp.bfloat16)


def test_full_mask_of_any_shape(xla_f32, rng):
    _check(rng, masks.full(), 37, 61)
    _check(rng, masks.full(), 70, 20)


@pytest.mark.parametrize(
    "mask, s, want",
    [
        (masks.full(), 37, _cudnn.CudnnMask("full", is_causal=False)),
        (masks.causal(), 37, _cudnn.CudnnMask("causal", is_causal=True)),
        (masks.sliding_window(9, 0), 37, _cudnn.CudnnMask("causal_window", True, (9, 0))),
        (masks.sliding_window(36, 0), 37, _cudnn.CudnnMask("causal", is_causal=True)),
        (masks.sliding_window(35, 0), 37, _cudnn.CudnnMask("causal_window", True, (35, 0))),
        (masks.sliding_window(0, 0), 1, _cudnn.CudnnMask("full", is_causal=False)),
    ],
)
def test_recognise(mask, s, want):
    assert _cudnn.recognise(mask.to_acsr(s)) == want


# -----------------------------------------------------------------------------
# refusals, with reasons
# -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(catalogue.SMALL))
def test_catalogue_masks_taken_or_refused(xla, rng, name):
    mask = catalogue.SMALL[name]
    layout = mask.to_acsr(130)
    q, k, v, _ = _inputs(rng, 130, 130)
    if name in TAKEN:
        assert _cudnn.recognise(layout).family == name
        assert _cudnn.attention(q, k, v, None, layout, 0.3).shape == q.shape
    else:
        with pytest.raises(NotImplementedError, match=REFUSAL + ": ."):
            _cudnn.attention(q, k, v, None, layout, 0.3)


def _growing_window(s: int) -> np.ndarray:
    """Row ``i`` sees ``[i // 2, i]``: causal, one segment, but no fixed window."""
    i, j = np.arange(s)[:, None], np.arange(s)[None, :]
    return (j <= i) & (j >= i // 2)


@pytest.mark.parametrize(
    "layout, found",
    [
        (masks.sliding_window(9, 9).to_acsr(40), r"row 0 attends \[0, 10\), not a causal row"),
        (masks.causal().to_acsr(40, 50), "a 40 x 50 mask that is not full"),
        (masks.strided(4).to_acsr(40), "segments per row|stride-4"),
        (catalogue.random_mask(40, 40).to_acsr(40, 40), "block-sparse residual"),
        (acsr.from_dense(np.tril(np.ones((40, 40), bool), -1)), "fully masked rows"),
        (acsr.from_dense(_growing_window(40)), r"row 2 attends \[1, 3\), not \[0, 3\) of the causal window"),
    ],
    ids=["bidirectional", "rectangular causal", "strided", "residual", "empty row", "odd window"],
)
def test_refusals_say_what_was_found(layout, found):
    with pytest.raises(NotImplementedError, match=REFUSAL) as info:
        _cudnn.recognise(layout)
    assert re.search(found, str(info.value)), str(info.value)


def test_dtype_head_dim_and_platform_refusals(monkeypatch, rng):
    layout = masks.causal().to_acsr(16)
    monkeypatch.setattr(_cudnn, "IMPLEMENTATION", "xla")
    q, k, v, _ = _inputs(rng, 16, 16, dtype=jnp.float32)
    with pytest.raises(NotImplementedError, match="bfloat16 and float16 inputs only, got float32"):
        _cudnn.attention(q, k, v, None, layout, 0.3)
    for d in (12, 264):
        x = jnp.zeros((1, 16, 1, d), jnp.bfloat16)
        with pytest.raises(NotImplementedError, match=f"multiples of 8 up to 256, got {d}"):
            _cudnn.attention(x, x, x, None, layout, 0.3)
    monkeypatch.setattr(_cudnn, "IMPLEMENTATION", "cudnn")
    if jax.default_backend() != "gpu":
        x = jnp.zeros((1, 16, 1, 16), jnp.bfloat16)
        with pytest.raises(NotImplementedError, match="cudnn needs a CUDA GPU"):
            _cudnn.attention(x, x, x, None, layout, 0.3)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(_cudnn, "_compute_capability", lambda: (7, 5))
    x = jnp.zeros((1, 16, 1, 16), jnp.bfloat16)
    with pytest.raises(NotImplementedError, match="compute capability 8.0 or newer, this GPU has 7.5"):
        _cudnn.attention(x, x, x, None, layout, 0.3)
    monkeypatch.setattr(_cudnn, "_compute_capability", lambda: (8, 0))
    x = jnp.zeros((1, 16, 1, 192), jnp.bfloat16)
    with pytest.raises(NotImplementedError, match="up to 128, got 192"):
        _cudnn.attention(x, x, x, None, layout, 0.3)


@pytest.mark.parametrize("op", _registry.CONTRACT_OPS)
def test_contract_ops_refuse(op):
    with pytest.raises(NotImplementedError, match="cudnn has no"):
        getattr(_cudnn, op)()


# -----------------------------------------------------------------------------
# through the dispatcher, on a pretend GPU
# -----------------------------------------------------------------------------


def test_explicit_cudnn_through_the_api(fake_gpu, rng):
    assert jax_bindings.available_backends()["cudnn"] is None
    window = masks.sliding_window(9, 0)
    _check(
        rng,
        window,
        37,
        37,
        dtype=jnp.bfloat16,
        attention=lambda q, k, v: api.attention(q, k, v, window, scale=0.3, backend="cudnn"),
    )
    q, k, v, _ = _inputs(rng, 37, 37)
    with pytest.raises(NotImplementedError, match=REFUSAL):
        api.attention(q, k, v, masks.strided(4), backend="cudnn")
    with pytest.raises(NotImplementedError, match="cudnn has no sddmm"):
        api.sddmm(q, k, masks.causal().to_acsr(37), backend="cudnn")
    with pytest.raises(NotImplementedError, match="no float32 logsumexp"):
        jax_bindings.attention_with_lse(q, k, v, masks.causal().to_acsr(37), 0.3, backend="cudnn")


def test_cudnn_under_vmap_jit_grad(fake_gpu, rng):
    layout = masks.causal().to_acsr(24)
    q, k, v, _ = _inputs(rng, 24, 24)
    q3, k3, v3 = (jnp.stack([x, 2 * x]) for x in (q, k, v))
    f = lambda q, k, v: jax_bindings.attention(q, k, v, layout, 0.3, backend="cudnn")  # noqa: E731
    out = jax.jit(jax.vmap(f))(q3, k3, v3)
    g = jax.jit(jax.vmap(jax.grad(lambda q, k, v: f(q, k, v).astype(jnp.float32).sum())))(q3, k3, v3)
    for i in range(2):
        one = f(q3[i], k3[i], v3[i])
        np.testing.assert_allclose(np.asarray(out[i], np.float32), np.asarray(one, np.float32))
        assert g[i].shape == q.shape


def test_auto_picks_cudnn_on_sm90_for_the_masks_it_takes(fake_gpu, monkeypatch, rng):
    monkeypatch.setattr(_tuning, "_compute_capability", lambda: "9.0")
    families = {"full": masks.full(), "causal": masks.causal(), "causal_window": masks.sliding_window(9, 0)}
    table = {m.to_acsr(64): name for name, m in families.items()}
    monkeypatch.setattr(acsr, "pattern_family", lambda layout: table.get(layout, "strided"), raising=False)
    x = jax.ShapeDtypeStruct((1, 64, 4, 64), jnp.bfloat16)
    for mask in families.values():
        assert jax_bindings.selected_backend("attention", x, x, x, mask.to_acsr(64), 0.125) == "cudnn"
    # no cudnn where it refuses: float32, another family, the unfused ops and attention_with_lse
    x32 = jax.ShapeDtypeStruct((1, 64, 4, 64), jnp.float32)
    assert jax_bindings.selected_backend("attention", x32, x32, x32, masks.causal().to_acsr(64), 0.1) == "jax"
    assert jax_bindings.selected_backend("attention", x, x, x, masks.strided(4).to_acsr(64), 0.1) == "jax"
    causal = masks.causal().to_acsr(64)
    assert jax_bindings.selected_backend("attention_with_lse", x, x, x, causal, 0.1) == "jax"
    # the auto call itself: cudnn runs it (forward and gradients), no fallback warning
    _check(
        rng,
        masks.causal(),
        64,
        64,
        dtype=jnp.bfloat16,
        attention=lambda q, k, v: api.attention(q, k, v, masks.causal(), scale=0.3),
    )
    # on compute capability 8.x without tuning data: registry order (triton, cudnn); triton cannot load
    # here, so cudnn still runs, but it is not ranked first
    monkeypatch.setattr(_tuning, "_compute_capability", lambda: "8.0")
    layout = masks.causal().to_acsr(64)
    assert _registry.auto_order("attention", layout, 64, jnp.bfloat16) == ("cudnn", "jax")
    assert _tuning.rank_backends("causal", 64, 64, "bfloat16", ["triton", "cudnn"]) == ["triton", "cudnn"]


def test_runtime_masks_and_soft_caps_are_refused(monkeypatch):
    monkeypatch.setattr(_cudnn, "IMPLEMENTATION", "xla")
    x = jnp.zeros((1, 16, 2, 16), jnp.bfloat16)
    layout = masks.causal().to_acsr(16)
    rt = _runtime.build(1, 16, 16, query_seq_lengths=jnp.array([3]))
    with pytest.raises(NotImplementedError, match="no runtime mask"):
        _cudnn.attention(x, x, x, rt, layout, 0.3)
    with pytest.raises(NotImplementedError, match="no logits soft cap"):
        _cudnn.attention(x, x, x, None, layout, 0.3, 30.0)
