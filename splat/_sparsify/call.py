"""The replacement call: the matched Q, K, V rearranged for ``splat.attention`` and back.

The matcher names every axis of Q, K, V and of the attention output by a label (an atom of
the ``Q @ K^T`` output, ``"d"`` for the head dim of Q/K, ``"e"`` for V's, None for size-1
axes). :func:`attention_call` builds the function that transposes and reshapes them to splat's
``q [B, T, heads*group, D]``, ``k/v [B, S, heads, D]``, runs the attention with the layout
analysed at trace time, and lays the result out as the replaced value was.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from splat import _attention
from splat._call_log import guard_sinks
from splat._runtime_args import everywhere
from splat._sparsify import runtime as rt_ops
from splat._sparsify.guard import Guard, positions_hold
from splat._sparsify.ir import run_nodes

__all__ = ["Arrangement", "attention_call"]


@dataclass(frozen=True)
class Arrangement:
    """Labels of the matched operands and output, and the roles of the score atoms.

    ``batch``, ``heads``, ``group``: lists of atoms (query-side batch axes before and after the
    sequence axis ``t``, and the query-only group axes of grouped-query attention); ``kv``: the
    key axis; ``sizes``: atom (or "e") -> length; ``out``: the labels of the replaced value.
    """

    q: list
    k: list
    v: list
    out: list
    batch: list
    heads: list
    group: list
    t: int
    kv: int
    sizes: dict


def _arrange(x, lab, order, tail):
    present = [lab.index(o) for o in order + [tail] if o in lab]
    extra = [a for a in range(len(lab)) if lab[a] not in order and lab[a] != tail]  # size-1 axes
    x = jnp.transpose(x, present + extra).reshape([x.shape[a] for a in present])
    for i, o in enumerate(order + [tail]):
        if o not in lab:
            x = jnp.expand_dims(x, i)
    return x


def attention_call(
    a: Arrangement,
    layout,
    scale: float,
    cap,
    runtime: rt_ops.Runtime,
    backend: str,
    out_dtype,
    *,
    positions=None,
    guard: Guard | None = None,
    consts=None,
) -> Callable:
    """``run(q, k, v, *runtime arrays, *position arrays, *key terms, *dense reads)``: splat's
    attention on the matched operands (the last two with a ``guard``).

    ``positions`` (:class:`positions.Positions`): pass its arrays as ``q_positions`` /
    ``kv_positions`` (the queries at ``clamp(start) + i`` where a constant is sliced at a start and
    no query array exists), but those of ``guard.checked``: those sides go at their indices, their
    positions checked to equal them where the mask lets a pair be seen (:mod:`guard`). Positions
    passed are checked to lie inside the mask, keys hidden by padding excepted; with a query array
    and a start, the two are checked equal. Where a check fails the original attention
    (``guard.nodes``, reading ``guard.reads``) runs. ``guard`` is None only where nothing needs a
    check (no position array: the rows of a sliced constant lie inside it by construction).
    """
    sizes, batch, heads, group, t, kv = a.sizes, a.batch, a.heads, a.group, a.t, a.kv
    q_len, kv_len = sizes[t], sizes[kv]
    n_heads, n_group = math.prod(sizes[h] for h in heads), math.prod(sizes[g] for g in group)
    n_rt = len(runtime.vids)
    pos_sides = [] if positions is None else [s for s in ("q", "kv") if getattr(positions, s) is not None]
    start = None if positions is None else positions.q_start
    n_pos = len(pos_sides) + (start is not None)
    consts = consts or {}

    def position_arrays(pos_vals):
        """``(q_positions, kv_positions)`` int32 ``[B, S]`` (or None) from the runtime values."""
        qp = kp = None
        for side, val in zip(pos_sides, pos_vals[: len(pos_sides)], strict=True):
            lab = getattr(positions, side)[1]
            arr = rt_ops.gather_rows(val, lab, list(batch) + [t if side == "q" else kv], sizes)
            arr = arr.astype(jnp.int32)
            qp, kp = (arr, kp) if side == "q" else (qp, arr)
        if start is not None and qp is None:
            b = math.prod(sizes[lab] for lab in batch)
            qp = jnp.broadcast_to(sliced_rows(pos_vals[-1])[None, :], (b, q_len))
        return qp, kp

    def sliced_rows(value):
        """The rows ``lax.dynamic_slice`` reads from a start: clamped, then ``start + i``."""
        first = jnp.clip(jnp.asarray(value).astype(jnp.int32), 0, start[1])
        return first + jnp.arange(q_len, dtype=jnp.int32)

    def run(qv, kv_arr, vv, *extra):
        rt_vals, pos_vals = extra[:n_rt], extra[n_rt : n_rt + n_pos]
        if guard is None:
            return core(qv, kv_arr, vv, rt_vals, *position_arrays(pos_vals))
        n_key = len(guard.key_terms.vids)
        key_vals, reads = extra[n_rt + n_pos : n_rt + n_pos + n_key], extra[n_rt + n_pos + n_key :]
        live = [v for v in guard.reads if v not in consts]
        fixed = {v: consts[v] for v in guard.reads if v in consts}

        def dense(args):
            vals = dict(zip(live, args, strict=True))
            return run_nodes(guard.nodes, live, [vals[v] for v in live], fixed, guard.out)

        qp, kp = position_arrays(pos_vals)
        q_at, kv_at = "q" in guard.checked, "kv" in guard.checked  # checked sides go at their indices
        q_rows = qp  # the rows of the call's mask the queries take
        if q_at or qp is None:
            b = math.prod(sizes[lab] for lab in batch)
            q_rows = jnp.broadcast_to(jnp.arange(q_len, dtype=jnp.int32), (b, q_len))
        kv_ok = rt_ops.key_valid(runtime, rt_vals, batch, t, kv, sizes) if rt_vals else None
        if key_vals:  # the terms on key positions alone: padding too, for keys outside the mask
            by_position = rt_ops.key_valid(guard.key_terms, key_vals, batch, t, kv, sizes)
            kv_ok = by_position if kv_ok is None else kv_ok & by_position
        kv_cols = None if kv_at else kp
        ok = positions_hold(guard, q_rows, qp if q_at else None, kp if kv_at else None, kv_ok, kv_cols)
        if start is not None and positions.q is not None:  # the query positions and the sliced rows agree
            ok &= jnp.all(qp == sliced_rows(pos_vals[-1])[None, :])
        qp, kp = (None if q_at else qp), (None if kv_at else kp)
        fast = lambda args: core(qv, kv_arr, vv, rt_vals, qp, kp)  # noqa: E731
        chose = everywhere(ok)
        sinks = guard_sinks()
        if sinks:  # someone asked, at trace time, which attention each execution runs
            jax.debug.callback(lambda c: [s.append(bool(np.all(c))) for s in sinks], chose)
        return jax.lax.cond(chose, fast, dense, list(reads))

    def core(qv, kv_arr, vv, extra, qp, kp):
        b = math.prod(sizes[lab] for lab in batch)
        qs = _arrange(qv, a.q, batch + [t] + heads + group, "d").reshape(b, q_len, n_heads * n_group, -1)
        ks = _arrange(kv_arr, a.k, batch + [kv] + heads, "d").reshape(b, kv_len, n_heads, -1)
        vs = _arrange(vv, a.v, batch + [kv] + heads, "e")
        vs = jnp.broadcast_to(vs, [sizes[lab] for lab in batch + [kv] + heads] + [sizes["e"]])
        vs = vs.reshape(b, kv_len, n_heads, -1)
        if cap is None and not extra and qp is None and kp is None:
            qs, ks, vs, s = _attention._check_qkv(qs, ks, vs, scale)
            o = _attention._attend(qs, ks, vs, layout, s, backend)  # the layout analysed at trace time
        else:
            seg = rt_ops.segment_arrays(runtime, extra, batch, t, kv, sizes) if extra else (None, None)
            o = _attention.attention(
                qs,
                ks,
                vs,
                layout,
                scale=scale,
                segment_ids=seg[0],
                kv_segment_ids=seg[1],
                logits_soft_cap=cap,
                backend=backend,
                q_positions=qp,
                kv_positions=kp,
            )
        order = batch + [t] + heads + group + ["e"]
        o = o.reshape([sizes[lab] for lab in order])
        present = [lab for lab in a.out if lab in order]
        o = jnp.transpose(o, [order.index(lab) for lab in present])
        return o.reshape([sizes[lab] if lab in sizes else 1 for lab in a.out]).astype(out_dtype)

    return run
