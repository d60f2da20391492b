"""Positions that stand in for indices: which pairs must agree, and the run-time check of it.

Some masks read one side (queries or keys) both by *index* and by *position* (an array computed
from the inputs): Gemma ANDs a causal mask on indices with a window on positions ``cumsum(valid)
- 1``; in decode it ANDs a causal mask on cache indices with a window on the positions the cache
stores (a slot not yet written holds position 0). ``splat.attention`` takes one coordinate per
side, so such a side is passed at its indices, and its positions are read as indices too
(:attr:`Guard.checked`). The call's mask is then the original one wherever the two agree.

They need to agree only where it matters. Write the mask as ``A & P``: ``P`` the terms that read a
checked side's positions, ``A`` the others (index terms, and terms on the positions of a side
passed at its positions). The call evaluates ``A`` as the original does and ``P`` with indices for
positions, so the two masks agree on every pair that ``A`` hides, and on every pair whose
positions equal its indices. It is enough that

- keys: ``kv_pos[j] == j`` for every key ``j`` that ``A`` lets some query see: keys within the
  extent ``[first, last]`` of some query's row of ``A`` (the extents known at trace time, read at
  run time at each query's row), keys that a padding term hides excepted;
- queries: ``q_pos[i] == i`` for every row ``i`` of ``A`` that sees some key.

A Gemma decode step passes its queries at their positions and its keys at their indices; the
slots not yet written lie past every query's extent of ``A`` (``j <= q_pos``), so their stored 0
does not matter. The check costs ``O(B * (Sq + Skv))``: a running count of the keys whose position
differs from their index, read at both ends of each query's extent. Where it fails the call runs
the original dense attention: exact either way.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from acsr import ACSR

__all__ = ["Guard", "positions_hold", "row_extents"]


@dataclass(frozen=True, eq=False)
class Guard:
    """The run-time check of one attention's positions, and the original attention run where it fails.

    ``checked``: the sides (``"q"``, ``"kv"``) passed at their indices whose positions must equal
    them where ``A`` lets them be seen (empty: the check is only that the rows a constant is
    sliced at equal the query positions, ``Positions.q_start``); ``first``, ``last``: int32
    ``[rows]``, the first and last column of each row of ``A`` (``first > last``: ``A`` hides the
    whole row; None when nothing is checked); ``nodes``, ``reads``, ``out``: the original attention
    (``ir.between``).
    """

    checked: frozenset
    first: np.ndarray | None
    last: np.ndarray | None
    nodes: list
    reads: list
    out: int


def row_extents(layout: ACSR) -> tuple[np.ndarray, np.ndarray]:
    """``(first, last)``: int32 ``[q_len]``, the first and last column of each row of ``layout``;
    an empty row has ``first = kv_len`` and ``last = -1``. ``O(q_len)`` per segment, plus the
    residual's bits."""
    flat = layout.flat
    first = np.full(flat.q_len, flat.kv_len, np.int64)
    last = np.full(flat.q_len, -1, np.int64)
    for s in flat.segments:
        on = s.count > 0
        end = s.base.astype(np.int64) + s.stride.astype(np.int64) * (s.count.astype(np.int64) - 1)
        first = np.where(on, np.minimum(first, s.base), first)
        last = np.where(on, np.maximum(last, end), last)
    res = flat.residual
    if res is not None and res.bits.size:
        cols = res.kv_blocks[:, :, None, None].astype(np.int64) * res.block_kv + np.arange(res.block_kv)
        on = res.bits & (res.kv_blocks >= 0)[:, :, None, None]  # [row blocks, blocks, block_q, block_kv]
        lo = np.where(on, cols, flat.kv_len).min(axis=(1, 3)).reshape(-1)[: flat.q_len]
        hi = np.where(on, cols, -1).max(axis=(1, 3)).reshape(-1)[: flat.q_len]
        first[: lo.size] = np.minimum(first[: lo.size], lo)
        last[: hi.size] = np.maximum(last[: hi.size], hi)
    return first.astype(np.int32), last.astype(np.int32)


def positions_hold(guard: Guard, q_rows, q_pos, kv_pos, kv_valid) -> jax.Array:
    """Whether the call's mask equals the original one for these values: a scalar bool.

    ``q_rows``: int32 ``[B, Sq]``, the row of the call's mask each query takes (its position, or
    its index); ``q_pos`` / ``kv_pos``: int ``[B, Sq]`` / ``[B, Skv]``, the positions of a checked
    side, else None; ``kv_valid``: bool ``[B, Skv]``, the keys the padding terms let be seen, or None.
    """
    rows = guard.first.shape[0]
    # a query outside the mask's rows sees no key in splat; the original may see some
    inside = (q_rows >= 0) & (q_rows < rows)
    row = jnp.clip(q_rows, 0, rows - 1)
    first, last = jnp.asarray(guard.first)[row], jnp.asarray(guard.last)[row]
    sees = first <= last
    ok = jnp.all(inside)
    if q_pos is not None:
        at_index = q_pos == jnp.arange(q_pos.shape[1], dtype=q_pos.dtype)[None, :]
        ok &= jnp.all(at_index | ~sees)
    if kv_pos is not None:
        moved = kv_pos != jnp.arange(kv_pos.shape[1], dtype=kv_pos.dtype)[None, :]
        if kv_valid is not None:
            moved &= kv_valid
        # moved keys before column c: count[:, c]; within [first, last]: count[last + 1] - count[first]
        count = jnp.cumsum(moved.astype(jnp.int32), axis=1)
        count = jnp.concatenate([jnp.zeros_like(count[:, :1]), count], axis=1)
        n_kv = kv_pos.shape[1]
        hi = jnp.take_along_axis(count, jnp.clip(last + 1, 0, n_kv), axis=1)
        lo = jnp.take_along_axis(count, jnp.clip(first, 0, n_kv), axis=1)
        ok &= jnp.all((hi == lo) | ~sees)
    return ok
