"""The merge of a walk cut into splits (flash-decoding), shared by the decode kernels of every backend.

A split's rows are normalised by their own sum and carry their log-sum-exp; the merge weighs them
by ``exp(lse_s - max lse)`` and sums them split after split in a fixed order, so reruns are
bit-identical whatever the kernels' timing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def merge_splits(o_part: jax.Array, lse_part: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """``(out [B, T, H, D] in dtype, lse [B, H, T])`` from the splits' rows ``o_part [B, T, H, S, D]``
    (each normalised by its own sum) and ``lse_part [B, T, H, S]`` (natural log; ``-inf``: the
    split saw no key of the row). A row no split saw gets 0 and ``-inf``.

    Example:
      >>> import jax.numpy as jnp
      >>> o = jnp.ones((1, 1, 1, 2, 4)) * jnp.array([1.0, 3.0])[:, None]
      >>> out, lse = merge_splits(o, jnp.zeros((1, 1, 1, 2)), jnp.float32)
      >>> out[0, 0, 0].tolist(), round(float(lse[0, 0, 0]), 4)
      ([2.0, 2.0, 2.0, 2.0], 0.6931)
    """
    splits = o_part.shape[3]
    top = jnp.max(lse_part, axis=-1)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    w = jnp.exp(lse_part - top[..., None])
    den = w[..., 0]
    acc = o_part[..., 0, :] * w[..., 0, None]
    for s in range(1, splits):
        den = den + w[..., s]
        acc = acc + o_part[..., s, :] * w[..., s, None]
    has = den > 0
    out = jnp.where(has[..., None], acc / jnp.where(has, den, 1.0)[..., None], 0.0).astype(dtype)
    lse = jnp.where(has, top + jnp.log(jnp.where(has, den, 1.0)), -jnp.inf)
    return out, jnp.moveaxis(lse, 1, 2)
