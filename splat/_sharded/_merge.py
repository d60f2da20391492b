"""Merging blocks' partial attention by log-sum-exp, and the accumulators the steps update.

A block's forward gives, for its rows, the softmax-normalised output over its own keys ``o_b`` and
``lse_b = log sum exp(z)`` over them. Over several blocks of the same rows::

    lse = log(sum_b exp(lse_b)),    out = sum_b exp(lse_b - lse) * o_b

exact whatever the order. A row no block sees keeps ``lse = -inf`` and output 0; nothing takes a
log of 0 or divides by it, so no NaN appears. Accumulators are float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_F32 = jnp.float32
_NEG_INF = float("-inf")


def _axes(x) -> frozenset:
    aval = jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", ()))


def axes_of(*trees) -> frozenset:
    """The mesh axes any array leaf of ``trees`` is typed as varying along (``shard_map`` with
    ``check_vma=True``; empty elsewhere)."""
    out = frozenset()
    for x in jax.tree.leaves(trees):
        out |= _axes(x)
    return out


def empty(b: int, n: int, h: int, d: int):
    """``(out [B, n, H, D] zeros, lse [B, H, n] -inf)``, float32: rows no block has seen yet."""
    return jnp.zeros((b, n, h, d), _F32), jnp.full((b, h, n), _NEG_INF, _F32)


def merge(o1, l1, o2, l2):
    """Two partial results of the same rows, ``o: [B, n, H, D]``, ``l: [B, H, n]`` -> merged, float32."""
    m = jnp.maximum(l1, l2)
    m = jnp.where(m == _NEG_INF, 0.0, m)
    w1, w2 = jnp.exp(l1 - m), jnp.exp(l2 - m)
    tot = w1 + w2
    seen = tot > 0
    lse = jnp.where(seen, m + jnp.log(jnp.where(seen, tot, 1.0)), _NEG_INF)
    inv = jnp.where(seen, 1.0 / jnp.where(seen, tot, 1.0), 0.0)
    a1 = jnp.swapaxes(w1 * inv, 1, 2)[..., None]  # [B, n, H, 1]
    a2 = jnp.swapaxes(w2 * inv, 1, 2)[..., None]
    return a1 * o1 + a2 * o2.astype(_F32), lse


def merge_rows(acc, o, lse, rows: tuple[int, int], *, fresh: bool = False):
    """``acc = (out, lse)`` with a block's ``(o, lse)`` of rows ``[r0, r1)`` merged in; ``fresh``:
    ``acc`` is still :func:`empty` (the first step), so the block's result is taken as it is."""
    (ao, al), (r0, r1) = acc, rows
    if fresh:
        mo, ml = o.astype(_F32), lse
    else:
        mo, ml = merge(ao[:, r0:r1], al[:, :, r0:r1], o, lse)
    if (r0, r1) == (0, ao.shape[1]):
        return mo, ml
    return ao.at[:, r0:r1].set(mo), al.at[:, :, r0:r1].set(ml)


def add_rows(acc, x, rows: tuple[int, int]):
    """``acc [B, n, ...]`` float32 with ``x`` added at rows ``[r0, r1)`` of axis 1."""
    r0, r1 = rows
    if (r0, r1) == (0, acc.shape[1]):
        return acc + x.astype(_F32)
    return acc.at[:, r0:r1].add(x.astype(_F32))
