"""Spatial tiles of the CUDA forward on grid layouts (N-D neighborhoods, :mod:`acsr._grid`).

The grid is padded to 3 axes (outermost first, leading axes of length 1). A work item is a
*query patch*: ``q_tile[a]`` query coordinates on each axis ``a``, ``q_start[a] + dilation[a] *
i`` for ``i < q_tile[a]``, so a patch is one TMA box (traversal stride ``dilation``) of
``prod(q_tile) = 128`` rows, and all its queries lie on one window phase per axis. Its keys are
the union of its queries' windows, a box of ``count`` coordinates per axis on that phase
(:meth:`acsr.GridAxis.box`), walked in key tiles of ``k_tile`` coordinates per axis, last axis
fastest; a key tile is one TMA box too. A tile that every query of the patch sees on every
axis (its *interior*) skips the mask; the others mask each (query, key) pair from the per-axis
windows. No permuted copy of q, k or v is made.

The kernel needs ``k_tile[2]`` a multiple of 8 (a thread's accumulator columns then differ from
its lane's by constants on every axis) and ``prod(k_tile)`` a multiple of 16 (the wgmma N).

Tables (``tables``, int32, one array, ``O(sum of axis lengths)``):

=================  =================  ==================================================
part               shape              meaning, padding
=================  =================  ==================================================
patches            [3, PMAX, 8]       axis ``a``, patch ``j``: ``q_start``, the key box's
                                      ``first``, its tiles along the axis, the tiles
                                      ``[lo, hi)`` inside every window of the patch, 0,
                                      0, 0
windows            [3, NMAX, 2]       axis ``a``, query coordinate ``x``: its window's
                                      first key and end (last + 1); ``(0, 0)`` past the
                                      axis
=================  =================  ==================================================
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass, field

import numpy as np

from acsr import GridAxis, GridWindows

AXES = 3
ROWS = 128  # queries in a patch: the kernel's row block
MAX_DILATION = 8  # TMA traversal strides
MAX_BOX = 256  # TMA box coordinates on an axis
BLOCK_NS = tuple(range(64, 177, 16))  # keys in a tile: wgmma N, registers for up to 176 scores
TILE_COST = 48  # a key tile's fixed cost, in keys (waits, reductions, the rescale of o)
PATCH_COST = 128  # a work item's fixed cost, in keys (its Q load, windows, epilogue)


@dataclass(frozen=True)
class GridTiles:
    """The spatial tiles of one grid forward (the kernel's baked-in geometry; module docstring)."""

    grid: tuple[int, int, int]
    dilation: tuple[int, int, int]
    q_tile: tuple[int, int, int]
    k_tile: tuple[int, int, int]
    patches: tuple[int, int, int]  # patches along each axis
    pmax: int  # the tables' patch stride
    nmax: int  # the tables' window stride

    @property
    def block_n(self) -> int:
        return math.prod(self.k_tile)

    @property
    def n_patches(self) -> int:
        return math.prod(self.patches)


@dataclass(frozen=True, eq=False)
class GridPlan:
    """Tiles and the tables the kernel reads (``tables``: int32, module docstring)."""

    tiles: GridTiles
    tables: np.ndarray = field(repr=False)

    @property
    def keys_per_patch(self) -> float:
        """Keys a patch walks, on average (its tiles times their keys)."""
        t = self.tiles
        patches = self.tables[: AXES * t.pmax * 8].reshape(AXES, t.pmax, 8)
        tiles = math.prod(int(patches[a, : t.patches[a], 2].sum()) for a in range(AXES))
        return tiles * t.block_n / t.n_patches


def _phase_ok(axis: GridAxis) -> bool:
    """Every query that sees a key sees keys on its own coordinate's phase (``x % dilation``):
    then a patch of one phase is one strided box."""
    x = np.arange(axis.length)
    live = axis.count > 0
    return bool(np.all((axis.first[live] - x[live]) % axis.dilation == 0))


def _axis_patches(axis: GridAxis, t: int) -> list[tuple[int, int, int, int, int]]:
    """``(q_start, box first, box count, inner lo, inner hi)`` of the patches of ``t`` query
    coordinates along ``axis``, phase after phase; ``[inner lo, inner hi)`` the keys every
    query of the patch sees (empty: lo >= hi)."""
    d = axis.dilation
    out = []
    end = axis.end()
    for p in range(min(d, axis.length)):
        xs = np.arange(p, axis.length, d)
        for j in range(0, xs.size, t):
            chunk = xs[j : j + t]
            first, count = axis.box(chunk)
            live = axis.count[chunk] > 0
            if live.all():
                inner = int(axis.first[chunk].max()), int(end[chunk].min())
            else:
                inner = (1, 0)
            out.append((int(chunk[0]), first, count, *inner))
    return out


def _tiles_along(count: np.ndarray, k: int) -> np.ndarray:
    return -(-count // k)


def _shapes(total: int, caps) -> list[tuple[int, int, int]]:
    """Shapes ``(t0, t1, t2)`` of ``total`` cells, powers of two, ``t[a] <= caps[a]``."""
    opts = [[1 << i for i in range(9) if (1 << i) <= c] for c in caps]
    return [s for s in itertools.product(*opts) if math.prod(s) == total]


def _key_tiles(dilation, caps):
    """Key-tile shapes the kernel takes: ``k[2]`` a multiple of 8, ``prod(k)`` in
    :data:`BLOCK_NS`; ``k[2]`` no longer than the longest box on the last axis (``caps[2]``)
    rounded up to 8, the other axes no longer than their longest box where the tile's keys can
    be spread over the axes within it (on small grids a tile is longer than its boxes)."""
    out = []
    for bn in BLOCK_NS:
        for k2 in range(8, bn + 1, 8):
            if bn % k2 or k2 * dilation[2] > MAX_BOX or k2 > max(8, -(-caps[2] // 8) * 8):
                continue
            rest = bn // k2
            for k1 in range(1, rest + 1):
                k0 = rest // k1
                if rest % k1 or k1 * dilation[1] > MAX_BOX or k0 * dilation[0] > MAX_BOX:
                    continue
                out.append((k0, k1, k2))
    inside = [k for k in out if k[0] <= caps[0] and k[1] <= caps[1]]
    return inside or out


def _cost(per_axis, k_tile) -> float:
    """Modelled cost of the walk, in keys: every patch's tiles times (keys + :data:`TILE_COST`),
    plus :data:`PATCH_COST` a patch. Patches are the product of the axes' patches, so the sum of
    a product is the product of per-axis sums."""
    tiles = math.prod(int(_tiles_along(c, k).sum()) for c, k in zip(per_axis, k_tile, strict=True))
    patches = math.prod(c.size for c in per_axis)
    return tiles * (math.prod(k_tile) + TILE_COST) + patches * PATCH_COST


def supported(windows: GridWindows) -> str | None:
    """None when the CUDA grid forward takes ``windows``, else why not."""
    if len(windows.axes) > AXES:
        return f"the cuda grid forward takes up to {AXES} axes, the layout has {len(windows.axes)}"
    for a in windows.axes:
        if a.dilation > MAX_DILATION:
            return f"dilation {a.dilation}: TMA boxes step by at most {MAX_DILATION}"
        if not _phase_ok(a):
            return "a query sees keys off its own coordinate's phase along a dilated axis"
    return None


def _check_shape(shape, dilation) -> None:
    """ValueError naming ``shape`` unless it is a ``(q_tile, k_tile)`` the kernel takes."""
    ok = isinstance(shape, tuple) and len(shape) == 2 and all(
        isinstance(t, tuple) and len(t) == AXES and all(type(x) is int and x > 0 for x in t) for t in shape)
    if ok:
        q, k = shape
        ok = (math.prod(q) == ROWS and all(x & (x - 1) == 0 for x in q) and k[2] % 8 == 0
              and math.prod(k) in BLOCK_NS
              and all(max(a, b) * d <= MAX_BOX for a, b, d in zip(q, k, dilation, strict=True)))
    if not ok:
        raise ValueError(f"shape must be (q_tile, k_tile): 3 positive ints each, q_tile powers of two of "
                         f"product {ROWS}, k_tile[2] a multiple of 8, prod(k_tile) in {BLOCK_NS}, "
                         f"boxes of at most {MAX_BOX} coordinates; got {shape!r}")


@functools.lru_cache(maxsize=64)
def grid_plan(windows: GridWindows, shape: tuple | None = None) -> GridPlan:
    """The tiles and tables of the forward over ``windows`` (NotImplementedError where
    :func:`supported` says why not): the query patch and key tile of least modelled cost
    (:func:`_cost`), or the ``shape`` ``(q_tile, k_tile)`` given (3 coordinates each; for
    tests and spikes; ValueError naming it where the kernel cannot take it)."""
    why = supported(windows)
    if why is not None:
        raise NotImplementedError(why)
    axes = windows.padded_axes(AXES)
    grid = tuple(a.length for a in axes)
    dil = tuple(a.dilation for a in axes)
    sub = [-(-n // d) for n, d in zip(grid, dil, strict=True)]
    if shape is not None:
        _check_shape(shape, dil)
    best = None
    patches_of = functools.cache(lambda a, t: _axis_patches(axes[a], t))
    # patches longer than their axis only where the grid holds fewer than ROWS queries per phase
    caps = [1 << max(0, (s - 1).bit_length()) for s in sub]
    if not _shapes(ROWS, caps):
        caps = [MAX_BOX // d for d in dil]
    for q_tile in _shapes(ROWS, caps) if shape is None else [shape[0]]:
        if any(q * d > MAX_BOX for q, d in zip(q_tile, dil, strict=True)):
            continue
        parts = [patches_of(a, t) for a, t in enumerate(q_tile)]
        counts = [np.array([p[2] for p in ps], np.int64) for ps in parts]
        longest = [int(c.max(initial=1)) for c in counts]
        for k_tile in _key_tiles(dil, longest) if shape is None else [shape[1]]:
            cost = _cost(counts, k_tile)
            if best is None or cost < best[0]:
                best = (cost, q_tile, k_tile, parts)
    if best is None:
        raise NotImplementedError(f"no query patch of {ROWS} rows fits grid {grid} with dilation {dil}")
    _, q_tile, k_tile, parts = best
    pmax = max(len(p) for p in parts)
    nmax = max(grid)
    patches = np.zeros((AXES, pmax, 8), np.int32)
    windows_t = np.zeros((AXES, nmax, 2), np.int32)
    for i, (a, ps, k) in enumerate(zip(axes, parts, k_tile, strict=True)):
        step = k * a.dilation
        for j, (q_start, first, count, in_lo, in_hi) in enumerate(ps):
            n = -(-count // k)
            t = np.arange(n)
            inside = (first + t * step >= in_lo) & (first + t * step + (k - 1) * a.dilation < in_hi)
            lo = int(np.argmax(inside)) if inside.any() else 0
            hi = lo + int(inside.sum()) if inside.any() else 0  # interior tiles are consecutive
            patches[i, j] = (q_start, first, n, lo, hi, 0, 0, 0)
        live = a.count > 0
        windows_t[i, : a.length, 0] = np.where(live, a.first, 0)
        windows_t[i, : a.length, 1] = np.where(live, a.end(), 0)
    tiles = GridTiles(grid, dil, q_tile, k_tile, tuple(len(p) for p in parts), pmax, nmax)
    tables = np.concatenate([patches.reshape(-1), windows_t.reshape(-1)])
    tables.setflags(write=False)
    return GridPlan(tiles, tables)
