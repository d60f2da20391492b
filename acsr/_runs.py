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
    nnz = int(indices.shape[0])
    if nnz == 0:
        z = np.zeros((n, 0), np.int64)
        return z, z + 1, z
    cols = indices.astype(np.int64)
    row = np.repeat(np.arange(n), np.diff(indptr))
    same_next = np.zeros(nnz, bool)
    same_next[:-1] = row[1:] == row[:-1]
    step = np.zeros(nnz, np.int64)  # cols[i + 1] - cols[i] where in-row
    step[:-1] = cols[1:] - cols[:-1]
    right = same_next & (step == 1)
    left = np.zeros(nnz, bool)
    left[1:] = right[:-1]
    contiguous = left | right

    # contiguous runs: start where the left neighbour is absent
    c_start = np.flatnonzero(contiguous & ~left)
    c_end = np.flatnonzero(contiguous & ~right)  # inclusive ends, aligned with starts
    run_row = [row[c_start]]
    run_base = [cols[c_start]]
    run_stride = [np.ones(c_start.size, np.int64)]
    run_count = [c_end - c_start + 1]

    # isolated columns: greedy equal-difference grouping within each row
    iso = np.flatnonzero(~contiguous)
    if iso.size:
        ir, ic = row[iso], cols[iso]
        m = iso.size
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
            length = same_len[starts] + 1  # elements in this run
            s_list.append(starts)
            c_list.append(length)
            nxt = starts + length
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


def runs_from_dense(chunk: np.ndarray):
    """Canonical runs of each row of a boolean ``[n, kv_len]`` chunk."""
    rows, cols = np.nonzero(chunk)
    indptr = np.zeros(chunk.shape[0] + 1, np.int64)
    np.cumsum(np.bincount(rows, minlength=chunk.shape[0]), out=indptr[1:])
    return runs_from_csr(indptr, cols)


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
