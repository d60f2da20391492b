"""Tile candidates and a cost model for the Triton kernels: what ``splat tune`` ranks before timing.

The tuner (``splat.tools.tune``) follows the LO-SpMM idea: enumerate tile configs, drop those the GPU
cannot run well (shared memory, registers), rank the rest with a cheap analytic model and time only
the best few. The model need not predict milliseconds, only the order; the tuner measures how well it
ranks (``rank_error``: Spearman 0.12-0.51 on H100 forwards, it orders tile shapes but not warps or
stages, so the heuristic default is always timed too).

Model, per kernel op over a layout (for ``bwd_dkdv`` the transposed one):

* work: the ``block_m x block_n`` tiles the walk visits (``acsr.tile_cover``: mask entries over the
  (row, column) pairs a walk with those tiles touches), each costing its matmul FLOPs at a rate that
  grows with the tile (bigger tiles feed the tensor cores better) and with pipelining depth;
* per program: a fixed prologue/epilogue (Q load, output store, softmax finish), in tile units;
* occupancy: programs per SM from shared memory and registers; the last wave's idle SMs are paid for.

Everything is per head and batch row; the absolute scale (``PEAK_TFLOPS``) only matters for printing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import acsr
from acsr import ACSR
from jax_bindings._triton.spec import Tiles, padded_head_dim

# Matmuls per visited tile, relative to the forward's two (QK^T, PV): dq recomputes QK^T and
# adds dP = dO V^T and dQ = dS K; dk/dv adds dV and dK as well.
OP_MATMULS = {"fwd": 2, "bwd_dq": 3, "bwd_dkdv": 4}
# fp32 tiles held in registers per tile row, in units of block_n (scores) and head_dim
# (accumulators): the forward keeps S/P and O; dq keeps S, dP and dQ; dk/dv keeps S, dP, dK, dV.
_SCORE_TILES = {"fwd": 1.5, "bwd_dq": 2.5, "bwd_dkdv": 2.5}
_ACC_TILES = {"fwd": 1, "bwd_dq": 1, "bwd_dkdv": 2}

SMEM_BYTES = 227 * 1024  # Hopper's per-block shared-memory limit (sm90; sm80 has 163 KiB)
REGS_PER_SM = 65536
MAX_REGS_PER_THREAD = 255
_REG_OVERHEAD = 40  # addresses, loop state, row statistics
SMS = 132  # H100 SXM; only the wave quantisation uses it
PEAK_TFLOPS = 700.0  # a dense bf16 rate the kernels can approach; scales predictions only

CANDIDATE_BLOCK_M = (64, 128)
CANDIDATE_BLOCK_N = (32, 64, 128)
CANDIDATE_WARPS = (4, 8)
CANDIDATE_STAGES = (2, 3, 4)


@dataclass(frozen=True)
class Resources:
    """What one program of a tile config needs: shared memory (bytes) and registers per thread."""

    smem: int
    regs: int

    def programs_per_sm(self, num_warps: int) -> int:
        by_smem = SMEM_BYTES // max(self.smem, 1)
        by_regs = REGS_PER_SM // (num_warps * 32 * max(self.regs, 1))
        return max(0, min(by_smem, by_regs, 8))


def resources(op: str, tiles: Tiles, head_dim: int, itemsize: int = 2) -> Resources:
    """Shared memory and registers per thread of one program of ``op`` with ``tiles``."""
    bm, bn, w, st, _ = tiles
    d = padded_head_dim(head_dim)
    # the staged tiles of every pipeline stage (K and V; dk/dv: Q and dO), plus the resident ones (the
    # forward's Q; dq: Q and dO; dk/dv: K and V). dq's two resident tiles: at D = 256 its 128x64x8x2
    # and 64x64x4x3 configs asked for 256 KiB and failed to launch
    resident = 2 if op in ("bwd_dq", "bwd_dkdv") else 1
    smem = st * 2 * bn * d * itemsize + resident * bm * d * itemsize
    fp32 = _SCORE_TILES[op] * bm * bn + _ACC_TILES[op] * bm * d
    regs = math.ceil(fp32 / (w * 32)) + _REG_OVERHEAD
    return Resources(int(smem), int(regs))


def candidates(op: str, head_dim: int, dtype: str = "bfloat16") -> list[Tiles]:
    """Tile configs worth timing for ``op``: the grid above minus what spills or does not fit.

    Pruned: shared memory over the per-block limit, more than 255 registers per thread
    (spills), fewer than one program per SM, and 8 warps on 64-row tiles of 32 columns (too
    little work per warp to feed two warp groups). float32 keeps to block_n <= 64 (exact fp32
    dots need far more registers).
    """
    if op not in OP_MATMULS:
        raise ValueError(f"op must be one of {tuple(OP_MATMULS)}, got {op!r}")
    itemsize = 4 if dtype == "float32" else 2
    out = []
    for bm in CANDIDATE_BLOCK_M:
        for bn in CANDIDATE_BLOCK_N:
            if dtype == "float32" and bn > 64:
                continue
            for w in CANDIDATE_WARPS:
                if w == 8 and bm == 64 and bn == 32:
                    continue
                for st in CANDIDATE_STAGES:
                    t = Tiles(bm, bn, w, st)
                    r = resources(op, t, head_dim, itemsize)
                    if r.smem > SMEM_BYTES or r.regs > MAX_REGS_PER_THREAD or r.programs_per_sm(w) < 1:
                        continue
                    out.append(t)
    return out


def _tile_rate(tiles: Tiles) -> float:
    """Relative tensor-core rate of a tile shape (1.0 = the best shapes), from H200 sweeps' trends."""
    bm, bn, w, st, _ = tiles
    rate = {64: 0.82, 128: 1.0}.get(bm, 0.7) * {32: 0.8, 64: 0.95, 128: 1.0}.get(bn, 0.7)
    rate *= {1: 0.75, 2: 0.93, 3: 1.0, 4: 0.98}.get(st, 0.95)
    if bm == 128 and w == 4:  # one warp group on 128 rows: half the issue slots per row
        rate *= 0.8
    return rate


def predict_ms(op: str, layout: ACSR, tiles: Tiles, *, batch: int, heads: int, head_dim: int) -> float:
    """Predicted milliseconds of ``op`` over ``layout`` (the transposed layout for ``bwd_dkdv``)."""
    bm, bn, w, _, _ = tiles
    cover = acsr.tile_cover(layout, bm, bn)
    walked = layout.nnz / cover if cover > 0 else 0.0
    tile_flops = 2.0 * OP_MATMULS[op] * bm * bn * head_dim
    n_tiles = walked / (bm * bn)
    row_blocks = -(-layout.q_len // bm)
    programs = batch * heads * row_blocks
    t_tile = tile_flops / (PEAK_TFLOPS * 1e12 / SMS * _tile_rate(tiles))  # seconds on one SM
    t_program = 1.5 * (2.0 * OP_MATMULS[op] * bm * 64 * head_dim) / (PEAK_TFLOPS * 1e12 / SMS)
    work = batch * heads * n_tiles * t_tile + programs * t_program  # SM-seconds
    per_sm = resources(op, tiles, head_dim).programs_per_sm(w)
    slots = SMS * max(per_sm, 1)
    waves = programs / slots
    quantised = math.ceil(waves) / waves if waves > 0 else 1.0
    # two or more resident programs hide each other's latency; one alone does not
    latency = 1.0 if per_sm >= 2 else 1.15
    return 1e3 * work / SMS * min(quantised, 2.0) * latency


def rank(op: str, layout: ACSR, cands: list[Tiles], *, batch: int, heads: int, head_dim: int) -> list:
    """``[(predicted_ms, tiles)]`` fastest first."""
    scored = [(predict_ms(op, layout, t, batch=batch, heads=heads, head_dim=head_dim), t) for t in cands]
    return sorted(scored, key=lambda x: x[0])


def rank_error(predicted: dict, measured: dict) -> dict:
    """How well predictions order configs: Spearman's rho, and where the measured best ranked.

    Both arguments map a config key to milliseconds (only keys in both count).
    """
    keys = [k for k in measured if k in predicted]
    n = len(keys)
    if n < 2:
        return {"n": n, "spearman": None, "best_measured_predicted_rank": 1 if n else None}
    pr = {k: i for i, k in enumerate(sorted(keys, key=lambda k: predicted[k]))}
    mr = {k: i for i, k in enumerate(sorted(keys, key=lambda k: measured[k]))}
    d2 = sum((pr[k] - mr[k]) ** 2 for k in keys)
    best = min(keys, key=lambda k: measured[k])
    return {"n": n, "spearman": 1 - 6 * d2 / (n * (n * n - 1)), "best_measured_predicted_rank": pr[best] + 1}
