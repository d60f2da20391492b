"""The arguments of a dense attention call, checked once: shared by ``@sparse_attention`` and the Flax hook.

Both front ends receive calls shaped like ``jax.nn.dot_product_attention`` (and Flax's
``attention_fn``): ``query, key, value`` of layout ``[batch..., S, H, D]``, then keywords.
:class:`CallChecker` decides, once per call, what splat honours and what it must refuse.

Honoured:

- ``mask``: ``&`` the front end's own mask, when it is concrete at trace time and the same for
  every batch row and head (traced or per-head: refused);
- ``is_causal``: ``& masks.causal()``;
- ``local_window_size``: ``& masks.sliding_window(left, right)``; an int ``w`` means ``(w, w)``;
- ``scale`` (default ``1 / sqrt(D)``) and ``dtype`` (q, k, v are cast to it);
- ``implementation``, ``precision``, ``promote_dtype``, ``broadcast_dropout``, ``dropout_rng``,
  ``deterministic``: no effect (splat picks its own kernels and accumulates in float32; the
  dropout arguments matter only with dropout).

Refused: ``bias`` (an additive bias), ``dropout_rate`` > 0 unless ``deterministic``, ``module``
(sowing the weights needs the dense weights), ``return_residual``, ``query_seq_lengths`` and
``key_value_seq_lengths`` (per-batch lengths), and any other argument that differs from its default.

A refused call raises ``ValueError`` naming the arguments or, with ``fallback=True``, runs the
dense function and warns once per reason (:class:`SparseAttentionFallbackWarning`). Malformed
arguments (a non-boolean mask, a bad ``local_window_size`` or ``scale``, mismatched shapes)
raise whatever ``fallback`` says, naming the argument.

Every check runs once per call: the call's own checks here, the array and scale checks of
:func:`splat.attention` (``_attention._check_qkv``), one analysis of the combined mask, then
``_attention._attend``, which checks nothing again.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from jax_bindings import check_backend
from splat import _attention, masks
from splat._analyzer import analyze

__all__ = [
    "DOT_PRODUCT_ATTENTION_ARGS",
    "CallChecker",
    "SparseAttentionFallbackWarning",
    "Unsupported",
    "base_mask",
    "combine_call_masks",
    "mask_from_array",
    "refusals",
]

# keyword arguments of jax.nn.dot_product_attention and of Flax's attention_fn that splat knows
DOT_PRODUCT_ATTENTION_ARGS = (
    "bias",
    "mask",
    "scale",
    "is_causal",
    "query_seq_lengths",
    "key_value_seq_lengths",
    "local_window_size",
    "implementation",
    "dropout_rate",
    "dropout_rng",
    "deterministic",
    "broadcast_dropout",
    "dtype",
    "precision",
    "module",
    "promote_dtype",
    "return_residual",
)


class SparseAttentionFallbackWarning(UserWarning):
    """A decorated attention call ran the original dense function; the message says why."""


class Unsupported(Exception):
    """A call asks for something splat cannot do (the message names the argument)."""


def _is_tracer(x) -> bool:
    return isinstance(x, jax.core.Tracer)


def _same(a, b) -> bool:
    if a is b:
        return True
    try:
        return bool(a == b)
    except Exception:
        return False


# -----------------------------------------------------------------------------
# masks: the front end's own (at decoration) and the call's (per call)
# -----------------------------------------------------------------------------


def _check_mask_array(name: str, a: np.ndarray) -> None:
    if a.dtype != np.bool_:
        raise ValueError(f"{name} must be a boolean array, got dtype {a.dtype}")
    if a.ndim < 2:
        raise ValueError(
            f"{name} must be broadcastable to [batch..., heads, q_len, kv_len], got shape {a.shape}"
        )


def base_mask(mask) -> masks.Mask | None:
    """A front end's own ``mask=`` as a Mask; None for None and for arrays (sized per call).

    Raises:
      TypeError: ``mask`` is none of the accepted kinds.
      ValueError: ``mask`` is an array that is not boolean or not at least 2-D.
    """
    if mask is None or isinstance(mask, masks.Mask):
        return mask
    if callable(mask) and not hasattr(mask, "shape"):
        return masks.from_fn(mask)
    if _is_tracer(mask):
        raise TypeError("mask is a traced array; splat needs the mask at trace time (build it outside jit)")
    if hasattr(mask, "shape"):
        _check_mask_array("mask", np.asarray(mask))
        return None
    raise TypeError(
        f"mask must be a splat.masks.Mask, a boolean [q_len, kv_len] array or a function f(q_idx, kv_idx); "
        f"got {type(mask).__name__}"
    )


def mask_from_array(mask, q_len: int, kv_len: int, name: str = "`mask`") -> masks.Mask:
    """A Mask for a concrete boolean array broadcastable to ``[batch..., heads, q_len, kv_len]``.

    Args:
      mask: the array; every ``[q_len, kv_len]`` slice of it must be the same.
      q_len, kv_len: the attention's lengths.
      name: how messages call the array.

    Raises:
      Unsupported: the array is traced, or differs across batch or heads.
      ValueError: wrong shape or dtype.
    """
    if _is_tracer(mask):
        raise Unsupported(f"{name} is a traced array (splat needs masks that are constant at trace time)")
    a = np.asarray(mask)
    _check_mask_array(name, a)
    if a.shape[-2] not in (1, q_len) or a.shape[-1] not in (1, kv_len):
        raise ValueError(f"{name} of shape {a.shape} does not broadcast to [..., {q_len}, {kv_len}]")
    lead = a.reshape(-1, a.shape[-2], a.shape[-1])
    if lead.shape[0] > 1 and not (lead == lead[:1]).all():
        raise Unsupported(f"{name} differs across batch or heads (splat uses one mask for all of them)")
    return masks.from_array(np.ascontiguousarray(np.broadcast_to(lead[0], (q_len, kv_len))))


def _window(local_window_size) -> tuple[int, int]:
    w = local_window_size
    if isinstance(w, (int, np.integer)) and not isinstance(w, bool):
        w = (int(w), int(w))
    if not (
        isinstance(w, (tuple, list))
        and len(w) == 2
        and all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in w)
    ):
        raise ValueError(
            f"local_window_size must be an int or a (left, right) pair of ints, got {local_window_size!r}"
        )
    return int(w[0]), int(w[1])


def combine_call_masks(
    base: masks.Mask | None, q_len: int, kv_len: int, *, mask=None, is_causal=False, local_window_size=None
) -> masks.Mask:
    """``base & mask & causal & window`` as one splat Mask (None parts skipped; none at all: full).

    Raises:
      Unsupported: ``mask`` is traced or differs across batch or heads.
      ValueError: a malformed ``mask``, ``is_causal`` or ``local_window_size``.
    """
    parts = [] if base is None else [base]
    if mask is not None:
        parts.append(mask_from_array(mask, q_len, kv_len))
    if _is_tracer(is_causal):
        raise ValueError("is_causal must be a static Python bool, got a traced value")
    if is_causal:
        parts.append(masks.causal())
    if local_window_size is not None:
        parts.append(masks.sliding_window(*_window(local_window_size)))
    if not parts:
        return masks.full()
    out = parts[0]
    for p in parts[1:]:
        out = out & p
    return out


# -----------------------------------------------------------------------------
# arguments splat must refuse
# -----------------------------------------------------------------------------


def refusals(call: Mapping[str, Any], defaults: Mapping[str, Any]) -> list[str]:
    """Why splat cannot run this call, one reason per argument (empty: it can).

    Args:
      call: the call's keyword arguments (query, key and value left out).
      defaults: the default of each argument the caller's signature gives one; an argument
        outside :data:`DOT_PRODUCT_ATTENTION_ARGS` is refused when it differs from it.
    """
    out = []
    if call.get("bias") is not None:
        out.append("`bias` (an additive bias) is not supported by splat")
    rate = call.get("dropout_rate")
    if rate and not call.get("deterministic", False):
        out.append(f"`dropout_rate`={rate} (dropout, deterministic=False) is not supported by splat")
    if call.get("module") is not None:
        out.append("`module` (sow_weights: sowing the attention weights) needs the dense attention weights")
    if call.get("return_residual"):
        out.append("`return_residual` is not supported by splat")
    for n in ("query_seq_lengths", "key_value_seq_lengths"):
        if call.get(n) is not None:
            out.append(f"`{n}` (per-batch lengths) is not supported by splat")
    for n, val in call.items():
        if n not in DOT_PRODUCT_ATTENTION_ARGS and n in defaults and not _same(val, defaults[n]):
            out.append(f"`{n}`={val!r} is not understood by splat")
    return out


# -----------------------------------------------------------------------------
# the checker shared by the front ends
# -----------------------------------------------------------------------------


def _batch_axes(query, key, value) -> tuple[int, ...]:
    """The leading axes of ``[batch..., S, H, D]`` arrays; checks they agree across q, k, v."""
    if not hasattr(query, "shape") or len(query.shape) < 3:
        got = tuple(query.shape) if hasattr(query, "shape") else type(query).__name__
        raise ValueError(f"query must be [batch..., q_len, heads, head_dim] (at least 3-D), got {got}")
    batch = tuple(query.shape[:-3])
    for name, x in (("key", key), ("value", value)):
        if not hasattr(x, "shape") or tuple(x.shape[:-3]) != batch or len(x.shape) != len(query.shape):
            got = tuple(x.shape) if hasattr(x, "shape") else type(x).__name__
            raise ValueError(
                f"{name} must be [batch..., kv_len, kv_heads, head_dim] with the batch axes {batch} "
                f"of query, got {got}"
            )
    return batch


class CallChecker:
    """One front end's checks of its calls, and the splat call they lead to.

    Built once per decorated function (or hook): checks ``backend`` and the front end's own
    ``mask`` there; each call then goes through :meth:`__call__`.
    """

    def __init__(self, who: str, mask: Any, backend: str, *, fallback: bool, dense_name: str):
        """
        Args:
          who: the front end as messages name it, e.g. ``"splat.sparse_attention(attn)"``.
          mask: its own mask (a Mask, a boolean array, a function ``f(q_idx, kv_idx)`` or None).
          backend: one of ``jax_bindings.BACKENDS``.
          fallback: refused calls run the dense function (True) or raise ``ValueError`` (False).
          dense_name: what the fallback runs, for messages.
        """
        self.who, self.fallback, self.dense_name = who, fallback, dense_name
        self.backend = check_backend(backend)
        self.base = base_mask(mask)
        self._base_array = mask if self.base is None and mask is not None else None
        self._base_sized: dict[tuple[int, int], masks.Mask] = {}
        self._warned: set[str] = set()

    def _base(self, q_len: int, kv_len: int) -> masks.Mask | None:
        if self._base_array is None:
            return self.base
        key = (q_len, kv_len)
        if key not in self._base_sized:
            name = f"the mask given to {self.who}"
            self._base_sized[key] = mask_from_array(self._base_array, q_len, kv_len, name)
        return self._base_sized[key]

    def __call__(
        self,
        query,
        key,
        value,
        call: Mapping[str, Any],
        defaults: Mapping[str, Any],
        dense: Callable[[], Any],
    ):
        """Sparse attention for this call, or ``dense()`` when splat refuses it and ``fallback`` is on.

        Args:
          query: ``[batch..., Sq, H, D]``.
          key, value: ``[batch..., Skv, Hk, D]`` with the batch axes of ``query``.
          call: the other arguments by name (see the module table).
          defaults: the caller's defaults, for arguments splat does not know.
          dense: runs the original dense attention on the same call.

        Returns:
          ``[batch..., Sq, H, D]``.
        """
        reasons = refusals(call, defaults)
        batch = _batch_axes(query, key, value)
        q_len, kv_len = query.shape[-3], key.shape[-3]
        mask = None
        if not reasons:
            try:
                mask = combine_call_masks(
                    self._base(q_len, kv_len),
                    q_len,
                    kv_len,
                    mask=call.get("mask"),
                    is_causal=call.get("is_causal", False),
                    local_window_size=call.get("local_window_size"),
                )
            except Unsupported as e:
                reasons.append(str(e))
        if reasons:
            return self._refuse(reasons, dense)
        b = math.prod(batch)  # [batch..., S, H, D] -> [B, S, H, D]
        q, k, v = (x.reshape((b, *x.shape[-3:])) for x in (query, key, value))
        dtype = call.get("dtype")
        if dtype is not None:
            q, k, v = q.astype(dtype), k.astype(dtype), v.astype(dtype)
        q, k, v, scale = _attention._check_qkv(q, k, v, call.get("scale"))
        out = _attention._attend(q, k, v, analyze(mask, q_len, kv_len), scale, self.backend)
        return out.reshape(batch + out.shape[1:])

    def _refuse(self, reasons: list[str], dense: Callable[[], Any]):
        msg = "; ".join(reasons)
        if not self.fallback:
            raise ValueError(
                f"{self.who}: {msg}. Remove it, or pass fallback=True to run {self.dense_name} instead"
            )
        if msg not in self._warned:
            self._warned.add(msg)
            warnings.warn(
                f"{self.who}: {msg}; running {self.dense_name}", SparseAttentionFallbackWarning, stacklevel=4
            )
        return dense()
