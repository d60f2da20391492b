"""Grid products found in masks that arrive without their grid (acsr._grid_detect, acsr._grid_factor).

One mask, one layout: a grid product given as a dense array, CSR, canonical runs or
row chunks gets exactly :func:`acsr.from_grid`'s layout, and a mask that is not a grid
product (a bit flipped, random, a neighborhood with register tokens, non-square) never
gets a grid layout. Masks here come from ``GridWindows.dense()`` (an outer product of the
per-axis tables, independent of the detector) and from ``masks.neighborhood``.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import acsr
from acsr._grid import GridWindows, canonical_axis
from acsr._grid_factor import product_axis, split_axis
from splat import masks
from splat._neighborhood import AxisWindow

# -----------------------------------------------------------------------------
# every path that builds a layout from rows
# -----------------------------------------------------------------------------


def layouts_from_rows(dense: np.ndarray, chunk_rows: int = 1024) -> dict[str, acsr.ACSR]:
    """The layout of ``dense`` through each builder that sees only its rows."""
    n, kv = dense.shape
    indptr = np.zeros(n + 1, np.int64)
    np.cumsum(dense.sum(axis=1), out=indptr[1:])
    cols = np.nonzero(dense)[1]
    return {
        "from_dense": acsr.from_dense(dense),
        "from_csr": acsr.from_csr(n, kv, indptr, cols, chunk_rows=7),
        "from_runs": acsr.from_runs(n, kv, *acsr.runs_from_dense(dense)),
        # small chunks: rows before the first chunk of many runs are checked as runs;
        # no make_rows: scattered rows are read through make_chunk
        "from_dense_chunks": acsr.from_dense_chunks(
            n, kv, lambda r0, r1: dense[r0:r1], block=(8, 8), chunk_rows=chunk_rows
        ),
        "from_array": masks.from_array(dense).to_acsr(),
        "from_fn": masks.from_fn(lambda q, k: dense[q, k]).to_acsr(n, kv),
    }


def assert_one_layout(dense: np.ndarray, want: acsr.ACSR) -> None:
    for path, got in layouts_from_rows(dense).items():
        if path == "from_dense_chunks":  # its residual blocks are 8x8
            assert (got.grid is None) == (want.grid is None), path
            if want.grid is not None:
                assert got == want, path
        else:
            assert got == want, f"{path}: {got} != {want}"
        np.testing.assert_array_equal(got.to_dense(), dense, err_msg=path)


# -----------------------------------------------------------------------------
# neighborhoods: every kind of axis
# -----------------------------------------------------------------------------

# (grid, kernel_size, stride, dilation, is_causal, stored as a grid)
NEIGHBORHOODS = [
    ((7, 9), (7, 3), 1, 1, False, True),  # outer axis full
    ((8, 10), 5, 1, 1, False, True),
    ((9, 8), (6, 4), 1, 1, False, True),  # even kernels
    ((10, 11), (5, 4), (2, 3), 1, False, True),  # strides, short last groups
    ((12, 10), (5, 3), 1, (2, 3), False, True),  # dilations, 3 does not divide 10
    ((12, 12), (5, 5), 1, (2, 2), False, True),  # dilations that divide: split and merged back
    ((10, 9), (6, 3), (2, 1), 1, (True, False), True),  # causal outer axis
    ((10, 9), (5, 4), 1, 1, True, True),
    ((9, 7), (9, 1), 1, 1, False, False),  # kernel 1 on the last axis: merged, one progression
    ((6, 4, 7), (5, 1, 3), 1, 1, False, True),  # kernel 1 in the middle: merged into the outer axis
    ((6, 9), (6, 9), 1, 1, False, False),  # kernel == grid: full, one run
    ((7, 9), (3, 9), 1, 1, False, False),  # last axis full: the rows of the window merge
    ((5, 4, 5), (5, 2, 1), (1, 2, 1), 1, False, True),  # block-local middle axis, point last
    ((4, 5, 6), (3, 3, 4), (1, 2, 3), 1, (False, True, False), True),
    ((5, 4, 7), (3, 2, 3), 1, (1, 2, 2), (True, False, True), True),
    ((3, 4, 5), (3, 4, 2), 1, 1, False, True),  # two full outer axes merge into one
    ((4, 4, 4), 4, (2, 3, 4), 1, False, False),
    ((2, 3, 2, 3), (2, 3, 2, 2), 1, 1, False, True),  # four axes
    ((2, 5), (2, 3), 1, 1, False, False),  # tiny
    ((3, 3), 3, 1, 1, False, False),
    ((5, 3), (5, 2), 1, 1, False, True),  # tiny, 15 tokens
]


@pytest.mark.parametrize(("grid", "kernel", "stride", "dilation", "causal", "is_grid"), NEIGHBORHOODS)
def test_neighborhood_rows_give_the_constructors_layout(grid, kernel, stride, dilation, causal, is_grid):
    want = masks.neighborhood(grid, kernel, stride=stride, dilation=dilation, is_causal=causal).to_acsr()
    assert (want.grid is not None) == is_grid
    assert_one_layout(want.to_dense(), want)


def test_rows_before_the_first_irregular_chunk_are_checked():
    # causal outer axis: the first rows see one key row (one run); rows of many runs come later
    nb = masks.neighborhood((16, 12), (8, 5), is_causal=(True, False))
    want = nb.to_acsr()
    dense = want.to_dense()
    got = acsr.from_dense_chunks(192, 192, lambda r0, r1: dense[r0:r1], block=(8, 8), chunk_rows=8)
    assert got == want and got.grid is not None
    # a bit in a row before the first chunk of many runs, in that chunk, in the last chunk
    for row, col in ((3, 100), (100, 0), (191, 5)):
        bad = dense.copy()
        bad[row, col] = ~bad[row, col]
        got = acsr.from_dense_chunks(192, 192, lambda r0, r1, m=bad: m[r0:r1], block=(8, 8), chunk_rows=8)
        assert got.grid is None
        np.testing.assert_array_equal(got.to_dense(), bad)


# -----------------------------------------------------------------------------
# random grid products, and the same mask written on other grids
# -----------------------------------------------------------------------------


@st.composite
def grid_axes(draw, length: int):
    """A progression table of one axis: windows, block-local, single keys, whole axis, or random."""
    n = length
    x = np.arange(n)
    kind = draw(st.sampled_from(["window", "blocks", "point", "full", "random"]))
    if kind == "window":  # NATTEN's, with stride, dilation, causal
        d = draw(st.integers(1, max(1, n // 2)))
        k = draw(st.integers(1, n // d))
        window = AxisWindow(n, k, draw(st.integers(1, k)), d, draw(st.booleans()))
        return canonical_axis(n, d, *window.windows())
    if kind == "blocks":
        b = draw(st.sampled_from([b for b in range(1, n + 1) if n % b == 0]))
        return canonical_axis(n, 1, x // b * b, np.full(n, b))
    if kind == "point":
        return canonical_axis(n, 1, draw(st.lists(st.integers(0, n - 1), min_size=n, max_size=n)), np.ones(n))
    if kind == "full":
        return canonical_axis(n, 1, np.zeros(n), np.full(n, n))
    d = draw(st.integers(1, 3))
    count = np.array(draw(st.lists(st.integers(0, (n - 1) // d + 1), min_size=n, max_size=n)))
    first = [draw(st.integers(0, n - 1 - d * (c - 1))) if c else 0 for c in count]
    return canonical_axis(n, d, first, count)


@st.composite
def products(draw):
    rank = draw(st.integers(2, 4))
    top = {2: 16, 3: 7, 4: 4}[rank]
    grid = [draw(st.integers(2, top)) for _ in range(rank)]
    return GridWindows(tuple(draw(grid_axes(n)) for n in grid))


@settings(max_examples=60, deadline=None)
@given(products())
def test_random_products_give_from_grids_layout(windows):
    dense = windows.dense()
    want = acsr.from_grid(windows)
    np.testing.assert_array_equal(want.to_dense(), dense)
    assert acsr.from_dense(dense) == want
    assert acsr.from_runs(*dense.shape, *acsr.runs_from_dense(dense)) == want


@settings(max_examples=60, deadline=None)
@given(products(), st.data())
def test_the_same_mask_on_another_grid_has_the_same_layout(windows, data):
    axes = list(windows.axes)
    i = data.draw(st.integers(0, len(axes) - 2))
    merged = product_axis(axes[i], axes[i + 1])  # coarser: two axes as one, where that is one axis
    if merged is not None:
        coarser = GridWindows(tuple(axes[:i] + [merged] + axes[i + 2 :]))
        np.testing.assert_array_equal(coarser.dense(), windows.dense())
        assert acsr.from_grid(coarser) == acsr.from_grid(windows)
    a = axes[i]
    for b in (b for b in range(2, a.length) if a.length % b == 0):  # finer: an axis as two
        parts = split_axis(a, b)
        if parts is not None:
            finer = GridWindows(tuple(axes[:i] + list(parts) + axes[i + 1 :]))
            np.testing.assert_array_equal(finer.dense(), windows.dense())
            assert acsr.from_grid(finer) == acsr.from_grid(windows)


def test_canonical_form_follows_the_mask_not_the_grid():
    # a block-local middle axis is (block, whole block): written as (5, 20) or (5, 4, 5), or
    # found in the dense mask, the layout is the same
    nb = masks.neighborhood((5, 4, 5), (5, 2, 1), stride=(1, 2, 1))
    want = nb.to_acsr()
    a0, a1, a2 = nb.windows().axes
    assert want == acsr.from_grid(GridWindows((a0, product_axis(a1, a2))))
    assert want == acsr.from_dense(want.to_dense())
    assert want.grid.grid == (10, 10)
    # a dilation that divides its axis is (windows, own phase), merged back into one axis
    nb = masks.neighborhood((12, 12), 5, dilation=(2, 1))
    assert nb.to_acsr().grid.grid == (12, 12) and nb.to_acsr().grid.axes[0].dilation == 2


def test_split_axis_is_exact():
    blocks = canonical_axis(12, 1, np.arange(12) // 4 * 4, np.full(12, 4))
    outer, inner = split_axis(blocks, 4)
    assert outer.is_point and inner.is_full
    np.testing.assert_array_equal(product_axis(outer, inner).dense(), blocks.dense())
    window = canonical_axis(12, 1, np.clip(np.arange(12) - 1, 0, 9), np.full(12, 3))
    assert all(split_axis(window, b) is None for b in (2, 3, 4, 6))
    phase = canonical_axis(12, 4, np.arange(12) % 4, np.full(12, 3))  # every key of its phase
    outer, inner = split_axis(phase, 4)
    assert outer.is_full and inner.is_point


# -----------------------------------------------------------------------------
# masks that are not grid products
# -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("grid", "kernel"), [((8, 9), 5), ((12, 12), (5, 7)), ((4, 5, 6), 3), ((6, 7), (6, 3))]
)
def test_one_flipped_bit_is_never_a_grid(rng, grid, kernel):
    dense = masks.neighborhood(grid, kernel).to_acsr().to_dense()
    size = dense.shape[0]
    rows = [0, size - 1, *rng.integers(0, size, 3)]
    for i in rows:
        for j in (0, size - 1, int(rng.integers(0, size))):
            bad = dense.copy()
            bad[i, j] = ~bad[i, j]
            for path, got in layouts_from_rows(bad).items():
                assert got.grid is None, (path, i, j)
                np.testing.assert_array_equal(got.to_dense(), bad, err_msg=path)


def test_random_masks_are_not_grids(rng):
    for size, density in ((36, 0.3), (64, 0.05), (60, 0.7)):
        dense = rng.random((size, size)) < density
        for path, got in layouts_from_rows(dense).items():
            assert got.grid is None, path
            np.testing.assert_array_equal(got.to_dense(), dense, err_msg=path)


def test_neighborhood_with_register_tokens_stays_residual():
    # register tokens see and are seen by every token: not a product of per-axis windows
    nb = masks.neighborhood((12, 12), 5)
    layout = (nb | masks.global_tokens(2)).to_acsr(144, 144)
    assert layout.grid is None and layout.residual is not None
    assert layout == acsr.from_dense(layout.to_dense())
    layout = (nb & masks.causal()).to_acsr(144, 144)
    assert layout.grid is None


def test_kronecker_product_with_an_irregular_outer_mask_is_not_a_grid(rng):
    # rows are blocks of one window axis, but the blocks follow a random outer mask
    window = masks.neighborhood((8,), 5).windows().axes[0].dense()
    outer = rng.random((9, 9)) < 0.6
    outer[:, 0] = True
    dense = np.kron(outer, window)
    assert acsr.from_dense(dense).grid is None
    assert acsr.from_runs(72, 72, *acsr.runs_from_dense(dense)).grid is None


def test_non_square_masks_are_never_grids():
    dense = masks.neighborhood((8, 9), 5).to_acsr().to_dense()
    for m in (dense[:, :70], np.concatenate([dense, dense[:3]]), dense[1:]):
        got = acsr.from_dense(m)
        assert got.grid is None
        np.testing.assert_array_equal(got.to_dense(), m)


def test_empty_rows_product():
    # an axis on which some coordinates see nothing empties whole rows of the mask
    a0 = canonical_axis(6, 1, np.clip(np.arange(6) - 2, 0, 1), np.full(6, 5))
    a1 = canonical_axis(8, 1, [0, 0, 1, 2, 0, 3, 3, 3], [5, 5, 5, 5, 0, 5, 5, 5])
    w = GridWindows((a0, a1))
    dense = w.dense()
    assert not dense[4].any()
    want = acsr.from_grid(w)
    assert want.grid is not None and acsr.from_dense(dense) == want


def test_grid_layouts_validate_and_transpose():
    for grid, kernel, kw in (((8, 10), 5, {}), ((9, 8), (6, 4), {"is_causal": (True, False)})):
        layout = acsr.from_dense(masks.neighborhood(grid, kernel, **kw).to_acsr().to_dense())
        assert layout.grid is not None
        layout.validate()
        assert layout.transpose() == acsr.from_dense(layout.to_dense().T)


def test_detection_costs_little_on_irregular_masks(rng):
    dense = rng.random((2048, 2048)) < 0.2
    t = time.process_time()
    acsr.from_dense(dense)
    took = time.process_time() - t
    assert took < 2.0, f"2048 x 2048 random mask: {took:.2f} s"  # ~0.05 s here, mostly the residual
