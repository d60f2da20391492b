"""Index remapping through shape primitives: where an output element of a shape op reads its operand.

Both slice evaluators (``numeric.Slices.value`` on numpy index arrays, ``symbolic.Symbolic`` on
affine index forms) follow a mask's shape ops backwards with :func:`operand_index`. Index entries
only meet ``+``, ``-`` and ``*`` by an int, except in a reshape group that merges or splits axes
(:func:`reshape_groups`): that one needs ``//`` and ``%`` on the flat index, which affine forms
refuse unless they are constant (the symbolic pass then gives up and the mask is evaluated
numerically).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["SHAPE_OPS", "operand_index", "reshape_groups", "size1_map"]

SHAPE_OPS = ("broadcast_in_dim", "transpose", "reshape", "squeeze", "slice", "rev")


def operand_index(name: str, params: dict, in_shape: Sequence[int], out_shape: Sequence[int], idx):
    """The operand index read by output index ``idx`` of shape primitive ``name``.

    Args:
      name: one of :data:`SHAPE_OPS`.
      params: the equation's parameters.
      in_shape, out_shape: operand and output shapes.
      idx: one index per output axis (ints, broadcastable numpy arrays, or affine forms).

    Returns:
      One index per operand axis (0 on size-1 axes that broadcast).
    """
    rank = len(in_shape)
    if name == "broadcast_in_dim":
        bd = params["broadcast_dimensions"]
        return tuple(idx[bd[a]] if in_shape[a] > 1 else 0 for a in range(rank))
    if name == "transpose":
        inv = [0] * rank
        for j, a in enumerate(params["permutation"]):
            inv[a] = idx[j]
        return tuple(inv)
    if name in ("reshape", "squeeze"):
        m = size1_map(in_shape, out_shape)
        if m is None:
            return _reshape_index(in_shape, out_shape, idx)
        back = {i: o for o, i in m.items()}
        return tuple(idx[back[a]] if a in back else 0 for a in range(rank))
    if name == "slice":
        strides = params["strides"] or (1,) * len(out_shape)
        return tuple(s + i * st for s, i, st in zip(params["start_indices"], idx, strides, strict=True))
    if name == "rev":
        dims = params["dimensions"]
        return tuple(in_shape[a] - 1 - i if a in dims else i for a, i in enumerate(idx))
    raise ValueError(f"operand_index: {name!r} is not one of {SHAPE_OPS}")


def size1_map(in_shape: Sequence[int], out_shape: Sequence[int]) -> dict[int, int] | None:
    """Axis map out -> in when a reshape only adds/removes size-1 axes, else None."""
    a = [i for i, n in enumerate(in_shape) if n != 1]
    b = [i for i, n in enumerate(out_shape) if n != 1]
    if [in_shape[i] for i in a] != [out_shape[i] for i in b]:
        return None
    return dict(zip(b, a, strict=True))


def reshape_groups(in_shape: Sequence[int], out_shape: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """A row-major reshape as the smallest consecutive (input axes, output axes) groups of equal size.

    An output axis can only take its values from the input axes of its own group, so it varies
    only where one of those does (used for the dependence axes of a reshaped constant).
    """
    groups, i, o = [], 0, 0
    while i < len(in_shape) or o < len(out_shape):
        gi, go, pi, po = [], [], 1, 1
        while True:
            if pi <= po and i < len(in_shape) and (pi < po or not gi or in_shape[i] == 1):
                gi.append(i)
                pi *= in_shape[i]
                i += 1
            elif o < len(out_shape) and (po < pi or not go or out_shape[o] == 1):
                go.append(o)
                po *= out_shape[o]
                o += 1
            else:
                break
            if pi == po and gi and go:
                break
        if not gi and not go:
            break
        groups.append((gi, go))
    # trailing axes (all of size 1) left over join the last group
    if i < len(in_shape) or o < len(out_shape):
        gi, go = groups[-1] if groups else ([], [])
        gi += list(range(i, len(in_shape)))
        go += list(range(o, len(out_shape)))
        groups[-1:] = [(gi, go)]
    return groups


def _reshape_index(in_shape, out_shape, idx):
    """Row-major reshape, group by group (:func:`reshape_groups`): flatten ``idx`` over a group's
    output axes, unflatten over its input axes. A group that only renames one axis (plus size-1
    axes) passes its index through untouched, so affine forms cross reshapes that merge or split
    other axes (e.g. ``[B, H, T, S] -> [B*H, T, S]``)."""
    res = [0] * len(in_shape)
    for gi, go in reshape_groups(in_shape, out_shape):
        big_i = [a for a in gi if in_shape[a] != 1]
        big_o = [o for o in go if out_shape[o] != 1]
        if len(big_i) == 1 and len(big_o) == 1:
            res[big_i[0]] = idx[big_o[0]]
            continue
        flat = 0
        for o in go:
            flat = flat * out_shape[o] + idx[o]
        for a in reversed(gi):
            n = in_shape[a]
            res[a] = flat % n if n > 1 else 0
            flat = flat // n
    return tuple(res)
