"""A splat mask in each peer's own terms: a band ``(left, right)``, an operator expression, FA3's arguments.

Peers that take only some masks (cuDNN, tokamax, FlashAttention-3) recognise
them from the layout, so a window qualifies however it was written;
FlexAttention takes the mask as a function built from the mask value
(neighborhoods included: :func:`neighborhood_expression` computes the window
from the flattened token indices).
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["band_of", "flash_attn3_arguments", "mask_expression", "neighborhood_expression"]


def band_of(layout) -> tuple[int, int] | None:
    """``(left, right)`` when the layout is exactly the band ``i - left <= j <= i + right`` with no
    empty row, else None.

    Read by :func:`acsr.band` from the layout's one segment, O(S) (a pass over the mask's
    nonzeros took minutes on a dense S = 16384 layout), so any mask that *is* a window
    qualifies, however it was written. ``left``/``right`` are capped at ``kv_len - 1`` (so full
    attention is ``(S-1, S-1)`` and causal ``(S-1, 0)``); a band off the diagonal (a negative
    bound) is None.
    """
    import acsr

    band = acsr.band(layout)
    if band is None or any(b is not None and b < 0 for b in band):
        return None
    (segment,) = [s for s in layout.segments if s.width > 0]  # acsr.band: exactly one
    if (segment.count == 0).any():
        return None
    cap = layout.kv_len - 1
    left, right = (cap if b is None else min(b, cap) for b in band)
    return left, right


def mask_expression(mask) -> Callable | None:
    """The mask as ``f(q_idx, kv_idx)`` written with operators only (``+ - * % // < <= & |``).

    The same function then runs on numpy arrays (tested against ``mask(q, kv)``)
    and on torch tensors inside FlexAttention's ``mask_mod``. Returns None for
    masks with no such form (arrays, user functions).
    """
    from splat import masks as M
    from splat._neighborhood import Neighborhood

    if isinstance(mask, Neighborhood):
        return neighborhood_expression(mask)
    if isinstance(mask, M.Full):
        return lambda q, kv: (q >= 0) | (kv >= 0)
    if isinstance(mask, M.Causal):
        return lambda q, kv: kv <= q
    if isinstance(mask, M.SlidingWindow):
        left, right = mask.left, mask.right
        return lambda q, kv: (q - kv <= left) & (kv - q <= right)
    if isinstance(mask, M.DilatedWindow):
        rad, dil = mask.radius, mask.dilation
        return lambda q, kv: (q - kv <= rad) & (kv - q <= rad) & ((q - kv) % dil == 0)
    if isinstance(mask, M.Strided):
        st = mask.stride
        return lambda q, kv: (q - kv >= 0) & ((q - kv) % st == 0)
    if isinstance(mask, M.BlockLocal):
        blk, lb = mask.block, mask.lookback
        return lambda q, kv: (kv // blk <= q // blk) & (kv // blk >= q // blk - lb)
    if isinstance(mask, M.GlobalTokens):
        n = mask.n
        return lambda q, kv: (q < n) | (kv < n)
    if isinstance(mask, M.Sink):
        n = mask.n
        if getattr(mask, "causal", False):  # causal sinks: key j < n only once the query has reached it
            return lambda q, kv: (kv < n) & (kv <= q)
        return lambda q, kv: (kv < n) & (q >= 0)
    if isinstance(mask, (M.Union, M.Intersection)):
        a, b = mask_expression(mask.a), mask_expression(mask.b)
        if a is None or b is None:
            return None
        if isinstance(mask, M.Union):
            return lambda q, kv: a(q, kv) | b(q, kv)
        return lambda q, kv: a(q, kv) & b(q, kv)
    return None


def _smaller(a, b):
    """``min(a, b)`` elementwise with operators only (numpy arrays, torch tensors, ints)."""
    return a - (a - b) * (a > b)


def _larger(a, b):
    """``max(a, b)`` elementwise with operators only."""
    return a + (b - a) * (b > a)


def neighborhood_expression(mask) -> Callable:
    """A :class:`splat.masks.neighborhood` mask as ``f(q_idx, kv_idx)`` on flattened token indices.

    Written from the definition in :class:`splat._neighborhood.AxisWindow`, with
    operators only, so the same function runs on numpy arrays and on torch tensors
    (FlexAttention's ``mask_mod``). Per axis ``a`` of length ``n`` (token ``i``
    has coordinate ``i // step_a % n``, ``step_a`` the product of the later axes'
    lengths), a query at ``x`` sees a key at ``y`` iff ``y`` is in the query's
    dilation phase (``y % d == x % d``) and its sub-grid position ``y // d`` lies
    in ``[lo, hi)``:

    * ``L = ceil((n - x % d) / d)`` (the phase sub-grid's length), ``p = x // d``,
      ``g = s * (p // s)`` (the stride group's first position);
    * causal: ``leader = min(g + s - 1, L - 1)``, ``lo = max(leader - k + 1, 0)``, ``hi = p + 1``;
    * otherwise: ``leader = min(g + s // 2, L - 1)``,
      ``lo = min(max(leader - k // 2, 0), L - k)``, ``hi = lo + k``.

    Args:
      mask: a :class:`splat._neighborhood.Neighborhood`.

    Returns:
      ``f(q_idx, kv_idx)`` -> bool, broadcasting its two integer arguments.
    """
    axes, step = [], 1
    for a in reversed(mask.axes):  # innermost first: its tokens step by 1
        axes.append((step, a.length, a.kernel_size, a.stride, a.dilation, a.is_causal))
        step *= a.length

    def within(q, kv):
        seen = None
        for step, n, k, s, d, causal in axes:
            x, y = q // step % n, kv // step % n
            phase, pos = x % d, x // d
            sub_len = (n - phase + d - 1) // d
            group = pos // s * s
            if causal:
                leader = _smaller(group + s - 1, sub_len - 1)
                lo = _larger(leader - k + 1, 0)
                hi = pos + 1
            else:
                leader = _smaller(group + s // 2, sub_len - 1)
                lo = _smaller(_larger(leader - k // 2, 0), sub_len - k)
                hi = lo + k
            key = y // d
            axis_seen = (y % d == phase) & (key >= lo) & (key < hi)
            seen = axis_seen if seen is None else seen & axis_seen
        return seen

    return within


def flash_attn3_arguments(layout) -> dict | None:
    """``flash_attn3_jax.flash_mha`` keywords computing exactly ``layout``, or None when none do.

    FlashAttention's windows (``q_len == kv_len``): query ``i`` sees keys
    ``i - left <= j <= i + right``, ``-1`` meaning no bound on that side, and
    ``is_causal=True`` caps ``right`` at 0. So a band (:func:`band_of`) is
    ``is_causal=True`` when ``right == 0``, with ``window_size=(left, 0)``
    (``(-1, -1)`` for plain causal); else ``window_size=(left, right)``, a side
    that spans the whole sequence written ``-1`` (full attention: ``(-1, -1)``).

    Returns:
      ``{"is_causal": bool, "window_size": (left, right)}``, or None for a
      non-square layout or a mask that is not a band.
    """
    if layout.q_len != layout.kv_len:
        return None
    band = band_of(layout)
    if band is None:
        return None
    s = layout.q_len
    left, right = (-1 if w >= s - 1 else w for w in band)
    if right == 0:
        return {"is_causal": True, "window_size": (left, 0) if left >= 0 else (-1, -1)}
    return {"is_causal": False, "window_size": (left, right)}
