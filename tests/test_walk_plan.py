"""Backend-neutral walk plans (``acsr._plan``): row order, key spans, modes, cover, order, family."""

from __future__ import annotations

import numpy as np
import pytest

import acsr
import splat
from splat import catalogue


def _ij(n, m=None):
    return np.arange(n)[:, None], np.arange(m or n)[None, :]


def _dense_spans(mask: np.ndarray, block_m: int) -> tuple[np.ndarray, np.ndarray]:
    """Per row block, first column and column span of the mask, from the dense array."""
    starts, spans = [], []
    for b in range(0, mask.shape[0], block_m):
        _, cols = np.nonzero(mask[b : b + block_m])
        starts.append(cols.min() if cols.size else 0)
        spans.append(cols.max() + 1 - cols.min() if cols.size else 0)
    return np.array(starts), np.array(spans)


@pytest.mark.parametrize("block_m", [1, 16, 24])
def test_key_spans_in_columns_match_the_dense_mask(block_m):
    i, j = _ij(100, 90)
    mask = (np.abs(i - j) <= 7) & ((i - j) % 3 == 0)
    mask[40:60] = False  # whole empty row blocks for block_m <= 16
    (seg,) = acsr.from_dense(mask).segments
    start, span = acsr.key_spans(seg, acsr.block_rows(100, block_m), compressed=False)
    want_start, want_span = _dense_spans(mask, block_m)
    np.testing.assert_array_equal(start, want_start)
    np.testing.assert_array_equal(span, want_span)
    assert start.dtype == span.dtype == np.int64


def test_key_spans_compressed_count_strided_steps():
    i, j = _ij(64)
    (seg,) = acsr.from_dense((j <= i) & ((i - j) % 4 == 0)).segments
    rows = acsr.block_rows(64, 64)
    start, span = acsr.key_spans(seg, rows)
    # row 63 holds columns 3, 7, ..., 63 (16 of them), row 0 only column 0: u in [0, 16)
    assert start.tolist() == [0] and span.tolist() == [16]


def test_block_rows_pad_with_minus_one():
    rows = acsr.block_rows(5, 4)
    assert rows.tolist() == [[0, 1, 2, 3], [4, -1, -1, -1]] and rows.dtype == np.int64
    perm = np.array([0, 2, -1, -1, 1, 3, -1, -1], np.int32)
    assert acsr.block_rows(4, 4, perm).tolist() == [[0, 2, -1, -1], [1, 3, -1, -1]]


def test_row_permutation_groups_phases_and_plans_aligned_walks():
    i, j = _ij(64)
    lay = acsr.from_dense((np.abs(i - j) <= 20) & ((i - j) % 2 == 0))
    p = acsr.walk_plan(lay, 16)
    assert p.modes == (acsr.SegmentMode("aligned", 2),) and p.perm.dtype == np.int32
    for blk in p.perm.reshape(-1, 16):
        assert len(set(blk[blk >= 0] % 2)) == 1
    assert sorted(p.perm[p.perm >= 0]) == list(range(64)) and p.row_blocks == p.perm.size // 16
    # without the permutation, rows of both phases share a block: masked (modular) walk
    q = acsr.walk_plan(lay, 16, permute=False)
    assert q.perm is None and q.modes == (acsr.SegmentMode("modular", 2),) and q.row_blocks == 4


def test_segment_modes_dense_and_varying_stride():
    i, j = _ij(32)
    assert acsr.walk_plan(acsr.from_dense(np.abs(i - j) <= 3), 16).modes == (acsr.SegmentMode("dense", 1),)
    m = np.zeros((32, 32), bool)
    for r in range(32):
        m[r, np.arange(r % 3, 32, 2 + r % 2)[:4]] = True
    (mode,) = acsr.walk_plan(acsr.from_dense(m), 16).modes
    assert mode == acsr.SegmentMode("modular", 0)


def test_walk_plan_rejects_a_bad_block_height():
    lay = acsr.from_dense(np.eye(8, dtype=bool))
    for bad in (0, -16, 2.5, True):
        with pytest.raises(ValueError, match="block_m"):
            acsr.walk_plan(lay, bad)


def test_tile_cover():
    full = acsr.from_dense(np.ones((128, 128), bool))
    assert acsr.tile_cover(full, 64, 64) == 1.0
    i, j = _ij(256)
    band = acsr.from_dense(np.abs(i - j) <= 8)
    tight, loose = acsr.tile_cover(band, 16, 16), acsr.tile_cover(band, 128, 64)
    assert 0 < loose < tight < 1
    # exact count: 16x16 tiles; each interior block walks 16 + 16 keys -> 32 columns (2 tiles)
    walked = sum(int(np.ceil(s / 16) * 16) * 16 for s in _dense_spans(band.to_dense(), 16)[1])
    assert tight == pytest.approx(band.nnz / walked)


def test_block_order_puts_heavy_blocks_first():
    i, j = _ij(256)
    glob = acsr.from_dense((np.abs(i - j) <= 8) | (i < 2) | (j < 2))
    order = acsr.block_order(glob, 16, None)
    assert order is not None and order.dtype == np.int32 and order[0] == 0
    assert sorted(order.tolist()) == list(range(16))
    assert acsr.block_order(acsr.from_dense(np.abs(i - j) <= 8), 16, None) is None
    work = acsr.block_work(glob, acsr.block_rows(256, 16))
    assert work.shape == (len(glob.segments), 16) and work.dtype == np.int64


FAMILIES = {
    "full": "full",
    "causal": "causal",
    "sliding_window": "window",
    "causal_window": "causal_window",
    "dilated_window": "dilated",
    "block_local": "block_local",
    "strided": "strided",
    "global_window": "global_window",
    "sink_causal_window": "global_window",
    "strided_local": "strided",
}


@pytest.mark.parametrize("name", sorted(catalogue.SMALL))
@pytest.mark.parametrize("size", [(256, 256), (200, 200), (96, 160)])
def test_pattern_family_of_the_catalogue(name, size):
    assert set(FAMILIES) == set(catalogue.SMALL), "every catalogue pattern needs an expected family"
    lay = splat.analyze(catalogue.SMALL[name], *size)
    fam = acsr.pattern_family(lay)
    assert fam in acsr.FAMILIES and fam == FAMILIES[name]
    if name != "sink_causal_window":  # the transposed walk (backward dk/dv) has the same shape
        assert acsr.pattern_family(lay.transpose()) == fam


def test_pattern_family_residual_and_other():
    rnd = splat.analyze(catalogue.random_mask(128, 128, 0.3), 128)
    assert rnd.residual is not None and acsr.pattern_family(rnd) == "residual"
    assert acsr.pattern_family(acsr.from_dense(np.zeros((32, 32), bool))) == "other"
    i, j = _ij(64)
    assert acsr.pattern_family(acsr.from_dense(np.broadcast_to(j < 3, (64, 64)))) == "other"  # sinks alone
    assert acsr.pattern_family(acsr.from_dense((i + j) % 7 == 0)) != "window"


# -- diagonal bands ---------------------------------------------------------------------


def _band_mask(q_len, kv_len, left, right):
    i, j = _ij(q_len, kv_len)
    keep = np.ones((q_len, kv_len), bool)
    if left is not None:
        keep &= j >= i - left
    if right is not None:
        keep &= j <= i + right
    return keep


BANDS = [(None, None), (None, 0), (0, 0), (7, 0), (3, 5), (None, 3), (12, None), (-4, 9), (6, -2), (20, -15)]


@pytest.mark.parametrize("left, right", BANDS)
@pytest.mark.parametrize("q_len, kv_len", [(64, 64), (50, 70), (70, 33)])
def test_band_is_read_back_from_its_dense_mask(left, right, q_len, kv_len):
    mask = _band_mask(q_len, kv_len, left, right)
    if not mask.any():
        assert acsr.band(acsr.from_dense(mask)) is None
        return
    got = acsr.band(acsr.from_dense(mask))
    assert got is not None
    # the band read back may differ where a bound never binds; it must give the same mask
    assert np.array_equal(_band_mask(q_len, kv_len, *got), mask), (got, (left, right))


@pytest.mark.parametrize("mask", [splat.masks.causal(), splat.masks.full(), catalogue.named("causal_window"),
                                  catalogue.named("sliding_window")], ids=repr)
def test_band_of_catalogue_masks(mask):
    layout = mask.to_acsr(96, 96)
    got = acsr.band(layout)
    assert got is not None and np.array_equal(_band_mask(96, 96, *got), layout.to_dense())


def test_bottom_right_causal_is_a_band_off_the_diagonal():
    layout = splat.masks.causal().to_acsr(40, 100)
    mask = layout.to_dense()
    got = acsr.band(layout)
    assert got is not None and np.array_equal(_band_mask(40, 100, *got), mask)


@pytest.mark.parametrize(
    "mask",
    [
        lambda i, j: (np.abs(i - j) <= 4) & ((i - j) % 2 == 0),  # dilated
        lambda i, j: (np.abs(i - j) <= 4) | (j < 2),  # global + window
        lambda i, j: (i // 8) == (j // 8),  # block-local
        lambda i, j: (j <= i) & (i > 10) | (j == i),  # a band with a hole of rows: first rows differ
        lambda i, j: (j <= i) & (i % 5 != 0),  # empty rows inside a causal mask
        lambda i, j: np.zeros_like(i + j, bool),  # empty
    ],
)
def test_non_bands_are_none(mask):
    i, j = _ij(48)
    assert acsr.band(acsr.from_dense(mask(i, j))) is None
