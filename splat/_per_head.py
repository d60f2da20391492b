"""Per-head static masks: one mask per query head or per KV-head group, run as one call per distinct mask.

``mask=`` of :func:`splat.attention` may be a sequence (list or tuple) of ``H`` or ``Hk`` masks, each
anything ``mask=`` takes, or a boolean array ``[H or Hk, Sq, Skv]`` (a leading axis of size 1 allowed).
Heads whose masks analyse to the same :class:`acsr.ACSR` form one group (layouts are hashable values);
each group runs the single-mask path once on its query heads, and the outputs go back in head order.

A group made of whole KV groups keeps GQA (its query heads read their KV heads); otherwise each query
head of the group gets its own K/V slice (``k[:, :, h // G]``). The kernels take one layout per launch,
so there is one launch per distinct mask; every head with the same mask is the single-mask path itself.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from acsr import ACSR


def head_masks(mask) -> tuple | None:
    """The per-head entries of ``mask``, or None when it is one mask shared by all heads.

    A list or tuple is per head; a boolean array is per head when, after leading axes of size 1 are
    dropped down to three, its first axis of three is longer than 1. Per-batch arrays (``[B, ...]``
    with ``B > 1``) and traced ones are left to the single-mask checks, which refuse them.
    """
    if isinstance(mask, (list, tuple)):
        if not mask:
            raise ValueError("mask is an empty sequence: pass one mask per query head or per KV head")
        return tuple(mask)
    if isinstance(mask, ACSR) or isinstance(mask, jax.core.Tracer):
        return None
    if not (hasattr(mask, "shape") and hasattr(mask, "dtype")) or len(mask.shape) < 3:
        return None
    shape = tuple(mask.shape)
    core = shape
    while len(core) > 3 and core[0] == 1:
        core = core[1:]
    if all(n == 1 for n in core[:-2]):
        return None  # one mask with leading axes of size 1: today's path
    if len(core) > 3:
        return None  # per batch: the single-mask checks refuse it
    if np.dtype(mask.dtype) != np.bool_:
        raise TypeError(f"mask array must be boolean, got dtype {mask.dtype}")
    a = np.asarray(mask).reshape(core)
    return tuple(a[i] for i in range(core[0]))


def query_head_layouts(entries: tuple, q_len: int, kv_len: int, heads: int, kv_heads: int) -> tuple:
    """One :class:`acsr.ACSR` per query head from ``H`` or ``Hk`` per-head ``entries``."""
    from splat._attention import _layout

    n = len(entries)
    if n not in (heads, kv_heads):
        what = f"{heads} query heads" if heads == kv_heads else f"{heads} query heads or {kv_heads} KV heads"
        raise ValueError(
            f"mask has {n} per-head masks but the attention has {what}: pass one mask per query head "
            "(H) or per KV-head group (Hk), or one mask for all heads"
        )
    layouts = []
    for i, m in enumerate(entries):
        if isinstance(m, (list, tuple)):
            raise TypeError(f"mask[{i}] is a {type(m).__name__}: per-head masks do not nest")
        try:
            layouts.append(_layout(m, q_len, kv_len))
        except (TypeError, ValueError) as e:
            raise type(e)(f"mask[{i}]: {e}") from e
    if n != heads:  # one per KV head: query head h reads KV head h // G
        g = heads // kv_heads
        layouts = [layouts[h // g] for h in range(heads)]
    return tuple(layouts)


def groups(layouts: tuple[ACSR, ...]) -> tuple[tuple[ACSR, tuple[int, ...]], ...]:
    """``(layout, heads)`` per distinct layout, in the order of each one's first head."""
    found: dict[ACSR, list[int]] = {}
    for h, lay in enumerate(layouts):
        found.setdefault(lay, []).append(h)
    return tuple((lay, tuple(hs)) for lay, hs in found.items())


def _heads(x: jax.Array, idx) -> jax.Array:
    """``x[:, :, idx]`` for static ``idx``: a slice where the heads are consecutive."""
    idx = tuple(int(i) for i in idx)
    if idx == tuple(range(idx[0], idx[0] + len(idx))):
        return x[:, :, idx[0] : idx[0] + len(idx)]
    return jnp.take(x, np.asarray(idx, np.int32), axis=2)


def attend(q, k, v, layouts: tuple[ACSR, ...], scale: float, backend: str, *, runtime, soft_cap):
    """Attention with layout ``layouts[h]`` for query head ``h``: one single-mask call per group.

    ``q: [B, Sq, H, D]``, ``k, v: [B, Skv, Hk, D]``; the arguments past ``layouts`` as
    :func:`splat._attention._attend` takes them (the runtime mask is per batch row, shared by all
    heads). Returns ``[B, Sq, H, D]``.
    """
    from splat._attention import _attend

    h, hk = q.shape[2], k.shape[2]
    g = h // hk
    outs, order = [], []
    for lay, hs in groups(layouts):
        kvs = sorted({i // g for i in hs})
        if len(hs) == len(kvs) * g:  # whole KV groups: GQA inside the group
            kv_idx = kvs
        else:  # part of a KV group: each query head gets its own K/V slice
            kv_idx = [i // g for i in hs]
        qg, kg, vg = _heads(q, hs), _heads(k, kv_idx), _heads(v, kv_idx)
        outs.append(_attend(qg, kg, vg, lay, scale, backend, runtime=runtime, soft_cap=soft_cap))
        order.extend(hs)
    out = jnp.concatenate(outs, axis=2)
    if order == sorted(order):
        return out
    return jnp.take(out, np.argsort(np.asarray(order)).astype(np.int32), axis=2)
