"""Runtime masks: the data-dependent part of a mask, as per-row ranges built on device.

The static mask (an :class:`acsr.ACSR` layout) is known at trace time and baked
into the kernels. What changes every batch -- packed documents, padding, the
position of a decode step -- arrives as arrays and becomes a
:class:`RuntimeMask`, built by :func:`build` in O(B * S) JAX work. Kernels AND
it with the static mask: query ``i`` of batch row ``b`` sees key ``j`` where

* the static layout has ``(pos_i, j)``, with ``pos_i = q_pos[b, i]`` when
  ``q_pos`` is given, else ``i``;
* ``q_lo[b, i] <= j < q_hi[b, i]``;
* ``q_ids[b, i] == kv_ids[b, j]`` when ids are given.

The ranges never change the answer on their own (they are implied by the ids
and lengths); they let kernels skip whole key tiles, and where ``exact[b]`` is
set they *are* the id test, so tiles inside every row's range need no mask.

Arrays (all int32; ``B`` batch rows, ``Sq`` queries, ``Skv`` keys):

=========  ===========  =================================================================
field      shape        meaning
=========  ===========  =================================================================
q_lo       ``[B, Sq]``  first key query row ``i`` may see
q_hi       ``[B, Sq]``  one past its last; ``q_lo == q_hi``: the row sees nothing
                        (a padded query, or an id with no key)
kv_lo      ``[B, Skv]`` first query row that may see key ``j`` (the dk/dv kernels walk
                        keys); ``kv_lo == kv_hi``: no query sees it (a padded key)
kv_hi      ``[B, Skv]`` one past the last such query row
exact      ``[B]``      1 where the ranges equal the id test (ids non-decreasing along
                        both sequences, or no ids): kernels then compare ids only in
                        tiles that cross a range end; 0: they compare them everywhere
q_ids      ``[B, Sq]``  segment id of each query, or None (no ids)
kv_ids     ``[B, Skv]`` segment id of each key, or None
q_pos      ``[B, Sq]``  the static layout's row for each query (``q_offset + i``,
                        clipped to ``[0, layout rows)``), or None (row ``i``)
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

    q_lo: jax.Array
    q_hi: jax.Array
    kv_lo: jax.Array
    kv_hi: jax.Array
    exact: jax.Array
    q_ids: jax.Array | None = None
    kv_ids: jax.Array | None = None
    q_pos: jax.Array | None = None

    @property
    def has_ids(self) -> bool:
        return self.q_ids is not None

    @property
    def has_offset(self) -> bool:
        return self.q_pos is not None


def _non_decreasing(x: jax.Array) -> jax.Array:
    """``[B, S] -> [B]``: whether each row never decreases."""
    if x.shape[1] < 2:
        return jnp.ones(x.shape[:1], bool)
    return jnp.all(x[:, 1:] >= x[:, :-1], axis=1)


def _equal_range(sorted_ids: jax.Array, ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per batch row: the range of ``sorted_ids`` equal to each of ``ids`` (``[B, n]`` each)."""
    left = jax.vmap(lambda a, v: jnp.searchsorted(a, v, side="left"))(sorted_ids, ids)
    right = jax.vmap(lambda a, v: jnp.searchsorted(a, v, side="right"))(sorted_ids, ids)
    return left.astype(_I32), right.astype(_I32)


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
    layout_rows: int | None = None,
) -> RuntimeMask | None:
    """The :class:`RuntimeMask` of these arguments, or None when all are None.

    Arguments are the checked arrays of :func:`splat.attention` (ints of any
    width; ``segment_ids [B, Sq]``, ``kv_segment_ids [B, Skv]`` (None: the same
    as ``segment_ids``), lengths ``[B]``, ``q_offset [B]``). Out-of-range
    values are clipped: lengths to ``[0, S]``, positions ``q_offset + i`` to
    ``[0, layout_rows - 1]``. ``layout_rows``: rows of the static layout the
    positions index (needed with ``q_offset``).

    Example:
      >>> import jax.numpy as jnp
      >>> ids = jnp.array([[0, 0, 1, 1, 1]])
      >>> rt = build(1, 5, 5, segment_ids=ids)
      >>> rt.q_lo.tolist(), rt.q_hi.tolist(), rt.exact.tolist()
      ([[0, 0, 2, 2, 2]], [[2, 2, 5, 5, 5]], [1])
    """
    given = (segment_ids, kv_segment_ids, query_seq_lengths, key_value_seq_lengths, q_offset)
    if all(x is None for x in given):
        return None
    q_rows = jnp.arange(q_len, dtype=_I32)[None, :]
    kv_rows = jnp.arange(kv_len, dtype=_I32)[None, :]
    q_lo = jnp.zeros((batch, q_len), _I32)
    q_hi = jnp.full((batch, q_len), kv_len, _I32)
    kv_lo = jnp.zeros((batch, kv_len), _I32)
    kv_hi = jnp.full((batch, kv_len), q_len, _I32)
    exact = jnp.ones((batch,), _I32)
    q_ids = kv_ids = q_pos = None
    if segment_ids is not None:
        q_ids = jnp.asarray(segment_ids).astype(_I32)
        kv_ids = q_ids if kv_segment_ids is None else jnp.asarray(kv_segment_ids).astype(_I32)
        sorted_both = _non_decreasing(q_ids) & _non_decreasing(kv_ids)
        # where both are sorted, a query's keys are one run of equal ids (and vice versa); else
        # the ranges stay whole and kernels compare ids everywhere
        lo, hi = _equal_range(kv_ids, q_ids)
        q_lo = jnp.where(sorted_both[:, None], lo, q_lo)
        q_hi = jnp.where(sorted_both[:, None], hi, q_hi)
        lo, hi = _equal_range(q_ids, kv_ids)
        kv_lo = jnp.where(sorted_both[:, None], lo, kv_lo)
        kv_hi = jnp.where(sorted_both[:, None], hi, kv_hi)
        exact = sorted_both.astype(_I32)
    if query_seq_lengths is not None:
        qn = jnp.clip(jnp.asarray(query_seq_lengths).astype(_I32), 0, q_len)[:, None]
        padded = q_rows >= qn
        q_lo = jnp.where(padded, 0, q_lo)
        q_hi = jnp.where(padded, 0, q_hi)
        kv_hi = jnp.minimum(kv_hi, qn)
    if key_value_seq_lengths is not None:
        kn = jnp.clip(jnp.asarray(key_value_seq_lengths).astype(_I32), 0, kv_len)[:, None]
        padded = kv_rows >= kn
        kv_lo = jnp.where(padded, 0, kv_lo)
        kv_hi = jnp.where(padded, 0, kv_hi)
        q_hi = jnp.minimum(q_hi, kn)
    if q_offset is not None:
        if layout_rows is None:
            raise ValueError("layout_rows is needed with q_offset")
        off = jnp.broadcast_to(jnp.asarray(q_offset).astype(_I32).reshape(-1), (batch,))
        q_pos = jnp.clip(off[:, None] + q_rows, 0, layout_rows - 1)
    # an empty range is [0, 0) everywhere, so lo <= hi always holds
    q_empty, kv_empty = q_hi <= q_lo, kv_hi <= kv_lo
    q_lo, q_hi = jnp.where(q_empty, 0, q_lo), jnp.where(q_empty, 0, q_hi)
    kv_lo, kv_hi = jnp.where(kv_empty, 0, kv_lo), jnp.where(kv_empty, 0, kv_hi)
    return RuntimeMask(q_lo, q_hi, kv_lo, kv_hi, exact, q_ids, kv_ids, q_pos)
