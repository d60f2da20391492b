"""ACSR: affine-compressed sparse row, the layout every splat kernel reads.

An attention mask of ``q_len x kv_len`` is stored as

* up to :data:`MAX_SEGMENTS` **segments**. Segment ``k`` holds, for each row
  ``r``, one arithmetic progression of columns::

      col(r, t) = base[r] + stride[r] * t        for 0 <= t < count[r]

  ========  =====  ==========  =================================================
  array     dtype  shape       meaning and padding
  ========  =====  ==========  =================================================
  base      int32  [q_len]     first column; 0 where ``count == 0``
  stride    int32  [q_len]     column step (>= 1); 1 where ``count <= 1``
  count     int32  [q_len]     number of columns (>= 0)
  ========  =====  ==========  =================================================

  plus, where the analyzer found one, a :class:`~acsr.ClosedForm`: laws in
  ``r`` that reproduce those arrays, so generated kernels compute them instead
  of loading them.

* a **residual** (:class:`BlockResidual`, block-sparse) for what the segments
  cannot hold: a mask whose rows need more than :data:`MAX_SEGMENTS`
  progressions is stored entirely there;

* or, instead of both, a **grid** (:class:`~acsr.GridWindows`, see
  :mod:`acsr._grid`): a mask over the tokens of an N-D grid that is a product
  of per-axis windows (neighborhood attention) and needs more than
  :data:`MAX_SEGMENTS` progressions per row is stored as its per-axis tables,
  with no per-row arrays. :attr:`ACSR.flat` gives the same mask as segments and
  residual for code that walks rows.

Segments and residual are disjoint and their union is the mask. Within a row
the segments follow the canonical decomposition of ``acsr._runs`` (contiguous
runs first, isolated columns grouped into progressions, ordered by first
column), so two layouts of the same mask are equal, and hash equal.

**Value arrays.** The unfused kernels (SDDMM, softmax, SpMM) store one value per
mask nonzero in a padded ``[B, H, q_len, nnz_max]`` array: segment ``k`` owns
slots ``[slot_offsets[k], slot_offsets[k] + width_k)`` with ``width_k`` its
largest count; slot ``t`` of that range is column ``base[r] + stride[r] * t``
and is padding when ``t >= count[r]``. The residual owns the last
``residual.max_blocks * residual.block_kv`` slots: slot ``j * block_kv + u`` is
column ``kv_blocks[r // block_q, j] * block_kv + u``, valid where
``bits[r // block_q, j, r % block_q, u]``. Padding slots hold 0 in SDDMM and
softmax outputs and are ignored by SpMM.

**Fully masked rows** (count 0 everywhere) are legal; attention over such a row
outputs 0, and its logsumexp is ``-inf``.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass, field

import numpy as np

from acsr._grid import GridWindows
from acsr._law import ClosedForm
from acsr._runs import csr_from_runs

MAX_SEGMENTS = 4


class LayoutError(ValueError):
    """An ACSR layout whose arrays contradict each other."""


def _frozen(a: np.ndarray, dtype) -> np.ndarray:
    a = np.ascontiguousarray(a, dtype=dtype)
    a.setflags(write=False)
    return a


@dataclass(frozen=True, eq=False)
class Segment:
    """One progression per row; see the module docstring for the arrays."""

    base: np.ndarray
    stride: np.ndarray
    count: np.ndarray
    closed_form: ClosedForm | None = None

    def __post_init__(self):
        for name in ("base", "stride", "count"):
            object.__setattr__(self, name, _frozen(getattr(self, name), np.int32))

    @property
    def width(self) -> int:
        """Value slots this segment owns: its largest row count."""
        return int(self.count.max()) if self.count.size else 0

    @property
    def uniform_stride(self) -> int | None:
        """The stride shared by every row with two or more columns, if one is."""
        s = np.unique(self.stride[self.count > 1])
        if s.size == 0:
            return 1
        return int(s[0]) if s.size == 1 else None

    def end(self) -> np.ndarray:
        """Last column plus one, int64 ``[q_len]`` (``base`` where empty)."""
        c = self.count.astype(np.int64)
        return np.where(c > 0, self.base + self.stride.astype(np.int64) * (c - 1) + 1, self.base)


@dataclass(frozen=True, eq=False)
class BlockResidual:
    """Block-sparse remainder of a mask (BCSR with a bitmap per block).

    =========== ===== ============================================ =====================
    array       dtype shape                                        meaning, padding
    =========== ===== ============================================ =====================
    kv_blocks   int32 [n_q_blocks, max_blocks]                     key-block indices,
                                                                   ascending; -1 pads
    num_blocks  int32 [n_q_blocks]                                 used entries per row
                                                                   block
    bits        bool  [n_q_blocks, max_blocks, block_q, block_kv]  which (row, column)
                                                                   of the block is in
                                                                   the mask; False pads
                                                                   (also past q_len and
                                                                   kv_len)
    =========== ===== ============================================ =====================

    Query row ``r`` lies in row block ``r // block_q``; key column
    ``kv_blocks[i, j] * block_kv + u`` is bit ``u`` of block ``j``.
    """

    block_q: int
    block_kv: int
    kv_blocks: np.ndarray
    num_blocks: np.ndarray
    bits: np.ndarray

    def __post_init__(self):
        object.__setattr__(self, "kv_blocks", _frozen(self.kv_blocks, np.int32))
        object.__setattr__(self, "num_blocks", _frozen(self.num_blocks, np.int32))
        object.__setattr__(self, "bits", _frozen(self.bits, bool))

    @property
    def max_blocks(self) -> int:
        return int(self.kv_blocks.shape[1])

    @property
    def width(self) -> int:
        return self.max_blocks * self.block_kv

    def nonzeros(self) -> tuple[np.ndarray, np.ndarray]:
        """``(rows, columns)``, int64, of every set bit."""
        i, j, a, u = np.nonzero(self.bits)
        return i * self.block_q + a, self.kv_blocks[i, j].astype(np.int64) * self.block_kv + u

    def dense(self, q_len: int, kv_len: int) -> np.ndarray:
        """Boolean ``[q_len, kv_len]`` rendering of the residual alone."""
        out = np.zeros((q_len, kv_len), bool)
        out[self.nonzeros()] = True
        return out


@dataclass(frozen=True, eq=False)
class ACSR:
    """An attention mask in affine-compressed sparse row form.

    Frozen, and hashable and comparable by value, so plans and kernels cache on
    it. Build one with :func:`acsr.from_dense` or, usually, through
    ``splat.masks`` / ``splat.analyze``.

    Example:
      >>> import numpy as np, acsr
      >>> m = np.tril(np.ones((4, 4), bool))
      >>> layout = acsr.from_dense(m)
      >>> layout.nnz, bool((layout.to_dense() == m).all())
      (10, True)
    """

    q_len: int
    kv_len: int
    segments: tuple[Segment, ...]
    residual: BlockResidual | None = None
    grid: GridWindows | None = None
    _key: bytes = field(default=b"", repr=False)

    def __post_init__(self):
        object.__setattr__(self, "segments", tuple(self.segments))
        if self.grid is not None and (self.segments or self.residual is not None):
            raise LayoutError("a grid layout holds neither segments nor a residual")
        if self.grid is not None and (self.grid.size, self.grid.size) != (self.q_len, self.kv_len):
            raise LayoutError(f"grid {self.grid.grid} does not cover a {self.q_len}x{self.kv_len} mask")
        object.__setattr__(self, "_key", self._digest())

    @functools.cached_property
    def flat(self) -> ACSR:
        """This mask as segments and residual: itself, unless it is a grid layout, whose
        rows are expanded into a block-sparse residual (for code that walks rows, e.g. the
        pure-JAX backend and the unfused kernels; ``O(nnz)`` work, done once)."""
        if self.grid is None:
            return self
        from acsr._build import residual_from_csr

        indptr, cols = self.grid.csr()
        return ACSR(self.q_len, self.kv_len, (), residual_from_csr(indptr, cols, self.q_len, self.kv_len))

    def _digest(self) -> bytes:
        h = hashlib.blake2b(digest_size=20)
        h.update(f"{self.q_len},{self.kv_len},{len(self.segments)}".encode())
        for s in self.segments:
            for a in (s.base, s.stride, s.count):
                h.update(a.tobytes())
            h.update(repr(s.closed_form).encode())
        if self.residual is not None:
            r = self.residual
            h.update(f"res{r.block_q},{r.block_kv},{r.kv_blocks.shape}".encode())
            for a in (r.kv_blocks, r.num_blocks, np.packbits(r.bits)):
                h.update(a.tobytes())
        if self.grid is not None:
            h.update(b"grid" + self.grid.digest())
        return h.digest()

    def __hash__(self) -> int:
        return hash(self._key)

    def __eq__(self, other) -> bool:
        return isinstance(other, ACSR) and self._key == other._key

    # -- sizes ----------------------------------------------------------------

    @property
    def shape(self) -> tuple[int, int]:
        return (self.q_len, self.kv_len)

    @property
    def slot_offsets(self) -> tuple[int, ...]:
        """First value slot of each segment, then of the residual (of :attr:`flat`)."""
        if self.grid is not None:
            return self.flat.slot_offsets
        offs, o = [], 0
        for s in self.segments:
            offs.append(o)
            o += s.width
        offs.append(o)
        return tuple(offs)

    @property
    def nnz_max(self) -> int:
        """Width of the padded value arrays ``[B, H, q_len, nnz_max]`` (of :attr:`flat`)."""
        if self.grid is not None:
            return self.flat.nnz_max
        w = sum(s.width for s in self.segments)
        return w + (self.residual.width if self.residual is not None else 0)

    def row_counts(self) -> np.ndarray:
        """Nonzeros per row, int64 ``[q_len]``."""
        if self.grid is not None:
            return self.grid.row_counts()
        n = np.zeros(self.q_len, np.int64)
        for s in self.segments:
            n += s.count
        if self.residual is not None:
            r = self.residual
            per_block_row = r.bits.sum(axis=(1, 3)).reshape(-1)[: self.q_len]
            n[: per_block_row.size] += per_block_row
        return n

    @property
    def nnz(self) -> int:
        return int(self.row_counts().sum())

    def density(self) -> float:
        return self.nnz / max(1, self.q_len * self.kv_len)

    # -- views ----------------------------------------------------------------

    def slot_columns(self, rows: slice | None = None) -> np.ndarray:
        """Column of each value slot, int32 ``[rows, nnz_max]``; -1 marks padding."""
        if self.grid is not None:
            return self.flat.slot_columns(rows)
        rows = rows or slice(0, self.q_len)
        r = np.arange(self.q_len)[rows]
        parts = []
        for s in self.segments:
            t = np.arange(s.width)
            col = s.base[r, None].astype(np.int64) + s.stride[r, None].astype(np.int64) * t
            parts.append(np.where(t < s.count[r, None], col, -1))
        if self.residual is not None:
            res = self.residual
            rb, ri = r // res.block_q, r % res.block_q
            u = np.arange(res.block_kv)
            kb = res.kv_blocks[rb].astype(np.int64)  # [n, max_blocks]
            col = kb[:, :, None] * res.block_kv + u  # [n, max_blocks, block_kv]
            valid = res.bits[rb, :, ri, :] & (kb[:, :, None] >= 0)
            parts.append(np.where(valid, col, -1).reshape(r.size, -1))
        if not parts:
            return np.zeros((r.size, 0), np.int32)
        return np.concatenate(parts, axis=1).astype(np.int32)

    def to_dense(self) -> np.ndarray:
        """The mask as a boolean ``[q_len, kv_len]`` array."""
        if self.grid is not None:
            return self.grid.dense()
        out = np.zeros((self.q_len, self.kv_len), bool)
        for s in self.segments:
            indptr, cols = csr_from_runs(s.base[:, None], s.stride[:, None], s.count[:, None])
            out[np.repeat(np.arange(self.q_len), np.diff(indptr)), cols] = True
        if self.residual is not None:
            out |= self.residual.dense(self.q_len, self.kv_len)
        return out

    def transpose(self) -> ACSR:
        """The column-wise view: an ACSR of the ``kv_len x q_len`` transposed mask."""
        from acsr._build import transpose

        return transpose(self)

    # -- text -----------------------------------------------------------------

    def to_string(self, max_rows: int = 16, max_cols: int = 64) -> str:
        """A readable summary and a character picture of the top-left corner (saying so when cut)."""
        lines = [repr(self)]
        if self.grid is not None:
            lines += [
                f"  grid axis {i}: length {a.length}, dilation {a.dilation}, "
                f"{int(a.count.min())}-{int(a.count.max())} keys per query coordinate"
                for i, a in enumerate(self.grid.axes)
            ]
        for k, s in enumerate(self.segments):
            st = s.uniform_stride
            law = s.closed_form.to_string() if s.closed_form is not None else "per-row arrays"
            lines.append(
                f"  segment {k}: width {s.width}, stride {st if st is not None else 'varies'}, {law}"
            )
        if self.residual is not None:
            r = self.residual
            lines.append(
                f"  residual: blocks {r.block_q}x{r.block_kv}, up to {r.max_blocks} per row block, "
                f"{int(r.num_blocks.sum())} in all"
            )
        nr, nc = min(max_rows, self.q_len), min(max_cols, self.kv_len)
        if (nr, nc) != (self.q_len, self.kv_len):
            lines.append(f"  showing rows 0-{nr - 1}, cols 0-{nc - 1} of {self.q_len}x{self.kv_len}:")
        pic = np.full((nr, nc), ".")
        if self.grid is not None:
            pic[self.grid.contains(np.arange(nr)[:, None], np.arange(nc)[None, :])] = "#"
        else:
            cols = self.slot_columns(slice(0, nr))
            for i in range(nr):
                c = cols[i][(cols[i] >= 0) & (cols[i] < nc)]
                pic[i, c] = "#"
        lines += ["  " + "".join(row) for row in pic]
        return "\n".join(lines)

    def __repr__(self) -> str:
        if self.grid is not None:
            return (
                f"ACSR({self.q_len}x{self.kv_len}, nnz={self.nnz}, density={self.density():.4f}, "
                f"grid={'x'.join(map(str, self.grid.grid))})"
            )
        res = "none" if self.residual is None else f"{int(self.residual.num_blocks.sum())} blocks"
        closed = sum(s.closed_form is not None for s in self.segments)
        return (
            f"ACSR({self.q_len}x{self.kv_len}, nnz={self.nnz}, density={self.density():.4f}, "
            f"segments={len(self.segments)} ({closed} closed-form), residual={res})"
        )

    # -- checks ---------------------------------------------------------------

    def validate(self) -> ACSR:
        """Checks every invariant in the module docstring; raises :class:`LayoutError`."""
        from acsr._build import validate

        validate(self)
        return self
