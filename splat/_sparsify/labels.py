"""Axis labels through shape ops: grouped-query einsums written with 5-D operands and reshapes.

The matcher names every axis of the scores after the ``Q @ K^T`` ``dot_general`` output axis it
comes from (an *atom*: an int). Code that writes grouped-query attention as
``einsum('BTKGH,BSKH->BTKGS')`` and then reshapes the scores to ``[B, T, K*G, S]`` (and the
probabilities back to ``[B, T, K, G, S]`` for ``P @ V``) merges and splits axes, so an axis label
is one of:

- an int: one atom;
- a tuple of ints: several atoms merged by a reshape, major to minor;
- None: a size-1 axis that carries no atom (added by a reshape, or broadcast);
- a str: an axis outside the scores ("d", the head dim of Q/K; "e", of V).

:func:`reshape_labels` maps labels through a reshape when it only merges or splits at atom
boundaries; :func:`forward` and :func:`backward` map them through a shape op in either direction.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from splat._sparsify.indexing import size1_map
from splat._sparsify.ir import IR, Node

__all__ = ["atoms", "backward", "forward", "reshape_labels"]

# shape ops whose labels the matcher follows
SHAPE = ("transpose", "reshape", "squeeze", "broadcast_in_dim")


def atoms(label) -> tuple:
    """The atoms of one axis label (empty for None and for str labels)."""
    if label is None or isinstance(label, str):
        return ()
    return label if isinstance(label, tuple) else (label,)


def _label(group: Sequence[int]):
    return None if not group else group[0] if len(group) == 1 else tuple(group)


def reshape_labels(
    labels: Sequence, in_shape: Sequence[int], out_shape: Sequence[int], size: Callable[[int], int]
) -> list | None:
    """Labels of a reshape's output axes; None when it splits an atom (or moves a str label).

    Args:
      labels: one label per input axis.
      in_shape, out_shape: the reshape's shapes.
      size: an atom's length.
    """
    m = size1_map(in_shape, out_shape)
    if m is not None:  # only size-1 axes added or removed: keep every label, even of size-1 axes
        return [labels[m[o]] if o in m else None for o in range(len(out_shape))]
    if any(isinstance(lab, str) for lab, n in zip(labels, in_shape, strict=True) if n != 1):
        return None
    seq = [a for lab in labels for a in atoms(lab)]
    out, pos = [], 0
    for o, n in enumerate(out_shape):
        group, prod = [], 1
        # a size-1 atom goes to the next axis when that one has size 1 too (a one-token query
        # axis stays its own, not merged into the batch axis before it)
        nxt1 = o + 1 < len(out_shape) and out_shape[o + 1] == 1
        while pos < len(seq) and (prod < n or (size(seq[pos]) == 1 and not (nxt1 and group))):
            if n == 1 and size(seq[pos]) != 1:
                break
            group.append(seq[pos])
            prod *= size(seq[pos])
            pos += 1
        if prod != n:
            return None
        out.append(_label(group))
    if any(size(a) != 1 for a in seq[pos:]):
        return None
    return out


def forward(ir: IR, node: Node, labels: Sequence, size: Callable[[int], int]) -> list | None:
    """Labels of ``node``'s output from those of its first operand (None: not expressible)."""
    name, p = node.prim.name, node.params
    if name == "transpose":
        return [labels[a] for a in p["permutation"]]
    if name in ("reshape", "squeeze"):
        return reshape_labels(labels, ir.shape(node.ins[0]), ir.shape(node.outs[0]), size)
    if name == "broadcast_in_dim":  # new axes, and size-1 axes stretched, carry no atom
        in_shape, out_shape = ir.shape(node.ins[0]), ir.shape(node.outs[0])
        out: list = [None] * len(out_shape)
        for a, d in enumerate(p["broadcast_dimensions"]):
            out[d] = labels[a] if in_shape[a] == out_shape[d] else None
        return out
    return list(labels)  # converts and copies


def backward(ir: IR, node: Node, labels: Sequence, size: Callable[[int], int]) -> list | None:
    """Labels of ``node``'s first operand from those of its output (None: not expressible).

    A ``broadcast_in_dim`` operand axis of size 1 under a longer output axis gets None: the
    value does not vary along it.
    """
    name, p = node.prim.name, node.params
    in_shape, out_shape = ir.shape(node.ins[0]), ir.shape(node.outs[0])
    if name == "broadcast_in_dim":
        bd = p["broadcast_dimensions"]
        return [labels[bd[a]] if in_shape[a] == out_shape[bd[a]] else None for a in range(len(in_shape))]
    if name == "transpose":
        inv = [None] * len(in_shape)
        for j, a in enumerate(p["permutation"]):
            inv[a] = labels[j]
        return inv
    if name in ("reshape", "squeeze"):
        return reshape_labels(labels, out_shape, in_shape, size)
    return list(labels)
