"""Rows of columns <-> canonical runs (arithmetic progressions), vectorised.

The canonical decomposition of one row's sorted column set, which every path
(mask constructors, combinators, the analyzer, the transpose) produces:

1. A column with a neighbour (``c - 1`` or ``c + 1`` also in the row) belongs
   to a *contiguous run*: a maximal stride-1 run of two or more columns.
2. The remaining *isolated* columns, in ascending order, are grouped greedily:
   a run starts at the first ungrouped column, takes the next one, and goes on
   while the difference stays the same. Its stride is that difference.
3. Runs are ordered by first column; a run of one column has stride 1.

Everything here works on CSR row chunks (``indptr``, ``indices`` with columns
sorted within each row) and never loops over columns in Python.
"""

from __future__ import annotations

import numpy as np


def runs_from_csr(indptr: np.ndarray, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Canonical runs of each row of a CSR chunk.

    Args:
      indptr: int ``[n + 1]`` row pointers.
      indices: int ``[nnz]`` columns, ascending within each row.

    Returns:
      ``(base, stride, count)``, each int64 ``[n, K]`` with ``K`` the largest
      number of runs in a row; slots past a row's runs have count 0, base 0,
      stride 1.
    """
    n = indptr.shape[0] - 1
    cols = indices.astype(np.int64)
    row = np.repeat(np.arange(n), np.diff(indptr))
    # maximal stride-1 runs: a new one starts where the left neighbour is absent
    new = np.ones(cols.size, bool)
    new[1:] = (row[1:] != row[:-1]) | (cols[1:] != cols[:-1] + 1)
    first = np.flatnonzero(new)
    length = np.diff(np.append(first, cols.size))
    return _canonical_runs(n, row[first], cols[first], length)


def runs_from_dense(chunk: np.ndarray):
    """Canonical runs of each row of a boolean ``[n, kv_len]`` chunk.

    Reads only the run boundaries (where a row changes value), never a list of
    all nonzeros.
    """
    n, kv = chunk.shape
    padded = np.zeros((n, kv + 2), bool)
    padded[:, 1:-1] = chunk
    rows, pos = np.nonzero(padded[:, 1:] != padded[:, :-1])  # alternating run starts and ends per row
    return _canonical_runs(n, rows[0::2], pos[0::2], pos[1::2] - pos[0::2])


def _canonical_runs(n: int, row: np.ndarray, start: np.ndarray, length: np.ndarray):
    """Canonical runs from each row's maximal stride-1 runs (ascending within rows)."""
    if row.size == 0:
        z = np.zeros((n, 0), np.int64)
        return z, z + 1, z
    row, start, length = row.astype(np.int64), start.astype(np.int64), length.astype(np.int64)
    long = length >= 2
    run_row, run_base = [row[long]], [start[long]]
    run_stride, run_count = [np.ones(int(long.sum()), np.int64)], [length[long]]

    # isolated columns (runs of one): greedy equal-difference grouping within each row
    ir, ic = row[~long], start[~long]
    m = ir.size
    if m:
        has_next = np.zeros(m, bool)
        has_next[:-1] = ir[1:] == ir[:-1]
        d = np.zeros(m, np.int64)
        d[:-1] = ic[1:] - ic[:-1]
        d[~has_next] = -1
        # same_len[j]: how many consecutive j' >= j share d[j] (all with a next)
        brk = np.ones(m, bool)
        brk[1:] = (d[1:] != d[:-1]) | ~has_next[:-1] | ~has_next[1:]
        grp = np.cumsum(brk) - 1
        grp_end = np.zeros(grp[-1] + 1, np.int64)
        np.maximum.at(grp_end, grp, np.arange(m))
        same_len = np.where(has_next, grp_end[grp] - np.arange(m) + 1, 0)
        first_of_row = np.ones(m, bool)
        first_of_row[1:] = ir[1:] != ir[:-1]
        starts = np.flatnonzero(first_of_row)
        s_list, c_list = [], []
        while starts.size:
            take = same_len[starts] + 1  # elements in this run
            s_list.append(starts)
            c_list.append(take)
            nxt = starts + take
            ok = nxt < m
            ok[ok] = ir[nxt[ok]] == ir[starts[ok]]
            starts = nxt[ok]
        s = np.concatenate(s_list)
        cnt = np.concatenate(c_list)
        run_row.append(ir[s])
        run_base.append(ic[s])
        run_stride.append(np.where(cnt > 1, d[s], 1))
        run_count.append(cnt)

    rr = np.concatenate(run_row)
    rb = np.concatenate(run_base)
    rs = np.concatenate(run_stride)
    rc = np.concatenate(run_count)
    order = np.lexsort((rb, rr))
    rr, rb, rs, rc = rr[order], rb[order], rs[order], rc[order]
    per_row = np.bincount(rr, minlength=n)
    k_max = int(per_row.max())
    first = np.zeros(n + 1, np.int64)
    np.cumsum(per_row, out=first[1:])
    slot = np.arange(rr.size) - first[rr]
    base = np.zeros((n, k_max), np.int64)
    stride = np.ones((n, k_max), np.int64)
    count = np.zeros((n, k_max), np.int64)
    base[rr, slot], stride[rr, slot], count[rr, slot] = rb, rs, rc
    return base, stride, count


def csr_from_runs(base: np.ndarray, stride: np.ndarray, count: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Expands runs ``[n, K]`` to CSR (columns sorted within rows)."""
    n = base.shape[0]
    count = count.astype(np.int64)
    per_row = count.sum(axis=1)
    indptr = np.zeros(n + 1, np.int64)
    np.cumsum(per_row, out=indptr[1:])
    flat_c = count.ravel()
    total = int(flat_c.sum())
    if total == 0:
        return indptr, np.zeros(0, np.int64)
    run_first = np.zeros(flat_c.size, np.int64)
    np.cumsum(flat_c[:-1], out=run_first[1:])
    run_id = np.repeat(np.arange(flat_c.size), flat_c)
    t = np.arange(total) - run_first[run_id]
    cols = base.ravel().astype(np.int64)[run_id] + stride.ravel().astype(np.int64)[run_id] * t
    # runs of one row may interleave: sort within rows
    row = run_id // max(base.shape[1], 1)
    order = np.lexsort((cols, row))
    return indptr, cols[order]


def dense_from_runs(base, stride, count, kv_len: int) -> np.ndarray:
    """Boolean ``[n, kv_len]`` rendering of runs."""
    n = base.shape[0]
    indptr, cols = csr_from_runs(base, stride, count)
    out = np.zeros((n, kv_len), bool)
    out[np.repeat(np.arange(n), np.diff(indptr)), cols] = True
    return out


def merge_intervals(lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """Union of half-open intervals ``[lo, hi)`` per row, as canonical runs.

    ``lo, hi``: int ``[n, K]``; empty intervals (``hi <= lo``) are ignored.
    Returns ``(base, count)`` ``[n, K']`` of stride-1 runs, or ``None`` where
    the result is not canonical as stride-1 runs alone (a row with two or more
    single columns, which the canonical form groups into a progression).
    """
    n, k = lo.shape
    big = np.iinfo(np.int64).max // 4
    empty = hi <= lo
    lo = np.where(empty, big, lo).astype(np.int64)
    hi = np.where(empty, big, hi).astype(np.int64)
    order = np.argsort(lo, axis=1, kind="stable")
    lo = np.take_along_axis(lo, order, 1)
    hi = np.take_along_axis(hi, order, 1)
    reach = np.maximum.accumulate(hi, axis=1)
    new = np.ones((n, k), bool)
    new[:, 1:] = lo[:, 1:] > reach[:, :-1]
    new &= lo < big
    # group ends: the reach just before the next group's start
    gid = np.cumsum(new, axis=1) - 1
    k_out = int(new.sum(axis=1).max()) if n else 0
    base = np.zeros((n, k_out), np.int64)
    end = np.zeros((n, k_out), np.int64)
    valid = lo < big
    rows = np.broadcast_to(np.arange(n)[:, None], (n, k))
    base[rows[new], gid[new]] = lo[new]
    np.maximum.at(end, (rows[valid], gid[valid]), hi[valid])
    count = np.maximum(end - base, 0)
    if np.any((count == 1).sum(axis=1) >= 2):
        return None
    return np.where(count > 0, base, 0), count


def runs_are_canonical(base: np.ndarray, count: np.ndarray, step: int) -> bool:
    """Whether ascending progressions of stride ``step`` ``[S, R]`` (live runs first)
    are already the canonical decomposition of ``acsr._runs``.

    They are when no row holds a single-column run beside other runs (the
    canonical form would group isolated columns differently) and no run joins
    the next one: the gap from a run's last column to the next run's first is
    neither 1 (neighbours: one contiguous run) nor ``step`` (the progression
    would go on).
    """
    live = count > 0
    several = live.sum(axis=1) > 1
    if np.any((count == 1) & several[:, None]):
        return False
    last = base + step * (count - 1)
    gap = base[:, 1:] - last[:, :-1]
    return not np.any(live[:, 1:] & ((gap == 1) | (gap == step)))
