"""Runs of sorted segment ids: where a run of equal ids sits, counted on device (JAX).

Packed documents give each key a non-decreasing segment id; a query of id ``x`` then sees only the
keys whose id is ``x``, one run of positions. :func:`runs` counts the ids below and at most ``x``
(the run's ends) in a few fused elementwise kernels, no loop and no sort; the CUDA forward's
per-block key ranges (:mod:`jax_bindings._cuda.runtime_tables`) and both decode kernels' per-token
document bounds (:func:`document_keys`) are built from it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_I32 = jnp.int32

_CHUNK = 128  # runs' first level: one id in this many


def runs(sorted_ids: jax.Array, x: jax.Array) -> jax.Array:
    """``[B, S], [B, n] -> [B, n, 2]``: how many of each row's ids are < x and <= x (the run of
    positions holding x).

    In two levels, each one comparison and one sum (no loop; a few fused kernels, both counts
    at once): the chunks of :data:`_CHUNK` ids whose first id counts, then the ids of the last
    such chunk. Rows that are not sorted give unspecified counts (the callers discard them)."""
    b, s = sorted_ids.shape
    v = x[:, :, None, None]
    # [B, n, 2]: the chunk heads < x, and <= x
    heads = jnp.stack([sorted_ids[:, None, ::_CHUNK] < x[:, :, None],
                       sorted_ids[:, None, ::_CHUNK] <= x[:, :, None]], axis=2).sum(-1, dtype=_I32)
    start = jnp.maximum(heads - 1, 0) * _CHUNK
    idx = start[..., None] + jnp.arange(_CHUNK, dtype=_I32)  # [B, n, 2, CHUNK]
    chunk = jnp.take_along_axis(sorted_ids, jnp.minimum(idx, s - 1).reshape(b, -1), axis=1).reshape(idx.shape)
    below = jnp.stack([chunk[:, :, 0] < v[:, :, 0], chunk[:, :, 1] <= v[:, :, 0]], axis=2)
    inside = (below & (idx < s)).sum(-1, dtype=_I32)
    return jnp.where(heads > 0, start + inside, 0)


def document_keys(runtime, length: int) -> jax.Array:
    """int32 ``[B, T, 2]``: the keys ``[lo, hi)`` each query's segment id may see: where a batch
    row's ids are sorted (``runtime.exact``, packed documents) its document's run of keys, counted
    as the keys whose id is below, and at most, the query's (:func:`runs`);
    elsewhere ``[0, length)``, the ids then tested key by key."""
    ends = runs(runtime.kv_ids.astype(jnp.int32), runtime.q_ids.astype(jnp.int32))
    sorted_rows = runtime.exact.astype(bool)[:, None, None]
    return jnp.where(sorted_rows, ends, jnp.array([0, length], jnp.int32)).astype(jnp.int32)
