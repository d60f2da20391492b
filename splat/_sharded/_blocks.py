"""One step's blocks on one device: the block's runtime mask, its forward and backward, the switch.

At a step every device holds one buffer of keys (its own, a halo, or the ring's current shard) and
computes the plan's block for it, if any. Devices whose blocks differ pick theirs with ``lax.switch``
on the axis index; a device with no block takes the branch that changes nothing.

Runtime masks are cut to the block: the query ids of its rows, the key ids of its keys (they travel
with the keys), and the lengths, which are global (``[B]``): a device's valid tokens are a prefix of
its local ones (:mod:`splat._sharded._order`), so each block gets the prefix that falls in it. Where a
runtime mask leaves a block nothing to do on every batch row -- documents that do not reach the key
shard, keys past the length, padded queries -- ``lax.cond`` skips its work at run time.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_bindings import _blockwise, _runtime
from splat._sharded import _merge
from splat._sharded._plan import Block, Plan, Step


class LocalRuntime(NamedTuple):
    """The runtime mask arguments of one device (int32; absent ones None).

    ``q_ids [B, nq]`` and ``kv_ids [B, nk]``: the local tokens' segment ids; ``q_lens [B]`` and
    ``kv_lens [B]``: the *global* ``query_seq_lengths`` and ``key_value_seq_lengths``.
    """

    q_ids: jax.Array | None = None
    kv_ids: jax.Array | None = None
    q_lens: jax.Array | None = None
    kv_lens: jax.Array | None = None


class Keys(NamedTuple):
    """A buffer of keys as it travels: ``k, v [B, n, Hk, D]`` and their ids ``[B, n]`` (or None)."""

    k: jax.Array
    v: jax.Array
    ids: jax.Array | None


class Context(NamedTuple):
    """What every block call of one attention shares (static)."""

    plan: Plan
    scale: float
    soft_cap: float | None
    backend: str


def valid_prefix(pieces, device, lens: jax.Array) -> jax.Array:
    """int32 ``[B]``: how many of ``device``'s local tokens lie below the global lengths ``lens [B]``."""
    starts = jnp.asarray(np.array([[s for s, _ in ps] for ps in pieces], np.int32))
    sizes = jnp.asarray(np.array([[n for _, n in ps] for ps in pieces], np.int32))
    device = jnp.clip(device, 0, len(pieces) - 1)
    return jnp.clip(lens[:, None] - starts[device][None, :], 0, sizes[device][None, :]).sum(axis=1)


def block_runtime(rt: LocalRuntime | None, plan: Plan, block: Block, q_dev, kv_dev, kv_ids, kv_start: int):
    """``(RuntimeMask or None, live)`` of ``block``: ``live`` (a traced bool, None without a runtime
    mask) is False where the runtime mask leaves the block nothing to do on every batch row.

    ``q_dev``, ``kv_dev``: the devices whose queries and keys the block reads (traced);
    ``kv_ids``: the key buffer's ids; ``kv_start``: the key device's local index of the buffer's
    first key (a halo's slice start, else 0).
    """
    if rt is None:
        return None, None
    (r0, r1), (c0, c1) = block.rows, block.cols
    b = jax.tree.leaves(rt)[0].shape[0]
    live = jnp.ones((b,), bool)
    q_len = kv_len = q_ids = kv_ids_b = None
    if rt.q_lens is not None:
        q_len = valid_prefix(plan.q_pieces, q_dev, rt.q_lens) - r0
        live &= q_len > 0
    if rt.kv_lens is not None:
        kv_len = valid_prefix(plan.kv_pieces, kv_dev, rt.kv_lens) - (kv_start + c0)
        live &= kv_len > 0
    if rt.q_ids is not None:
        q_ids, kv_ids_b = rt.q_ids[:, r0:r1], kv_ids[:, c0:c1]
        live &= (q_ids.min(axis=1) <= kv_ids_b.max(axis=1)) & (kv_ids_b.min(axis=1) <= q_ids.max(axis=1))
    runtime = _runtime.build(
        b,
        r1 - r0,
        c1 - c0,
        segment_ids=q_ids,
        kv_segment_ids=kv_ids_b,
        query_seq_lengths=q_len,
        key_value_seq_lengths=kv_len,
    )
    return runtime, jnp.any(live)


def _switch(step: Step, dev, branch, noop, *operands):
    """``branch(block)(*operands)`` for device ``dev``'s block at ``step``, ``noop`` where it has none;
    one ``lax.switch`` over the distinct blocks when devices differ."""
    used = sorted({i for i in step.index if i >= 0})
    pick = np.array([0 if i < 0 else 1 + used.index(i) for i in step.index], np.int32)
    fns = [noop] + [branch(u) for u in used]
    if (pick == pick[0]).all():
        return fns[int(pick[0])](*operands)
    return lax.switch(jnp.asarray(pick)[dev], fns, *operands)


def forward_step(ctx: Context, step: Step, acc, q, keys: Keys, rt, dev, kv_dev, *, fresh: bool = False):
    """``acc = (out, lse)`` (float32, all local rows) with this step's block merged in (``fresh``:
    the first step, ``acc`` still empty)."""

    def branch(u: int):
        block = ctx.plan.blocks[u]
        (r0, r1), (c0, c1) = block.rows, block.cols

        def run_block(acc, keys):
            runtime, live = block_runtime(rt, ctx.plan, block, dev, kv_dev, keys.ids, step.cols[0])

            def run(acc):
                o, lse = _blockwise.attention_fwd(
                    q[:, r0:r1],
                    keys.k[:, c0:c1],
                    keys.v[:, c0:c1],
                    block.layout,
                    ctx.scale,
                    ctx.backend,
                    runtime=runtime,
                    soft_cap=ctx.soft_cap,
                )
                return _merge.merge_rows(acc, o, lse, block.rows, fresh=fresh)

            return run(acc) if live is None else lax.cond(live, run, lambda a: a, acc)

        return run_block

    return _switch(step, dev, branch, lambda acc, keys: acc, acc, keys)


def _padded(x, cols: tuple[int, int], n: int):
    """``x [B, c1 - c0, ...]`` placed at rows ``[c0, c1)`` of zeros ``[B, n, ...]``."""
    c0, c1 = cols
    if (c0, c1) == (0, n):
        return x
    return jnp.pad(x, ((0, 0), (c0, n - c1)) + ((0, 0),) * (x.ndim - 2))


def backward_step(ctx: Context, step: Step, dq, q, out, lse, dout, keys: Keys, rt, dev, kv_dev):
    """``(dq, gk, gv)``: ``dq`` (float32, all local rows) plus this step's block's share, and the
    block's key and value gradients, shaped like the key buffer (zeros outside the block) in the
    keys' dtype: what the backend returned, so sending them costs no precision."""
    zeros = lambda: (jnp.zeros(keys.k.shape, keys.k.dtype), jnp.zeros(keys.v.shape, keys.v.dtype))

    def branch(u: int):
        block = ctx.plan.blocks[u]
        (r0, r1), (c0, c1) = block.rows, block.cols

        def run_block(dq, keys):
            runtime, live = block_runtime(rt, ctx.plan, block, dev, kv_dev, keys.ids, step.cols[0])

            def run(dq):
                dqb, dkb, dvb = _blockwise.attention_bwd(
                    q[:, r0:r1],
                    keys.k[:, c0:c1],
                    keys.v[:, c0:c1],
                    out[:, r0:r1],
                    lse[:, :, r0:r1],
                    dout[:, r0:r1],
                    block.layout,
                    ctx.scale,
                    ctx.backend,
                    runtime=runtime,
                    soft_cap=ctx.soft_cap,
                )
                n = keys.k.shape[1]
                return (
                    _merge.add_rows(dq, dqb, block.rows),
                    _padded(dkb, block.cols, n),
                    _padded(dvb, block.cols, n),
                )

            return run(dq) if live is None else lax.cond(live, run, lambda dq: (dq, *zeros()), dq)

        return run_block

    return _switch(step, dev, branch, lambda dq, keys: (dq, *zeros()), dq, keys)
