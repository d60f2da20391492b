"""Factoring grid axes: one axis as the product of two shorter ones, and back.

An axis of length ``n = a * b`` (tables of :mod:`acsr._grid`) *splits* over
``(a, b)`` when, writing a coordinate ``x = u * b + v``, what ``x`` sees is the
product of what ``u`` sees on an outer axis of length ``a`` and what ``v`` sees
on an inner axis of length ``b`` (key ``y = u' * b + v'``). Windows aligned to
blocks split into (one block, the whole block); a dilated axis whose dilation
divides its length splits into (windows, own phase). One mask can be written
over many grids; :func:`refine` takes every axis down to factors that do not
split (its *atoms*), so that :func:`acsr._grid.canonical` builds its form from
the mask alone and not from the grid it was written on.

Everything here is ``O(length)`` array arithmetic on the tables; nothing is
expanded to ``length x length``.
"""

from __future__ import annotations

import numpy as np

from acsr._grid import GridAxis, canonical_axis

__all__ = ["common_step", "divisors", "product_axis", "refine", "split_axis"]


def common_step(step: np.ndarray, count: np.ndarray) -> int | None:
    """The one step shared by every row with two or more keys (1 where none has), else None."""
    s = np.unique(step[count > 1])
    if s.size > 1:
        return None
    return int(s[0]) if s.size else 1


def product_axis(outer: GridAxis, inner: GridAxis) -> GridAxis | None:
    """``outer x inner`` as one axis of length ``outer.length * inner.length``, or None where
    some coordinate's keys are not one progression, or the progressions' steps differ.

    Coordinate ``u * b + v`` (``b = inner.length``) sees keys ``u' * b + v'`` for ``u'``
    seen by ``u`` and ``v'`` seen by ``v``: one progression when either side has at most
    one key, or the inner keys fill their block's phase (``outer.dilation * b ==
    inner.dilation * inner.count``), so that the next block continues them.
    """
    b = inner.length
    x = np.arange(outer.length * b)
    u, v = x // b, x % b
    ca, cb = outer.count[u].astype(np.int64), inner.count[v].astype(np.int64)
    fa, fb = outer.first[u].astype(np.int64), inner.first[v].astype(np.int64)
    da, db = outer.dilation, inner.dilation
    step = np.where(cb > 1, db, da * b)
    joined = (ca <= 1) | (cb <= 1) | (da * b == db * cb)
    if not np.all(joined | (ca * cb == 0)):
        return None
    count = ca * cb
    dilation = common_step(step, count)
    if dilation is None:
        return None
    return canonical_axis(outer.length * b, dilation, fa * b + fb, count)


def _same_axis(a: GridAxis, b: GridAxis) -> bool:
    return (
        a.length == b.length
        and a.dilation == b.dilation
        and np.array_equal(a.first, b.first)
        and np.array_equal(a.count, b.count)
    )


def split_axis(axis: GridAxis, b: int) -> tuple[GridAxis, GridAxis] | None:
    """``(outer, inner)`` of lengths ``(axis.length // b, b)`` whose :func:`product_axis` is
    ``axis``, or None where the axis does not split so.

    The inner table is read in the block of a coordinate that sees something, the outer
    one at that coordinate's place in its block; the product of the two is then compared
    with the axis, so a split is never wrong.
    """
    n, d = axis.length, axis.dilation
    if b <= 1 or b >= n or n % b:
        return None
    live = np.flatnonzero(axis.count > 0)
    if live.size == 0:
        return None
    u0, v0 = divmod(int(live[0]), b)
    first, count = axis.first.astype(np.int64), axis.count.astype(np.int64)
    # inner: the keys of coordinate u0 * b + v that fall in the block of its first key
    f, c = first[u0 * b : u0 * b + b], count[u0 * b : u0 * b + b]
    room = ((f // b + 1) * b - f + d - 1) // d  # keys of the progression left in that block
    inner = canonical_axis(b, d, f % b, np.minimum(c, room))
    # outer: the blocks coordinate u * b + v0 reaches
    f, c = first[v0::b], count[v0::b]
    last = f + d * np.maximum(c - 1, 0)
    if d < b:  # consecutive keys never skip a block
        fo, co, do = f // b, np.where(c > 0, last // b - f // b + 1, 0), 1
    elif d % b == 0:
        fo, co, do = f // b, c, d // b
    else:
        return None
    outer = canonical_axis(n // b, do, fo, co)
    both = product_axis(outer, inner)
    return (outer, inner) if both is not None and _same_axis(both, axis) else None


def divisors(n: int) -> list[int]:
    """Divisors of ``n`` strictly between 1 and ``n``, ascending."""
    small = [k for k in range(2, int(n**0.5) + 1) if n % k == 0]
    return sorted(set(small) | {n // k for k in small})


def _atoms(axis: GridAxis) -> list[GridAxis]:
    """The axis as factors that do not split, outermost first (the smallest inner factor is
    split off first). Whole-axis and single-key axes are kept whole: their splits are many
    and all merge back the same way."""
    if axis.is_full or axis.is_point:
        return [axis]
    for b in divisors(axis.length):
        parts = split_axis(axis, b)
        if parts is not None:
            return _atoms(parts[0]) + [parts[1]]
    return [axis]


def refine(axes: list[GridAxis]) -> list[GridAxis]:
    """Every axis split into its atoms; then neighbouring whole-axis factors joined into one,
    and neighbouring single-key factors joined into one (their order within such a run
    depends on how the mask was written, their product does not)."""
    out: list[GridAxis] = []
    for atom in (a for axis in axes for a in _atoms(axis)):
        prev = out[-1] if out else None
        if prev is not None and ((prev.is_full and atom.is_full) or (prev.is_point and atom.is_point)):
            out[-1] = product_axis(prev, atom)
        else:
            out.append(atom)
    return out
