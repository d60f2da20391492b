"""``@splat.sparse_attention``: run an existing dense attention function sparse.

The decorated function keeps its signature (that of
``jax.nn.dot_product_attention``, or a prefix of it such as ``(q, k, v)``), but
its body is replaced by :func:`splat.attention` with the decorator's mask,
intersected with whatever the call asks for through ``is_causal``,
``local_window_size`` and a static ``mask`` argument. Arguments splat cannot
honour raise ``ValueError`` naming them, or, with ``fallback=True``, call the
original function and warn once saying why.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jax_bindings import check_backend

__all__ = ["SparseAttentionFallbackWarning", "sparse_attention"]

# parameter names of jax.nn.dot_product_attention (and flax's attention_fn) we understand
_KNOWN = (
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
    "return_residual",
)


class SparseAttentionFallbackWarning(UserWarning):
    """A decorated attention call ran the original dense function; the message says why."""


class _Unsupported(Exception):
    pass


def _is_tracer(x) -> bool:
    return isinstance(x, jax.core.Tracer)


def mask_from_array(mask, q_len: int, kv_len: int, name: str = "mask"):
    """A splat Mask for a concrete boolean array broadcastable to ``[B?, H?, q_len, kv_len]``.

    Raises:
      _Unsupported: the array is traced, or differs across batch/heads.
      ValueError: wrong shape or dtype.
    """
    from splat import masks

    if _is_tracer(mask):
        raise _Unsupported(f"`{name}` is a traced array (splat needs masks that are constant at trace time)")
    a = np.asarray(mask)
    if a.dtype != np.bool_:
        raise ValueError(f"`{name}` must be a boolean array, got dtype {a.dtype}")
    if a.ndim < 2 or a.ndim > 4:
        raise ValueError(f"`{name}` must be broadcastable to [B, H, q_len, kv_len], got shape {a.shape}")
    if a.shape[-2] not in (1, q_len) or a.shape[-1] not in (1, kv_len):
        raise ValueError(f"`{name}` of shape {a.shape} does not broadcast to [..., {q_len}, {kv_len}]")
    lead = a.reshape(-1, a.shape[-2], a.shape[-1])
    if lead.shape[0] > 1 and not (lead == lead[:1]).all():
        raise _Unsupported(f"`{name}` differs across batch or heads (splat uses one mask for all of them)")
    return masks.from_array(np.ascontiguousarray(np.broadcast_to(lead[0], (q_len, kv_len))))


def combine_call_masks(base, q_len: int, kv_len: int, *, mask=None, is_causal=False, local_window_size=None):
    """``base & mask & causal & window`` as one splat Mask (None parts skipped)."""
    from splat import masks

    parts = [] if base is None else [base]
    if mask is not None:
        parts.append(mask_from_array(mask, q_len, kv_len))
    if is_causal:
        parts.append(masks.causal())
    if local_window_size is not None:
        w = local_window_size
        if isinstance(w, (int, np.integer)):
            w = (int(w), int(w))
        if not (
            isinstance(w, (tuple, list)) and len(w) == 2 and all(isinstance(x, (int, np.integer)) for x in w)
        ):
            raise ValueError(
                f"local_window_size must be an int or a (left, right) pair of ints, got {local_window_size!r}"
            )
        parts.append(masks.sliding_window(int(w[0]), int(w[1])))
    if not parts:
        return masks.full()
    out = parts[0]
    for p in parts[1:]:
        out = out & p
    return out


def _same(a, b) -> bool:
    if a is b:
        return True
    try:
        return bool(a == b)
    except Exception:
        return False


def _as_base_mask(mask):
    from splat import masks

    if mask is None or isinstance(mask, masks.Mask):
        return mask
    if callable(mask) and not hasattr(mask, "shape"):
        return masks.from_fn(mask)
    if hasattr(mask, "shape"):
        return None  # arrays are sized: checked per call against the actual lengths
    raise TypeError(
        f"mask must be a splat.masks.Mask, a boolean [q_len, kv_len] array or a function f(q_idx, kv_idx); "
        f"got {type(mask).__name__}"
    )


def sparse_attention(
    fn: Callable | None = None, *, mask: Any = None, backend: str = "auto", fallback: bool = False
) -> Callable:
    """Decorate a dense attention function so that it runs through :func:`splat.attention`.

    The function must take ``(query, key, value, ...)`` with layout
    ``[B, S, H, D]`` (``[S, H, D]`` also works, e.g. under ``vmap``); it may
    accept any of ``jax.nn.dot_product_attention``'s keyword arguments. The
    mask used is ``mask & is_causal & local_window_size & <mask argument>``.

    Fully masked rows: a query row that the mask leaves with no key gets output
    0 (and zero gradients), as everywhere in splat. The replaced dense function
    may give something else there: ``jax.nn.dot_product_attention`` and a
    finite fill (``jnp.where(mask, s, -1e9)``) give mean(V) over the keys, a
    ``-inf`` fill gives NaN. Outputs agree on every row with at least one key.
    (Detection mode, ``mask=None``, keeps such attentions dense unless asked;
    see :func:`splat.sparsify`'s ``empty_rows``.)

    Args:
      fn: the attention function (when used as ``@sparse_attention`` bare).
      mask: a :class:`splat.masks.Mask`, a boolean ``[q_len, kv_len]`` array,
        or a vectorised ``f(q_idx, kv_idx)``. None switches to detection mode:
        the mask is found inside ``fn`` at trace time (:func:`splat.sparsify`,
        with ``empty_rows="fallback"``).
      backend: one of ``jax_bindings.BACKENDS``, passed to :func:`splat.attention`.
      fallback: when a call passes something splat cannot honour (a ``bias``,
        dropout, per-batch sequence lengths, a traced or per-head ``mask``),
        False raises ``ValueError`` naming it; True calls ``fn`` itself and
        warns once per reason.

    Returns:
      A function with ``fn``'s signature; works under ``jit``, ``vmap``, ``grad``.

    Example:
      >>> import jax, splat
      >>> @splat.sparse_attention(mask=splat.masks.sliding_window(4))
      ... def attn(q, k, v, bias=None, mask=None, *, is_causal=False):
      ...     return jax.nn.dot_product_attention(q, k, v, bias, mask, is_causal=is_causal)
      >>> q = jax.random.normal(jax.random.key(0), (1, 32, 2, 8))
      >>> attn(q, q, q, is_causal=True).shape      # sliding_window(4) & causal
      (1, 32, 2, 8)
    """
    check_backend(backend)
    if fn is None:
        return functools.partial(sparse_attention, mask=mask, backend=backend, fallback=fallback)
    if not callable(fn):
        raise TypeError(f"sparse_attention decorates a function, got {type(fn).__name__}")
    if mask is None:
        from splat._sparsify import sparsify

        return sparsify(fn, backend=backend, fallback=fallback)

    base = _as_base_mask(mask)
    base_array = mask if base is None else None
    sig = inspect.signature(fn)
    params = list(sig.parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    has_varargs = any(p.kind == p.VAR_POSITIONAL for p in params)
    if len(positional) < 3 and not has_varargs:
        raise TypeError(
            f"sparse_attention needs a function taking (query, key, value, ...); {fn.__name__}{sig}"
        )
    name = getattr(fn, "__qualname__", repr(fn))
    warned: set = set()

    def call_args(args, kwargs) -> dict:
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        out = dict(bound.arguments)
        for p in params:
            if p.kind == p.VAR_KEYWORD:
                out.update(out.pop(p.name, {}))
            elif p.kind == p.VAR_POSITIONAL:
                extra = out.pop(p.name, ())
                out.update(zip(("query", "key", "value")[len(positional) :], extra, strict=False))
        return out

    def plan(args, kwargs):
        a = call_args(args, kwargs)
        names = [p.name for p in positional[:3]] if len(positional) >= 3 else ["query", "key", "value"]
        q, k, v = (a.pop(n) for n in names)
        defaults = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}
        problems = []
        if a.get("bias") is not None:
            problems.append("`bias` (an additive bias) is not supported by splat")
        if a.get("dropout_rate", 0.0) not in (0, 0.0, None) and not a.get("deterministic", False):
            problems.append(f"`dropout_rate`={a['dropout_rate']} (dropout) is not supported by splat")
        if a.get("module") is not None:
            problems.append("`module` (sowing attention weights) needs the dense weights")
        if a.get("return_residual"):
            problems.append("`return_residual` is not supported by splat")
        for n in ("query_seq_lengths", "key_value_seq_lengths"):
            if a.get(n) is not None:
                problems.append(f"`{n}` (per-batch lengths) is not supported by splat")
        for n, val in a.items():
            if n not in _KNOWN and n in defaults and not _same(val, defaults[n]):
                problems.append(f"`{n}`={val!r} is not understood by splat.sparse_attention")
        if q.ndim not in (3, 4):
            raise ValueError(f"query must be [B, S, H, D] or [S, H, D], got shape {q.shape}")
        q_len, kv_len = q.shape[-3], k.shape[-3]
        m = None
        if not problems:
            try:
                b = (
                    base
                    if base_array is None
                    else mask_from_array(base_array, q_len, kv_len, "mask= (decorator)")
                )
                m = combine_call_masks(
                    b,
                    q_len,
                    kv_len,
                    mask=a.get("mask"),
                    is_causal=bool(a.get("is_causal", False)),
                    local_window_size=a.get("local_window_size"),
                )
            except _Unsupported as e:
                problems.append(str(e))
        return q, k, v, a, m, problems

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        q, k, v, a, m, problems = plan(args, kwargs)
        if problems:
            msg = "; ".join(problems)
            if not fallback:
                raise ValueError(
                    f"splat.sparse_attention({name}): {msg}. "
                    "Remove it, or pass fallback=True to run the dense function"
                )
            if msg not in warned:
                warned.add(msg)
                warnings.warn(
                    f"splat.sparse_attention({name}): {msg}; running the original dense function",
                    SparseAttentionFallbackWarning,
                    stacklevel=2,
                )
            return fn(*args, **kwargs)
        from splat._attention import attention

        dtype = a.get("dtype")
        if dtype is not None:
            q, k, v = q.astype(dtype), k.astype(dtype), v.astype(dtype)
        squeeze = q.ndim == 3
        if squeeze:
            q, k, v = q[None], k[None], v[None]
        out = attention(q, k, v, mask=m, scale=a.get("scale"), backend=backend)
        return out[0] if squeeze else out

    wrapper.splat_mask = mask
    return wrapper
