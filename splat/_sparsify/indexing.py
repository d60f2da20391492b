"""Index remapping through shape primitives: where an output element of a shape op reads its operand.

Both slice evaluators (``numeric.Slices.value`` on numpy index arrays, ``symbolic.Symbolic`` on
affine index forms) follow a mask's shape ops backwards with :func:`operand_index`. Index entries
only meet ``+``, ``-`` and ``*`` by an int, except in a reshape that does more than add or drop
size-1 axes: that one needs ``//`` and ``%`` on the flat index, which affine forms refuse (the
symbolic pass then gives up and the mask is evaluated numerically).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["SHAPE_OPS", "operand_index", "size1_map"]

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


def _reshape_index(in_shape, out_shape, idx):
    """Row-major reshape: flatten ``idx`` over ``out_shape``, unflatten over ``in_shape``."""
    flat = 0
    for i, n in enumerate(out_shape):
        flat = flat * n + idx[i]
    res = []
    for n in reversed(in_shape):
        res.append(flat % n if n > 1 else 0)
        flat = flat // n
    return tuple(reversed(res))
