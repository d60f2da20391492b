"""The ACSR format: round trips, canonical form, value semantics, checks."""

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import acsr
from acsr import ACSR, Law, LayoutError, Segment


def _csr(m):
    rows, cols = np.nonzero(m)
    indptr = np.zeros(m.shape[0] + 1, np.int64)
    np.cumsum(np.bincount(rows, minlength=m.shape[0]), out=indptr[1:])
    return indptr, cols


masks_2d = hnp.arrays(bool, hnp.array_shapes(min_dims=2, max_dims=2, min_side=1, max_side=48))


@settings(max_examples=150, deadline=None)
@given(masks_2d, st.sampled_from([(4, 4), (8, 16), (3, 5)]), st.integers(1, 40))
def test_any_boolean_mask_round_trips(m, block, chunk):
    layout = acsr.from_dense(m, block=block, chunk_rows=chunk)
    np.testing.assert_array_equal(layout.to_dense(), m)
    assert layout.nnz == m.sum()
    np.testing.assert_array_equal(layout.row_counts(), m.sum(1))
    layout.validate()
    # the CSR path produces the same (canonical) layout
    assert acsr.from_csr(*m.shape, *_csr(m), block=block) == layout
    np.testing.assert_array_equal(layout.transpose().to_dense(), m.T)


@settings(max_examples=60, deadline=None)
@given(masks_2d)
def test_slot_columns_enumerate_each_nonzero_once(m):
    layout = acsr.from_dense(m, block=(8, 8))
    cols = layout.slot_columns()
    assert cols.shape == (m.shape[0], layout.nnz_max)
    rebuilt = np.zeros_like(m)
    for r in range(m.shape[0]):
        c = cols[r][cols[r] >= 0]
        assert len(np.unique(c)) == len(c)
        rebuilt[r, c] = True
    np.testing.assert_array_equal(rebuilt, m)


def test_canonical_runs_contiguous_then_isolated_progressions():
    row = np.zeros((1, 40), bool)
    row[0, [0, 1, 2, 3]] = True  # contiguous run
    row[0, [10, 14, 18]] = True  # isolated, stride 4
    row[0, [30]] = True  # isolated: joins the stride-4 run? no: 30 - 18 = 12 != 4
    base, stride, count = acsr.runs_from_dense(row)
    got = sorted(zip(base[0].tolist(), stride[0].tolist(), count[0].tolist(), strict=True))
    assert got == [(0, 1, 4), (10, 4, 3), (30, 1, 1)]


def test_equal_masks_give_equal_hashable_layouts():
    rng = np.random.default_rng(0)
    m = rng.random((37, 29)) < 0.4
    a, b = acsr.from_dense(m), acsr.from_dense(m.copy())
    assert a == b and hash(a) == hash(b)
    m2 = m.copy()
    m2[5, 7] = ~m2[5, 7]
    assert acsr.from_dense(m2) != a
    assert len({a, b}) == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.q_len = 3
    with pytest.raises(ValueError, match="read-only"):
        a.residual.bits[0, 0, 0, 0] = True
    window = acsr.from_dense(np.abs(np.arange(9)[:, None] - np.arange(9)) <= 1)
    with pytest.raises(ValueError, match="read-only"):
        window.segments[0].base[0] = 1


def test_fully_masked_rows_are_legal():
    m = np.tril(np.ones((10, 10), bool))
    m[[2, 7]] = False
    layout = acsr.from_dense(m).validate()
    assert (layout.row_counts()[[2, 7]] == 0).all()
    np.testing.assert_array_equal(layout.to_dense(), m)


def test_irregular_mask_goes_to_residual_exactly():
    rng = np.random.default_rng(3)
    m = rng.random((130, 90)) < 0.35
    layout = acsr.from_dense(m, block=(16, 32))
    assert layout.segments == () and layout.residual is not None
    assert layout.residual.bits.shape[2:] == (16, 32)
    np.testing.assert_array_equal(layout.to_dense(), m)
    assert layout.nnz_max == layout.residual.width


def test_closed_forms_reproduce_arrays_and_window_law():
    i, j = np.arange(50)[:, None], np.arange(50)[None]
    layout = acsr.from_dense(np.abs(i - j) <= 3)
    (seg,) = layout.segments
    (piece,) = seg.closed_form.pieces
    assert piece.base == Law(1, 0, -3, lo=0) and piece.end == Law(1, 0, 4, hi=50)
    b, s, c = seg.closed_form.evaluate(50)
    np.testing.assert_array_equal(b, seg.base)
    np.testing.assert_array_equal(c, seg.count)
    assert "clamp(r - 3, 0, inf)" in layout.to_string()


def test_fit_law_finds_periodic_and_staircase_laws():
    r = np.arange(200)
    assert acsr.fit_law(r, r % 7) == Law(1, -7, 0, div=7)
    law = acsr.fit_law(r, np.maximum((r // 16 - 1) * 16, 0))
    assert law is not None and np.array_equal(law(r), np.maximum((r // 16 - 1) * 16, 0))
    assert acsr.fit_law(r, (r * r) % 11) is None


def test_validate_names_the_broken_invariant():
    good = acsr.from_dense(np.tril(np.ones((6, 6), bool)))
    seg = good.segments[0]
    too_far = Segment(seg.base, seg.stride, seg.count + 1)
    with pytest.raises(LayoutError, match="leave"):
        ACSR(6, 6, (too_far,)).validate()
    neg = Segment(seg.base, seg.stride, seg.count - 2)
    with pytest.raises(LayoutError, match="negative count"):
        ACSR(6, 6, (neg,)).validate()
    wrong_law = Segment(
        seg.base, seg.stride, seg.count, acsr.from_dense(np.eye(6, dtype=bool)).segments[0].closed_form
    )
    with pytest.raises(LayoutError, match="closed form"):
        ACSR(6, 6, (wrong_law,)).validate()
    with pytest.raises(LayoutError, match="overlap"):
        ACSR(6, 6, (seg, seg)).validate()
    with pytest.raises(LayoutError, match="shape"):
        ACSR(7, 6, (seg,)).validate()


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(TypeError, match="boolean"):
        acsr.from_dense(np.ones((3, 3)))
    with pytest.raises(ValueError, match="2-D"):
        acsr.from_dense(np.ones(3, bool))


def test_repr_and_to_string_are_readable():
    layout = acsr.from_dense(np.tril(np.ones((8, 8), bool)))
    assert repr(layout).startswith("ACSR(8x8, nnz=36")
    text = layout.to_string()
    assert "segment 0" in text and "#" in text


def test_analytic_transpose_equals_enumeration():
    from acsr._build import _enumerated_transpose, _fast_transpose
    from splat import catalogue, masks

    extra = [
        masks.causal() & masks.dilated_window(12, 2),
        masks.sliding_window(3, 40),
        masks.sink(1) | masks.causal(),
    ]
    used = 0
    for m in [*catalogue.SMALL.values(), *extra]:
        for shape in [(97, 97), (60, 131), (131, 60), (1, 9)]:
            layout = m.to_acsr(*shape)
            fast = _fast_transpose(layout)
            if fast is not None:
                used += 1
                assert fast == _enumerated_transpose(layout), (m, shape)
    assert used >= 40  # the analytic path really covers the catalogue
