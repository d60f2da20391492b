"""The run-time check that splat's mask at the positions is the original one, and what runs where not.

Positions outside the mask. ``splat.attention`` takes its static mask on ``[0, rows) x [0, Skv)``
(``rows = Skv`` where the queries sit at positions); a query at a position outside sees no key,
a key outside is padding. The original mask is a function of any integers: it may let a query at
``cache_index + i >= Skv`` see the whole cache (Keras's ``i >= j`` past the cache's end), or a key
at a negative position be seen (a window ``q_pos - kv_pos < w`` with no ``kv_pos >= 0`` term).
Wherever position arrays are passed, the check asks that

- every query's row lies in ``[0, rows)``;
- every key passed at its position lies in ``[0, Skv)``, keys that a padding term hides excepted;
  a mask term on the key positions alone (an explicit ``kv_pos >= 0``) counts as one: inside the
  mask it is a constant column, outside it is read at run time (:attr:`Guard.key_terms`).

Positions that stand in for indices. Some masks read one side (queries or keys) both by *index*
and by *position* (an array computed from the inputs): Gemma ANDs a causal mask on indices with a
window on positions ``cumsum(valid) - 1``; in decode it ANDs a causal mask on cache indices with a
window on the positions the cache stores (a slot not yet written holds position 0).
``splat.attention`` takes one coordinate per side, so such a side is passed at its indices, and
its positions are read as indices too (:attr:`Guard.checked`). The call's mask is then the
original one wherever the two agree.

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
does not matter.

The check costs ``O(B * (Sq + Skv))``: comparisons with the bounds, and a running count of the keys
whose position differs from their index, read at both ends of each query's extent. Where it fails
the call runs the original dense attention: exact either way.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from acsr import ACSR
from splat._sparsify.runtime import Runtime

__all__ = ["Guard", "positions_hold", "row_extents"]


@dataclass(frozen=True, eq=False)
class Guard:
    """The run-time check of one attention's positions, and the original attention run where it fails.

    ``checked``: the sides (``"q"``, ``"kv"``) passed at their indices whose positions must equal
    them where ``A`` lets them be seen (empty: the check is that the positions lie inside the mask,
    and that the rows a constant is sliced at equal the query positions, ``Positions.q_start``);
    ``first``, ``last``: int32 ``[rows]``, the first and last column of each row of ``A`` (every
    term when nothing is checked; ``first > last``: ``A`` hides the whole row); ``key_terms``: the
    mask terms on key positions alone (``kv_pos >= 0``) as key padding terms, read at run time to
    tell which keys outside the mask the original hides; ``nodes``, ``reads``, ``out``: the
    original attention (``ir.between``).
    """

    checked: frozenset
    first: np.ndarray
    last: np.ndarray
    key_terms: Runtime
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


def positions_hold(guard: Guard, q_rows, q_pos, kv_pos, kv_valid, kv_cols=None) -> jax.Array:
    """Whether the call's mask equals the original one for these values: a scalar bool.

    ``q_rows``: int32 ``[B, Sq]``, the row of the call's mask each query takes (its position, or
    its index); ``q_pos`` / ``kv_pos``: int ``[B, Sq]`` / ``[B, Skv]``, the positions of a checked
    side, else None; ``kv_valid``: bool ``[B, Skv]``, the keys the padding terms let be seen, or
    None; ``kv_cols``: int ``[B, Skv]``, the column each key takes where the keys are passed at
    their positions, else None.
    """
    rows = guard.first.shape[0]
    # outside the mask splat sees nothing; the original may see something there
    ok = jnp.all((q_rows >= 0) & (q_rows < rows))
    if kv_cols is not None:
        outside = (kv_cols < 0) | (kv_cols >= kv_cols.shape[1])
        ok &= ~jnp.any(outside if kv_valid is None else outside & kv_valid)
    row = jnp.clip(q_rows, 0, rows - 1)
    first, last = jnp.asarray(guard.first)[row], jnp.asarray(guard.last)[row]
    sees = first <= last
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
