"""Decode and chunked prefill on Triton: query tokens at run-time positions against a KV cache.

The decode route wherever it takes the call (any layout of up to four segments, runs of
consecutive keys or progressions: causal, windows, sinks + window, dilated and strided masks,
with or without segment ids): on H200 this loop measured 1.11-1.52x the CUDA decode kernel
(:mod:`jax_bindings._cuda.decode`), which keeps head dims that are no power of two. A longer
chunk at an offset (chunked prefill) runs the same loop on blocks of rows, for the masks the
CUDA band kernel does not take (sinks + window, chunked causal, prefix-LM ...).

Glossary (the kernel's symbols):

* ``B`` batch rows, ``SQ`` query tokens a row (a few in decode, a chunk in prefill), ``H`` query
  heads, ``HK`` KV heads, ``G = H // HK``, ``D`` head dim (a power of two, 16..256).
* The cache: contiguous ``[B, L, HK, D]`` (``PAGE = 0``), or a page pool ``[N_PAGES, PAGE, HK, D]``
  with ``TABLE [B, MAX_PAGES]`` (logical key ``j`` of row ``b`` at page ``TABLE[b, j // PAGE]``,
  slot ``j % PAGE``; a page id outside ``[0, N_PAGES)`` hides its keys).
* ``QPOS [B, SQ]``: each token's row of the layout (-1: it sees nothing); ``QLEN``, ``KVLEN``
  ``[B]``: tokens at or past ``QLEN`` are padding, keys at or past ``KVLEN`` are never seen.
* ``SEG [L, NSEG, 3]``: per layout row, each segment's first key, count and stride
  (:func:`segment_table`). Token ``t`` sees key ``base + u * stride``, ``0 <= u < count``, of
  each segment of row ``pos_t``, where it is below ``KVLEN``.
* ``IDS``: segment ids ``QIDS [B, SQ]``, ``KVIDS [B, L]`` (over logical key positions): a token
  sees only keys of its id, and walks only ``DOC [B, SQ, 2]``, the keys its document may hold
  (:func:`jax_bindings._id_runs.document_keys`: the document's run where a row's ids are sorted,
  else every key). Without ids the three are one-element placeholders.
* A program owns (split, batch row, KV head, block of rows). Its tile rows are ``r = t * G + g``
  (token, head of the group), ``BLOCK_M`` of them (at least 16, for ``tl.dot``): in decode one
  block holds every token's rows, so a K/V tile is read once for all ``G`` heads and ``SQ``
  tokens; a longer chunk (chunked prefill) takes blocks of 128 rows, one program each. Per
  segment it walks the tiles of ``BLOCK_N`` keys over the union of its rows' keys: with the
  segment's stride where every row steps alike from one residue (one decode token of a dilated
  mask), else key by key; each row's own keys mask its scores.
* Splits (flash-decoding): the tiles of all segments, in order, are cut into ``NUM_SPLITS``
  equal shares, one a program (fewer where the row's walk holds fewer tiles).
* Online softmax in base 2 (``SCALE_LOG2 = scale * log2(e)`` folded into the scores; with a soft
  cap ``CAP``, ``z = scale * q.k`` becomes ``CAP * tanh(z / CAP)`` first). A row block walked by
  one program writes ``out`` and ``lse [B, H, SQ]`` (natural log) at once. Otherwise each split
  writes its rows normalised by its own sum to float32 ``PART_O [B * SQ * H, NUM_SPLITS, D]``
  and their lse to ``PART_L``, and takes a ticket (``TICKETS``, zeroed by the launch); the last
  to arrive merges the splits in split order (the sums of
  :func:`jax_bindings._split_merge.merge_splits`, in the kernel). The sums do not depend on
  which split arrives last: reruns are bit-identical.
* A row that sees no key outputs 0 and lse ``-inf``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import types

import numpy as np
import triton
import triton.language as tl

from acsr import ACSR
from jax_bindings._triton.ops import Call

MAX_SEGMENTS = 4
DECODE_ROWS = 128  # SQ * G rows up to which one program holds them all (decode), else blocks of them
LOG2E = 1.4426950408889634
# the kernel reads module globals only as constexprs
_LOG2E = tl.constexpr(LOG2E)
_LN2 = tl.constexpr(0.6931471805599453)


def _run(SEG, seg_row, s, live, doc_lo, doc_hi, IDS: tl.constexpr, STRIDED: tl.constexpr):
    """Segment ``s`` of the rows at ``seg_row``: its first key, the end of its keys (exclusive), its
    stride, and whether it holds a key; cut to the row's document."""
    base = tl.load(SEG + seg_row + 3 * s, mask=live, other=0)
    count = tl.load(SEG + seg_row + 3 * s + 1, mask=live, other=0)
    if STRIDED:
        step = tl.maximum(tl.load(SEG + seg_row + 3 * s + 2, mask=live, other=1), 1)
    else:
        step = count * 0 + 1
    first = base
    end = base + tl.maximum(count - 1, 0) * step + 1
    if IDS:
        first = base + tl.cdiv(tl.maximum(doc_lo - base, 0), step) * step
        end = tl.minimum(end, doc_hi)
    has = live & (count > 0) & (end > first)
    return first, end, step, has


def _union(first, end, step, has, kv_len, STRIDED: tl.constexpr, BLOCK_N: tl.constexpr):
    """The walk over the union of the tile rows' runs: its first key, its end (clipped to
    ``kv_len``), its stride (the runs' common one where they all step alike from one residue,
    else 1: every key, each run masking its own) and its tiles of ``BLOCK_N`` keys."""
    lo = tl.min(tl.where(has, first, 2147483647), 0)
    hi = tl.minimum(tl.max(tl.where(has, end, 0), 0), kv_len)
    keys = tl.maximum(hi - lo, 0)
    if STRIDED:
        w_lo = tl.min(tl.where(has, step, 2147483647), 0)
        w_hi = tl.max(tl.where(has, step, 0), 0)
        r_lo = tl.min(tl.where(has, first % step, 2147483647), 0)
        r_hi = tl.max(tl.where(has, first % step, -1), 0)
        walk = tl.where((w_lo == w_hi) & (r_lo == r_hi), w_hi, 1)
        keys = tl.cdiv(keys, walk)
    else:
        walk = lo * 0 + 1
    return lo, hi, walk, tl.cdiv(keys, BLOCK_N)


def _kernel(
    Q, K, V, QPOS, QLEN, KVLEN, SEG, TABLE, QIDS, KVIDS, DOC, OUT, LSE, PART_O, PART_L, TICKETS,
    IDS: tl.constexpr, SCALE_LOG2: tl.constexpr, CAP: tl.constexpr, SQ: tl.constexpr, H: tl.constexpr,
    HK: tl.constexpr, D: tl.constexpr, NSEG: tl.constexpr, STRIDED: tl.constexpr, L: tl.constexpr,
    PAGE: tl.constexpr, MAX_PAGES: tl.constexpr, N_PAGES: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    G: tl.constexpr = H // HK
    tl.static_assert(BLOCK_M >= 16, "tl.dot takes 16 rows or more")
    pid_s = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_r = tl.program_id(2)
    b = pid_bh // HK
    hk = pid_bh % HK
    b64 = b.to(tl.int64)

    # -- the tile's rows: (token, head of the group), the pid_r-th BLOCK_M of them; which see keys
    offs_m = pid_r * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    tok = offs_m // G
    head = hk * G + offs_m % G
    row_ok = offs_m < SQ * G
    q_len = tl.load(QLEN + b)
    kv_len = tl.load(KVLEN + b)
    pos = tl.load(QPOS + b * SQ + tok, mask=row_ok, other=-1)
    live = row_ok & (tok < q_len) & (pos >= 0) & (pos < L)
    seg_row = tl.where(live, pos, 0).to(tl.int64) * (NSEG * 3)
    q_rows = (b64 * SQ + tok) * H + head
    doc_lo = 0
    doc_hi = 0
    if IDS:  # a token's segment id and the keys its document may hold
        qid = tl.load(QIDS + b64 * SQ + tok, mask=row_ok, other=0)
        doc_lo = tl.load(DOC + (b64 * SQ + tok) * 2, mask=row_ok, other=0)
        doc_hi = tl.load(DOC + (b64 * SQ + tok) * 2 + 1, mask=row_ok, other=0)

    # -- the walk: per segment, the union of the rows' runs (clipped to kv_len) in whole tiles
    total = 0
    for s in tl.static_range(NSEG):
        first, end, step, has = _run(SEG, seg_row, s, live, doc_lo, doc_hi, IDS, STRIDED)
        total += _union(first, end, step, has, kv_len, STRIDED, BLOCK_N)[3]

    # -- this program's share: the row's walk in NUM_SPLITS equal shares (fewer where it is short)
    used = tl.maximum(tl.cdiv(total, tl.cdiv(tl.maximum(total, 1), NUM_SPLITS)), 1)
    per_split = tl.cdiv(total, used)
    t0 = pid_s * per_split
    t1 = tl.minimum(t0 + per_split, total)

    q = tl.load(Q + q_rows[:, None] * D + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    done = 0  # tiles of the segments before this one
    for s in tl.static_range(NSEG):
        first, end, step, has = _run(SEG, seg_row, s, live, doc_lo, doc_hi, IDS, STRIDED)
        lo, hi, walk, n = _union(first, end, step, has, kv_len, STRIDED, BLOCK_N)
        t_first = tl.minimum(tl.maximum(t0 - done, 0), n)
        t_last = tl.minimum(tl.maximum(t1 - done, 0), n)
        for t in tl.range(t_first, t_last):
            offs_n = lo + (t * BLOCK_N + tl.arange(0, BLOCK_N)) * walk
            kv_ok = offs_n < hi
            if PAGE == 0:
                rows = (b64 * L + offs_n) * HK + hk
            else:
                page = tl.load(TABLE + b64 * MAX_PAGES + offs_n // PAGE, mask=kv_ok, other=-1)
                kv_ok = kv_ok & (page >= 0) & (page < N_PAGES)
                page = tl.minimum(tl.maximum(page, 0), N_PAGES - 1).to(tl.int64)
                rows = (page * PAGE + offs_n % PAGE) * HK + hk
            k = tl.load(K + rows[:, None] * D + offs_d[None, :], mask=kv_ok[:, None], other=0.0)
            sc = tl.dot(q, tl.trans(k), input_precision=PRECISION)
            if CAP > 0:
                z = sc * (SCALE_LOG2 / _LOG2E / CAP)  # soft cap: CAP * tanh(scale * q.k / CAP)
                sc = CAP * _LOG2E * (1.0 - 2.0 / (tl.math.exp2(z * (2.0 * _LOG2E)) + 1.0))
            else:
                sc = sc * SCALE_LOG2
            seen = kv_ok[None, :] & (offs_n[None, :] >= first[:, None]) & (offs_n[None, :] < end[:, None])
            seen = seen & has[:, None]
            if STRIDED:
                seen = seen & ((offs_n[None, :] - first[:, None]) % step[:, None] == 0)
            if IDS:
                kid = tl.load(KVIDS + b64 * L + offs_n, mask=kv_ok, other=0)
                seen = seen & (qid[:, None] == kid[None, :])
            sc = tl.where(seen, sc, float("-inf"))
            # softmax with its rescale; a row with no key yet keeps m = -inf and p = 0
            m_new = tl.maximum(m_i, tl.max(sc, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(sc - m_use[:, None])
            alpha = tl.math.exp2(m_i - m_use)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(V + rows[:, None] * D + offs_d[None, :], mask=kv_ok[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        done += n

    # -- epilogue: normalised by this program's own sum; no key -> 0 and lse -inf
    seen_any = l_i > 0.0
    o = acc / tl.where(seen_any, l_i, 1.0)[:, None]
    lse = tl.where(seen_any, (m_i + tl.math.log2(tl.where(seen_any, l_i, 1.0))) * _LN2, float("-inf"))
    o_ptrs = OUT + q_rows[:, None] * D + offs_d[None, :]
    lse_ptrs = LSE + (b64 * H + head) * SQ + tok
    if NUM_SPLITS == 1:
        tl.store(o_ptrs, o.to(OUT.dtype.element_ty), mask=row_ok[:, None])
        tl.store(lse_ptrs, lse, mask=row_ok)
    elif used == 1:
        if pid_s == 0:
            tl.store(o_ptrs, o.to(OUT.dtype.element_ty), mask=row_ok[:, None])
            tl.store(lse_ptrs, lse, mask=row_ok)
    elif pid_s < used:
        # each split leaves its rows and takes a ticket; the last to arrive merges them all in split
        # order, so the sums, and the output, do not depend on which split finishes last
        part = q_rows * NUM_SPLITS + pid_s
        tl.store(PART_O + part[:, None] * D + offs_d[None, :], o, mask=row_ok[:, None])
        tl.store(PART_L + part, lse, mask=row_ok)
        tl.debug_barrier()
        ticket = tl.atomic_add(TICKETS + pid_bh * tl.num_programs(2) + pid_r, 1, sem="acq_rel")
        if ticket == used - 1:
            top = tl.full([BLOCK_M], float("-inf"), tl.float32)
            for split in range(0, used):
                top = tl.maximum(top, tl.load(PART_L + q_rows * NUM_SPLITS + split, mask=row_ok,
                                              other=float("-inf"), cache_modifier=".cg"))
            top = tl.where(top == float("-inf"), 0.0, top)
            den = tl.zeros([BLOCK_M], tl.float32)
            acc = tl.zeros([BLOCK_M, D], tl.float32)
            for split in range(0, used):
                part = q_rows * NUM_SPLITS + split
                lse_s = tl.load(PART_L + part, mask=row_ok, other=float("-inf"), cache_modifier=".cg")
                w = tl.exp(lse_s - top)
                o_s = tl.load(PART_O + part[:, None] * D + offs_d[None, :], mask=row_ok[:, None], other=0.0,
                              cache_modifier=".cg")
                den = den + w
                acc = acc + o_s * w[:, None]
            has_any = den > 0.0
            o = tl.where(has_any[:, None], acc / tl.where(has_any, den, 1.0)[:, None], 0.0)
            lse = tl.where(has_any, top + tl.log(tl.where(has_any, den, 1.0)), float("-inf"))
            tl.store(o_ptrs, o.to(OUT.dtype.element_ty), mask=row_ok[:, None])
            tl.store(lse_ptrs, lse, mask=row_ok)


def _in_mode(fn, namespace: dict):
    """``fn`` as a new function whose globals are ``namespace`` (so it calls the helpers jitted in
    the same mode), with its annotations, which mark its constexprs for Triton's launcher."""
    copy = types.FunctionType(fn.__code__, namespace, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__annotations__ = dict(fn.__annotations__)
    copy.__doc__ = fn.__doc__
    return copy


@functools.cache
def kernel(interpret: bool):
    """The kernel as ``triton.jit`` makes it with ``TRITON_INTERPRET`` set to ``interpret``
    (Triton picks compiled or interpreted when it decorates, and a kernel calls only helpers
    jitted in its own mode)."""
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
    try:
        namespace = dict(globals())
        for helper in (_run, _union):
            namespace[helper.__name__] = triton.jit(_in_mode(helper, namespace))
        return triton.jit(_in_mode(_kernel, namespace))
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old


def refusal(layout: ACSR, q_shape, kv_heads: int, dtype: str) -> str | None:
    """Why this kernel does not take a call (None: it does): layouts of at most
    :data:`MAX_SEGMENTS` segments, square (a cache's), no residual or grid; head dims that are
    powers of two from 16 to 256."""
    b, sq, h, d = q_shape
    if layout.grid is not None or layout.residual is not None:
        return "the triton decode kernel walks segments only (no grid layout, no block residual)"
    if not 1 <= len(layout.segments) <= MAX_SEGMENTS:
        return f"the triton decode kernel walks 1-{MAX_SEGMENTS} segments, not {len(layout.segments)}"
    if layout.q_len != layout.kv_len:
        return f"the triton decode kernel takes a cache's square layout, not {layout.q_len} x {layout.kv_len}"
    if d < 16 or d > 256 or d & (d - 1):
        return f"the triton decode kernel takes head dims that are powers of two in [16, 256], not {d}"
    if dtype not in ("bfloat16", "float16", "float32"):
        return f"the triton decode kernel takes bfloat16, float16 or float32, not {dtype}"
    return None


def preferred(layout: ACSR, q_shape, kv_heads: int, dtype: str) -> bool:
    """Whether decode should run here rather than on the CUDA decode kernel: wherever this kernel
    takes the call (:func:`refusal`). Measured (bf16, Hq=32, Hk=8, D=128) at 1.11-1.32x the CUDA
    decode kernel on H200 on causal at three sizes, a window, sinks + window, pages of 16, 4 and
    16 query tokens, and on H100 at 1.03-1.09x on causal at two sizes, the window, sinks +
    window, a dilated window, documents and pages of 16 (``benchmarks/NOTES.md``, sessions 28 and
    32)."""
    return refusal(layout, q_shape, kv_heads, dtype) is None


@functools.lru_cache(maxsize=32)
def strided(layout: ACSR) -> bool:
    """Whether some segment of some row steps by more than one key (dilated, strided masks)."""
    return any(bool(np.any((s.stride > 1) & (s.count > 1))) for s in layout.segments)


@functools.lru_cache(maxsize=32)
def segment_table(layout: ACSR) -> np.ndarray:
    """int32 ``[L, NSEG, 3]``: each row's segments as (first key, count, stride) (the kernel's
    ``SEG``; the stride of a segment of one key or none is 1)."""
    cols = [np.stack([s.base, s.count, np.where(s.count > 1, s.stride, 1)], axis=-1) for s in layout.segments]
    return np.stack(cols, axis=1).astype(np.int32)


def block_n_for(d: int, itemsize: int, stages: int) -> int:
    """Keys a tile: the most of 128, 64, 32 whose pipelined K and V tiles (``stages - 1`` of each)
    fit in 160 KB of shared memory. On an H200 (bf16, D=128, 4 warps, 3 stages) 128 read 3-5% more
    of HBM than 64, and 256 5-18% less."""
    for bn in (128, 64, 32):
        if max(1, stages - 1) * 2 * bn * d * itemsize <= 160 * 1024:
            return bn
    return 16


def programs_per_sm(block_n: int, d: int, itemsize: int, stages: int, warps: int) -> int:
    """Programs an SM holds: the pipelined tiles (``stages - 1`` of K and V) plus a few KB of
    scratch in 227 KB of shared memory, and at most ``16 // warps`` by registers."""
    smem = max(1, stages - 1) * 2 * block_n * d * itemsize + 8 * 1024
    return max(1, min(227 * 1024 // smem, 16 // warps))


def splits_for(programs: int, tiles: int, sm_count: int, occupancy: int, max_splits: int = 128,
               min_tiles: int = 4) -> int:
    """Splits of each walk so that ``programs * splits`` fill ``sm_count * occupancy`` slots with
    little wave quantization: of the counts that keep ``min_tiles`` tiles a split, the smallest
    within 5% of the best wave efficiency (``waves / ceil(waves)``); fewer, longer programs pay the
    pipeline's fill less often."""
    cap = max(1, min(max_splits, tiles // min_tiles))
    slots = max(1, sm_count * occupancy)
    effs = [(programs * s / slots) / math.ceil(programs * s / slots) for s in range(1, cap + 1)]
    best = max(effs)
    return next(s for s, e in enumerate(effs, 1) if e >= 0.95 * best)


# splits with segment ids, times those planned for the layout's longest row: on H100 (packed
# documents of 4K-32K keys in a 32K cache, B=8) 4x read 1.20x faster than 1x, 1.08x faster than 2x
IDS_SPLITS = 4


@dataclasses.dataclass(frozen=True)
class Plan:
    """One call's launch: grid ``(splits, B * HK, row blocks)``, the constexprs and the outputs
    (``out, lse``, the splits' rows and log-sum-exps, the tickets)."""

    grid: tuple[int, int, int]
    splits: int
    constexprs: tuple[tuple[str, object], ...]
    out: tuple[tuple[tuple[int, ...], str], ...]
    num_warps: int = 4
    num_stages: int = 3

    @property
    def zeroed(self) -> tuple[int, ...]:
        """The outputs that start at zero: the tickets, where a row block has several splits."""
        return (4,) if self.splits > 1 else ()


def plan(q_shape, kv_heads: int, dtype: str, layout: ACSR, scale: float, soft_cap, sm_count: int, *,
         page_size: int = 0, max_pages: int = 0, n_pages: int = 0, ids: bool = False,
         splits: int | None = None) -> Plan:
    """The launch of a call :func:`refusal` takes (``page_size`` 0: a contiguous cache): decode's
    one block of every (token, head) row, up to :data:`DECODE_ROWS` rows (4 warps, keys in tiles of
    :func:`block_n_for`); a longer chunk's blocks of 128 rows, 8 warps (two warpgroups' products)
    and tiles of 64 keys, as a prefill kernel's. ``splits``: of each row's walk (None:
    :func:`splits_for` the layout's longest row)."""
    b, sq, h, d = q_shape
    itemsize = 4 if dtype == "float32" else 2
    rows = sq * (h // kv_heads)
    stages = 3
    if rows <= DECODE_ROWS:
        warps, block_m = 4, max(16, 1 << max(0, rows - 1).bit_length())
        block_n = block_n_for(d, itemsize, stages)
    else:
        warps, block_m, block_n = 8, 128, min(64, block_n_for(d, itemsize, stages))
    row_blocks = -(-rows // block_m)
    nseg = len(layout.segments)
    programs = b * kv_heads * row_blocks
    if splits is None:
        tiles = -(-int(layout.row_counts().max(initial=0)) // block_n) + nseg
        occupancy = programs_per_sm(block_n, d, itemsize, stages, warps)
        splits = splits_for(programs, tiles, sm_count, occupancy)
        if ids:  # walks cut to documents are shorter than the row: the long ones take more programs
            splits = min(IDS_SPLITS * splits, max(1, tiles // 4), 128)
    cx = (("IDS", bool(ids)), ("SCALE_LOG2", float(scale) * LOG2E), ("CAP", float(soft_cap or 0.0)),
          ("SQ", sq), ("H", h), ("HK", kv_heads), ("D", d), ("NSEG", nseg), ("STRIDED", strided(layout)),
          ("L", layout.kv_len), ("PAGE", page_size), ("MAX_PAGES", max_pages), ("N_PAGES", n_pages),
          ("NUM_SPLITS", splits), ("BLOCK_M", block_m), ("BLOCK_N", block_n),
          ("PRECISION", "ieee" if dtype == "float32" else "tf32"))
    final = (((b, sq, h, d), dtype), ((b, h, sq), "float32"))
    if splits == 1:
        out = (*final, ((1,), "float32"), ((1,), "float32"), ((1,), "int32"))
    else:
        out = (*final, ((b * sq * h, splits, d), "float32"), ((b * sq * h, splits), "float32"),
               ((programs,), "int32"))
    return Plan((splits, b * kv_heads, row_blocks), splits, cx, out, warps, stages)


def call(p: Plan, interpret: bool = False) -> Call:
    """The launch of ``p`` for :func:`jax_bindings._triton.backend.run_call` (JAX) or
    :func:`jax_bindings._triton.launch.run_numpy` (the interpreter). Operands, in order: ``q, k,
    v, q_pos, q_len, kv_len, seg`` (:func:`segment_table`) ``, table, q_ids, kv_ids, doc`` (each
    ``[1]`` where absent). Outputs: ``out, lse`` and the kernel's scratch ``part_o, part_l,
    tickets``."""
    return Call(kernel(interpret), p.grid, (), p.out, dict(p.constexprs), p.num_warps, p.num_stages, p,
                zeroed=p.zeroed)
