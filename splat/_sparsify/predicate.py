"""Mask predicates split into AND-ed leaves, through boolean logic and integer mask algebra.

A ``jnp.where(pred, scores, fill)`` predicate is split into an AND of *leaves* through ``and``,
``or`` under negation, ``not`` and shape ops on booleans, each leaf keeping the labels of its
axes (see :mod:`splat._sparsify.labels`). Keras-style integer masks are split too: a leaf may
carry a *test* ``(op, c)`` (it holds where ``op(value, c)``), and

- a comparison with a constant (``mask > 0``, ``mask != 0``, a cast to bool) of a value computed
  elementwise from at most three boolean arrays (``minimum``/``maximum``/``*`` of 0/1 casts,
  ``1 - m``, ``a + b``) is evaluated on every assignment of those booleans; where the result is
  an AND of them (or of their negations), they become the leaves. Nothing is assumed about the
  values: a 0/2 mask is evaluated as 0/2;
- ``min(a, b) > c`` is ``a > c and b > c`` and ``max(a, b) < c`` is ``a < c and b < c`` for any
  values (so an integer padding input of unknown values keeps its exact test); ``a * m`` with
  ``m`` a boolean cast is ``m and a op c`` where ``0 op c`` is false.

Constant sub-predicates are kept whole (the symbolic pass reads them) unless ``split_constants``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from splat._sparsify import labels as lab_ops
from splat._sparsify.ir import IR
from splat._sparsify.numeric import ELEMENTWISE, TESTS, NotSparsifiable, Slices

__all__ = ["STRIP", "Leaf", "leaf_key", "split_predicate"]

STRIP = ("broadcast_in_dim", "transpose", "reshape", "squeeze", "copy", "copy_p")
_MIRROR = {"gt": "lt", "lt": "gt", "ge": "le", "le": "ge", "eq": "eq", "ne": "ne"}
_ALGEBRA = ("min", "max", "mul", "add", "sub", "neg", "convert_element_type", "select_n") + STRIP
_MAX_SOURCES = 3


@dataclass(frozen=True)
class Leaf:
    """One AND-ed term of a mask predicate: ``vid`` (negated when ``negate``), its axes' labels.

    ``test``: None when ``vid`` is boolean (or read as ``!= 0``), else ``(op, c)``: the term is
    ``op(vid, c)`` (see ``numeric.TESTS``).
    """

    vid: int
    labels: tuple
    negate: bool
    test: tuple | None = None


def _is_bool(ir: IR, vid: int) -> bool:
    return np.dtype(ir.avals[vid].dtype) == np.bool_


def _operand_labels(ir: IR, u: int, out: int, lab: tuple) -> tuple:
    """Labels of an elementwise operand: its size-1 (broadcast) axes carry none; scalars have none."""
    ushape, shape = ir.shape(u), ir.shape(out)
    if len(ushape) != len(shape):
        return ()
    return tuple(x if ushape[a] == shape[a] else None for a, x in enumerate(lab))


def _scalar(sl: Slices, vid: int):
    """The value of a constant that is the same everywhere, else None."""
    if not sl.independent(vid) or sl.deps(vid):
        return None
    try:
        return np.asarray(sl.scalar(vid))
    except NotSparsifiable:
        return None


def _bool_function(ir: IR, sl: Slices, vid: int, lab: tuple, size):
    """``(sources, f)``: ``vid`` as an elementwise function ``f`` of boolean ``(vid, labels)``
    sources and scalar constants, evaluated per assignment; None when it is not one."""
    sources: list = []

    def build(v, lab):
        if _is_bool(ir, v) and _scalar(sl, v) is None:
            key = (v, tuple(None if n == 1 else x for x, n in zip(lab, ir.shape(v), strict=True)))
            if key not in sources:
                sources.append(key)
            k = sources.index(key)
            return lambda asg: np.bool_(asg[k])
        c = _scalar(sl, v)
        if c is not None:
            return lambda asg: c
        node = ir.node_of(v)
        if node is None:
            raise LookupError
        name, dt = node.prim.name, np.dtype(ir.avals[v].dtype)
        if name in STRIP:
            back = lab_ops.backward(ir, node, lab, size)
            if back is None:
                raise LookupError
            return build(node.ins[0], tuple(back))
        if name not in ELEMENTWISE and name not in ("select_n", "convert_element_type"):
            raise LookupError
        fs = [build(u, _operand_labels(ir, u, v, lab)) for u in node.ins]
        if name == "convert_element_type":
            return lambda asg: np.asarray(fs[0](asg)).astype(dt)
        if name == "select_n":
            return lambda asg: np.asarray(fs[1 + int(fs[0](asg))](asg)).astype(dt)
        op = ELEMENTWISE[name]
        return lambda asg: np.asarray(op(*[np.asarray(f(asg)) for f in fs])).astype(dt)

    try:
        f = build(vid, lab)
    except (LookupError, NotSparsifiable):
        return None
    if len(sources) > _MAX_SOURCES:
        return None
    return sources, f


def _conjunction(table: dict) -> list[tuple[int, bool]] | None:
    """``[(source, positive)]`` whose AND is the truth table ``table`` (assignment -> bool), or None.

    ``[]`` means always true; None: not an AND of literals (or never true).
    """
    true = [a for a, v in table.items() if v]
    if not true:
        return None
    n = len(next(iter(table)))
    lits = [(k, true[0][k]) for k in range(n) if all(a[k] == true[0][k] for a in true)]
    if len(true) != 2 ** (n - len(lits)):
        return None
    return lits


def split_predicate(
    ir: IR,
    sl: Slices,
    vid: int,
    labels: Sequence,
    negate: bool,
    size: Callable[[int], int],
    split_constants: bool = False,
    test: tuple | None = None,
) -> tuple[list[Leaf], list[Leaf]]:
    """(constant leaves, input-dependent leaves) whose AND is ``vid`` (``not vid`` when ``negate``;
    ``test(vid)`` when a test is given, e.g. ``("ne", 0)`` for a 0/1 factor)."""
    static: list[Leaf] = []
    runtime: list[Leaf] = []
    stack = [(vid, tuple(labels), negate, test)]
    while stack:
        v, lab, neg, tst = stack.pop()
        node = ir.node_of(v)
        indep = sl.independent(v)
        leaves = static if indep else runtime
        # a test on a constant is only moved to the boolean it casts (easier to read), not split
        if (
            tst is not None
            and node is not None
            and (not indep or split_constants or _casts_bool(ir, node) or node.prim.name in STRIP)
        ):
            pushed = _push_test(ir, sl, v, lab, neg, tst, size, split_constants)
            if pushed is not None:
                stack.extend(pushed)
                continue
        if (indep and not split_constants) or node is None or (tst is None and not _is_bool(ir, v)):
            leaves.append(Leaf(v, lab, neg, tst))
            continue
        if tst is not None:
            leaves.append(Leaf(v, lab, neg, tst))
            continue
        name = node.prim.name
        if (name == "and" and not neg) or (name == "or" and neg):
            for u in node.ins:  # same rank; size-1 operand axes broadcast
                stack.append((u, _operand_labels(ir, u, v, lab), neg, None))
        elif name == "not":
            stack.append((node.ins[0], lab, not neg, None))
        elif name in STRIP or (name == "convert_element_type" and _is_bool(ir, node.ins[0])):
            back = lab_ops.backward(ir, node, lab, size)
            if back is None:
                leaves.append(Leaf(v, lab, neg))
            else:
                stack.append((node.ins[0], tuple(back), neg, None))
        elif name == "convert_element_type" and _algebra(ir, node.ins[0]):  # a cast to bool: != 0
            stack.append((node.ins[0], lab, neg, ("ne", 0)))
        elif name in _MIRROR and len(node.ins) == 2:
            got = _compare(ir, sl, node, lab, neg, size, split_constants)
            if got is None:
                leaves.append(Leaf(v, lab, neg))
            else:
                stack.append(got)
        else:
            leaves.append(Leaf(v, lab, neg))
    return static, runtime


def _casts_bool(ir: IR, node) -> bool:
    return node.prim.name == "convert_element_type" and _is_bool(ir, node.ins[0])


def _is_cast(ir: IR, vid: int) -> bool:
    node = ir.node_of(vid)
    return node is not None and _casts_bool(ir, node)


def _algebra(ir: IR, vid: int) -> bool:
    node = ir.node_of(vid)
    return node is not None and node.prim.name in _ALGEBRA


def _compare(ir: IR, sl: Slices, node, lab, neg, size, split_constants=False):
    """``cmp(a, c)`` with ``a`` integer mask algebra and ``c`` a scalar constant: test ``a``."""
    a, b = node.ins
    op = node.prim.name
    c = _scalar(sl, b)
    if c is None:
        a, b, op = b, a, _MIRROR[op]
        c = _scalar(sl, b)
    if c is None or (sl.independent(a) and not split_constants) or not _algebra(ir, a) or _is_bool(ir, a):
        return None
    lab_a = _operand_labels(ir, a, node.outs[0], lab)
    # index arithmetic (positions - positions < w) stays one leaf; add/sub only of boolean casts
    if ir.node_of(a).prim.name in ("add", "sub", "neg") and _bool_function(ir, sl, a, lab_a, size) is None:
        return None
    return a, lab_a, neg, (op, c[()])


def _push_test(ir: IR, sl: Slices, v: int, lab: tuple, neg: bool, tst: tuple, size, split_constants=False):
    """Stack items equivalent to the leaf ``tst(v)`` (negated when ``neg``), or None."""
    node = ir.node_of(v)
    name = node.prim.name
    op, c = tst
    if name in STRIP:
        back = lab_ops.backward(ir, node, lab, size)
        return None if back is None else [(node.ins[0], tuple(back), neg, tst)]
    if sl.independent(v) and not split_constants and not _casts_bool(ir, node):
        return None
    got = _bool_function(ir, sl, v, lab, size)
    if got is not None:
        sources, f = got
        n = len(sources)
        table = {}
        for k in range(2**n):
            asg = tuple(bool(k >> b & 1) for b in range(n))
            table[asg] = bool(TESTS[op](f(asg), c)) != neg
        lits = _conjunction(table)
        if lits is not None:
            return [(sources[k][0], sources[k][1], not pos, None) for k, pos in lits]
    if name == "convert_element_type":
        src, dst = np.dtype(ir.avals[node.ins[0]].dtype), np.dtype(ir.avals[v].dtype)
        same = (
            np.issubdtype(src, np.integer) and np.issubdtype(dst, np.integer) and src.itemsize <= dst.itemsize
        )
        if same or (
            np.issubdtype(src, np.floating)
            and np.issubdtype(dst, np.floating)
            and src.itemsize <= dst.itemsize
        ):
            return [(node.ins[0], lab, neg, tst)]  # value-preserving: the test reads the same values
        return None
    if name in ("min", "max") and op in ("gt", "ge", "lt", "le"):
        upper = op in ("gt", "ge")  # min > c: both > c; max < c: both < c (any values)
        if (name == "min") == upper and not neg or (name == "min") != upper and neg:
            return [(u, _operand_labels(ir, u, v, lab), neg, tst) for u in node.ins]
        return None
    if name == "mul" and not neg and not bool(TESTS[op](np.asarray(0), c)):
        for x, m in (node.ins, node.ins[::-1]):  # x * float(mask) op c == mask and x op c
            if _is_cast(ir, m) and not _is_cast(ir, x):
                return [
                    (m, _operand_labels(ir, m, v, lab), False, ("ne", 0)),
                    (x, _operand_labels(ir, x, v, lab), False, tst),
                ]
    return None


def leaf_key(ir: IR, sl: Slices, leaf: Leaf, size) -> tuple:
    """A key equal for leaves that hold the same values: shape ops and bool casts stripped,
    constants named by their slice's fingerprint (so a mask rebuilt the same way matches)."""
    v, lab, neg, tst = leaf.vid, tuple(leaf.labels), leaf.negate, leaf.test
    while True:
        node = ir.node_of(v)
        if node is None:
            break
        if node.prim.name in STRIP:
            back = lab_ops.backward(ir, node, lab, size)
            if back is None:
                break
            v, lab = node.ins[0], tuple(back)
        elif _casts_bool(ir, node) and tst is not None:
            t = [bool(TESTS[tst[0]](np.asarray(x).astype(ir.avals[v].dtype), tst[1])) for x in (0, 1)]
            if t[0] == t[1]:
                break
            v, neg, tst = node.ins[0], neg if t[1] else not neg, None
        elif _casts_bool(ir, node) and _is_bool(ir, v):
            v = node.ins[0]
        else:
            break
    lab = tuple(None if n == 1 else x for x, n in zip(lab, ir.shape(v), strict=True))
    name = ("const", sl.fingerprint(v)) if sl.independent(v) else ("vid", v)
    return name, lab, neg, tst
