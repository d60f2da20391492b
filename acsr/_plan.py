"""Walk plans: how a kernel visits an ACSR layout a row block at a time (backend-neutral, numpy only).

Every backend that tiles a layout asks the same questions, answered here once:

* **row order** (:func:`row_permutation`): rows grouped by the column phase of the
  widest-stride segment, so that no row block mixes phases;
* **row blocks** (:func:`block_rows`): the original row behind each program row;
* **key spans** (:func:`key_spans`): per row block, the first key and the width of the
  key range its rows cover in one segment -- the one definition the Triton planner,
  the pure-JAX backend and the analyzer's report share;
* **segment modes** (:func:`segment_modes`): how a row block walks each segment's keys:

  ``dense``   -- stride 1: key tiles are contiguous column ranges;
  ``aligned`` -- uniform stride ``s > 1`` and every row of a row block shares the phase
  ``base % s`` (after the row permutation): key tiles are dense in compressed space,
  ``col = phase + s * u``; no wasted products;
  ``modular`` -- anything else (strides vary per row, or phases are mixed in a row
  block): contiguous column tiles masked with ``(col - base) % stride == 0``;

* **tile cover** (:func:`tile_cover`): mask entries over the (row, column) pairs a walk
  with given tiles visits;
* **block order** (:func:`block_order`): heaviest row blocks first when a few walk far
  more keys than the rest;
* **pattern family** (:func:`pattern_family`): a short name for the shape of the mask,
  for tile tables and reports.

:func:`walk_plan` bundles order, modes and block order for one row-block height.

Arrays returned (all numpy, never written to):

=============  =====  ===========================  ======================================
array          dtype  shape                        meaning, padding
=============  =====  ===========================  ======================================
perm           int32  [row_blocks * block_m]       original row of each program row,
                                                   phase groups padded to ``block_m``
                                                   with -1
rows           int64  [row_blocks, block_m]        :func:`block_rows`: original row of
                                                   each program row; -1 pads
start, span    int64  [row_blocks]                 :func:`key_spans`: first key and key
                                                   span of a row block; 0 and 0 where the
                                                   block has no key in the segment
work           int64  [parts, row_blocks]          :func:`block_work`: keys each row block
                                                   walks, per segment then the residual
order          int32  [row_blocks]                 :func:`block_order`: row blocks,
                                                   heaviest first
=============  =====  ===========================  ======================================
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from acsr._bands import block_height
from acsr._format import ACSR, Segment

MODES = ("dense", "aligned", "modular")
FAMILIES = (
    "full",
    "causal",
    "causal_window",
    "window",
    "dilated",
    "strided",
    "block_local",
    "global_window",
    "neighborhood",
    "residual",
    "other",
)

# A row block walking more than this many times the median block's keys is launched
# first (block_order); read at call time, so experiments may change it.
HEAVY_RATIO = 3.0

_BIG = np.iinfo(np.int64).max


# -- rows -----------------------------------------------------------------------


def row_permutation(layout: ACSR, block_m: int) -> np.ndarray | None:
    """Row order grouping rows by the column phase of the widest-stride segment.

    Each phase group is padded with -1 to a multiple of ``block_m`` so no row block
    mixes phases (rows without a column in that segment take their own index's phase).

    Returns:
      int32 ``[row_blocks * block_m]``, or None when no segment has a uniform stride
      > 1 or the layout has a residual (whose row blocks stay in original order).
    """
    if layout.residual is not None:
        return None
    strided = [(s.uniform_stride, s) for s in layout.segments if (s.uniform_stride or 1) > 1]
    if not strided:
        return None
    stride, seg = max(strided, key=lambda t: t[0])
    r = np.arange(layout.q_len)
    ph = np.where(seg.count > 0, seg.base % stride, r % stride)
    order = np.argsort(ph, kind="stable")
    groups = np.split(order, np.flatnonzero(np.diff(ph[order])) + 1)
    out = []
    for g in groups:
        pad = (-g.size) % block_m
        out.append(np.concatenate([g, np.full(pad, -1, np.int64)]))
    return np.concatenate(out).astype(np.int32)


def block_rows(q_len: int, block_m: int, perm: np.ndarray | None = None) -> np.ndarray:
    """Original row of each program row, int64 ``[row_blocks, block_m]``; -1 pads.

    ``perm``: a :func:`row_permutation` (its length is a multiple of ``block_m``), or
    None for rows in order, the last block padded.
    """
    if perm is not None:
        return np.asarray(perm, np.int64).reshape(-1, block_m)
    n = -(-q_len // block_m) * block_m
    r = np.arange(n)
    return np.where(r < q_len, r, -1).reshape(-1, block_m)


# -- key spans ------------------------------------------------------------------


def key_spans(
    segment: Segment, rows: np.ndarray, *, compressed: bool = True
) -> tuple[np.ndarray, np.ndarray]:
    """First key and key span of each row block over one segment.

    Args:
      segment: the segment.
      rows: int ``[row_blocks, block_m]`` original rows (:func:`block_rows`), -1 pads.
      compressed: True: keys in compressed space, row ``r`` covering
        ``[base // stride, base // stride + count)`` (what a strided walk steps
        through); False: columns, row ``r`` covering ``[base, end)``.

    Returns:
      ``(start, span)``, int64 ``[row_blocks]``: the smallest first key of the
      block's rows with a column in the segment, and ``max(last key + 1) - start``;
      both 0 for a block with no such row.
    """
    ok = rows >= 0
    r = np.maximum(rows, 0)
    count = segment.count[r]
    live = ok & (count > 0)
    if compressed:
        lo = segment.base[r].astype(np.int64) // np.maximum(segment.stride[r].astype(np.int64), 1)
        hi = lo + count
    else:
        lo = segment.base[r].astype(np.int64)
        hi = segment.end()[r]
    has = live.any(axis=1)
    start = np.where(has, np.where(live, lo, _BIG).min(axis=1), 0)
    span = np.where(has, np.where(live, hi, 0).max(axis=1) - start, 0)
    return start, span


def block_work(layout: ACSR, rows: np.ndarray) -> np.ndarray:
    """Keys each row block of ``rows`` walks: int64 ``[parts, row_blocks]``.

    One part per segment (its compressed :func:`key_spans`), then, with a residual,
    its key blocks times ``block_kv`` (the residual row block of each block's first row).
    """
    parts = [key_spans(s, rows)[1] for s in layout.segments]
    if layout.residual is not None:
        res = layout.residual
        nb = res.num_blocks * res.block_kv
        parts.append(nb[rows[:, 0].clip(0) // res.block_q].astype(np.int64))
    if not parts:
        return np.zeros((0, rows.shape[0]), np.int64)
    return np.stack(parts)


def tile_cover(layout: ACSR, block_m: int, block_n: int) -> float:
    """Mask entries over the (row, column) pairs a walk with ``block_m x block_n`` tiles visits.

    1 = no waste. Rows are taken in :func:`row_permutation` order, each part's keys
    rounded up to whole tiles.
    """
    rows = block_rows(layout.q_len, block_m, row_permutation(layout, block_m))
    walked = sum(float((-(-sp // block_n) * block_n).sum()) for sp in block_work(layout, rows)) * block_m
    return layout.nnz / walked if walked else 1.0


def block_order(layout: ACSR, block_m: int, perm: np.ndarray | None) -> np.ndarray | None:
    """Row blocks heaviest first when a few walk far more keys than the rest.

    Returns int32 ``[row_blocks]`` (a permutation of the row blocks, stable among
    equals) when the heaviest block walks more than :data:`HEAVY_RATIO` times the
    median block's keys (and at least that many keys), else None.
    """
    rows = block_rows(layout.q_len, block_m, perm)
    if rows.shape[0] < 2:
        return None
    work = np.sum(block_work(layout, rows), axis=0, dtype=np.float64)
    med = float(np.median(work))
    if work.max() <= HEAVY_RATIO * max(med, 1.0):
        return None
    return np.argsort(-work, kind="stable").astype(np.int32)


# -- segment modes -----------------------------------------------------------------


class SegmentMode(NamedTuple):
    """How a row block walks one segment: ``mode`` in :data:`MODES`; ``stride`` the
    uniform stride, or 0 when strides vary per row."""

    mode: str
    stride: int


def _phase_aligned(seg: Segment, perm: np.ndarray | None, q_len: int, block_m: int, stride: int) -> bool:
    """Whether every row block's rows with a column in ``seg`` share one phase ``base % stride``."""
    rows = block_rows(q_len, block_m, perm)
    rows = np.where(rows < q_len, rows, -1)
    r = np.maximum(rows, 0)
    ph = np.where((rows >= 0) & (seg.count[r] > 0), seg.base[r] % stride, -1)
    hi = ph.max(axis=1)
    return bool(np.all((ph == -1) | (ph == hi[:, None])))


def segment_modes(
    layout: ACSR, block_m: int, perm: np.ndarray | None, *, aligned: bool = True
) -> tuple[SegmentMode, ...]:
    """The :class:`SegmentMode` of each segment for row blocks of ``block_m`` rows in ``perm`` order.

    ``aligned=False``: never ``"aligned"`` (a walk that does not permute rows, such as
    a row softmax over value slots, has no use for it).
    """
    out = []
    for s in layout.segments:
        st = s.uniform_stride
        if st is None:
            out.append(SegmentMode("modular", 0))
        elif st == 1:
            out.append(SegmentMode("dense", 1))
        elif aligned and _phase_aligned(s, perm, layout.q_len, block_m, st):
            out.append(SegmentMode("aligned", st))
        else:
            out.append(SegmentMode("modular", st))
    return tuple(out)


@dataclass(frozen=True, eq=False)
class WalkPlan:
    """How kernels with row blocks of ``block_m`` rows walk a layout.

    Attributes:
      block_m: rows per row block.
      perm: int32 ``[row_blocks * block_m]`` row order (-1 pads), or None: rows in order.
      order: int32 ``[row_blocks]`` row blocks heaviest first, or None: in order.
      modes: one :class:`SegmentMode` per segment.
      row_blocks: number of row blocks.
    """

    block_m: int
    perm: np.ndarray | None = field(repr=False)
    order: np.ndarray | None = field(repr=False)
    modes: tuple[SegmentMode, ...]
    row_blocks: int


def walk_plan(layout: ACSR, block_m: int, *, permute: bool = True, reorder: bool = True) -> WalkPlan:
    """The :class:`WalkPlan` of ``layout`` for row blocks of ``block_m`` rows.

    Args:
      layout: the layout walked.
      block_m: rows per row block (>= 1).
      permute: group rows by stride phase (:func:`row_permutation`); without it no
        segment is walked ``"aligned"``.
      reorder: launch the heaviest row blocks first (:func:`block_order`).

    Example:
      >>> import numpy as np, acsr
      >>> i, j = np.arange(8)[:, None], np.arange(8)[None, :]
      >>> p = acsr.walk_plan(acsr.from_dense((j <= i) & ((i - j) % 2 == 0)), 4)
      >>> p.modes[0].mode, p.perm.tolist()
      ('aligned', [0, 2, 4, 6, 1, 3, 5, 7])
    """
    if not isinstance(block_m, (int, np.integer)) or isinstance(block_m, bool) or block_m < 1:
        raise ValueError(f"block_m must be a positive int, got {block_m!r}")
    block_m = int(block_m)
    perm = row_permutation(layout, block_m) if permute else None
    modes = segment_modes(layout, block_m, perm, aligned=permute)
    order = block_order(layout, block_m, perm) if reorder else None
    row_blocks = perm.size // block_m if perm is not None else -(-layout.q_len // block_m)
    return WalkPlan(block_m, perm, order, modes, row_blocks)


# -- pattern family -------------------------------------------------------------------

_EDGE = "edge"  # every row's bound sits on the mask's edge (0 or kv_len)


def _diagonal(x: np.ndarray, r: np.ndarray, edge: int, clip) -> int | str | None:
    """``a`` when ``x == clip(r + a, edge)`` on every row, :data:`_EDGE` when ``x == edge``
    everywhere, else None."""
    inside = x != edge
    if not inside.any():
        return _EDGE
    a = x[inside] - r[inside]
    if np.any(a != a[0]):
        return None
    a = int(a[0])
    return a if np.array_equal(clip(r + a, edge), x) else None


def _segment_family(seg: Segment, q_len: int, kv_len: int) -> str:
    """One segment's shape: a family of :data:`FAMILIES`, or ``"prefix"`` (every row starts at column 0)."""
    r = np.flatnonzero(seg.count > 0)
    lo, hi, stride = seg.base[r].astype(np.int64), seg.end()[r], seg.stride[r]
    steps = (seg.count[r] > 1) & (stride > 1)
    if steps.any():  # every s-th key: from the sequence's edge (strided) or in a band (dilated)
        s, b, e = stride[steps], lo[steps], hi[steps]
        return "strided" if np.all(b < s) or np.all(e > kv_len - s) else "dilated"
    lo_a = _diagonal(lo, r, 0, np.maximum)
    hi_a = _diagonal(hi, r, kv_len, np.minimum)
    if lo_a == _EDGE and hi_a == _EDGE:
        return "full"
    if lo_a is not None and hi_a is not None:
        if _EDGE in (lo_a, hi_a):
            return "causal"  # one bound on the edge, the other on a diagonal (either orientation)
        diagonals = {0, kv_len - q_len}  # top-left and bottom-right aligned
        return "causal_window" if (hi_a - 1 in diagonals or lo_a in diagonals) else "window"
    if block_height(r, lo, hi) >= 2:
        return "block_local"
    return "prefix" if np.all(lo == 0) else "other"


def pattern_family(layout: ACSR) -> str:
    """A short name for the shape of ``layout``'s mask, one of :data:`FAMILIES`.

    Read from the per-row arrays (closed forms are not needed): ``"neighborhood"`` for a
    grid layout (:mod:`acsr._grid`); ``"residual"`` when the layout has a block-sparse
    residual; otherwise each segment's rows are compared
    with diagonal bands ``clip(r + a)`` and block steps:

    * one segment: ``"full"``; ``"causal"`` (one bound on the mask's edge, the other
      on a diagonal); ``"causal_window"`` (a band ending on, or starting at, the
      diagonal) or ``"window"`` (any other band); ``"block_local"`` (bounds change
      only every few rows, at multiples of one block height); ``"strided"`` (every
      s-th key from the sequence's edge) or ``"dilated"`` (every s-th key in a band);
    * several segments: ``"strided"`` / ``"dilated"`` when one is; ``"global_window"``
      for bands plus a segment of leading columns (global or sink tokens);
    * ``"other"`` for anything else (including an empty mask).

    The transposed layouts of these masks (the backward dk/dv walk) get the same
    names, except where global tokens are asymmetric (sinks): ``"other"``.

    Example:
      >>> import numpy as np, acsr
      >>> i, j = np.arange(64)[:, None], np.arange(64)[None, :]
      >>> acsr.pattern_family(acsr.from_dense((j <= i) & (i - j < 8)))
      'causal_window'
    """
    if layout.grid is not None:
        return "neighborhood"
    if layout.residual is not None:
        return "residual"
    kinds = [_segment_family(s, layout.q_len, layout.kv_len) for s in layout.segments if s.width > 0]
    if not kinds:
        return "other"
    if len(kinds) == 1:
        return "other" if kinds[0] == "prefix" else kinds[0]
    if "strided" in kinds or "dilated" in kinds:
        return "strided" if "strided" in kinds else "dilated"
    bands = {"window", "causal_window"}
    if "prefix" in kinds and bands & set(kinds) and set(kinds) <= bands | {"prefix", "full", "causal"}:
        return "global_window"
    return "other"
