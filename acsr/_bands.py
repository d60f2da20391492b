"""Diagonal bands: the masks the band kernels take, read back from a layout (numpy only).

:func:`band` reads a layout as one :class:`Band` (row ``i`` sees keys ``i - left .. i +
right``). :func:`band_form` also reads the two foldings of a band a kernel can take without
masking every tile: a band measured from the first row of each block of rows
(``block_local``: every row of a block sees the same keys), and a band in interleaved
sequences (``dilated_window``, ``strided``: row ``i`` sees only keys ``j = i mod d``, so the
``d`` phases are ``d`` independent banded sequences of ``1 / d`` the length). Both are read
from the layout's rows and compared with the mask they define row by row, so a form is
returned only where it reproduces the mask exactly.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from acsr._format import ACSR, Segment


class Band(NamedTuple):
    """A mask that is one diagonal band: row ``i`` sees keys ``j`` with ``i - left <= j <= i + right``
    and ``0 <= j < kv_len``; a bound of None is open (the sequence's edge).

    ``left`` and ``right`` may be negative (a band off the diagonal, such as the bottom-right
    aligned causal mask of ``q_len < kv_len``: ``right = kv_len - q_len``). Dense is
    ``(None, None)``, causal ``(None, 0)``, a causal window of ``W`` keys ``(W - 1, 0)``.
    """

    left: int | None
    right: int | None


class BandForm(NamedTuple):
    """A mask as a :class:`Band` in one of its foldings (at most one of ``block``, ``phases`` is
    above 1).

    ``block``: row ``i`` measures the band from its block's first row ``a(i) = i - i % block``:
    it sees keys ``a(i) - left <= j <= a(i) + right`` (``block_local(b, n)`` is ``block = b``,
    ``left = n * b``, ``right = b - 1``). ``phases``: ``q_len`` and ``kv_len`` are multiples of
    ``d = phases``, row ``i`` sees only keys ``j`` with ``j % d == i % d``, and with ``t = i // d``,
    ``u = j // d`` the band holds between ``t`` and ``u`` (``dilated_window(r, d)`` is
    ``Band(r // d, r // d)`` in ``d`` phases, ``strided(s)`` causal in ``s``). A plain band is
    ``BandForm(band)``.
    """

    band: Band
    block: int = 1
    phases: int = 1


def _one_segment(layout: ACSR) -> Segment | None:
    """The layout's one non-empty segment, or None (a grid, a residual, none or several)."""
    if layout.grid is not None or layout.residual is not None:
        return None
    segs = [s for s in layout.segments if s.width > 0]
    return segs[0] if len(segs) == 1 else None


def _rows_of(band: Band, anchor: np.ndarray, kv_len: int) -> tuple[np.ndarray, np.ndarray]:
    """``(first key, count)`` of each row of ``band`` measured from the rows' ``anchor``."""
    left, right = band
    lo = np.zeros_like(anchor) if left is None else np.maximum(0, anchor - left)
    hi = np.full_like(anchor, kv_len) if right is None else np.minimum(kv_len, anchor + right + 1)
    return lo, np.maximum(0, hi - lo)


def _gives(band: Band, lo: np.ndarray, count: np.ndarray, anchor: np.ndarray, kv_len: int) -> bool:
    """Whether ``band`` measured from ``anchor`` gives exactly the rows ``(lo, count)`` (contiguous
    keys; a row's ``lo`` matters only where it has some)."""
    want_lo, want_count = _rows_of(band, anchor, kv_len)
    return np.array_equal(want_count, count) and np.array_equal(want_lo[count > 0], lo[count > 0])


def _band_of_rows(lo: np.ndarray, count: np.ndarray, anchor: np.ndarray, kv_len: int) -> Band | None:
    """The band measured from ``anchor`` that gives the contiguous rows ``(lo, count)``, or None.

    The bounds are read from the rows whose first (last) key is inside the sequence, then the
    rows they define are compared with all rows (empty rows included)."""
    lo, count, anchor = lo.astype(np.int64), count.astype(np.int64), anchor.astype(np.int64)
    some = count > 0
    if not some.any():
        return None
    hi = lo + count
    inside_lo, inside_hi = some & (lo > 0), some & (hi < kv_len)
    left = right = None
    if inside_lo.any():
        d = anchor[inside_lo] - lo[inside_lo]
        if np.any(d != d[0]):
            return None
        left = int(d[0])
    if inside_hi.any():
        d = hi[inside_hi] - 1 - anchor[inside_hi]
        if np.any(d != d[0]):
            return None
        right = int(d[0])
    found = Band(left, right)
    return found if _gives(found, lo, count, anchor, kv_len) else None


def band(layout: ACSR) -> Band | None:
    """``layout`` as one :class:`Band`, or None when it is not exactly one.

    One non-empty segment of stride 1, no residual, no grid; the bounds are read from the rows
    whose first (last) key is inside the sequence, and the whole layout is then compared with
    the band they define, row by row (empty rows included), so a band is returned only where
    it reproduces the mask exactly. An empty mask is no band.

    Example:
      >>> import numpy as np, acsr
      >>> i, j = np.arange(64)[:, None], np.arange(64)[None, :]
      >>> acsr.band(acsr.from_dense((j <= i) & (i - j < 8)))
      Band(left=7, right=0)
      >>> acsr.band(acsr.from_dense(np.ones((64, 64), bool)))
      Band(left=None, right=None)
      >>> acsr.band(acsr.from_dense(j % 2 == 0)) is None
      True
    """
    seg = _one_segment(layout)
    if seg is None or seg.uniform_stride != 1:
        return None
    return _band_of_rows(seg.base, seg.count, np.arange(layout.q_len), layout.kv_len)


def block_height(rows: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> int:
    """The gcd of the ``rows`` (ascending) where a bound ``lo`` or ``hi`` changes from the row
    before; 0 where none changes. Bounds that change only at multiples of a block height >= 2
    are block-local."""
    at = np.flatnonzero((np.diff(lo) != 0) | (np.diff(hi) != 0)) + 1
    return int(np.gcd.reduce(rows[at])) if at.size else 0


def _block_band(seg: Segment, q_len: int, kv_len: int) -> BandForm | None:
    """A stride-1 segment as a band measured from blocks of rows (:func:`block_height`, 2 or
    more), or None."""
    lo, count, r = seg.base.astype(np.int64), seg.count.astype(np.int64), np.arange(q_len)
    block = block_height(r, lo, lo + count)
    if block < 2:
        return None
    found = _band_of_rows(lo, count, r - r % block, kv_len)
    return None if found is None else BandForm(found, block=block)


def _phase_band(seg: Segment, stride: int, q_len: int, kv_len: int) -> BandForm | None:
    """A segment of stride ``stride`` as a band in ``stride`` phases, or None."""
    d = stride
    if q_len % d or kv_len % d:
        return None
    base, count = seg.base.astype(np.int64), seg.count.astype(np.int64)
    r = np.arange(q_len)
    if np.any(base[count > 0] % d != r[count > 0] % d):
        return None
    t = np.arange(q_len // d)
    found = _band_of_rows(base[0::d] // d, count[0::d], t, kv_len // d)
    if found is None:
        return None
    for p in range(1, d):
        if not _gives(found, base[p::d] // d, count[p::d], t, kv_len // d):
            return None
    return BandForm(found, phases=d)


def band_form(layout: ACSR) -> BandForm | None:
    """``layout`` as a :class:`BandForm`, or None when it is none exactly.

    A plain :func:`band` first; else, for one segment of stride 1, a band measured from blocks
    of rows; for one segment of a uniform stride ``d > 1``, a band in ``d`` phases.

    Example:
      >>> import numpy as np, acsr
      >>> i, j = np.arange(64)[:, None], np.arange(64)[None, :]
      >>> acsr.band_form(acsr.from_dense((abs(i - j) <= 8) & ((i - j) % 2 == 0)))
      BandForm(band=Band(left=4, right=4), block=1, phases=2)
      >>> acsr.band_form(acsr.from_dense((j // 16 <= i // 16) & (j // 16 >= i // 16 - 1)))
      BandForm(band=Band(left=16, right=15), block=16, phases=1)
    """
    plain = band(layout)
    if plain is not None:
        return BandForm(plain)
    seg = _one_segment(layout)
    if seg is None:
        return None
    stride = seg.uniform_stride
    if stride == 1:
        return _block_band(seg, layout.q_len, layout.kv_len)
    if stride is None:
        return None
    return _phase_band(seg, stride, layout.q_len, layout.kv_len)
