#!/usr/bin/env python3
"""Spike: a Triton split-KV (flash-decoding) kernel for decode, the Triton route beside the CUDA one.

Decode is memory-bound: a few new query tokens per batch row read the whole (or a window of the)
KV cache once. The figure of merit is HBM bandwidth: bytes of K and V the mask needs / time.

Glossary (the kernels' symbols):

* ``B`` batch rows, ``SQ`` new query tokens a row (1..16), ``H`` query heads, ``HK`` KV heads,
  ``G = H // HK`` query heads sharing one KV head, ``D`` head dim, ``L`` cache length (static).
* ``seqlen = cache_seqlens[b]``: keys ``[0, seqlen)`` of row ``b`` are valid. Query ``i`` of row
  ``b`` sits at ``pos = seqlen - SQ + i`` and sees keys ``j <= pos`` and, with ``WINDOW = w``,
  ``j >= pos - w`` (a causal window of ``w + 1`` keys). ``WINDOW = -1``: no window.
* ``[lo, hi)``: the keys any query of the row sees: ``hi = seqlen``, ``lo = max(0, seqlen - SQ - w)``.
* A program of :func:`_split_kernel` (grid ``(S, B * HK)``) owns one KV head of one row and split
  ``pid_s`` of the row's tiles of ``BLOCK_N`` keys from ``lo``. Its tile rows are the ``M = SQ * G``
  (query token, head of the group) pairs, ``r = i * G + g``, padded to ``BLOCK_M >= 16`` for
  ``tl.dot``; so each K/V tile is read once for all ``G`` heads and ``SQ`` tokens.
* Online softmax in base 2: ``SCALE_LOG2 = scale * log2(e)`` is folded into the scores, ``m`` is
  the running max, ``l`` the running sum; a split's ``lse = m + log2(l)`` (base 2, -inf when the
  split saw no key of that row).
* ``S = NUM_SPLITS``. With ``S == 1`` the kernel writes ``out`` (q's dtype) directly. Otherwise it
  writes float32 partials normalised by their own sum, ``part [B, SQ, H, S, D]`` and
  ``lse [B, SQ, H, S]``, and :func:`_combine_kernel` (or :func:`combine_partials` in plain
  ``jnp``) weighs them by ``exp2(lse - max lse)`` in a fixed order: reruns are bit-identical.
* A row that sees no key outputs 0 (and lse -inf).

Measured (H200, jax 0.11.2, triton 3.6.0, jax-triton 0.3.1; bf16, Sq=1, H=32, Hk=8, D=128,
caches full; 10 calls chained in one jitted program): block_n 128, 4 warps, 3 stages, heuristic
splits read 4270 GB/s (89%) at B=8/32K, 4088 (85%) at B=1/128K, 4348 (91%) at B=64/8K and 3278
(68%) with window 4096 at B=8/32K (0.13 GB a call, 41 us: fixed costs dominate; XLA reading the
same bytes gets 3106). 64/4/3 reads 3-5% less; 256-key tiles 5-18% less; twice the heuristic's
splits 2-8% less, half of them 23-33% less. The jnp combine times like the combine kernel.
Tensor descriptors (launched from torch, Triton allocating their scratch) gained nothing
consistent: within 1% at B=8/32K and B=64/8K, mixed at B=1/128K.

Public surface: :func:`decode` (JAX arrays on a GPU, through ``jax_triton.triton_call``),
:func:`decode_numpy` (numpy arrays, the same kernels under Triton's interpreter, for CPU tests),
:func:`decode_torch` (torch tensors, Triton's own launcher: the only way to run ``tma=True``),
:func:`plan` (grid, splits and constexprs; shared by all three), :func:`default_block_n` and
:func:`num_splits_for` (the heuristics) and :func:`main` (the GPU sweep; needs jax-triton)::

    python -m benchmarks.spikes.spike_decode_triton [--quick] [--configs 128/4/3 64/4/3/x2 ...] [--out PATH]
    python -m benchmarks.spikes.spike_decode_triton --torch   # pointer loads vs tensor descriptors

Example (CPU, interpreter)::

    import numpy as np
    q = np.random.randn(1, 1, 4, 32).astype(np.float16)
    k = np.random.randn(1, 100, 2, 32).astype(np.float16)
    out = decode_numpy(q, k, k, np.array([70], np.int32), window=31, num_splits=2)
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import math
import os
import sys
import time

import numpy as np
import triton
import triton.language as tl

LOG2E = 1.4426950408889634

# -- kernels (plain functions; :func:`_kernels` wraps them for the GPU or the interpreter) ---------


def _split_kernel(
    Q, K, V, LENS, OUT, LSE,
    SCALE_LOG2: tl.constexpr, L: tl.constexpr, SQ: tl.constexpr, H: tl.constexpr, HK: tl.constexpr,
    D: tl.constexpr, WINDOW: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, USE_TMA: tl.constexpr, PRECISION: tl.constexpr,
):
    """One (split, row, KV head): online softmax over its share of ``[lo, hi)``.

    Q ``[B, SQ, H, D]``; K, V ``[B, L, HK, D]``; LENS int32 ``[B]``. ``NUM_SPLITS == 1``: O
    ``[B, SQ, H, D]`` (q's dtype), LSE ``[B, SQ, H]``; else O ``[B, SQ, H, S, D]`` float32, LSE
    ``[B, SQ, H, S]`` float32 (base-2 log-sum-exp; -inf: no key). O is ``OUT`` below.
    """
    G: tl.constexpr = H // HK
    M: tl.constexpr = SQ * G
    tl.static_assert(M <= BLOCK_M, "BLOCK_M must cover SQ * G rows")
    tl.static_assert(BLOCK_M >= 16, "tl.dot needs at least 16 rows")
    pid_s = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // HK
    hk = pid_bh % HK
    b64 = b.to(tl.int64)

    # -- block bounds: the row's key range, then this split's whole tiles of it
    seqlen = tl.load(LENS + b)
    hi = seqlen
    if WINDOW >= 0:
        lo = tl.maximum(seqlen - SQ - WINDOW, 0)
    else:
        lo = seqlen * 0
    n_tiles = tl.cdiv(tl.maximum(hi - lo, 0), BLOCK_N)
    per_split = tl.cdiv(n_tiles, NUM_SPLITS)
    t0 = tl.minimum(pid_s * per_split, n_tiles)
    t1 = tl.minimum(t0 + per_split, n_tiles)
    start = lo + t0 * BLOCK_N
    stop = lo + t1 * BLOCK_N

    # -- rows: (query token i, head g of the group), padded to BLOCK_M
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    tok = offs_m // G
    head = hk * G + offs_m % G
    row_ok = offs_m < M
    pos = seqlen - SQ + tok  # a padded row's pos is past every key: harmless, never stored
    q_rows = (b64 * SQ + tok) * H + head
    q = tl.load(Q + q_rows[:, None] * D + offs_d[None, :], mask=row_ok[:, None], other=0.0)

    kv_base = b64 * (L * HK * D) + hk * D
    if USE_TMA:
        # rows >= hi read as zeros (the descriptor's bounds), so no load mask
        k_desc = tl.make_tensor_descriptor(K + kv_base, shape=[hi, D], strides=[HK * D, 1],
                                           block_shape=[BLOCK_N, D])
        v_desc = tl.make_tensor_descriptor(V + kv_base, shape=[hi, D], strides=[HK * D, 1],
                                           block_shape=[BLOCK_N, D])

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)

    # -- mainloop: one tile of keys per step, loads pipelined over num_stages
    for n0 in tl.range(start, stop, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        if USE_TMA:
            k = k_desc.load([n0, 0])
        else:
            kv_off = kv_base + offs_n[:, None] * (HK * D) + offs_d[None, :]
            k = tl.load(K + kv_off, mask=(offs_n < hi)[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * SCALE_LOG2
        # -- mask: causal (j <= pos, which implies j < seqlen) and the window
        ok = offs_n[None, :] <= pos[:, None]
        if WINDOW >= 0:
            ok = ok & (offs_n[None, :] >= pos[:, None] - WINDOW)
        s = tl.where(ok, s, float("-inf"))
        # -- softmax with its rescale; a row with no key so far keeps m = -inf and p = 0
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        if USE_TMA:
            v = v_desc.load([n0, 0])
        else:
            v = tl.load(V + kv_off, mask=(offs_n < hi)[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    # -- epilogue: normalise by this split's own sum; no key -> 0 and lse -inf
    seen = l_i > 0.0
    o = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, m_i + tl.math.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
    if NUM_SPLITS == 1:
        o_ptrs = OUT + q_rows[:, None] * D + offs_d[None, :]
        tl.store(o_ptrs, o.to(OUT.dtype.element_ty), mask=row_ok[:, None])
        tl.store(LSE + q_rows, lse, mask=row_ok)
    else:
        part_rows = q_rows * NUM_SPLITS + pid_s
        tl.store(OUT + part_rows[:, None] * D + offs_d[None, :], o, mask=row_ok[:, None])
        tl.store(LSE + part_rows, lse, mask=row_ok)


def _combine_kernel(
    PART, LSE, OUT,
    D: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One (b, i, h) row, ``BLOCK_D`` of its features: ``sum_s w_s part_s / sum_s w_s`` with
    ``w_s = exp2(lse_s - max lse)``; every split in one tile, reduced in a fixed order."""
    tl.static_assert(NUM_SPLITS <= BLOCK_S, "BLOCK_S must cover the splits")
    row = tl.program_id(0).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    s_ok = offs_s < NUM_SPLITS
    lse = tl.load(LSE + row * NUM_SPLITS + offs_s, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.math.exp2(lse - tl.where(m == float("-inf"), 0.0, m))  # 0 for empty splits
    den = tl.sum(w, 0)
    part = tl.load(PART + (row * NUM_SPLITS + offs_s[:, None]) * D + offs_d[None, :], mask=s_ok[:, None],
                   other=0.0)
    num = tl.sum(w[:, None] * part, 0)
    out = num / tl.where(den > 0.0, den, 1.0)
    tl.store(OUT + row * D + offs_d, out.to(OUT.dtype.element_ty))


@functools.cache
def _kernels(interpret: bool):
    """``(split_kernel, combine_kernel)`` as ``triton.jit`` makes them with ``TRITON_INTERPRET``
    set to ``interpret`` (Triton picks compiled vs interpreted at decoration time)."""
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
    try:
        return triton.jit(_split_kernel), triton.jit(_combine_kernel)
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old


# -- plan: shapes -> grids, splits, constexprs ---------------------------------------------------


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def programs_per_sm(block_n: int, d: int, itemsize: int, num_stages: int, num_warps: int) -> int:
    """Estimated resident programs of the split kernel per SM (Hopper: 227 KB of shared memory,
    64K registers). Triton's pipeliner keeps ``num_stages - 1`` K and V tiles in shared memory
    (sm_90 compile of 64/4/3 at D=128: 70 KB, 78 registers), plus a few KB of scratch; registers
    are taken as 128 a thread, so at most ``16 // num_warps`` programs."""
    smem = max(1, num_stages - 1) * 2 * block_n * d * itemsize + 8 * 1024
    return max(1, min(227 * 1024 // smem, 16 // num_warps))


def default_block_n(d: int, itemsize: int, num_stages: int) -> int:
    """The largest of 128, 64, 32 keys a tile whose pipelined K and V tiles (``num_stages - 1`` of
    each) fit in 160 KB of shared memory, else 16. On an H200 (bf16, D=128, 4 warps, 3 stages,
    the four sweep cases) 128 read 3-5% more of HBM than 64, and 256 5-18% less than 128."""
    for bn in (128, 64, 32):
        if max(1, num_stages - 1) * 2 * bn * d * itemsize <= 160 * 1024:
            return bn
    return 16


def num_splits_for(bh: int, n_keys: int, block_n: int, sm_count: int, occupancy: int,
                   max_splits: int = 128, min_tiles: int = 4) -> int:
    """Splits of the key range so that ``bh * splits`` programs fill ``sm_count * occupancy`` slots
    with little wave quantization (flash-decoding's heuristic, on slots instead of SMs).

    Candidates keep at least ``min_tiles`` tiles of ``block_n`` keys a split; the wave efficiency of
    ``s`` splits is ``waves / ceil(waves)`` with ``waves = bh * s / slots``; the smallest ``s``
    within 5% of the best wins (fewer, longer programs pay the pipeline fill less often).
    """
    tiles = max(1, math.ceil(n_keys / block_n))
    cap = max(1, min(max_splits, tiles // min_tiles))
    slots = max(1, sm_count * occupancy)
    effs = []
    for s in range(1, cap + 1):
        waves = bh * s / slots
        effs.append(waves / math.ceil(waves))
    best = max(effs)
    return next(s for s, e in enumerate(effs, 1) if e >= 0.95 * best)


@dataclasses.dataclass(frozen=True)
class Plan:
    """One decode call's launches: the split kernel's grid and constexprs, and the combine's."""

    B: int
    Sq: int
    H: int
    D: int
    num_splits: int
    block_n: int
    grid: tuple[int, int]
    constexprs: tuple[tuple[str, object], ...]
    combine_grid: tuple[int, int]
    combine_constexprs: tuple[tuple[str, object], ...]
    num_warps: int
    num_stages: int

    @property
    def part_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Shapes of the split kernel's two outputs (out/partials, lse)."""
        B, Sq, H, D, S = self.B, self.Sq, self.H, self.D, self.num_splits
        if S == 1:
            return (B, Sq, H, D), (B, Sq, H)
        return (B, Sq, H, S, D), (B, Sq, H, S)


def plan(q_shape, k_shape, dtype: str, *, window: int | None = None, num_splits: int | None = None,
         block_n: int | None = None, num_warps: int = 4, num_stages: int = 3, scale: float | None = None,
         tma: bool = False, sm_count: int = 132) -> Plan:
    """The launches of one decode call (see the module docstring for the symbols)."""
    B, Sq, H, D = map(int, q_shape)
    Bk, L, Hk, Dk = map(int, k_shape)
    if (Bk, Dk) != (B, D):
        raise ValueError(f"q {tuple(q_shape)} and the cache {tuple(k_shape)} disagree on batch or head dim")
    if Hk < 1 or H % Hk:
        raise ValueError(f"KV heads ({Hk}) must divide query heads ({H})")
    if D < 16 or D & (D - 1):
        raise NotImplementedError(f"head dim {D}: the kernel takes powers of two >= 16")
    itemsize = {"float16": 2, "bfloat16": 2, "float32": 4}.get(dtype)
    if itemsize is None:
        raise TypeError(f"dtype {dtype}: the kernel takes float16, bfloat16 or float32")
    if B * Hk > 65535:
        raise NotImplementedError(f"B * Hk = {B * Hk}: the grid's second axis takes at most 65535")
    if block_n is None:
        block_n = default_block_n(D, itemsize, num_stages)
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
    if window is not None and window < 0:
        raise ValueError(f"window must be >= 0 or None, got {window}")
    block_m = max(16, _pow2(Sq * (H // Hk)))
    if block_m > 256:
        raise NotImplementedError(f"Sq * H / Hk = {Sq * (H // Hk)} rows: at most 256 a program")
    n_keys = L if window is None else min(L, window + Sq)
    if num_splits is None:
        occ = programs_per_sm(block_n, D, itemsize, num_stages, num_warps)
        num_splits = num_splits_for(B * Hk, n_keys, block_n, sm_count, occ)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    scale = D**-0.5 if scale is None else float(scale)
    cx = (("SCALE_LOG2", scale * LOG2E), ("L", L), ("SQ", Sq), ("H", H), ("HK", Hk), ("D", D),
          ("WINDOW", -1 if window is None else int(window)), ("NUM_SPLITS", num_splits),
          ("BLOCK_M", block_m), ("BLOCK_N", block_n), ("USE_TMA", bool(tma)),
          ("PRECISION", "ieee" if dtype == "float32" else "tf32"))
    block_s = _pow2(num_splits)
    block_d = max(16, min(D, 4096 // block_s))
    ccx = (("D", D), ("NUM_SPLITS", num_splits), ("BLOCK_S", block_s), ("BLOCK_D", block_d))
    return Plan(B, Sq, H, D, num_splits, block_n, (num_splits, B * Hk), cx, (B * Sq * H, D // block_d), ccx,
                num_warps, num_stages)


def combine_partials(part, lse, xp=np):
    """The split combine in array ops (``xp``: numpy or ``jax.numpy``), the peer of
    :func:`_combine_kernel`: part ``[B, Sq, H, S, D]``, lse ``[B, Sq, H, S]`` -> float32
    ``[B, Sq, H, D]``."""
    m = lse.max(axis=-1, keepdims=True)
    w = xp.exp2(lse - xp.where(m == -xp.inf, 0.0, m))
    den = w.sum(axis=-1)
    num = (w[..., None] * part).sum(axis=-2)
    return num / xp.where(den > 0, den, 1.0)[..., None]


# -- CPU: the same kernels under Triton's interpreter --------------------------------------------


def decode_numpy(q, k_cache, v_cache, cache_seqlens, *, window=None, num_splits=None, block_n=None,
                 num_warps=4, num_stages=3, scale=None, tma=False, combine="triton", sm_count=132):
    """:func:`decode` on numpy arrays, under Triton's interpreter (float16 / float32: the interpreter
    mishandles bfloat16 dots). ``combine="jnp"`` combines the splits with :func:`combine_partials`
    in ``jax.numpy`` (on whatever JAX runs here) instead of the combine kernel."""
    from jax_bindings._triton.launch import run_numpy
    from jax_bindings._triton.ops import Call

    dtype = np.dtype(q.dtype).name
    p = plan(q.shape, k_cache.shape, dtype, window=window, num_splits=num_splits, block_n=block_n,
             num_warps=num_warps, num_stages=num_stages, scale=scale, tma=tma, sm_count=sm_count)
    split_k, combine_k = _kernels(interpret=True)
    o_shape, l_shape = p.part_shapes
    o_dt = dtype if p.num_splits == 1 else "float32"
    call = Call(split_k, p.grid, (), ((o_shape, o_dt), (l_shape, "float32")), dict(p.constexprs),
                p.num_warps, p.num_stages, None)
    o, lse = run_numpy(call, q, k_cache.astype(q.dtype), v_cache.astype(q.dtype),
                       np.asarray(cache_seqlens, np.int32))
    if p.num_splits == 1:
        return o
    if combine == "jnp":
        import jax.numpy as jnp

        return np.asarray(combine_partials(jnp.asarray(o), jnp.asarray(lse), jnp)).astype(q.dtype)
    if combine != "triton":
        raise ValueError(f"combine must be 'triton' or 'jnp', got {combine!r}")
    cc = Call(combine_k, p.combine_grid, (), (((p.B, p.Sq, p.H, p.D), dtype),), dict(p.combine_constexprs),
              4, 1, None)
    (out,) = run_numpy(cc, o, lse)
    return out


# -- GPU: jax_triton ----------------------------------------------------------------------------


@functools.cache
def _jax_triton():
    """``jax_triton``, imported here (its import needs a CUDA JAX); like
    ``jax_bindings/_triton/backend.py``, puts back the ``TRITON_CACHE_DIR`` it blanks."""
    old = os.environ.get("TRITON_CACHE_DIR")
    try:
        import jax_triton
    finally:
        if os.environ.get("TRITON_CACHE_DIR") == "":
            if old:
                os.environ["TRITON_CACHE_DIR"] = old
            else:
                del os.environ["TRITON_CACHE_DIR"]
    return jax_triton


def _sm_count() -> int:
    import jax

    return int(getattr(jax.devices()[0], "core_count", None) or 132)


def decode(q, k_cache, v_cache, cache_seqlens, *, window=None, num_splits=None, block_n=None, num_warps=4,
           num_stages=3, scale=None, tma=False, combine="triton"):
    """Split-KV decode attention of a few new tokens against a KV cache (JAX arrays on a GPU).

    Args:
      q: ``[B, Sq, H, D]``, Sq small (1..16).
      k_cache, v_cache: ``[B, L, Hk, D]`` (Hk divides H; cast to q's dtype).
      cache_seqlens: int32 ``[B]``: keys ``[0, cache_seqlens[b])`` of row b are valid; query i
        sits at ``cache_seqlens[b] - Sq + i`` and sees the keys up to it.
      window: ``w``: query at ``pos`` sees keys ``pos - w <= j <= pos`` (None: all up to pos).
      num_splits: key-range splits (None: :func:`num_splits_for` on the SM count).
      block_n, num_warps, num_stages: the split kernel's tile of keys (None: :func:`default_block_n`,
        128 for bf16 D=128), warps, pipeline depth.
      scale: score scale (None: ``D ** -0.5``).
      tma: load K/V tiles through tensor descriptors (``tl.make_tensor_descriptor``).
      combine: ``"triton"`` (the combine kernel) or ``"jnp"`` (:func:`combine_partials`).

    Returns:
      out ``[B, Sq, H, D]`` in q's dtype (0 for a query that sees no key).

    Example::

        out = decode(q, k_cache, v_cache, jnp.full((B,), 4096, jnp.int32), window=1023)
    """
    import jax
    import jax.numpy as jnp

    if tma:
        raise NotImplementedError(
            "tma=True needs Triton's global scratch (256 B a program for the device-side descriptors), "
            "and jaxlib's Triton custom call passes a null scratch pointer (jaxlib/gpu/triton_kernels.cc, "
            "b/381242007): time it through decode_torch(..., tma=True) instead")
    jt = _jax_triton()
    dtype = jnp.dtype(q.dtype).name
    p = plan(q.shape, k_cache.shape, dtype, window=window, num_splits=num_splits, block_n=block_n,
             num_warps=num_warps, num_stages=num_stages, scale=scale, tma=tma, sm_count=_sm_count())
    split_k, combine_k = _kernels(interpret=False)
    o_shape, l_shape = p.part_shapes
    o_dt = q.dtype if p.num_splits == 1 else jnp.float32
    o, lse = jt.triton_call(
        q, k_cache.astype(q.dtype), v_cache.astype(q.dtype), cache_seqlens.astype(jnp.int32),
        kernel=split_k,
        out_shape=[jax.ShapeDtypeStruct(o_shape, o_dt), jax.ShapeDtypeStruct(l_shape, jnp.float32)],
        grid=p.grid, num_warps=p.num_warps, num_stages=p.num_stages, **dict(p.constexprs),
    )
    if p.num_splits == 1:
        return o
    if combine == "jnp":
        return combine_partials(o, lse, jnp).astype(q.dtype)
    if combine != "triton":
        raise ValueError(f"combine must be 'triton' or 'jnp', got {combine!r}")
    return jt.triton_call(
        o, lse, kernel=combine_k, out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        grid=p.combine_grid, num_warps=4, num_stages=1, **dict(p.combine_constexprs),
    )


def decode_torch(q, k_cache, v_cache, cache_seqlens, *, window=None, num_splits=None, block_n=None,
                 num_warps=4, num_stages=3, scale=None, tma=False):
    """:func:`decode` on torch CUDA tensors, launched by Triton's own launcher (for the sweep's
    TMA comparison: Triton allocates the descriptors' global scratch, jaxlib does not)."""
    import torch

    from jax_bindings._triton.launch import run_torch
    from jax_bindings._triton.ops import Call

    if tma:  # device-side descriptors live in global scratch that Triton's launcher asks for
        triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    dtype = str(q.dtype).removeprefix("torch.")
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    p = plan(q.shape, k_cache.shape, dtype, window=window, num_splits=num_splits, block_n=block_n,
             num_warps=num_warps, num_stages=num_stages, scale=scale, tma=tma, sm_count=sms)
    split_k, combine_k = _kernels(interpret=False)
    o_shape, l_shape = p.part_shapes
    o_dt = dtype if p.num_splits == 1 else "float32"
    call = Call(split_k, p.grid, (), ((o_shape, o_dt), (l_shape, "float32")), dict(p.constexprs),
                p.num_warps, p.num_stages, None)
    o, lse = run_torch(call, q, k_cache, v_cache, cache_seqlens.to(torch.int32))
    if p.num_splits == 1:
        return o
    cc = Call(combine_k, p.combine_grid, (), ((tuple(q.shape), dtype),), dict(p.combine_constexprs),
              4, 1, None)
    return run_torch(cc, o, lse)[0]


# -- GPU sweep ----------------------------------------------------------------------------------

# (name, B, L, window): issue's four cases, bf16, H=32, Hk=8, D=128, cache full (cache_seqlens = L)
CASES = (
    ("b8_l32k", 8, 32768, None),
    ("b1_l128k", 1, 131072, None),
    ("b64_l8k", 64, 8192, None),
    ("b8_l32k_w4096", 8, 32768, 4096),
)
H, HK, D = 32, 8, 128
HBM_GBS = 4800.0  # H200 datasheet


def needed_bytes(B: int, Hk: int, D: int, itemsize: int, seqlens, Sq: int, window: int | None) -> int:
    """Bytes of K and V that the mask needs: each row's keys ``[lo, seqlen)`` once per KV head."""
    total = 0
    for n in np.asarray(seqlens).tolist():
        lo = 0 if window is None else max(0, n - Sq - window)
        total += max(0, n - lo)
    return 2 * total * Hk * D * itemsize


def reference(q, k, v, seqlens, window=None, scale=None):
    """Dense masked attention in float32 ``jnp`` (the GPU check's oracle), ``[B, Sq, H, D]``."""
    import jax.numpy as jnp

    B, Sq, H_, D_ = q.shape
    L, Hk = k.shape[1], k.shape[2]
    scale = D_**-0.5 if scale is None else scale
    qg = q.astype(jnp.float32).reshape(B, Sq, Hk, H_ // Hk, D_)
    s = jnp.einsum("bikgd,bjkd->bkgij", qg, k.astype(jnp.float32)) * scale
    pos = seqlens[:, None] - Sq + jnp.arange(Sq)[None, :]  # [B, Sq]
    j = jnp.arange(L)
    ok = j[None, None, :] <= pos[:, :, None]
    if window is not None:
        ok &= j[None, None, :] >= pos[:, :, None] - window
    ok = ok[:, None, None]  # [B, 1, 1, Sq, L]
    s = jnp.where(ok, s, -jnp.inf)
    m = jnp.max(s, -1, keepdims=True)
    p = jnp.where(ok, jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
    den = p.sum(-1, keepdims=True)
    o = jnp.einsum("bkgij,bjkd->bikgd", p / jnp.where(den > 0, den, 1.0), v.astype(jnp.float32))
    return o.reshape(B, Sq, H_, D_)


def _configs(quick: bool):
    """(block_n, num_warps, num_stages, num_splits, combine) to sweep; num_splits None: the
    heuristic's, ``"xF"``: F times the heuristic's."""
    if quick:
        return [(64, 4, 3, None, "triton"), (128, 4, 3, None, "triton"), (64, 4, 4, None, "triton"),
                (128, 4, 2, None, "triton"), (64, 4, 3, "x0.5", "triton"), (64, 4, 3, "x2", "triton"),
                (64, 4, 3, None, "jnp")]
    out = []
    for bn in (64, 128, 256):
        for st in (2, 3, 4):
            for nw in (4, 8):
                if (st - 1) * 2 * bn * D * 2 <= 200 * 1024:
                    out.append((bn, nw, st, None, "triton"))
    for sp in ("x0.5", "x2", "x4"):
        out += [(64, 4, 3, sp, "triton"), (128, 4, 3, sp, "triton")]
    return out + [(128, 4, 3, None, "jnp")]


def _parse_config(text: str):
    """``"128/4/3"``, ``"128/4/3/x2"``, ``"64/4/3/12/jnp"`` -> a :func:`_configs` entry."""
    f = text.split("/")
    sp = None if len(f) < 4 or f[3] == "h" else (f[3] if f[3].startswith("x") else int(f[3]))
    return int(f[0]), int(f[1]), int(f[2]), sp, f[4] if len(f) > 4 else "triton"


def _splits(spec, B, L, window, bn, nw, st, sm_count) -> int:
    base = plan((B, 1, H, D), (B, L, HK, D), "bfloat16", window=window, block_n=bn, num_warps=nw,
                num_stages=st, sm_count=sm_count).num_splits
    if spec is None:
        return base
    if isinstance(spec, str):
        return max(1, round(base * float(spec[1:])))
    return int(spec)


def _header(kind: str, sms: int, args) -> dict:
    return {"device": kind, "sm_count": sms, "triton": triton.__version__, "sq": args.sq,
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "shape": {"H": H, "Hk": HK, "D": D, "dtype": "bfloat16"},
            "gbs": "bytes of K and V the mask needs / ms per call", "rows": []}


def _line(row: dict, ceiling: float | None = None) -> str:
    tma, comb = int(row.get("tma", False)), row.get("combine", "triton")
    cfg = (f"  bn={row['block_n']:3d} w={row['num_warps']} st={row['num_stages']} "
           f"splits={row['num_splits']:3d} tma={tma} {comb:6s}: ")
    if "error" in row:
        return cfg + "FAILED " + row["error"][:200]
    x = f", {row['gbs'] / ceiling:4.2f}x XLA read" if ceiling else ""
    det = "det" if row["deterministic"] else "NONDET"
    return cfg + (f"{row['ms'] * 1e3:8.1f} us {row['gbs']:6.0f} GB/s "
                  f"({row['gbs'] / HBM_GBS:5.1%} of 4.8 TB/s{x}) err {row['max_abs_err']:.1e} {det}")


def _best(rows, name):
    best = max((r for r in rows if r["case"] == name and "gbs" in r and r["peer"] != "xla_read"),
               key=lambda r: r["gbs"], default=None)
    if best:
        print(f"  best {name}: bn={best['block_n']} w={best['num_warps']} st={best['num_stages']} "
              f"splits={best['num_splits']} tma={best.get('tma', False)} {best.get('combine', 'triton')}: "
              f"{best['gbs']:.0f} GB/s ({best['gbs'] / HBM_GBS:.1%})", flush=True)


def _gpu_checks() -> list[dict]:
    """Small bf16 shapes on the GPU against :func:`reference`: ragged lengths (one row shorter than
    Sq), Sq = 4, a window, 1 / 3 / heuristic splits, both combines; printed and returned."""
    import jax
    import jax.numpy as jnp

    rows = []
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(1), 3)
    B, Sq, L = 3, 4, 1000
    q = jax.random.normal(kq, (B, Sq, H, D), jnp.bfloat16)
    k = jax.random.normal(kk, (B, L, HK, D), jnp.bfloat16)
    v = jax.random.normal(kv, (B, L, HK, D), jnp.bfloat16)
    lens = jnp.array([L, 517, 2], jnp.int32)
    for window in (None, 100):
        ref = reference(q, k, v, lens, window)
        for splits in (1, 3, None):
            for comb in ("triton", "jnp"):
                f = jax.jit(functools.partial(decode, window=window, num_splits=splits, combine=comb))
                out = f(q, k, v, lens)
                err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref)))
                same = bool(jnp.array_equal(out, f(q, k, v, lens)))
                zero = not bool(jnp.any(out[2, :2]))  # row 2's first two queries see no key
                ok = err < 2e-2 and same and zero
                rows.append({"window": window, "num_splits": splits, "combine": comb, "max_abs_err": err,
                             "deterministic": same, "empty_rows_zero": zero, "ok": ok})
                print(f"check window={window} splits={splits} {comb}: err {err:.2e} det={same} "
                      f"empty->0={zero} {'ok' if ok else 'FAILED'}", flush=True)
    return rows


def _main_jax(args) -> None:
    import jax
    import jax.numpy as jnp

    from splat.tools import timing

    if jax.default_backend() != "gpu":
        sys.exit("spike_decode_triton: needs a GPU (jax.default_backend() is not 'gpu')")
    sms = _sm_count()
    result = _header(jax.devices()[0].device_kind, sms, args)
    result.update(jax=jax.__version__, timing=timing.TIMING_METHOD, launch="jax_triton.triton_call")
    print(f"{result['device']}, {sms} SMs, jax {jax.__version__}, triton {triton.__version__}", flush=True)
    per_sample, min_ms = timing.sampling()
    result["checks"] = [] if args.skip_checks else _gpu_checks()
    configs = _configs(args.quick) if args.configs is None else [_parse_config(c) for c in args.configs]
    configs += [(64, 4, 3, s, "triton") for s in args.splits]
    for name, B, L, window in CASES:
        if name not in args.cases:
            continue
        kq, kk, kv = jax.random.split(jax.random.PRNGKey(B * L), 3)
        q = jax.random.normal(kq, (B, args.sq, H, D), jnp.bfloat16)
        k = jax.random.normal(kk, (B, L, HK, D), jnp.bfloat16)
        v = jax.random.normal(kv, (B, L, HK, D), jnp.bfloat16)
        lens = jnp.full((B,), L, jnp.int32)
        nbytes = needed_bytes(B, HK, D, 2, np.asarray(lens), args.sq, window)
        ref = reference(q, k, v, lens, window)
        lo = 0 if window is None else max(0, L - args.sq - window)

        def read_all(q, k, v, lens, lo=lo):  # the read ceiling here: XLA summing the same K and V rows
            s = k[:, lo:].astype(jnp.float32).sum((1, 2)) + v[:, lo:].astype(jnp.float32).sum((1, 2))
            return q + s[:, None, None, :].astype(q.dtype)

        _, launch, sync = timing.compile_timed(read_all, (q, k, v, lens), 10, {0: 0})
        t = timing.time_call(None, 2, args.repeats, launch=launch, sync=sync, per_sample=per_sample,
                             calls_per_launch=10, min_sample_ms=min_ms)
        ceiling = nbytes / t["ms"] / 1e6
        print(f"\n{name}: B={B} L={L} window={window} Sq={args.sq}: {nbytes / 1e9:.3f} GB needed; "
              f"XLA read of the same bytes {t['ms'] * 1e3:.1f} us = {ceiling:.0f} GB/s", flush=True)
        result["rows"].append({"case": name, "peer": "xla_read", "B": B, "L": L, "window": window,
                               "bytes": nbytes, "gbs": ceiling, **t})
        for bn, nw, st, sp, comb in configs:
            splits = _splits(sp, B, L, window, bn, nw, st, sms)
            row = {"case": name, "peer": "triton_decode", "B": B, "L": L, "window": window, "bytes": nbytes,
                   "block_n": bn, "num_warps": nw, "num_stages": st, "num_splits": splits,
                   "splits_rule": "heuristic" if sp is None else sp, "tma": False, "combine": comb}
            fn = functools.partial(decode, window=window, num_splits=splits, block_n=bn, num_warps=nw,
                                   num_stages=st, combine=comb)
            t0 = time.perf_counter()
            try:
                compiled, launch, sync = timing.compile_timed(fn, (q, k, v, lens), 10, {0: 0})
                out = compiled(q, k, v, lens)
                err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref)))
                same = bool(jnp.array_equal(out, compiled(q, k, v, lens)))
                t = timing.time_call(None, 2, args.repeats, launch=launch, sync=sync, per_sample=per_sample,
                                     calls_per_launch=10, min_sample_ms=min_ms)
            except Exception as e:  # one config failing (shared memory, ...) must not end the sweep
                row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
            else:
                gbs = nbytes / t["ms"] / 1e6
                row.update(t, gbs=gbs, max_abs_err=err, deterministic=same, hbm_frac=gbs / HBM_GBS,
                           x_xla_read=gbs / ceiling, build_s=time.perf_counter() - t0)
            print(_line(row, ceiling), flush=True)
            result["rows"].append(row)
            with open(args.out, "w") as f:  # after every config: a cut run keeps what it measured
                json.dump(result, f, indent=1)
        _best(result["rows"], name)
        del q, k, v, ref


def _main_torch(args) -> None:
    """The same kernel launched by Triton from torch, pointer loads vs tensor descriptors (TMA),
    timed by ``triton.testing.do_bench`` (CUDA events); no JAX on the device in this process."""
    import torch

    props = torch.cuda.get_device_properties(0)
    result = _header(props.name, props.multi_processor_count, args)
    result.update(torch=torch.__version__, launch="triton launcher (torch tensors)",
                  timing="triton.testing.do_bench median (CUDA events, L2 flushed between calls)")
    print(f"{props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, "
          f"triton {triton.__version__}", flush=True)
    for name, B, L, window in CASES:
        if name not in args.cases:
            continue
        g = torch.Generator(device="cuda").manual_seed(B * L)
        q = torch.randn((B, args.sq, H, D), generator=g, device="cuda", dtype=torch.bfloat16)
        k = torch.randn((B, L, HK, D), generator=g, device="cuda", dtype=torch.bfloat16)
        v = torch.randn((B, L, HK, D), generator=g, device="cuda", dtype=torch.bfloat16)
        lens = torch.full((B,), L, device="cuda", dtype=torch.int32)
        nbytes = needed_bytes(B, HK, D, 2, lens.cpu().numpy(), args.sq, window)
        print(f"\n{name}: B={B} L={L} window={window} Sq={args.sq}: {nbytes / 1e9:.3f} GB needed", flush=True)
        base = None
        for bn, nw, st in ((64, 4, 3), (128, 4, 3), (64, 4, 4), (128, 4, 2)):
            for tma in (False, True):
                splits = _splits(None, B, L, window, bn, nw, st, props.multi_processor_count)
                row = {"case": name, "peer": "triton_decode_torch", "B": B, "L": L, "window": window,
                       "bytes": nbytes, "block_n": bn, "num_warps": nw, "num_stages": st,
                       "num_splits": splits, "tma": tma, "combine": "triton"}
                fn = functools.partial(decode_torch, q, k, v, lens, window=window, num_splits=splits,
                                       block_n=bn, num_warps=nw, num_stages=st, tma=tma)
                try:
                    out = fn()
                    if base is None:
                        base = out.float()
                    err = float((out.float() - base).abs().max())
                    same = bool(torch.equal(out, fn()))
                    ms = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
                except Exception as e:
                    row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
                else:
                    row.update(ms=ms, gbs=nbytes / ms / 1e6, max_abs_err=err, deterministic=same)
                print(_line(row).replace("err ", "diff vs first "), flush=True)
                result["rows"].append(row)
                with open(args.out, "w") as f:
                    json.dump(result, f, indent=1)
        _best(result["rows"], name)
        del q, k, v


def main(argv=None) -> None:
    """The GPU sweep: ``--quick`` (7 configs a case) or the full one; ``--torch``: the TMA comparison."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="benchmarks/out/spike_decode_triton.json")
    ap.add_argument("--quick", action="store_true", help="seven configs per case instead of the sweep")
    ap.add_argument("--torch", action="store_true",
                    help="launch through Triton from torch instead (pointer loads vs tensor descriptors)")
    ap.add_argument("--cases", nargs="*", default=[c[0] for c in CASES])
    ap.add_argument("--sq", type=int, default=1, help="new query tokens a row")
    ap.add_argument("--splits", nargs="*", type=int, default=[], help="also sweep these num_splits at 64/4/3")
    ap.add_argument("--configs", nargs="*", default=None, metavar="BN/WARPS/STAGES[/SPLITS[/COMBINE]]",
                    help="sweep exactly these (SPLITS: an int, xF for F times the heuristic's, or h)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--skip-checks", action="store_true", help="skip the small bf16 correctness checks")
    args = ap.parse_args(argv)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    _main_torch(args) if args.torch else _main_jax(args)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
