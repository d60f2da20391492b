"""Closed forms: integer laws in the row index that describe a segment.

A segment of an ACSR layout is, per row ``r``, one arithmetic progression of
columns ``base(r) + stride * t`` for ``0 <= t < count(r)``. When the analyzer
finds laws that reproduce ``base`` and ``end`` (the last column plus one) from
``r`` alone, the code generator bakes them into the kernel as arithmetic and
no per-row metadata is loaded.

A :class:`Law` is ``v(r) = clamp(a*r + b*((r + e) // div) + c, lo, hi)``. With
``b = 0`` it is affine (a sliding window's edges), with ``a = 0`` a staircase
(block-local), and with ``a = 1, b = -div`` a periodic law (``r mod div``, the
phase of a dilated or strided pattern). A :class:`ClosedForm` is a short list
of :class:`Piece` s, each a pair of laws over a range of rows; rows outside
every piece are empty.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MAX_PIECES = 4  # a segment needing more row pieces keeps only its per-row arrays


@dataclass(frozen=True)
class Law:
    """``v(r) = clamp(a*r + b*((r + e) // div) + c, lo, hi)``; ``None`` bounds are open."""

    a: int
    b: int
    c: int
    div: int = 1
    e: int = 0
    lo: int | None = None
    hi: int | None = None

    def __call__(self, r: np.ndarray) -> np.ndarray:
        r = np.asarray(r, dtype=np.int64)
        v = self.a * r + self.c
        if self.b:
            v = v + self.b * ((r + self.e) // self.div)
        if self.lo is not None or self.hi is not None:
            v = np.clip(v, self.lo, self.hi)
        return v

    def to_string(self) -> str:
        terms = []
        if self.a:
            terms.append("r" if self.a == 1 else f"{self.a}*r")
        if self.b:
            inner = f"(r + {self.e})" if self.e else "r"
            terms.append(f"{self.b}*({inner} // {self.div})")
        if self.c or not terms:
            terms.append(str(self.c))
        s = " + ".join(terms).replace("+ -", "- ")
        if self.lo is not None or self.hi is not None:
            lo = "-inf" if self.lo is None else self.lo
            hi = "inf" if self.hi is None else self.hi
            s = f"clamp({s}, {lo}, {hi})"
        return s


@dataclass(frozen=True)
class Piece:
    """Rows ``[row_start, row_stop)`` of a segment, described by two laws.

    ``base(r)`` is the first column, ``end(r)`` the last column plus one, and the
    row holds ``max(0, ceil((end(r) - base(r)) / stride))`` columns.
    """

    row_start: int
    row_stop: int
    stride: int
    base: Law
    end: Law

    def evaluate(self, r: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Returns ``(base, count)`` for rows ``r`` (all inside this piece)."""
        base = self.base(r)
        end = self.end(r)
        count = np.maximum(0, -((base - end) // self.stride))
        return base, count


@dataclass(frozen=True)
class ClosedForm:
    """A segment's law: pieces over disjoint, ascending row ranges."""

    pieces: tuple[Piece, ...]

    def evaluate(self, q_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per-row ``(base, stride, count)`` int32 arrays, canonical as in ACSR."""
        base = np.zeros(q_len, np.int64)
        stride = np.ones(q_len, np.int64)
        count = np.zeros(q_len, np.int64)
        for p in self.pieces:
            r = np.arange(p.row_start, p.row_stop)
            b, n = p.evaluate(r)
            base[r], count[r] = b, n
            stride[r] = p.stride
        return _canonical(base, stride, count)

    def to_string(self) -> str:
        parts = []
        for p in self.pieces:
            parts.append(
                f"rows [{p.row_start}, {p.row_stop}): base = {p.base.to_string()}, "
                f"end = {p.end.to_string()}, stride {p.stride}"
            )
        return "; ".join(parts)


def _canonical(base, stride, count):
    """Canonical per-row arrays: empty rows have base 0, rows of <= 1 column stride 1."""
    count = np.asarray(count, np.int64)
    base = np.where(count > 0, base, 0)
    stride = np.where(count > 1, stride, 1)
    return base.astype(np.int32), stride.astype(np.int32), count.astype(np.int32)


# --- fitting -----------------------------------------------------------------


def fit_law(rows: np.ndarray, v: np.ndarray) -> Law | None:
    """The simplest :class:`Law` with ``law(rows) == v`` exactly, or ``None``.

    Deterministic in ``(rows, v)``: the analyzer and the mask constructors call
    it on equal arrays and so agree on the closed form. Candidates, in order:
    no clamp, clamp below, clamp above, both; within each, the slope is the
    commonest step between adjacent rows, and steps that differ from it reveal
    the period ``div``, its offset ``e`` and the jump ``b``.
    """
    rows = np.asarray(rows, np.int64)
    v = np.asarray(v, np.int64)
    if rows.size == 0:
        return None
    vmin, vmax = int(v.min()), int(v.max())
    if vmin == vmax:
        return Law(0, 0, vmin)
    for lo, hi in ((None, None), (vmin, None), (None, vmax), (vmin, vmax)):
        inside = np.ones(v.shape, bool)
        if lo is not None:
            inside &= v > lo
        if hi is not None:
            inside &= v < hi
        law = _fit_interior(rows[inside], v[inside], lo, hi)
        if law is not None and np.array_equal(law(rows), v):
            return law
    return None


def _fit_interior(r: np.ndarray, v: np.ndarray, lo, hi) -> Law | None:
    if r.size == 0:
        # every value sits on a clamp: a step between the two bounds
        return None
    if r.size == 1:
        return Law(0, 0, int(v[0]), lo=lo, hi=hi)
    adjacent = np.diff(r) == 1
    steps = np.diff(v)[adjacent]
    if steps.size == 0:
        # no adjacent rows: affine through the first two points, if integral
        dr, dv = int(r[1] - r[0]), int(v[1] - v[0])
        if dv % dr:
            return None
        a = dv // dr
        return Law(a, 0, int(v[0] - a * r[0]), lo=lo, hi=hi)
    values, counts = np.unique(steps, return_counts=True)
    a = int(values[np.argmax(counts)])
    jump_at = r[1:][adjacent][steps != a]  # rows r where v(r) - v(r-1) != a
    if jump_at.size == 0:
        return Law(a, 0, int(v[0] - a * r[0]), lo=lo, hi=hi)
    jumps = steps[steps != a] - a
    if np.any(jumps != jumps[0]) or jump_at.size < 2:
        return None
    div = int(np.gcd.reduce(np.diff(jump_at)))
    if div <= 1:
        return None
    b = int(jumps[0])
    e = int((-jump_at[0]) % div)
    c = int(v[0] - a * r[0] - b * ((r[0] + e) // div))
    return Law(a, b, c, div=div, e=e, lo=lo, hi=hi)


def fit_closed_form(base: np.ndarray, stride: np.ndarray, count: np.ndarray) -> ClosedForm | None:
    """Fits a :class:`ClosedForm` to one segment's canonical per-row arrays.

    Rows are cut into at most :data:`MAX_PIECES` pieces; each piece is the
    longest run of rows, from the first non-empty one on, that one pair of laws
    reproduces exactly (empty rows inside it included). Returns ``None`` where
    that takes more pieces or no law fits.
    """
    q_len = count.shape[0]
    count = count.astype(np.int64)
    base = base.astype(np.int64)
    stride = stride.astype(np.int64)
    nonempty = np.flatnonzero(count > 0)
    if nonempty.size == 0:
        return ClosedForm(())
    pieces: list[Piece] = []
    start = int(nonempty[0])
    while True:
        if len(pieces) == MAX_PIECES:
            return None
        piece = _longest_piece(base, stride, count, start, q_len)
        if piece is None:
            return None
        pieces.append(piece)
        later = nonempty[nonempty >= piece.row_stop]
        if later.size == 0:
            return ClosedForm(tuple(pieces))
        start = int(later[0])


def _piece_for(base, stride, count, start, stop) -> Piece | None:
    rows = np.arange(start, stop)
    n = count[start:stop]
    full = n > 0
    multi = n > 1
    strides = np.unique(stride[start:stop][multi])
    if strides.size > 1:
        return None
    s = int(strides[0]) if strides.size else 1
    r_ne = rows[full]
    b_ne = base[start:stop][full]
    end_ne = b_ne + s * (n[full] - 1) + 1
    base_law = fit_law(r_ne, b_ne)
    end_law = fit_law(r_ne, end_ne)
    if base_law is None or end_law is None:
        return None
    piece = Piece(start, stop, s, base_law, end_law)
    got_base, got_count = piece.evaluate(rows)
    if not np.array_equal(got_count, n) or not np.array_equal(got_base[full], b_ne):
        return None
    return piece


def _longest_piece(base, stride, count, start, q_len) -> Piece | None:
    whole = _piece_for(base, stride, count, start, q_len)
    if whole is not None:
        return whole
    # gallop: fit a prefix, extend to the first row its laws get wrong, refit on
    # the longer range (which may reveal clamps), until the range stops growing
    stop = min(q_len, start + 64)
    piece = None
    while True:
        fitted = _piece_for(base, stride, count, start, stop)
        if fitted is None:
            break
        piece = fitted
        rows = np.arange(start, q_len)
        b, n = fitted.evaluate(rows)
        wrong = (n != count[start:]) | ((n > 0) & (b != base[start:]))
        new_stop = start + int(np.argmax(wrong)) if wrong.any() else q_len
        if new_stop <= stop:
            return piece
        stop = new_stop
    if piece is not None:
        return piece
    # not even the first rows fit one law pair: bisect down to the longest prefix that does
    lo, hi = start + 1, stop
    best = _piece_for(base, stride, count, start, lo)
    if best is None:
        return None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        p = _piece_for(base, stride, count, start, mid)
        if p is None:
            hi = mid
        else:
            lo, best = mid, p
    return best


__all__ = ["Law", "Piece", "ClosedForm", "fit_law", "fit_closed_form", "MAX_PIECES"]
