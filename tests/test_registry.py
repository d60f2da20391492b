"""The backend registry and the dispatcher's fallback: adding a backend is one module + one entry.

A toy backend registered before "jax" takes ``attention_fwd`` of full masks only
and refuses everything else; ``backend="auto"`` uses it where it can and falls
back where it refuses, per op (its refused backward goes to "jax").
"""

from __future__ import annotations

import doctest
import importlib
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import assert_close, attention_grads_ref, attention_ref

import acsr
import jax_bindings
from jax_bindings import _dispatch, _pure, _registry, _tuning
from splat import _attention as api
from splat import masks

TOY_REASON = "toy takes attention_fwd of full masks only"


@pytest.fixture
def clean(fresh_registry):
    """Registry, store and jit caches cleared around the test; the tuning store empty."""


def _is_full(layout) -> bool:
    return layout.residual is None and bool((layout.row_counts() == layout.kv_len).all())


def _toy_module(name: str, calls: list) -> types.ModuleType:
    """Every contract op refuses, but ``attention_fwd`` of a full mask (the pure one, counted)."""
    mod = types.ModuleType(name)

    def refuse(*args):
        raise NotImplementedError(TOY_REASON)

    for op in _registry.CONTRACT_OPS:
        setattr(mod, op, refuse)

    def attention_fwd(q, k, v, runtime, layout, scale, soft_cap):
        if not _is_full(layout) or runtime is not None or soft_cap is not None:
            raise NotImplementedError(TOY_REASON)
        calls.append(layout.shape)
        return _pure.attention_fwd(q, k, v, runtime, layout, scale, soft_cap)

    mod.attention_fwd = attention_fwd
    return mod


@pytest.fixture
def toy(monkeypatch, clean):
    """Registers backend "toy" (CPU, before "jax"); yields the list of its attention_fwd calls."""
    calls: list = []
    monkeypatch.setitem(sys.modules, "toy_backend", _toy_module("toy_backend", calls))
    entry = _registry.Backend("toy", "toy_backend", "a test backend: full masks, forward only", ("cpu",))
    monkeypatch.setattr(_registry, "ENTRIES", (entry, *_registry.ENTRIES))
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    return calls


def _inputs(rng, s, *, h=4, hk=2, d=16, dtype=jnp.float32):
    q = jnp.asarray(rng.standard_normal((2, s, h, d)), dtype)
    k, v = (jnp.asarray(rng.standard_normal((2, s, hk, d)), dtype) for _ in range(2))
    do = jnp.asarray(rng.standard_normal((2, s, h, d)), dtype)
    return q, k, v, do


def _check(q, k, v, do, mask, scale, backend="auto"):
    out, vjp = jax.vjp(lambda q, k, v: api.attention(q, k, v, mask, scale=scale, backend=backend), q, k, v)
    layout = mask.to_acsr(q.shape[1]) if hasattr(mask, "to_acsr") else mask
    assert_close("out", out, attention_ref(q, k, v, layout, scale)[0], jnp.float32)
    refs = attention_grads_ref(q, k, v, layout, scale, do)
    for name, g, r in zip(("dq", "dk", "dv"), vjp(do), refs, strict=True):
        assert_close(name, g, r, jnp.float32)


# -----------------------------------------------------------------------------
# the registry
# -----------------------------------------------------------------------------


def test_backends_in_order_with_auto_first():
    assert jax_bindings.BACKENDS == ("auto", "cuda", "triton", "cudnn", "jax")
    assert _registry.names()[-1] == _registry.FALLBACK == "jax"
    for e in _registry.ENTRIES:
        assert e.description and "\n" not in e.description


def test_check_backend():
    for name in jax_bindings.BACKENDS:
        assert jax_bindings.check_backend(name) == name
    for bad in ("hopper", "", None, 1, "AUTO"):
        allowed = r"\('auto', 'cuda', 'triton', 'cudnn', 'jax'\)"
        with pytest.raises(ValueError, match=r"backend must be one of " + allowed):
            jax_bindings.check_backend(bad)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"name": "auto"}, "name"),
        ({"name": "two words"}, "name"),
        ({"module": ""}, "module"),
        ({"description": "two\nlines"}, "description"),
        ({"platforms": ()}, "platforms"),
        ({"platforms": "gpu"}, "platforms"),
    ],
)
def test_entries_are_validated(kwargs, field):
    args = {"name": "x", "module": "m", "description": "d", "platforms": ("gpu",)} | kwargs
    with pytest.raises(ValueError, match=f"Backend.{field}"):
        _registry.Backend(**args)


def test_available_backends_say_why(clean):
    got = jax_bindings.available_backends()
    assert list(got) == list(_registry.names())
    assert got["jax"] is None
    if jax.default_backend() != "gpu":
        for name in ("cuda", "triton", "cudnn"):
            assert got[name] == "runs on gpu only; jax.default_backend() is 'cpu'"


def test_backend_modules_import_where_they_should():
    """Nothing is registered that cannot import: the CPU-capable modules import here."""
    for e in _registry.ENTRIES:
        # triton needs jax_triton on a CUDA JAX, cuda a Hopper GPU (checked on a GPU by their gpu tests)
        if e.name not in ("triton", "cuda"):
            mod = importlib.import_module(e.module)
            assert all(callable(getattr(mod, op)) for op in _registry.CONTRACT_OPS), e.name


def test_unknown_module_and_platform_give_reasons(monkeypatch, clean):
    entries = (
        _registry.Backend("ghost", "no_such_module_here", "missing", None),
        _registry.Backend("tpu_only", "jax_bindings._pure", "elsewhere", ("tpu",)),
        *_registry.ENTRIES,
    )
    monkeypatch.setattr(_registry, "ENTRIES", entries)
    got = jax_bindings.available_backends()
    assert got["ghost"].startswith("ModuleNotFoundError: No module named 'no_such_module_here'")
    assert got["tpu_only"].startswith("runs on tpu only")
    x = jnp.zeros((1, 8, 1, 8))
    with pytest.raises(jax_bindings.BackendUnavailableError, match='backend="ghost".*no_such_module_here'):
        jax_bindings.attention(x, x, x, masks.causal().to_acsr(8), 0.5, backend="ghost")
    # auto skips both; "ghost" is meant for every platform, so landing on jax says why
    with pytest.warns(RuntimeWarning, match="falls back.*ghost: ModuleNotFoundError"):
        jax_bindings.attention(x, x, x, masks.causal().to_acsr(8), 0.5)


# -----------------------------------------------------------------------------
# a toy backend: one module + one entry
# -----------------------------------------------------------------------------


def test_toy_backend_is_checkable_and_available(toy):
    assert "toy" not in jax_bindings.BACKENDS  # the import-time tuple; check_backend reads the registry
    assert jax_bindings.check_backend("toy") == "toy"
    assert jax_bindings.available_backends()["toy"] is None


def test_auto_uses_the_toy_where_it_takes_the_call(toy, rng):
    q, k, v, do = _inputs(rng, 37)
    full = masks.full().to_acsr(37)
    assert jax_bindings.selected_backend("attention", q, k, v, full, 0.3) == "toy"
    with pytest.warns(RuntimeWarning, match=f"falls back.*attention_bwd: toy: {TOY_REASON}"):
        _check(q, k, v, do, masks.full(), 0.3)  # forward on the toy, backward refused: jax's
    assert toy and all(shape == (37, 37) for shape in toy)


def test_auto_falls_back_where_the_toy_refuses(toy, rng):
    q, k, v, do = _inputs(rng, 37)
    causal = masks.causal().to_acsr(37)
    assert jax_bindings.selected_backend("attention", q, k, v, causal, 0.3) == "jax"
    message = f"falls back to the pure-JAX backend for attention: toy: {TOY_REASON}$"
    with pytest.warns(RuntimeWarning, match=message):
        _check(q, k, v, do, masks.causal(), 0.3)
    assert not toy
    # the unfused ops: the toy refuses them all
    s = jnp.zeros((2, 4, 37, causal.nnz_max))
    assert jax_bindings.selected_backend("softmax", s, causal, 1.0) == "jax"


def test_explicit_toy_refusal_reaches_the_caller(toy, rng):
    q, k, v, _ = _inputs(rng, 16)
    with pytest.raises(NotImplementedError, match=TOY_REASON) as info:
        api.attention(q, k, v, masks.causal(), backend="toy")
    assert any('backend "toy" refused attention' in n for n in info.value.__notes__)
    with pytest.raises(NotImplementedError, match=TOY_REASON):
        jax_bindings.selected_backend("attention", q, k, v, masks.causal().to_acsr(16), 0.3, backend="toy")
    # its forward works; its backward refuses, and named explicitly nothing falls back
    out = api.attention(q, k, v, masks.full(), backend="toy")
    assert out.shape == q.shape and toy
    with pytest.raises(NotImplementedError, match=TOY_REASON):
        jax.grad(lambda q: api.attention(q, k, v, masks.full(), backend="toy").sum())(q)


def test_auto_catches_nothing_but_not_implemented(toy, monkeypatch, rng):
    def bug(*args):
        raise TypeError("a planner bug")

    monkeypatch.setattr(sys.modules["toy_backend"], "attention_fwd", bug)
    q, k, v, _ = _inputs(rng, 16)
    with pytest.raises(TypeError, match="a planner bug"):
        api.attention(q, k, v, masks.causal())


def test_vmap_and_jit_through_the_toy(toy, rng):
    q, k, v, _ = _inputs(rng, 24)
    full = masks.full().to_acsr(24)
    f = lambda q, k, v: jax_bindings.attention(q, k, v, full, 0.3)  # noqa: E731
    batched = jax.jit(jax.vmap(f))(q[None], k[None], v[None])[0]
    np.testing.assert_allclose(batched, f(q, k, v), atol=1e-6)
    assert toy


def test_tuning_store_orders_auto(toy, monkeypatch, tmp_path, rng):
    """Two toys; the store says the second is faster for this family: auto tries it first."""
    calls_b: list = []
    monkeypatch.setitem(sys.modules, "toy_b_backend", _toy_module("toy_b_backend", calls_b))
    toy_b = _registry.Backend("toy_b", "toy_b_backend", "another test backend", ("cpu",))
    monkeypatch.setattr(_registry, "ENTRIES", (_registry.ENTRIES[0], toy_b, *_registry.ENTRIES[1:]))
    classify = lambda layout: "full" if _is_full(layout) else "other"  # noqa: E731
    monkeypatch.setattr(acsr, "pattern_family", classify, raising=False)
    store = tmp_path / "store.json"
    store.write_text(
        '{"schema": 1, "device_kind": "cpu", "tiles": [], "implementations": [{"family": "full", '
        '"s_bucket": 32, "head_dim": 16, "dtype": "float32", "pass": "fwd_bwd", '
        '"times_ms": {"toy": 2.0, "toy_b": 1.0, "jax": 0.5}}]}'
    )
    monkeypatch.setenv(_tuning.ENV_FILE, str(store))
    _tuning.store.cache_clear()
    q, k, v, _ = _inputs(rng, 37)
    full = masks.full().to_acsr(37)
    assert _registry.auto_order("attention", full, 16, jnp.float32) == ("toy_b", "toy", "jax")  # jax last
    assert jax_bindings.selected_backend("attention", q, k, v, full, 0.3) == "toy_b"
    # no entry for this head dim: registry order
    q8 = jnp.zeros((1, 37, 1, 8))
    assert jax_bindings.selected_backend("attention", q8, q8, q8, full, 0.3) == "toy"
    # the unfused ops are not ranked
    assert _registry.auto_order("sddmm", full, None, jnp.float32) == ("toy", "toy_b", "jax")


def test_family_falls_back_to_other_without_the_classifier(monkeypatch, clean):
    monkeypatch.delattr(acsr, "pattern_family", raising=False)
    assert _registry.family(masks.causal().to_acsr(8)) == "other"


# -----------------------------------------------------------------------------
# selected_backend arguments
# -----------------------------------------------------------------------------


def test_selected_backend_argument_errors():
    x = jax.ShapeDtypeStruct((1, 8, 1, 8), jnp.float32)
    layout = masks.causal().to_acsr(8)
    with pytest.raises(ValueError, match="op must be one of"):
        jax_bindings.selected_backend("attention_fwd", x, x, x, layout, 1.0)
    with pytest.raises(TypeError, match=r"takes q, k, v, layout, scale; got 4"):
        jax_bindings.selected_backend("attention", x, x, x, layout)
    with pytest.raises(ValueError, match="backend must be one of"):
        jax_bindings.selected_backend("sddmm", x, x, layout, backend="hopper")


def test_docstring_examples_run(clean):
    from splat import _analyzer

    if jax.default_backend() == "gpu":
        pytest.skip("the examples show a CPU")
    for mod in (_registry, _tuning, _dispatch, _analyzer):
        result = doctest.testmod(mod, optionflags=doctest.ELLIPSIS)
        assert result.failed == 0 and result.attempted > 0, mod.__name__


def test_attention_led_by_a_backend_runs_as_auto_would_after_it():
    """The tuner's forward+backward of one backend: here "jax" (the only one on a CPU) leads."""
    from jax_bindings import _dispatch

    layout = masks.sliding_window(5, 2).to_acsr(40)
    rng = np.random.default_rng(0)
    q, k, v, do = (jnp.asarray(rng.standard_normal((1, 40, 2, 8)), jnp.float32) for _ in range(4))
    led = lambda q, k, v: _dispatch.attention_led_by("jax", q, k, v, layout, 0.3)  # noqa: E731
    ref = lambda q, k, v: _dispatch.attention(q, k, v, layout, 0.3, "jax")  # noqa: E731
    (o1, pull1), (o2, pull2) = jax.vjp(led, q, k, v), jax.vjp(ref, q, k, v)
    assert np.array_equal(o1, o2)
    assert all(np.array_equal(a, b) for a, b in zip(pull1(do), pull2(do), strict=True))
    if jax.default_backend() != "gpu":
        with pytest.raises(jax_bindings.BackendUnavailableError, match="cuda"):
            _dispatch.attention_led_by("cuda", q, k, v, layout, 0.3)
