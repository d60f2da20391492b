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

import jax.numpy as jnp

from splat import _attention
from splat._sparsify import runtime as rt_ops

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
    a: Arrangement, layout, scale: float, cap, runtime: rt_ops.Runtime, backend: str, out_dtype
) -> Callable:
    """``run(q, k, v, *runtime arrays)``: splat's attention on the matched operands."""
    sizes, batch, heads, group, t, kv = a.sizes, a.batch, a.heads, a.group, a.t, a.kv
    q_len, kv_len = sizes[t], sizes[kv]
    n_heads, n_group = math.prod(sizes[h] for h in heads), math.prod(sizes[g] for g in group)

    def run(qv, kv_arr, vv, *extra):
        b = math.prod(sizes[lab] for lab in batch)
        qs = _arrange(qv, a.q, batch + [t] + heads + group, "d").reshape(b, q_len, n_heads * n_group, -1)
        ks = _arrange(kv_arr, a.k, batch + [kv] + heads, "d").reshape(b, kv_len, n_heads, -1)
        vs = _arrange(vv, a.v, batch + [kv] + heads, "e")
        vs = jnp.broadcast_to(vs, [sizes[lab] for lab in batch + [kv] + heads] + [sizes["e"]])
        vs = vs.reshape(b, kv_len, n_heads, -1)
        if cap is None and not extra:
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
            )
        order = batch + [t] + heads + group + ["e"]
        o = o.reshape([sizes[lab] for lab in order])
        present = [lab for lab in a.out if lab in order]
        o = jnp.transpose(o, [order.index(lab) for lab in present])
        return o.reshape([sizes[lab] if lab in sizes else 1 for lab in a.out]).astype(out_dtype)

    return run
