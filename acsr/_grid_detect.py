"""Finding grid products in masks that arrive as rows (dense chunks, CSR, runs).

A mask built by :func:`splat.masks.neighborhood` carries its grid; the same mask
written as a predicate on flat indices, a boolean array or CSR does not. So that
one mask has one layout, the builders of :mod:`acsr._build` ask here, for a
square mask some of whose rows need more than ``MAX_SEGMENTS`` runs, whether it
is a grid product (:mod:`acsr._grid`), and then build it with
:func:`acsr.from_grid`, as the constructor does.

How (:func:`find_grid`): a grid product over ``(..., n)`` is the product of a mask
over the outer tokens and an axis of length ``n``: token ``x = u * n + v`` sees
keys ``u' * n + v'`` with ``u'`` seen by ``u`` on the outer mask and ``v'`` by
``v`` on the axis. For each divisor ``n`` of the size the rows
are cut into blocks of ``n`` columns: every occupied block of a row holds the
same offsets (the axis's keys for ``v``), and the occupied blocks are the outer
mask's row ``u``. The axis is read from the ``n`` rows of one block of queries,
the outer mask from the ``size / n`` rows at one place in their blocks (so
divisors are tried in order of ``n + size / n``), and the outer mask, now held
whole, is factored the same way until it is one axis. Cheap tests on a sample
of rows discard most divisors before any rows are read. Any factorisation will
do: :func:`acsr._grid.canonical` makes the layout independent of it.

The result is checked on the rows read so far only; the caller compares it
with every row of the mask (:class:`GridRows`: runs against runs, dense chunks
against the product's columns) before using it, so a mask that is not exactly
a grid product never gets a grid layout.

Rows are handled as CSR pieces: ``(indptr, cols)``, int64 ``[rows + 1]`` and
``[nnz]``, columns ascending within each row. A *reader* maps ascending, unique
row indices (int64 ``[r]``) to the CSR of those rows.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from acsr._grid import GridAxis, GridWindows, canonical_axis
from acsr._grid_factor import common_step, divisors
from acsr._runs import csr_from_runs, runs_are_canonical, runs_from_csr

__all__ = ["GridRows", "find_grid", "grid_of_runs"]

CSR = tuple[np.ndarray, np.ndarray]
Reader = Callable[[np.ndarray], CSR]

_SAMPLE_ROWS = 32  # rows, besides the reference row and its neighbours, that every candidate must fit


# --- CSR pieces ---------------------------------------------------------------------------------


def _take_rows(indptr: np.ndarray, cols: np.ndarray, rows: np.ndarray) -> CSR:
    """The CSR of ``rows`` of a CSR."""
    counts = np.diff(indptr)[rows]
    out = np.zeros(rows.size + 1, np.int64)
    np.cumsum(counts, out=out[1:])
    src = np.repeat(indptr[rows] - out[:-1], counts) + np.arange(out[-1])
    return out, cols[src]


def _rows_of(indptr: np.ndarray) -> np.ndarray:
    return np.repeat(np.arange(indptr.size - 1), np.diff(indptr))


def _progressions(indptr: np.ndarray, cols: np.ndarray):
    """Each row as one progression: ``(first, count, step, ok)``, int64 ``[rows]`` (``ok`` bool):
    ``ok`` where the row's columns are equally spaced; ``first`` 0 and ``step`` 1 where
    they do not say (empty rows, rows of one column)."""
    n = indptr.size - 1
    count = np.diff(indptr)
    head = indptr[:-1]
    if cols.size == 0:
        z = np.zeros(n, np.int64)
        return z, z, z + 1, np.ones(n, bool)
    first = np.where(count > 0, cols[np.minimum(head, cols.size - 1)], 0)
    step = np.where(count > 1, cols[np.minimum(head + 1, cols.size - 1)] - first, 1)
    row = _rows_of(indptr)
    gap = np.empty_like(cols)
    gap[1:] = cols[1:] - cols[:-1]
    inside = np.ones(cols.size, bool)
    inside[head[count > 0]] = False
    bad = inside & (gap != step[row])
    return first, count, step, np.bincount(row[bad], minlength=n) == 0


def _blocks(indptr: np.ndarray, cols: np.ndarray, n: int):
    """Each row cut into blocks of ``n`` columns.

    Returns:
      ``(ok, outer, inner)``: ``ok`` bool ``[rows]``, True where every occupied block
      of the row holds the same offsets; ``outer`` the CSR of the occupied blocks;
      ``inner`` the CSR of the offsets in the row's first occupied block.
    """
    rows = indptr.size - 1
    row = _rows_of(indptr)
    block, offset = np.divmod(cols, n)
    new = np.ones(cols.size, bool)
    new[1:] = (row[1:] != row[:-1]) | (block[1:] != block[:-1])
    start = np.flatnonzero(new)
    size = np.diff(np.append(start, cols.size))
    group = np.cumsum(new) - 1
    head = indptr[:-1][row]  # each element's row's first element
    first_group = group[head]
    first_size = size[first_group]
    pos = np.arange(cols.size) - start[group]
    bad = size[group] != first_size
    bad |= offset != offset[head + np.minimum(pos, first_size - 1)]
    ok = np.bincount(row[bad], minlength=rows) == 0

    outer_ptr = np.zeros(rows + 1, np.int64)
    np.cumsum(np.bincount(row[start], minlength=rows), out=outer_ptr[1:])
    in_first = group == first_group
    inner_ptr = np.zeros(rows + 1, np.int64)
    np.cumsum(np.bincount(row[in_first], minlength=rows), out=inner_ptr[1:])
    return ok, (outer_ptr, block[start]), (inner_ptr, offset[in_first])


def _rows_equal(indptr: np.ndarray, cols: np.ndarray, target: np.ndarray) -> bool:
    """Whether every non-empty row of a CSR holds exactly the columns ``target``."""
    count = np.diff(indptr)
    if np.any(count[count > 0] != target.size):
        return False
    return not target.size or bool(np.all(cols.reshape(-1, target.size) == target))


def _one_axis(n: int, indptr: np.ndarray, cols: np.ndarray) -> GridAxis | None:
    """The rows of a whole ``n x n`` mask as one axis, where each is one progression of one step."""
    first, count, step, ok = _progressions(indptr, cols)
    dilation = common_step(step, count)
    if not ok.all() or dilation is None:
        return None
    return canonical_axis(n, dilation, first, count)


# --- the product of tables, at chosen rows -----------------------------------------------------


def _product_rows(axes: list[GridAxis], rows: np.ndarray) -> CSR:
    """CSR of the keys the product of ``axes`` gives the query tokens ``rows`` (int64 ``[r]``)."""
    grid = [a.length for a in axes]
    steps = [int(np.prod(grid[i + 1 :])) for i in range(len(grid))]
    cols = np.zeros((rows.size, 1), np.int64)
    live = np.ones((rows.size, 1), bool)
    for a, step in zip(axes, steps, strict=True):
        x = rows // step % a.length
        width = int(a.count.max(initial=0))
        t = np.arange(width)
        keys = (a.first[x].astype(np.int64)[:, None] + a.dilation * t) * step
        cols = (cols[:, :, None] + keys[:, None, :]).reshape(rows.size, -1)
        live = (live[:, :, None] & (t < a.count[x][:, None])[:, None, :]).reshape(rows.size, -1)
    indptr = np.zeros(rows.size + 1, np.int64)
    np.cumsum(live.sum(axis=1), out=indptr[1:])
    return indptr, cols[live]


def _same_csr(a: CSR, b: CSR) -> bool:
    return np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])


# --- factoring ------------------------------------------------------------------------------------


def _split(read: Reader, size: int, n: int, ref: int) -> tuple[CSR, GridAxis] | None:
    """The mask as (outer mask, axis of length ``n``), read at the rows of ``ref``'s block
    (the axis) and at ``ref``'s place in every block (the outer mask), or None where those
    rows are no such product. ``ref`` must see some key."""
    u0, v0 = divmod(ref, n)
    ok, outer, inner = _blocks(*read(u0 * n + np.arange(n)), n)
    ref_outer = outer[1][outer[0][v0] : outer[0][v0 + 1]]
    if not ok.all() or not _rows_equal(*outer, ref_outer):
        return None
    first, count, step, ok = _progressions(*inner)
    dilation = common_step(step, count)
    if not ok.all() or dilation is None:
        return None
    axis = canonical_axis(n, dilation, first, count)
    ref_inner = inner[1][inner[0][v0] : inner[0][v0 + 1]]
    ok, outer, inner = _blocks(*read(np.arange(size // n) * n + v0), n)
    if not ok.all() or not _rows_equal(*inner, ref_inner):
        return None
    return outer, axis


def _fits(csr: CSR, n: int) -> bool:
    """Cheap test of a divisor on known rows: blocks of ``n`` agree and hold progressions."""
    ok, _, inner = _blocks(*csr, n)
    return bool(ok.all()) and bool(_progressions(*inner)[3].all())


def _factor(read: Reader, size: int, ref: int, known: np.ndarray, whole: bool) -> list[GridAxis] | None:
    """Axes whose product agrees with the mask on the rows ``known`` (all rows where
    ``whole``, then the answer is exact), outermost first; None where none is found."""
    csr = read(known)
    if whole:
        axis = _one_axis(size, *csr)
        if axis is not None:
            return [axis]
    for n in sorted(divisors(size), key=lambda n: (n + size // n, n)):  # fewest rows to read first
        if not _fits(csr, n):
            continue
        split = _split(read, size, n, ref)
        if split is None:
            continue
        (outer_ptr, outer_cols), axis = split
        m = size // n
        sub = _factor(
            lambda rows, p=outer_ptr, c=outer_cols: _take_rows(p, c, rows), m, ref // n, np.arange(m), True
        )
        if sub is not None and _same_csr(_product_rows(sub + [axis], known), csr):
            return sub + [axis]
    return None


def find_grid(size: int, read: Reader, ref: int) -> GridWindows | None:
    """A grid product over the ``size`` tokens of a square mask that agrees with it on every
    row read (not yet on all rows: compare with :class:`GridRows`), or None.

    Args:
      size: ``q_len == kv_len``.
      read: the mask's rows: ascending unique int64 row indices ``[r]`` -> CSR.
      ref: a row that sees keys, best one needing many runs (its blocks pick the divisors).
    """
    rng = np.random.default_rng(size)  # a fixed sample per size: the same mask, the same answer
    near = [ref - 1, ref, ref + 1]
    known = np.unique(np.clip(np.concatenate([near, rng.integers(0, size, _SAMPLE_ROWS)]), 0, size - 1))
    axes = _factor(read, size, ref, known, False)
    return None if axes is None or len(axes) < 2 else GridWindows(tuple(axes))


# --- checking every row ---------------------------------------------------------------------------


class GridRows:
    """The rows of a grid product, to compare a mask with, a piece of rows at a time."""

    def __init__(self, windows: GridWindows):
        self.windows = windows
        self.base, self.stride, self.count = windows.product_runs()  # int64 [size, R]
        self._canonical = None

    def canonical_runs(self):
        """The product's canonical runs (``acsr._runs``), int64 ``[size, K]`` each."""
        if self._canonical is None:
            if runs_are_canonical(self.base, self.count, self.windows.axes[-1].dilation):
                self._canonical = (self.base, self.stride, self.count)
            else:
                self._canonical = runs_from_csr(*self.windows.csr())
        return self._canonical

    def equals_runs(self, r0: int, base: np.ndarray, stride: np.ndarray, count: np.ndarray) -> bool:
        """Whether canonical runs ``[r, K]`` of rows ``r0 ..`` are the product's."""
        r1 = r0 + base.shape[0]
        mine = [x[r0:r1] for x in self.canonical_runs()]
        theirs = [base, stride, count]
        k = int((count > 0).sum(axis=1).max(initial=0))
        if int((mine[2] > 0).sum(axis=1).max(initial=0)) != k:
            return False
        return all(np.array_equal(a[:, :k], b[:, :k]) for a, b in zip(mine, theirs, strict=True))

    def equals_dense(self, r0: int, chunk: np.ndarray) -> bool:
        """Whether boolean rows ``chunk`` ``[r, size]`` from row ``r0`` on are the product's."""
        r = chunk.shape[0]
        base, count = self.base[r0 : r0 + r], self.count[r0 : r0 + r]
        t = np.arange(int(count.max(initial=0)))
        cols = base[:, :, None] + self.windows.axes[-1].dilation * t
        live = t < count[:, :, None]
        flat = (np.arange(r)[:, None, None] * chunk.shape[1] + cols)[live]
        if np.count_nonzero(chunk) != flat.size:
            return False
        return bool(np.ravel(chunk)[flat].all())


def grid_of_runs(base: np.ndarray, stride: np.ndarray, count: np.ndarray) -> GridWindows | None:
    """The grid product whose canonical runs are ``(base, stride, count)`` (int64
    ``[size, K]`` of a square mask), or None where the mask is no grid product."""
    size = base.shape[0]
    live = (count > 0).sum(axis=1)
    if size < 4 or not live.any():
        return None
    windows = find_grid(
        size, lambda rows: csr_from_runs(base[rows], stride[rows], count[rows]), int(np.argmax(live))
    )
    if windows is None or not GridRows(windows).equals_runs(0, base, stride, count):
        return None
    return windows
