"""A runtime mask as the CUDA kernels read it: lengths, segment ids and per-block ranges (JAX).

The generated kernels (:mod:`jax_bindings._cuda.source`, :mod:`jax_bindings._cuda.bwd_source`)
AND a :class:`~jax_bindings._runtime.RuntimeMask` with their baked-in band. They take its
lengths and ids as they are, and, with ids, the runs of keys (forward) or query rows
(backward) each block can see, built here on device in O(B * S / 128 * (S / 128 + 128))
elementwise work fused into a few kernels:

=============  ==============  ===============================================================
array          shape           meaning
=============  ==============  ===============================================================
rt_lens        ``[B, 2]``      ``q_len``, ``kv_len``; with queries at run-time positions (the
                               forward's ``shifted`` kernels) ``[B, 4]``: the end of the rows
                               that see keys, ``kv_len``, the layout row of query 0 (``shift``)
                               and the first row that sees keys (:func:`shifted_lens`)
rt_q_ids       ``[B, Sq]``     segment id of each query (backward: padded to whole query blocks,
                               which its producer copies with each step's Q and dO)
rt_kv_ids      ``[B, Skv]``    segment id of each key (forward: padded to whole key tiles of
                               ``block_n``, which its producer copies with each K tile)
rt_ranges      ``[B, n, 4]``   forward: per row block of ``source.BM`` rows, keys ``[x, y)``
                               that a row of it may see and keys ``[z, w)`` that every row sees
                               (as far as ids go; tiles inside skip the id test). Backward: per
                               key block of ``block_n`` keys, the same in query rows
rt_leads       ``[B, nq, 2]``  backward: per query block of ``bwd_source.BM`` rows, the first
                               and the last key block whose ``rt_ranges`` walk covers it (-1:
                               none): the one that adds to its dQ first, in either key order
=============  ==============  ===============================================================

Where ``exact[b]`` is set (both id arrays non-decreasing: packed documents) the runs come from
counting the other side's ids below each block's first and last id
(:func:`jax_bindings._id_runs.runs`), so the kernels skip the tiles outside a block's documents.
Elsewhere a block may see anything (``[0, S)``, no tile id-free): any ids are exact, sorted ones
fast. The kernels apply the lengths themselves.

The backward adds dQ in a fixed order, each query block's key blocks one after another from
the last or from the first (its key order, :mod:`jax_bindings._cuda.bwd_source`), which needs
the key blocks that walk a query block to be consecutive. With sorted ids, both ends of a key
block's run of query blocks, ``x // BM`` and ``max(x, y - 1) // BM``, never decrease from one
key block to the next, and the run is never empty: so the key blocks covering a query block are
consecutive. ``rt_leads`` holds the first of them and the last.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_bindings import _id_runs as id_runs
from jax_bindings._cuda import bwd_source, source
from jax_bindings._runtime import RuntimeMask

_I32 = jnp.int32


def kind(runtime: RuntimeMask | None, *, positions: bool = False) -> str:
    """The kernels' runtime kind (a key of :data:`source.RUNTIMES`) for ``runtime``, or
    NotImplementedError naming what they cannot take. ``positions``: the caller takes queries
    at run-time positions that run on from an offset (``q_start``, the forward's shifted
    kernels); else query positions are refused."""
    if runtime is None:
        return ""
    if runtime.q_pos is not None and not positions:
        raise NotImplementedError("the cuda kernels take query positions (q_offset) in the forward only")
    if runtime.q_pos is not None and runtime.q_start is None:
        raise NotImplementedError(
            "the cuda forward takes query positions that run on from an offset (q_offset), "
            "not given one by one")
    return "ids" if runtime.q_ids is not None else "lengths"


def _ranges(exact, own_ids, other_ids, block: int) -> jax.Array:
    """``[B, n, 4]``: per block of ``block`` of ``own_ids``, the run of ``other_ids`` positions
    whose id any element of the block has, and the run every element has (sorted rows); ``[0,
    S_other)`` and an empty run where ``exact`` is 0."""
    b, s = own_ids.shape
    s_other = other_ids.shape[1]
    first = jnp.arange(0, s, block)
    last = jnp.minimum(first + block - 1, s - 1)
    n = first.size
    ends = id_runs.runs(other_ids, jnp.concatenate([own_ids[:, first], own_ids[:, last]], axis=1))
    a, z = ends[:, :n], ends[:, n:]  # the runs of each block's first and last id
    runs = jnp.stack([a[..., 0], z[..., 1], z[..., 0], a[..., 1]], axis=-1)
    anything = jnp.broadcast_to(jnp.array([0, s_other, 0, 0], _I32), runs.shape)
    return jnp.where(exact.astype(bool)[:, None, None], runs, anything)


def lens(runtime: RuntimeMask) -> jax.Array:
    """``rt_lens [B, 2]``."""
    return jnp.stack([runtime.q_len, runtime.kv_len], axis=1).astype(_I32)


def shifted_lens(runtime: RuntimeMask, layout_rows: int) -> jax.Array:
    """``rt_lens [B, 4]`` of queries at run-time positions ``q_start + i`` in a layout of
    ``layout_rows`` rows: ``(q_end, kv_len, q_start, q_first)``, the rows ``[q_first, q_end)``
    being those inside ``q_len`` whose position is inside the layout (the rest see no key, as
    ``q_pos = -1`` says)."""
    start = runtime.q_start.astype(_I32)
    sq = runtime.q_pos.shape[1]
    end = jnp.clip(jnp.minimum(runtime.q_len, layout_rows - start), 0, sq)
    first = jnp.clip(-start, 0, sq)
    return jnp.stack([end, runtime.kv_len, start, first], axis=1).astype(_I32)


def _padded(ids: jax.Array, block: int) -> jax.Array:
    """``ids [B, S]`` padded with zeros to a whole number of blocks."""
    s = ids.shape[1]
    return jnp.pad(ids, ((0, 0), (0, -(-s // block) * block - s)))


def fwd_arrays(runtime: RuntimeMask, block_n: int, layout_rows: int | None = None) -> tuple[jax.Array, ...]:
    """The forward kernel's runtime arrays (:data:`source.FWD_RUNTIME_ARRAYS` for its kind), for
    a kernel of ``block_n`` keys a tile; ``layout_rows``: the rows of the layout that query
    positions index (needed with them)."""
    r = runtime
    if r.q_pos is not None and layout_rows is None:
        raise ValueError("layout_rows is needed with query positions")
    rt_lens = lens(r) if r.q_pos is None else shifted_lens(r, layout_rows)
    if kind(r, positions=True) == "lengths":
        return (rt_lens,)
    q_ids, kv_ids = r.q_ids.astype(_I32), r.kv_ids.astype(_I32)
    ranges = _ranges(r.exact, q_ids, kv_ids, source.BM)
    return rt_lens, q_ids, _padded(kv_ids, block_n), ranges


def lead_key_blocks(ranges: jax.Array, sq: int) -> jax.Array:
    """``rt_leads [B, nq, 2]`` from the backward's ``rt_ranges``: per query block, the first and
    the last key block whose run of query blocks (``x // BM`` to ``max(x, y - 1) // BM``) covers
    it, -1 if none. Both ends never decrease along the key blocks (module docstring), so the
    first is the first key block whose run ends at or after the query block, if that run starts
    at or before it, and the last the last whose run starts at or before it, if that run
    reaches it."""
    bm = bwd_source.BM
    start = ranges[..., 0] // bm
    end = jnp.maximum(ranges[..., 0], ranges[..., 1] - 1) // bm
    nkv = end.shape[1]
    nq = bwd_source.num_q_blocks(sq)
    blocks = jnp.broadcast_to(jnp.arange(nq, dtype=_I32), (end.shape[0], nq))
    first = id_runs.runs(end, blocks)[..., 0]
    starts = jnp.take_along_axis(start, jnp.minimum(first, nkv - 1), axis=1) <= blocks
    last = id_runs.runs(start, blocks)[..., 1] - 1
    reaches = jnp.take_along_axis(end, jnp.maximum(last, 0), axis=1) >= blocks
    return jnp.stack([jnp.where((first < nkv) & starts, first, -1),
                      jnp.where((last >= 0) & reaches, last, -1)], axis=-1).astype(_I32)


def bwd_arrays(runtime: RuntimeMask, block_n: int) -> tuple[jax.Array, ...]:
    """The backward kernel's runtime arrays (:data:`bwd_source.BWD_RUNTIME_ARRAYS` for its kind), for
    its items of ``block_n`` keys (:func:`bwd_source.block_n`)."""
    r = runtime
    if kind(r) == "lengths":
        return (lens(r),)
    q_ids, kv_ids = r.q_ids.astype(_I32), r.kv_ids.astype(_I32)
    ranges = _ranges(r.exact, kv_ids, q_ids, block_n)
    leads = lead_key_blocks(ranges, q_ids.shape[1])
    return lens(r), _padded(q_ids, bwd_source.BM), kv_ids, ranges, leads
