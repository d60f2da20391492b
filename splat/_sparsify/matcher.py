"""The attention-pattern matcher: ``softmax(Q K^T * scale, masked) @ V`` in a flat IR.

:func:`match_pv` takes one ``dot_general`` as the candidate ``P @ V``, checks that ``P`` is a
softmax (``exp(x - max) / sum``, or a ``custom_jvp`` softmax), walks back from the softmax input
to the ``Q @ K^T`` ``dot_general`` through converts, transposes, scalar ``mul``/``div`` (the
scale), ``select_n`` against a large negative fill and ``add`` of a 0/-inf bias, labels every
axis (batch, query sequence, heads, GQA group, key sequence, head dim), and builds the mask of the
constant mask terms (:func:`symbolic.recognise`, else an exact ``masks.from_fn`` predicate over
:class:`numeric.Slices`). The returned :class:`Match` carries the function that runs
``splat``'s attention on the matched Q, K, V in their original layout.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core

from splat import _attention, masks
from splat._analyzer import analyze
from splat._sparsify.ir import IR, Node, build_ir
from splat._sparsify.numeric import NEG_THRESHOLD, NotSparsifiable, Slices, kept
from splat._sparsify.symbolic import recognise

__all__ = ["Found", "Match", "match_pv"]

_PASS = ("convert_element_type", "copy", "copy_p")


@dataclass(frozen=True)
class Found:
    """One dense attention that ``sparsify`` replaced.

    Attributes:
      mask: the detected :class:`splat.masks.Mask`: constructors (e.g.
        ``SlidingWindow(left=1023, right=0)``) where recognised, else an exact
        ``from_fn`` predicate.
      q_len, kv_len: sequence lengths of the matched attention.
      scale: the logit scale found.
      heads: ``(kv_heads, group)``: query heads = kv_heads * group (GQA).
    """

    mask: Any
    q_len: int
    kv_len: int
    scale: float
    heads: tuple[int, int]


@dataclass
class Match:
    pv_out: int
    q: int
    k: int
    v: int
    fn: Callable
    found: Found


def _strip_back(ir: IR, vid: int, ops=_PASS + ("transpose",)) -> tuple[int, list[Node]]:
    """Walk back from ``vid`` through pass-through ops; returns (source vid, ops forward-ordered)."""
    chain = []
    while True:
        node = ir.node_of(vid)
        if node is None or node.prim.name not in ops:
            return vid, chain[::-1]
        chain.append(node)
        vid = node.ins[0]


def _forward_labels(labels: list, chain: list[Node]) -> list:
    for node in chain:
        if node.prim.name == "transpose":
            labels = [labels[a] for a in node.params["permutation"]]
    return labels


def _match_softmax(ir: IR, sl: Slices, vid: int) -> tuple[int, int] | None:
    """(softmax input vid, reduce axis) when ``vid`` is softmax(x) along one axis."""
    node = ir.node_of(vid)
    if node is None:
        return None
    if node.prim.name == "custom_jvp_call":
        inner = node.params.get("call_jaxpr")
        if inner is None or len(node.ins) != 1 or len(node.outs) != 1:
            return None
        sub_ir = build_ir(
            inner if isinstance(inner, jex_core.ClosedJaxpr) else jex_core.ClosedJaxpr(inner, ())
        )
        m = _match_softmax(sub_ir, Slices(sub_ir), sub_ir.outputs[0])
        if m is None or m[0] != sub_ir.inputs[0]:
            return None
        return node.ins[0], m[1]
    if node.prim.name != "div":
        return None
    e, z = node.ins
    zsrc, _ = _strip_back(ir, z, _PASS + ("broadcast_in_dim", "reshape"))
    red = ir.node_of(zsrc)
    if red is None or red.prim.name != "reduce_sum" or len(red.params["axes"]) != 1:
        return None
    axis = int(red.params["axes"][0])
    if _strip_back(ir, red.ins[0], _PASS)[0] != _strip_back(ir, e, _PASS)[0]:
        return None
    ex = ir.node_of(_strip_back(ir, e, _PASS)[0])
    if ex is None or ex.prim.name != "exp":
        return None
    y = ex.ins[0]
    sub = ir.node_of(y)
    if sub is not None and sub.prim.name == "sub":
        x, m = sub.ins
        if not _is_row_shift(ir, m, x):
            return None
        return x, axis
    return y, axis


def _is_row_shift(ir: IR, m: int, x: int) -> bool:
    """True when ``m`` is computed from ``x`` by reductions/broadcasts only (a per-row shift)."""
    ok = ("reduce_max", "max", "broadcast_in_dim", "reshape", "squeeze", "stop_gradient") + _PASS
    stack, seen_x = [m], False
    while stack:
        v = stack.pop()
        if v == x:
            seen_x = True
            continue
        if v in ir.consts:
            continue
        node = ir.node_of(v)
        if node is None or node.prim.name not in ok:
            return False
        stack.extend(node.ins)
    return seen_x


def match_pv(ir: IR, sl: Slices, pv: Node, backend: str, empty_rows: str = "fallback") -> Match | None:
    """Match one ``dot_general`` as ``softmax(...) @ V``; None if it is not attention.

    Raises:
      NotSparsifiable: it is attention, but splat cannot take it (message says why).
    """
    (lc, rc), (lb, rb) = pv.params["dimension_numbers"]
    if len(lc) != 1:
        return None
    for side in (0, 1):
        src, p_chain = _strip_back(ir, pv.ins[side])
        sm = _match_softmax(ir, sl, src)
        if sm is not None:
            break
    else:
        return None
    x, axis = sm
    # walk back from the softmax input to Q K^T
    chain: list[tuple[str, Node, Any]] = []
    scale = 1.0
    cur = x
    while True:
        node = ir.node_of(cur)
        if node is None:
            return None
        name = node.prim.name
        if name in _PASS or name == "transpose":
            chain.append(("pass", node, None))
            cur = node.ins[0]
        elif name in ("mul", "div", "add", "select_n"):
            dyn = [u for u in node.ins if not sl.independent(u)]
            const = [u for u in node.ins if sl.independent(u)]
            if name == "select_n":
                pred, cases = node.ins[0], node.ins[1:]
                if len(cases) != 2:
                    return None
                if not sl.independent(pred):
                    raise NotSparsifiable("the attention mask depends on the function's inputs")
                fill = [i for i, u in enumerate(cases) if sl.independent(u)]
                if len(fill) != 1:
                    return None
                f = sl.scalar(cases[fill[0]])
                if not f <= NEG_THRESHOLD:
                    raise NotSparsifiable(f"masked logits are filled with {f}, not a large negative value")
                chain.append(("mask", node, (pred, fill[0] == 1)))  # fill in case 1 -> mask = not pred
                cur = cases[1 - fill[0]]
            elif len(dyn) != 1:
                if name == "add":
                    raise NotSparsifiable("the additive attention bias depends on the function's inputs")
                if name in ("mul", "div"):
                    raise NotSparsifiable("the logit scale depends on the function's inputs")
                return None
            elif name == "add":
                chain.append(("bias", node, const[0]))
                cur = dyn[0]
            else:
                if name == "div" and node.ins[0] != dyn[0]:
                    return None
                c = sl.scalar(const[0])
                scale *= c if name == "mul" else 1.0 / c
                cur = dyn[0]
        elif name == "dot_general":
            qk = node
            break
        else:
            raise NotSparsifiable(f"the attention logits pass through `{name}`, which splat cannot express")
    chain.reverse()
    # labels: QK^T output axis numbers, carried forward to the softmax and to P
    qk_shape = ir.shape(qk.outs[0])
    labels = list(range(len(qk_shape)))
    mask_terms = []
    for kind, node, info in chain:
        if kind == "pass" and node.prim.name == "transpose":
            labels = [labels[a] for a in node.params["permutation"]]
        elif kind == "mask":
            mask_terms.append(("where", info[0], info[1], labels))
        elif kind == "bias":
            mask_terms.append(("bias", info, False, labels))
    kv = labels[axis]
    p_labels = _forward_labels(labels, p_chain)

    (qlc, qrc), (qlb, qrb) = qk.params["dimension_numbers"]
    if len(qlc) != 1:
        return None
    nb = len(qlb)
    lrank, rrank = len(ir.shape(qk.ins[0])), len(ir.shape(qk.ins[1]))
    lfree = [a for a in range(lrank) if a not in qlb and a not in qlc]
    rfree = [a for a in range(rrank) if a not in qrb and a not in qrc]

    def operand_labels(rank, batch, contract, free, offset):
        lab = [None] * rank
        for j, a in enumerate(batch):
            lab[a] = j
        lab[contract[0]] = "d"
        for j, a in enumerate(free):
            lab[a] = offset + j
        return lab

    l_lab = operand_labels(lrank, qlb, qlc, lfree, nb)
    r_lab = operand_labels(rrank, qrb, qrc, rfree, nb + len(lfree))
    if kv in r_lab:
        q_vid, k_vid, q_lab, k_lab = qk.ins[0], qk.ins[1], l_lab, r_lab
    elif kv in l_lab:
        q_vid, k_vid, q_lab, k_lab = qk.ins[1], qk.ins[0], r_lab, l_lab
    else:
        return None
    k_free = [lab for lab in k_lab if isinstance(lab, int) and lab >= nb]
    if any(lab != kv and qk_shape[lab] != 1 for lab in k_free):
        return None
    q_free = [lab for lab in q_lab if isinstance(lab, int) and lab >= nb]

    # P @ V: P's contracting axis must be the kv axis
    p_side = side
    v_vid = pv.ins[1 - p_side]
    p_con = (lc, rc)[p_side][0]
    v_con = (lc, rc)[1 - p_side][0]
    p_bat = (lb, rb)[p_side]
    v_bat = (lb, rb)[1 - p_side]
    if p_labels[p_con] != kv:
        return None
    v_rank = len(ir.shape(v_vid))
    v_lab: list = [None] * v_rank
    v_lab[v_con] = kv
    for pa, va in zip(p_bat, v_bat, strict=False):
        if not (isinstance(p_labels[pa], int) and p_labels[pa] < nb):
            raise NotSparsifiable("P @ V batches over a query axis; splat cannot express it")
        v_lab[va] = p_labels[pa]
    v_free = [a for a in range(v_rank) if v_lab[a] is None]
    if len(v_free) != 1:
        return None
    v_lab[v_free[0]] = "e"
    p_free = [p_labels[a] for a in range(len(p_labels)) if a != p_con and a not in p_bat]
    out_labels = [p_labels[a] for a in p_bat]
    out_labels += p_free + ["e"] if p_side == 0 else ["e"] + p_free

    # which query-free axis is the sequence axis? the one the masks vary along
    mask_axes: set = set()
    for _, vid, _, lab in mask_terms:
        if len(ir.shape(vid)) == len(lab):
            mask_axes |= {lab[a] for a in sl.deps(vid)}
    if not mask_terms:
        raise NotSparsifiable("found dense attention without a mask; nothing to sparsify")
    if mask_axes - set(q_free) - {kv}:
        raise NotSparsifiable("the attention mask differs across batch or heads")
    seq = [lab for lab in q_free if lab in mask_axes]
    if len(seq) > 1:
        raise NotSparsifiable("the attention mask varies along two query axes")
    if not seq:
        seq = [lab for lab in q_free if qk_shape[lab] == qk_shape[kv]] if len(q_free) > 1 else q_free
        if len(seq) != 1:
            raise NotSparsifiable("cannot tell which axis of the queries is the sequence axis")
    t = seq[0]
    q_len, kv_len = qk_shape[t], qk_shape[kv]

    mask = _make_mask(sl, mask_terms, t, kv, q_len, kv_len)
    try:
        layout = analyze(mask, q_len, kv_len)  # evaluates (and caches) the layout now: errors surface here
    except NotSparsifiable:
        raise
    except Exception as e:  # a mask splat cannot analyse: report, do not crash the user's model
        raise NotSparsifiable(f"the detected mask could not be analysed ({type(e).__name__}: {e})") from e
    empty = np.flatnonzero(layout.row_counts() == 0)
    if empty.size and empty_rows != "zero":
        fills = [sl.scalar(n.ins[1 + int(info[1])]) for kind, n, info in chain if kind == "mask"]
        dense = (
            "NaN"
            if any(not np.isfinite(f) for f in fills) or any(k == "bias" for k, _, _ in chain)
            else "mean(V)"
        )
        raise NotSparsifiable(
            f"the mask leaves {empty.size} query row(s) fully masked (first: row {int(empty[0])}); splat "
            f"outputs 0 there but this function outputs {dense}, so it was left dense "
            '(pass empty_rows="zero" to accept zeros on those rows)'
        )

    # arrangement for splat: q [B, T, heads*group, D], k/v [B, S, heads, D]
    sizes = {lab: qk_shape[lab] for lab in range(len(qk_shape))}
    sizes["e"] = ir.shape(v_vid)[v_free[0]]
    t_pos = q_lab.index(t)
    batch = [lab for i, lab in enumerate(q_lab) if isinstance(lab, int) and lab < nb and i < t_pos]
    heads = [lab for i, lab in enumerate(q_lab) if isinstance(lab, int) and lab < nb and i > t_pos]
    group = [lab for lab in q_free if lab != t]
    n_heads, n_group = math.prod(sizes[h] for h in heads), math.prod(sizes[g] for g in group)
    out_dtype = ir.avals[pv.outs[0]].dtype

    def arrange(x, lab, order, tail):
        present = [lab.index(o) for o in order + [tail] if o in lab]
        extra = [a for a in range(len(lab)) if lab[a] not in order and lab[a] != tail]  # size-1 axes
        x = jnp.transpose(x, present + extra).reshape([x.shape[a] for a in present])
        for i, o in enumerate(order + [tail]):
            if o not in lab:
                x = jnp.expand_dims(x, i)
        return x

    def run(qv, kv_arr, vv):
        b = math.prod(sizes[lab] for lab in batch)
        qs = arrange(qv, q_lab, batch + [t] + heads + group, "d").reshape(b, q_len, n_heads * n_group, -1)
        ks = arrange(kv_arr, k_lab, batch + [kv] + heads, "d").reshape(b, kv_len, n_heads, -1)
        vs = arrange(vv, v_lab, batch + [kv] + heads, "e")
        vs = jnp.broadcast_to(vs, [sizes[lab] for lab in batch + [kv] + heads] + [sizes["e"]])
        vs = vs.reshape(b, kv_len, n_heads, -1)
        qs, ks, vs, s = _attention._check_qkv(qs, ks, vs, scale)
        o = _attention._attend(qs, ks, vs, layout, s, backend)  # the layout analysed above, not again
        order = batch + [t] + heads + group + ["e"]
        o = o.reshape([sizes[lab] for lab in order])
        return jnp.transpose(o, [order.index(lab) for lab in out_labels]).astype(out_dtype)

    found = Found(mask=mask, q_len=q_len, kv_len=kv_len, scale=float(scale), heads=(n_heads, n_group))
    return Match(pv.outs[0], q_vid, k_vid, v_vid, run, found)


_MASK_CACHE: dict[str, Any] = {}


def _make_mask(sl: Slices, terms, t, kv, q_len: int, kv_len: int) -> masks.Mask:
    """The Mask of the constant mask terms; equal terms share one Mask value.

    Constructors when the symbolic pass recognises the terms (O(q_len + kv_len) work,
    see ``recognise``), else an exact ``masks.from_fn`` predicate evaluated in row chunks.
    """
    ir = sl.ir
    parts = []
    for kind, vid, negate, lab in terms:
        roles = tuple("q" if x == t else "k" if x == kv else "0" for x in lab) if ir.shape(vid) else ()
        parts.append((kind, vid, negate, roles))
    key = f"{q_len}x{kv_len}|" + "|".join(f"{k}:{sl.fingerprint(v)}:{n}:{''.join(r)}" for k, v, n, r in parts)
    if key in _MASK_CACHE:
        return _MASK_CACHE[key]
    if len(_MASK_CACHE) > 256:
        _MASK_CACHE.clear()
    mask = recognise(sl, parts, q_len, kv_len)
    if mask is not None:
        _MASK_CACHE[key] = mask
        return mask

    def predicate(q_idx, kv_idx):
        q_idx, kv_idx = np.asarray(q_idx), np.asarray(kv_idx)
        memo: dict = {}
        out = np.ones(np.broadcast_shapes(q_idx.shape, kv_idx.shape), dtype=bool)
        for kind, vid, negate, roles in parts:
            idx = tuple(q_idx if r == "q" else kv_idx if r == "k" else 0 for r in roles)
            keep = kept(sl.value(vid, idx, memo), kind)
            out &= ~keep if negate else keep
        return out

    _MASK_CACHE[key] = mask = masks.from_fn(predicate)
    return mask
