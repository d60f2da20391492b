"""Which tokens of the global sequence each device holds: the sequence axis and its chunk orders.

Two orders, each a list of *pieces* per device (contiguous ranges of global positions, in the order
the device holds them):

* ``"contiguous"``: device ``d`` of ``P`` holds positions ``[d * n, (d + 1) * n)``, ``n = S / P``.
* ``"zigzag"``: the sequence is cut into ``2P`` chunks of ``c = S / (2P)``; device ``d`` holds chunk
  ``d`` then chunk ``2P - 1 - d``. Under a causal mask every device then has the same work: its
  early chunk sees few keys and its late chunk many.

Pieces are ascending in global position on every device, in both orders: a device's valid tokens
(positions below a length) are a prefix of its local tokens, and ids that are non-decreasing
globally stay non-decreasing locally.

splat does not permute tokens between devices: with ``"zigzag"`` the caller holds the sequence in
zigzag order, permuted once per model (:func:`zigzag` on the token ids, positions, document ids and
labels as the data arrive; position-wise layers do not care, and the loss is a sum over tokens).
Permuting inside every attention call would move q, k, v and the output across devices in every
layer, forward and backward.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np

ORDERS = ("contiguous", "zigzag")

Pieces = tuple[tuple[int, int], ...]  # (global start, length) per piece, in local order


@dataclass(frozen=True)
class SequenceAxis:
    """The mesh axis a sequence is sharded along, and the order of its chunks.

    Attributes:
      name: the mesh axis name (as ``jax.lax.psum`` takes it).
      order: ``"contiguous"`` (device ``d`` holds the ``d``-th slice) or ``"zigzag"`` (device ``d``
        holds chunks ``d`` and ``2P - 1 - d`` of ``2P``; the sequence must already be in that order:
        :func:`splat.zigzag`).

    Example:
      >>> import splat
      >>> splat.SequenceAxis("sp", order="zigzag")
      SequenceAxis(name='sp', order='zigzag')
    """

    name: str
    order: str = "contiguous"

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(f"SequenceAxis name must be a mesh axis name (a str), got {self.name!r}")
        if self.order not in ORDERS:
            raise ValueError(f"SequenceAxis order must be one of {ORDERS}, got {self.order!r}")


def as_axis(sequence_axis) -> SequenceAxis:
    """``sequence_axis`` (a str or a :class:`SequenceAxis`) as a :class:`SequenceAxis`."""
    if isinstance(sequence_axis, SequenceAxis):
        return sequence_axis
    if isinstance(sequence_axis, str) and sequence_axis:
        return SequenceAxis(sequence_axis)
    raise TypeError(
        "sequence_axis must be a mesh axis name (a str, e.g. 'sp') or a splat.SequenceAxis, "
        f"got {type(sequence_axis).__name__} {sequence_axis!r}"
    )


def check_length(name: str, local: int, order: str) -> None:
    """A zigzag shard holds two equal chunks: its local length must be even."""
    if order == "zigzag" and local % 2:
        raise ValueError(
            f"{name} has {local} tokens a device, but the zigzag order holds two equal chunks a device: "
            "the local sequence length must be even (the global one a multiple of 2 x the axis size)"
        )


@functools.lru_cache(maxsize=64)
def pieces(order: str, local: int, parts: int) -> tuple[Pieces, ...]:
    """Per device, its pieces ``(global start, length)`` for ``local`` tokens a device."""
    if order == "contiguous":
        return tuple(((d * local, local),) for d in range(parts))
    c = local // 2
    return tuple(((d * c, c), ((2 * parts - 1 - d) * c, c)) for d in range(parts))


def positions(order: str, local: int, parts: int) -> np.ndarray:
    """int64 ``[parts, local]``: the global position of each device's local tokens."""
    return np.stack([np.concatenate([s + np.arange(n) for s, n in ps]) for ps in pieces(order, local, parts)])


def _zigzag_check(length: int, parts: int) -> None:
    for name, n in (("length", length), ("parts", parts)):
        if not isinstance(n, int | np.integer) or isinstance(n, bool) or n < 1:
            raise ValueError(f"{name} must be a positive int, got {n!r}")
    if length % (2 * parts):
        raise ValueError(
            f"a zigzag order over {parts} devices cuts the sequence into {2 * parts} equal chunks: "
            f"length {length} is not a multiple of {2 * parts}"
        )


def zigzag_positions(length: int, parts: int) -> np.ndarray:
    """int64 ``[length]``: the global position held at each index of the zigzag-ordered sequence.

    Index ``i`` of ``zigzag(x, parts)`` holds ``x[zigzag_positions(length, parts)[i]]``; feed these
    positions to position embeddings (RoPE) of a model run in zigzag order.

    Example:
      >>> import splat
      >>> splat.zigzag_positions(8, 2).tolist()
      [0, 1, 6, 7, 2, 3, 4, 5]
    """
    _zigzag_check(length, parts)
    return positions("zigzag", length // parts, parts).reshape(-1)


def zigzag(x, parts: int, axis: int = 1):
    """``x`` with its sequence axis put in zigzag order over ``parts`` devices.

    Sharding the result contiguously along ``axis`` gives device ``d`` chunks ``d`` and
    ``2 * parts - 1 - d`` of the original sequence, as ``splat.SequenceAxis(name, order="zigzag")``
    says. Apply it once to the model's inputs (tokens, positions, document ids, labels) and
    :func:`unzigzag` to outputs that need the original order.

    Args:
      x: a numpy or jax array; ``x.shape[axis]`` a multiple of ``2 * parts``.
      parts: the size of the sequence mesh axis.
      axis: the sequence axis (1 for ``[B, S, ...]``).

    Example:
      >>> import numpy as np, splat
      >>> splat.zigzag(np.arange(8)[None], 2).tolist()
      [[0, 1, 6, 7, 2, 3, 4, 5]]
      >>> splat.unzigzag(splat.zigzag(np.arange(8)[None], 2), 2).tolist()
      [[0, 1, 2, 3, 4, 5, 6, 7]]
    """
    perm = zigzag_positions(x.shape[axis], parts)
    return (jnp if not isinstance(x, np.ndarray) else np).take(x, perm, axis=axis)


def unzigzag(x, parts: int, axis: int = 1):
    """The inverse of :func:`zigzag`: ``x`` in zigzag order back to the original order."""
    inv = np.argsort(zigzag_positions(x.shape[axis], parts))
    return (jnp if not isinstance(x, np.ndarray) else np).take(x, inv, axis=axis)
