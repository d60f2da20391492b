"""Checks of :func:`splat.attention`'s runtime mask arguments, and the mask they build.

Shapes and dtypes are checked always, with errors that name the argument.
Values are checked where they are concrete (not traced: outside ``jit``,
``vmap`` and ``grad``): a ``q_offset`` placing a query outside the static
mask's rows raises. Traced values cannot be checked; they get the rule of
:mod:`jax_bindings._runtime`: lengths are clipped to ``[0, S]``, and a query
whose position falls outside the static mask's rows sees no key (output 0).
"""

from __future__ import annotations

import functools
import math
import numbers
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_bindings import _runtime

# ids are compared as int32 in the kernels: wider ids could alias, so they are refused
_ID_DTYPES = ("int8", "int16", "int32", "uint8", "uint16")


def _int_array(name: str, x, shape: tuple[int, ...], form: str, *, ids: bool = False):
    if isinstance(x, bool) or isinstance(x, numbers.Integral):
        x = np.asarray(x)
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be an integer array {form}, got {type(x).__name__}")
    dt = np.dtype(x.dtype)
    if dt.kind not in "iu":
        raise TypeError(f"{name} must have an integer dtype, got {dt}")
    if ids and dt.name not in _ID_DTYPES:
        raise TypeError(
            f"{name} must be int32 or narrower (ids are compared as int32), got {dt}; cast it with "
            ".astype(jnp.int32) if its values fit"
        )
    if tuple(x.shape) != shape:
        raise ValueError(f"{name} must have shape {form} = {shape}, got {tuple(x.shape)}")
    return jnp.asarray(x)


def concrete(x) -> np.ndarray | None:
    """The values of ``x`` as numpy where they are known now, None for a traced value."""
    if x is None or isinstance(x, jax.core.Tracer):
        return None
    return np.asarray(x)


def check_offset(q_offset, q_len: int, rows: int, *, name: str = "q_offset") -> None:
    """A concrete ``q_offset`` ([B] or scalar) must keep the queries ``q_offset + [0, q_len)`` inside
    ``[0, rows)``; a traced one is not checked (positions outside give rows that see no key)."""
    off = concrete(q_offset)
    if off is None:
        return
    off = off.astype(np.int64).reshape(-1)
    if (off < 0).any():
        i = int(np.argmax(off < 0))
        raise ValueError(f"{name} must be >= 0, got {int(off[i])} (batch row {i})")
    past = off + q_len > rows
    if past.any():
        i = int(np.argmax(past))
        raise ValueError(
            f"{name} + Sq must be at most {rows} (the static mask's rows; queries sit at positions "
            f"{name} + [0, Sq)), got {name} = {int(off[i])} with Sq = {q_len} (batch row {i})"
        )


def positive_number(name: str, x) -> float:
    """A static positive finite number (``scale``, ``logits_soft_cap``), or an error naming ``name``."""
    if isinstance(x, jax.core.Tracer):
        raise TypeError(f"{name} must be a static Python number, not a traced value")
    if isinstance(x, bool) or not isinstance(x, numbers.Real | np.ndarray | jax.Array):
        raise TypeError(f"{name} must be a positive finite number, got {type(x).__name__}")
    try:
        v = float(x)
    except TypeError as e:
        raise TypeError(f"{name} must be a positive finite number, got {x!r}") from e
    if not (math.isfinite(v) and v > 0):
        raise ValueError(f"{name} must be a positive finite number, got {v}")
    return v


def check_soft_cap(cap) -> float | None:
    """``logits_soft_cap``: None or a static positive finite number."""
    return None if cap is None else positive_number("logits_soft_cap", cap)


def runtime_mask(
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
) -> _runtime.RuntimeMask | None:
    """Checks the runtime mask arguments (shapes, dtypes) and builds their :class:`RuntimeMask`."""
    seg = kv_seg = qlen = kvlen = off = qpos = None
    if q_offset is not None and q_positions is not None:
        raise ValueError("pass q_offset or q_positions, not both (q_offset + arange(Sq) is a q_positions)")
    if kv_segment_ids is not None and segment_ids is None:
        raise ValueError("kv_segment_ids needs segment_ids (the queries' ids)")
    if segment_ids is not None:
        seg = _int_array("segment_ids", segment_ids, (batch, q_len), "[B, Sq]", ids=True)
        if kv_segment_ids is None and q_len != kv_len:
            raise ValueError(
                f"segment_ids covers {q_len} queries but there are {kv_len} keys: pass kv_segment_ids "
                "[B, Skv] for the keys"
            )
        if kv_segment_ids is not None:
            kv_seg = _int_array("kv_segment_ids", kv_segment_ids, (batch, kv_len), "[B, Skv]", ids=True)
    if query_seq_lengths is not None:
        qlen = _int_array("query_seq_lengths", query_seq_lengths, (batch,), "[B]")
    if key_value_seq_lengths is not None:
        kvlen = _int_array("key_value_seq_lengths", key_value_seq_lengths, (batch,), "[B]")
    if q_offset is not None:
        shape = getattr(q_offset, "shape", ())
        want = tuple(shape) if tuple(shape) in ((), (batch,)) else (batch,)
        off = _int_array("q_offset", q_offset, want, "[B] (or a scalar)")
        check_offset(q_offset, q_len, kv_len)
    if q_positions is not None:
        qpos = _int_array("q_positions", q_positions, (batch, q_len), "[B, Sq]")
    return _runtime.build(
        batch,
        q_len,
        kv_len,
        segment_ids=seg,
        kv_segment_ids=kv_seg,
        query_seq_lengths=qlen,
        key_value_seq_lengths=kvlen,
        q_offset=off,
        q_positions=qpos,
        layout_rows=kv_len,
    )


def kv_positions_array(kv_positions, batch: int, kv_len: int):
    """``kv_positions`` checked: an integer ``[B, Skv]`` array."""
    return _int_array("kv_positions", kv_positions, (batch, kv_len), "[B, Skv]")


class KeysAtColumns(NamedTuple):
    """A runtime mask whose keys sit at run-time columns of the static layout, some sharing one.

    ``mask``: the :class:`~jax_bindings._runtime.RuntimeMask` (with ``q_pos``); ``kv_cols``: int32
    ``[B, Skv]``, non-decreasing along each row: key ``j`` of batch row ``b`` is column
    ``kv_cols[b, j]`` (``Skv``: never seen). No kernel takes keys that share a column, so
    :func:`splat._attention._attend` runs this with :func:`jax_bindings._pure_rows.attention_at_columns`,
    whatever the backend.
    """

    mask: _runtime.RuntimeMask
    kv_cols: jax.Array


@jax.custom_batching.custom_vmap
def everywhere(flag: jax.Array) -> jax.Array:
    """``flag``, a scalar bool that picks the fast branch of a ``lax.cond`` whose branches agree
    where it holds; under ``vmap``, whether it holds for every mapped row, unbatched.

    A batched predicate turns ``lax.cond`` into a ``select`` that runs both branches; the flag
    picks a route, not a value, so one answer for all mapped rows keeps the cond a cond.
    """
    return flag


@everywhere.def_vmap
def _everywhere_vmap(axis_size, in_batched, flag):
    return everywhere(jnp.all(flag) if in_batched[0] else flag), False


def distinct_positions(kv_positions) -> jax.Array:
    """A scalar bool: whether no two keys of a batch row sit at one position inside ``[0, Skv)``
    (:func:`everywhere`: under ``vmap``, in no mapped row either).

    ``O(B * Skv)``: a count of the keys at each position.
    """
    b, skv = kv_positions.shape
    pos = jnp.asarray(kv_positions).astype(jnp.int32)
    column = jnp.where((pos >= 0) & (pos < skv), pos, skv)  # outside: one extra column, not counted
    count = jnp.zeros((b, skv + 1), jnp.int32).at[jnp.arange(b)[:, None], column].add(1)
    return everywhere(jnp.all(count[:, :skv] <= 1))


def place_keys(k, v, kv_positions, kv_segment_ids):
    """Keys and values moved to the static mask's columns their positions name.

    Key ``j`` of batch row ``b`` is column ``kv_positions[b, j]`` of the static mask; a negative
    position (or one at or past ``Skv``) is padding, never seen. Positions inside ``[0, Skv)`` must
    be distinct (:func:`distinct_positions`; otherwise see :func:`sort_keys`). Returns ``(k, v,
    kv_ok, ids)``: ``k, v [B, Skv, Hk, D]`` in column order, ``kv_ok [B, Skv]`` (the columns a key
    sits at), ``ids`` ``kv_segment_ids`` moved alike (None when None).

    Where every seen key already sits at its own index (no padding before it: the common case,
    a cache filled from the start) nothing is moved; a ``lax.cond`` picks that branch on device.
    """
    b, skv = kv_positions.shape
    pos = jnp.asarray(kv_positions).astype(jnp.int32)
    seen = (pos >= 0) & (pos < skv)
    j = jnp.arange(skv, dtype=jnp.int32)[None, :]
    in_place = everywhere(jnp.all(~seen | (pos == j)))
    ids = kv_segment_ids

    def keep():
        return k, v, seen, ids

    def move():
        rows = jnp.arange(b)[:, None]
        target = jnp.where(seen, pos, skv)  # padding goes to a dropped column
        src = jnp.zeros((b, skv + 1), jnp.int32).at[rows, target].set(jnp.broadcast_to(j, (b, skv)))
        has = jnp.zeros((b, skv + 1), bool).at[rows, target].set(seen)[:, :skv]
        src = src[:, :skv]
        take = functools.partial(jnp.take_along_axis, axis=1)
        k2 = take(k, src[:, :, None, None])
        v2 = take(v, src[:, :, None, None])
        ids2 = None if ids is None else take(ids, src)
        return k2, v2, has, ids2

    return jax.lax.cond(in_place, keep, move)


def sort_keys(k, v, kv_positions, kv_segment_ids):
    """Keys and values in the order of their positions, which may repeat: ``(k, v, kv_ok, ids,
    kv_cols)``, as :func:`place_keys` returns them, and ``kv_cols`` int32 ``[B, Skv]`` the sorted
    positions (``Skv`` for padding, sorted last): the columns of :class:`KeysAtColumns`."""
    skv = kv_positions.shape[1]
    pos = jnp.asarray(kv_positions).astype(jnp.int32)
    cols = jnp.where((pos >= 0) & (pos < skv), pos, skv)
    order = jnp.argsort(cols, axis=1, stable=True)
    take = functools.partial(jnp.take_along_axis, axis=1)
    ids = None if kv_segment_ids is None else take(kv_segment_ids, order)
    cols = take(cols, order)
    return take(k, order[:, :, None, None]), take(v, order[:, :, None, None]), cols < skv, ids, cols


def key_ids(segment_ids, kv_ids, kv_ok, q_len: int):
    """``(segment_ids, kv_segment_ids)`` int32 with the keys outside ``kv_ok`` as padding: ids
    doubled (even), padding odd, never equal to a query's id; without ids, queries 0 and padding 1."""
    if kv_ids is None:
        return jnp.zeros((kv_ok.shape[0], q_len), jnp.int32), jnp.where(kv_ok, 0, 1).astype(jnp.int32)
    return 2 * segment_ids.astype(jnp.int32), jnp.where(kv_ok, 2 * kv_ids, 1).astype(jnp.int32)


def key_positions_args(k, kv_positions, segment_ids, kv_segment_ids, q_len: int):
    """:func:`splat.attention`'s ``kv_positions`` and segment ids checked: ``(kv_positions,
    segment_ids, kv_ids)``, ``kv_ids`` int32 ``[B, Skv]`` or None (no ids)."""
    b, skv = k.shape[:2]
    pos = kv_positions_array(kv_positions, b, skv)
    if segment_ids is not None:
        segment_ids = _int_array("segment_ids", segment_ids, (b, q_len), "[B, Sq]", ids=True)
        ids = segment_ids if kv_segment_ids is None else kv_segment_ids
        if kv_segment_ids is None and q_len != skv:
            raise ValueError(
                f"segment_ids covers {q_len} queries but there are {skv} keys: pass kv_segment_ids "
                "[B, Skv] for the keys"
            )
        ids = _int_array("kv_segment_ids", ids, (b, skv), "[B, Skv]", ids=True).astype(jnp.int32)
    elif kv_segment_ids is not None:
        raise ValueError("kv_segment_ids needs segment_ids (the queries' ids)")
    else:
        ids = None
    return pos, segment_ids, ids
