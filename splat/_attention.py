"""Public sparse attention and the unfused sparse ops: input checks, then the backend seam."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from acsr import ACSR
from jax_bindings import _dispatch, _pure_rows
from splat import _per_head, _runtime_args

_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
_DTYPE_NAMES = "float32, bfloat16 or float16"


# -----------------------------------------------------------------------------
# checks
# -----------------------------------------------------------------------------


def _array(name: str, x, form: str, ndim: int, *, slots: bool = False):
    """Checks an array argument; ``slots``: its last axis is ``nnz_max``, which may be 0."""
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be a jax or numpy array {form}, got {type(x).__name__}")
    if x.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D {form}, got shape {tuple(x.shape)}")
    if any(n == 0 for n in (x.shape[:-1] if slots else x.shape)):
        raise ValueError(f"{name} must have no empty axis {form}, got shape {tuple(x.shape)}")
    if jnp.dtype(x.dtype) not in [jnp.dtype(d) for d in _DTYPES]:
        raise TypeError(f"{name} must have dtype {_DTYPE_NAMES}, got {x.dtype}")
    return x


def _same_dtype(names: tuple[str, ...], arrays) -> None:
    dtypes = [jnp.dtype(a.dtype) for a in arrays]
    if len(set(dtypes)) > 1:
        got = ", ".join(f"{n}={d}" for n, d in zip(names, dtypes, strict=True))
        raise TypeError(f"{', '.join(names)} must share one dtype, got {got}; cast them first")


def _check_qk(qname: str, q, kname: str, k) -> None:
    """q: [B, Sq, H, D] against k: [B, Skv, Hk, D]."""
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"{kname} batch {k.shape[0]} != {qname} batch {q.shape[0]} (axis 0 of [B, S, H, D])")
    if k.shape[3] != q.shape[3]:
        raise ValueError(
            f"{kname} head dim {k.shape[3]} != {qname} head dim {q.shape[3]} (axis 3 of [B, S, H, D])"
        )
    if q.shape[2] % k.shape[2]:
        raise ValueError(
            f"{kname} has {k.shape[2]} heads, which must divide the {q.shape[2]} query heads "
            "(GQA/MQA: query head h reads KV head h // (H // Hk))"
        )


def _check_scale(scale, default: float) -> float:
    return default if scale is None else _runtime_args.positive_number("scale", scale)


def _layout(mask, q_len: int, kv_len: int) -> ACSR:
    """The ACSR layout for ``mask=`` (None = full) and these sizes."""
    from splat._analyzer import analyze

    if isinstance(mask, jax.core.Tracer):
        raise TypeError(
            "mask is a traced jax value: splat needs the mask when the function is traced, not at run "
            "time. A mask built inside the model from index comparisons (jnp.arange(S)[:, None] >= "
            "jnp.arange(S)[None, :], ...): decorate the model's attention with @splat.sparsify, which "
            "finds such masks at trace time. Otherwise pass a splat.masks constructor (masks.causal(), "
            "masks.sliding_window(...), ...), a numpy array, or a jax array computed outside jit. Masks "
            "that depend on the data go in the runtime arguments: segment_ids / kv_segment_ids (packed "
            "documents, key padding), query_seq_lengths / key_value_seq_lengths (padding), q_offset (decode)"
        )
    if hasattr(mask, "shape") and hasattr(mask, "dtype") and not isinstance(mask, ACSR):
        if np.dtype(mask.dtype) != np.bool_:
            raise TypeError(f"mask array must be boolean, got dtype {mask.dtype}")
        shape = tuple(mask.shape)
        if len(shape) > 2 and shape[-2:] == (q_len, kv_len) and any(n != 1 for n in shape[:-2]):
            raise ValueError(
                f"mask array has shape {shape}: per-batch masks are not supported; splat "
                f"takes one mask [q_len, kv_len] = [{q_len}, {kv_len}] shared by all heads and batch rows "
                "(leading axes of size 1 allowed), or, in splat.attention without sequence_axis, one "
                "per head: [H, q_len, kv_len] or [Hk, q_len, kv_len] (or a list of H or Hk masks). If "
                "every batch row has the same masks, pass mask[0] of [B, H, S, S]"
            )
        core = shape[-2:] if len(shape) >= 2 and all(n == 1 for n in shape[:-2]) else None
        if core != (q_len, kv_len):
            raise ValueError(
                f"mask array must have shape (q_len, kv_len) = ({q_len}, {kv_len}) "
                f"(leading axes of size 1 allowed), got {shape}"
            )
    if isinstance(mask, ACSR) and mask.shape != (q_len, kv_len):
        raise ValueError(
            f"mask layout is {mask.q_len} x {mask.kv_len} but the attention is "
            f"{q_len} x {kv_len} (q_len x kv_len)"
        )
    return analyze(mask, q_len, kv_len)


def _check_layout(name: str, layout) -> ACSR:
    if not isinstance(layout, ACSR):
        raise TypeError(
            f"{name} must be an acsr.ACSR layout (build one with splat.analyze(mask, q_len, kv_len)), "
            f"got {type(layout).__name__}"
        )
    return layout


# -----------------------------------------------------------------------------
# public API
# -----------------------------------------------------------------------------


def attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    mask=None,
    *,
    scale: float | None = None,
    segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    query_seq_lengths: jax.Array | None = None,
    key_value_seq_lengths: jax.Array | None = None,
    q_offset: jax.Array | int | None = None,
    logits_soft_cap: float | None = None,
    backend: str = "auto",
    q_positions: jax.Array | None = None,
    kv_positions: jax.Array | None = None,
    sequence_axis=None,
) -> jax.Array:
    """Sparse multi-head attention: ``softmax(scale * q k^T, masked) v``.

    Works under ``jax.jit``, ``jax.vmap`` and ``jax.grad``. The static ``mask``
    must be known at trace time: its geometry is compiled into the kernels.
    What changes with the data -- packed documents, padding, the position of
    a decode step -- goes in the runtime arguments, traced arrays that may
    differ per batch row and per call with one compile for any values; they
    are AND-ed with ``mask``. A query row left with no key outputs 0 (and gets
    zero gradients).

    Args:
      query: ``[B, Sq, H, D]``, float32, bfloat16 or float16.
      key: ``[B, Skv, Hk, D]``, same dtype; ``Hk`` divides ``H`` (GQA/MQA:
        query head ``h`` reads key head ``h // (H // Hk)``).
      value: ``[B, Skv, Hk, D]``, like ``key``.
      mask: None (full attention), a :class:`splat.masks.Mask`, a boolean
        ``[Sq, Skv]`` array, a function ``f(q_idx, kv_idx)``, or an
        :class:`acsr.ACSR` layout; ``True`` = attend. Per head: a list or
        tuple of ``H`` (one per query head) or ``Hk`` (one per KV-head group)
        such masks, or a boolean ``[H or Hk, Sq, Skv]`` array (a leading axis
        of size 1 allowed). Heads with equal masks share a layout; each
        distinct mask is one call on its heads.
      scale: positive multiplier of the scores; default ``1 / sqrt(D)``.
      segment_ids: int ``[B, Sq]`` (int32 or narrower): query ``i`` sees key
        ``j`` only where ``segment_ids[b, i] == kv_segment_ids[b, j]``
        (packed documents). Any values are exact; non-decreasing ids are the
        fast case (kernels skip tiles outside a row's document).
      kv_segment_ids: int ``[B, Skv]``; default ``segment_ids`` (then
        ``Sq == Skv``). A key padding mask ``valid [B, Skv]`` is
        ``segment_ids=zeros([B, Sq]), kv_segment_ids=where(valid, 0, 1)``
        (sorted where the padding is at the end: the fast case).
      query_seq_lengths: int ``[B]``: query rows at or past the length are
        padding and output 0. Clipped to ``[0, Sq]``.
      key_value_seq_lengths: int ``[B]``: keys at or past the length are never
        seen. Clipped to ``[0, Skv]``.
      q_offset: int ``[B]`` or a scalar: query row ``i`` sits at position
        ``q_offset + i`` of the key sequence for the static mask, which is then
        taken at shape ``(Skv, Skv)`` (decode against a KV cache, chunked
        prefill; :func:`splat.attention_with_kvcache` wraps this). A query
        whose position falls outside ``[0, Skv)`` sees no key and outputs 0
        (zero gradients); where ``q_offset`` is concrete (not traced) such a
        position raises ``ValueError`` instead (``q_offset < 0`` or
        ``q_offset + Sq > Skv``). Without ``q_offset`` query row ``i`` is
        row ``i`` of the mask taken at ``(Sq, Skv)``: with ``Sq != Skv`` a
        causal mask is top-left aligned (query ``i`` sees keys ``j <= i``),
        not bottom-right as FlashAttention's; pass
        ``q_offset = Skv - Sq`` for the bottom-right alignment.
      logits_soft_cap: a static positive number ``c``: scores
        ``z = scale * q . k`` become ``c * tanh(z / c)`` before masking
        (Gemma 2).
      q_positions: int ``[B, Sq]``: query ``i`` of batch row ``b`` sits at
        position ``q_positions[b, i]``: it takes that row of the static mask,
        taken at shape ``(Skv, Skv)`` (decode, left padding, packed sequences
        whose positions restart; ``q_offset`` is ``q_positions = q_offset +
        arange(Sq)``). A position outside ``[0, Skv)`` sees no key (output 0).
      kv_positions: int ``[B, Skv]``: key ``j`` sits at position
        ``kv_positions[b, j]`` (column of the static mask); query ``i`` sees key
        ``j`` where the mask holds at ``(q_positions[b, i], kv_positions[b, j])``
        (``q_positions`` defaults to ``arange(Sq)``). A negative position (or one
        at or past ``Skv``) is padding: that key is never seen. Keys may share a
        position: they then share its mask column. Where every seen key sits at
        its own index nothing moves; where the positions are distinct keys and
        values are gathered into position order first; where two keys of a call
        share a position the whole call runs on the pure-JAX rows
        (``jax_bindings._pure_rows``, whatever ``backend`` says), which evaluate
        the mask at each key's position: exact, but without the kernels' speed.

        The static mask is defined at positions in ``[0, Skv)`` only: outside,
        the rules above hold (a query sees no key, a key is padding), whatever
        the mask's formula would give there. A caller whose own mask reaches
        further (a window on positions that may run past the cache, a negative
        position with no padding term) keeps its positions inside or handles
        the rest itself, as :func:`splat.sparsify` does (it checks at run time
        and runs the original attention where they are not).
      backend: one of ``jax_bindings.BACKENDS``: ``"auto"`` (the fastest
        backend here that takes the call: the generated CUDA kernels (Hopper,
        one-band masks, with or without segment ids and lengths, and the
        forward of N-D neighborhoods), cuDNN or
        Triton on a CUDA GPU, else pure JAX; ``jax_bindings.selected_backend``
        says which), or a backend by name (``"cuda"``, ``"triton"``,
        ``"cudnn"``, ``"jax"``), which raises rather than fall back when it
        cannot take the call.
      sequence_axis: None, or a mesh axis name (``"sp"``) or a
        :class:`splat.SequenceAxis` (name and chunk order): sequence-parallel
        attention inside ``jax.shard_map``. ``query``, ``key``, ``value`` and
        the segment ids are then this device's shards of the sequence along
        that axis (contiguous slices, or zigzag chunks); ``mask`` and the
        lengths are the whole sequence's; ``q_offset``, ``q_positions`` and
        ``kv_positions`` are refused. Keys move between devices as the mask
        needs (a halo for band masks, a ring for long-range ones; README
        "Running sharded"); the result equals one device's.
        :func:`splat.sharded_attention` does this for global arrays.

    Returns:
      ``[B, Sq, H, D]`` in the dtype of ``query``.

    Example:
      >>> import jax, splat
      >>> q, k, v = jax.random.normal(jax.random.key(0), (3, 1, 128, 4, 32))
      >>> out = splat.attention(q, k, v, mask=splat.masks.sliding_window(16, 0))
      >>> out.shape
      (1, 128, 4, 32)
    """
    _dispatch.check_backend(backend)
    q, k, v, s = _check_qkv(query, key, value, scale)
    cap = _runtime_args.check_soft_cap(logits_soft_cap)
    if sequence_axis is not None:
        from splat import _sharded  # it builds on this module

        if _per_head.head_masks(mask) is not None:
            raise ValueError(
                "per-head masks cannot be combined with sequence_axis yet: pass one mask for all heads, "
                "or call splat.attention once per group of heads that share a mask"
            )
        if q_positions is not None or kv_positions is not None:
            raise ValueError(
                "q_positions and kv_positions cannot be combined with sequence_axis: each device holds "
                "a shard of the sequence at its own positions (pass the mask of the whole sequence)"
            )
        return _sharded.attention(
            q,
            k,
            v,
            mask,
            sequence_axis=sequence_axis,
            scale=s,
            segment_ids=segment_ids,
            kv_segment_ids=kv_segment_ids,
            query_seq_lengths=query_seq_lengths,
            key_value_seq_lengths=key_value_seq_lengths,
            q_offset=q_offset,
            soft_cap=cap,
            backend=backend,
        )
    (b, sq), skv = q.shape[:2], k.shape[1]
    if kv_positions is not None:
        kv_pos, segment_ids, kv_ids = _runtime_args.key_positions_args(
            k, kv_positions, segment_ids, kv_segment_ids, sq
        )
        if q_positions is None and q_offset is None:
            q_positions = jnp.broadcast_to(jnp.arange(sq, dtype=jnp.int32), (b, sq))
    at_positions = q_offset is not None or q_positions is not None
    rows = skv if at_positions else sq
    per_head = _per_head.head_masks(mask)
    if per_head is None:
        layout = _layout(mask, rows, skv)
    else:  # one layout per query head; equal masks on every head are the one-mask call itself
        layouts = _per_head.query_head_layouts(per_head, rows, skv, q.shape[2], k.shape[2])
        layout = layouts[0] if len(set(layouts)) == 1 else layouts

    def attend(k, v, segment_ids, kv_segment_ids, kv_cols=None):
        runtime = _runtime_args.runtime_mask(
            b,
            sq,
            skv,
            segment_ids=segment_ids,
            kv_segment_ids=kv_segment_ids,
            query_seq_lengths=query_seq_lengths,
            key_value_seq_lengths=key_value_seq_lengths,
            q_offset=q_offset,
            q_positions=q_positions,
        )
        if kv_cols is not None:
            runtime = _runtime_args.KeysAtColumns(runtime, kv_cols)
        if isinstance(layout, ACSR):
            return _attend(q, k, v, layout, s, backend, runtime=runtime, soft_cap=cap)
        return _per_head.attend(q, k, v, layout, s, backend, runtime=runtime, soft_cap=cap)

    if kv_positions is None:
        return attend(k, v, segment_ids, kv_segment_ids)

    def in_columns():  # distinct positions: the keys move to their columns, any backend runs
        k2, v2, ok, ids = _runtime_args.place_keys(k, v, kv_pos, kv_ids)
        return attend(k2, v2, *_runtime_args.key_ids(segment_ids, ids, ok, sq))

    def at_columns():  # keys that share a column share its mask entries: no column order says so
        k2, v2, ok, ids, cols = _runtime_args.sort_keys(k, v, kv_pos, kv_ids)
        return attend(k2, v2, *_runtime_args.key_ids(segment_ids, ids, ok, sq), kv_cols=cols)

    return jax.lax.cond(_runtime_args.distinct_positions(kv_pos), in_columns, at_columns)


def _check_qkv(query, key, value, scale) -> tuple[jax.Array, jax.Array, jax.Array, float]:
    """:func:`attention`'s checks of ``query, key, value`` and ``scale``: jax arrays and a float scale."""
    names = ("query", "key", "value")
    q, k, v = (_array(n, x, "[B, S, H, D]", 4) for n, x in zip(names, (query, key, value), strict=True))
    _same_dtype(names, (q, k, v))
    if k.shape != v.shape:
        raise ValueError(
            f"key and value must have the same shape [B, Skv, Hk, D], got {k.shape} and {v.shape}"
        )
    _check_qk("query", q, "key", k)
    s = _check_scale(scale, 1.0 / math.sqrt(q.shape[3]))
    return jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), s


def _attend(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    layout: ACSR,
    scale: float,
    backend: str,
    *,
    runtime=None,
    soft_cap: float | None = None,
) -> jax.Array:
    """:func:`attention` past its checks (the internal entry point; it checks nothing).

    For callers that ran them once already: ``q, k, v, scale`` from :func:`_check_qkv`, ``layout``
    of shape ``(Sq, Skv)`` (``(Skv, Skv)`` with a ``q_offset``) from the analyzer, ``backend``
    validated when the caller was built, ``runtime`` from :func:`splat._runtime_args.runtime_mask`
    (or a :class:`splat._runtime_args.KeysAtColumns` of it: keys sharing columns, which only the
    pure-JAX rows take), ``soft_cap`` from :func:`splat._runtime_args.check_soft_cap`.
    """
    if isinstance(runtime, _runtime_args.KeysAtColumns):
        cols, flat = runtime.kv_cols, layout.flat
        return _pure_rows.attention_at_columns(q, k, v, runtime.mask, cols, flat, scale, soft_cap)
    return _dispatch.attention(q, k, v, layout, scale, backend, runtime=runtime, soft_cap=soft_cap)


def sddmm(q: jax.Array, k: jax.Array, layout: ACSR, *, backend: str = "auto") -> jax.Array:
    """Sampled dense-dense matmul: the scores ``q . k`` at a layout's nonzeros.

    Args:
      q: ``[B, Sq, H, D]``, float32, bfloat16 or float16.
      k: ``[B, Skv, Hk, D]``, same dtype, ``Hk`` divides ``H``.
      layout: :class:`acsr.ACSR` of shape ``(Sq, Skv)``.
      backend: as for :func:`splat.attention` (``"cudnn"`` has no unfused ops).

    Returns:
      ``scores: [B, H, Sq, layout.nnz_max]`` in q's dtype (unscaled); slot ``t``
      of row ``i`` is column ``layout.slot_columns()[i, t]``; padding slots are 0.

    Example:
      >>> import jax, splat
      >>> q, k = jax.random.normal(jax.random.key(0), (2, 1, 64, 2, 16))
      >>> layout = splat.analyze(splat.masks.causal(), q_len=64)
      >>> splat.sddmm(q, k, layout).shape
      (1, 2, 64, 64)
    """
    _dispatch.check_backend(backend)
    q = _array("q", q, "[B, Sq, H, D]", 4)
    k = _array("k", k, "[B, Skv, Hk, D]", 4)
    _same_dtype(("q", "k"), (q, k))
    _check_qk("q", q, "k", k)
    layout = _check_layout("layout", layout)
    if layout.shape != (q.shape[1], k.shape[1]):
        raise ValueError(
            f"layout is {layout.q_len} x {layout.kv_len} but q, k give {q.shape[1]} x {k.shape[1]}"
        )
    return _dispatch.sddmm(jnp.asarray(q), jnp.asarray(k), layout, backend)


def softmax(
    scores: jax.Array, layout: ACSR, scale: float | None = None, *, backend: str = "auto"
) -> jax.Array:
    """Softmax of ``scale * scores`` along each row's valid slots.

    Args:
      scores: ``[B, H, Sq, layout.nnz_max]`` (from :func:`sddmm`).
      layout: the :class:`acsr.ACSR` the scores belong to.
      scale: positive multiplier applied before the softmax; default 1.0
        (:func:`sddmm` returns unscaled scores, so pass ``1 / sqrt(D)`` to
        match :func:`attention`).
      backend: as for :func:`splat.attention` (``"cudnn"`` has no unfused ops).

    Returns:
      ``probs`` like ``scores``; padding slots and empty rows are 0.

    Example:
      >>> import jax, splat
      >>> layout = splat.analyze(splat.masks.sliding_window(2), q_len=8)
      >>> s = jax.random.normal(jax.random.key(0), (1, 1, 8, layout.nnz_max))
      >>> p = splat.softmax(s, layout)
      >>> bool(abs(p.sum(-1) - 1).max() < 1e-5)
      True
    """
    _dispatch.check_backend(backend)
    scores = _array("scores", scores, "[B, H, Sq, nnz_max]", 4, slots=True)
    layout = _check_layout("layout", layout)
    if scores.shape[2:] != (layout.q_len, layout.nnz_max):
        raise ValueError(
            f"scores must be [B, H, {layout.q_len}, {layout.nnz_max}] ([B, H, q_len, nnz_max] of layout), "
            f"got {tuple(scores.shape)}"
        )
    s = _check_scale(scale, 1.0)
    return _dispatch.softmax(jnp.asarray(scores), layout, s, backend)


def spmm(probs: jax.Array, v: jax.Array, layout: ACSR, *, backend: str = "auto") -> jax.Array:
    """Sparse x dense matmul: ``out[:, i, h] = sum_t probs[:, h, i, t] * v[:, col(i, t), h // G]``.

    Args:
      probs: ``[B, H, Sq, layout.nnz_max]`` (from :func:`softmax`).
      v: ``[B, Skv, Hk, D]``, same dtype, ``Hk`` divides ``H``.
      layout: :class:`acsr.ACSR` of shape ``(Sq, Skv)``.
      backend: as for :func:`splat.attention` (``"cudnn"`` has no unfused ops).

    Returns:
      ``[B, Sq, H, D]`` in v's dtype.

    Example:
      >>> import jax, splat
      >>> q, k, v = jax.random.normal(jax.random.key(0), (3, 1, 32, 2, 8))
      >>> layout = splat.analyze(splat.masks.causal(), q_len=32)
      >>> p = splat.softmax(splat.sddmm(q, k, layout), layout, scale=8 ** -0.5)
      >>> out = splat.spmm(p, v, layout)
      >>> bool(abs(out - splat.attention(q, k, v, mask=layout)).max() < 1e-5)
      True
    """
    _dispatch.check_backend(backend)
    probs = _array("probs", probs, "[B, H, Sq, nnz_max]", 4, slots=True)
    v = _array("v", v, "[B, Skv, Hk, D]", 4)
    _same_dtype(("probs", "v"), (probs, v))
    layout = _check_layout("layout", layout)
    if probs.shape[2:] != (layout.q_len, layout.nnz_max):
        raise ValueError(
            f"probs must be [B, H, {layout.q_len}, {layout.nnz_max}] ([B, H, q_len, nnz_max] of layout), "
            f"got {tuple(probs.shape)}"
        )
    if v.shape[1] != layout.kv_len:
        raise ValueError(f"v has {v.shape[1]} keys (axis 1) but layout has kv_len {layout.kv_len}")
    if v.shape[0] != probs.shape[0]:
        raise ValueError(f"v batch {v.shape[0]} != probs batch {probs.shape[0]} (axis 0)")
    if probs.shape[1] % v.shape[2]:
        raise ValueError(f"v has {v.shape[2]} heads, which must divide the {probs.shape[1]} heads of probs")
    return _dispatch.spmm(jnp.asarray(probs), jnp.asarray(v), layout, backend)
