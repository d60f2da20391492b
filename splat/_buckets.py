"""Sequence-length buckets: one compile per bucket when the sequence length varies.

``jax.jit`` traces and compiles a function once per input shape, and splat
builds one layout and one kernel per ``(mask, q_len, kv_len)``. A training loop
whose batches have a varying length ``S`` (say anywhere in 1000..4096) would
compile per distinct ``S``. Padding every batch up to a few fixed lengths
bounds that: one compile per bucket.

The policy, :func:`bucket_length`: lengths up to ``min_length`` share one
bucket; above it, every octave ``[2^e, 2^(e+1)]`` is split into ``per_octave``
equal steps, and a length goes to the smallest step at or above it. With the
defaults (128, 4) the buckets are 128, 160, 192, 224, 256, 320, 384, 448, 512,
640, ..., 4096, ...: at most ``1 / per_octave`` (25%) of a padded batch is
padding (of the attention's work, the causal part of it: less), and 1000..4096
falls into 9 buckets (1024, 1280, ..., 4096).

Padding is masked, not computed on: :func:`pad_to_bucket` pads the arrays and
gives back the true length; pass it to :func:`splat.attention` as
``query_seq_lengths`` / ``key_value_seq_lengths`` (padded queries output 0,
padded keys are never seen) and give padded positions zero loss weight. For
every query below the true length the result equals the unpadded call's, as
long as the static mask is a function of positions (a :mod:`splat.masks`
mask, not an array of one size).
"""

from __future__ import annotations

import operator

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["bucket_length", "pad_to_bucket"]


def _positive_int(name: str, x) -> int:
    try:
        n = operator.index(x)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(x).__name__}") from None
    if isinstance(x, bool) or n <= 0:
        raise ValueError(f"{name} must be a positive int, got {x!r}")
    return n


def bucket_length(length: int, *, min_length: int = 128, per_octave: int = 4) -> int:
    """The padded length for a sequence of ``length``: the smallest bucket at or above it.

    Buckets: ``min_length``, then in every octave above it ``per_octave`` equal
    steps, ``2^e * (1 + i / per_octave)`` for ``i = 1 .. per_octave``, rounded up
    to an integer; padding is at most ``1 / per_octave`` of the padded length
    (for lengths above ``min_length``).

    Args:
      length: the true sequence length, a positive int.
      min_length: the smallest bucket: shorter sequences are padded to it.
      per_octave: buckets per doubling of the length; more buckets, less padding,
        more compiles.

    Returns:
      The bucket, an int ``>= length``.

    Example:
      >>> import splat
      >>> [splat.bucket_length(s) for s in (1, 128, 129, 1000, 1025, 4000, 4096)]
      [128, 128, 160, 1024, 1280, 4096, 4096]
    """
    length = _positive_int("length", length)
    min_length = _positive_int("min_length", min_length)
    per_octave = _positive_int("per_octave", per_octave)
    if length <= min_length:
        return min_length
    base = 1 << (length.bit_length() - 1)  # 2^e <= length < 2^(e+1)
    if base == length:
        return length
    step = base / per_octave
    return max(min_length, int(np.ceil(np.ceil((length - base) / step) * step + base)))


def pad_to_bucket(
    *arrays, axis: int = 1, fill=0, min_length: int = 128, per_octave: int = 4
) -> tuple[tuple, int]:
    """Pads arrays that share a sequence axis to its bucket (:func:`bucket_length`).

    Call it on the batch, outside ``jit``, so that the jitted step sees one shape
    per bucket; inside, mask the padding with the returned length.

    Args:
      *arrays: numpy or jax arrays with the same size ``S`` along ``axis``
        (e.g. tokens, labels and loss weights ``[B, S]``, or q, k, v ``[B, S, H, D]``).
      axis: the sequence axis.
      fill: the value of padded positions (give loss weights 0 there).
      min_length, per_octave: the bucket policy, as :func:`bucket_length`.

    Returns:
      ``(padded, S)``: the arrays padded at the end of ``axis`` to the bucket (numpy
      stays numpy), and the true length ``S``, for ``query_seq_lengths`` /
      ``key_value_seq_lengths`` (``jnp.full((B,), S)``).

    Example:
      >>> import jax, jax.numpy as jnp, splat
      >>> q = k = v = jax.random.normal(jax.random.key(0), (2, 1000, 2, 16))
      >>> (qp, kp, vp), n = splat.pad_to_bucket(q, k, v)
      >>> qp.shape, n
      ((2, 1024, 2, 16), 1000)
      >>> lens = jnp.full((2,), n)
      >>> out = splat.attention(qp, kp, vp, splat.masks.causal(),
      ...                       query_seq_lengths=lens, key_value_seq_lengths=lens)[:, :n]
    """
    if not arrays:
        raise ValueError("pad_to_bucket needs at least one array")
    for i, a in enumerate(arrays):
        if not hasattr(a, "shape"):
            raise TypeError(f"arrays[{i}] must be a numpy or jax array, got {type(a).__name__}")
    ax = [operator.index(axis) % a.ndim if a.ndim else None for a in arrays]
    if None in ax:
        raise ValueError(f"arrays[{ax.index(None)}] is a scalar; it has no axis {axis}")
    sizes = {a.shape[x] for a, x in zip(arrays, ax, strict=True)}
    if len(sizes) != 1:
        got = [a.shape[x] for a, x in zip(arrays, ax, strict=True)]
        raise ValueError(f"arrays must share their size along axis {axis}, got {got}")
    (s,) = sizes
    target = bucket_length(s, min_length=min_length, per_octave=per_octave)
    out = []
    for a, x in zip(arrays, ax, strict=True):
        widths = [(0, 0)] * a.ndim
        widths[x] = (0, target - s)
        xp = jnp if isinstance(a, jax.Array) else np
        out.append(xp.pad(a, widths, constant_values=fill))
    return tuple(out), s
