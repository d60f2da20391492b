"""Grid-shaped neighborhood attention: ``[B, *grid, H, D]`` in and out (like NATTEN's na2d)."""

from __future__ import annotations

from collections.abc import Sequence

import jax

from splat._attention import attention
from splat._neighborhood import neighborhood

_MAX_GRID_AXES = 3


def _grid_of(name: str, x) -> tuple[int, ...]:
    """The spatial axes of ``x: [B, *grid, H, D]`` (1 to 3 of them)."""
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be a jax or numpy array [B, *grid, H, D], got {type(x).__name__}")
    if not 4 <= x.ndim <= 3 + _MAX_GRID_AXES:
        raise ValueError(
            f"{name} must be [B, *grid, H, D] with 1 to {_MAX_GRID_AXES} grid axes (rank 4 to "
            f"{3 + _MAX_GRID_AXES}), got shape {tuple(x.shape)}"
        )
    return tuple(int(n) for n in x.shape[1:-2])


def neighborhood_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    kernel_size: int | Sequence[int],
    *,
    stride: int | Sequence[int] = 1,
    dilation: int | Sequence[int] = 1,
    is_causal: bool | Sequence[bool] = False,
    scale: float | None = None,
    backend: str = "auto",
) -> jax.Array:
    """Neighborhood attention over the token grid of ``[B, *grid, H, D]`` inputs.

    The grid comes from the shapes; the tokens are flattened row-major to
    ``[B, prod(grid), H, D]`` (a reshape), attended with
    :func:`splat.masks.neighborhood` and :func:`splat.attention`, and reshaped
    back. Works under ``jax.jit``, ``jax.vmap`` and ``jax.grad``.

    Args:
      query: ``[B, *grid, H, D]`` with 1 to 3 grid axes; float32, bfloat16 or
        float16.
      key: ``[B, *grid, Hk, D]``, same grid and dtype; ``Hk`` divides ``H``
        (GQA/MQA).
      value: like ``key``.
      kernel_size, stride, dilation, is_causal: per-axis neighborhood geometry,
        an int / bool for every axis or one per grid axis; see
        :func:`splat.masks.neighborhood` for their exact meaning.
      scale: positive multiplier of the scores; default ``1 / sqrt(D)``.
      backend: ``"auto"``, ``"jax"`` or ``"triton"``.

    Returns:
      ``[B, *grid, H, D]`` in the dtype of ``query``.

    Example:
      >>> import jax, splat
      >>> q, k, v = jax.random.normal(jax.random.key(0), (3, 1, 8, 8, 2, 16))  # [B, 8, 8, H, D]
      >>> out = splat.neighborhood_attention(q, k, v, kernel_size=3, is_causal=(True, False))
      >>> out.shape
      (1, 8, 8, 2, 16)
    """
    grid = _grid_of("query", query)
    for name, x in (("key", key), ("value", value)):
        g = _grid_of(name, x)
        if g != grid:
            raise ValueError(
                f"{name} grid {g} != query grid {grid} (axes 1..{len(grid)} of [B, *grid, H, D])"
            )
    mask = neighborhood(grid, kernel_size, stride=stride, dilation=dilation, is_causal=is_causal)
    flat = [x.reshape(x.shape[0], mask.size, *x.shape[-2:]) for x in (query, key, value)]
    out = attention(*flat, mask=mask, scale=scale, backend=backend)
    return out.reshape(query.shape)
