"""Masks taken at positions computed from the inputs -> ``splat.attention``'s runtime positions.

Model code often builds its mask on *positions*, not on indices: Gemma's ``cumsum(mask) - 1``,
penzai's ``token_positions`` side input, a KV cache's ``cache_index + i``. The predicate is then a
constant function of the positions -- ``q_pos[b, i] >= kv_pos[b, j]`` is causal taken at
``(q_pos, kv_pos)`` -- but it depends on the inputs, so it is neither a constant mask nor padding.

:func:`find` looks for the *position arrays* of such mask leaves: walking down from a leaf that
involves both the query and the key axis, an input-dependent value that varies along batch axes
and one sequence axis only (the query axis ``t``, or the key axis) is a position array of that
side. The walk goes through elementwise ops with one input-dependent operand (``p - w`` is read
as a function of ``p``) and shape ops, while the operand still carries the sequence axis; it
stops where two input-dependent values meet (``cumsum(m) - (cumsum(m) >= 1)``), at any other
primitive, or where the sequence axis comes from a constant (``iota + cache_index`` is itself
the query position). Each position array is then read as the index of its sequence axis
(``Slices.index_of``), which makes the leaf a constant mask in position coordinates; at run time
the arrays' values are passed as ``q_positions`` / ``kv_positions``.

Rules:

- one position array per side (the same array may serve both sides, as Gemma's does), or
  several that are each ``iota + x`` of one scalar ``x`` of the inputs (keras-hub Mistral reads
  its cache index into a float and an integer array);
- a position array must be integer (or float; its values are cast to int32 at run time) and may
  not vary across heads;
- where mask terms read the *indices* of a side that has positions (Gemma ANDs a causal mask on
  indices with a window on positions; :func:`index_atoms` tells which), the two agree only where
  the positions equal the indices: the call passes such a side at its indices and checks at run
  time that its positions equal them wherever the other terms let a pair be seen
  (:mod:`splat._sparsify.guard`), running the original dense attention where they do not;
- a constant mask sliced along the query axis at a start computed from the inputs
  (``dynamic_slice(band, (cache_index, 0))``, keras-hub's sliding window in decode) is that
  mask at the query positions ``start + i`` (:attr:`Positions.q_start`); one start per
  attention, and where a query position array exists too the call checks at run time that the
  two agree.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from splat._sparsify import labels as lab_ops
from splat._sparsify.ir import IR, reads_any
from splat._sparsify.numeric import NotSparsifiable, Slices
from splat._sparsify.predicate import STRIP, Leaf

__all__ = ["Positions", "find", "index_atoms"]

# positions are compared, after a shift or a scale: ``p - w < j``, ``p >= 0``
_ARITH = ("add", "sub", "mul", "neg", "convert_element_type", "copy", "copy_p")
_LOGIC = ("and", "or", "not", "copy", "copy_p")
_COMPARE = ("lt", "le", "gt", "ge", "eq", "ne")


@dataclass(frozen=True)
class Positions:
    """The position arrays of one attention's mask.

    ``q``/``kv``: ``(vid, labels)`` of the query / key position array, or None (that side's
    positions are its indices); ``slices``: the :class:`Slices` that reads them as indices.
    ``q_start``: ``(vid, last)`` where a constant mask is sliced along the query axis at a start
    computed from the inputs (scalar ``vid``; ``lax.dynamic_slice`` clamps it into ``[0, last]``):
    the queries sit at ``clamp(start) + i``; with a query position array as well, the two must
    agree, which the call checks at run time.
    """

    q: tuple | None
    kv: tuple | None
    slices: Slices
    q_start: tuple | None = None

    @property
    def vids(self) -> list[int]:
        """The runtime values the call takes: the position arrays, then the slice's start."""
        return [x[0] for x in (self.q, self.kv, self.q_start) if x is not None]


def _atoms(lab: Sequence) -> set:
    return {a for x in lab for a in lab_ops.atoms(x)}


def _operand_labels(ir: IR, u: int, out: int, lab: tuple) -> tuple:
    ushape, shape = ir.shape(u), ir.shape(out)
    if len(ushape) != len(shape):
        return (None,) * len(ushape)
    return tuple(x if ushape[a] == shape[a] else None for a, x in enumerate(lab))


def find(
    ir: IR,
    sl: Slices,
    leaves: list[Leaf],
    batch: set,
    q_free: Sequence,
    kv,
    size: Callable[[int], int],
) -> Positions | None:
    """The position arrays of the input-dependent ``leaves``, or None when they use none.

    ``batch``: the score atoms shared by queries and keys (batch and heads); ``q_free``: the
    query-only atoms (the query axis among them); ``kv``: the key atom.

    Raises:
      NotSparsifiable: positions that splat cannot take (two arrays on one side, positions that
        vary across heads, ...).
    """
    q_free = set(q_free)
    found: dict[str, set] = {"q": set(), "kv": set(), "start": set()}
    local: dict = {"q": set(), "kv": set(), "start": set(), "q_index": False, "kv_index": False}
    index_used = {"q": False, "kv": False}

    def side(lab) -> str | None:
        at = _atoms(lab)
        if at & q_free and kv not in at:
            return "q"
        if kv in at and not at & q_free:
            return "kv"
        return None

    def walk(v: int, lab: tuple, arith: bool, depth: int = 0) -> None:
        """``arith``: ``v`` is a number under a comparison (else a boolean of the predicate)."""
        if depth > 64:
            return
        if sl.independent(v):
            if arith:  # an index compared with positions: which sides it reads
                at = {lab[a] for a in sl.deps(v) if a < len(lab)}
                at = {x for y in at for x in lab_ops.atoms(y)}
                local["q_index"] |= bool(at & q_free)
                local["kv_index"] |= kv in at
            return
        node = ir.node_of(v)
        if node is not None and node.prim.name == "dynamic_slice" and not arith:
            start = _query_start(ir, sl, node, lab, q_free)  # a constant's rows at the query positions
            if start is not None:
                local["start"].add(start)
            return
        s = side(lab)
        if s is None and arith and not _atoms(lab) & (q_free | {kv}) and _query_index(ir, sl, v):
            # an index plus a value of the inputs along no sequence axis: a one-token query's
            # position (``arange(1) + cache_index``), its axis of size 1 unlabelled by now
            local["q"].add((v, lab))
            return
        if s is not None and not arith and not (node is not None and node.prim.name in _COMPARE):
            return  # a one-sided boolean: padding, not a position
        if s is not None and arith:
            seq = (q_free if s == "q" else {kv}) & _atoms(lab)
            if node is not None and (node.prim.name in STRIP or node.prim.name in _ARITH):
                dyn = [u for u in node.ins if not sl.independent(u)]
                if len(dyn) == 1:
                    u = dyn[0]
                    if node.prim.name in STRIP:
                        back = lab_ops.backward(ir, node, lab, size)
                        ulab = None if back is None else tuple(back)
                    else:
                        ulab = _operand_labels(ir, u, v, lab)
                    if ulab is not None and seq & _atoms(ulab):
                        walk(u, ulab, True, depth + 1)
                        return
            local[s].add((v, lab))
            return
        if node is None:
            return
        name = node.prim.name
        if name in STRIP or (name == "convert_element_type" and not arith):
            back = lab_ops.backward(ir, node, lab, size) if name in STRIP else list(lab)
            if back is not None:
                walk(node.ins[0], tuple(back), arith, depth + 1)
            return
        if arith and name in _ARITH:
            go = True
        elif not arith and name in _LOGIC:
            go = True
        elif not arith and name in _COMPARE:
            arith, go = True, True
        else:
            go = False
        if go:
            for u in node.ins:
                walk(u, _operand_labels(ir, u, v, lab), arith, depth + 1)

    for leaf in leaves:
        local.update(q=set(), kv=set(), start=set(), q_index=False, kv_index=False)
        walk(leaf.vid, tuple(leaf.labels), leaf.test is not None)
        # whole numbers only: integers, or floats made of integers and iota (Keras's
        # ``arange(n, dtype=float) + cache_index``); values of q or k are no positions
        for x in ("q", "kv"):
            local[x] = {(v, lab) for v, lab in local[x] if _integral(ir, sl, v)}
        # a position leaf places the query: a key-only term (``kv_pos >= 0``, an integer padding
        # mask under ``> 0``) is padding, whatever its values
        if (local["q"] or local["start"]) and (local["kv"] or kv in _atoms(leaf.labels)):
            found["q"] |= local["q"]
            found["kv"] |= local["kv"]
            found["start"] |= local["start"]
            index_used["q"] |= local["q_index"]
            index_used["kv"] |= local["kv_index"]
    if not found["q"] and not found["kv"] and not found["start"]:
        return None
    index_of: dict[int, tuple[int, str]] = {}
    chosen: dict[str, tuple | None] = {"q": None, "kv": None}

    def register(v: int, lab: tuple, s: str) -> None:
        """Reads ``v`` as side ``s``'s index; the first array registered is the one passed."""
        at = _atoms(lab)
        if at - batch - q_free - {kv}:
            raise NotSparsifiable("the attention mask's positions vary along an axis of the heads")
        seq = q_free if s == "q" else {kv}
        axes = [a for a, x in enumerate(lab) if set(lab_ops.atoms(x)) & seq]
        if chosen[s] is None:
            chosen[s] = (v, lab)
        if not axes and s == "q":  # a one-token query: the position is the same along any axis
            index_of[v] = (0, "q")
            return
        if len(axes) != 1 or len(lab_ops.atoms(lab[axes[0]])) != 1:
            raise NotSparsifiable("the attention mask's positions vary along two query axes")
        if v in index_of:  # one array of positions for both sides: read as the index of each
            if index_of[v][0] != axes[0]:
                raise NotSparsifiable("one position array is read along two different axes")
            index_of[v] = (axes[0], "qk")  # read along its axis (a size-1 axis would read 0)
            return
        index_of[v] = (axes[0], "q" if s == "q" else "k")

    for s in ("q", "kv"):
        srcs = found[s]
        vids = {v for v, _ in srcs}
        # several arrays are one only where each is ``iota + x`` of the same value x of the inputs
        # (Keras's float cache mask beside Mistral's integer window on the same cache index)
        roots = {_shifted_iota(ir, sl, v) for v in vids}
        if len(vids) > 1 and (len(roots) > 1 or None in roots):
            raise NotSparsifiable(
                f"the attention mask compares {'query' if s == 'q' else 'key'} positions from "
                f"{len(vids)} different arrays computed from the inputs; splat takes one array of "
                "positions per side"
            )
        for v, lab in sorted(srcs, key=lambda x: (len(x[1]), x[0])):
            register(v, lab, s)
    q_start = None
    if found["start"]:
        if len({x[0] for x in found["start"]}) > 1:
            raise NotSparsifiable("the attention mask slices constants at two different query starts")
        if index_used["q"] or (index_used["kv"] and chosen["kv"] is not None):
            raise NotSparsifiable(
                "the attention mask slices a constant at a query start and also compares query indices"
            )
        v, axis, last, rows = next(iter(found["start"]))
        if rows < size(kv):  # the mask is taken at every position of the keys
            raise NotSparsifiable(
                f"the attention mask slices query rows of a constant with {rows} rows, fewer than the "
                f"{size(kv)} key positions"
            )
        index_of[v] = (axis, "start")
        q_start = (v, last)
    return Positions(chosen["q"], chosen["kv"], Slices(ir, index_of), q_start)


def index_atoms(pos: Positions, terms: list, t, kv) -> set:
    """The score atoms that the mask ``terms`` (``(kind, vid, negate, labels)``, read through
    ``pos.slices``) read by *index*: the axes they vary along with the position arrays held still
    (``t``, ``kv``: the query and key atoms).

    A constant sliced at the query start reads its rows at the query positions (``t`` is no
    index read there); its other axes are indices.
    """
    sl = pos.slices
    ir = sl.ir
    held = Slices(ir, {v: (a, side if side == "start" else "held") for v, (a, side) in sl.index_of.items()})
    start = {pos.q_start[0]} if pos.q_start is not None else set()
    out: set = set()
    for _, vid, _, lab in terms:
        if len(ir.shape(vid)) != len(lab):  # labels not known per axis: it may read any index
            out |= {t, kv}
            continue
        atoms = {a for d in held.deps(vid) for a in lab_ops.atoms(lab[d])}
        if start and reads_any(ir, vid, start):
            atoms.discard(t)
        out |= atoms
    return out


def _query_start(ir: IR, sl: Slices, node, lab: tuple, q_free: set) -> tuple | None:
    """``(start vid, axis, last, rows)`` where ``node`` (a ``dynamic_slice``) takes rows of a
    constant of ``rows`` rows along the query axis from one start computed from the inputs, every
    other start constant; else None. ``last``: the largest start ``lax.dynamic_slice`` keeps (it
    clamps)."""
    operand, starts = node.ins[0], node.ins[1:]
    if not sl.independent(operand):
        return None
    dynamic = [a for a, u in enumerate(starts) if not sl.independent(u)]
    if len(dynamic) != 1 or len(lab) != len(starts):
        return None
    a = dynamic[0]
    atoms = set(lab_ops.atoms(lab[a]))
    one_row = not atoms and ir.shape(node.outs[0])[a] == 1  # a one-token query: its axis unlabelled
    if not one_row and (not atoms or not atoms <= q_free):
        return None
    last = ir.shape(operand)[a] - ir.shape(node.outs[0])[a]
    return starts[a], a, last, ir.shape(operand)[a]


_PASS = ("broadcast_in_dim", "reshape", "squeeze", "convert_element_type", "copy", "copy_p")


def _through(ir: IR, v: int) -> int:
    """``v`` before the broadcasts, reshapes and casts that made it."""
    node = ir.node_of(v)
    while node is not None and node.prim.name in _PASS:
        v = node.ins[0]
        node = ir.node_of(v)
    return v


def _shifted_iota(ir: IR, sl: Slices, v: int) -> int | None:
    """The scalar ``x`` computed from the inputs where ``v`` is ``iota + x`` (through broadcasts,
    reshapes and casts of whole numbers), else None."""
    node = ir.node_of(_through(ir, v))
    if node is None or node.prim.name != "add":
        return None
    for x, y in (node.ins, node.ins[::-1]):
        xn, root = ir.node_of(_through(ir, x)), _through(ir, y)
        if xn is not None and xn.prim.name == "iota" and not sl.independent(root) and ir.shape(root) == ():
            return root
    return None


def _integral(ir: IR, sl: Slices, v: int, depth: int = 0) -> bool:
    """Whether ``v`` holds whole numbers by construction (exactly, as far as its dtype goes)."""
    dt = np.dtype(ir.avals[v].dtype)
    if dt.kind in "iu":
        return True
    if dt.kind != "f" or depth > 32:
        return False
    node = ir.node_of(v)
    if node is None:
        c = sl.constant(v)
        return c is not None and bool(np.all(np.asarray(c) == np.round(np.asarray(c))))
    name = node.prim.name
    if name == "iota":
        return True
    if name in STRIP or name in ("add", "sub", "neg", "mul", "convert_element_type", "copy", "copy_p"):
        return all(_integral(ir, sl, u, depth + 1) for u in node.ins)
    return False


def _query_index(ir: IR, sl: Slices, v: int, depth: int = 0) -> bool:
    """Whether ``v`` is an ``iota`` shifted by values of the inputs (through adds and casts)."""
    node = ir.node_of(v)
    if node is None or depth > 32:
        return False
    name = node.prim.name
    if name == "iota":
        return True
    if name in ("add", "sub") or name in STRIP or name in ("convert_element_type", "copy", "copy_p"):
        return any(_query_index(ir, sl, u, depth + 1) for u in node.ins) and not sl.independent(v)
    return False
