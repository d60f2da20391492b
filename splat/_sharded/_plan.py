"""Planning sequence-parallel attention from the mask's layout, on the host, once per mask and mesh size.

The mask is static, so which keys each device's queries need is known before anything runs. For every
pair (query device ``i``, key device ``j``) the planner cuts the global layout to the block of ``i``'s
local queries against ``j``'s local keys, trims it to the rows and columns that hold a nonzero, and
builds that block's own layout (:class:`Block`); an empty block is no block.

From the blocks it picks how keys travel (:class:`Plan`):

* ``"local"``: no device needs another's keys (block-local attention whose blocks are the shards).
* ``"halo"``: each device needs a few keys from a few devices (windows, dilated windows, block-local
  with blocks across shards, neighborhoods along the sharded axis). For each offset ``delta`` some
  device needs keys from, every device sends the same static slice of its keys (the union over
  devices of the columns the blocks at that offset read) straight to device ``i - delta``: a window
  of ``w`` keys moves ``w`` keys per neighbour, from as many neighbours as the window spans. Taken
  while the halos total at most :data:`HALO_SHARDS` shards of keys: a halo holds them all at once.
* ``"ring"``: the rest (causal, dense, global tokens, prefix-LM, packed documents). Key shards rotate
  one device per step, in the direction that needs fewer steps; the ring stops after the last step
  with a block on any device, so a mask that reads only the ``T`` nearest shards takes ``T`` steps,
  not ``P - 1``. Steps in between with no block anywhere only rotate.

Per step, devices whose blocks differ (the causal diagonal, the sequence's ends) pick theirs by
``lax.switch`` on the axis index: each distinct block is one branch, traced once.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

import acsr
from acsr import ACSR
from splat._sharded import _order

# Halo keys (summed over offsets) above which the ring is used instead: the ring holds two shards of
# keys (the one it computes on and the one arriving) whatever the mask; a halo holds all of its keys.
HALO_SHARDS = 2

MODES = ("local", "halo", "ring")

Runs = tuple[np.ndarray, np.ndarray, np.ndarray]


@dataclass(frozen=True)
class Block:
    """One device's queries against one device's keys, trimmed to where the mask has nonzeros.

    Attributes:
      rows: ``(r0, r1)``, the query device's local rows the block covers.
      cols: ``(c0, c1)``, the key device's local keys the block covers.
      layout: the mask on those rows and keys, shape ``(r1 - r0, c1 - c0)``.
      full: every (row, key) of the block is in the mask.
    """

    rows: tuple[int, int]
    cols: tuple[int, int]
    layout: ACSR
    full: bool

    @property
    def nnz(self) -> int:
        return self.layout.nnz

    def describe(self) -> str:
        kind = "full" if self.full else f"{self.layout.density():.3f} dense"
        return f"rows {self.rows[0]}:{self.rows[1]} x keys {self.cols[0]}:{self.cols[1]} ({kind})"


@dataclass(frozen=True, eq=False)
class Step:
    """One exchange of keys and the blocks computed on them.

    Attributes:
      offset: halo: device ``i`` computes on the keys of device ``i + offset`` (0: its own); ring:
        on those of device ``(i - direction * offset) mod P``, after ``offset`` rotations.
      cols: the keys each device sends, ``(h0, h1)`` of its local keys (the ring sends all).
      index: per device, the :attr:`Plan.blocks` entry it computes, -1 for none.
    """

    offset: int
    cols: tuple[int, int]
    index: tuple[int, ...]

    @property
    def width(self) -> int:
        return self.cols[1] - self.cols[0]


@dataclass(frozen=True, eq=False)
class Plan:
    """How one mask runs over ``parts`` devices (module docstring); built by :func:`plan`, cached.

    Attributes:
      mode: ``"local"``, ``"halo"`` or ``"ring"``.
      parts: devices on the sequence axis, ``P``.
      order: the chunk order (:mod:`splat._sharded._order`).
      q_local, kv_local: queries and keys a device holds.
      q_pieces, kv_pieces: per device, its pieces ``(global start, length)``.
      blocks: the distinct blocks, over all steps and devices.
      steps: the exchanges in the order they run; the first computes on local keys.
      direction: ring only: +1 when device ``i`` receives from ``i - 1``, -1 from ``i + 1``.
    """

    mode: str
    parts: int
    order: str
    q_local: int
    kv_local: int
    q_pieces: tuple[_order.Pieces, ...]
    kv_pieces: tuple[_order.Pieces, ...]
    blocks: tuple[Block, ...]
    steps: tuple[Step, ...]
    direction: int = 1

    @property
    def halo_keys(self) -> int:
        """Keys a device receives in halo mode (summed over offsets); 0 otherwise."""
        return sum(s.width for s in self.steps if s.offset) if self.mode == "halo" else 0

    def key_device(self, step: Step, device: int) -> int:
        """The device whose keys ``device`` computes on at ``step``."""
        if self.mode == "ring":
            return (device - self.direction * step.offset) % self.parts
        return device + step.offset

    def describe(self) -> str:
        """What moves and what each step computes, one line per step."""
        head = f"{self.mode} over {self.parts} devices ({self.order}), {self.q_local} queries a device"
        lines = [head]
        for s in self.steps:
            used = sorted({b for b in s.index if b >= 0})
            what = "; ".join(self.blocks[b].describe() for b in used) or "nothing (rotation only)"
            if s.offset == 0:
                src = "local keys"
            elif self.mode == "ring":
                src = f"the shard of device i{-self.direction * s.offset:+d} (mod {self.parts})"
            else:
                src = f"keys {s.cols[0]}:{s.cols[1]} of device i{s.offset:+d}"
            lines.append(f"  step {s.offset}: {src}: {what}")
        return "\n".join(lines)


# -----------------------------------------------------------------------------
# the global layout's rows as progressions
# -----------------------------------------------------------------------------


@functools.lru_cache(maxsize=8)
def _residual_csr(layout: ACSR) -> tuple[np.ndarray, np.ndarray]:
    """CSR ``(indptr [q_len + 1], cols)`` of the layout's residual, sorted within rows."""
    rows, cols = layout.residual.nonzeros()
    order = np.lexsort((cols, rows))
    indptr = np.zeros(layout.q_len + 1, np.int64)
    np.cumsum(np.bincount(rows, minlength=layout.q_len), out=indptr[1:])
    return indptr, cols[order].astype(np.int64)


@functools.lru_cache(maxsize=8)
def _grid_runs(layout: ACSR) -> Runs:
    return layout.grid.product_runs()


def _rows_runs(layout: ACSR, r0: int, r1: int) -> Runs:
    """Rows ``[r0, r1)`` of the global layout as disjoint progressions ``[r1 - r0, K]`` (global
    columns; not canonical, padding has count 0)."""
    if layout.grid is not None:
        return tuple(a[r0:r1] for a in _grid_runs(layout))
    parts = [
        tuple(a[r0:r1, None].astype(np.int64) for a in (s.base, s.stride, s.count)) for s in layout.segments
    ]
    if layout.residual is not None and layout.residual.max_blocks:
        indptr, cols = _residual_csr(layout)
        sub = indptr[r0 : r1 + 1]
        parts.append(acsr.runs_from_csr(sub - sub[0], cols[sub[0] : sub[-1]]))
    if not parts:
        z = np.zeros((r1 - r0, 1), np.int64)
        return z, z + 1, z
    return tuple(np.concatenate([p[i] for p in parts], axis=1) for i in range(3))


def _clip(runs: Runs, g0: int, g1: int, offset: int) -> Runs:
    """The progressions cut to global columns ``[g0, g1)``, moved to start at local column ``offset``."""
    base, stride, count = runs
    t0 = np.maximum(0, -(-(g0 - base) // stride))
    t1 = np.minimum(count, -(-(g1 - base) // stride))
    n = np.maximum(t1 - t0, 0)
    return np.where(n > 0, base + stride * t0 - g0 + offset, 0), np.where(n > 1, stride, 1), n


def _canonical(runs: Runs) -> Runs:
    """The canonical runs (:mod:`acsr._runs`) of disjoint progressions."""
    base, stride, count = runs
    if np.all((stride == 1) | (count <= 1)):
        merged = acsr.merge_intervals(base, base + count)
        if merged is not None:
            b, c = merged
            return b, np.ones_like(b), c
    return acsr.runs_from_csr(*acsr.csr_from_runs(base, stride, count))


# -----------------------------------------------------------------------------
# blocks
# -----------------------------------------------------------------------------


def _pieces_runs(layout: ACSR, q_pieces: _order.Pieces, kv_pieces: _order.Pieces) -> Runs:
    """The mask on these query pieces against these key pieces (local columns, keys numbered in
    piece order), as disjoint progressions ``[rows, K]``."""
    per_rows = []
    for g0, n in q_pieces:
        runs = _rows_runs(layout, g0, g0 + n)
        cut, off = [], 0
        for k0, m in kv_pieces:
            cut.append(_clip(runs, k0, k0 + m, off))
            off += m
        per_rows.append(tuple(np.concatenate([c[i] for c in cut], axis=1) for i in range(3)))
    width = max(r[0].shape[1] for r in per_rows)
    pad = lambda a, fill: np.pad(a, ((0, 0), (0, width - a.shape[1])), constant_values=fill)
    return tuple(np.concatenate([pad(r[i], f) for r in per_rows]) for i, f in ((0, 0), (1, 1), (2, 0)))


def _block(layout: ACSR, q_pieces: _order.Pieces, kv_pieces: _order.Pieces) -> Block | None:
    """The block of these query pieces against these key pieces; None where the mask has none."""
    base, stride, count = _pieces_runs(layout, q_pieces, kv_pieces)
    live = count > 0
    rows_live = live.any(axis=1)
    if not rows_live.any():
        return None
    r0 = int(np.argmax(rows_live))
    r1 = len(rows_live) - int(np.argmax(rows_live[::-1]))
    last = base + stride * (count - 1)
    c0 = int(base[live].min())
    c1 = int(last[live].max()) + 1
    base, stride, count = (a[r0:r1] for a in (base, stride, count))
    base = np.where(count > 0, base - c0, 0)
    base, stride, count = _canonical((base, stride, count))
    nnz = int(count.sum())
    layout_b = acsr.from_runs(r1 - r0, c1 - c0, base, stride, count)
    return Block((r0, r1), (c0, c1), layout_b, nnz == (r1 - r0) * (c1 - c0))


def rows_layout(layout: ACSR, parts: int, order: str, device: int) -> ACSR:
    """Device ``device``'s local queries against the whole key sequence in its original order: the
    layout a device uses after gathering every key (the all-gather baseline of
    ``benchmarks/bench_sequence_parallel.py``; gathered zigzag keys are put back in order first)."""
    qp = _order.pieces(order, layout.q_len // parts, parts)
    runs = _canonical(_pieces_runs(layout, qp[device], ((0, layout.kv_len),)))
    return acsr.from_runs(layout.q_len // parts, layout.kv_len, *runs)


def blocks(layout: ACSR, parts: int, order: str) -> list[list[Block | None]]:
    """``[i][j]``: the block of device ``i``'s queries against device ``j``'s keys (None: empty)."""
    qp = _order.pieces(order, layout.q_len // parts, parts)
    kp = _order.pieces(order, layout.kv_len // parts, parts)
    return [[_block(layout, qp[i], kp[j]) for j in range(parts)] for i in range(parts)]


# -----------------------------------------------------------------------------
# the plan
# -----------------------------------------------------------------------------


@functools.lru_cache(maxsize=32)
def plan(layout: ACSR, parts: int, order: str = "contiguous") -> Plan:
    """The :class:`Plan` of the global ``layout`` over ``parts`` devices in ``order``.

    ``layout.q_len`` and ``layout.kv_len`` must be multiples of ``parts`` (of ``2 * parts`` for the
    zigzag order); the caller checks.

    Example:
      >>> from splat import masks
      >>> p = plan(masks.sliding_window(7, 0).to_acsr(64), 4)
      >>> p.mode, p.halo_keys
      ('halo', 7)
    """
    nq, nk = layout.q_len // parts, layout.kv_len // parts
    grid = blocks(layout, parts, order)
    distinct: dict[Block, int] = {}

    def index(b: Block | None) -> int:
        return -1 if b is None else distinct.setdefault(b, len(distinct))

    common = dict(
        parts=parts,
        order=order,
        q_local=nq,
        kv_local=nk,
        q_pieces=_order.pieces(order, nq, parts),
        kv_pieces=_order.pieces(order, nk, parts),
    )

    # halo: per offset, the devices with a block there and the union of the keys they read
    halo = []
    for delta in sorted(range(-(parts - 1), parts), key=lambda d: (abs(d), d)):
        pairs = [(i, grid[i][i + delta]) for i in range(parts) if 0 <= i + delta < parts]
        used = [b for _, b in pairs if b is not None]
        if delta == 0 or used:
            cols = (min(b.cols[0] for b in used), max(b.cols[1] for b in used)) if used else (0, nk)
            halo.append(
                (delta, cols, [grid[i][i + delta] if 0 <= i + delta < parts else None for i in range(parts)])
            )
    halo_keys = sum(c[1] - c[0] for d, c, _ in halo if d)
    if halo_keys <= HALO_SHARDS * nk:
        steps = []
        for delta, cols, row in halo:
            if delta:
                row = [None if b is None else _shifted(b, -cols[0]) for b in row]
            steps.append(Step(delta, cols if delta else (0, nk), tuple(index(b) for b in row)))
        mode = "halo" if len(steps) > 1 else "local"
        return Plan(mode, blocks=tuple(distinct), steps=tuple(steps), **common)

    # ring, in the direction whose last step with a block comes first
    def last_step(direction: int) -> int:
        return max(
            t for t in range(parts) for i in range(parts) if grid[i][(i - direction * t) % parts] is not None
        )

    direction = 1 if last_step(1) <= last_step(-1) else -1
    steps = []
    for t in range(last_step(direction) + 1):
        row = [grid[i][(i - direction * t) % parts] for i in range(parts)]
        steps.append(Step(t, (0, nk), tuple(index(b) for b in row)))
    return Plan("ring", blocks=tuple(distinct), steps=tuple(steps), direction=direction, **common)


def _shifted(b: Block, by: int) -> Block:
    """``b`` with its key columns counted from ``by`` keys later (a halo buffer's first key)."""
    return Block(b.rows, (b.cols[0] + by, b.cols[1] + by), b.layout, b.full)
