"""Pure-JAX backend: ACSR attention and the unfused sparse ops, on any platform.

This is the CPU (and any non-CUDA) backend, and the sparse twin of the dense
float64 test oracle. It follows the backend contract in
:mod:`jax_bindings._dispatch`.

Glossary (shapes; ``G = H // Hk`` query heads per KV head):

* ``q``: ``[B, Sq, H, D]``; ``k``, ``v``: ``[B, Skv, Hk, D]``.
* ``BQ``: rows per row block; ``nb``: row blocks; ``BK``: keys per chunk.
* a *piece*: one segment (or the residual) planned for one kernel shape. Each
  piece is an attention over a disjoint subset of the mask's columns; it yields
  a normalised partial output and its logsumexp, which are merged exactly.

Piece kinds (chosen per segment by a cost model, see :func:`_plan`):

* **window**: the rows of a row block hold columns inside one bounded key
  range ``[start_b, start_b + span)``; keys come from ``lax.dynamic_slice``
  (no gather), scored as a dense ``BQ x BK`` tile and masked from each row's
  ``base/stride/count``. Long spans (causal, full) are chunked with an
  online softmax and a per-block trip count, so skipped chunks cost nothing.
* **gather**: each row gathers its own ``count`` keys ``base + stride * t``
  (strided/dilated segments whose rows do not share a narrow key range).
* **residual**: the block-sparse remainder; each row block gathers its key
  blocks and masks them with the stored bitmap.

Queries at run-time positions (a runtime mask with ``q_pos``) run on
:mod:`jax_bindings._pure_rows` instead; so does ``attention_paged``, after
gathering each batch row's pages into a contiguous cache.

Memory: every piece works a row block at a time (``lax.map`` / ``lax.scan``),
so temporaries are ``O(BQ * BK)`` scores per step plus ``O(S * D)`` outputs;
nothing is ``O(Sq * Skv)``. The backward pass recomputes probabilities from
the saved logsumexp and accumulates ``dK``/``dV`` in place.

Numerics: inputs are upcast to float32, everything accumulates in float32, and
results are cast back. A fully masked row has output 0, logsumexp ``-inf`` and
zero gradients; no NaN is produced on any path.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from acsr import ACSR, Segment, block_rows, key_spans
from jax_bindings import _pure_rows

_F32 = jnp.float32
_NEG_INF = float("-inf")

# Planning constants (see _plan). Spans up to _MAX_SINGLE_CHUNK keys may be one
# chunk (no inner loop); otherwise spans are walked a chunk of _KEY_CHUNKS keys
# at a time, each block only as far as its own span.
_MAX_SINGLE_CHUNK = 1024
_KEY_CHUNKS = (64, 128, 256, 512)
_CHUNK_OVERHEAD = 2048
_GATHER_MAX_SINGLE = 256
_GATHER_CHUNK = 128
# A gathered key costs about this many dense-tile score slots (gather traffic
# per row instead of one shared tile per block; measured on CPU, XLA 0.10).
_GATHER_PENALTY = 32.0
# Fixed cost of one row-block step, in score slots (loop and launch overhead).
_STEP_OVERHEAD = 4096
_BLOCK_CHOICES = (32, 64, 128, 256)
# residual: key blocks visited per chunk, aiming at this many keys
_RESIDUAL_KEYS_PER_CHUNK = 256
# unfused ops: gathered-operand budget per row block, in float32 elements
_UNFUSED_BUDGET = 1 << 21


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _round_up(a: int, b: int) -> int:
    return _cdiv(a, b) * b


# -----------------------------------------------------------------------------
# planning (numpy, cached on the layout)
# -----------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class _Window:
    """Rows of a block read keys ``[start, start + n_chunks * chunk)`` by dynamic slice.

    ``lo/hi/stride``: int32 ``[nb, BQ]`` row bounds (``hi = lo`` for empty rows),
    ``start``: int32 ``[nb]``, ``nchunk``: int32 ``[nb]`` chunks a block really
    visits (``<= n_chunks``), ``strided``: some row has stride > 1.
    """

    block_q: int
    chunk: int
    n_chunks: int
    strided: bool
    start: np.ndarray
    nchunk: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    stride: np.ndarray

    @property
    def kv_need(self) -> int:
        return int((self.start + self.nchunk * self.chunk).max(initial=0))


@dataclass(frozen=True, eq=False)
class _Gather:
    """Row ``r`` gathers keys ``base + stride * t``, ``t < count``, ``chunk`` at a time.

    ``base/stride/count``: int32 ``[nb, BQ]``; ``nchunk``: int32 ``[nb]``.
    """

    block_q: int
    chunk: int
    n_chunks: int
    base: np.ndarray
    stride: np.ndarray
    count: np.ndarray
    nchunk: np.ndarray

    @property
    def kv_need(self) -> int:
        return 0


@dataclass(frozen=True, eq=False)
class _Residual:
    """Block-sparse remainder, walked ``per_chunk`` key blocks at a time.

    ``kv_blocks``: int32 ``[nqb, n_chunks * per_chunk]`` (padding 0, masked by
    ``bits``); ``bits``: bool ``[nqb, n_chunks, block_q, per_chunk * block_kv]``;
    ``nchunk``: int32 ``[nqb]``.
    """

    block_q: int
    block_kv: int
    per_chunk: int
    n_chunks: int
    kv_blocks: np.ndarray
    bits: np.ndarray
    nchunk: np.ndarray

    @property
    def chunk(self) -> int:
        return self.per_chunk * self.block_kv

    @property
    def kv_need(self) -> int:
        return int(self.kv_blocks.max(initial=0) + 1) * self.block_kv


def _pad_rows(a: np.ndarray, n: int, fill: int) -> np.ndarray:
    return np.concatenate([a, np.full(n - a.shape[0], fill, a.dtype)])


def _window_piece(seg: Segment, q_len: int, bq: int) -> tuple[_Window, float]:
    nb = _cdiv(q_len, bq)
    n = nb * bq
    count = _pad_rows(seg.count.astype(np.int64), n, 0)
    st = _pad_rows(seg.stride.astype(np.int64), n, 1)
    lo2 = _pad_rows(seg.base.astype(np.int64), n, 0).reshape(nb, bq)
    hi2 = _pad_rows(seg.end(), n, 0).reshape(nb, bq)  # = lo for empty and padding rows
    start, span = key_spans(seg, block_rows(q_len, bq), compressed=False)  # 0, 0 for empty blocks
    width = int(span.max(initial=0))
    # one chunk covering the widest span, or a chunk size walked per block
    options = [max(8, _round_up(width, 8))] if width <= _MAX_SINGLE_CHUNK else []
    options += [c for c in _KEY_CHUNKS if c < width] or [max(8, _round_up(width, 8))]
    best = None
    for chunk in options:
        nchunk = -(-span // chunk)
        n_chunks = int(nchunk.max(initial=0)) or 1
        cost = float(nchunk.sum()) * (chunk * bq + _CHUNK_OVERHEAD) + nb * _STEP_OVERHEAD
        if best is None or cost < best[0]:
            best = (cost, chunk, n_chunks, nchunk)
    cost, chunk, n_chunks, nchunk = best
    strided = bool(((st > 1) & (count > 1)).any())
    piece = _Window(
        bq,
        chunk,
        n_chunks,
        strided,
        start.astype(np.int32),
        nchunk.astype(np.int32),
        lo2.astype(np.int32),
        hi2.astype(np.int32),
        st.reshape(nb, bq).astype(np.int32),
    )
    return piece, cost


def _gather_piece(seg: Segment, q_len: int, bq: int) -> tuple[_Gather, float]:
    nb = _cdiv(q_len, bq)
    n = nb * bq
    c2 = _pad_rows(seg.count, n, 0).reshape(nb, bq)
    width = int(c2.max(initial=0))
    if width <= _GATHER_MAX_SINGLE:
        chunk, n_chunks = max(8, _round_up(width, 8)), 1
    else:
        chunk, n_chunks = _GATHER_CHUNK, _cdiv(width, _GATHER_CHUNK)
    nchunk = -(-c2.max(axis=1) // chunk)
    cost = _GATHER_PENALTY * float(nchunk.sum()) * chunk * bq + nb * _STEP_OVERHEAD
    piece = _Gather(
        bq,
        chunk,
        n_chunks,
        _pad_rows(seg.base, n, 0).reshape(nb, bq).astype(np.int32),
        _pad_rows(seg.stride, n, 1).reshape(nb, bq).astype(np.int32),
        c2.astype(np.int32),
        nchunk.astype(np.int32),
    )
    return piece, cost


def _residual_piece(res) -> _Residual:
    nqb, mb = res.kv_blocks.shape
    per = max(1, min(mb, _RESIDUAL_KEYS_PER_CHUNK // res.block_kv))
    n_chunks = max(1, _cdiv(mb, per))
    width = n_chunks * per
    kvb = np.zeros((nqb, width), np.int32)
    kvb[:, :mb] = np.maximum(res.kv_blocks, 0)
    bits = np.zeros((nqb, width, res.block_q, res.block_kv), bool)
    bits[:, :mb] = res.bits
    # [nqb, n_chunks, per, bq, bkv] -> [nqb, n_chunks, bq, per * bkv]
    bits = bits.reshape(nqb, n_chunks, per, res.block_q, res.block_kv).transpose(0, 1, 3, 2, 4)
    bits = bits.reshape(nqb, n_chunks, res.block_q, per * res.block_kv)
    nchunk = -(-res.num_blocks.astype(np.int64) // per)
    return _Residual(res.block_q, res.block_kv, per, n_chunks, kvb, bits, nchunk.astype(np.int32))


# Tests set this to "window" or "gather" to force one piece kind for every segment.
_FORCE: str | None = None


def _plan(layout: ACSR) -> tuple:
    """The pieces of a layout: each segment as its cheapest window/gather plan, then the residual."""
    return _plan_cached(layout, _FORCE)


@functools.lru_cache(maxsize=128)
def _plan_cached(layout: ACSR, force: str | None) -> tuple:
    pieces = []
    for seg in layout.segments:
        if seg.width == 0:
            continue
        best, best_cost = None, math.inf
        for bq in _BLOCK_CHOICES:
            for kind, make in (("window", _window_piece), ("gather", _gather_piece)):
                if force not in (None, kind):
                    continue
                p, c = make(seg, layout.q_len, bq)
                if c < best_cost:
                    best, best_cost = p, c
        pieces.append(best)
    if layout.residual is not None and layout.residual.max_blocks > 0:
        pieces.append(_residual_piece(layout.residual))
    return tuple(pieces)


def _kv_pad(layout: ACSR) -> int:
    need = [p.kv_need for p in _plan(layout)]
    return max([layout.kv_len] + need)


# -----------------------------------------------------------------------------
# fused attention: per-piece forward
# -----------------------------------------------------------------------------


def _blocks(x: jax.Array, bq: int, fill=0.0) -> jax.Array:
    """``[B, S, ...] -> [nb, B, bq, ...]`` with rows padded by ``fill``."""
    s = x.shape[1]
    nb = _cdiv(s, bq)
    pad = [(0, 0)] * x.ndim
    pad[1] = (0, nb * bq - s)
    x = jnp.pad(x, pad, constant_values=fill)
    x = x.reshape(x.shape[0], nb, bq, *x.shape[2:])
    return jnp.moveaxis(x, 1, 0)


def _unblocks(x: jax.Array, s: int) -> jax.Array:
    """``[nb, B, bq, ...] -> [B, s, ...]``."""
    x = jnp.moveaxis(x, 0, 1)
    return x.reshape(x.shape[0], x.shape[1] * x.shape[2], *x.shape[3:])[:, :s]


def _row_stats_blocks(x: jax.Array, bq: int, fill) -> jax.Array:
    """``[B, Hk, G, S] -> [nb, B, Hk, G, bq]``."""
    x = jnp.moveaxis(x, -1, 1)  # [B, S, Hk, G]
    x = _blocks(x, bq, fill)  # [nb, B, bq, Hk, G]
    return jnp.moveaxis(x, 2, -1)


def _row_stats_unblocks(x: jax.Array, s: int) -> jax.Array:
    """``[nb, B, Hk, G, bq] -> [B, Hk, G, s]``."""
    x = jnp.moveaxis(x, -1, 2)  # [nb, B, bq, Hk, G]
    x = _unblocks(x, s)  # [B, s, Hk, G]
    return jnp.moveaxis(x, 1, -1)


def _chunk_keys(piece, kf, vf, blk, c):
    """Keys, values and mask of chunk ``c`` of one row block.

    Returns ``(kc, vc, mask, shared, cols)``: shared -> ``kc [B, BK, Hk, D]``
    and ``cols [BK]``, else per row ``kc [B, BQ, BK, Hk, D]`` and ``cols [BQ, BK]``;
    ``mask [BQ, BK]`` (the static layout's).
    """
    if isinstance(piece, _Window):
        start, lo, hi, st = blk
        off = start + c * piece.chunk
        kc = lax.dynamic_slice_in_dim(kf, off, piece.chunk, axis=1)
        vc = lax.dynamic_slice_in_dim(vf, off, piece.chunk, axis=1)
        cols = off + jnp.arange(piece.chunk, dtype=jnp.int32)
        mask = (cols[None, :] >= lo[:, None]) & (cols[None, :] < hi[:, None])
        if piece.strided:
            mask &= (cols[None, :] - lo[:, None]) % st[:, None] == 0
        return kc, vc, mask, True, cols
    if isinstance(piece, _Gather):
        base, st, cnt = blk
        t = c * piece.chunk + jnp.arange(piece.chunk, dtype=jnp.int32)
        mask = t[None, :] < cnt[:, None]
        cols = jnp.where(mask, base[:, None] + st[:, None] * t[None, :], 0)
        kc, vc = jnp.take(kf, cols, axis=1, mode="clip"), jnp.take(vf, cols, axis=1, mode="clip")
        return kc, vc, mask, False, cols
    kvb, bits = blk  # [n_chunks * per], [n_chunks, bq, per * bkv]
    idx = lax.dynamic_slice_in_dim(kvb, c * piece.per_chunk, piece.per_chunk)
    cols = (idx[:, None] * piece.block_kv + jnp.arange(piece.block_kv, dtype=jnp.int32)).reshape(-1)
    mask = lax.dynamic_index_in_dim(bits, c, axis=0, keepdims=False)
    kc, vc = jnp.take(kf, cols, axis=1, mode="clip"), jnp.take(vf, cols, axis=1, mode="clip")
    return kc, vc, mask, True, cols


def _runtime_keep(mask, cols, shared, rt_blk, keys):
    """The static ``mask [BQ, BK]`` AND-ed with the runtime mask: ``[B, 1, 1, BQ, BK]`` (or ``mask``).

    ``rt_blk``: ``(row_ok, ids)``: whether each of the block's rows is a real query ``[B, BQ]``
    and the rows' ids ``[B, BQ]`` (or None); None without a runtime mask. ``keys``: ``(kv_len [B],
    kv_ids [B, Skv'] or None)`` (:func:`_key_side`).
    """
    if rt_blk is None:
        return mask
    (row_ok, ids), (kv_len, kv_ids) = rt_blk, keys
    c = cols[None, None, :] if shared else cols[None]  # [1, 1|BQ, BK]
    keep = mask[None] & row_ok[:, :, None] & (c < kv_len[:, None, None])
    if ids is not None:
        kid = jnp.take(kv_ids, cols, axis=1, mode="clip")  # [B, BK] or [B, BQ, BK]
        keep &= ids[:, :, None] == (kid[:, None, :] if shared else kid)
    return keep[:, None, None]


def _scores(qb, kc, shared):
    # qb [B, BQ, Hk, G, D] -> s [B, Hk, G, BQ, BK]
    if shared:
        return jnp.einsum("bqhgd,bkhd->bhgqk", qb, kc)
    return jnp.einsum("bqhgd,bqkhd->bhgqk", qb, kc)


def _pv(p, vc, shared):
    # p [B, Hk, G, BQ, BK] -> [B, Hk, G, BQ, D]
    if shared:
        return jnp.einsum("bhgqk,bkhd->bhgqd", p, vc)
    return jnp.einsum("bhgqk,bqkhd->bhgqd", p, vc)


def _block_inputs(piece) -> tuple:
    if isinstance(piece, _Window):
        return (piece.start, piece.lo, piece.hi, piece.stride)
    if isinstance(piece, _Gather):
        return (piece.base, piece.stride, piece.count)
    return (piece.kv_blocks, piece.bits)


def _rt_blocks(rt, bq, sq):
    """The runtime mask's query side per row block: ``(row_ok [nb, B, bq], ids [nb, B, bq])``."""
    if rt is None:
        return None
    row_ok = _blocks(jnp.arange(sq)[None, :] < rt.q_len[:, None], bq, False)
    return row_ok, None if rt.q_ids is None else _blocks(rt.q_ids, bq)


def _piece_fwd(piece, qs, kf, vf, rt=None, keys=None, soft_cap=None):
    """Normalised partial output ``[B, Sq, H, D]`` and logsumexp ``[B, Hk, G, Sq]`` of one piece."""
    b, sq, hk, g, d = qs.shape
    bq = piece.block_q
    qb = _blocks(qs, bq)
    consts = tuple(jnp.asarray(a) for a in _block_inputs(piece))
    nchunk = jnp.asarray(piece.nchunk)

    def step(args):
        q_blk, n, blk, rt_blk = args
        stats_shape = (b, hk, g, bq)

        def body(c, state):
            m, denom, acc = state
            kc, vc, mask, shared, cols = _chunk_keys(piece, kf, vf, blk, c)
            keep = _runtime_keep(mask, cols, shared, rt_blk, keys)
            s = jnp.where(keep, _pure_rows.capped(_scores(q_blk, kc, shared), soft_cap)[0], _NEG_INF)
            m_new = jnp.maximum(m, s.max(axis=-1))
            m_safe = jnp.where(m_new == _NEG_INF, 0.0, m_new)
            p = jnp.exp(s - m_safe[..., None])
            alpha = jnp.exp(m - m_safe)
            denom = alpha * denom + p.sum(axis=-1)
            acc = acc * alpha[..., None] + _pv(p, vc, shared)
            return m_new, denom, acc

        init = (
            jnp.full(stats_shape, _NEG_INF, _F32),
            jnp.zeros(stats_shape, _F32),
            jnp.zeros((*stats_shape, d), _F32),
        )
        if piece.n_chunks == 1:
            m, denom, acc = body(0, init)
        else:
            m, denom, acc = lax.fori_loop(0, n, body, init)
        has = denom > 0
        out = acc / jnp.where(has, denom, 1.0)[..., None]
        lse = jnp.where(has, jnp.where(m == _NEG_INF, 0.0, m) + jnp.log(jnp.where(has, denom, 1.0)), _NEG_INF)
        return jnp.moveaxis(out, 3, 1), lse  # [B, BQ, Hk, G, D], [B, Hk, G, BQ]

    out, lse = lax.map(step, (qb, nchunk, consts, _rt_blocks(rt, bq, sq)))
    return _unblocks(out, sq), _row_stats_unblocks(lse, sq)


def _piece_bwd(piece, qs, kf, vf, dof, lse, delta, dk, dv, rt=None, keys=None, soft_cap=None):
    """Adds one piece's gradients: returns ``dq_s`` (w.r.t. the scaled q) and updated ``dk, dv``."""
    b, sq, hk, g, d = qs.shape
    bq = piece.block_q
    xs = (
        _blocks(qs, bq),
        _blocks(dof, bq),
        _row_stats_blocks(lse, bq, 0.0),
        _row_stats_blocks(delta, bq, 0.0),
        jnp.asarray(piece.nchunk),
        tuple(jnp.asarray(a) for a in _block_inputs(piece)),
        _rt_blocks(rt, bq, sq),
    )

    def step(carry, args):
        q_blk, do_blk, lse_blk, delta_blk, n, blk, rt_blk = args

        def body(c, state):
            dq, dk, dv = state
            kc, vc, mask, shared, cols = _chunk_keys(piece, kf, vf, blk, c)
            keep = _runtime_keep(mask, cols, shared, rt_blk, keys)
            s, t = _pure_rows.capped(_scores(q_blk, kc, shared), soft_cap)
            p = jnp.where(keep, jnp.exp(jnp.minimum(s - lse_blk[..., None], 0.0)), 0.0)
            dp = _scores(do_blk, vc, shared)
            ds = jnp.where(keep, p * (dp - delta_blk[..., None]), 0.0)
            if t is not None:  # d(cap * tanh(s / cap)) / ds
                ds = ds * (1.0 - t * t)
            dq = dq + jnp.moveaxis(_pv(ds, kc, shared), 3, 1)
            if shared:
                dk_c = jnp.einsum("bhgqk,bqhgd->bkhd", ds, q_blk)
                dv_c = jnp.einsum("bhgqk,bqhgd->bkhd", p, do_blk)
            else:
                dk_c = jnp.einsum("bhgqk,bqhgd->bqkhd", ds, q_blk)
                dv_c = jnp.einsum("bhgqk,bqhgd->bqkhd", p, do_blk)
            dk, dv = _accumulate(piece, blk, c, dk, dv, dk_c, dv_c, mask)
            return dq, dk, dv

        dq0 = jnp.zeros(q_blk.shape, _F32)
        state = (dq0, *carry)
        if piece.n_chunks == 1:
            dq, dk, dv = body(0, state)
        else:
            dq, dk, dv = lax.fori_loop(0, n, body, state)
        return (dk, dv), dq

    (dk, dv), dq = lax.scan(step, (dk, dv), xs)
    return _unblocks(dq, sq), dk, dv


def _accumulate(piece, blk, c, dk, dv, dk_c, dv_c, mask):
    """Adds a chunk's key/value gradients at its columns."""
    if isinstance(piece, _Window):
        off = blk[0] + c * piece.chunk

        def add(acc, x):
            cur = lax.dynamic_slice_in_dim(acc, off, piece.chunk, axis=1)
            return lax.dynamic_update_slice_in_dim(acc, cur + x, off, axis=1)

        return add(dk, dk_c), add(dv, dv_c)
    if isinstance(piece, _Gather):
        base, st, cnt = blk
        t = c * piece.chunk + jnp.arange(piece.chunk, dtype=jnp.int32)
        cols = jnp.where(mask, base[:, None] + st[:, None] * t[None, :], 0)
        return dk.at[:, cols].add(dk_c), dv.at[:, cols].add(dv_c)
    kvb, _ = blk
    idx = lax.dynamic_slice_in_dim(kvb, c * piece.per_chunk, piece.per_chunk)
    cols = (idx[:, None] * piece.block_kv + jnp.arange(piece.block_kv, dtype=jnp.int32)).reshape(-1)
    return dk.at[:, cols].add(dk_c), dv.at[:, cols].add(dv_c)


# -----------------------------------------------------------------------------
# fused attention: public backend functions
# -----------------------------------------------------------------------------


def _prep(q, k, v, layout: ACSR, scale: float):
    b, sq, h, d = q.shape
    hk = k.shape[2]
    g = h // hk
    pad = _kv_pad(layout) - k.shape[1]
    qs = (q.astype(_F32) * scale).reshape(b, sq, hk, g, d)
    kf = jnp.pad(k.astype(_F32), ((0, 0), (0, pad), (0, 0), (0, 0)))
    vf = jnp.pad(v.astype(_F32), ((0, 0), (0, pad), (0, 0), (0, 0)))
    return qs, kf, vf


def _merge(parts, shape):
    """Exact merge of per-piece ``(out, lse)``: ``out = sum_k exp(lse_k - lse) out_k``."""
    b, sq, hk, g, d = shape
    if not parts:
        return jnp.zeros((b, sq, hk, g, d), _F32), jnp.full((b, hk, g, sq), _NEG_INF, _F32)
    if len(parts) == 1:
        return parts[0]
    lses = jnp.stack([p[1] for p in parts])  # [n, B, Hk, G, Sq]
    m = lses.max(axis=0)
    m_safe = jnp.where(m == _NEG_INF, 0.0, m)
    w = jnp.exp(lses - m_safe)
    tot = w.sum(axis=0)
    has = tot > 0
    lse = jnp.where(has, m_safe + jnp.log(jnp.where(has, tot, 1.0)), _NEG_INF)
    w = w / jnp.where(has, tot, 1.0)
    out = sum(jnp.moveaxis(wk, -1, 1)[..., None] * o for wk, (o, _) in zip(w, parts, strict=True))
    return out, lse


def _key_side(rt, kf):
    """The runtime mask's key side: ``(kv_len [B], kv_ids padded to kf's length or None)``; the
    padding lies past ``kv_len``, so it is never seen."""
    if rt is None:
        return None
    ids = None if rt.kv_ids is None else jnp.pad(rt.kv_ids, ((0, 0), (0, kf.shape[1] - rt.kv_ids.shape[1])))
    return rt.kv_len, ids


def attention_fwd(q, k, v, runtime, layout: ACSR, scale: float, soft_cap=None):
    """Fused forward. See :mod:`jax_bindings._dispatch` for the contract."""
    if runtime is not None and runtime.q_pos is not None:
        return _pure_rows.attention_fwd(q, k, v, runtime, layout, scale, soft_cap)
    b, sq, h, d = q.shape
    qs, kf, vf = _prep(q, k, v, layout, scale)
    keys = _key_side(runtime, kf)
    parts = [_piece_fwd(p, qs, kf, vf, runtime, keys, soft_cap) for p in _plan(layout)]
    out, lse = _merge(parts, qs.shape)
    return out.reshape(b, sq, h, d).astype(q.dtype), lse.reshape(b, h, sq)


def attention_bwd(q, k, v, runtime, out, lse, dout, layout: ACSR, scale: float, soft_cap=None):
    """Fused backward (recomputes probabilities from ``lse``). See the contract."""
    if runtime is not None and runtime.q_pos is not None:
        return _pure_rows.attention_bwd(q, k, v, runtime, out, lse, dout, layout, scale, soft_cap)
    b, sq, h, d = q.shape
    skv, hk = k.shape[1], k.shape[2]
    g = h // hk
    qs, kf, vf = _prep(q, k, v, layout, scale)
    keys = _key_side(runtime, kf)
    dof = dout.astype(_F32).reshape(b, sq, hk, g, d)
    delta = jnp.einsum("bshd,bshd->bhs", dout.astype(_F32), out.astype(_F32)).reshape(b, hk, g, sq)
    lse = lse.astype(_F32).reshape(b, hk, g, sq)
    # fully masked rows: lse = -inf; their probabilities are masked to 0 anyway
    lse = jnp.where(lse == _NEG_INF, 0.0, lse)
    dq = jnp.zeros(qs.shape, _F32)
    dk = jnp.zeros(kf.shape, _F32)
    dv = jnp.zeros(vf.shape, _F32)
    for p in _plan(layout):
        dq_p, dk, dv = _piece_bwd(p, qs, kf, vf, dof, lse, delta, dk, dv, runtime, keys, soft_cap)
        dq = dq + dq_p
    dq = (dq * scale).reshape(b, sq, h, d).astype(q.dtype)
    return dq, dk[:, :skv].astype(k.dtype), dv[:, :skv].astype(v.dtype)


def attention_paged(q, k_pages, v_pages, page_table, runtime, layout: ACSR, scale: float, soft_cap=None):
    """Attention against a paged KV cache (forward only). See the contract.

    Gathers each batch row's pages into a contiguous ``[B, L, Hk, D]`` cache (``L = max_pages *
    page_size``), then runs the rows of :mod:`jax_bindings._pure_rows` at ``runtime.q_pos``. A page
    id outside ``[0, P)`` is clipped for the gather (nothing is read out of bounds) and its keys are
    masked (AND-ed into the runtime mask's key side); keys never seen (those, and keys at or past
    ``kv_len``) are zeroed, so what unused pages hold (NaN, say) never reaches the arithmetic.
    """
    n_pages, page_size = k_pages.shape[:2]
    b, max_pages = page_table.shape
    length = max_pages * page_size
    page_ok = (page_table >= 0) & (page_table < n_pages)  # [B, max_pages]
    ids = jnp.clip(page_table, 0, n_pages - 1)
    k, v = (x[ids].reshape(b, length, *x.shape[2:]) for x in (k_pages, v_pages))
    kv_ok = jnp.repeat(page_ok, page_size, axis=1)  # [B, L]
    return _pure_rows.attention_fwd(q, k, v, runtime, layout, scale, soft_cap, kv_ok=kv_ok)[0]


# -----------------------------------------------------------------------------
# unfused ops on padded value arrays [B, H, Sq, nnz_max]
# -----------------------------------------------------------------------------


@functools.lru_cache(maxsize=128)
def _residual_slots(layout: ACSR) -> tuple[np.ndarray, np.ndarray] | None:
    """Residual slot columns ``[n_q_blocks, width]`` and validity ``[Sq, width]`` (numpy)."""
    res = layout.residual
    if res is None or res.max_blocks == 0:
        return None
    cols = res.kv_blocks[:, :, None].astype(np.int64) * res.block_kv + np.arange(res.block_kv)
    cols = np.where(res.kv_blocks[:, :, None] >= 0, cols, 0).reshape(res.kv_blocks.shape[0], -1)
    valid = res.bits.transpose(0, 2, 1, 3).reshape(-1, res.width)[: layout.q_len]
    return np.minimum(cols, layout.kv_len - 1).astype(np.int32), valid


def _slots(layout: ACSR):
    """Traced ``(cols int32 [Sq, nnz_max], valid bool [Sq, nnz_max])``; invalid columns read 0."""
    cols, valid = [], []
    for seg in layout.segments:
        t = jnp.arange(seg.width, dtype=jnp.int32)
        ok = t[None, :] < jnp.asarray(seg.count)[:, None]
        c = jnp.asarray(seg.base)[:, None] + jnp.asarray(seg.stride)[:, None] * t[None, :]
        cols.append(jnp.where(ok, c, 0))
        valid.append(ok)
    res = _residual_slots(layout)
    if res is not None:
        rc, rv = res
        rows = np.arange(layout.q_len) // layout.residual.block_q
        cols.append(jnp.asarray(rc)[jnp.asarray(rows)])
        valid.append(jnp.asarray(rv))
    if not cols:
        z = jnp.zeros((layout.q_len, 0), jnp.int32)
        return z, z.astype(bool)
    return jnp.concatenate(cols, axis=1), jnp.concatenate(valid, axis=1)


def _unfused_block(layout: ACSR, b: int, hk: int, d: int) -> int:
    per_row = max(1, layout.nnz_max * b * hk * d)
    bq = 1 << max(0, int(math.log2(max(1, _UNFUSED_BUDGET // per_row))))
    return int(min(max(bq, 8), 256, _round_up(layout.q_len, 8)))


def _vals_blocks(x, bq):
    """``[B, Hk, G, S, N] -> [nb, B, Hk, G, bq, N]``."""
    x = jnp.moveaxis(x, 3, 1)  # [B, S, Hk, G, N]
    return jnp.moveaxis(_blocks(x, bq), 2, 4)


def _vals_unblocks(x, s):
    """``[nb, B, Hk, G, bq, N] -> [B, Hk, G, s, N]``."""
    return jnp.moveaxis(_unblocks(jnp.moveaxis(x, 4, 2), s), 1, 3)


def _slot_blocks(layout, bq):
    cols, valid = _slots(layout)
    return _blocks(cols[None], bq)[:, 0], _blocks(valid[None], bq, False)[:, 0]


def sddmm(q, k, layout: ACSR):
    """Scores ``q . k`` at the mask's slots, ``[B, H, Sq, nnz_max]`` in q.dtype, padding 0."""
    b, sq, h, d = q.shape
    hk = k.shape[2]
    g = h // hk
    bq = _unfused_block(layout, b, hk, d)
    qf = q.astype(_F32).reshape(b, sq, hk, g, d)
    kf = k.astype(_F32)

    def step(args):
        q_blk, cols, valid = args
        kc = jnp.take(kf, cols, axis=1, mode="clip")  # [B, bq, N, Hk, D]
        s = jnp.einsum("bqhgd,bqnhd->bhgqn", q_blk, kc)
        return jnp.where(valid, s, 0.0)

    cols, valid = _slot_blocks(layout, bq)
    s = lax.map(step, (_blocks(qf, bq), cols, valid))
    return _vals_unblocks(s, sq).reshape(b, h, sq, layout.nnz_max).astype(q.dtype)


def sddmm_bwd(q, k, dscores, layout: ACSR):
    """``(dq, dk)`` of :func:`sddmm` given ``dscores [B, H, Sq, nnz_max]`` (padding ignored)."""
    b, sq, h, d = q.shape
    skv, hk = k.shape[1], k.shape[2]
    g = h // hk
    bq = _unfused_block(layout, b, hk, d)
    qf = q.astype(_F32).reshape(b, sq, hk, g, d)
    kf = k.astype(_F32)
    ds = dscores.astype(_F32).reshape(b, hk, g, sq, layout.nnz_max)

    def step(dk, args):
        q_blk, ds_blk, cols, valid = args
        ds_blk = jnp.where(valid, ds_blk, 0.0)
        kc = jnp.take(kf, cols, axis=1, mode="clip")
        dq = jnp.einsum("bhgqn,bqnhd->bqhgd", ds_blk, kc)
        dk = dk.at[:, cols].add(jnp.einsum("bhgqn,bqhgd->bqnhd", ds_blk, q_blk))
        return dk, dq

    cols, valid = _slot_blocks(layout, bq)
    dk, dq = lax.scan(
        step, jnp.zeros((b, skv, hk, d), _F32), (_blocks(qf, bq), _vals_blocks(ds, bq), cols, valid)
    )
    return _unblocks(dq, sq).reshape(b, sq, h, d).astype(q.dtype), dk.astype(k.dtype)


def _valid_rows(layout: ACSR):
    return _slots(layout)[1]  # [Sq, N]


def softmax(scores, layout: ACSR, scale: float):
    """Row softmax of ``scale * scores`` over valid slots; padding and empty rows give 0."""
    valid = _valid_rows(layout)
    x = jnp.where(valid, scores.astype(_F32) * scale, _NEG_INF)
    m = x.max(axis=-1, keepdims=True) if x.shape[-1] else jnp.zeros(x.shape[:-1] + (1,), _F32)
    m = jnp.where(m == _NEG_INF, 0.0, m)
    e = jnp.where(valid, jnp.exp(x - m), 0.0)
    tot = e.sum(axis=-1, keepdims=True)
    return (e / jnp.where(tot > 0, tot, 1.0)).astype(scores.dtype)


def softmax_bwd(probs, dprobs, layout: ACSR, scale: float):
    """``dscores`` of :func:`softmax` from its output ``probs`` and cotangent ``dprobs``."""
    valid = _valid_rows(layout)
    p = jnp.where(valid, probs.astype(_F32), 0.0)
    dp = jnp.where(valid, dprobs.astype(_F32), 0.0)
    ds = scale * p * (dp - (p * dp).sum(axis=-1, keepdims=True))
    return ds.astype(probs.dtype)


def spmm(probs, v, layout: ACSR):
    """``out[b, r, h] = sum_t probs[b, h, r, t] * v[b, col(r, t), h // G]``, ``[B, Sq, H, D]``."""
    b, h, sq, _ = probs.shape
    hk, d = v.shape[2], v.shape[3]
    g = h // hk
    bq = _unfused_block(layout, b, hk, d)
    pf = probs.astype(_F32).reshape(b, hk, g, sq, layout.nnz_max)
    vf = v.astype(_F32)

    def step(args):
        p_blk, cols, valid = args
        vc = jnp.take(vf, cols, axis=1, mode="clip")
        return jnp.einsum("bhgqn,bqnhd->bqhgd", jnp.where(valid, p_blk, 0.0), vc)

    cols, valid = _slot_blocks(layout, bq)
    out = lax.map(step, (_vals_blocks(pf, bq), cols, valid))
    return _unblocks(out, sq).reshape(b, sq, h, d).astype(v.dtype)


def spmm_bwd(probs, v, dout, layout: ACSR):
    """``(dprobs, dv)`` of :func:`spmm` given ``dout [B, Sq, H, D]``; padding slots get 0."""
    b, h, sq, _ = probs.shape
    skv, hk, d = v.shape[1], v.shape[2], v.shape[3]
    g = h // hk
    bq = _unfused_block(layout, b, hk, d)
    pf = probs.astype(_F32).reshape(b, hk, g, sq, layout.nnz_max)
    vf = v.astype(_F32)
    dof = dout.astype(_F32).reshape(b, sq, hk, g, d)

    def step(dv, args):
        p_blk, do_blk, cols, valid = args
        vc = jnp.take(vf, cols, axis=1, mode="clip")
        dp = jnp.where(valid, jnp.einsum("bqhgd,bqnhd->bhgqn", do_blk, vc), 0.0)
        contrib = jnp.einsum("bhgqn,bqhgd->bqnhd", jnp.where(valid, p_blk, 0.0), do_blk)
        return dv.at[:, cols].add(contrib), dp

    cols, valid = _slot_blocks(layout, bq)
    dv, dp = lax.scan(
        step, jnp.zeros((b, skv, hk, d), _F32), (_vals_blocks(pf, bq), _blocks(dof, bq), cols, valid)
    )
    return _vals_unblocks(dp, sq).reshape(b, h, sq, layout.nnz_max).astype(probs.dtype), dv.astype(v.dtype)
