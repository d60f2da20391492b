"""The two entry points: ``splat.attention(..., sequence_axis=)`` inside ``shard_map``, and
:func:`sharded_attention` for global arrays."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from acsr import ACSR
from splat import _attention, _runtime_args
from splat._sharded import _merge, _order, _plan, _vjp
from splat._sharded._blocks import Context, LocalRuntime


def _axis_size(axis: _order.SequenceAxis) -> int:
    try:
        return int(lax.axis_size(axis.name))
    except NameError:
        raise ValueError(
            f"sequence_axis={axis.name!r} is not a bound mesh axis here: call splat.attention with "
            f"sequence_axis inside jax.shard_map over a mesh with an axis {axis.name!r} (q, k, v being "
            "the local shards of the sequence), or use splat.sharded_attention on global arrays"
        ) from None


def _local_runtime(runtime, query_seq_lengths, key_value_seq_lengths) -> LocalRuntime | None:
    """One device's runtime arguments: the ids of ``runtime`` (the checked RuntimeMask of its
    shards) and the *global* lengths as given (``runtime``'s are clipped to the shard)."""
    if runtime is None:
        return None
    i32 = lambda x: None if x is None else jnp.asarray(x).astype(jnp.int32)
    return LocalRuntime(runtime.q_ids, runtime.kv_ids, i32(query_seq_lengths), i32(key_value_seq_lengths))


def attention(
    q,
    k,
    v,
    mask,
    *,
    sequence_axis,
    scale: float,
    segment_ids=None,
    kv_segment_ids=None,
    query_seq_lengths=None,
    key_value_seq_lengths=None,
    q_offset=None,
    soft_cap: float | None = None,
    backend: str = "auto",
):
    """:func:`splat.attention` with ``sequence_axis``, past its checks of ``q, k, v``, ``scale`` and
    ``logits_soft_cap`` (``soft_cap``). See that docstring for the arguments."""
    axis = _order.as_axis(sequence_axis)
    if q_offset is not None:
        raise ValueError(
            "q_offset cannot be combined with sequence_axis: sequence-parallel attention runs the whole "
            "sequence, each device a shard of it. For decode or chunked prefill against a KV cache call "
            "splat.attention (or splat.attention_with_kvcache) without sequence_axis"
        )
    parts = _axis_size(axis)
    typed = _merge.axes_of(q, k, v)
    if typed:
        raise ValueError(
            f"sequence_axis={axis.name!r}: q, k, v are typed as varying along mesh axes "
            f"{sorted(typed)}, i.e. jax.shard_map runs with check_vma=True; the backends' loops (the "
            "pure-JAX one's scans) are not typed for that: call jax.shard_map(..., check_vma=False) "
            "(splat.sharded_attention does)"
        )
    b, nq = q.shape[:2]
    nk = k.shape[1]
    _order.check_length("query", nq, axis.order)
    _order.check_length("key", nk, axis.order)
    runtime = _runtime_args.runtime_mask(  # checks shapes and dtypes (ids: the local shards)
        b,
        nq,
        nk,
        segment_ids=segment_ids,
        kv_segment_ids=kv_segment_ids,
        query_seq_lengths=query_seq_lengths,
        key_value_seq_lengths=key_value_seq_lengths,
    )
    sq, skv = parts * nq, parts * nk
    if isinstance(mask, ACSR) and mask.shape != (sq, skv):
        raise ValueError(
            f"mask layout is {mask.q_len} x {mask.kv_len}, but with sequence_axis the mask is the whole "
            f"sequence's: {sq} x {skv} ({parts} devices x {nq} queries, x {nk} keys)"
        )
    try:
        layout = _attention._layout(mask, sq, skv)
    except ValueError as e:
        e.add_note(
            f"with sequence_axis, mask describes the whole sequence: {sq} x {skv} ({parts} devices x the "
            f"local {nq} queries and {nk} keys)"
        )
        raise
    if parts == 1:  # the local shard is the sequence
        return _attention._attend(q, k, v, layout, scale, backend, runtime=runtime, soft_cap=soft_cap)
    rt = _local_runtime(runtime, query_seq_lengths, key_value_seq_lengths)
    plan = _plan.plan(layout, parts, axis.order)
    return _vjp.attention(q, k, v, rt, Context(plan, float(scale), soft_cap, backend), axis.name)


def sharded_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    mask=None,
    *,
    mesh: jax.sharding.Mesh,
    axis: str,
    order: str = "contiguous",
    scale: float | None = None,
    segment_ids: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    query_seq_lengths: jax.Array | None = None,
    key_value_seq_lengths: jax.Array | None = None,
    logits_soft_cap: float | None = None,
    backend: str = "auto",
) -> jax.Array:
    """Sequence-parallel :func:`splat.attention` of global arrays, sharded along ``axis`` of ``mesh``.

    Wraps ``jax.shard_map``: the sequence axis (axis 1) of ``query``, ``key``, ``value`` and the
    segment ids is split over the devices of ``axis`` (other mesh axes see replicated inputs), and
    each device runs ``splat.attention(..., sequence_axis=SequenceAxis(axis, order))`` on its
    shard. Works under ``jit`` (inputs already sharded as ``NamedSharding(mesh, P(None, axis))``
    move nothing) and ``grad``. Results equal :func:`splat.attention` on one device.

    Args:
      query, key, value, mask, scale, segment_ids, kv_segment_ids, query_seq_lengths,
        key_value_seq_lengths, logits_soft_cap, backend: as :func:`splat.attention` (global arrays:
        ``[B, S, H, D]``, ids ``[B, S]``, lengths ``[B]``), ``S`` a multiple of the axis size.
      mesh: a ``jax.sharding.Mesh`` with an axis ``axis``.
      axis: the mesh axis the sequence is split along.
      order: ``"contiguous"`` or ``"zigzag"``: the arrays are given in that order
        (:func:`splat.zigzag`; ``S`` then a multiple of twice the axis size) and the output comes
        in it too. The mask applies to the original positions either way.

    Returns:
      ``[B, Sq, H, D]`` in the dtype of ``query``, sharded like it.

    Example:
      >>> import jax, splat
      >>> mesh = jax.sharding.Mesh(jax.devices(), ("sp",))
      >>> q, k, v = jax.random.normal(jax.random.key(0), (3, 1, 64 * len(jax.devices()), 2, 16))
      >>> m = splat.masks.sliding_window(15, 0)
      >>> out = splat.sharded_attention(q, k, v, m, mesh=mesh, axis="sp")
      >>> bool(abs(out - splat.attention(q, k, v, m)).max() < 1e-5)
      True
    """
    if not isinstance(axis, str) or axis not in mesh.axis_names:
        raise ValueError(f"axis must name an axis of mesh (one of {tuple(mesh.axis_names)}), got {axis!r}")
    seq = _order.SequenceAxis(axis, order)
    parts = mesh.shape[axis]
    chunk = parts * (2 if order == "zigzag" else 1)
    for name, x in (("query", query), ("key", key), ("value", value)):
        if not hasattr(x, "shape") or len(x.shape) != 4:
            raise ValueError(f"{name} must be a 4-D array [B, S, H, D], got {getattr(x, 'shape', type(x))}")
        if x.shape[1] % chunk:
            what = f"2 x the {parts} devices" if order == "zigzag" else f"the {parts} devices"
            raise ValueError(
                f"{name} has sequence length {x.shape[1]}, which must be a multiple of {chunk} ({what} "
                f"of mesh axis {axis!r}); pad it (splat.pad_to_bucket) and mask the padding with "
                "query_seq_lengths / key_value_seq_lengths"
            )
    seq_spec, rep = P(None, axis), P()
    named = {
        "segment_ids": (segment_ids, seq_spec),
        "kv_segment_ids": (kv_segment_ids, seq_spec),
        "query_seq_lengths": (query_seq_lengths, rep),
        "key_value_seq_lengths": (key_value_seq_lengths, rep),
    }
    given = {n: (jnp.asarray(x), s) for n, (x, s) in named.items() if x is not None}

    def local(q, k, v, *extra):
        kw = dict(zip(given, extra, strict=True))
        return _attention.attention(
            q,
            k,
            v,
            mask,
            scale=scale,
            logits_soft_cap=logits_soft_cap,
            backend=backend,
            sequence_axis=seq,
            **kw,
        )

    specs = (seq_spec,) * 3 + tuple(s for _, s in given.values())
    args = (query, key, value, *(x for x, _ in given.values()))
    if any(t == jax.sharding.AxisType.Explicit for t in getattr(mesh, "axis_types", ())):
        args = tuple(
            jax.sharding.reshard(x, NamedSharding(mesh, s)) for x, s in zip(args, specs, strict=True)
        )
    run = jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=seq_spec, check_vma=False)
    return run(*args)
