"""Pure-JAX attention whose queries take the static layout's rows at run time (``q_offset``).

With a :class:`~jax_bindings._runtime.RuntimeMask` carrying ``q_pos``, query
``i`` of batch row ``b`` uses row ``q_pos[b, i]`` of the static layout (decode
against a KV cache, chunked prefill). The row is only known on device, so the
plans of :mod:`jax_bindings._pure` (built per row block at trace time) do not
apply; here each row's membership is evaluated from the layout's arrays,
gathered at its position:

* a segment's row ``p`` holds columns ``base[p] + stride[p] * t``, ``t < count[p]``;
* the residual's row ``p`` holds the set bits of its row block's key blocks.

A query at ``q_pos = -1`` (outside the layout) sees no key: its row is read at
0 and its key range emptied, so no array is indexed at -1 (which would wrap to
the last row).

Keys may sit at run-time columns too (``kv_cols``, :func:`attention_at_columns`):
key ``j`` of batch row ``b`` is then column ``kv_cols[b, j]`` of the layout, and
membership is evaluated at that column, so keys that share a column share its
mask entries (no permutation of the keys can express that, which is why the
kernels cannot take it). The keys come sorted by column, so the keys a block
of rows walks, those in its columns ``[first, last)``, are one run found by a
binary search.

Each block of ``_BLOCK_Q`` queries walks the keys between its rows' smallest
first column and largest last one (after the runtime ranges), ``_CHUNK`` keys
at a time, with an online softmax; the backward pass recomputes the
probabilities from the logsumexp. A chunk may run past a row's last key, so
keys and values a batch row never sees (at or past ``kv_len``, or outside
``kv_ok``) are zeroed first: a cache's stale tail (NaN, say) never reaches the
arithmetic (``0 * NaN`` would). Work is ``O(rows x span)``, not
``O(nnz)``: exact for every layout, fast where rows are intervals (causal,
windows), which is what decode needs. Batch rows run under ``vmap``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from acsr import ACSR

_F32 = jnp.float32
_NEG_INF = float("-inf")
_BIG = np.iinfo(np.int32).max
_BLOCK_Q = 64
_CHUNK = 128


def capped(s, soft_cap):
    """``(soft_cap * tanh(s / soft_cap), tanh(s / soft_cap))``, or ``(s, None)`` without a cap."""
    if soft_cap is None:
        return s, None
    t = jnp.tanh(s / soft_cap)
    return soft_cap * t, t


@dataclass(frozen=True, eq=False)
class _Rows:
    """The layout as per-row numpy arrays (indexed by layout row ``p``).

    ``segs``: ``(base, stride, count)`` int32 ``[P]`` per segment; ``lo``/``hi``:
    int32 ``[P]``, the row's first column and one past its last (``lo == hi``:
    empty); ``res``: ``(kv_blocks [nqb, maxb], bits [nqb, maxb, block_q, block_kv],
    block_q, block_kv)`` or None.
    """

    segs: tuple
    lo: np.ndarray
    hi: np.ndarray
    res: tuple | None


@functools.lru_cache(maxsize=32)
def _rows(layout: ACSR) -> _Rows:
    p = layout.q_len
    lo = np.full(p, _BIG, np.int64)
    hi = np.zeros(p, np.int64)
    segs = []
    for seg in layout.segments:
        base, stride, count = (a.astype(np.int64) for a in (seg.base, seg.stride, seg.count))
        has = count > 0
        lo = np.where(has, np.minimum(lo, base), lo)
        hi = np.where(has, np.maximum(hi, base + stride * (count - 1) + 1), hi)
        segs.append(tuple(a.astype(np.int32) for a in (base, stride, count)))
    res = None
    r = layout.residual
    if r is not None and r.max_blocks > 0:
        kvb = r.kv_blocks.astype(np.int64)
        ok = kvb >= 0
        blk_lo = np.where(ok, kvb * r.block_kv, _BIG).min(axis=1)
        blk_hi = np.where(ok, np.minimum((kvb + 1) * r.block_kv, layout.kv_len), 0).max(axis=1)
        rb = np.arange(p) // r.block_q
        lo, hi = np.minimum(lo, blk_lo[rb]), np.maximum(hi, blk_hi[rb])
        res = (r.kv_blocks.astype(np.int32), r.bits.astype(bool), r.block_q, r.block_kv)
    empty = hi <= lo
    lo, hi = np.where(empty, 0, lo), np.where(empty, 0, hi)
    return _Rows(tuple(segs), lo.astype(np.int32), hi.astype(np.int32), res)


def _member(rows: _Rows, pos, cols):
    """``[BQ, C]``: whether layout row ``pos[r]`` holds column ``cols[c]``."""
    c = cols[None, :]
    keep = jnp.zeros((pos.shape[0], cols.shape[0]), bool)
    for base, stride, count in rows.segs:
        b, st, n = (jnp.asarray(a)[pos][:, None] for a in (base, stride, count))
        rel = c - b
        keep |= (rel >= 0) & (rel % st == 0) & (rel // st < n)
    if rows.res is not None:
        kv_blocks, bits, block_q, block_kv = rows.res
        rb, a = pos // block_q, pos % block_q
        kvb = jnp.asarray(kv_blocks)[rb]  # [BQ, maxb]
        row_bits = jnp.asarray(bits)[rb, :, a, :]  # [BQ, maxb, block_kv]
        hit = kvb[:, None, :] == (cols // block_kv)[None, :, None]  # [BQ, C, maxb]
        bit = jnp.take_along_axis(row_bits, jnp.broadcast_to(cols % block_kv, (*kvb.shape, cols.shape[0])), 2)
        keep |= (hit & jnp.swapaxes(bit, 1, 2)).any(axis=-1)
    return keep


def _blocked(x, bq, fill):
    """``[S, ...] -> [nb, bq, ...]``, rows padded with ``fill``."""
    nb = -(-x.shape[0] // bq)
    pad = [(0, nb * bq - x.shape[0])] + [(0, 0)] * (x.ndim - 1)
    return jnp.pad(x, pad, constant_values=fill).reshape(nb, bq, *x.shape[1:])


def _block_args(rows: _Rows, pos, limit, ids, bq):
    """Row blocks of ``(pos, lo, hi, ids)``: each query's keys ``[lo, hi)``, its layout row's span
    cut at ``limit`` (the key length, 0 for a padded query). A query at ``pos = -1`` (outside the
    layout) gets the empty range ``[0, 0)`` and reads row 0 (masked by that range)."""
    inside = pos >= 0
    pos = jnp.where(inside, pos, 0)
    lo = jnp.where(inside, jnp.asarray(rows.lo)[pos], 0)
    hi = jnp.where(inside, jnp.minimum(limit, jnp.asarray(rows.hi)[pos]), 0)
    out = (_blocked(pos, bq, 0), _blocked(lo, bq, 0), _blocked(hi, bq, 0))
    return (*out, None if ids is None else _blocked(ids, bq, 0))


def _walk(lo, hi, kcol):
    """First key and chunk count of a row block whose rows see columns ``[lo, hi)``; ``kcol``:
    the batch row's key columns (sorted, padded like ``kf``), or None (key ``j`` at column ``j``)."""
    has = hi > lo
    first = jnp.min(jnp.where(has, lo, _BIG))
    last = jnp.max(jnp.where(has, hi, 0))
    if kcol is not None:  # the run of keys whose columns lie in [first, last)
        first, last = jnp.searchsorted(kcol, first), jnp.searchsorted(kcol, last)
    return first, (jnp.maximum(last - first, 0) + _CHUNK - 1) // _CHUNK


def _chunk(rows, kf, vf, keys, blk, first, c):
    """Chunk ``c`` of a row block: ``(start, keys, values, keep [BQ, _CHUNK])``. ``keys``: the
    batch row's key side ``(kid, kok, kcol)``, each padded like ``kf`` or None."""
    pos, lo, hi, ids = blk
    kid, kok, kcol = keys
    start = first + c * _CHUNK
    idx = start + jnp.arange(_CHUNK, dtype=jnp.int32)
    cols = idx if kcol is None else lax.dynamic_slice_in_dim(kcol, start, _CHUNK)
    keep = _member(rows, pos, cols) & (cols[None, :] >= lo[:, None]) & (cols[None, :] < hi[:, None])
    if ids is not None:
        keep &= ids[:, None] == jnp.take(kid, idx, mode="clip")[None, :]
    if kok is not None:
        keep &= jnp.take(kok, idx, mode="clip")[None, :]
    kc = lax.dynamic_slice_in_dim(kf, start, _CHUNK, axis=0)
    vc = lax.dynamic_slice_in_dim(vf, start, _CHUNK, axis=0)
    return start, kc, vc, keep


def _fwd_one(rows, qs, kf, vf, pos, limit, ids, kid, kok, kcol, soft_cap):
    """One batch row: ``qs [Sq, Hk, G, D]`` (scaled), ``kf, vf [Skv + _CHUNK, Hk, D]`` (padded)."""
    sq, hk, g, d = qs.shape
    bq = min(_BLOCK_Q, -(-sq // 8) * 8)

    def step(args):
        q_blk, blk = args[0], args[1:]
        first, n = _walk(blk[1], blk[2], kcol)

        def body(c, state):
            m, denom, acc = state
            _, kc, vc, keep = _chunk(rows, kf, vf, (kid, kok, kcol), blk, first, c)
            s = capped(jnp.einsum("qhgd,khd->hgqk", q_blk, kc), soft_cap)[0]
            s = jnp.where(keep, s, _NEG_INF)
            m_new = jnp.maximum(m, s.max(axis=-1))
            m_safe = jnp.where(m_new == _NEG_INF, 0.0, m_new)
            p = jnp.exp(s - m_safe[..., None])
            alpha = jnp.exp(m - m_safe)
            return (
                m_new,
                alpha * denom + p.sum(-1),
                acc * alpha[..., None] + jnp.einsum("hgqk,khd->hgqd", p, vc),
            )

        shape = (hk, g, bq)
        init = (jnp.full(shape, _NEG_INF, _F32), jnp.zeros(shape, _F32), jnp.zeros((*shape, d), _F32))
        m, denom, acc = lax.fori_loop(0, n, body, init)
        has = denom > 0
        out = acc / jnp.where(has, denom, 1.0)[..., None]
        lse = jnp.where(has, jnp.where(m == _NEG_INF, 0.0, m) + jnp.log(jnp.where(has, denom, 1.0)), _NEG_INF)
        return jnp.moveaxis(out, 2, 0), jnp.moveaxis(lse, 2, 0)  # [bq, Hk, G, D], [bq, Hk, G]

    out, lse = lax.map(step, (_blocked(qs, bq, 0.0), *_block_args(rows, pos, limit, ids, bq)))
    return out.reshape(-1, hk, g, d)[:sq], lse.reshape(-1, hk, g)[:sq]


def _bwd_one(rows, qs, kf, vf, dof, lse, delta, pos, limit, ids, kid, kok, kcol, soft_cap):
    """One batch row's ``(dq_s, dk, dv)`` (dq w.r.t. the scaled q; dk, dv padded like kf)."""
    sq, hk, g, d = qs.shape
    bq = min(_BLOCK_Q, -(-sq // 8) * 8)
    xs = (
        _blocked(qs, bq, 0.0),
        _blocked(dof, bq, 0.0),
        _blocked(lse, bq, 0.0),
        _blocked(delta, bq, 0.0),
        *_block_args(rows, pos, limit, ids, bq),
    )

    def step(carry, args):
        q_blk, do_blk, lse_blk, delta_blk, blk = args[0], args[1], args[2], args[3], args[4:]
        first, n = _walk(blk[1], blk[2], kcol)
        lse_t = jnp.moveaxis(lse_blk, 0, 2)[..., None]  # [Hk, G, bq, 1]
        delta_t = jnp.moveaxis(delta_blk, 0, 2)[..., None]

        def body(c, state):
            dq, dk, dv = state
            start, kc, vc, keep = _chunk(rows, kf, vf, (kid, kok, kcol), blk, first, c)
            s, t = capped(jnp.einsum("qhgd,khd->hgqk", q_blk, kc), soft_cap)
            p = jnp.where(keep, jnp.exp(jnp.minimum(s - lse_t, 0.0)), 0.0)
            dp = jnp.einsum("qhgd,khd->hgqk", do_blk, vc)
            ds = jnp.where(keep, p * (dp - delta_t), 0.0)
            if t is not None:
                ds = ds * (1.0 - t * t)
            dq = dq + jnp.einsum("hgqk,khd->qhgd", ds, kc)

            def add(acc, x):
                cur = lax.dynamic_slice_in_dim(acc, start, _CHUNK, axis=0)
                return lax.dynamic_update_slice_in_dim(acc, cur + x, start, axis=0)

            dk = add(dk, jnp.einsum("hgqk,qhgd->khd", ds, q_blk))
            dv = add(dv, jnp.einsum("hgqk,qhgd->khd", p, do_blk))
            return dq, dk, dv

        dq, dk, dv = lax.fori_loop(0, n, body, (jnp.zeros(q_blk.shape, _F32), *carry))
        return (dk, dv), dq

    zeros = jnp.zeros(kf.shape, _F32)
    (dk, dv), dq = lax.scan(step, (zeros, zeros), xs)
    return dq.reshape(-1, hk, g, d)[:sq], dk, dv


def _seen(rt, skv, kv_ok, kv_cols):
    """``[B, Skv]``: the keys a batch row may see (at a column in ``[0, kv_len)``, and ``kv_ok``
    where given)."""
    cols = jnp.arange(skv)[None, :] if kv_cols is None else kv_cols
    seen = (cols >= 0) & (cols < rt.kv_len[:, None])
    return seen if kv_ok is None else seen & kv_ok


def _prep(q, k, v, scale, seen):
    """Scaled queries ``[B, Sq, Hk, G, D]``; keys and values in float32, zero where not ``seen``
    and padded by a chunk (a chunk may start at any key below ``kv_len``)."""
    b, sq, h, d = q.shape
    hk = k.shape[2]
    pad = ((0, 0), (0, _CHUNK), (0, 0), (0, 0))
    qs = (q.astype(_F32) * scale).reshape(b, sq, hk, h // hk, d)
    keep = seen[:, :, None, None]
    k, v = (jnp.pad(jnp.where(keep, x.astype(_F32), 0.0), pad) for x in (k, v))
    return qs, k, v


def _key_limit(rt, sq):
    """``[B, Sq]``: each query sees keys below this (the key length; 0 for a padded query)."""
    real = jnp.arange(sq)[None, :] < rt.q_len[:, None]
    return jnp.where(real, rt.kv_len[:, None], 0)


def _kid(rt):
    """The key ids padded like ``kf`` (past ``kv_len``: never seen), or None without ids."""
    return None if rt.kv_ids is None else jnp.pad(rt.kv_ids, ((0, 0), (0, _CHUNK)))


def _kok(kv_ok):
    """``kv_ok`` padded like ``kf`` with False, or None."""
    return None if kv_ok is None else jnp.pad(kv_ok, ((0, 0), (0, _CHUNK)))


def _kcol(kv_cols):
    """``kv_cols`` padded like ``kf`` with a column past every row (still sorted), or None."""
    if kv_cols is None:
        return None
    return jnp.pad(kv_cols.astype(jnp.int32), ((0, 0), (0, _CHUNK)), constant_values=_BIG)


def attention_fwd(q, k, v, rt, layout: ACSR, scale: float, soft_cap=None, kv_ok=None, kv_cols=None):
    """``(out, lse)`` as the backend contract says, rows at ``rt.q_pos``.

    ``kv_ok``: bool ``[B, Skv]`` or None: keys where it is False are never seen (AND-ed with the
    runtime mask's key side; the paged cache's keys on pages out of range). ``kv_cols``: int
    ``[B, Skv]``, non-decreasing along each row, or None: key ``j`` sits at column
    ``kv_cols[b, j]`` of the layout (keys may share one); a column outside ``[0, kv_len)`` is
    never seen. None: column ``j``.
    """
    b, sq, h, d = q.shape
    rows = _rows(layout)
    qs, kf, vf = _prep(q, k, v, scale, _seen(rt, k.shape[1], kv_ok, kv_cols))
    one = functools.partial(_fwd_one, rows, soft_cap=soft_cap)
    args = (rt.q_pos, _key_limit(rt, sq), rt.q_ids, _kid(rt), _kok(kv_ok), _kcol(kv_cols))
    out, lse = jax.vmap(one)(qs, kf, vf, *args)
    lse = jnp.moveaxis(lse.reshape(b, sq, h), 1, 2)
    return out.reshape(b, sq, h, d).astype(q.dtype), lse


def attention_bwd(q, k, v, rt, out, lse, dout, layout: ACSR, scale: float, soft_cap=None, kv_cols=None):
    """``(dq, dk, dv)`` as the backend contract says, rows at ``rt.q_pos``; ``kv_cols`` as for
    :func:`attention_fwd`."""
    b, sq, h, d = q.shape
    skv, hk = k.shape[1], k.shape[2]
    rows = _rows(layout)
    qs, kf, vf = _prep(q, k, v, scale, _seen(rt, skv, None, kv_cols))
    dof = dout.astype(_F32).reshape(qs.shape)
    delta = jnp.einsum("bshd,bshd->bsh", dout.astype(_F32), out.astype(_F32)).reshape(b, sq, hk, h // hk)
    lse = jnp.moveaxis(lse.astype(_F32), 1, 2).reshape(b, sq, hk, h // hk)
    lse = jnp.where(lse == _NEG_INF, 0.0, lse)  # empty rows: every probability is masked anyway
    one = functools.partial(_bwd_one, rows, soft_cap=soft_cap)
    limit = _key_limit(rt, sq)
    args = (rt.q_pos, limit, rt.q_ids, _kid(rt), None, _kcol(kv_cols))
    dq, dk, dv = jax.vmap(one)(qs, kf, vf, dof, lse, delta, *args)
    dq = (dq * scale).reshape(b, sq, h, d).astype(q.dtype)
    return dq, dk[:, :skv].astype(k.dtype), dv[:, :skv].astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def attention_at_columns(q, k, v, rt, kv_cols, layout: ACSR, scale: float, soft_cap=None):
    """Differentiable attention, rows at ``rt.q_pos`` and keys at columns ``kv_cols`` (int
    ``[B, Skv]``, non-decreasing; see :func:`attention_fwd`): ``[B, Sq, H, D]`` in q's dtype.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np, acsr
      >>> from jax_bindings import _runtime
      >>> q, k, v = jax.random.normal(jax.random.key(0), (3, 1, 4, 2, 8))
      >>> rt = _runtime.build(1, 4, 4, q_positions=jnp.array([[0, 1, 2, 3]]), layout_rows=4)
      >>> cols = jnp.array([[0, 1, 1, 3]])   # keys 1 and 2 share column 1
      >>> layout = acsr.from_dense(np.tril(np.ones((4, 4), bool)))
      >>> attention_at_columns(q, k, v, rt, cols, layout, 8 ** -0.5).shape
      (1, 4, 2, 8)
    """
    return attention_fwd(q, k, v, rt, layout, scale, soft_cap, kv_cols=kv_cols)[0]


def _at_columns_fwd(q, k, v, rt, kv_cols, layout, scale, soft_cap):
    out, lse = attention_fwd(q, k, v, rt, layout, scale, soft_cap, kv_cols=kv_cols)
    return out, (q, k, v, rt, kv_cols, out, lse)


def _at_columns_bwd(layout, scale, soft_cap, res, dout):
    q, k, v, rt, kv_cols, out, lse = res
    dq, dk, dv = attention_bwd(q, k, v, rt, out, lse, dout, layout, scale, soft_cap, kv_cols=kv_cols)
    return dq, dk, dv, None, None  # integer arrays: no gradient


attention_at_columns.defvjp(_at_columns_fwd, _at_columns_bwd)
