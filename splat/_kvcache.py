"""Attention against a KV cache (decode, speculative decoding, chunked prefill), contiguous or paged.

Named after FlashAttention-3's ``flash_mha_with_kvcache``. A contiguous cache ``[B, Lmax, Hk, D]``
runs through :func:`splat.attention`'s machinery (differentiable; the static mask taken at
``(Lmax, Lmax)`` and the queries at their positions); a paged cache (a page pool and a page table,
as vLLM and FlashInfer keep it) through the dispatcher's ``attention_paged`` op (forward only).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jax_bindings import _dispatch, _runtime
from splat import _runtime_args
from splat._attention import _array, _attend, _check_qk, _check_scale, _layout, _same_dtype

_CONTIGUOUS = "[B, Lmax, Hk, D]"
_PAGED = "[num_pages, page_size, Hk, D]"


# -----------------------------------------------------------------------------
# checks
# -----------------------------------------------------------------------------


def _caches(k_cache, v_cache, paged: bool):
    """``k_cache, v_cache`` checked: 4-D float arrays of one shape and dtype (a positive page size)."""
    form = _PAGED if paged else _CONTIGUOUS
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        if paged and hasattr(x, "shape") and len(x.shape) == 4 and not x.shape[1] >= 1:
            raise ValueError(
                f"page size (axis 1 of {name} {_PAGED}) must be a positive int, got {x.shape[1]}"
            )
    k = _array("k_cache", k_cache, form, 4)
    v = _array("v_cache", v_cache, form, 4)
    if tuple(k.shape) != tuple(v.shape):
        raise ValueError(
            f"k_cache and v_cache must have the same shape {form}, got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    _same_dtype(("k_cache", "v_cache"), (k, v))
    return k, v


def _check_heads(qname: str, q, kname: str, k) -> None:
    """Head dim and head count of ``q [..., H, D]`` against a cache ``[..., Hk, D]``."""
    if k.shape[3] != q.shape[3]:
        raise ValueError(f"{kname} head dim {k.shape[3]} != {qname} head dim {q.shape[3]} (axis 3)")
    if q.shape[2] % k.shape[2]:
        raise ValueError(
            f"{kname} has {k.shape[2]} heads, which must divide the {q.shape[2]} query heads "
            "(GQA/MQA: query head h reads KV head h // (H // Hk))"
        )


def _page_table(page_table, batch: int) -> jax.Array:
    """``page_table``: int32 ``[B, max_pages]`` with ``max_pages >= 1``."""
    if not hasattr(page_table, "shape") or not hasattr(page_table, "dtype"):
        raise ValueError(f"page_table must be an int32 array [B, max_pages], got {type(page_table).__name__}")
    if np.dtype(page_table.dtype) != np.int32:
        raise ValueError(f"page_table must have dtype int32 [B, max_pages], got {page_table.dtype}")
    shape = tuple(page_table.shape)
    if len(shape) != 2 or shape[0] != batch or shape[1] < 1:
        raise ValueError(
            f"page_table must have shape [B, max_pages] with B = {batch} and max_pages >= 1, got {shape}"
        )
    return jnp.asarray(page_table)


def _per_row(name: str, x, batch: int) -> jax.Array:
    """An int ``[B]`` or scalar argument, as int32 ``[B]``."""
    shape = tuple(getattr(x, "shape", ()))
    want = shape if shape in ((), (batch,)) else (batch,)
    x = _runtime_args._int_array(name, x, want, "[B] (or a scalar)")
    return jnp.broadcast_to(x.astype(jnp.int32).reshape(-1), (batch,))


def _check_lengths(cache_seqlens, length: int) -> np.ndarray | None:
    """Concrete ``cache_seqlens`` in ``[1, length]``; returns them (int64 ``[B]`` or ``[1]``), or None."""
    lens = _runtime_args.concrete(cache_seqlens)
    if lens is None:
        return None
    lens = lens.astype(np.int64).reshape(-1)
    bad = (lens < 1) | (lens > length)
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(
            f"cache_seqlens must lie in [1, {length}] (the new queries' own keys are in the cache, which "
            f"holds {length} keys), got {int(lens[i])} (batch row {i})"
        )
    return lens


def _check_pages(page_table, lens: np.ndarray | None, n_pages: int, page_size: int, extra: int = 0) -> None:
    """Concrete page ids of the pages that hold (or receive) keys lie in ``[0, n_pages)``.

    Row ``b``'s pages below ``ceil((lens[b] + extra) / page_size)`` are checked; nothing without
    concrete ``lens`` and ``page_table``.
    """
    table = _runtime_args.concrete(page_table)
    if table is None or lens is None:
        return
    used = -(-(np.broadcast_to(lens, table.shape[:1]) + extra) // page_size)  # [B]
    live = np.arange(table.shape[1])[None, :] < used[:, None]
    bad = live & ((table < 0) | (table >= n_pages))
    if bad.any():
        b, j = (int(x) for x in np.argwhere(bad)[0])
        raise ValueError(
            f"page_table[{b}, {j}] = {int(table[b, j])} is not a page of the pool (pages 0 .. {n_pages - 1} "
            f"of k_cache {_PAGED}); it holds keys {j * page_size} .. {(j + 1) * page_size - 1} of row {b}"
        )


# -----------------------------------------------------------------------------
# public API
# -----------------------------------------------------------------------------


def attention_with_kvcache(
    query: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    mask=None,
    *,
    cache_seqlens: jax.Array | int,
    page_table: jax.Array | None = None,
    q_offset: jax.Array | int | None = None,
    segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    logits_soft_cap: float | None = None,
    scale: float | None = None,
    backend: str = "auto",
) -> jax.Array:
    """Attention of new queries against a KV cache: decode, speculative decoding, chunked prefill.

    Query ``i`` of batch row ``b`` sits at position ``q_offset[b] + i`` and sees key ``j`` where the
    static ``mask`` holds at ``(q_offset[b] + i, j)``, ``j < cache_seqlens[b]``, and (with ids)
    ``segment_ids[b, i] == kv_segment_ids[b, j]``. The queries' own keys are already in the cache
    (write them first with :func:`update_kvcache`). A query that sees no key outputs 0.

    Two cache layouts:

    * contiguous (``page_table=None``): ``k_cache, v_cache: [B, Lmax, Hk, D]``, key ``j`` of row
      ``b`` at ``k_cache[b, j]``. Runs as :func:`splat.attention` does: differentiable in
      ``query``, ``k_cache`` and ``v_cache``, under ``jit``, ``vmap`` and ``grad``.
    * paged: ``k_cache, v_cache: [num_pages, page_size, Hk, D]``, a page pool shared by the batch
      rows; logical key ``j`` of row ``b`` lives at ``k_cache[page_table[b, j // page_size],
      j % page_size]``. Forward only (serving): ``jax.grad`` through it raises; ``jit`` and ``vmap``
      work (a vmapped page pool ``[V, num_pages, ...]`` is one pool per mapped row).

    The static mask is taken on the square ``L x L`` layout, ``L = Lmax`` (contiguous) or
    ``max_pages * page_size`` (paged), analysed once per ``(mask, L)``: positions, lengths and page
    tables are traced values, so changing them never recompiles.

    Bad values. Shapes and dtypes are always checked. Where a value is concrete (not traced) it is
    checked too and a ``ValueError`` names it: ``q_offset < 0`` or ``q_offset + Sq > L`` (the default
    ``q_offset`` too: ``cache_seqlens < Sq``), ``cache_seqlens`` outside ``[1, L]``, and
    ``page_table`` entries outside ``[0, num_pages)`` among the pages that hold valid keys (pages
    below ``ceil(cache_seqlens / page_size)``; the others are never read). Under ``jit`` the values
    are traced and cannot be checked; then a query whose position falls outside ``[0, L)`` sees no
    key and outputs 0, lengths are clipped to ``[0, L]``, and keys on a page id outside ``[0,
    num_pages)`` are not seen (nothing is read out of bounds). Keys at or past ``cache_seqlens`` are
    never read into a result, whatever they hold (a stale or NaN tail is harmless).

    Args:
      query: ``[B, Sq, H, D]``, float32, bfloat16 or float16. ``Sq = 1`` for decode, a few for
        speculative decoding, any for a chunk of prefill.
      k_cache: ``[B, Lmax, Hk, D]`` (contiguous) or ``[num_pages, page_size, Hk, D]`` (paged), the
        dtype of ``query``; ``Hk`` divides ``H`` (GQA/MQA: query head ``h`` reads KV head
        ``h // (H // Hk)``).
      v_cache: like ``k_cache``.
      mask: the static mask, as :func:`splat.attention` takes it (None: full; a
        :class:`splat.masks.Mask`, a function ``f(q_idx, kv_idx)``, a boolean ``[L, L]`` array, an
        :class:`acsr.ACSR` layout of shape ``(L, L)``), taken at (query position, key position).
      cache_seqlens: int ``[B]`` or a scalar: keys ``0 .. cache_seqlens[b] - 1`` are valid (the new
        queries' keys included).
      page_table: int32 ``[B, max_pages]``, or None for a contiguous cache.
      q_offset: int ``[B]`` or a scalar: the position of query 0; default ``cache_seqlens - Sq``
        (the queries are the newest tokens: a causal mask is bottom-right aligned, as in
        FlashAttention-3).
      segment_ids: int ``[B, Sq]`` (int32 or narrower): the queries' ids.
      kv_segment_ids: int ``[B, L]``: the ids of the keys at logical positions ``0 .. L - 1``
        (given together with ``segment_ids``).
      logits_soft_cap: a static positive number ``c``: scores ``z`` become ``c * tanh(z / c)``.
      scale: positive multiplier of the scores; default ``1 / sqrt(D)``.
      backend: as :func:`splat.attention` takes it. On CPU both layouts run on the pure-JAX
        backend; a backend that cannot take a paged cache refuses it and ``"auto"`` moves on.

    Returns:
      ``[B, Sq, H, D]`` in the dtype of ``query``.

    Example:
      >>> import jax, jax.numpy as jnp, splat
      >>> kc, vc = jnp.zeros((2, 2, 64, 1, 16))                     # contiguous, [B, Lmax, Hk, D]
      >>> k1, v1, q1 = jax.random.normal(jax.random.key(0), (3, 2, 1, 1, 16))
      >>> lens = jnp.array([5, 9])                                  # tokens already in the cache
      >>> kc, vc = splat.update_kvcache(kc, vc, k1, v1, lens)       # the new token at position lens
      >>> out = splat.attention_with_kvcache(q1, kc, vc, splat.masks.causal(), cache_seqlens=lens + 1)
      >>> out.shape
      (2, 1, 1, 16)
    """
    _dispatch.check_backend(backend)
    paged = page_table is not None
    q = _array("query", query, "[B, Sq, H, D]", 4)
    k, v = _caches(k_cache, v_cache, paged)
    _same_dtype(("query", "k_cache", "v_cache"), (q, k, v))
    if paged:
        _check_heads("query", q, "k_cache", k)
    else:
        _check_qk("query", q, "k_cache", k)
    (b, sq), d = q.shape[:2], q.shape[3]
    if paged:
        table = _page_table(page_table, b)
        n_pages, page_size = k.shape[:2]
        length = table.shape[1] * page_size
    else:
        length = k.shape[1]
    lens = _per_row("cache_seqlens", cache_seqlens, b)
    known = _check_lengths(cache_seqlens, length)
    if paged:
        _check_pages(page_table, known, n_pages, page_size)
    if q_offset is None:
        if known is not None and (known < sq).any():
            i = int(np.argmax(known < sq))
            raise ValueError(
                f"cache_seqlens = {int(known[i])} (batch row {i}) is below Sq = {sq}: the queries are "
                "the newest tokens and their keys must be in the cache (q_offset defaults to "
                "cache_seqlens - Sq); pass q_offset to place them elsewhere"
            )
        offset = lens - sq
    else:
        offset = _per_row("q_offset", q_offset, b)
        _runtime_args.check_offset(q_offset, sq, length)
    seg = kv_seg = None
    if (segment_ids is None) != (kv_segment_ids is None):
        given = "segment_ids" if kv_segment_ids is None else "kv_segment_ids"
        raise ValueError(
            f"{given} was given alone: pass segment_ids [B, Sq] (the queries' ids) and kv_segment_ids "
            f"[B, L] (the ids of the cache's keys) together"
        )
    if segment_ids is not None:
        seg = _runtime_args._int_array("segment_ids", segment_ids, (b, sq), "[B, Sq]", ids=True)
        kv_seg = _runtime_args._int_array("kv_segment_ids", kv_segment_ids, (b, length), "[B, L]", ids=True)
    s = _check_scale(scale, 1.0 / math.sqrt(d))
    cap = _runtime_args.check_soft_cap(logits_soft_cap)
    runtime = _runtime.build(
        b,
        sq,
        length,
        segment_ids=seg,
        kv_segment_ids=kv_seg,
        key_value_seq_lengths=lens,
        q_offset=offset,
        layout_rows=length,
    )
    layout = _layout(mask, length, length)
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    if paged:
        return _dispatch.attention_paged(q, k, v, table, layout, s, backend, runtime=runtime, soft_cap=cap)
    return _attend(q, k, v, layout, s, backend, runtime=runtime, soft_cap=cap)


def update_kvcache(
    k_cache: jax.Array,
    v_cache: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    cache_seqlens: jax.Array | int,
    *,
    page_table: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Writes new tokens' keys and values into a KV cache; returns the updated ``(k_cache, v_cache)``.

    Row ``b``'s new tokens go to logical positions ``cache_seqlens[b] .. cache_seqlens[b] + Sn - 1``:
    ``cache_seqlens`` is the length BEFORE the new tokens (then call
    :func:`attention_with_kvcache` with ``cache_seqlens + Sn``). A functional update: under
    ``jax.jit`` donate the caches (``jax.jit(step, donate_argnums=...)``) so XLA writes in place
    instead of copying them every step.

    Where ``cache_seqlens`` (and ``page_table``) are concrete, a write past the cache, a negative
    length, or a page id outside ``[0, num_pages)`` among the pages written raises ``ValueError``;
    traced, such writes are dropped (nothing is written out of bounds).

    Args:
      k_cache, v_cache: ``[B, Lmax, Hk, D]`` (contiguous) or ``[num_pages, page_size, Hk, D]``
        (paged, with ``page_table``).
      k_new, v_new: ``[B, Sn, Hk, D]`` in the caches' dtype.
      cache_seqlens: int ``[B]`` or a scalar: tokens in the cache before this write.
      page_table: int32 ``[B, max_pages]`` for a paged cache (logical key ``j`` of row ``b`` at
        ``k_cache[page_table[b, j // page_size], j % page_size]``), else None.

    Returns:
      ``(k_cache, v_cache)`` with the new tokens written.

    Example:
      >>> import jax.numpy as jnp, splat
      >>> pool = jnp.zeros((4, 8, 1, 2))                            # 4 pages of 8 tokens
      >>> table = jnp.array([[2, 0]], jnp.int32)                    # row 0: pages 2 then 0
      >>> new = jnp.ones((1, 3, 1, 2))
      >>> kp, vp = splat.update_kvcache(pool, pool, new, new, jnp.array([7]), page_table=table)
      >>> kp[2, 7, 0, 0].item(), kp[0, 1, 0, 0].item(), kp[0, 2, 0, 0].item()   # positions 7, 8, 9
      (1.0, 1.0, 0.0)
    """
    paged = page_table is not None
    k, v = _caches(k_cache, v_cache, paged)
    kn = _array("k_new", k_new, "[B, Sn, Hk, D]", 4)
    vn = _array("v_new", v_new, "[B, Sn, Hk, D]", 4)
    if tuple(kn.shape) != tuple(vn.shape):
        raise ValueError(
            f"k_new and v_new must have the same shape, got {tuple(kn.shape)} and {tuple(vn.shape)}"
        )
    _same_dtype(("k_cache", "v_cache", "k_new", "v_new"), (k, v, kn, vn))
    if tuple(kn.shape[2:]) != tuple(k.shape[2:]):
        raise ValueError(
            f"k_new heads and head dim {tuple(kn.shape[2:])} != k_cache's {tuple(k.shape[2:])} (axes 2, 3)"
        )
    b, sn = kn.shape[:2]
    if paged:
        table = _page_table(page_table, b)
        n_pages, page_size = k.shape[:2]
        length = table.shape[1] * page_size
    else:
        if k.shape[0] != b:
            raise ValueError(f"k_new batch {b} != k_cache batch {k.shape[0]} (axis 0)")
        length = k.shape[1]
    lens = _per_row("cache_seqlens", cache_seqlens, b)
    known = _runtime_args.concrete(cache_seqlens)
    if known is not None:
        known = known.astype(np.int64).reshape(-1)
        bad = (known < 0) | (known + sn > length)
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(
                f"cache_seqlens + Sn must lie in [Sn, {length}] (the cache holds {length} keys; "
                f"cache_seqlens is the length before the {sn} new tokens), got cache_seqlens = "
                f"{int(known[i])} (batch row {i})"
            )
        if paged:
            _check_pages(page_table, known, n_pages, page_size, extra=sn)
    pos = lens[:, None] + jnp.arange(sn, dtype=jnp.int32)[None, :]  # [B, Sn] logical positions
    inside = (pos >= 0) & (pos < length)
    if paged:
        # a write that cannot land goes to index n_pages, which mode="drop" drops (a negative index
        # would count from the end)
        slot = jnp.where(inside, pos % page_size, 0)
        page = jnp.take_along_axis(table, jnp.where(inside, pos // page_size, 0), axis=1)
        page = jnp.where(inside & (page >= 0) & (page < n_pages), page, n_pages)
        idx = (page, slot)
    else:
        idx = (jnp.arange(b)[:, None], jnp.where(inside, pos, length))
    k = jnp.asarray(k).at[idx].set(jnp.asarray(kn), mode="drop")
    v = jnp.asarray(v).at[idx].set(jnp.asarray(vn), mode="drop")
    return k, v


__all__ = ["attention_with_kvcache", "update_kvcache"]
