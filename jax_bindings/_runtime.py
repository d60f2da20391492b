"""Runtime masks: the data-dependent part of a mask, as per-row ranges built on device.

The static mask (an :class:`acsr.ACSR` layout) is known at trace time and baked
into the kernels. What changes every batch -- packed documents, padding, the
position of a decode step -- arrives as arrays and becomes a
:class:`RuntimeMask`, built by :func:`build` with O(B * S) JAX work (one
sortedness test of the ids). Kernels AND it with the static mask: query ``i``
of batch row ``b`` sees key ``j`` where

* the static layout has ``(pos_i, j)``, with ``pos_i = q_pos[b, i]`` when
  ``q_pos`` is given, else ``i``; ``pos_i = -1`` (a position outside the
  layout) sees no key;
* ``i < q_len[b]`` and ``j < kv_len[b]``;
* ``q_ids[b, i] == kv_ids[b, j]`` when ids are given.

Where ``exact[b]`` is set (ids non-decreasing along both sequences: packed
documents) a block of rows with ids in ``[lo, hi]`` sees only the keys whose
ids lie in that interval, a contiguous run the Triton kernels find by a
two-level search of ``kv_ids``; they skip the tiles outside it and compare ids
only in tiles that cross a document end. Elsewhere they compare ids in every
tile: any ids are exact, sorted ones are fast.

Arrays (all int32; ``B`` batch rows, ``Sq`` queries, ``Skv`` keys):

=========  ===========  =================================================================
field      shape        meaning
=========  ===========  =================================================================
q_len      ``[B]``      queries at or past it are padding (output 0); in ``[0, Sq]``
kv_len     ``[B]``      keys at or past it are never seen; in ``[0, Skv]``
exact      ``[B]``      1 where both id arrays are non-decreasing (or there are no ids)
q_ids      ``[B, Sq]``  segment id of each query, or None (no ids)
kv_ids     ``[B, Skv]`` segment id of each key, or None
q_pos      ``[B, Sq]``  the static layout's row for each query (``q_offset + i``, or given), or None
                        (row ``i``); -1: outside the layout, the query sees no key (output 0,
                        lse ``-inf``, zero gradients); never another row, never clipped
q_start    ``[B]``      with ``q_pos`` from an offset: ``q_pos[b, i] = q_start[b] + i`` wherever
                        that is inside the layout (kernels that walk a chunk of consecutive
                        rows read this); None when positions are absent or given otherwise
=========  ===========  =================================================================

A :class:`RuntimeMask` is a pytree (a NamedTuple; absent fields are None), so
it passes through ``jit``, ``vmap`` and ``custom_vjp`` as arrays with ``B`` at
axis 0; which fields are present is part of the trace, their values are not.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

_I32 = jnp.int32


class RuntimeMask(NamedTuple):
    """The data-dependent part of a mask (see the module docstring for every field)."""

    q_len: jax.Array
    kv_len: jax.Array
    exact: jax.Array
    q_ids: jax.Array | None = None
    kv_ids: jax.Array | None = None
    q_pos: jax.Array | None = None
    q_start: jax.Array | None = None


def _non_decreasing(x: jax.Array) -> jax.Array:
    """``[B, S] -> [B]``: whether each row never decreases."""
    if x.shape[1] < 2:
        return jnp.ones(x.shape[:1], bool)
    return jnp.all(x[:, 1:] >= x[:, :-1], axis=1)


def build(
    batch: int,
    q_len: int,
    kv_len: int,
    *,
    segment_ids=None,
    kv_segment_ids=None,
    query_seq_lengths=None,
    key_value_seq_lengths=None,
    q_offset=None,
    q_positions=None,
    layout_rows: int | None = None,
) -> RuntimeMask | None:
    """The :class:`RuntimeMask` of these arguments, or None when all are None.

    Arguments are the checked arrays of :func:`splat.attention` (ints of any
    width; ``segment_ids [B, Sq]``, ``kv_segment_ids [B, Skv]`` (None: the same
    as ``segment_ids``), lengths ``[B]``, ``q_offset [B]``). Lengths are
    clipped to ``[0, S]``; a position ``q_offset + i`` outside ``[0,
    layout_rows)`` becomes -1: that query sees no key (it is not clipped to the
    nearest row, whose mask is not its own). ``q_positions [B, Sq]``: each query's row
    given directly (instead of ``q_offset``), the same rule outside ``[0, layout_rows)``.
    ``layout_rows``: rows of the static layout the positions index (needed with
    ``q_offset`` or ``q_positions``).

    Example:
      >>> import jax.numpy as jnp
      >>> rt = build(1, 5, 5, segment_ids=jnp.array([[0, 0, 1, 1, 1]]), query_seq_lengths=jnp.array([9]))
      >>> rt.q_len.tolist(), rt.kv_len.tolist(), rt.exact.tolist()
      ([5], [5], [1])
      >>> build(1, 3, 8, q_offset=6, layout_rows=8).q_pos.tolist()   # the third query is past the layout
      [[6, 7, -1]]
    """
    given = (segment_ids, kv_segment_ids, query_seq_lengths, key_value_seq_lengths, q_offset, q_positions)
    if all(x is None for x in given):
        return None
    qn = jnp.full((batch,), q_len, _I32)
    kn = jnp.full((batch,), kv_len, _I32)
    if query_seq_lengths is not None:
        qn = jnp.clip(jnp.asarray(query_seq_lengths).astype(_I32), 0, q_len)
    if key_value_seq_lengths is not None:
        kn = jnp.clip(jnp.asarray(key_value_seq_lengths).astype(_I32), 0, kv_len)
    exact = jnp.ones((batch,), _I32)
    q_ids = kv_ids = q_pos = q_start = None
    if segment_ids is not None:
        q_ids = jnp.asarray(segment_ids).astype(_I32)
        kv_ids = q_ids if kv_segment_ids is None else jnp.asarray(kv_segment_ids).astype(_I32)
        exact = (_non_decreasing(q_ids) & _non_decreasing(kv_ids)).astype(_I32)
    if q_offset is not None:
        if layout_rows is None:
            raise ValueError("layout_rows is needed with q_offset")
        q_start = jnp.broadcast_to(jnp.asarray(q_offset).astype(_I32).reshape(-1), (batch,))
        pos = q_start[:, None] + jnp.arange(q_len, dtype=_I32)[None, :]
        q_pos = jnp.where((pos >= 0) & (pos < layout_rows), pos, -1)
    if q_positions is not None:  # any rows, one per query (no q_start: not consecutive)
        if layout_rows is None:
            raise ValueError("layout_rows is needed with q_positions")
        pos = jnp.asarray(q_positions).astype(_I32)
        q_pos = jnp.where((pos >= 0) & (pos < layout_rows), pos, -1)
    return RuntimeMask(qn, kn, exact, q_ids, kv_ids, q_pos, q_start)
