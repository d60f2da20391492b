"""Grid windows: masks that are a product of per-axis windows on a row-major token grid.

A mask over the ``S = n_0 * ... * n_{m-1}`` tokens of a grid (token ``i`` at
``np.unravel_index(i, grid)``, last axis fastest) is a *grid product* when query
``x`` sees key ``y`` exactly when, on every axis ``a``, the key coordinate
``y_a`` lies in a progression that depends only on the query coordinate ``x_a``::

    y_a = first_a[x_a] + dilation_a * t        for 0 <= t < count_a[x_a]

N-D neighborhood attention (NATTEN: windows, strides, dilations, causal axes)
is one. On the flattened tokens a row needs ``prod(count_a, a < m - 1)``
progressions, more than ACSR's segments hold, so the layout keeps the per-axis
tables instead (``O(sum n_a)`` numbers, no per-row or per-block arrays) and
kernels tile the grid in grid coordinates.

==========  =====  ==========  =================================================
array       dtype  shape       meaning and padding (one :class:`GridAxis`)
==========  =====  ==========  =================================================
first       int32  [length]    first key coordinate seen by query coordinate
                               ``x``; 0 where ``count == 0``
count       int32  [length]    number of key coordinates seen (>= 0)
==========  =====  ==========  =================================================

``dilation`` (an int per axis, >= 1) is the step between a row's key
coordinates; it is 1 on an axis whose counts are all <= 1.

**Canonical form** (:func:`canonical`), so that one mask has one layout: axes of
length 1 are dropped (unless they see nothing), every axis is split into the
shorter axes it is a product of (:mod:`acsr._grid_factor`: block-aligned
windows, a dilation that divides the axis, ...), and then an inner axis that
every query sees whole (``first == 0``, ``count == length``), or in one key
only, is merged into the axis outside it (the pair is then one progression on
the merged axis), innermost pair first. Splitting first makes the form follow
the mask rather than the grid it was written on, so the same mask written on
another grid, or found in a dense array (:mod:`acsr._grid_detect`), gets the
same layout. A product that stays at two or more axes and needs more than
``MAX_SEGMENTS`` progressions in some row is stored as a grid; otherwise its
rows become segments.
"""

from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass

import numpy as np


def _frozen(a, dtype=np.int32) -> np.ndarray:
    a = np.ascontiguousarray(a, dtype=dtype)
    a.setflags(write=False)
    return a


@dataclass(frozen=True, eq=False)
class GridAxis:
    """One axis of a grid product: what each query coordinate sees along it (tables above)."""

    length: int
    dilation: int
    first: np.ndarray
    count: np.ndarray

    def __post_init__(self):
        object.__setattr__(self, "first", _frozen(self.first))
        object.__setattr__(self, "count", _frozen(self.count))
        if self.first.shape != (self.length,) or self.count.shape != (self.length,):
            raise ValueError(
                f"GridAxis tables must have shape ({self.length},), got first {self.first.shape} "
                f"and count {self.count.shape}"
            )

    def end(self) -> np.ndarray:
        """Last key coordinate plus one, int64 ``[length]`` (``first`` where empty)."""
        c = self.count.astype(np.int64)
        return np.where(c > 0, self.first + self.dilation * (c - 1) + 1, self.first)

    def dense(self) -> np.ndarray:
        """Boolean ``[length, length]``: query coordinate x sees key coordinate y."""
        off = np.arange(self.length)[None, :] - self.first[:, None].astype(np.int64)
        d = self.dilation
        return (off >= 0) & (off % d == 0) & (off < d * self.count[:, None].astype(np.int64))

    def box(self, queries) -> tuple[int, int]:
        """``(first, count)``: the progression of step ``dilation`` from ``first`` that covers
        every key the query coordinates ``queries`` see (all on one window phase); ``(0, 0)``
        where they see none."""
        q = np.asarray(queries, np.int64)
        live = q[self.count[q] > 0]
        if not live.size:
            return 0, 0
        lo = int(self.first[live].min())
        hi = int(self.end()[live].max())
        return lo, (hi - lo + self.dilation - 1) // self.dilation

    @property
    def is_full(self) -> bool:
        """Every query coordinate sees the whole axis."""
        return bool(np.all(self.count == self.length)) and self.dilation == 1

    @property
    def is_point(self) -> bool:
        """Every query coordinate sees exactly one key coordinate."""
        return bool(np.all(self.count == 1))

    def transpose(self) -> GridAxis | None:
        """The axis of the transposed product (which queries see each key), or None
        where a key's queries are not one progression of step ``dilation``."""
        seen = self.dense().T  # [key, query]
        count = seen.sum(axis=1)
        first = np.where(count > 0, np.argmax(seen, axis=1), 0)
        out = canonical_axis(self.length, self.dilation, first, count)
        return out if np.array_equal(out.dense(), seen) else None


def canonical_axis(length: int, dilation: int, first, count) -> GridAxis:
    """A :class:`GridAxis` with canonical padding (first 0 where empty, dilation 1 where no row steps)."""
    count = np.asarray(count, np.int64)
    first = np.where(count > 0, np.asarray(first, np.int64), 0)
    return GridAxis(int(length), int(dilation) if np.any(count > 1) else 1, first, count)


@dataclass(frozen=True, eq=False)
class GridWindows:
    """A grid product (module docstring): one :class:`GridAxis` per grid axis, outermost first."""

    axes: tuple[GridAxis, ...]

    def __post_init__(self):
        object.__setattr__(self, "axes", tuple(self.axes))

    @property
    def grid(self) -> tuple[int, ...]:
        return tuple(a.length for a in self.axes)

    @property
    def size(self) -> int:
        return math.prod(self.grid)

    def padded_axes(self, n: int) -> tuple[GridAxis, ...]:
        """The axes with leading length-1 axes (whose one query sees its one key) up to ``n``."""
        one = GridAxis(1, 1, np.zeros(1), np.ones(1))
        return (one,) * (n - len(self.axes)) + self.axes

    @property
    def steps(self) -> tuple[int, ...]:
        """Token-index step of one unit along each axis (row-major)."""
        g = self.grid
        return tuple(math.prod(g[a + 1 :]) for a in range(len(g)))

    @functools.cached_property
    def _digest(self) -> bytes:
        h = hashlib.blake2b(digest_size=20)
        for a in self.axes:
            h.update(f"grid{a.length},{a.dilation};".encode())
            h.update(a.first.tobytes())
            h.update(a.count.tobytes())
        return h.digest()

    def digest(self) -> bytes:
        """A hash of the tables; equal products have equal digests (and hash and compare equal)."""
        return self._digest

    def __hash__(self) -> int:
        return hash(self._digest)

    def __eq__(self, other) -> bool:
        return isinstance(other, GridWindows) and self._digest == other._digest

    def row_counts(self) -> np.ndarray:
        """Keys per query token, int64 ``[size]``."""
        out = np.ones((), np.int64)
        for a in self.axes:
            out = np.multiply.outer(out, a.count.astype(np.int64))
        return out.reshape(-1)

    def contains(self, q_idx, kv_idx) -> np.ndarray:
        """Whether query token ``q_idx`` sees key token ``kv_idx`` (broadcast, int arrays)."""
        q, k = np.asarray(q_idx, np.int64), np.asarray(kv_idx, np.int64)
        out = np.ones(np.broadcast_shapes(q.shape, k.shape), bool)
        for a, step in zip(self.axes, self.steps, strict=True):
            xq = q // step % a.length
            off = k // step % a.length - a.first[xq]
            out &= (off >= 0) & (off % a.dilation == 0) & (off < a.dilation * a.count[xq].astype(np.int64))
        return out

    def product_runs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Each query's keys as progressions along the last axis, one per key coordinate on
        the other axes: ``(base, stride, count)``, int64 ``[size, R]`` with ``R`` the most any
        row needs; ascending within a row, live runs first, then canonical padding (0, 1, 0)."""
        m = len(self.axes)
        t_shape = tuple(int(a.count.max(initial=0)) for a in self.axes[:-1])
        shape = self.grid + t_shape
        base = np.zeros(shape, np.int64)
        live = np.ones(shape, bool)
        last = self.axes[-1]
        for i, (a, step) in enumerate(zip(self.axes, self.steps, strict=True)):
            view = [1] * len(shape)
            view[i] = a.length
            if i == m - 1:
                base += (a.first.astype(np.int64) * step).reshape(view)
                continue
            view[m + i] = t_shape[i]
            t = np.arange(t_shape[i])
            base += ((a.first[:, None].astype(np.int64) + a.dilation * t) * step).reshape(view)
            live &= (t < a.count[:, None]).reshape(view)
        s, r = self.size, math.prod(t_shape)
        view = [1] * len(shape)
        view[m - 1] = last.length
        last_count = np.broadcast_to(last.count.astype(np.int64).reshape(view), shape).reshape(s, r)
        base, live = base.reshape(s, r), live.reshape(s, r)
        count = np.where(live, last_count, 0)
        if not (count > 0).all():  # rows with fewer runs: live runs first
            order = np.argsort(count == 0, axis=1, kind="stable")
            base = np.take_along_axis(base, order, 1)
            count = np.take_along_axis(count, order, 1)
            r = int((count > 0).sum(axis=1).max(initial=0))
            base, count = base[:, :r], count[:, :r]
        base = np.where(count > 0, base, 0)
        stride = np.where(count > 1, last.dilation, 1)
        return base, stride, count

    def csr(self) -> tuple[np.ndarray, np.ndarray]:
        """CSR ``(indptr [size + 1], columns)``, sorted within rows (expanded in order, no sort)."""
        base, _, count = self.product_runs()
        step = self.axes[-1].dilation
        t = np.arange(int(count.max(initial=0)))
        cols = base[:, :, None] + step * t
        keep = t < count[:, :, None]
        indptr = np.zeros(base.shape[0] + 1, np.int64)
        np.cumsum(count.sum(axis=1), out=indptr[1:])
        return indptr, (cols.reshape(-1) if keep.all() else cols[keep])

    def dense(self) -> np.ndarray:
        """Boolean ``[size, size]`` rendering."""
        out = np.ones((), bool)
        for a in self.axes:  # outer product over axes, interleaving query and key coordinates
            out = np.multiply.outer(out, a.dense())
        m = len(self.axes)
        order = [2 * i for i in range(m)] + [2 * i + 1 for i in range(m)]
        return out.transpose(order).reshape(self.size, self.size)

    def transpose(self) -> GridWindows | None:
        """The product of the transposed masks (keys as rows), or None where an axis has no
        progression form (:meth:`GridAxis.transpose`)."""
        axes = [a.transpose() for a in self.axes]
        return None if any(a is None for a in axes) else GridWindows(tuple(axes))


def _merge(outer: GridAxis, inner: GridAxis) -> GridAxis | None:
    """``outer x inner`` as one axis, where the pair is one progression per query: ``inner``
    full with ``outer`` stepping by 1, or ``inner`` a single key per query."""
    n = inner.length
    x = np.arange(outer.length * n)
    xo, xi = x // n, x % n
    if inner.is_full and (outer.dilation == 1):
        return canonical_axis(outer.length * n, 1, outer.first[xo] * n, outer.count[xo] * n)
    if inner.is_point:
        return canonical_axis(
            outer.length * n, outer.dilation * n, outer.first[xo] * n + inner.first[xi], outer.count[xo]
        )
    return None


def canonical(windows: GridWindows) -> GridWindows:
    """The canonical form (module docstring): length-1 axes dropped, every axis split into
    the factors it is a product of (:func:`acsr._grid_factor.refine`, so that the form does
    not depend on the grid the mask was written on), then full or single-key inner axes
    merged outwards, innermost pair first, until nothing changes."""
    from acsr._grid_factor import refine  # builds on this module's tables

    kept = [a for a in windows.axes if a.length > 1 or not a.count.all()]  # an empty one empties all
    axes = refine(kept or list(windows.axes[-1:]))
    changed = True
    while changed and len(axes) > 1:
        changed = False
        for i in range(len(axes) - 1, 0, -1):
            merged = _merge(axes[i - 1], axes[i])
            if merged is not None:
                axes[i - 1 : i + 1] = [merged]
                changed = True
                break
    return GridWindows(tuple(axes))
