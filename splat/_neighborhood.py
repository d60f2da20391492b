"""Neighborhood attention masks on an N-D token grid (NATTEN's na1d / na2d / na3d semantics).

Tokens of a grid ``(n_0, ..., n_{m-1})`` are numbered row-major (last axis
fastest): token ``i`` has coordinates ``np.unravel_index(i, grid)``. The mask is
a product of per-axis windows: query ``x`` attends key ``y`` iff on every axis
``a`` the key coordinate ``y_a`` lies in the window of the query coordinate
``x_a``. The geometry of one axis is stated once, in :class:`AxisWindow`; the
mask (:class:`Neighborhood`) combines the axes and builds the ACSR layout from
per-axis tables, vectorised, never looping over tokens in Python.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

import acsr
from splat.masks import Mask, Runs


@dataclass(frozen=True)
class AxisWindow:
    """The keys each query coordinate sees along one axis of length ``length``.

    Definition (NATTEN's), for a query at coordinate ``x``:

    * **dilation** ``d``: the query sees only keys of its own phase ``p = x % d``.
      Its *phase sub-grid* is the coordinates ``p, p + d, p + 2d, ...`` below
      ``length``, of length ``L_p = ceil((length - p) / d)`` (it depends on the
      phase where ``d`` does not divide ``length``); the query sits at position
      ``x' = x // d`` in it. Everything below is in sub-grid positions.
    * **stride groups** ``s``: positions ``[g, g + s)`` with ``g = s * (x' // s)``
      share one neighborhood, that of the group's *leader*. The last group of a
      sub-grid may be shorter than ``s``; a leader that would lie past the end
      of the sub-grid is the sub-grid's last position instead (``min(nominal,
      L_p - 1)``).
    * **non-causal**: the nominal leader is the group's centre, ``g + s // 2``
      (the right-hand one of the two centres for even ``s``). The window holds
      ``kernel_size`` positions, ``kernel_size // 2`` left of the leader and
      ``(kernel_size - 1) // 2`` right of it, shifted inside ``[0, L_p)`` at the
      borders so that every query sees exactly ``kernel_size`` keys.
    * **causal**: the nominal leader is the group's last position, ``g + s - 1``.
      The window is the ``kernel_size`` positions ending at the leader, but never
      a position after the query itself, and never before 0: positions
      ``max(0, leader - kernel_size + 1) ..= x'``.

    Requires ``kernel_size * dilation <= length`` (so every phase sub-grid holds
    a full window) and ``stride <= kernel_size``; :func:`neighborhood` checks.
    """

    length: int
    kernel_size: int
    stride: int = 1
    dilation: int = 1
    is_causal: bool = False

    def windows(self) -> tuple[np.ndarray, np.ndarray]:
        """``(first, count)``, int64 ``[length]``: coordinate ``x`` sees the keys
        ``first[x] + dilation * t`` for ``0 <= t < count[x]``."""
        n, k, s, d = self.length, self.kernel_size, self.stride, self.dilation
        x = np.arange(n, dtype=np.int64)
        phase, pos = x % d, x // d
        sub_len = (n - phase + d - 1) // d
        group = pos // s * s
        if self.is_causal:
            leader = np.minimum(group + s - 1, sub_len - 1)
            lo = np.maximum(leader - k + 1, 0)
            hi = pos + 1
        else:
            leader = np.minimum(group + s // 2, sub_len - 1)
            lo = np.clip(leader - k // 2, 0, sub_len - k)
            hi = lo + k
        return phase + d * lo, hi - lo


@dataclass(frozen=True)
class Neighborhood(Mask):
    """N-D neighborhood attention on ``grid``, one :class:`AxisWindow` per axis.

    Every field is a tuple with one entry per grid axis (build it with
    :func:`neighborhood`, which broadcasts ints and checks the values). Its
    layout exists only for ``q_len == kv_len == prod(grid)``.
    """

    grid: tuple[int, ...]
    kernel_size: tuple[int, ...]
    stride: tuple[int, ...]
    dilation: tuple[int, ...]
    is_causal: tuple[bool, ...]

    def __post_init__(self):
        grid = _grid_arg(self.grid)
        rank = len(grid)
        kernel = _per_axis("kernel_size", self.kernel_size, rank)
        stride = _per_axis("stride", self.stride, rank)
        dilation = _per_axis("dilation", self.dilation, rank)
        causal = _causal_arg(self.is_causal, rank)
        for a, (n, k, s, d) in enumerate(zip(grid, kernel, stride, dilation, strict=True)):
            if k * d > n:
                raise ValueError(
                    f"kernel_size * dilation must be <= the grid axis length: axis {a} has "
                    f"kernel_size {k} and dilation {d} ({k * d}) but grid length {n}"
                )
            if s > k:
                raise ValueError(f"stride must be <= kernel_size on every axis: axis {a} has {s} > {k}")
        for name, value in (
            ("grid", grid),
            ("kernel_size", kernel),
            ("stride", stride),
            ("dilation", dilation),
            ("is_causal", causal),
        ):
            object.__setattr__(self, name, value)

    @property
    def size(self) -> int:
        """Tokens in the grid, ``prod(grid)``: the only valid ``q_len`` and ``kv_len``."""
        return math.prod(self.grid)

    @property
    def axes(self) -> tuple[AxisWindow, ...]:
        """The per-axis geometry, outermost axis first."""
        return tuple(
            AxisWindow(*v)
            for v in zip(self.grid, self.kernel_size, self.stride, self.dilation, self.is_causal, strict=True)
        )

    def _check_lengths(self, q_len: int, kv_len: int) -> None:
        if q_len != self.size or kv_len != self.size:
            raise ValueError(
                f"neighborhood grid {self.grid} has {self.size} tokens, but the attention is "
                f"{q_len} x {kv_len} (q_len x kv_len); both must equal prod(grid)"
            )

    def windows(self) -> acsr.GridWindows:
        """The mask as a grid product: one :class:`acsr.GridAxis` per axis, from :class:`AxisWindow`."""
        axes = []
        for axis in self.axes:
            first, count = axis.windows()
            axes.append(acsr.canonical_axis(axis.length, axis.dilation, first, count))
        return acsr.GridWindows(tuple(axes))

    def to_acsr(self, q_len: int | None = None, kv_len: int | None = None, *, block=acsr.DEFAULT_BLOCK):
        """The layout; ``q_len`` and ``kv_len`` default to (and must equal) ``prod(grid)``.

        The same canonical layout ``Mask.to_acsr`` would give (:func:`acsr.from_grid`): a
        grid layout (per-axis tables, no per-row arrays) where the rows need more than
        ``acsr.MAX_SEGMENTS`` progressions, segments otherwise.
        """
        q_len = self.size if q_len is None else q_len
        kv_len = q_len if kv_len is None else kv_len
        self._check_lengths(q_len, kv_len)
        return _layout(self, tuple(block))

    def __call__(self, q_idx, kv_idx) -> np.ndarray:
        q, k = np.asarray(q_idx, np.int64), np.asarray(kv_idx, np.int64)
        for name, idx in (("q_idx", q), ("kv_idx", k)):
            if idx.size and (idx.min() < 0 or idx.max() >= self.size):
                raise ValueError(
                    f"{name} has indices outside the neighborhood grid {self.grid} "
                    f"(tokens 0..{self.size - 1})"
                )
        return self.windows().contains(q, k)

    def _runs(self, q_len: int, kv_len: int) -> Runs:
        self._check_lengths(q_len, kv_len)
        w = self.windows()
        base, stride, count = w.product_runs()
        if acsr.runs_are_canonical(base, count, w.axes[-1].dilation):
            return base, stride, count
        return acsr.runs_from_csr(*w.csr())


@functools.lru_cache(maxsize=16)
def _layout(mask: Neighborhood, block: tuple[int, int]) -> acsr.ACSR:
    return acsr.from_grid(mask.windows(), block=block)


# --- arguments -------------------------------------------------------------------


def _int(name: str, value, where: str) -> int:
    if isinstance(value, bool | np.bool_) or not isinstance(value, int | np.integer):
        raise TypeError(f"{name} must hold ints, got {type(value).__name__} {value!r}{where}")
    if value < 1:
        raise ValueError(f"{name} must be positive, got {value}{where}")
    return int(value)


def _grid_arg(grid) -> tuple[int, ...]:
    if isinstance(grid, np.ndarray):
        grid = grid.tolist()
    if isinstance(grid, int | np.integer) and not isinstance(grid, bool | np.bool_):
        grid = (grid,)
    if not isinstance(grid, Sequence) or isinstance(grid, str) or len(grid) == 0:
        raise TypeError(f"grid must be an int or a non-empty sequence of ints, got {grid!r}")
    return tuple(_int("grid", n, f" on axis {a}") for a, n in enumerate(grid))


def _per_axis(name: str, value, rank: int) -> tuple[int, ...]:
    """An int (every axis) or a sequence with one positive int per grid axis."""
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if isinstance(value, Sequence) and not isinstance(value, str):
        if len(value) != rank:
            raise ValueError(f"{name} has {len(value)} values but the grid has {rank} axes: {value!r}")
        return tuple(_int(name, v, f" on axis {a}") for a, v in enumerate(value))
    return (_int(name, value, ""),) * rank


def _causal_arg(value, rank: int) -> tuple[bool, ...]:
    """A bool (every axis) or a sequence with one bool per grid axis."""
    if isinstance(value, Sequence) and not isinstance(value, str):
        if len(value) != rank:
            raise ValueError(f"is_causal has {len(value)} values but the grid has {rank} axes: {value!r}")
        values = tuple(value)
    else:
        values = (value,) * rank
    for a, v in enumerate(values):
        if not isinstance(v, bool | np.bool_):
            raise TypeError(f"is_causal must hold bools, got {type(v).__name__} {v!r} on axis {a}")
    return tuple(bool(v) for v in values)


def neighborhood(
    grid: int | Sequence[int],
    kernel_size: int | Sequence[int],
    *,
    stride: int | Sequence[int] = 1,
    dilation: int | Sequence[int] = 1,
    is_causal: bool | Sequence[bool] = False,
) -> Neighborhood:
    """Neighborhood attention (NATTEN's na1d / na2d / na3d) over the row-major tokens of ``grid``.

    Each query attends to a window of ``kernel_size`` keys per axis around its
    stride group's leader (causal axes: ending there, never past the query),
    within its dilation phase; :class:`AxisWindow` states the geometry of one
    axis exactly, including short last stride groups (their leader is clamped to
    the last query). The layout exists for ``q_len == kv_len == prod(grid)``.

    Args:
      grid: the token grid ``(n_0, ..., n_{m-1})`` (an int for 1-D); token ``i``
        sits at ``np.unravel_index(i, grid)``.
      kernel_size: window length per axis (an int for every axis);
        ``kernel_size * dilation <= n`` on each axis.
      stride: queries per stride group along each axis, ``<= kernel_size``.
      dilation: key spacing per axis.
      is_causal: a bool for every axis, or one per axis.

    Returns:
      A frozen :class:`Neighborhood` mask, hashable by value and combinable
      with ``|`` and ``&`` (e.g. ``| masks.global_tokens(n)`` for register tokens).

    Raises:
      TypeError, ValueError: naming the argument that is wrong.

    Example:
      >>> from splat import masks
      >>> m = masks.neighborhood((4, 4), 3)
      >>> m.to_acsr().to_dense()[5].reshape(4, 4).astype(int)  # query (1, 1)
      array([[1, 1, 1, 0],
             [1, 1, 1, 0],
             [1, 1, 1, 0],
             [0, 0, 0, 0]])
      >>> m.to_acsr().to_dense()[0].reshape(4, 4).astype(int)  # query (0, 0): shifted inside
      array([[1, 1, 1, 0],
             [1, 1, 1, 0],
             [1, 1, 1, 0],
             [0, 0, 0, 0]])
      >>> masks.neighborhood(8, 3, is_causal=True).to_acsr().row_counts()
      array([1, 2, 3, 3, 3, 3, 3, 3])
    """
    return Neighborhood(grid, kernel_size, stride, dilation, is_causal)
