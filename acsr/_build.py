"""Building ACSR layouts: from canonical runs, from dense masks, transposes, checks.

Every builder that sees a mask's rows (runs, CSR, dense chunks) asks
:mod:`acsr._grid_detect` whether a square mask with rows of many runs is a grid
product, so that it gets :func:`from_grid`'s layout, as its constructor would.
"""

from __future__ import annotations

import numpy as np

from acsr._format import ACSR, MAX_SEGMENTS, BlockResidual, LayoutError, Segment
from acsr._grid import GridWindows, canonical
from acsr._grid_detect import GridRows, find_grid, grid_of_runs
from acsr._law import _canonical, fit_closed_form
from acsr._runs import csr_from_runs, merge_intervals, runs_are_canonical, runs_from_csr, runs_from_dense

DEFAULT_BLOCK = (64, 64)


def _check_len(name: str, n) -> int:
    if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n <= 0:
        raise ValueError(f"{name} must be a positive int, got {n!r}")
    return int(n)


def from_runs(
    q_len: int,
    kv_len: int,
    base: np.ndarray,
    stride: np.ndarray,
    count: np.ndarray,
    *,
    block: tuple[int, int] = DEFAULT_BLOCK,
    closed_forms: bool = True,
) -> ACSR:
    """Layout from canonical per-row runs ``[q_len, K]`` (see ``acsr._runs``).

    Rows needing at most :data:`MAX_SEGMENTS` runs become segments with fitted
    closed forms. A square mask with a row needing more that is a grid product
    (:mod:`acsr._grid_detect`, checked on every row) gets :func:`from_grid`'s
    layout; any other goes to the residual whole.
    """
    q_len, kv_len = _check_len("q_len", q_len), _check_len("kv_len", kv_len)
    if base.shape[1] > MAX_SEGMENTS and q_len == kv_len:
        windows = grid_of_runs(base, stride, count)
        if windows is not None:
            return from_grid(windows, block=block)
    return _runs_layout(q_len, kv_len, base, stride, count, block, closed_forms)


def _runs_layout(q_len, kv_len, base, stride, count, block, closed_forms=True) -> ACSR:
    """Segments from canonical runs, or the residual where a row needs more than
    :data:`MAX_SEGMENTS` (no search for a grid: :func:`from_grid` builds its own rows here)."""
    k = base.shape[1]
    if k <= MAX_SEGMENTS:
        segs = []
        for j in range(k):
            b, s, c = _canonical(base[:, j], stride[:, j], count[:, j])
            cf = fit_closed_form(b, s, c) if closed_forms else None
            segs.append(Segment(b, s, c, cf))
        return ACSR(q_len, kv_len, tuple(segs))
    indptr, cols = csr_from_runs(base, stride, count)
    return ACSR(q_len, kv_len, (), residual_from_csr(indptr, cols, q_len, kv_len, block))


def from_grid(windows: GridWindows, *, block: tuple[int, int] = DEFAULT_BLOCK) -> ACSR:
    """The layout of a grid product (:mod:`acsr._grid`): a grid layout of its canonical
    form when that keeps two or more axes and some row needs more than
    :data:`MAX_SEGMENTS` progressions; otherwise segments (or the residual), as
    :func:`from_csr` gives for the same mask."""
    w = canonical(windows)
    s = w.size
    base, stride, count = w.product_runs()
    if runs_are_canonical(base, count, w.axes[-1].dilation):
        runs = base, stride, count
    else:
        runs = runs_from_csr(*w.csr())
    if len(w.axes) >= 2 and base.shape[1] > MAX_SEGMENTS and runs[0].shape[1] > MAX_SEGMENTS:
        return ACSR(s, s, (), None, grid=w)
    return _runs_layout(s, s, *runs, block)


def residual_from_csr(indptr, cols, q_len: int, kv_len: int, block=DEFAULT_BLOCK) -> BlockResidual:
    """Block-sparse residual holding exactly the CSR's nonzeros."""
    bq, bkv = block
    n_qb = -(-q_len // bq)
    rows = np.repeat(np.arange(q_len), np.diff(indptr))
    rb, cb = rows // bq, cols // bkv
    n_kvb = -(-kv_len // bkv)
    pair = np.unique(rb * n_kvb + cb)
    prb, pcb = pair // n_kvb, pair % n_kvb
    num = np.bincount(prb, minlength=n_qb)
    max_blocks = int(num.max()) if num.size else 0
    first = np.zeros(n_qb + 1, np.int64)
    np.cumsum(num, out=first[1:])
    slot = np.arange(pair.size) - first[prb]
    kv_blocks = np.full((n_qb, max_blocks), -1, np.int32)
    kv_blocks[prb, slot] = pcb
    bits = np.zeros((n_qb, max_blocks, bq, bkv), bool)
    nz_slot = slot[np.searchsorted(pair, rb * n_kvb + cb)]
    bits[rb, nz_slot, rows % bq, cols % bkv] = True
    return BlockResidual(bq, bkv, kv_blocks, num.astype(np.int32), bits)


def _pad_k(parts: list[np.ndarray], fill: int) -> np.ndarray:
    k = max(p.shape[1] for p in parts)
    return np.concatenate([np.pad(p, ((0, 0), (0, k - p.shape[1])), constant_values=fill) for p in parts])


def from_row_chunks(q_len: int, kv_len: int, chunks, **kw) -> ACSR:
    """Layout from an iterable of ``(base, stride, count)`` runs, one per row chunk."""
    bs, ss, cs = [], [], []
    for b, s, c in chunks:
        bs.append(b), ss.append(s), cs.append(c)
    return from_runs(q_len, kv_len, _pad_k(bs, 0), _pad_k(ss, 1), _pad_k(cs, 0), **kw)


def _run_bound(chunk: np.ndarray) -> np.ndarray:
    """A lower bound on each row's canonical runs, int64 ``[rows]``: its contiguous
    runs (two or more adjacent columns), plus one if it has any isolated column."""
    left = np.zeros_like(chunk)
    left[:, 1:] = chunk[:, :-1]
    right = np.zeros_like(chunk)
    right[:, :-1] = chunk[:, 1:]
    start = chunk & ~left
    return (start & right).sum(axis=1) + (start & ~right).any(axis=1)


def _residual_chunk(chunk: np.ndarray, block) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(kv_blocks, num_blocks, bits) of a dense chunk whose row count is a multiple of block_q
    (or the last chunk)."""
    bq, bkv = block
    n, kv = chunk.shape
    nqb, nkb = -(-n // bq), -(-kv // bkv)
    padded = np.zeros((nqb * bq, nkb * bkv), bool)
    padded[:n, :kv] = chunk
    blocks = padded.reshape(nqb, bq, nkb, bkv).transpose(0, 2, 1, 3)
    present = blocks.any(axis=(2, 3))
    num = present.sum(axis=1)
    width = int(num.max(initial=0))
    order = np.argsort(~present, axis=1, kind="stable")[:, :width]
    used = np.arange(width) < num[:, None]
    kv_blocks = np.where(used, order, -1)
    bits = blocks[np.arange(nqb)[:, None], order] & used[:, :, None, None]
    return kv_blocks, num, bits


def from_dense_chunks(
    q_len: int,
    kv_len: int,
    make_chunk,
    *,
    block=DEFAULT_BLOCK,
    chunk_rows: int = 1024,
    make_rows=None,
) -> ACSR:
    """Layout of a mask given as ``make_chunk(r0, r1) -> bool [r1 - r0, kv_len]``.

    Peak memory is one chunk plus the layout. An irregular mask (some row needs
    more than MAX_SEGMENTS runs) is detected cheaply; if it is square and a grid
    product (:mod:`acsr._grid_detect`: found from a few rows, then compared with
    every chunk) it gets :func:`from_grid`'s layout, else it is stored as a
    residual. ``make_rows(rows) -> bool [len(rows), kv_len]``, for ascending row
    indices, reads the scattered rows that search needs (default: through
    ``make_chunk``, one call per run of consecutive rows).
    """
    q_len, kv_len = _check_len("q_len", q_len), _check_len("kv_len", kv_len)
    step = max(block[0], chunk_rows // block[0] * block[0])
    starts = range(0, q_len, step)
    parts = []
    for r0 in starts:
        c = make_chunk(r0, min(q_len, r0 + step))
        bound = _run_bound(c)
        if bound.max(initial=0) > MAX_SEGMENTS:
            break
        parts.append(runs_from_dense(c))
    else:
        return from_row_chunks(q_len, kv_len, parts, block=block)
    if q_len == kv_len:
        rows = make_rows or _rows_from_chunks(make_chunk)
        windows = _grid_of_chunks(q_len, make_chunk, rows, parts, (r0, c), r0 + int(np.argmax(bound)), step)
        if windows is not None:
            return from_grid(windows, block=block)
    pieces = [_residual_chunk(make_chunk(r0, min(q_len, r0 + step)), block) for r0 in starts]
    width = max(p[0].shape[1] for p in pieces)
    kv_blocks = np.concatenate(
        [np.pad(p[0], ((0, 0), (0, width - p[0].shape[1])), constant_values=-1) for p in pieces]
    )
    bits = np.concatenate(
        [np.pad(p[2], ((0, 0), (0, width - p[2].shape[1]), (0, 0), (0, 0))) for p in pieces]
    )
    num = np.concatenate([p[1] for p in pieces])
    return ACSR(q_len, kv_len, (), BlockResidual(block[0], block[1], kv_blocks, num, bits))


def _rows_from_chunks(make_chunk):
    """``make_rows`` through ``make_chunk``: one call per run of consecutive rows."""

    def make_rows(rows: np.ndarray) -> np.ndarray:
        groups = np.split(rows, np.flatnonzero(np.diff(rows) != 1) + 1)
        return np.concatenate([make_chunk(int(g[0]), int(g[-1]) + 1) for g in groups])

    return make_rows


def _grid_of_chunks(size: int, make_chunk, make_rows, parts, current, ref: int, step: int):
    """The grid product equal to a square mask given as chunks, or None.

    ``parts``: canonical runs of the chunks already read (rows ``0 ..``); ``current``:
    ``(r0, chunk)``, the chunk read last (the first with a row of many runs, ``ref``).
    The candidate is compared with those, then with every later chunk as it is made.
    """

    def read(rows):
        rows_hit, cols = np.nonzero(make_rows(rows))
        indptr = np.zeros(rows.size + 1, np.int64)
        np.cumsum(np.bincount(rows_hit, minlength=rows.size), out=indptr[1:])
        return indptr, cols.astype(np.int64)

    windows = find_grid(size, read, ref)
    if windows is None:
        return None
    check = GridRows(windows)
    r = 0
    for base, stride, count in parts:
        if not check.equals_runs(r, base, stride, count):
            return None
        r += base.shape[0]
    at, chunk = current
    if not check.equals_dense(at, chunk):
        return None
    for r0 in range(at + step, size, step):
        if not check.equals_dense(r0, make_chunk(r0, min(size, r0 + step))):
            return None
    return windows


def from_dense(mask, *, block: tuple[int, int] = DEFAULT_BLOCK, chunk_rows: int = 1024) -> ACSR:
    """Layout of a boolean ``[q_len, kv_len]`` array (numpy or a concrete jax array)."""
    mask = np.asarray(mask)
    if mask.ndim != 2:
        raise ValueError(f"mask must be 2-D [q_len, kv_len], got shape {mask.shape}")
    if mask.dtype != np.bool_:
        raise TypeError(f"mask must be a boolean array, got dtype {mask.dtype}")
    q_len, kv_len = mask.shape
    return from_dense_chunks(
        q_len,
        kv_len,
        lambda r0, r1: mask[r0:r1],
        block=block,
        chunk_rows=chunk_rows,
        make_rows=lambda rows: mask[rows],
    )


def to_csr(layout: ACSR) -> tuple[np.ndarray, np.ndarray]:
    """All nonzeros as CSR ``(indptr [q_len + 1], columns)``, sorted within rows."""
    if layout.grid is not None:
        return layout.grid.csr()
    parts_b, parts_s, parts_c = [], [], []
    for s in layout.segments:
        parts_b.append(s.base[:, None]), parts_s.append(s.stride[:, None]), parts_c.append(s.count[:, None])
    cols_list = []
    if parts_b:
        indptr, cols = csr_from_runs(np.hstack(parts_b), np.hstack(parts_s), np.hstack(parts_c))
        cols_list.append((np.repeat(np.arange(layout.q_len), np.diff(indptr)), cols))
    if layout.residual is not None:
        cols_list.append(layout.residual.nonzeros())
    if not cols_list:
        return np.zeros(layout.q_len + 1, np.int64), np.zeros(0, np.int64)
    rows = np.concatenate([c[0] for c in cols_list])
    cols = np.concatenate([c[1] for c in cols_list])
    order = np.lexsort((cols, rows))
    indptr = np.zeros(layout.q_len + 1, np.int64)
    np.cumsum(np.bincount(rows, minlength=layout.q_len), out=indptr[1:])
    return indptr, cols[order]


def from_csr(q_len: int, kv_len: int, indptr, cols, *, block=DEFAULT_BLOCK, chunk_rows: int = 4096) -> ACSR:
    """Layout of a CSR mask, canonicalised in row chunks."""

    def chunks():
        for i in range(0, q_len, chunk_rows):
            j = min(q_len, i + chunk_rows)
            p = indptr[i : j + 1]
            yield runs_from_csr(p - p[0], cols[p[0] : p[-1]])

    return from_row_chunks(q_len, kv_len, chunks(), block=block)


def _segment_transpose(seg, q_len: int, kv_len: int):
    """Per-column row progressions ``(base, stride, count)`` ``[kv_len]`` of one segment's transpose.

    Needs a uniform stride ``s`` whose phase follows the row (``base[r] - r`` is
    constant mod ``s``) and, within each class of rows ``r = p (mod s)``,
    non-empty rows forming one run with non-decreasing ``base`` and ``end``:
    then the rows that hit a column form one progression. Returns None otherwise.
    """
    s = seg.uniform_stride
    nonempty = np.flatnonzero(seg.count > 0)
    if s is None or nonempty.size == 0:
        return None if s is None else (np.zeros(kv_len, np.int64),) * 3
    base = seg.base.astype(np.int64)
    end = seg.end()
    phase = np.unique((base[nonempty] - nonempty) % s)
    if phase.size != 1:
        return None
    phi = int(phase[0])
    t_base = np.zeros(kv_len, np.int64)
    t_count = np.zeros(kv_len, np.int64)
    for p in range(min(s, q_len)):
        rows = np.arange(p, q_len, s)
        ne = np.flatnonzero(seg.count[rows] > 0)
        if ne.size == 0:
            continue
        if ne[-1] - ne[0] + 1 != ne.size:
            return None
        rows = rows[ne[0] : ne[-1] + 1]
        b, e = base[rows], end[rows]
        if np.any(np.diff(b) < 0) or np.any(np.diff(e) < 0):
            return None
        cols = np.arange((p + phi) % s, kv_len, s)
        lo = np.searchsorted(e, cols, side="right")  # first row whose end passes c
        hi = np.searchsorted(b, cols, side="right")  # rows whose base is <= c
        n = np.maximum(hi - lo, 0)
        t_base[cols] = np.where(n > 0, rows[np.minimum(lo, rows.size - 1)], 0)
        t_count[cols] = n
    return t_base, np.full(kv_len, s, np.int64), t_count


_MAX_RANGES = 8  # monotone row ranges per segment the analytic transpose handles


def _interval_transpose(seg, kv_len: int):
    """Per-column row intervals ``[lo, hi)`` of a stride-1 segment's transpose, one pair of
    ``[kv_len]`` arrays per range of rows on which ``base`` and ``end`` do not decrease."""
    rows = np.flatnonzero(seg.count > 0)
    base, end = seg.base.astype(np.int64)[rows], seg.end()[rows]
    cut = np.flatnonzero((np.diff(rows) != 1) | (np.diff(base) < 0) | (np.diff(end) < 0)) + 1
    if cut.size >= _MAX_RANGES:
        return None
    cols = np.arange(kv_len)
    parts = []
    for r, b, e in zip(np.split(rows, cut), np.split(base, cut), np.split(end, cut), strict=True):
        lo = r[0] + np.searchsorted(e, cols, side="right")
        hi = r[0] + np.searchsorted(b, cols, side="right")
        parts.append((lo, np.maximum(hi, lo)))
    return parts


def _fast_transpose(layout: ACSR) -> ACSR | None:
    if layout.residual is not None or not layout.segments:
        return None
    q_len, kv_len = layout.q_len, layout.kv_len
    if len(layout.segments) == 1 and layout.segments[0].uniform_stride != 1:
        part = _segment_transpose(layout.segments[0], q_len, kv_len)
        if part is None:
            return None
        b, st, c = part
        return from_runs(kv_len, q_len, b[:, None], np.where(c > 1, st, 1)[:, None], c[:, None])
    parts = []
    for seg in layout.segments:
        if seg.uniform_stride != 1:
            return None
        p = _interval_transpose(seg, kv_len)
        if p is None:
            return None
        parts += p
    if not parts:
        return from_runs(kv_len, q_len, *(np.zeros((kv_len, 0), np.int64),) * 3)
    merged = merge_intervals(np.stack([p[0] for p in parts], 1), np.stack([p[1] for p in parts], 1))
    if merged is None:
        return None
    b, c = merged
    return from_runs(kv_len, q_len, b, np.ones_like(b), c)


def transpose(layout: ACSR) -> ACSR:
    """ACSR of the transposed (``kv_len x q_len``) mask.

    Analytic for segments with monotone bounds (windows, causal, block-local,
    dilated and strided patterns and their unions); exact O(nnz) enumeration
    otherwise. Both give the same canonical layout.
    """
    if layout.grid is not None:
        t = layout.grid.transpose()
        return from_grid(t) if t is not None else _enumerated_transpose(layout)
    fast = _fast_transpose(layout)
    if fast is not None:
        return fast
    return _enumerated_transpose(layout)


def _enumerated_transpose(layout: ACSR) -> ACSR:
    indptr, cols = to_csr(layout)
    rows = np.repeat(np.arange(layout.q_len), np.diff(indptr))
    order = np.lexsort((rows, cols))
    t_indptr = np.zeros(layout.kv_len + 1, np.int64)
    np.cumsum(np.bincount(cols, minlength=layout.kv_len), out=t_indptr[1:])
    block = (
        (layout.residual.block_kv, layout.residual.block_q) if layout.residual is not None else DEFAULT_BLOCK
    )
    return from_csr(layout.kv_len, layout.q_len, t_indptr, rows[order], block=block)


def validate(layout: ACSR) -> None:
    """Raises :class:`LayoutError` naming the first broken invariant."""
    q, kv = layout.q_len, layout.kv_len
    if layout.grid is not None:
        _validate_grid(layout)
        return
    if len(layout.segments) > MAX_SEGMENTS:
        raise LayoutError(f"{len(layout.segments)} segments; at most {MAX_SEGMENTS} allowed")
    for k, s in enumerate(layout.segments):
        for name in ("base", "stride", "count"):
            a = getattr(s, name)
            if a.shape != (q,):
                raise LayoutError(f"segment {k}: {name} has shape {a.shape}, expected ({q},)")
        if np.any(s.count < 0):
            raise LayoutError(f"segment {k}: negative count at row {int(np.argmax(s.count < 0))}")
        if np.any(s.stride < 1):
            raise LayoutError(f"segment {k}: stride < 1 at row {int(np.argmax(s.stride < 1))}")
        bad = (s.count > 0) & ((s.base < 0) | (s.end() > kv))
        if np.any(bad):
            r = int(np.argmax(bad))
            raise LayoutError(f"segment {k}: row {r} columns [{s.base[r]}, {s.end()[r]}) leave [0, {kv})")
        if np.any((s.count == 0) & (s.base != 0)) or np.any((s.count <= 1) & (s.stride != 1)):
            raise LayoutError(
                f"segment {k}: padding not canonical (empty rows need base 0, short rows stride 1)"
            )
        if s.closed_form is not None:
            b, st, c = s.closed_form.evaluate(q)
            if not (
                np.array_equal(b, s.base) and np.array_equal(st, s.stride) and np.array_equal(c, s.count)
            ):
                raise LayoutError(f"segment {k}: closed form disagrees with its per-row arrays")
    r = layout.residual
    if r is not None:
        n_qb = -(-q // r.block_q)
        if r.kv_blocks.shape[0] != n_qb or r.bits.shape != (n_qb, r.max_blocks, r.block_q, r.block_kv):
            raise LayoutError(f"residual: arrays do not match {n_qb} row blocks of {r.block_q}x{r.block_kv}")
        used = np.arange(r.max_blocks) < r.num_blocks[:, None]
        if np.any((r.kv_blocks >= 0) != used):
            raise LayoutError("residual: kv_blocks must hold num_blocks entries then -1 padding")
        if np.any(r.bits[~used]):
            raise LayoutError("residual: padding blocks have bits set")
        if np.any((np.diff(r.kv_blocks.astype(np.int64), axis=1) <= 0) & used[:, 1:]):
            raise LayoutError("residual: kv_blocks must be strictly ascending within a row block")
    indptr, cols = to_csr(layout)
    if cols.size and (cols.min() < 0 or cols.max() >= kv):
        raise LayoutError(f"columns outside [0, {kv})")
    rows = np.repeat(np.arange(q), np.diff(indptr))
    if np.unique(rows.astype(np.int64) * kv + cols).size != cols.size:
        raise LayoutError("segments and residual overlap: a (row, column) is stored twice")
    if layout.residual is None:
        again = from_csr(q, kv, indptr, cols)
        if again != layout:
            raise LayoutError("segments are not the canonical decomposition of their mask")


def _validate_grid(layout: ACSR) -> None:
    g = layout.grid
    for i, a in enumerate(g.axes):
        if a.dilation < 1 or np.any(a.count < 0):
            raise LayoutError(f"grid axis {i}: dilation must be >= 1 and counts >= 0")
        bad = (a.count > 0) & ((a.first < 0) | (a.end() > a.length))
        if np.any(bad):
            x = int(np.argmax(bad))
            raise LayoutError(f"grid axis {i}: coordinate {x} sees keys outside [0, {a.length})")
        if np.any((a.count == 0) & (a.first != 0)) or (a.dilation != 1 and not np.any(a.count > 1)):
            raise LayoutError(f"grid axis {i}: padding not canonical (first 0 where empty, dilation 1)")
    if from_grid(g) != layout:
        raise LayoutError("grid is not the canonical layout of its mask")
