"""Input-dependent mask terms -> ``splat.attention``'s runtime arguments.

A ``jnp.where(pred, scores, fill)`` predicate is split into AND-ed *leaves*
(:func:`splat._sparsify.predicate.split_predicate`). Leaves that depend only on literals,
constants and iota stay static mask terms. The others must be one of:

- a key padding mask: varies only along batch and key axes (``input_mask[:, None, :]``, any
  boolean or integer ``[B, 1, S]`` / ``[B, S]`` broadcast, or an integer one under a test such
  as Keras's ``mask > 0``) -> ``kv_segment_ids = where(valid, 0, 2)``;
- a query padding mask: varies only along batch and query axes (its rows are left with no key;
  see ``empty_rows``);
- equality of two id arrays, one varying along the query axis and one along the key axis
  (``seg[:, :, None] == seg[:, None, :]``) -> ``segment_ids`` / ``kv_segment_ids``.

Anything else (a comparison of input-dependent positions, a mask varying across heads, ...)
raises :class:`NotSparsifiable` naming the operation; a constant that varies across the batch
or heads, or a value of an enclosing trace splat cannot see into, is named as such (not as
input-dependent). :func:`segment_arrays` combines the leaves
at run time into one ``(segment_ids [B, Sq], kv_segment_ids [B, Skv])`` pair (int32): ids alone
are passed unchanged; with padding too they are doubled and padding gets odd ids, so ids that
differ by a multiple of 2**31 would collide (documented, not expected of real ids). Padding ids
sit above every id, so that padding at the end (right-padded batches, a cache's unfilled
tail) keeps sorted ids sorted: the kernels' fast case.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from splat._sparsify import labels as lab_ops
from splat._sparsify.ir import IR
from splat._sparsify.numeric import NotSparsifiable, Slices
from splat._sparsify.predicate import STRIP, Leaf, split_predicate

__all__ = ["Leaf", "Runtime", "classify", "gather_rows", "key_valid", "segment_arrays", "split_predicate"]

# a leaf's test (see ``predicate.Leaf``), applied to the traced array at run time
_TESTS = {
    "eq": jnp.equal,
    "ne": jnp.not_equal,
    "lt": jnp.less,
    "le": jnp.less_equal,
    "gt": jnp.greater,
    "ge": jnp.greater_equal,
}


@dataclass(frozen=True)
class Runtime:
    """The runtime mask terms of one attention, as value ids of the (stripped) source arrays.

    ``kv_valid``/``q_valid``: ``(vid, labels, negate[, test])`` of padding masks (a test
    ``(op, c)``: the mask is ``op(value, c)``; none: ``value != 0``); ``ids``:
    ``((q_vid, q_labels), (kv_vid, kv_labels))`` of one id equality, or None.
    """

    kv_valid: tuple = ()
    q_valid: tuple = ()
    ids: tuple | None = None

    @property
    def vids(self) -> list[int]:
        out = [term[0] for term in self.kv_valid + self.q_valid]
        if self.ids is not None:
            out += [self.ids[0][0], self.ids[1][0]]
        return out

    def describe(self) -> tuple[str, ...]:
        return tuple(
            name
            for name, on in (
                ("kv_padding", self.kv_valid),
                ("q_padding", self.q_valid),
                ("segment_ids", self.ids is not None),
            )
            if on
        )


def _strip(ir: IR, vid: int, labels: Sequence, size, keep_value: bool) -> tuple[int, tuple]:
    """Walk back through broadcasts and shape ops to the smallest array holding the same values.

    ``keep_value``: only value-preserving converts are crossed (ids); otherwise converts to bool
    from bool or integers are crossed too (the leaf is read back with ``astype(bool)``).
    """
    labels = tuple(labels)
    while True:
        node = ir.node_of(vid)
        if node is None or vid in ir.consts:
            return vid, labels
        name = node.prim.name
        if name == "convert_element_type":
            src, dst = np.dtype(ir.avals[node.ins[0]].dtype), np.dtype(ir.avals[vid].dtype)
            ints = np.issubdtype(src, np.integer) or src == np.bool_
            if keep_value:
                ok = ints and np.issubdtype(dst, np.integer) and src.itemsize <= dst.itemsize
            else:
                ok = dst == np.bool_ and ints
            if not ok:
                return vid, labels
        elif name not in STRIP:
            return vid, labels
        back = lab_ops.backward(ir, node, labels, size)
        if back is None:
            return vid, labels
        vid, labels = node.ins[0], tuple(back)


def _varies(ir: IR, vid: int, labels: Sequence) -> set:
    return {x for x, n in zip(labels, ir.shape(vid), strict=True) if n > 1}


def classify(
    ir: IR,
    sl: Slices,
    leaves: list[Leaf],
    batch: Sequence,
    t,
    kv,
    size: Callable[[int], int],
) -> Runtime:
    """The runtime arguments of the input-dependent leaves (``batch`` labels, query ``t``, key ``kv``).

    Raises:
      NotSparsifiable: a leaf is none of key padding, query padding or id equality.
    """
    on_kv, on_q = set(batch) | {kv}, set(batch) | {t}
    kv_valid, q_valid, ids = [], [], []
    for leaf in leaves:
        # a test reads the integers themselves: only shape ops and widening casts are crossed
        src, lab = _strip(ir, leaf.vid, leaf.labels, size, keep_value=leaf.test is not None)
        dims = _varies(ir, src, lab)
        term = (src, lab, leaf.negate) + ((leaf.test,) if leaf.test is not None else ())
        if dims <= on_kv:
            kv_valid.append(term)
            continue
        if dims <= on_q:
            q_valid.append(term)
            continue
        node = ir.node_of(leaf.vid)
        name = node.prim.name if node is not None else "an input"
        if leaf.test is None and ((name == "eq" and not leaf.negate) or (name == "ne" and leaf.negate)):
            shape = ir.shape(leaf.vid)
            sides = []
            for u in node.ins:
                ulab = tuple(x if ir.shape(u)[a] == shape[a] else None for a, x in enumerate(leaf.labels))
                s, sl_ = _strip(ir, u, ulab, size, keep_value=True)
                sides.append((s, sl_, _varies(ir, s, sl_)))
            if sides[1][2] <= on_q and sides[0][2] <= on_kv:
                sides.reverse()
            if sides[0][2] <= on_q and sides[1][2] <= on_kv:
                if not all(np.issubdtype(np.dtype(ir.avals[s].dtype), np.integer) for s, _, _ in sides):
                    raise NotSparsifiable(
                        "the attention mask compares non-integer values computed from the function's "
                        "inputs (`eq`); splat's segment ids are integers"
                    )
                ids.append(((sides[0][0], sides[0][1]), (sides[1][0], sides[1][1])))
                continue
        if sl.independent(leaf.vid):
            what = (f"`{name}` on " if node is not None else "a constant array, ") + ir.avals[
                leaf.vid
            ].str_short()
            raise NotSparsifiable(
                f"the attention mask is a constant ({what}) that varies across "
                "the batch or across heads, and along both query and key positions; splat takes one constant "
                "mask for every batch row and head, plus a per-key (or per-query) padding mask or segment ids"
            )
        if node is None and isinstance(ir.consts.get(leaf.vid), jax.core.Tracer):
            raise NotSparsifiable(
                f"the attention mask uses a value ({ir.avals[leaf.vid].str_short()}) closed over from an "
                "enclosing trace (jit, vmap, grad) whose computation splat cannot see; build the mask "
                "inside the function passed to sparsify, or apply sparsify outside that trace"
            )
        raise NotSparsifiable(
            f"the attention mask depends on the function's inputs through `{name}` on "
            f"{ir.avals[leaf.vid].str_short()} values that vary along both query and key positions "
            "(or across heads); splat takes input-dependent masks only as a per-key (or per-query) "
            "padding mask or as equality of two id arrays (segment ids)"
        )
    if len(ids) > 1:
        raise NotSparsifiable("the attention mask ANDs two input-dependent id equalities; splat takes one")
    return Runtime(tuple(kv_valid), tuple(q_valid), ids[0] if ids else None)


def gather_rows(x, labels: Sequence, order: Sequence, sizes: dict):
    """``x`` (axes ``labels``; every axis of length > 1 is in ``order``) as ``[prod(batch), n]``."""
    keep = [a for a, n in enumerate(x.shape) if n > 1]
    x = jnp.reshape(x, [x.shape[a] for a in keep])
    lab = [labels[a] for a in keep]
    x = jnp.transpose(x, [lab.index(o) for o in order if o in lab])
    for i, o in enumerate(order):
        if o not in lab:
            x = jnp.expand_dims(x, i)
    x = jnp.broadcast_to(x, [sizes[o] for o in order])
    return x.reshape(-1, sizes[order[-1]])


def key_valid(rt: Runtime, vals: Sequence, batch: Sequence, t, kv, sizes: dict):
    """``[B, Skv]`` bool: the keys the padding terms let be seen, or None without key terms."""
    out = None
    for term, x in zip(rt.kv_valid, vals, strict=False):
        x = gather_rows(x, term[1], list(batch) + [kv], sizes)
        if len(term) > 3:
            x = _TESTS[term[3][0]](x, term[3][1])
        x = x.astype(bool)
        x = ~x if term[2] else x
        out = x if out is None else out & x
    return out


def segment_arrays(rt: Runtime, vals: Sequence, batch: Sequence, t, kv, sizes: dict):
    """``(segment_ids [B, Sq], kv_segment_ids [B, Skv])`` int32 from the runtime leaves' values.

    ``vals``: the arrays of ``rt.vids`` in that order.
    """
    it = iter(vals)

    def valid(terms, seq):
        out = None
        for term in terms:
            lab, neg = term[1], term[2]
            x = gather_rows(next(it), lab, list(batch) + [seq], sizes)
            if len(term) > 3:  # (op, c): e.g. an integer padding mask read as `mask > 0`
                x = _TESTS[term[3][0]](x, term[3][1])
            x = x.astype(bool)
            x = ~x if neg else x
            out = x if out is None else out & x
        return out

    kv_ok, q_ok = valid(rt.kv_valid, kv), valid(rt.q_valid, t)
    b = int(np.prod([sizes[x] for x in batch]))
    if rt.ids is not None:
        (_, q_lab), (_, kv_lab) = rt.ids
        q_ids = gather_rows(next(it), q_lab, list(batch) + [t], sizes).astype(jnp.int32)
        kv_ids = gather_rows(next(it), kv_lab, list(batch) + [kv], sizes).astype(jnp.int32)
        if kv_ok is None and q_ok is None:
            return q_ids, kv_ids
        q_ids, kv_ids = 2 * q_ids, 2 * kv_ids  # even: ids; odd, above them all: padding
        top = jnp.maximum(q_ids.max(), kv_ids.max())
        pad_q, pad_kv = top + 1, top + 3
    else:
        q_ids, kv_ids = jnp.zeros((b, sizes[t]), jnp.int32), jnp.zeros((b, sizes[kv]), jnp.int32)
        pad_q, pad_kv = 1, 2
    if q_ok is not None:
        q_ids = jnp.where(q_ok, q_ids, pad_q)
    if kv_ok is not None:
        kv_ids = jnp.where(kv_ok, kv_ids, pad_kv)
    return q_ids, kv_ids
