"""Spatial-tile plans for grid layouts (N-D neighborhoods, :mod:`acsr._grid`).

A program of a grid kernel owns a *query patch*: ``q_tile[a]`` query coordinates on
each axis ``a`` (padded to 3 axes, outermost first), taken from one *window phase*
(``first % dilation``), so the patch's keys lie on one progression of step
``dilation`` per axis. Its keys are the union of its queries' windows, a box of
``count`` coordinates per axis, walked in key tiles of ``k_tile`` coordinates per axis;
a key's token index is computed from its coordinates (no permuted copy of q, k, v).
Every tile masks each (query, key) pair from the per-axis windows.

Metadata operands (int32, all tiny: ``O(sum of axis lengths)``):

=========  ==============  ===================================================
array      shape           meaning, padding
=========  ==============  ===================================================
QCoord     [3, QMAX]       axis ``a``: query coordinates in patch order, patch
                           ``j`` at ``[j * q_tile[a], (j + 1) * q_tile[a])``;
                           -1 pads a phase's last patch
Region     [3, PMAX, 2]    axis ``a``, patch ``j``: first key coordinate and
                           key count (step ``dilation[a]``) of the patch's box
Win        [3, NMAX, 2]    axis ``a``, coordinate ``x``: its window's first key
                           coordinate and end (last + 1); keys between them on
                           the window's phase are seen
=========  ==============  ===================================================
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass, field

import numpy as np

from acsr import GridAxis, GridWindows
from jax_bindings._triton import cost
from jax_bindings._triton.spec import HeadShape, Tiles, pow2_ceil

GRID_OPS = ("fwd", "bwd_dq", "bwd_dkdv")
AXES = 3  # grids of 1 to 3 axes are padded to 3 (leading axes of length 1)


@dataclass(frozen=True)
class GridSpec(HeadShape):
    """Frozen description of one generated grid kernel (cache key of the generator).

    ``grid``/``dilation`` are the layout's axes padded to 3 (for ``bwd_dkdv`` the
    transposed windows: rows are keys). ``patches[a]``: patches along axis ``a``.
    """

    op: str
    grid: tuple[int, int, int]
    dilation: tuple[int, int, int]
    q_tile: tuple[int, int, int]
    k_tile: tuple[int, int, int]
    patches: tuple[int, int, int]
    dtype: str
    head_dim: int
    num_heads: int
    num_kv_heads: int
    num_warps: int = 4
    num_stages: int = 2
    ordered: bool = False  # the launch helper's field for 1-D kernels; grid programs are never reordered

    @property
    def size(self) -> int:
        return math.prod(self.grid)

    @property
    def block_m(self) -> int:
        return math.prod(self.q_tile)

    @property
    def block_n(self) -> int:
        return math.prod(self.k_tile)

    def meta_names(self) -> tuple[str, ...]:
        return ("QCoord", "Region", "Win")


@dataclass(frozen=True, eq=False)
class GridPlan:
    """A grid spec, its metadata operands and its number of programs per (batch, head)."""

    spec: GridSpec
    meta: tuple[np.ndarray, ...] = field(repr=False)
    row_blocks: int


def _phase_patches(axis: GridAxis, t: int) -> tuple[np.ndarray, np.ndarray]:
    """Query coordinates of one axis grouped by window phase, in patches of ``t``:
    ``(coords [P * t] with -1 padding, region [P, 2])``."""
    d = axis.dilation
    x = np.arange(axis.length)
    phase = axis.first % d
    coords, regions = [], []
    for p in range(d):
        xs = x[phase == p]
        for j in range(0, xs.size, t):
            chunk = xs[j : j + t]
            regions.append(axis.box(chunk))
            coords.append(np.pad(chunk, (0, t - chunk.size), constant_values=-1))
    return np.concatenate(coords), np.asarray(regions, np.int64).reshape(-1, 2)


def _tile_shapes(block: int, extent) -> list[tuple[int, ...]]:
    """Power-of-two tile shapes of ``block`` cells, no axis longer than ``extent[a]`` rounded up."""
    caps = [pow2_ceil(max(1, e)) for e in extent]
    opts = [[1 << i for i in range(c.bit_length()) if (1 << i) <= c] for c in caps]
    return [s for s in itertools.product(*opts) if math.prod(s) == block]


def _query_tile(axes, block_m: int) -> tuple[int, int, int]:
    """The query patch of ``block_m`` queries whose key box per query is smallest."""
    reach = [int(a.count.max(initial=1)) for a in axes]
    sub = [-(-a.length // a.dilation) for a in axes]

    def waste(t):  # keys in a patch's box (sub-grid steps) per query of the patch
        box = math.prod(min(t[i] + reach[i] - 1, sub[i]) for i in range(AXES))
        return box / math.prod(min(t[i], sub[i]) for i in range(AXES))

    shapes = _tile_shapes(block_m, sub)
    if not shapes:  # fewer queries than one tile on every axis: take the whole grid
        return _at_least_16(tuple(pow2_ceil(s) for s in sub))
    return min(shapes, key=lambda t: (waste(t), [-x for x in t[::-1]]))  # ties: longer inner axes


def _at_least_16(t: tuple[int, ...]) -> tuple[int, ...]:
    """``t`` with its last axis doubled until the tile holds 16 cells (``tl.dot``'s minimum)."""
    while math.prod(t) < 16:
        t = (*t[:-1], 2 * t[-1])
    return t


def _key_tile(region: np.ndarray, block_n: int) -> tuple[int, int, int]:
    """Key tile of ``block_n`` keys covering the patches' boxes with the fewest padded keys."""
    need = [int(region[a][:, 1].max(initial=1)) for a in range(AXES)]
    shapes = _tile_shapes(block_n, need)
    if not shapes:
        return _at_least_16(tuple(pow2_ceil(max(1, n)) for n in need))

    def padded(t):  # keys walked over every patch: separable, a product of per-axis sums
        return math.prod(int((-(-region[a][:, 1] // t[a]) * t[a]).sum()) for a in range(AXES))

    return min(shapes, key=lambda t: (padded(t), [-x for x in t[::-1]]))


# (block_m, block_n, num_warps, num_stages) to try in order; the first that fits the head dim
# and dtype is taken. Forward: 64-query patches with 3 stages measured best on an H100 (2-D
# windows of 15 and 63, 3-D (5, 9, 9): 1.05-1.33x 128-query ones); 128x64 with 4 warps and 3 stages
# does not compile in Triton 3.6.
_PREFERRED = {
    "fwd": ((64, 64, 4, 3), (64, 64, 4, 2), (64, 32, 4, 2), (32, 32, 4, 1), (16, 16, 4, 1)),
    "bwd_dq": ((64, 64, 4, 2), (64, 32, 4, 2), (32, 32, 4, 1), (16, 16, 4, 1)),
    "bwd_dkdv": ((64, 64, 4, 2), (64, 32, 4, 2), (32, 32, 4, 1), (16, 16, 4, 1)),
}


def _tiles_for(op: str, head_dim: int = 128, dtype: str = "bfloat16") -> tuple[int, int, int, int]:
    """(block_m, block_n, num_warps, num_stages) of the grid kernel ``op``: the first preferred
    config whose shared memory and registers (:func:`jax_bindings._triton.cost.resources`) fit."""
    itemsize = 4 if dtype == "float32" else 2
    for t in _PREFERRED[op]:
        r = cost.resources(op, Tiles(*t), head_dim, itemsize)
        if r.smem <= cost.SMEM_BYTES and r.regs <= cost.MAX_REGS_PER_THREAD:
            return t
    return _PREFERRED[op][-1]


@functools.lru_cache(maxsize=64)
def grid_plan(op: str, windows: GridWindows, dtype: str, head_dim: int, num_heads: int, num_kv_heads: int):
    """The plan of grid kernel ``op`` over ``windows`` (for ``bwd_dkdv``: the transposed windows)."""
    if op not in GRID_OPS:
        raise ValueError(f"op must be one of {GRID_OPS}, got {op!r}")
    if len(windows.axes) > AXES:
        raise NotImplementedError(f"grid kernels take up to {AXES} axes, the layout has {len(windows.axes)}")
    axes = windows.padded_axes(AXES)
    block_m, block_n, warps, stages = _tiles_for(op, head_dim, dtype)
    q_tile = _query_tile(axes, block_m)
    parts = [_phase_patches(a, t) for a, t in zip(axes, q_tile, strict=True)]
    region = [p[1] for p in parts]
    k_tile = _key_tile(region, block_n)
    qmax = max(p[0].size for p in parts)
    pmax = max(r.shape[0] for r in region)
    nmax = max(a.length for a in axes)
    qcoord = np.full((AXES, qmax), -1, np.int32)
    reg = np.zeros((AXES, pmax, 2), np.int32)
    win = np.zeros((AXES, nmax, 2), np.int32)
    for i, (a, (coords, r)) in enumerate(zip(axes, parts, strict=True)):
        qcoord[i, : coords.size] = coords
        reg[i, : r.shape[0]] = r
        win[i, : a.length, 0] = a.first
        win[i, : a.length, 1] = a.end()
    patches = tuple(int(r.shape[0]) for r in region)
    spec = GridSpec(
        op,
        tuple(a.length for a in axes),
        tuple(a.dilation for a in axes),
        q_tile,
        k_tile,
        patches,
        dtype,
        head_dim,
        num_heads,
        num_kv_heads,
        warps,
        stages,
    )
    meta = (qcoord, reg, win)
    for m in meta:
        m.setflags(write=False)
    return GridPlan(spec, meta, math.prod(patches))
