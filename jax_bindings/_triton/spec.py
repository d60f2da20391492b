"""Kernel specs: everything the generator needs to render one Triton kernel.

A :class:`KernelSpec` is derived from an :class:`acsr.ACSR` layout, the shapes
and the dtype (:func:`plan`). It is frozen and hashable: generated modules are
cached by it. Per-row metadata (arrays for segments without a closed form, the
row permutation of stride alignment, the heaviest-first block order, the
residual's block lists) is not part of the spec; :class:`Plan` carries it next
to the spec as numpy operands.

What is not Triton's -- row order, segment modes (``dense`` / ``aligned`` /
``modular``), key spans, tile cover, block order -- comes from the
backend-neutral walk plan, :func:`acsr.walk_plan` (see :mod:`acsr._plan`).
What is: tiles, warps, stages, the tile walk (``loop``), the head dims, dtypes
and residual blocks the kernels take.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import numpy as np

import acsr
from acsr import ACSR, Piece

OPS = ("fwd", "bwd_dq", "bwd_dkdv", "sddmm", "softmax", "spmm")
FUSED_OPS = ("fwd", "bwd_dq", "bwd_dkdv")
# runtime masks the fused kernels take: none, per-row column ranges, ranges and segment ids
RUNTIME_MASKS = ("", "ranges", "ids")
DTYPES = ("float16", "bfloat16", "float32")
MAX_HEAD_DIM = 256


@dataclass(frozen=True)
class SegSpec:
    """How a kernel walks one ACSR segment.

    Attributes:
      mode: ``"dense"``, ``"aligned"`` or ``"modular"`` (:data:`acsr.MODES`, see :mod:`acsr._plan`).
      stride: the uniform stride, or 0 when it varies per row.
      source: ``"law"`` (closed form baked in, no metadata loaded) or
        ``"arrays"`` (per-row base/count[/stride] int32 operands).
      pieces: the closed form's pieces when ``source == "law"``.
      width: value slots owned (largest row count).
      slot_offset: first value slot in ``[B, H, rows, nnz_max]`` arrays.
    """

    mode: str
    stride: int
    source: str
    pieces: tuple[Piece, ...]
    width: int
    slot_offset: int


@dataclass(frozen=True)
class ResSpec:
    """The residual's static shape: ``block_q x block_kv`` blocks, ``max_blocks`` per row block."""

    block_q: int
    block_kv: int
    max_blocks: int
    slot_offset: int


def pow2_ceil(n: int) -> int:
    """The least power of two >= ``n`` (1 for ``n <= 1``)."""
    return 1 << max(0, (n - 1).bit_length())


def padded_head_dim(head_dim: int) -> int:
    """``BLOCK_D``: the head dim rounded up to a power of two, at least 16 (``tl.dot``)."""
    return max(16, pow2_ceil(head_dim))


class HeadShape:
    """What every kernel spec derives from its ``num_heads``, ``num_kv_heads`` and ``head_dim``."""

    @property
    def group(self) -> int:
        """GQA ratio: query heads per key/value head."""
        return self.num_heads // self.num_kv_heads

    @property
    def block_d(self) -> int:
        return padded_head_dim(self.head_dim)


@dataclass(frozen=True)
class KernelSpec(HeadShape):
    """Frozen description of one generated kernel (cache key of the generator).

    ``rows``/``cols`` are the layout's ``q_len``/``kv_len``; for ``bwd_dkdv``
    the layout is the transposed one (rows are keys, columns are queries).
    ``loop``: how the fused attention kernels (fwd, bwd_dq, bwd_dkdv) walk a
    stride-1 / aligned segment's key tiles: ``"fused"`` one software-pipelined
    loop whose edge tiles (known per row block at run time) build and apply the
    mask under a run-time test, interior tiles skip it; ``"split"`` three loops
    (partial, full, partial) with the mask decided at compile time;
    ``"single"`` one loop masking every tile. The unfused ops walk ``"fused"``
    as ``"split"``.
    ``ordered``: programs take row blocks from an ``Order`` operand, heaviest
    first, with the grid's fastest axis over batch x heads (load balance for
    layouts with a few very long rows, e.g. global tokens).
    ``runtime``: the runtime mask the fused kernels AND in (:data:`RUNTIME_MASKS`;
    see :mod:`jax_bindings._runtime`): ``""`` none; ``"ranges"`` the lengths
    ``RtRowLen [B]`` (rows at or past it are padding) and ``RtColLen [B]``
    (columns at or past it are never seen) and the flag ``RtExact [B]``, data
    operands after the inputs; ``"ids"`` also ``RowIds [B, rows]`` and
    ``ColIds [B, cols]``. Tiles outside a row block's columns are skipped;
    tiles crossing a length or a document end (or every tile, where ids are
    not sorted) are masked.
    """

    op: str
    rows: int
    cols: int
    segments: tuple[SegSpec, ...]
    residual: ResSpec | None
    permuted: bool
    dtype: str
    head_dim: int
    num_heads: int
    num_kv_heads: int
    block_m: int
    block_n: int
    nnz_max: int
    num_warps: int = 4
    num_stages: int = 2
    loop: str = "fused"
    ordered: bool = False
    runtime: str = ""

    def runtime_names(self) -> tuple[str, ...]:
        """Names of the runtime-mask operands, in the order kernels take them (after the inputs)."""
        if not self.runtime:
            return ()
        return ("RtRowLen", "RtColLen", "RtExact") + (("RowIds", "ColIds") if self.runtime == "ids" else ())

    def meta_names(self) -> tuple[str, ...]:
        """Names of the metadata operands, in the order kernels take them."""
        names = []
        for k, s in enumerate(self.segments):
            if s.source == "arrays":
                names += [f"Base{k}", f"Cnt{k}"]
                if s.stride == 0:
                    names.append(f"Str{k}")
        if self.permuted:
            names.append("Perm")
        if self.ordered:
            names.append("Order")
        if self.residual is not None:
            names += ["ResKB", "ResNB", "ResBits"]
        return tuple(names)


LOOPS = ("fused", "split", "single")
WARPS = (1, 2, 4, 8)


def _int_field(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"tiles.{name} must be an int, got {type(v).__name__} {v!r}")
    return int(v)


@dataclass(frozen=True)
class Tiles:
    """Tile configuration of one kernel, validated (errors name the field).

    Attributes:
      block_m: rows per program (a power of two >= 16; ``tl.dot`` needs 16).
      block_n: columns per key tile (a power of two >= 16).
      num_warps: warps per program, one of :data:`WARPS`.
      num_stages: software-pipeline stages (>= 1).
      loop: the tile walk, one of :data:`LOOPS` (see :class:`KernelSpec`).

    Unpacks as ``block_m, block_n, num_warps, num_stages, loop``; ``tiles=``
    arguments take a plain 4- or 5-tuple too (:meth:`of`).

    Example:
      >>> Tiles(64, 32, 4, 3)
      Tiles(block_m=64, block_n=32, num_warps=4, num_stages=3, loop='fused')
      >>> Tiles(64, 24, 4, 3)
      Traceback (most recent call last):
      ...
      ValueError: tiles.block_n must be a power of two >= 16, got 24
    """

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    loop: str = "fused"

    def __post_init__(self):
        for name in ("block_m", "block_n"):
            v = _int_field(name, getattr(self, name))
            if v < 16 or v & (v - 1):
                raise ValueError(f"tiles.{name} must be a power of two >= 16, got {v}")
            object.__setattr__(self, name, v)
        w = _int_field("num_warps", self.num_warps)
        if w not in WARPS:
            raise ValueError(f"tiles.num_warps must be one of {WARPS}, got {w}")
        st = _int_field("num_stages", self.num_stages)
        if st < 1:
            raise ValueError(f"tiles.num_stages must be >= 1, got {st}")
        if self.loop not in LOOPS:
            raise ValueError(f"tiles.loop must be one of {LOOPS}, got {self.loop!r}")
        object.__setattr__(self, "num_warps", w)
        object.__setattr__(self, "num_stages", st)

    def __iter__(self):
        return iter((self.block_m, self.block_n, self.num_warps, self.num_stages, self.loop))

    @classmethod
    def of(cls, tiles) -> Tiles:
        """``tiles`` as :class:`Tiles`: a Tiles, or ``(block_m, block_n, num_warps, num_stages[, loop])``."""
        if isinstance(tiles, Tiles):
            return tiles
        if isinstance(tiles, (tuple, list)) and len(tiles) in (4, 5):
            return cls(*tiles)
        raise TypeError(
            "tiles must be a Tiles or a (block_m, block_n, num_warps, num_stages[, loop]) tuple, "
            f"got {tiles!r}"
        )


@dataclass(frozen=True, eq=False)
class Plan:
    """A spec plus its metadata operands and grid size along rows."""

    spec: KernelSpec
    meta: tuple[np.ndarray, ...] = field(repr=False)
    row_blocks: int


# -- tile defaults ------------------------------------------------------------

# (block_m, block_n, num_warps, num_stages) per op for head dims <= 128 on Hopper-class GPUs.
_GPU_TILES = {
    "fwd": (64, 64, 4, 3),  # best of 15 walks x tiles on H200 for rows of <= ~1k keys
    "bwd_dq": (64, 32, 4, 3),  # H200, fused loop: best window + dilated + causal-window sum
    "bwd_dkdv": (64, 32, 4, 3),  # H200, fused loop: +5% window, +21% dilated over 64x64x2 split
    # unfused ops, H200 sweep at S=16384: spmm 2.0x, softmax 1.6x, sddmm 1.04x
    "sddmm": (64, 64, 4, 3),
    "softmax": (16, 256, 4, 2),
    "spmm": (64, 128, 4, 2),
}
# Long rows (causal, full, global): bigger tiles with 8 warps pay off once a row block
# walks enough tiles to amortise its prologue (H200, S=16384: forward 494 vs 422 TF/s
# causal at 128x128; dq 556 vs 463 at 128x64; 1k-key rows lose 3-10% with them).
_LONG_ROW = 2048
_LONG_TILES = {"fwd": (128, 128, 8, 3), "bwd_dq": (128, 64, 8, 3)}
# Shorter rows: 128-row forward tiles run full tiles ~10% faster than 64-row ones (H200:
# 477 vs 432 TF/s on a full mask) but waste more of a diagonal edge (window256: 266 vs 298).
# Taken when 128x64 tiles cover the mask almost as tightly as 64x64 ones (block-local:
# 403 vs 368 TF/s).
_TALL_TILES = {"fwd": (128, 64, 8, 3)}
_TALL_MIN_COVER = 0.97
# Head dims over 128 in 16-bit types: sliding window (256, 256) at D = 256, S = 8192 / 16384,
# H100 (splat tune): the forward 2.3x faster on 128x64x8x2 than on
# 64x32x8x1, dK/dV 1.16x on 64x64x8x2; dQ's larger tiles exceed shared memory.
_WIDE_HEAD_TILES = {"fwd": (128, 64, 8, 2), "bwd_dq": (64, 32, 8, 1), "bwd_dkdv": (64, 64, 8, 2)}


def default_tiles(
    op: str, head_dim: int, dtype: str = "bfloat16", row_keys: float = 0.0, tall_cover: float = 0.0
) -> Tiles:
    """Heuristic tiles for ``op``.

    ``row_keys``: mean keys per query row of the layout; ``tall_cover``: how tightly
    128-row tiles cover the mask relative to 64-row ones (:func:`acsr.tile_cover` ratio).
    """
    bm, bn, w, st = _GPU_TILES[op]
    if op in _LONG_TILES and row_keys >= _LONG_ROW and head_dim <= 128 and dtype != "float32":
        bm, bn, w, st = _LONG_TILES[op]
    elif op in _TALL_TILES and tall_cover >= _TALL_MIN_COVER and head_dim <= 128 and dtype != "float32":
        bm, bn, w, st = _TALL_TILES[op]
    if dtype == "float32":  # exact (ieee) fp32 dots: smaller tiles compile and run far better
        bm, bn, w = min(bm, 64), min(bn, 32), 4
    if head_dim > 128:
        wide = op in _WIDE_HEAD_TILES and dtype != "float32"
        bm, bn, w, st = _WIDE_HEAD_TILES[op] if wide else (min(bm, 64), min(bn, 32), 8, 1)
    return Tiles(bm, bn, w, st)


def _tuned(op: str, layout: ACSR, head_dim: int, dtype: str) -> Tiles | None:
    """Tiles from the tuning tables (``jax_bindings._tuning.lookup_tiles``), or None.

    The hook: ``lookup_tiles(op, family, q_len, head_dim, dtype)`` with ``family``
    = :func:`acsr.pattern_family` of the layout the kernel walks (for ``bwd_dkdv``
    the transposed one) and ``q_len`` its rows; it returns ``(block_m, block_n,
    num_warps, num_stages, loop)`` or None. Until the tuning module exists, None.
    """
    try:  # (``from jax_bindings import _tuning`` would turn a missing module into a plain ImportError)
        import jax_bindings._tuning as _tuning
    except ModuleNotFoundError as e:
        if e.name != "jax_bindings._tuning":  # the module exists but something it imports does not
            raise
        return None
    hit = _tuning.lookup_tiles(op, acsr.pattern_family(layout), layout.q_len, head_dim, dtype)
    return None if hit is None else Tiles.of(hit)


# Forward tiles with segment ids (packed documents): rows end at document ends, so key walks are
# short and edge tiles many; 64 x 64 beat the causal family's tuned 128 x 128 by 12% on a
# document-causal forward (H100, B=4, S=8192, documents of 256-4096 tokens).
_DOCUMENT_FWD_TILES = Tiles(64, 64, 4, 3)


def tiles_for(op: str, layout: ACSR, head_dim: int, dtype: str, runtime: str = "") -> Tiles:
    """The tiles ``op`` runs with over ``layout`` when the caller names none.

    The forward with segment ids (``runtime == "ids"``) takes :data:`_DOCUMENT_FWD_TILES`
    on a GPU-class head dim (<= 128). Otherwise tuned tiles first (:func:`_tuned`: the tuning
    tables, keyed by op, pattern family, rows, head dim and dtype); otherwise the heuristics of
    :func:`default_tiles`, fed the layout's mean keys per row and, for ops with tall tiles, how
    tightly 128-row tiles cover it relative to 64-row ones.

    Args:
      op: one of :data:`OPS`.
      layout: the layout the kernel walks (for ``"bwd_dkdv"`` the transposed one).
      head_dim: D.
      dtype: one of :data:`DTYPES`.
      runtime: the kernel's runtime mask (:data:`RUNTIME_MASKS`).
    """
    if op == "fwd" and runtime == "ids" and head_dim <= 128:
        return _DOCUMENT_FWD_TILES
    tuned = _tuned(op, layout, head_dim, dtype)
    if tuned is not None:
        return tuned
    row_keys = layout.nnz / max(layout.q_len, 1)
    tall = (
        acsr.tile_cover(layout, 128, 64) / max(acsr.tile_cover(layout, 64, 64), 1e-9)
        if op in _TALL_TILES
        else 0.0
    )
    return default_tiles(op, head_dim, dtype, row_keys, tall)


# -- planning -------------------------------------------------------------------


def _check_dtype(dtype) -> str:
    name = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
    if name not in DTYPES:
        raise TypeError(f"dtype must be one of {DTYPES}, got {name!r}")
    return name


def _check_head_dim(d) -> int:
    if isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 1:
        raise ValueError(f"head dim D must be a positive int, got {d!r}")
    if d > MAX_HEAD_DIM:
        raise NotImplementedError(
            f"head dim D={d} > {MAX_HEAD_DIM} has no Triton kernel; use backend='jax' for larger heads"
        )
    return int(d)


def _check_residual(res: acsr.BlockResidual | None, block_m: int) -> int:
    """The row-block height for a layout with residual ``res`` (a row block must sit in one residual
    block); NotImplementedError for residual blocks the kernels cannot tile."""
    if res is None:
        return block_m
    if res.block_kv < 16 or res.block_kv & (res.block_kv - 1):
        raise NotImplementedError(
            f"residual block_kv={res.block_kv} is not a power of two >= 16, which the Triton kernels "
            "need; use backend='jax' or build the layout with such blocks"
        )
    block_m = math.gcd(block_m, res.block_q)
    if block_m < 16:
        raise NotImplementedError(
            f"residual block_q={res.block_q} is not a multiple of 16, which the Triton kernels need; "
            "use backend='jax' or build the layout with such blocks"
        )
    return block_m


def plan(
    op: str,
    layout: ACSR,
    *,
    dtype,
    head_dim: int,
    num_heads: int,
    num_kv_heads: int,
    tiles: Tiles | tuple | None = None,
    runtime: str = "",
) -> Plan:
    """Builds the :class:`Plan` of ``op`` over ``layout``.

    Raises ``NotImplementedError`` (the reason, and what to use instead) for what the
    Triton kernels cannot take: head dims above :data:`MAX_HEAD_DIM`, residual blocks
    they cannot tile. Bad arguments raise ``ValueError`` / ``TypeError``: the backend
    passes both kinds on, and only the first lets ``backend="auto"`` fall back.

    Args:
      op: one of :data:`OPS`. For ``"bwd_dkdv"`` pass the transposed layout.
      layout: the ACSR layout the kernel walks.
      dtype: element dtype of q/k/v (``float16``, ``bfloat16``, ``float32``).
      head_dim: D.
      num_heads, num_kv_heads: H and H_kv (H_kv divides H).
      tiles: :class:`Tiles` (or ``(block_m, block_n, num_warps, num_stages[, loop])``);
        None: :func:`tiles_for`.
      runtime: the runtime mask of the fused ops (:data:`RUNTIME_MASKS`).
    """
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    dtype = _check_dtype(dtype)
    head_dim = _check_head_dim(head_dim)
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"key/value heads ({num_kv_heads}) must divide query heads ({num_heads})")
    tiles = None if tiles is None else Tiles.of(tiles)
    if runtime not in RUNTIME_MASKS:
        raise ValueError(f"runtime must be one of {RUNTIME_MASKS}, got {runtime!r}")
    if runtime and op not in FUSED_OPS:
        raise ValueError(f"only the fused ops {FUSED_OPS} take a runtime mask, not {op!r}")
    return _plan_cached(op, layout, dtype, head_dim, int(num_heads), int(num_kv_heads), tiles, runtime)


@functools.lru_cache(maxsize=256)
def _plan_cached(op, layout: ACSR, dtype, head_dim, num_heads, num_kv_heads, tiles, runtime="") -> Plan:
    if tiles is None:
        tiles = tiles_for(op, layout, head_dim, dtype, runtime)
    bm, bn, warps, stages, loop = tiles
    res = layout.residual
    bm = _check_residual(res, bm)
    walk = acsr.walk_plan(layout, bm, permute=op != "softmax", reorder=op != "softmax")
    offs = layout.slot_offsets
    segs, meta = [], []
    for k, (s, (mode, stride)) in enumerate(zip(layout.segments, walk.modes, strict=True)):
        cf = s.closed_form
        if cf is not None:
            source, pieces = "law", cf.pieces
        else:
            source, pieces = "arrays", ()
            meta += [s.base, s.count]
            if stride == 0:
                meta.append(s.stride)
        segs.append(SegSpec(mode, stride, source, pieces, s.width, offs[k]))
    if walk.perm is not None:
        meta.append(walk.perm)
    if walk.order is not None:
        meta.append(walk.order)
    rspec = None
    if res is not None:
        rspec = ResSpec(res.block_q, res.block_kv, res.max_blocks, offs[-1])
        meta += [res.kv_blocks, res.num_blocks, res.bits.astype(np.int8)]
    spec = KernelSpec(
        op=op,
        rows=layout.q_len,
        cols=layout.kv_len,
        segments=tuple(segs),
        residual=rspec,
        permuted=walk.perm is not None,
        dtype=dtype,
        head_dim=head_dim,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        block_m=bm,
        block_n=bn,
        nnz_max=layout.nnz_max,
        num_warps=warps,
        num_stages=stages,
        loop=loop,
        ordered=walk.order is not None,
        runtime=runtime,
    )
    meta = tuple(np.ascontiguousarray(m, dtype=np.int8 if m.dtype == np.int8 else np.int32) for m in meta)
    return Plan(spec, meta, walk.row_blocks)


@functools.lru_cache(maxsize=64)
def transposed(layout: ACSR) -> ACSR:
    """The transposed layout (cached: the backward pass asks for it every step)."""
    return layout.transpose()


@functools.lru_cache(maxsize=64)
def transpose_slots(layout: ACSR) -> np.ndarray:
    """Where each value slot of the transposed layout lives in ``layout``'s value array.

    Returns int64 ``[kv_len, nnz_max_T]``: flat index ``row * nnz_max + slot``
    into ``layout``'s ``[q_len, nnz_max]`` values, or ``q_len * nnz_max`` (one
    past the end, read as 0 after padding) for padding slots.
    """
    lt = transposed(layout)
    n = layout.nnz_max
    cols = layout.slot_columns().astype(np.int64)
    rows = np.repeat(np.arange(layout.q_len, dtype=np.int64), n)
    flat = np.arange(layout.q_len * n, dtype=np.int64)
    c = cols.reshape(-1)
    ok = c >= 0
    key = rows[ok] * layout.kv_len + c[ok]
    order = np.argsort(key)
    key_sorted, flat_sorted = key[order], flat[ok][order]
    tcols = lt.slot_columns().astype(np.int64)  # [kv_len, nT]: query row per slot
    trow = np.arange(layout.kv_len, dtype=np.int64)[:, None]
    tkey = tcols * layout.kv_len + trow
    idx = np.searchsorted(key_sorted, np.where(tcols >= 0, tkey, 0))
    idx = np.minimum(idx, max(key_sorted.size - 1, 0))
    out = np.where(tcols >= 0, flat_sorted[idx] if key_sorted.size else 0, layout.q_len * n)
    return out


__all__ = [
    "DTYPES",
    "FUSED_OPS",
    "LOOPS",
    "RUNTIME_MASKS",
    "MAX_HEAD_DIM",
    "OPS",
    "WARPS",
    "KernelSpec",
    "Plan",
    "ResSpec",
    "SegSpec",
    "Tiles",
    "default_tiles",
    "plan",
    "tiles_for",
    "transpose_slots",
    "transposed",
]
