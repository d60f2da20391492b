#!/usr/bin/env python3
"""Spike: what Triton's Hopper features give a hand-written attention forward.

Measures hand-written Triton forward kernels -- dense and causal window 1024 --
beside FlashAttention-3, cuDNN and splat's generated kernel, all in one process,
to decide between a Triton and a CUDA C++ route for splat's Hopper forward.

Every kernel here reads ``q, k, v: [B, S, H, D]`` through their strides (no
transposes; the head dim must be contiguous), takes bf16 (fp16 in the CPU
interpreter) in, accumulates in fp32 with an online softmax in base 2 (``scale *
log2(e)`` folded into q once, rounded to the input dtype), and writes
``out: [B, S, H, D]`` (input dtype) and ``lse: [B, H, S]`` (fp32, natural log).
A row block's keys are ``[lo, hi)`` with, for a causal window of ``W`` keys,
``lo = max(0, row0 - (W - 1))`` and ``hi = min(row0 + BLOCK_M, S)``; the tiles
inside every row's window (the interior) skip masking, only the edge tiles mask.

Variants (each a few fixed configs, no autotuning; see :data:`VARIANTS`):

==============  ==================================================================
``base``        pointer loads, ``tl.range(..., num_stages=)`` pipelining; the key
                walk (``Config.loop``) is three loops (left edge, interior, right
                edge: "split"), one loop masking edge tiles under a run-time test
                ("fused") or one loop masking every tile ("masked", branch-free)
``tma``         q/k/v/out through tensor descriptors (``tl.make_tensor_descriptor``,
                TMA on Hopper; needs the ``triton.set_allocator`` set below)
``ws``          the key loop with ``tl.range(..., warp_specialize=True)`` (the
                interior loop when "split"), tensor descriptors; the compiled
                kernel's warp count, recorded per build, says whether it took
``persistent``  one program per SM looping over (row block, batch*head) tiles,
                heaviest row blocks first; built at run time from the fastest
                base/tma/ws config of the same (mask, S)
``lazy``        FA4-style conditional rescaling: the running max moves (and the
                accumulator is rescaled) only when some row's max grows by more
                than 2^8; exact, since out and lse use the sums at that same max;
                built from the fastest config so far (and from the fastest one
                without warp specialisation, which its branch undoes)
==============  ==================================================================

Every (variant, config) is compiled and checked first against a float32 torch
reference on a small problem (B=1, H=2, S=1664: interior and edge tiles; max
abs error < 6e-2 on out and lse), then timed; one that fails to compile or
check is recorded with the error's first line and skipped. Peers, same inputs:
FlashAttention-3 for JAX (``flash_attn3_jax.flash_mha``), cuDNN
(``jax.nn.dot_product_attention(implementation="cudnn")``) and splat
(``splat.attention(backend="triton")``), each timed as 10 calls chained in one
jitted program (``splat.tools.timing.compile_timed``: each call's out is the next
call's q).

Timing: Triton kernels with CUDA events around back-to-back launches, JAX
programs with the host clock around back-to-back launches and one wait; a
sample lasts >= 20 ms, the median of 5 samples is reported. Useful FLOPs
``4 * B * H * nnz * D`` with nnz the mask's true count (dense ``S^2``, causal
window ``sum_i min(i + 1, W)``). Every row lands in the JSON as soon as it is
measured (``--out``, default ``benchmarks/results/spike-hopper-<device>.json``);
a table of the best config per variant and its ratios to the peers is printed last.

Usage (GPU machine, project root, after the command prefix of the device notes that
installs jax-triton and flash-attn3-jax and sets a writable ``TRITON_CACHE_DIR``)::

    python3 benchmarks/spike_hopper_fwd.py [--quick] [--out PATH] [--budget-s 330]
    python3 benchmarks/spike_hopper_fwd.py --check-only     # compile + numerics of every build

No row starts after ``--budget-s`` seconds (the rows left are listed under
``skipped``), so a full run ends near 6 minutes, compiles included; a kernel
that breaks the CUDA context stops the run with what was measured kept.

CPU numerics check of the kernels under Triton's interpreter (no torch needed;
kernels launched through ``jax_bindings._triton.launch.run_numpy``)::

    TRITON_INTERPRET=1 python3 benchmarks/spike_hopper_fwd.py --check-only --interpret
"""

from __future__ import annotations

import os
import sys

if "--interpret" in sys.argv:  # Triton reads it when the kernels below are decorated
    os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # JAX beside torch on one GPU

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402
import importlib  # noqa: E402
import importlib.metadata  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from dataclasses import dataclass, replace  # noqa: E402

import numpy as np  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

LOG2E = 1.4426950408889634
SCHEMA = "splat-spike-hopper-fwd/1"
FLOP_FORMULA = "useful FLOPs = 4*B*H*nnz*D; nnz: dense S^2, causal window sum_i min(i+1, W)"
# max abs error of out and lse vs the float32 reference. Folding scale*log2(e) into q and rounding
# it to bf16 changes every score by up to 2^-8 relative: lse moves by ~2e-2 at scores of ~5 and out
# by about an output ulp (1.6e-2 at |out| ~ 3) -- the H100 run saw 0.020-0.023 on correct builds.
TOLERANCE = 6e-2
MIN_SAMPLE_MS = 20.0
SAMPLES = 5
CHAIN = 10  # JAX peer calls per executable

# =============================================================================================
# Kernels
#
# Glossary: bh = batch * H + head; row0 = first query row of a row block; [lo, hi) = the keys
# any row of the block reads; [full_lo, full_hi) = interior tiles (every key in every row's
# window, no mask); m_i / l_i = running max (log2 units) / running sum of exp2(s - m_i);
# acc = unnormalised output. Scores s are in log2 units (q carries scale * log2(e)).
# =============================================================================================

# (kernel argument lists are grouped by role, one group a line)
# fmt: off
_NO_MASK = tl.constexpr(0)  # every key of the tile is valid for every row
_MASK = tl.constexpr(1)  # mask every tile of the loop
_MASK_IF_EDGE = tl.constexpr(2)  # test at run time whether the tile is an edge tile
_RESCALE_LOG2 = tl.constexpr(8.0)  # lazy rescale: move the max only past 2^8 growth
# Key-loop shapes (Config.loop): three loops (edge / interior / edge); one loop testing each tile
# at run time; one loop masking every tile (no branch in the body: what warp specialisation takes)
_SPLIT = tl.constexpr(0)
_FUSED = tl.constexpr(1)
_MASKED = tl.constexpr(2)
LOOPS = {"split": 0, "fused": 1, "masked": 2}


@triton.jit
def _softmax_update(s, m_i, l_i, acc, LAZY: tl.constexpr):
    """One tile of the online softmax: returns (p, m_i, l_i, acc) with acc rescaled to the new max."""
    m_tile = tl.max(s, 1)
    if LAZY:
        # the whole block moves its reference max only when some row grew past 2^8: the
        # rescale (a multiply over acc) leaves the common path; p <= 2^8 stays exact in fp32
        if tl.max(m_tile - m_i, 0) > _RESCALE_LOG2:
            m_new = tl.maximum(m_i, m_tile)
            alpha = tl.math.exp2(m_i - m_new)
            acc = acc * alpha[:, None]
            l_i = l_i * alpha
            m_i = m_new
        p = tl.math.exp2(s - m_i[:, None])
    else:
        m_new = tl.maximum(m_i, m_tile)
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        acc = acc * alpha[:, None]
        l_i = l_i * alpha
        m_i = m_new
    l_i += tl.sum(p, 1)
    return p, m_i, l_i, acc


@triton.jit
def _kv_loop(
    acc, l_i, m_i, q, k_src, v_src, sks, svs, offs_m, offs_n, offs_d,
    start, stop, full_lo, full_hi, S,
    WINDOW: tl.constexpr, BLOCK_N: tl.constexpr, MASK_MODE: tl.constexpr, EVEN: tl.constexpr,
    USE_TMA: tl.constexpr, STAGES: tl.constexpr, WARP_SPEC: tl.constexpr, LAZY: tl.constexpr,
):
    """Key tiles ``[start, stop)`` of one row block (q: [BLOCK_M, D], pre-scaled)."""
    for n0 in tl.range(start, stop, BLOCK_N, num_stages=STAGES, warp_specialize=WARP_SPEC):
        cols = n0 + offs_n
        # -- load K, V tiles [BLOCK_N, D]
        if USE_TMA:
            k = k_src.load([n0, 0])
            v = v_src.load([n0, 0])
        elif EVEN:
            k = tl.load(k_src + cols[:, None] * sks + offs_d[None, :])
            v = tl.load(v_src + cols[:, None] * svs + offs_d[None, :])
        else:
            k = tl.load(k_src + cols[:, None] * sks + offs_d[None, :], mask=(cols < S)[:, None], other=0.0)
            v = tl.load(v_src + cols[:, None] * svs + offs_d[None, :], mask=(cols < S)[:, None], other=0.0)
        # -- scores [BLOCK_M, BLOCK_N], log2 units
        s = tl.dot(q, tl.trans(k))
        if MASK_MODE != _NO_MASK:
            keep = cols[None, :] < S
            if WINDOW > 0:
                keep = keep & (cols[None, :] <= offs_m[:, None]) & (cols[None, :] > offs_m[:, None] - WINDOW)
            if MASK_MODE == _MASK:
                s = tl.where(keep, s, float("-inf"))
            else:
                if (n0 < full_lo) | (n0 >= full_hi):
                    s = tl.where(keep, s, float("-inf"))
        # -- online softmax, then P V
        p, m_i, l_i, acc = _softmax_update(s, m_i, l_i, acc, LAZY)
        acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, l_i, m_i


@triton.jit
def _row_block(
    Q, K, V, Out, LSE, bh, pid_m, sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sob, sos, soh, H, S, qk_scale,
    WINDOW: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_D: tl.constexpr,
    EVEN: tl.constexpr, LOOP: tl.constexpr, STAGES: tl.constexpr, USE_TMA: tl.constexpr,
    WARP_SPEC: tl.constexpr, LAZY: tl.constexpr,
):
    """Rows ``[pid_m * BLOCK_M, +BLOCK_M)`` of head ``bh``: out and lse."""
    b = (bh // H).to(tl.int64)
    h = bh % H
    row0 = pid_m * BLOCK_M
    offs_m = row0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_D)
    q_base = Q + b * sqb + h * sqh
    k_base = K + b * skb + h * skh
    v_base = V + b * svb + h * svh
    o_base = Out + b * sob + h * soh
    # -- q [BLOCK_M, D], with scale * log2(e) folded in once
    if USE_TMA:
        k_src = tl.make_tensor_descriptor(k_base, [S, HEAD_D], [sks, 1], [BLOCK_N, HEAD_D])
        v_src = tl.make_tensor_descriptor(v_base, [S, HEAD_D], [svs, 1], [BLOCK_N, HEAD_D])
        q_desc = tl.make_tensor_descriptor(q_base, [S, HEAD_D], [sqs, 1], [BLOCK_M, HEAD_D])
        q = q_desc.load([row0, 0])
    else:
        k_src = k_base
        v_src = v_base
        q_ptrs = q_base + offs_m[:, None] * sqs + offs_d[None, :]
        if EVEN:
            q = tl.load(q_ptrs)
        else:
            q = tl.load(q_ptrs, mask=(offs_m < S)[:, None], other=0.0)
    q = (q * qk_scale).to(Q.dtype.element_ty)
    # -- key range and interior tiles (multiples of BLOCK_N from lo)
    if WINDOW > 0:
        lo = tl.maximum(row0 - (WINDOW - 1), 0) // BLOCK_N * BLOCK_N
        hi = tl.minimum(row0 + BLOCK_M, S)
        # interior: first key >= the last row's first key, last key <= the first row's own key
        first = tl.maximum(row0 + BLOCK_M - WINDOW, 0)
        full_lo = tl.minimum(tl.maximum((first + BLOCK_N - 1) // BLOCK_N * BLOCK_N, lo), hi)
        full_hi = tl.maximum(tl.minimum(tl.minimum(row0 + 1, S) // BLOCK_N * BLOCK_N, hi), full_lo)
    else:
        lo = 0
        hi = S
        full_lo = 0
        full_hi = S // BLOCK_N * BLOCK_N
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)  # finite: a row masked so far gives p = 0, no NaN
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_D], tl.float32)
    # -- key tiles
    if WINDOW == 0 and EVEN:
        acc, l_i, m_i = _kv_loop(
            acc, l_i, m_i, q, k_src, v_src, sks, svs, offs_m, offs_n, offs_d, 0, S, 0, S, S,
            WINDOW, BLOCK_N, _NO_MASK, EVEN, USE_TMA, STAGES, WARP_SPEC, LAZY,
        )
    elif LOOP == _SPLIT:
        if WINDOW > 0:
            acc, l_i, m_i = _kv_loop(
                acc, l_i, m_i, q, k_src, v_src, sks, svs, offs_m, offs_n, offs_d, lo, full_lo, full_lo,
                full_hi, S, WINDOW, BLOCK_N, _MASK, EVEN, USE_TMA, STAGES, False, LAZY,
            )
        acc, l_i, m_i = _kv_loop(
            acc, l_i, m_i, q, k_src, v_src, sks, svs, offs_m, offs_n, offs_d, full_lo, full_hi, full_lo,
            full_hi, S, WINDOW, BLOCK_N, _NO_MASK, EVEN, USE_TMA, STAGES, WARP_SPEC, LAZY,
        )
        acc, l_i, m_i = _kv_loop(
            acc, l_i, m_i, q, k_src, v_src, sks, svs, offs_m, offs_n, offs_d, full_hi, hi, full_lo,
            full_hi, S, WINDOW, BLOCK_N, _MASK, EVEN, USE_TMA, STAGES, False, LAZY,
        )
    elif LOOP == _FUSED:
        acc, l_i, m_i = _kv_loop(
            acc, l_i, m_i, q, k_src, v_src, sks, svs, offs_m, offs_n, offs_d, lo, hi, full_lo, full_hi, S,
            WINDOW, BLOCK_N, _MASK_IF_EDGE, EVEN, USE_TMA, STAGES, WARP_SPEC, LAZY,
        )
    else:  # _MASKED
        acc, l_i, m_i = _kv_loop(
            acc, l_i, m_i, q, k_src, v_src, sks, svs, offs_m, offs_n, offs_d, lo, hi, full_lo, full_hi, S,
            WINDOW, BLOCK_N, _MASK, EVEN, USE_TMA, STAGES, WARP_SPEC, LAZY,
        )
    # -- epilogue: normalise with the true sums; lse in natural log
    out = (acc / l_i[:, None]).to(Out.dtype.element_ty)
    lse = (m_i + tl.math.log2(l_i)) * 0.6931471805599453
    if USE_TMA:
        o_desc = tl.make_tensor_descriptor(o_base, [S, HEAD_D], [sos, 1], [BLOCK_M, HEAD_D])
        o_desc.store([row0, 0], out)
    elif EVEN:
        tl.store(o_base + offs_m[:, None] * sos + offs_d[None, :], out)
    else:
        tl.store(o_base + offs_m[:, None] * sos + offs_d[None, :], out, mask=(offs_m < S)[:, None])
    tl.store(LSE + bh.to(tl.int64) * S + offs_m, lse, mask=offs_m < S)


# sizes that differ between the small check and the timed problem stay unspecialised, so the
# build that passed the check is the build that is timed
@triton.jit(do_not_specialize=["BH", "H", "n_row_blocks", "n_programs"])
def _attn_fwd(
    Q, K, V, Out, LSE, sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sob, sos, soh,
    BH, H, S, n_row_blocks, n_programs, qk_scale,
    WINDOW: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_D: tl.constexpr,
    EVEN: tl.constexpr, LOOP: tl.constexpr, STAGES: tl.constexpr, USE_TMA: tl.constexpr,
    WARP_SPEC: tl.constexpr, PERSISTENT: tl.constexpr, LAZY: tl.constexpr,
):
    """Attention forward; tile t = (row block n_row_blocks-1 - t // BH, head t % BH): heaviest first.

    Q, K, V, O: [B, S, H, D] (strides s?b, s?s, s?h; D contiguous); LSE: [B, H, S] float32.
    Grid: (n_row_blocks * BH,), or (n_programs,) programs looping over tiles when PERSISTENT.
    """
    tl.static_assert(BLOCK_M % 16 == 0 and BLOCK_N % 16 == 0 and HEAD_D % 16 == 0)
    if PERSISTENT:
        for t in range(tl.program_id(0), n_row_blocks * BH, n_programs):
            _row_block(
                Q, K, V, Out, LSE, t % BH, n_row_blocks - 1 - t // BH, sqb, sqs, sqh, skb, sks, skh, svb, svs,
                svh, sob, sos, soh, H, S, qk_scale, WINDOW, BLOCK_M, BLOCK_N, HEAD_D, EVEN, LOOP, STAGES,
                USE_TMA, WARP_SPEC, LAZY,
            )
    else:
        t = tl.program_id(0)
        _row_block(
            Q, K, V, Out, LSE, t % BH, n_row_blocks - 1 - t // BH, sqb, sqs, sqh, skb, sks, skh, svb, svs,
            svh, sob, sos, soh, H, S, qk_scale, WINDOW, BLOCK_M, BLOCK_N, HEAD_D, EVEN, LOOP, STAGES, USE_TMA,
            WARP_SPEC, LAZY,
        )


# fmt: on


# =============================================================================================
# Configs
# =============================================================================================


@dataclass(frozen=True)
class Config:
    """One kernel build: tiles, warps, pipeline stages and feature flags.

    Attributes:
      block_m, block_n: query rows / keys per tile.
      warps: ``num_warps``.
      stages: ``num_stages`` of the launch and of the key loop's ``tl.range``.
      tma: q/k/v/out through tensor descriptors.
      ws: ``warp_specialize=True`` on the interior (or only) key loop.
      persistent: one program per SM looping over tiles.
      lazy: conditional rescaling (see :func:`_softmax_update`).
      loop: the key walk of a masked row block: "split" (edge, interior, edge loops), "fused"
        (one loop, edge tiles masked under a run-time test) or "masked" (one loop, every tile
        masked). A dense row block whose tiles divide S walks one unmasked loop in all three.
    """

    block_m: int
    block_n: int
    warps: int
    stages: int
    tma: bool = False
    ws: bool = False
    persistent: bool = False
    lazy: bool = False
    loop: str = "split"

    def __post_init__(self):
        if self.loop not in LOOPS:
            raise ValueError(f"loop must be one of {sorted(LOOPS)}, got {self.loop!r}")

    @property
    def name(self) -> str:
        flags = [f for f in ("tma", "ws", "persistent", "lazy") if getattr(self, f)]
        loop = [] if self.loop == "split" else [self.loop]
        return " ".join([f"{self.block_m}x{self.block_n} w{self.warps} s{self.stages}", *flags, *loop])


# Fixed configs, best guess first (--quick times only the first). 128x128 at 3 stages would
# hold q + 3 x (k + v) = 224 KiB of shared memory: at the H100's limit, so 2 stages there.
# Compiled for sm_90 with Triton 3.9 (cuobjdump): 128-row tiles on 4 warps spill (acc alone is
# 128 fp32 registers a thread) except warp-specialised; 8 warps fit in 174-255 registers.
VARIANTS: dict[str, list[Config]] = {
    "base": [
        Config(128, 64, 8, 3),
        Config(128, 128, 8, 2),
        Config(128, 64, 8, 3, loop="fused"),
        Config(128, 64, 4, 3),
    ],
    "tma": [
        Config(128, 128, 8, 2, tma=True),
        Config(128, 64, 8, 3, tma=True),
        Config(128, 64, 4, 3, tma=True),
    ],
    # Triton 3.9 (sm_90 compiles here) specialised warps (4 -> 12 warps, 168 registers, no spill)
    # only with 4 warps and no branch in the loop ("fused" + window stayed 4 warps and spilled);
    # "split" + window and pointer loads + dense failed to compile there
    "ws": [
        Config(128, 128, 4, 2, tma=True, ws=True, loop="masked"),
        Config(128, 128, 4, 2, tma=True, ws=True, loop="fused"),
        Config(128, 64, 4, 3, tma=True, ws=True, loop="masked"),
        Config(128, 128, 8, 2, tma=True, ws=True, loop="masked"),
    ],
}
# Built at run time from the fastest config measured so far at the same (mask, S).
DERIVED = {"persistent": {"persistent": True}, "lazy": {"lazy": True}}
VARIANT_ORDER = ("base", "tma", "ws", "persistent", "lazy")

# CPU interpreter check: small tiles, every code path (loops, tma, ws, persistent, lazy).
INTERPRET_CONFIGS: list[tuple[str, Config]] = [
    ("base", Config(64, 32, 4, 2)),
    ("base", Config(32, 64, 4, 2)),
    ("base", Config(64, 32, 4, 2, loop="fused")),
    ("base", Config(32, 64, 4, 2, loop="masked")),
    ("tma", Config(64, 32, 4, 2, tma=True)),
    ("ws", Config(64, 32, 4, 2, tma=True, ws=True, loop="masked")),
    ("ws", Config(64, 32, 4, 2, ws=True, loop="fused")),
    ("persistent", Config(64, 32, 4, 2, tma=True, persistent=True)),
    ("persistent", Config(64, 32, 4, 2, persistent=True, loop="fused")),
    ("lazy", Config(64, 32, 4, 2, lazy=True)),
    ("lazy", Config(32, 32, 4, 2, tma=True, lazy=True, persistent=True, loop="masked")),
]


def nnz(S: int, window: int) -> int:
    """Nonzeros of the S x S mask: dense (window 0) or causal window of ``window`` keys."""
    if window == 0:
        return S * S
    rows = np.arange(S, dtype=np.int64)
    return int(np.minimum(rows + 1, window).sum())


def useful_flops(B: int, H: int, S: int, D: int, window: int) -> int:
    return 4 * B * H * nnz(S, window) * D


def _mask_name(window: int) -> str:
    return "dense" if window == 0 else f"causal_window_{window}"


# =============================================================================================
# Launching
# =============================================================================================


def _launch_args(cfg: Config, shapes, strides, window: int, scale: float, programs: int | None):
    """``(grid, scalar keyword args, constexprs)`` for ``_attn_fwd`` on ``q: [B, S, H, D]``."""
    (B, S, H, D), (sq, sk, sv, so) = shapes, strides
    for name, st in zip("qkvo", (sq, sk, sv, so), strict=True):
        if st[3] != 1:
            raise ValueError(f"{name} must have a contiguous head dim (stride 1), got strides {st}")
    if D % 16 or D < 16:
        raise ValueError(f"head dim D must be a multiple of 16, got {D}")
    n_rb = triton.cdiv(S, cfg.block_m)
    tiles = n_rb * B * H
    n_prog = min(tiles, programs) if cfg.persistent else tiles
    scalars = dict(
        sqb=sq[0], sqs=sq[1], sqh=sq[2], skb=sk[0], sks=sk[1], skh=sk[2], svb=sv[0], svs=sv[1], svh=sv[2],
        sob=so[0], sos=so[1], soh=so[2], BH=B * H, H=H, S=S, n_row_blocks=n_rb, n_programs=n_prog,
        qk_scale=float(scale) * LOG2E,
    )
    cx = dict(
        WINDOW=window, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, HEAD_D=D,
        EVEN=S % cfg.block_m == 0 and S % cfg.block_n == 0, LOOP=LOOPS[cfg.loop], STAGES=cfg.stages,
        USE_TMA=cfg.tma, WARP_SPEC=cfg.ws, PERSISTENT=cfg.persistent, LAZY=cfg.lazy,
    )
    return (n_prog,), scalars, cx


def run_interpreted(cfg: Config, q, k, v, window: int, scale: float, programs: int = 3):
    """``(out, lse)`` numpy, through Triton's interpreter (``jax_bindings._triton.launch.run_numpy``)."""
    from jax_bindings._triton.launch import run_numpy
    from jax_bindings._triton.ops import Call

    B, S, H, D = q.shape
    st = tuple(s // q.itemsize for s in q.strides)
    grid, scalars, cx = _launch_args(cfg, q.shape, (st, st, st, st), window, scale, programs)
    out = (((B, S, H, D), q.dtype.name), ((B, H, S), "float32"))
    # run_numpy launches kernel[grid](*data, *meta, *outputs, **constexprs): the scalar
    # arguments (strides, sizes, scale) travel by keyword beside the constexprs
    call = Call(_attn_fwd, grid, (), out, {**scalars, **cx}, cfg.warps, cfg.stages, None)
    return run_numpy(call, q, k, v)


def run_torch(cfg: Config, q, k, v, o, lse, window: int, scale: float, programs: int):
    """Launches into preallocated ``o: [B, S, H, D]``, ``lse: [B, H, S]`` float32 (torch CUDA);
    returns Triton's compiled kernel."""
    grid, scalars, cx = _launch_args(
        cfg, tuple(q.shape), (q.stride(), k.stride(), v.stride(), o.stride()), window, scale, programs
    )
    return _attn_fwd[grid](q, k, v, o, lse, **scalars, **cx, num_warps=cfg.warps, num_stages=cfg.stages)


def compiled_info(kernel, cfg: Config) -> dict:
    """What the compiler made of a build: warps (more than asked: warp-specialised), shared
    memory bytes, registers per thread, spills."""
    info = {}
    md = getattr(kernel, "metadata", None)
    for name in ("num_warps", "num_stages", "shared"):
        if hasattr(md, name):
            info[name] = getattr(md, name)
    for name in ("n_regs", "n_spills"):
        try:
            info[name] = int(getattr(kernel, name))
        except Exception:  # not loaded yet, or another Triton version's attribute names
            pass
    if "num_warps" in info:
        info["warp_specialized"] = info["num_warps"] > cfg.warps
    return info


# =============================================================================================
# References
# =============================================================================================


def reference_numpy(q, k, v, window: int, scale: float):
    """Float64 ``(out [B, S, H, D], lse [B, H, S])`` of masked softmax attention."""
    qf, kf, vf = (np.asarray(x, np.float64) for x in (q, k, v))
    S = q.shape[1]
    s = np.einsum("bqhd,bkhd->bhqk", qf, kf) * scale
    r, c = np.arange(S)[:, None], np.arange(S)[None, :]
    keep = np.ones((S, S), bool) if window == 0 else (c <= r) & (c > r - window)
    s = np.where(keep, s, -np.inf)
    m = s.max(-1, keepdims=True)
    p = np.exp(s - m)
    lsum = p.sum(-1, keepdims=True)
    out = np.einsum("bhqk,bkhd->bqhd", p / lsum, vf)
    return out, (m + np.log(lsum))[..., 0]


def reference_torch(q, k, v, window: int, scale: float):
    """Float32 ``(out [B, S, H, D], lse [B, H, S])`` on q's device."""
    import torch

    qf, kf, vf = (x.float().transpose(1, 2) for x in (q, k, v))
    S = q.shape[1]
    s = (qf @ kf.transpose(-1, -2)) * scale
    if window:
        r = torch.arange(S, device=q.device)[:, None]
        c = torch.arange(S, device=q.device)[None, :]
        s = s.masked_fill(~((c <= r) & (c > r - window)), float("-inf"))
    lse = torch.logsumexp(s, -1)
    out = torch.softmax(s, -1) @ vf
    return out.transpose(1, 2), lse


def _test_inputs(rng: np.random.Generator, shape, dtype):
    """q, k, v ~ N(0, 1), with a few keys x4 late in the sequence: row maxima jump mid-row,
    so the lazy variant's rescale branch runs, and the others' max updates are exercised."""
    q, k, v = (rng.standard_normal(shape).astype(np.float32) for _ in range(3))
    S = shape[1]
    k[:, rng.choice(np.arange(S // 2, S), size=max(1, S // 32), replace=False)] *= 4.0
    return tuple(x.astype(dtype) for x in (q, k, v))


def _first_line(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip()
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return (lines[0] if lines else type(e).__name__)[:300]


# =============================================================================================
# CPU check (interpreter)
# =============================================================================================


def check_interpreted(args) -> dict:
    """Numerics of every interpreter-supported config at tiny shapes; fp16 (the interpreter's
    ``tl.dot`` mishandles bf16). Returns the report; its ``failed`` counts mismatches."""
    if type(_attn_fwd).__name__ != "InterpretedFunction":
        raise SystemExit("--interpret: the kernels were compiled for a GPU (set TRITON_INTERPRET=1 at start)")
    rng = np.random.default_rng(args.seed)
    B, H, D = 1, 2, 64
    lengths = args.check_lengths  # default 256 (tiles divide it: EVEN) and 200 (partial tiles)
    windows = (0, args.check_window)
    report = {"mode": "check-interpret", "shapes": [], "checks": [], "skipped": [], "failed": 0}
    for variant, cfg in INTERPRET_CONFIGS:
        if args.variants and variant not in args.variants:
            continue
        for S in lengths:
            q, k, v = _test_inputs(rng, (B, S, H, D), np.float16)
            scale = D**-0.5
            for window in windows:
                rec = {"variant": variant, "config": cfg.name, "S": S, "mask": _mask_name(window)}
                t0 = time.perf_counter()
                try:
                    out, lse = run_interpreted(cfg, q, k, v, window, scale)
                except Exception as e:  # an interpreter gap (not a numerics failure): skip, say why
                    rec["skipped"] = _first_line(e)
                    report["skipped"].append(rec)
                    _log(f"SKIP {variant} [{cfg.name}] S={S} {rec['mask']}: {rec['skipped']}")
                    continue
                ro, rl = reference_numpy(q, k, v, window, scale)
                rec["max_abs_err_out"] = float(np.abs(out.astype(np.float64) - ro).max())
                rec["max_abs_err_lse"] = float(np.abs(lse.astype(np.float64) - rl).max())
                rec["ok"] = bool(rec["max_abs_err_out"] < TOLERANCE and rec["max_abs_err_lse"] < TOLERANCE)
                rec["seconds"] = round(time.perf_counter() - t0, 2)
                report["failed"] += not rec["ok"]
                report["checks"].append(rec)
                _log(
                    f"{'ok  ' if rec['ok'] else 'FAIL'} {variant} [{cfg.name}] S={S} {rec['mask']}: "
                    f"out {rec['max_abs_err_out']:.2e} lse {rec['max_abs_err_lse']:.2e} ({rec['seconds']} s)"
                )
    if args.variants:
        unknown = set(args.variants) - {v for v, _ in INTERPRET_CONFIGS}
        if unknown:
            raise SystemExit(f"--variants: unknown {sorted(unknown)}; known: {list(VARIANT_ORDER)}")
    return report


# =============================================================================================
# GPU benchmark
# =============================================================================================


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _versions() -> dict:
    out = {"python": platform.python_version()}
    for dist in ("triton", "torch", "jax", "jaxlib", "flash-attn3-jax", "jax-triton", "numpy"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    return out


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


class Fatal(Exception):
    """The CUDA context is broken (a kernel faulted): nothing after this can be trusted."""


_FATAL = ("illegal memory access", "unspecified launch failure", "illegal instruction", "misaligned address")


def _raise_if_fatal(e: BaseException) -> None:
    if any(s in str(e).lower() for s in _FATAL):
        raise Fatal(_first_line(e)) from e


def time_cuda(fn, torch) -> dict:
    """Median ms per call of ``fn`` over SAMPLES CUDA-event samples of >= MIN_SAMPLE_MS each."""
    fn()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(3):
        fn()
    e1.record()
    e1.synchronize()
    per = max(e0.elapsed_time(e1) / 3, 1e-3)
    n = max(10, math.ceil(MIN_SAMPLE_MS / per))
    samples = []
    for _ in range(SAMPLES):
        e0.record()
        for _ in range(n):
            fn()
        e1.record()
        e1.synchronize()
        samples.append(e0.elapsed_time(e1) / n)
    return {
        "ms": statistics.median(samples),
        "samples_ms": samples,
        "calls_per_sample": n,
        "timing": "cuda_events",
    }


def time_jax(launch, sync) -> dict:
    """Median ms per call of a chained JAX program (CHAIN calls per launch), host clock, one wait."""
    launch()
    sync()
    t0 = time.perf_counter()
    launch()
    sync()
    per_launch = max((time.perf_counter() - t0) * 1e3, 1e-3)
    n = max(1, math.ceil(MIN_SAMPLE_MS / per_launch))
    samples = []
    for _ in range(SAMPLES):
        t0 = time.perf_counter()
        for _ in range(n):
            launch()
        sync()
        samples.append((time.perf_counter() - t0) * 1e3 / (n * CHAIN))
    return {
        "ms": statistics.median(samples),
        "samples_ms": samples,
        "calls_per_sample": n * CHAIN,
        "timing": f"host clock, {CHAIN} calls chained in one jitted program",
    }


class Bench:
    """The GPU run: inputs, checks, rows, JSON after every row."""

    def __init__(self, args):
        import torch

        self.torch = torch
        self.args = args
        self.t_start = time.perf_counter()
        props = torch.cuda.get_device_properties(0)
        self.sms = props.multi_processor_count
        dev = torch.cuda.get_device_name()
        default_out = os.path.join(ROOT, "benchmarks", "results", f"spike-hopper-{_slug(dev)}.json")
        self.out_path = args.out or default_out
        # device-side tensor descriptors need global scratch memory at launch
        triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
        self.checks: dict[tuple[Config, int], dict] = {}
        self.doc = {
            "schema": SCHEMA,
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "device": dev,
            "sm_count": self.sms,
            "compute_capability": list(torch.cuda.get_device_capability()),
            "versions": {**_versions(), "cuda (torch)": torch.version.cuda},
            "settings": dict(
                B=args.batch,
                H=args.heads,
                D=args.head_dim,
                lengths=args.lengths,
                windows=args.windows,
                dtype="bfloat16",
                quick=args.quick,
                seed=args.seed,
                min_sample_ms=MIN_SAMPLE_MS,
                samples=SAMPLES,
                budget_s=args.budget_s,
            ),
            "flop_formula": FLOP_FORMULA,
            "timing": (
                "Triton kernels: CUDA events around n back-to-back launches (sample >= 20 ms), median of 5; "
                "JAX peers: host clock around n launches of one jitted program chaining 10 calls (out -> "
                "next q) and one wait, sample >= 20 ms, median of 5"
            ),
            "check": (
                f"before timing, each kernel build runs at B=1, H=2, S={args.check_len}, D={args.head_dim} "
                f"against a float32 torch reference: max abs error of out and lse < {TOLERANCE}"
            ),
            "ratio": "x PEER = PEER ms / variant ms (> 1: the variant is faster)",
            "checks": [],
            "rows": [],
            "skipped": [],
            "fatal": None,
        }
        self.write()

    # -- bookkeeping --------------------------------------------------------------------------

    def write(self) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(self.out_path)), exist_ok=True)
        tmp = self.out_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.doc, f, indent=1)
        os.replace(tmp, self.out_path)

    def over_budget(self) -> bool:
        return time.perf_counter() - self.t_start > self.args.budget_s

    def add_row(self, row: dict) -> None:
        row["t_s"] = round(time.perf_counter() - self.t_start, 1)
        self.doc["rows"].append(row)
        self.write()
        if "tflops" in row:
            _log(f"[{row['t_s']:6.1f}s] {row['mask']:>20} S={row['S']:<6} {row['name']:<11} "
                 f"{row.get('config', ''):<34} {row['tflops']:7.1f} TFLOP/s  {row['ms']:.4f} ms")
        else:
            _log(f"[{row['t_s']:6.1f}s] {row['mask']:>20} S={row['S']:<6} {row['name']:<11} "
                 f"{row.get('config', ''):<34} {row.get('error', row.get('skipped', ''))}")

    def inputs(self, S: int, seed: int):
        torch = self.torch
        g = torch.Generator(device="cuda").manual_seed(seed)
        shape = (self.args.batch, S, self.args.heads, self.args.head_dim)
        return tuple(torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))

    # -- our kernels --------------------------------------------------------------------------

    def check(self, cfg: Config, window: int) -> dict:
        """Compile + numerics of one build (cached per (config, window))."""
        key = (cfg, window)
        if key in self.checks:
            return self.checks[key]
        torch = self.torch
        a = self.args
        rec = {"config": cfg.name, "mask": _mask_name(window), "S": a.check_len}
        t0 = time.perf_counter()
        try:
            g = torch.Generator(device="cuda").manual_seed(a.seed + 1)
            shape = (1, a.check_len, 2, a.head_dim)
            q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
            k[:, a.check_len // 2 :: 41] *= 4.0  # row maxima that jump mid-row (see _test_inputs)
            o = torch.empty_like(q)
            lse = torch.empty((1, 2, a.check_len), device="cuda", dtype=torch.float32)
            o.fill_(float("nan"))
            # 7 programs: a persistent build walks several tiles each
            kernel = run_torch(cfg, q, k, v, o, lse, window, a.head_dim**-0.5, programs=7)
            torch.cuda.synchronize()
            rec["compiled"] = compiled_info(kernel, cfg)
            ro, rl = reference_torch(q, k, v, window, a.head_dim**-0.5)
            rec["max_abs_err_out"] = float((o.float() - ro).abs().max())
            rec["max_abs_err_lse"] = float((lse - rl).abs().max())
            rec["ok"] = bool(rec["max_abs_err_out"] < TOLERANCE and rec["max_abs_err_lse"] < TOLERANCE)
            if not rec["ok"]:
                errs = f"out {rec['max_abs_err_out']:.3g}, lse {rec['max_abs_err_lse']:.3g}"
                rec["error"] = f"check failed: max abs err {errs} (tolerance {TOLERANCE})"
        except Exception as e:
            _raise_if_fatal(e)
            rec["ok"] = False
            rec["error"] = _first_line(e)
            rec["traceback_tail"] = traceback.format_exc()[-1500:]
        rec["compile_and_check_s"] = round(time.perf_counter() - t0, 2)
        self.checks[key] = rec
        self.doc["checks"].append(rec)
        return rec

    def kernel_row(self, variant: str, cfg: Config, window: int, S: int, q, k, v, state: dict) -> dict:
        torch = self.torch
        a = self.args
        row = {"kind": "triton", "name": variant, "config": cfg.name, "cfg": dataclasses.asdict(cfg)}
        row.update(mask=_mask_name(window), S=S)
        chk = self.check(cfg, window)
        row["compiled"] = chk.get("compiled", {})
        if not chk["ok"]:
            row["error"] = chk["error"]
            return row
        try:
            o = torch.empty_like(q)
            lse = torch.empty((a.batch, a.heads, S), device="cuda", dtype=torch.float32)
            scale = a.head_dim**-0.5
            fn = lambda: run_torch(cfg, q, k, v, o, lse, window, scale, self.sms)
            row.update(time_cuda(fn, torch))
            fn()
            torch.cuda.synchronize()
            if state.get("ref_out") is None:
                state["ref_out"], state["ref_name"] = o.clone(), f"{variant} [{cfg.name}]"
            else:  # same inputs, same math: every variant agrees with the first at full size
                row["max_abs_diff_vs_first"] = float((o.float() - state["ref_out"].float()).abs().max())
                row["first"] = state["ref_name"]
        except Exception as e:
            _raise_if_fatal(e)
            row["error"] = _first_line(e)
            return row
        row["tflops"] = useful_flops(a.batch, a.heads, S, a.head_dim, window) / row["ms"] * 1e-9
        return row

    # -- peers ----------------------------------------------------------------------------------

    def peer_row(self, name: str, window: int, S: int, q, k, v, state: dict) -> dict:
        torch = self.torch
        a = self.args
        row = {"kind": "peer", "name": name, "mask": _mask_name(window), "S": S}
        try:
            import jax
            import jax.numpy as jnp

            from splat.tools.timing import compile_timed

            fn = self._peer_fn(name, window)
            jq, jk, jv = (_to_jax(x, torch, jax, jnp) for x in (q, k, v))
            compiled, launch, sync = compile_timed(fn, (jq, jk, jv), CHAIN, {0: 0})
            out = jax.block_until_ready(compiled(jq, jk, jv))
            out = out[0] if isinstance(out, (tuple, list)) else out
            if state.get("ref_out") is not None:
                diff = (_to_torch(out, torch, jnp).float() - state["ref_out"].float()).abs().max()
                row["max_abs_diff_vs_first"] = float(diff)
                row["first"] = state["ref_name"]
            row.update(time_jax(launch, sync))
        except Exception as e:
            _raise_if_fatal(e)
            row["error"] = _first_line(e)
            return row
        row["tflops"] = useful_flops(a.batch, a.heads, S, a.head_dim, window) / row["ms"] * 1e-9
        return row

    def _peer_fn(self, name: str, window: int):
        import jax

        scale = self.args.head_dim**-0.5
        if name == "fa3":
            fa3 = importlib.import_module("flash_attn3_jax")
            kw = {} if window == 0 else {"is_causal": True, "window_size": (window - 1, 0)}
            return lambda q, k, v: fa3.flash_mha(q, k, v, softmax_scale=scale, **kw)
        if name == "cudnn":
            kw = {} if window == 0 else {"is_causal": True, "local_window_size": (window - 1, 0)}
            return lambda q, k, v: jax.nn.dot_product_attention(
                q, k, v, scale=scale, implementation="cudnn", **kw
            )
        if name == "splat":
            import splat
            from splat import masks

            mask = None if window == 0 else masks.sliding_window(window - 1, 0)
            return lambda q, k, v: splat.attention(q, k, v, mask=mask, scale=scale, backend="triton")
        raise ValueError(f"unknown peer {name!r}")

    # -- the run ----------------------------------------------------------------------------------

    def configs(self, variant: str, window: int, S: int) -> list[Config]:
        if variant in VARIANTS:
            cfgs = VARIANTS[variant]
            return cfgs[:1] if self.args.quick else list(cfgs)
        # derived: the fastest measured config at this (mask, S) plus the variant's flags
        here = (_mask_name(window), S)
        rows = self.doc["rows"]
        done = [r for r in rows if r["kind"] == "triton" and "tflops" in r and (r["mask"], r["S"]) == here]
        if not done:
            return []
        best = Config(**max(done, key=lambda r: r["tflops"])["cfg"])
        out = [replace(best, **DERIVED[variant])]
        plain = [r for r in done if not r["cfg"]["ws"]]
        if variant == "lazy" and best.ws and plain:
            # the rescale branch undoes warp specialisation (Triton 3.9: 4 warps, spills), so
            # lazy is also measured on the fastest build without it, to isolate its own effect
            out.append(replace(Config(**max(plain, key=lambda r: r["tflops"])["cfg"]), lazy=True))
        return out

    def run(self) -> None:
        a = self.args
        for S in a.lengths:
            q, k, v = self.inputs(S, a.seed + S)
            for window in a.windows:
                state: dict = {}
                mask = _mask_name(window)
                for variant in [x for x in VARIANT_ORDER if x in a.variants]:
                    cfgs = self.configs(variant, window, S)
                    if not cfgs:
                        self.add_row({"kind": "triton", "name": variant, "mask": mask, "S": S,
                                      "skipped": "no measured config to derive it from"})
                    for cfg in cfgs:
                        if self.over_budget():
                            self.doc["skipped"].append(f"{variant} [{cfg.name}] {mask} S={S}: time budget")
                            continue
                        row = self.kernel_row(variant, cfg, window, S, q, k, v, state)
                        if variant in DERIVED:
                            row["derived_from"] = replace(cfg, **dict.fromkeys(DERIVED[variant], False)).name
                        self.add_row(row)
                    if variant == "base":  # peers once a reference output exists
                        for peer in a.peers:
                            if self.over_budget():
                                self.doc["skipped"].append(f"peer {peer} {mask} S={S}: time budget")
                                continue
                            self.add_row(self.peer_row(peer, window, S, q, k, v, state))
                state.clear()
            del q, k, v
            self.torch.cuda.empty_cache()
        self.doc["table"] = summary(self.doc["rows"], a.peers)
        self.write()


def _to_jax(t, torch, jax, jnp):
    """A torch CUDA tensor as a JAX array (DLPack; host copy if that fails)."""
    torch.cuda.synchronize()
    try:
        return jax.dlpack.from_dlpack(t)
    except Exception:
        return jnp.asarray(t.float().cpu().numpy(), dtype=jnp.bfloat16)


def _to_torch(x, torch, jnp):
    try:
        return torch.from_dlpack(x)
    except Exception:
        return torch.from_numpy(np.asarray(x.astype(jnp.float32))).cuda()


def summary(rows: list[dict], peers) -> list[dict]:
    """Per (mask, S): the fastest config of each variant, with ratios to each peer."""
    table = []
    keys = sorted({(r["mask"], r["S"]) for r in rows}, key=lambda x: (x[0] != "dense", x[0], x[1]))
    for mask, S in keys:
        here = [r for r in rows if (r["mask"], r["S"]) == (mask, S) and "tflops" in r]
        peer_ms = {r["name"]: r["ms"] for r in here if r["kind"] == "peer"}
        for variant in VARIANT_ORDER:
            mine = [r for r in here if r["kind"] == "triton" and r["name"] == variant]
            if not mine:
                continue
            best = min(mine, key=lambda r: r["ms"])
            config = best["config"]
            if best.get("compiled", {}).get("warp_specialized"):
                config += f" ({best['compiled']['num_warps']} warps)"
            rec = dict(mask=mask, S=S, variant=variant, config=config, tflops=best["tflops"], ms=best["ms"])
            rec["max_abs_diff_vs_first"] = best.get("max_abs_diff_vs_first")
            for p in peers:
                rec[f"x_{p}"] = peer_ms[p] / best["ms"] if p in peer_ms else None
            table.append(rec)
        for p in peers:
            pr = [r for r in here if r["kind"] == "peer" and r["name"] == p]
            if pr:
                rec = dict(mask=mask, S=S, variant=f"peer:{p}", config="")
                rec.update(tflops=pr[0]["tflops"], ms=pr[0]["ms"])
                rec["max_abs_diff_vs_first"] = pr[0].get("max_abs_diff_vs_first")
                table.append(rec)
    return table


def format_table(table: list[dict], peers) -> str:
    """The summary as text: one line per (mask, S, variant or peer)."""
    head = f"{'mask':<20} {'S':>6} {'variant':<12} {'best config':<46} {'TFLOP/s':>8}"
    head += "".join(f" {'x ' + p:>8}" for p in peers) + f" {'max|diff|':>9}"
    lines = [head, "-" * len(head)]
    for r in table:
        line = f"{r['mask']:<20} {r['S']:>6} {r['variant']:<12} {r['config']:<46} {r['tflops']:>8.1f}"
        for p in peers:
            x = r.get(f"x_{p}")
            line += f" {'' if x is None else format(x, '.2f'):>8}"
        d = r.get("max_abs_diff_vs_first")
        lines.append(line + f" {'' if d is None else format(d, '.1e'):>9}")
    lines.append("x PEER = PEER ms / variant ms (> 1: the variant is faster); " + FLOP_FORMULA)
    lines.append(
        "max|diff|: max |out - out of the first config timed at that (mask, S)|; two correct bf16 "
        "kernels differ by up to an output ulp (1.6e-2 where |out| ~ 3: the window's first rows)"
    )
    return "\n".join(lines)


# =============================================================================================
# main
# =============================================================================================


def _csv(kind):
    return lambda s: [kind(x) for x in s.split(",") if x]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="S=8192 only and the first config of each variant")
    p.add_argument("--check-only", action="store_true", help="numerics checks only, no timing")
    p.add_argument("--interpret", action="store_true", help="CPU: Triton's interpreter (with --check-only)")
    p.add_argument("--out", default=None, help="JSON path (default results/spike-hopper-<device>.json)")
    p.add_argument("--lengths", type=_csv(int), default=None, help="sequence lengths (default 8192,16384)")
    p.add_argument("--windows", type=_csv(int), default=[0, 1024], help="0: dense; W: causal window, W keys")
    p.add_argument("--variants", type=_csv(str), default=None, help=f"subset of {','.join(VARIANT_ORDER)}")
    p.add_argument("--peers", type=_csv(str), default=["fa3", "cudnn", "splat"], help="of fa3,cudnn,splat")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--check-len", type=int, default=1664, help="S of the GPU numerics check (13 x 128)")
    p.add_argument("--check-window", type=int, default=96, help="causal window of the interpreter check")
    p.add_argument("--check-lengths", type=_csv(int), default=[256, 200], help="S of the interpreter check")
    p.add_argument("--budget-s", type=float, default=330.0, help="start no new row after this many seconds")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if a.lengths is None:
        a.lengths = [8192] if a.quick else [8192, 16384]
    for name in ("batch", "heads", "head_dim", "check_len", "check_window"):
        if getattr(a, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    if any(n < 1 for n in a.check_lengths):
        raise SystemExit(f"--check-lengths must be >= 1, got {a.check_lengths}")
    if any(w < 0 for w in a.windows):
        raise SystemExit(f"--windows must be >= 0 (0 = dense), got {a.windows}")
    bad = set(a.variants or ()) - set(VARIANT_ORDER)
    if bad:
        raise SystemExit(f"--variants: unknown {sorted(bad)}; known: {', '.join(VARIANT_ORDER)}")
    bad = set(a.peers) - {"fa3", "cudnn", "splat"}
    if bad:
        raise SystemExit(f"--peers: unknown {sorted(bad)}; known: fa3, cudnn, splat")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.interpret:
        if not a.check_only:
            raise SystemExit("--interpret runs only with --check-only (the interpreter times nothing useful)")
        report = check_interpreted(a)
        report.update(date=datetime.datetime.now().isoformat(timespec="seconds"), versions=_versions())
        if a.out:
            os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
            with open(a.out, "w") as f:
                json.dump(report, f, indent=1)
        n = len(report["checks"])
        print(f"interpreter check: {n - report['failed']}/{n} ok, {len(report['skipped'])} skipped")
        for s in report["skipped"]:
            print(f"  skipped {s['variant']} [{s['config']}] S={s['S']} {s['mask']}: {s['skipped']}")
        return 1 if report["failed"] or not n else 0
    a.variants = a.variants or list(VARIANT_ORDER)
    try:
        import torch
    except ImportError:
        raise SystemExit("timing and the GPU check need torch; on a CPU: --check-only --interpret") from None
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device for torch; on a CPU run --check-only --interpret")
    bench = Bench(a)
    if a.check_only:
        cfgs = [(v, c) for v in VARIANT_ORDER if v in a.variants for c in VARIANTS.get(v, [])]
        cfgs += [(v, replace(VARIANTS["base"][0], **DERIVED[v])) for v in DERIVED if v in a.variants]
        failed = 0
        for v, cfg in cfgs:
            for window in a.windows:
                rec = bench.check(cfg, window)
                failed += not rec["ok"]
                errs = rec.get("error") or "out {:.2e} lse {:.2e}".format(
                    rec["max_abs_err_out"], rec["max_abs_err_lse"]
                )
                _log(f"{'ok  ' if rec['ok'] else 'FAIL'} {v} [{cfg.name}] {rec['mask']}: {errs}")
        bench.write()
        print(f"GPU check: {len(bench.checks) - failed}/{len(bench.checks)} ok -> {bench.out_path}")
        return 1 if failed else 0
    try:
        bench.run()
    except Fatal as e:
        bench.doc["fatal"] = str(e)
        bench.doc["table"] = summary(bench.doc["rows"], a.peers)
        bench.write()
        _log(f"FATAL (CUDA context broken, run stopped): {e}")
    print(f"\n{bench.doc['device']}: B={a.batch} H={a.heads} D={a.head_dim} bf16 forward -> {bench.out_path}")
    print(format_table(bench.doc.get("table", []), a.peers))
    return 0


if __name__ == "__main__":
    sys.exit(main())
