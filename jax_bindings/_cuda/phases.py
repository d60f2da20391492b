"""A band in ``d`` interleaved phases as a band over ``S / d`` rows and ``d`` times the heads (JAX).

Where row ``i`` sees only keys ``j`` with ``j % d == i % d`` (:class:`acsr.BandForm`'s
``phases``: ``dilated_window``, ``strided``), the ``d`` phases are independent sequences. In the
``[B, S, H, D]`` layout the rows of phase ``p`` are ``t * d + p``, so reshaping to ``[B, S / d,
d * H, D]`` (no copy) makes phase ``p`` of head ``h`` the head ``p * H + h`` of a sequence of ``S / d``
rows, where the band holds between ``t = i // d`` and ``u = j // d``. Grouped queries stay
grouped: query head ``p * H + h`` reads KV head ``(p * H + h) // (H / Hkv) = p * Hkv + h // (H /
Hkv)``, phase ``p``'s fold of the KV head the unfolded call reads. The per-row statistics (``lse
[B, H, S]``) are the one array that moves: a transpose of ``B * H * S`` floats.
"""

from __future__ import annotations

import jax


def fold(x: jax.Array, d: int) -> jax.Array:
    """``[B, S, H, D] -> [B, S / d, d * H, D]``: phase ``p`` of head ``h`` as head ``p * H + h``."""
    b, s, h, hd = x.shape
    return x.reshape(b, s // d, d * h, hd)


def unfold(x: jax.Array, d: int) -> jax.Array:
    """The inverse of :func:`fold`."""
    b, t, dh, hd = x.shape
    return x.reshape(b, t * d, dh // d, hd)


def fold_rows(x: jax.Array, d: int) -> jax.Array:
    """``[B, H, S] -> [B, d * H, S / d]``: per-row values (``lse``) as :func:`fold` orders the rows."""
    b, h, s = x.shape
    return x.reshape(b, h, s // d, d).transpose(0, 3, 1, 2).reshape(b, d * h, s // d)


def unfold_rows(x: jax.Array, d: int) -> jax.Array:
    """The inverse of :func:`fold_rows`."""
    b, dh, t = x.shape
    return x.reshape(b, d, dh // d, t).transpose(0, 2, 3, 1).reshape(b, dh // d, t * d)
