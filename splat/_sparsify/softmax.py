"""The softmax of attention, matched through the shape ops that vectorised code puts in it.

``P = E / Z`` with ``E = exp(X - M)`` (or ``exp(X)``), ``M`` a row max of ``X`` and ``Z`` the row
sum of ``E``. Code that vectorises with named axes (penzai's ``nmap`` is nested ``vmap``s) takes
the max on the scores as laid out and subtracts it from a transposed copy, and sums a transposed
copy; so identity of arrays is not the test. Instead each operand is walked back through shape
ops (*views*: transposes, reshapes, converts, copies) to its *root*, the first value that is not
a view, and the axes of every view are labelled by the root axis they come from
(:mod:`splat._sparsify.labels`: a reshape may merge or split axes other than the reduced one).
Then:

- ``M`` must come from one ``reduce_max`` over one root axis k of the root of ``X``, through
  views, broadcasts, ``stop_gradient`` and scalar elementwise ops (``max(m, -inf)`` of
  ``jnp.max(initial=)``); on every axis of ``X`` other than k, ``M`` has the same label, and
  along k it is constant. So ``M`` is a per-row shift: the softmax is the same whatever it is;
- ``Z`` must come from one ``reduce_sum`` of a view of the numerator's root, over the axis
  the numerator holds as its key axis, through views and broadcasts only;
- a reduction over any other axis does not match (it is not a softmax).

``E`` may be masked after the ``exp`` (``where(mask, e, 0)`` or ``e * mask``): a mask on the
logits with fill -inf. Without ``Z`` (``exp(s - max) @ V / rowsum``, flash-style reference
code) the match says so (``normalised=False``) and the matcher looks for the division after
``P @ V``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from jax.extend import core as jex_core

from splat._sparsify import labels as lab_ops
from splat._sparsify.ir import IR, Node, build_ir
from splat._sparsify.numeric import NEG_THRESHOLD, NotSparsifiable, Slices

__all__ = ["VIEW", "Softmax", "aligned", "match_softmax", "post_mask", "row_stat", "view_root"]

VIEW = ("transpose", "reshape", "squeeze", "convert_element_type", "copy", "copy_p")


@dataclass
class Softmax:
    """A matched softmax (or unnormalised ``exp``) of the logits ``x`` along its axis ``axis``.

    ``to_p``: ``(ir, node)`` shape ops mapping ``x``'s axes to the matched value's; ``masks``:
    ``(pred, negate, test)`` applied to the exponentials, in ``x``'s layout (see
    :func:`post_mask`); ``e_root``: the (masked) exponentials, whose row sum normalises.
    """

    x: int
    axis: int | None  # None: unnormalised without a shift; the division's row sum names it
    e_root: int
    normalised: bool
    to_p: list = field(default_factory=list)
    masks: list = field(default_factory=list)


def view_root(ir: IR, vid: int, ops: Sequence[str] = VIEW) -> tuple[int, list[Node]]:
    """(root, views from the root to ``vid`` in program order)."""
    chain = []
    while True:
        node = ir.node_of(vid)
        if node is None or node.prim.name not in ops:
            return vid, chain[::-1]
        chain.append(node)
        vid = node.ins[0]


def _forward(ir: IR, chain, labels: list, size) -> list | None:
    for node in chain:
        labels = lab_ops.forward(ir, node, labels, size)
        if labels is None:
            return None
    return labels


def row_stat(ir: IR, sl: Slices, vid: int, reduce: str) -> tuple[int, list, int] | None:
    """``(root, labels, k)`` when ``vid`` is a row ``reduce`` (``reduce_max`` / ``reduce_sum``) of
    a view of ``root`` over root axis ``k``; ``labels``: the root axis of each axis of ``vid``
    (None where ``vid`` is constant along it)."""
    after = []
    v = vid
    while True:
        node = ir.node_of(v)
        if node is None:
            return None
        name = node.prim.name
        if name == reduce:
            break
        if name in VIEW or name == "broadcast_in_dim":
            after.append(node)
            v = node.ins[0]
        elif reduce == "reduce_max" and name == "stop_gradient":
            after.append(node)
            v = node.ins[0]
        elif reduce == "reduce_max" and len(node.ins) == 2 and name in ("max", "min", "add", "sub"):
            # a scalar constant keeps it a per-row value: jnp.max's `initial` is max(m, -inf)
            rows = [u for u in node.ins if not (ir.shape(u) == () and sl.independent(u))]
            if len(rows) != 1 or ir.shape(rows[0]) != ir.shape(v):
                return None
            v = rows[0]
        else:
            return None
    root, chain = view_root(ir, node.ins[0])
    root_shape = ir.shape(root)

    def size(atom):
        return root_shape[atom]

    lab = _forward(ir, chain, list(range(len(root_shape))), size)
    if lab is None:
        return None
    in_shape = ir.shape(node.ins[0])
    axes = {int(a) for a in node.params["axes"]}
    reduced = [lab[a] for a in axes if in_shape[a] != 1]
    if len(reduced) != 1 or not isinstance(reduced[0], int):
        return None  # over several axes, or a merged one: not a row of keys
    lab = [x for a, x in enumerate(lab) if a not in axes]
    for n in reversed(after):
        lab = lab_ops.forward(ir, n, lab, size) if n.prim.name in VIEW + ("broadcast_in_dim",) else lab
        if lab is None:
            return None
    return root, lab, reduced[0]


def aligned(labels: Sequence, stat_labels: Sequence, key: int, shape, stat_shape) -> bool:
    """True when a row statistic (``stat_labels``) lines up with the values it shifts or divides:
    the same root axis wherever ``labels`` has one, constant along the key axis ``key``."""
    if len(labels) != len(stat_labels) or len(shape) != len(stat_shape):
        return False
    if [x for x in labels if x == key] != [key] or any(isinstance(x, tuple) and key in x for x in labels):
        return False
    for a, (x, m) in enumerate(zip(labels, stat_labels, strict=True)):
        if shape[a] == 1:
            continue
        if x == key:
            if m is not None:
                return False
        elif m != x or stat_shape[a] != shape[a]:
            return False
    return True


def same_value(sl: Slices, a: int, b: int) -> bool:
    """True when ``a`` and ``b`` hold the same array: equal slices (:meth:`Slices.fingerprint`).
    ``jax.nn.softmax(where=)`` masks the logits twice, once for the row max and once for the shift."""
    return a == b or sl.fingerprint(a) == sl.fingerprint(b)


def _zero_where_masked(ir: IR, sl: Slices, x: int, pred: int, negate: bool) -> bool:
    """True when the logits ``x`` are ``where(pred, s, fill)`` (``negate``: ``where(pred, fill,
    s)``) with a large negative fill: their exponentials are 0 wherever that mask drops them."""
    node = ir.node_of(x)
    if node is None or node.prim.name != "select_n" or len(node.ins) != 3:
        return False
    if not same_value(sl, node.ins[0], pred):
        return False
    fill = node.ins[2 if negate else 1]  # select_n's case 0 is taken where pred is false
    if not sl.independent(fill):
        return False
    try:
        return sl.scalar(fill) <= NEG_THRESHOLD
    except NotSparsifiable:
        return False


def _is_zero(sl: Slices, vid: int) -> bool:
    if not sl.independent(vid):
        return False
    try:
        return sl.scalar(vid) == 0
    except NotSparsifiable:
        return False


def _bool_factor(ir: IR, vid: int) -> bool:
    """True when ``vid`` is a boolean mask cast to a number (0 or 1), seen through shape ops."""
    src, _ = view_root(ir, vid, ("broadcast_in_dim", "transpose", "reshape", "squeeze", "copy", "copy_p"))
    node = ir.node_of(src)
    return (
        node is not None
        and node.prim.name == "convert_element_type"
        and np.dtype(ir.avals[node.ins[0]].dtype) == np.bool_
    )


def post_mask(ir: IR, sl: Slices, node: Node) -> tuple[int, tuple] | None:
    """``(masked value, (pred, negate, test))`` when ``node`` zeroes entries of a value by a mask:
    ``select_n(pred, 0, x)`` (kept where pred), ``select_n(pred, x, 0)`` (negated), or
    ``x * float(mask)`` (``pred`` the factor, test ``("ne", 0)``)."""
    name = node.prim.name
    if name == "select_n" and len(node.ins) == 3:
        pred, c0, c1 = node.ins
        if _is_zero(sl, c0) and not sl.independent(c1):
            return c1, (pred, False, None)
        if _is_zero(sl, c1) and not sl.independent(c0):
            return c0, (pred, True, None)
    if name == "mul" and len(node.ins) == 2:
        a, b = node.ins
        for x, f in ((a, b), (b, a)):
            fs, out = ir.shape(f), ir.shape(node.outs[0])  # the factor may broadcast size-1 axes
            fits = len(fs) == len(out) and all(n in (1, m) for n, m in zip(fs, out, strict=True))
            if fits and ir.shape(x) == out and _bool_factor(ir, f) and not _bool_factor(ir, x):
                return x, (f, False, ("ne", 0))
    return None


def _exp_part(ir: IR, sl: Slices, e: int) -> tuple[int, int | None, list] | None:
    """``(x, shift axis or None, masks)`` when ``e`` is ``exp(x - row max)`` or ``exp(x)``, masked."""
    masks = []
    while True:
        node = ir.node_of(e)
        if node is None:
            return None
        got = post_mask(ir, sl, node)
        if got is None:
            break
        e = got[0]
        masks.append(got[1])
    if node.prim.name != "exp":
        return None
    y = node.ins[0]
    sub = ir.node_of(y)
    if sub is None or sub.prim.name != "sub":
        return y, None, masks
    x, m = sub.ins
    if ir.shape(x) != ir.shape(y):
        return None
    stat = row_stat(ir, sl, m, "reduce_max")
    if stat is None:
        return None
    root_m, m_labels, key = stat
    root_x, chain = view_root(ir, x)
    if not same_value(sl, root_x, root_m):
        return None
    root_shape = ir.shape(root_x)
    x_labels = _forward(ir, chain, list(range(len(root_shape))), lambda a: root_shape[a])
    if x_labels is None or not aligned(x_labels, m_labels, key, ir.shape(x), ir.shape(m)):
        return None
    return x, x_labels.index(key), masks


def match_softmax(ir: IR, sl: Slices, vid: int) -> Softmax | None:
    """The softmax (or masked, shifted ``exp``) that computes ``vid``, or None."""
    node = ir.node_of(vid)
    if node is None:
        return None
    if node.prim.name == "custom_jvp_call":
        return _match_custom_jvp(node)
    if node.prim.name == "div":
        n, z = node.ins
        e_root, n_chain = view_root(ir, n)
        stat = row_stat(ir, sl, z, "reduce_sum")
        if stat is None:
            return None
        # the sum may be of the exponentials masked by the logits' own mask (softmax(where=)): the
        # same sum, as they are 0 where it drops them
        summed = post_mask(ir, sl, ir.node_of(stat[0])) if stat[0] != e_root and ir.node_of(stat[0]) else None
        if stat[0] != e_root and (summed is None or summed[0] != e_root or summed[1][2] is not None):
            return None
        _, z_labels, key = stat
        e_shape = ir.shape(e_root)
        n_labels = _forward(ir, n_chain, list(range(len(e_shape))), lambda a: e_shape[a])
        if n_labels is None or not aligned(n_labels, z_labels, key, ir.shape(n), ir.shape(z)):
            return None
        part = _exp_part(ir, sl, e_root)
        if part is None or (part[1] is not None and part[1] != key) or ir.shape(part[0]) != e_shape:
            return None
        if summed is not None and not _zero_where_masked(ir, sl, part[0], summed[1][0], summed[1][1]):
            return None
        return Softmax(part[0], key, e_root, True, [(ir, x) for x in n_chain], part[2])
    part = _exp_part(ir, sl, vid)
    if part is None:
        return None
    # unnormalised: the division after P @ V confirms the key axis (and gives it without a shift)
    return Softmax(part[0], part[1], vid, False, [], part[2])


def _match_custom_jvp(node: Node) -> Softmax | None:
    """``jax.nn.softmax`` (a ``custom_jvp``): the softmax inside, on a view of its one input."""
    inner = node.params.get("call_jaxpr")
    if inner is None or len(node.ins) != 1 or len(node.outs) != 1:
        return None
    sub = build_ir(inner if isinstance(inner, jex_core.ClosedJaxpr) else jex_core.ClosedJaxpr(inner, ()))
    sm = match_softmax(sub, Slices(sub), sub.outputs[0])
    if sm is None or not sm.normalised or sm.masks:
        return None
    root, chain = view_root(sub, sm.x)
    if root != sub.inputs[0]:
        return None
    in_shape = sub.shape(root)
    x_labels = _forward(sub, chain, list(range(len(in_shape))), lambda a: in_shape[a])
    if x_labels is None or not isinstance(x_labels[sm.axis], int):
        return None
    return Softmax(node.ins[0], x_labels[sm.axis], node.outs[0], True, [(sub, x) for x in chain] + sm.to_p)
