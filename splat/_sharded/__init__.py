"""Sequence-parallel sparse attention: a sequence sharded along a mesh axis, keys moved as the mask needs.

``splat.attention(..., sequence_axis="sp")`` inside ``jax.shard_map`` hands off to :func:`attention`
here; :func:`sharded_attention` wraps ``shard_map`` for global arrays. The parts, one concern each:

* :mod:`~splat._sharded._order`: which tokens each device holds (contiguous or zigzag chunks), and
  the zigzag permutation helpers;
* :mod:`~splat._sharded._plan`: from the mask's layout, on the host, the blocks each device computes
  and how keys travel (local, halo or ring);
* :mod:`~splat._sharded._exchange`: the ``ppermute`` patterns that move keys and send their gradients
  back;
* :mod:`~splat._sharded._merge`: the log-sum-exp merge of blocks and the accumulators;
* :mod:`~splat._sharded._blocks`: one step's block on one device (its runtime mask, the backends'
  forward and backward through :mod:`jax_bindings._blockwise`, the switch between devices);
* :mod:`~splat._sharded._vjp`: the ``custom_vjp`` running a plan's steps forward and backward.
"""

from splat._sharded._api import attention, sharded_attention
from splat._sharded._order import SequenceAxis, unzigzag, zigzag, zigzag_positions
from splat._sharded._plan import Plan, plan

__all__ = [
    "Plan",
    "SequenceAxis",
    "attention",
    "plan",
    "sharded_attention",
    "unzigzag",
    "zigzag",
    "zigzag_positions",
]
