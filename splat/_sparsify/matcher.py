"""The attention-pattern matcher: ``softmax(Q K^T * scale, masked) @ V`` in a flat IR.

:func:`match_pv` takes one ``dot_general`` as the candidate ``P @ V``. ``P`` must be a softmax
(:mod:`splat._sparsify.softmax`: ``exp(x - max) / sum`` through the shape ops vectorised code
puts in it, or a ``custom_jvp`` softmax), possibly masked again after it (Keras's
``Softmax(mask)``: allowed when the mask is the one applied before it); or ``exp(x - max)``
alone, when the product is divided by the row sum after (flash-style reference code). From the
softmax input the matcher walks back to the ``Q @ K^T`` ``dot_general`` through converts,
transposes, scalar ``mul``/``div`` (the scale), ``select_n`` against a large negative fill and
``add`` of a 0/-inf bias, labels every axis (batch, query sequence, heads, GQA group, key
sequence, head dim), and builds the mask of the constant mask terms
(:func:`terms.make_mask`). The returned :class:`Match` carries the function that runs splat's
attention on the matched Q, K, V in their original layout (:mod:`splat._sparsify.call`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from splat import masks
from splat._analyzer import analyze
from splat._sparsify import labels as lab_ops
from splat._sparsify import positions
from splat._sparsify import runtime as rt_ops
from splat._sparsify.call import Arrangement, attention_call
from splat._sparsify.guard import Guard, row_extents
from splat._sparsify.ir import IR, Node, between, reads_any
from splat._sparsify.numeric import NEG_THRESHOLD, NotSparsifiable, Slices
from splat._sparsify.predicate import split_predicate
from splat._sparsify.softmax import Softmax, match_softmax, post_mask, row_stat
from splat._sparsify.terms import make_mask, mask_term, no_labels_on_size1, same_post_mask

__all__ = ["Found", "Match", "match_pv"]

_PASS = ("convert_element_type", "copy", "copy_p")
_SHAPE = ("transpose", "reshape", "squeeze")


@dataclass(frozen=True)
class Found:
    """One dense attention that ``sparsify`` replaced.

    Attributes:
      mask: the detected :class:`splat.masks.Mask`: constructors (e.g.
        ``SlidingWindow(left=1023, right=0)``) where recognised, else an exact
        ``from_fn`` predicate.
      q_len, kv_len: sequence lengths of the matched attention.
      scale: the logit scale found (with a soft cap: the scale of ``q . k`` inside
        ``cap * tanh(scale * q . k / cap)``, as :func:`splat.attention` takes it).
      heads: ``(kv_heads, group)``: query heads = kv_heads * group (GQA).
      soft_cap: the logit soft cap found (``c * tanh(x / c)``), or None.
      runtime: the input-dependent mask terms passed as runtime arguments: any of
        "kv_padding", "q_padding", "segment_ids" (see :mod:`splat._sparsify.runtime`), then
        "positions" where position arrays go to splat (``q_positions`` / ``kv_positions``) and
        "positions=indices" where a side read by index and by position goes at its indices, its
        positions checked at run time (:mod:`splat._sparsify.guard`).
    """

    mask: Any
    q_len: int
    kv_len: int
    scale: float
    heads: tuple[int, int]
    soft_cap: float | None = None
    runtime: tuple[str, ...] = ()


@dataclass
class Match:
    pv_out: int  # the value replaced: the P @ V output, or the division after it
    q: int
    k: int
    v: int
    fn: Callable
    found: Found
    extra: tuple[int, ...] = ()  # more inputs of ``fn`` after q, k, v (runtime mask sources)


def _forward_labels(ir: IR, labels: list, chain, size) -> list:
    """Labels through shape ops; ``chain`` items are nodes of ``ir`` or ``(ir, node)`` pairs."""
    for item in chain:
        node_ir, node = item if isinstance(item, tuple) else (ir, item)
        labels = lab_ops.forward(node_ir, node, labels, size)
        if labels is None:
            raise NotSparsifiable(
                f"a `{node.prim.name}` of the attention scores to "
                f"{node_ir.avals[node.outs[0]].str_short()} splits an axis that splat cannot follow"
            )
    return labels


def _check_mask_position(cap, outer: float, what: str) -> None:
    """A mask term must meet the logits after the soft cap and before no non-positive factor."""
    if cap is not None:
        raise NotSparsifiable(
            f"the {what} is applied before the logit soft cap (`tanh`), which maps its fill to -cap: "
            "that is not a mask splat can express"
        )
    if not outer > 0:
        raise NotSparsifiable(f"the masked logits are multiplied by {outer}; a mask needs a positive scale")


def _probs(ir: IR, sl: Slices, vid: int) -> tuple[Softmax, list] | None:
    """(softmax, items from it to ``vid``): shape ops ("pass") and, after a normalised softmax,
    masks of the probabilities ("post") in between."""
    items = []
    while True:
        node = ir.node_of(vid)
        if node is None:
            return None
        if node.prim.name not in _PASS + _SHAPE:
            break
        items.append(("pass", node, None))
        vid = node.ins[0]
    sm = match_softmax(ir, sl, vid)  # a softmax, or exp(x - max) masked before the product
    if sm is not None:
        return sm, items[::-1]
    while True:  # Keras's Softmax(mask): the probabilities masked again
        got = post_mask(ir, sl, node)
        if got is not None:
            items.append(("post", node, got[1]))
            vid = got[0]
        elif node.prim.name in _PASS + _SHAPE:
            items.append(("pass", node, None))
            vid = node.ins[0]
        else:
            break
        node = ir.node_of(vid)
        if node is None:
            return None
    sm = match_softmax(ir, sl, vid)
    return (sm, items[::-1]) if sm is not None and sm.normalised else None


def _walk_logits(ir: IR, sl: Slices, x: int):
    """``(chain, scale, cap, qk)`` from the softmax input back to ``Q @ K^T``, or None.

    ``scale`` multiplies the factors met so far, which apply after what comes next; a ``tanh``
    turns them into the soft cap and restarts it.
    """
    chain: list[tuple[str, Node, Any]] = []
    scale, cap = 1.0, None
    cur = x
    while True:
        node = ir.node_of(cur)
        if node is None:
            return None
        name = node.prim.name
        if name in _PASS or name in _SHAPE:
            chain.append(("pass", node, None))
            cur = node.ins[0]
        elif name == "tanh":
            if cap is not None:
                raise NotSparsifiable("the attention logits pass through `tanh` twice; splat has one cap")
            if not scale > 0:
                raise NotSparsifiable(f"the soft cap's `tanh` is multiplied by {scale}, not a positive cap")
            cap, scale = scale, 1.0
            cur = node.ins[0]
        elif name in ("mul", "div", "add", "select_n"):
            dyn = [u for u in node.ins if not sl.independent(u)]
            const = [u for u in node.ins if sl.independent(u)]
            if name == "select_n":
                pred, cases = node.ins[0], node.ins[1:]
                if len(cases) != 2:
                    return None
                fill = [i for i, u in enumerate(cases) if sl.independent(u)]
                if len(fill) != 1:
                    return None
                f = sl.scalar(cases[fill[0]])
                if not f <= NEG_THRESHOLD:
                    raise NotSparsifiable(f"masked logits are filled with {f}, not a large negative value")
                _check_mask_position(cap, scale, "`where` mask")
                chain.append(("mask", node, (pred, fill[0] == 1, None, f)))  # fill in case 1: not pred
                cur = cases[1 - fill[0]]
            elif len(dyn) != 1:
                if name == "add":
                    raise NotSparsifiable("the additive attention bias depends on the function's inputs")
                if name in ("mul", "div"):
                    raise NotSparsifiable("the logit scale depends on the function's inputs")
                return None
            elif name == "add":
                _check_mask_position(cap, scale, "additive mask")
                chain.append(("bias", node, const[0]))
                cur = dyn[0]
            else:
                if name == "div" and node.ins[0] != dyn[0]:
                    return None
                c = sl.scalar(const[0])
                scale *= c if name == "mul" else 1.0 / c
                cur = dyn[0]
        elif name == "dot_general":
            break
        else:
            raise NotSparsifiable(f"the attention logits pass through `{name}`, which splat cannot express")
    if cap is not None:
        scale *= cap  # logits = cap * tanh(inner * qk) = cap * tanh((inner * cap) * qk / cap)
    return chain[::-1], scale, cap, node


def _division(ir: IR, sl: Slices, pv: Node, sm: Softmax):
    """``(div, z labels, key, shape ops)``: ``exp(...) @ V`` divided by the row sum after it."""
    v, fwd = pv.outs[0], []
    while True:
        users = ir.users(v)
        if len(users) != 1:
            return None
        u = users[0]
        if u.prim.name in _PASS + ("transpose",) and u.ins[0] == v:
            fwd.append(u)
            v = u.outs[0]
        elif u.prim.name == "div" and u.ins[0] == v:
            break
        else:
            return None
    stat = row_stat(ir, sl, u.ins[1], "reduce_sum")
    if stat is None or stat[0] != sm.e_root:
        return None
    return u, stat[1], stat[2], fwd


def match_pv(ir: IR, sl: Slices, pv: Node, backend: str, empty_rows: str = "fallback") -> Match | None:
    """Match one ``dot_general`` as ``softmax(...) @ V``; None if it is not attention.

    Raises:
      NotSparsifiable: it is attention, but splat cannot take it (message says why).
    """
    (lc, rc), (lb, rb) = pv.params["dimension_numbers"]
    if len(lc) != 1:
        return None
    for side in (0, 1):
        got = _probs(ir, sl, pv.ins[side])
        if got is not None:
            break
    else:
        return None
    sm, p_items = got
    division = None
    if not sm.normalised:
        division = _division(ir, sl, pv, sm)
        if division is None or (sm.axis is not None and sm.axis != division[2]):
            return None
        sm.axis = division[2]
    walked = _walk_logits(ir, sl, sm.x)
    if walked is None:
        return None
    chain, scale, cap, qk = walked
    # labels: QK^T output axis numbers (atoms), carried forward to the softmax and to P
    qk_shape = ir.shape(qk.outs[0])

    def size(atom):
        return qk_shape[atom]

    labels: list = list(range(len(qk_shape)))
    mask_terms, runtime_leaves, pre_leaves, fills = [], [], [], []
    for kind, node, info in chain:
        if kind == "pass":
            labels = _forward_labels(ir, labels, [node], size)
        elif kind == "mask":
            static, dynamic = split_predicate(ir, sl, info[0], labels, info[1], size)
            mask_terms += [mask_term(leaf) for leaf in static]
            runtime_leaves += dynamic
            pre_leaves += static + dynamic
            fills.append(info[3])
        elif kind == "bias":
            mask_terms.append(("bias", info, False, labels))
            fills.append(-np.inf)  # a 0/-inf bias: a fully masked row is NaN
    # masks of the exponentials (and, unnormalised, of the product's operand): fill -inf
    e_masks = [(m, labels) for m in sm.masks]
    p_labels = _forward_labels(ir, labels, sm.to_p, size)
    post = []
    for kind, node, info in p_items:
        if kind == "pass":
            p_labels = _forward_labels(ir, p_labels, [node], size)
        else:
            post.append((info, p_labels))
    for (pred, negate, test), lab in e_masks:
        static, dynamic = split_predicate(
            ir, sl, pred, no_labels_on_size1(ir, pred, lab), negate, size, test=test
        )
        mask_terms += [mask_term(leaf) for leaf in static]
        runtime_leaves += dynamic
        fills.append(-np.inf)
    kv = labels[sm.axis]
    if not isinstance(kv, int):
        return None

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
    v_vid = pv.ins[1 - side]
    p_con, v_con = (lc, rc)[side][0], (lc, rc)[1 - side][0]
    p_bat, v_bat = (lb, rb)[side], (lb, rb)[1 - side]
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
    out_labels += p_free + ["e"] if side == 0 else ["e"] + p_free
    out_vid = pv.outs[0]
    if division is not None:
        out_labels, out_vid = _divided_labels(ir, division, out_labels, labels, size)

    # masks taken at positions computed from the inputs: those leaves become constant masks in
    # position coordinates, and the positions runtime arguments
    pos = positions.find(
        ir,
        sl,
        [leaf for leaf in runtime_leaves if _not_ids(ir, leaf)],
        set(range(nb)),
        q_free,
        kv,
        size,
    )
    position_leaves = []  # the leaves made constant by reading positions as indices
    if pos is not None:
        sl = pos.slices
        leaves, runtime_leaves = runtime_leaves, []
        for leaf in leaves:
            static, dynamic = split_predicate(
                ir, sl, leaf.vid, leaf.labels, leaf.negate, size, test=leaf.test
            )
            mask_terms += [mask_term(x) for x in static]
            position_leaves += static
            runtime_leaves += dynamic

    # which query-free axis is the sequence axis? the one the masks vary along
    mask_axes: set = set()
    todo, mask_terms = mask_terms, []
    while todo:
        kind, vid, negate, lab = term = todo.pop(0)
        dims = {lab[a] for a in sl.deps(vid)} if len(ir.shape(vid)) == len(lab) else set()
        if kind != "bias" and dims - set(q_free) - {kv}:
            # a constant that varies across the batch (a concrete padding mask argument): its
            # parts that do are passed at run time like an input's
            test = kind[1:] if isinstance(kind, tuple) else None
            static, dynamic = split_predicate(ir, sl, vid, lab, negate, size, split_constants=True, test=test)
            if len(static) == 1 and static[0].vid == vid:  # nothing to split
                runtime_leaves.append(static[0])
            else:
                todo += [mask_term(leaf) for leaf in static]
                runtime_leaves += dynamic
            continue
        mask_terms.append(term)
        mask_axes |= dims
    if not mask_terms and not runtime_leaves:
        if post:
            raise NotSparsifiable(
                "the attention probabilities are masked only after the softmax (`where`/`*` on them): they "
                "are not renormalised, so this is not the masked attention splat computes"
            )
        raise NotSparsifiable("found dense attention without a mask; nothing to sparsify")
    if mask_axes - set(q_free) - {kv}:
        raise NotSparsifiable("the attention mask differs across batch or heads")
    seq = [lab for lab in q_free if lab in mask_axes]
    if len(seq) > 1:
        raise NotSparsifiable("the attention mask varies along two query axes")
    if not seq and pos is not None and pos.q is not None:  # a one-token query at a position
        seq = [a for x in pos.q[1] for a in lab_ops.atoms(x) if a in q_free]
    if not seq and pos is not None and pos.q_start is not None:  # one row sliced at a position
        seq = [lab for lab in q_free if qk_shape[lab] == 1][:1]
    if not seq:
        seq = _sequence_axis(ir, runtime_leaves, q_free, kv, qk_shape)
    t = seq[0]
    q_len, kv_len = qk_shape[t], qk_shape[kv]
    # a side read by index and by position is passed at its indices, its positions checked at run
    # time where the other terms let a pair be seen (``guard``)
    checked = _checked_sides(pos, mask_terms, t, kv, q_len, kv_len)
    if checked and pos.q_start is not None:
        raise NotSparsifiable("the attention mask slices a constant at a query start and compares indices")
    at_positions = pos is not None and (
        pos.q_start is not None or any(getattr(pos, s) is not None and s not in checked for s in ("q", "kv"))
    )
    rows = kv_len if at_positions else q_len  # positions index rows of the (Skv, Skv) mask

    mask = make_mask(sl, mask_terms, t, kv, rows, kv_len) if mask_terms else masks.full()
    # Keras's Softmax(mask) masks the probabilities again: exact when it is the same mask, and
    # then a fully masked row is 0 in the dense function too (select; mul unless a fill is -inf)
    zero_rows = False
    if post:
        others = bool(e_masks) or any(kind == "bias" for kind, _, _ in chain)
        same = same_post_mask(ir, sl, post, pre_leaves, mask, (t, kv, q_len, kv_len), size, others)
        zero_rows = same and (all(info[2] is None for info, _ in post) or all(np.isfinite(f) for f in fills))
    layout = _analysed(mask, rows, kv_len)
    empty = np.flatnonzero(layout.row_counts() == 0)
    if empty.size and empty_rows != "zero" and not zero_rows:
        dense = "NaN" if any(not np.isfinite(f) for f in fills) else "mean(V)"
        raise NotSparsifiable(
            f"the mask leaves {empty.size} query row(s) fully masked (first: row {int(empty[0])}); splat "
            f"outputs 0 there but this function outputs {dense}, so it was left dense "
            '(pass empty_rows="zero" to accept zeros on those rows)'
        )

    sizes = {lab: qk_shape[lab] for lab in range(len(qk_shape))}
    sizes["e"] = ir.shape(v_vid)[v_free[0]]
    t_pos = q_lab.index(t)
    batch = [lab for i, lab in enumerate(q_lab) if isinstance(lab, int) and lab < nb and i < t_pos]
    heads = [lab for i, lab in enumerate(q_lab) if isinstance(lab, int) and lab < nb and i > t_pos]
    runtime = rt_ops.classify(ir, sl, runtime_leaves, batch, t, kv, size)
    if runtime.q_valid and empty_rows != "zero" and not zero_rows:
        raise NotSparsifiable(
            "the mask has a query padding term computed from the function's inputs: its padded rows see "
            "no key, where splat outputs 0 and this function does not, so it was left dense "
            '(pass empty_rows="zero" to accept zeros on those rows)'
        )
    group = [lab for lab in q_free if lab != t]
    arrangement = Arrangement(q_lab, k_lab, v_lab, out_labels, batch, heads, group, t, kv, sizes)
    # position arrays are checked at run time: inside the mask, equal to the indices they stand in
    # for (``checked``), equal to a sliced constant's rows; the original attention runs where not
    guard = None
    if pos is not None and (pos.q is not None or pos.kv is not None):
        # the extents of the terms that read no checked side's positions (``guard``'s A)
        read = {getattr(pos, s)[0] for s in checked}
        unchecked = [term for term in mask_terms if not reads_any(ir, term[1], read)]
        seen = make_mask(sl, unchecked, t, kv, rows, kv_len) if unchecked else masks.full()
        first, last = row_extents(_analysed(seen, rows, kv_len))
        key_terms = _key_terms(ir, sl, pos, checked, position_leaves, batch, t, kv, size)
        guard = Guard(checked, first, last, key_terms, *between(ir, {q_vid, k_vid}, out_vid), out_vid)
    run = attention_call(
        arrangement,
        layout,
        scale,
        cap,
        runtime,
        backend,
        ir.avals[out_vid].dtype,
        positions=pos,
        guard=guard,
        consts={**ir.consts, **ir.outer},
    )
    found = Found(
        mask=mask,
        q_len=q_len,
        kv_len=kv_len,
        scale=float(scale),
        heads=(int(np.prod([sizes[h] for h in heads])), int(np.prod([sizes[g] for g in group]))),
        soft_cap=None if cap is None else float(cap),
        runtime=runtime.describe()
        + (("positions",) if at_positions else ())
        + (("positions=indices",) if checked else ()),
    )
    extra = tuple(runtime.vids) + tuple(pos.vids if pos is not None else ())
    if guard is not None:
        extra += tuple(guard.key_terms.vids)
        extra += tuple(v for v in guard.reads if v not in ir.consts and v not in ir.outer)
    return Match(out_vid, q_vid, k_vid, v_vid, run, found, extra)


def _analysed(mask, rows: int, kv_len: int):
    """``mask``'s layout, analysed (and cached) now, so that its errors surface here."""
    try:
        return analyze(mask, rows, kv_len)
    except NotSparsifiable:
        raise
    except Exception as e:  # a mask splat cannot analyse: report, do not crash the user's model
        raise NotSparsifiable(f"the detected mask could not be analysed ({type(e).__name__}: {e})") from e


def _checked_sides(pos, mask_terms: list, t, kv, q_len: int, kv_len: int) -> frozenset:
    """The sides (``"q"``, ``"kv"``) with a position array that the mask terms also read by index:
    the call passes them at their indices and checks their positions (see ``guard``)."""
    if pos is None:
        return frozenset()
    by_index = positions.index_atoms(pos, mask_terms, t, kv)
    checked = {s for s, axis in (("q", t), ("kv", kv)) if getattr(pos, s) is not None and axis in by_index}
    # queries at their indices beside keys at positions take rows of the (Skv, Skv) mask: past
    # Skv they would see no key, so the keys go at their indices too
    if checked == {"q"} and pos.kv is not None and q_len > kv_len:
        checked.add("kv")
    return frozenset(checked)


def _key_terms(ir: IR, sl: Slices, pos, checked, leaves: list, batch: list, t, kv, size) -> rt_ops.Runtime:
    """The mask leaves on key positions alone (``kv_pos >= 0``), as key padding terms the guard
    reads at run time: inside the mask they are constant columns, but a key outside it that they
    hide is hidden by the original mask too (``guard``). No terms where the keys are not passed at
    their positions."""
    if pos.kv is None or "kv" in checked:
        return rt_ops.Runtime()
    on_kv = set(batch) | {kv}

    def key_only(leaf) -> bool:
        shape = ir.shape(leaf.vid)
        varies = {a for x, n in zip(leaf.labels, shape, strict=True) if n > 1 for a in lab_ops.atoms(x)}
        return varies <= on_kv and reads_any(ir, leaf.vid, {pos.kv[0]})

    return rt_ops.classify(ir, sl, [leaf for leaf in leaves if key_only(leaf)], batch, t, kv, size)


def _not_ids(ir: IR, leaf) -> bool:
    """Whether a mask leaf is other than an equality of two arrays (segment ids, see
    ``runtime.classify``): equal ids are no positions."""
    node = ir.node_of(leaf.vid)
    return not (leaf.test is None and node is not None and node.prim.name == ("ne" if leaf.negate else "eq"))


def _sequence_axis(ir: IR, leaves, q_free, kv, qk_shape) -> list:
    """The query axis when no constant mask term tells it: the one a runtime term varies along,
    else the one as long as the keys, else the longest. A mask that varies along no query axis is
    the same for every query, so any query axis gives the same attention."""
    if len(q_free) == 1:
        return list(q_free)
    along = {a for leaf in leaves for x in leaf.labels for a in lab_ops.atoms(x) if a in q_free}
    if len(along) == 1:
        return list(along)
    if len(along) > 1:
        raise NotSparsifiable("the attention mask varies along two query axes")
    same = [lab for lab in q_free if qk_shape[lab] == qk_shape[kv]]
    if len(same) == 1:
        return same
    return [max(q_free, key=lambda lab: qk_shape[lab])]


def _divided_labels(ir: IR, division, out_labels: list, x_labels: list, size) -> tuple[list, int]:
    """Labels of ``(exp(...) @ V) / rowsum`` after checking the row sum lines up with each row."""
    div, z_labels, _, fwd = division
    out = _forward_labels(ir, out_labels, fwd, size)
    z = div.ins[1]
    o_shape, z_shape = ir.shape(div.ins[0]), ir.shape(z)
    if len(z_shape) != len(o_shape):
        raise NotSparsifiable("the attention output is divided by a row sum of another shape")
    for a, lab in enumerate(out):
        zl = z_labels[a]
        zq = x_labels[zl] if isinstance(zl, int) else None  # the row sum's axis as a score atom
        if o_shape[a] == 1:
            continue
        if (lab == "e" and zq is not None) or (lab != "e" and (zq != lab or z_shape[a] != o_shape[a])):
            raise NotSparsifiable(
                "the attention output is divided by a sum that is not its rows' softmax sum"
            )
    return out, div.outs[0]
