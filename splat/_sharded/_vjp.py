"""Sequence-parallel attention on one device of the axis, as one ``custom_vjp``: the halo and the ring.

Forward: the blocks of the plan's steps, each merged into float32 accumulators by log-sum-exp
(:mod:`splat._sharded._merge`); the output is cast to the input dtype, the merged ``lse`` kept for
the backward.

* Halo: every halo is requested before the local block is computed, so the transfers overlap it;
  each halo block is merged in when its keys are there. The halos are kept for the backward (at
  most :data:`~splat._sharded._plan.HALO_SHARDS` shards).
* Ring: the next rotation is requested before the current shard's block is computed, so it overlaps
  that compute; the last step requests none. The backward rotates the shards again rather than
  keeping them (memory stays two shards). With a runtime mask the ring also stops at run time: every
  device learns (one small all-gather of each shard's id range and valid length) the last step at
  which any device has work, and the steps past it -- their rotations included -- are not run
  (``lax.cond`` on a value equal on every device); packed documents shorter than a shard take one
  step. A step that runs requests the next rotation before it knows whether the next step will run,
  so the ring moves one shard more than it computes on, overlapped with the last step's compute.

Backward: every block's ``attention_bwd`` gets the merged ``out`` and ``lse``
(:mod:`jax_bindings._blockwise`), so its ``dq`` adds into the local rows and its ``dk``/``dv`` are
exactly the keys' gradients from those rows. Key gradients computed on another device's keys go
back to the owner by one permute per step (the transpose of the permute that brought the keys),
requested as soon as the step is done and summed only at the end, so they overlap the steps after
it; the halo's backward runs before the local block's for the same reason. Differentiating through
the merge instead would save every block's output for the backward and differentiate the
collectives one by one; here the backward holds only ``out`` and ``lse``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from splat._sharded import _exchange, _merge
from splat._sharded._blocks import Context, Keys, backward_step, forward_step, valid_prefix

_F32 = jnp.float32


def _slice(keys: Keys, cols: tuple[int, int]) -> Keys:
    c0, c1 = cols
    if (c0, c1) == (0, keys.k.shape[1]):
        return keys
    return jax.tree.map(lambda x: x[:, c0:c1], keys)


def _kv_device(ctx: Context, step, dev):
    plan = ctx.plan
    if plan.mode == "ring":
        return (dev - plan.direction * step.offset) % plan.parts
    return dev + step.offset


def _ring_reach(ctx: Context, rt, axis: str, dev):
    """int32 scalar, equal on every device: the last ring step at which some device's block is left
    work by the runtime mask (0: none past the local one). Conservative: a shard's whole id range
    and valid length stand for its blocks'."""
    plan = ctx.plan
    b = jax.tree.leaves(rt)[0].shape[0]
    full = lambda n: jnp.full((b,), n, jnp.int32)
    q_valid = full(plan.q_local) if rt.q_lens is None else valid_prefix(plan.q_pieces, dev, rt.q_lens)
    k_valid = full(plan.kv_local) if rt.kv_lens is None else valid_prefix(plan.kv_pieces, dev, rt.kv_lens)
    rows = [q_valid, k_valid]
    if rt.q_ids is not None:
        rows += [rt.q_ids.min(axis=1), rt.q_ids.max(axis=1), rt.kv_ids.min(axis=1), rt.kv_ids.max(axis=1)]
    mine = jnp.stack([r.astype(jnp.int32) for r in rows])  # [4 or 6, B]
    every = lax.all_gather(mine, axis)  # [P, 4 or 6, B]
    reach = jnp.zeros((), jnp.int32)
    i = np.arange(plan.parts)
    for step in plan.steps[1:]:
        has = np.array([x >= 0 for x in step.index])
        if not has.any():
            continue
        j = (i - plan.direction * step.offset) % plan.parts
        qi, kj = every[i], every[j]  # [P, 4 or 6, B]
        live = (qi[:, 0] > 0) & (kj[:, 1] > 0)
        if rt.q_ids is not None:
            live &= (qi[:, 2] <= kj[:, 5]) & (kj[:, 4] <= qi[:, 3])
        live = jnp.any(live, axis=1) & jnp.asarray(has)
        reach = jnp.where(jnp.any(live), step.offset, reach)
    return reach


def _gate(reach, t: int, run, skip, *operands):
    """``run(*operands)`` when ring step ``t`` is within ``reach`` (None: always), else ``skip``."""
    if reach is None or t == 0:
        return run(*operands)
    return lax.cond(t <= reach, run, skip, *operands)


def _forward(q, k, v, rt, ctx: Context, axis: str):
    plan = ctx.plan
    dev = lax.axis_index(axis)
    b, n, h, d = q.shape
    local = Keys(k, v, None if rt is None else rt.kv_ids)

    def step_fwd(i: int, acc, keys):
        step = plan.steps[i]
        return forward_step(ctx, step, acc, q, keys, rt, dev, _kv_device(ctx, step, dev), fresh=i == 0)

    if plan.mode == "ring":
        reach = None if rt is None else _ring_reach(ctx, rt, axis, dev)

        def ring_from(i: int, acc, keys):
            def run(acc, keys):
                if i + 1 == len(plan.steps):
                    return step_fwd(i, acc, keys)
                nxt = _exchange.rotate(keys, axis, plan.parts, plan.direction)
                return ring_from(i + 1, step_fwd(i, acc, keys), nxt)

            return _gate(reach, plan.steps[i].offset, run, lambda acc, keys: acc, acc, keys)

        out, lse = ring_from(0, _merge.empty(b, n, h, d), local)
        return out.astype(q.dtype), lse, ()
    halos = tuple(_exchange.fetch(_slice(local, s.cols), axis, plan.parts, s.offset) for s in plan.steps[1:])
    acc = _merge.empty(b, n, h, d)
    for i, keys in enumerate((local, *halos)):
        acc = step_fwd(i, acc, keys)
    out, lse = acc
    return out.astype(q.dtype), lse, halos


def _backward(ctx: Context, axis: str, res, dout):
    q, k, v, rt, out, lse, halos = res
    plan = ctx.plan
    dev = lax.axis_index(axis)
    local = Keys(k, v, None if rt is None else rt.kv_ids)

    def step_bwd(step, dq, keys):
        return backward_step(ctx, step, dq, q, out, lse, dout, keys, rt, dev, _kv_device(ctx, step, dev))

    dq = jnp.zeros(q.shape, _F32)
    if plan.mode == "ring":
        reach = None if rt is None else _ring_reach(ctx, rt, axis, dev)

        def ring_from(i: int, dq, keys):
            """``(dq, dk, dv)`` of steps ``i`` on; dk, dv: float32, of the local keys, returned."""
            step = plan.steps[i]

            def run(dq, keys):
                nxt = None
                if i + 1 < len(plan.steps):
                    nxt = _exchange.rotate(keys, axis, plan.parts, plan.direction)
                dq, gk, gv = step_bwd(step, dq, keys)
                gk, gv = _exchange.give_back_ring((gk, gv), axis, plan.parts, plan.direction, step.offset)
                if nxt is None:
                    return dq, gk.astype(_F32), gv.astype(_F32)
                dq, dk, dv = ring_from(i + 1, dq, nxt)  # independent of the gradients in flight
                return dq, dk + gk.astype(_F32), dv + gv.astype(_F32)

            def skip(dq, keys):
                return dq, jnp.zeros(k.shape, _F32), jnp.zeros(v.shape, _F32)

            return _gate(reach, step.offset, run, skip, dq, keys)

        dq, dk, dv = ring_from(0, dq, local)
        return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None
    returned = []
    for step, keys in zip(plan.steps[1:], halos, strict=True):  # halos first: their gradients travel
        dq, gk, gv = step_bwd(step, dq, keys)
        returned.append((step.cols, _exchange.give_back_halo((gk, gv), axis, plan.parts, step.offset)))
    dq, dk, dv = step_bwd(plan.steps[0], dq, local)
    dk, dv = dk.astype(_F32), dv.astype(_F32)
    for cols, (gk, gv) in returned:
        dk, dv = _merge.add_rows(dk, gk, cols), _merge.add_rows(dv, gv, cols)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def attention(q, k, v, rt, ctx: Context, axis: str):
    """Sequence-parallel attention of the local shards ``q [B, nq, H, D]``, ``k, v [B, nk, Hk, D]``
    (the runtime mask ``rt``: a :class:`~splat._sharded._blocks.LocalRuntime` or None) inside
    ``shard_map`` over ``axis``; ``[B, nq, H, D]`` in q's dtype. No checks (the caller made them)."""
    return _forward(q, k, v, rt, ctx, axis)[0]


def _fwd(q, k, v, rt, ctx, axis):
    out, lse, halos = _forward(q, k, v, rt, ctx, axis)
    return out, (q, k, v, rt, out, lse, halos)


attention.defvjp(_fwd, _backward)
