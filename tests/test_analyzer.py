"""The analyzer recovers the constructors' segments and closed forms from dense masks."""

import itertools

import jax.numpy as jnp
import numpy as np
import pytest

import splat
from splat import catalogue, masks


def _dense(m, q_len, kv_len):
    return m(np.arange(q_len)[:, None], np.arange(kv_len)[None, :])


FAMILIES = {k: v for k, v in catalogue.SMALL.items()}
UNIONS = {
    f"{a}|{b}": FAMILIES[a] | FAMILIES[b]
    for a, b in itertools.combinations(["sliding_window", "dilated_window", "strided", "block_local"], 2)
}
UNIONS["sink|strided|causal_window"] = masks.sink(2) | masks.strided(16) | masks.sliding_window(5, 0)
UNIONS["bidirectional_sink|causal_window"] = masks.sink(3, causal=False) | masks.sliding_window(5, 0)
UNIONS["bidirectional_sink|strided|window"] = (
    masks.sink(2, causal=False) | masks.strided(16) | masks.sliding_window(4, 4)
)
UNIONS["causal_sink|window"] = masks.sink(4) | masks.sliding_window(6, 6)
UNIONS["global|block_local|dilated"] = (
    masks.global_tokens(2) | masks.block_local(16) | masks.dilated_window(30, 4)
)


@pytest.mark.parametrize("name", list(FAMILIES) + list(UNIONS))
@pytest.mark.parametrize("shape", [(150, 150), (90, 170)])
def test_analyze_dense_equals_constructor(name, shape):
    m = {**FAMILIES, **UNIONS}[name]
    built = m.to_acsr(*shape)
    found = splat.analyze(_dense(m, *shape))
    assert found == built  # same segments, per-row arrays and closed forms
    for a, b in zip(found.segments, built.segments, strict=True):
        assert a.closed_form == b.closed_form


def test_function_masks_and_arrays_agree():
    f = lambda i, j: (np.abs(i - j) <= 6) | (j < 2)  # noqa: E731
    by_fn = splat.analyze(f, q_len=120, kv_len=100)
    by_array = splat.analyze(_dense(masks.from_fn(f), 120, 100))
    assert by_fn == by_array == (masks.sliding_window(6) | masks.sink(2)).to_acsr(120, 100)


def test_concrete_jax_arrays_and_leading_unit_axes_are_accepted():
    m = np.tril(np.ones((40, 40), bool))
    assert splat.analyze(jnp.asarray(m)[None, None]) == masks.causal().to_acsr(40)


def test_layouts_pass_through_with_a_size_check():
    layout = masks.causal().to_acsr(16)
    assert splat.analyze(layout, 16, 16) is layout
    with pytest.raises(ValueError, match="kv_len=20"):
        splat.analyze(layout, 16, 20)


def test_report_names_family_segments_and_empty_rows():
    rep = splat.report(masks.sink(2) | masks.sliding_window(7, 0), q_len=64)
    text = rep.to_string()
    assert "Sink(n=2, causal=True)" in rep.family and len(rep.segments) == 2
    assert all(s.closed_form for s in rep.segments)
    assert "segment 1" in text and "closed form: rows" in text
    m = np.tril(np.ones((32, 32), bool))
    m[5] = False
    rep = splat.report(m)
    assert rep.empty_rows == 1 and rep.nnz == m.sum()
    rep = splat.report(catalogue.random_mask(64, 64, 0.4))
    assert rep.residual_blocks > 0 and "irregular" in rep.family
    assert 0 < rep.tile_efficiency <= 1


@pytest.mark.parametrize(
    "args, err, match",
    [
        ((masks.causal(),), ValueError, "q_len is required"),
        ((np.ones((4, 4), np.int32),), TypeError, "boolean"),
        ((np.ones((2, 4, 4), bool),), ValueError, r"\[q_len, kv_len\]"),
        (("causal",), TypeError, "mask must be"),
        ((np.eye(4, dtype=bool), 5, 5), ValueError, "shape"),
    ],
)
def test_analyze_rejects_bad_masks(args, err, match):
    with pytest.raises(err, match=match):
        splat.analyze(*args)


def test_traced_masks_are_refused_with_advice():
    import jax

    @jax.jit
    def f(x):
        return splat.analyze(x > 0)

    with pytest.raises(TypeError, match="trace time"):
        f(jnp.ones((4, 4)))


def test_report_names_the_backend_auto_picks(monkeypatch):
    import jax

    import jax_bindings

    rep = splat.report(masks.causal(), q_len=64)
    assert "depends on head dim and dtype" in rep.backend and rep.backend in rep.to_string()
    seen = []

    def selected(op, q, k, v, layout, scale, backend="auto"):
        seen.append((op, q.shape, q.dtype, k.shape, layout.shape, scale))
        return "somebackend"

    monkeypatch.setattr(jax_bindings, "selected_backend", selected)
    rep = splat.report(masks.causal(), q_len=64, kv_len=64, head_dim=32, dtype="bfloat16")
    assert rep.backend == 'auto picks "somebackend" for the fused attention here (head dim 32, bfloat16)'
    assert seen == [("attention", (1, 64, 1, 32), jnp.bfloat16, (1, 64, 1, 32), (64, 64), 32**-0.5)]
    monkeypatch.undo()
    if jax.default_backend() != "gpu":
        rep = splat.report(masks.causal(), q_len=64, head_dim=32, dtype=jnp.float32)
        assert rep.backend.startswith('auto picks "jax"')
    with pytest.raises(ValueError, match="dtype must be given with head_dim"):
        splat.report(masks.causal(), q_len=64, head_dim=32)
    with pytest.raises(ValueError, match="head_dim must be a positive int"):
        splat.report(masks.causal(), q_len=64, dtype="bfloat16")
