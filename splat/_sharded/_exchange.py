"""How keys (and their gradients) move between the devices of the sequence axis: ``lax.ppermute`` patterns.

Every function takes a pytree of arrays (keys, values, key ids; None leaves stay None) and sends each
leaf with one collective permute. A device that receives nothing gets zeros; the plan never lets it
compute on them.

* :func:`rotate`: the ring's step: device ``s`` sends to ``s + direction`` (cyclic).
* :func:`fetch`: a halo: device ``i`` receives from ``i + offset`` (no wrap), the slice the plan says.
* :func:`give_back`: the gradients of keys held at a step go straight to the keys' owner (one permute
  per step, independent of the other steps', so each overlaps the compute that follows it; on
  NVLink/NVSwitch hosts any shift is one hop).
"""

from __future__ import annotations

import jax
from jax import lax


def _send(tree, axis: str, pairs: list[tuple[int, int]]):
    if not pairs:
        return jax.tree.map(lambda x: x * 0, tree)
    return jax.tree.map(lambda x: lax.ppermute(x, axis, pairs), tree)


def rotate(tree, axis: str, parts: int, direction: int):
    """Device ``s``'s leaves to device ``(s + direction) mod parts``."""
    return _send(tree, axis, [(s, (s + direction) % parts) for s in range(parts)])


def fetch(tree, axis: str, parts: int, offset: int):
    """Device ``i`` gets device ``i + offset``'s leaves (zeros where there is no such device)."""
    return _send(tree, axis, [(j, j - offset) for j in range(parts) if 0 <= j - offset < parts])


def give_back_halo(tree, axis: str, parts: int, offset: int):
    """The inverse of :func:`fetch`: device ``i`` returns what it computed for device ``i + offset``."""
    return _send(tree, axis, [(i, i + offset) for i in range(parts) if 0 <= i + offset < parts])


def give_back_ring(tree, axis: str, parts: int, direction: int, steps: int):
    """After ``steps`` rotations device ``s`` holds device ``(s - direction * steps) mod parts``'s
    keys: their gradients go back there in one permute."""
    shift = (direction * steps) % parts
    if shift == 0:
        return tree
    return _send(tree, axis, [(s, (s - shift) % parts) for s in range(parts)])
