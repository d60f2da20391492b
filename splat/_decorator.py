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
from collections.abc import Callable
from typing import Any

from jax_bindings import check_backend
from splat._call_args import CallChecker, SparseAttentionFallbackWarning

__all__ = ["SparseAttentionFallbackWarning", "sparse_attention"]


def sparse_attention(
    fn: Callable | None = None, *, mask: Any = None, backend: str = "auto", fallback: bool = False
) -> Callable:
    """Decorate a dense attention function so that it runs through :func:`splat.attention`.

    The function must take ``(query, key, value, ...)`` with layout
    ``[B, S, H, D]`` (any number of batch axes, none included: ``[S, H, D]``
    under ``vmap``); it may accept any of ``jax.nn.dot_product_attention``'s
    keyword arguments. The mask used is ``mask & is_causal & local_window_size
    & <mask argument>``; what each argument does is listed in
    :mod:`splat._call_args`.

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
      Each call (each trace, under ``jit``) leaves a :class:`splat.CallRecord`
      (``front_end="sparse_attention(<fn name>)"``) in :func:`splat.call_log`
      and :func:`splat.call_counts`, also when it raises.

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
    name = getattr(fn, "__qualname__", repr(fn))
    if mask is None:
        from splat._sparsify.api import wrap

        return wrap(
            fn,
            backend=backend,
            fallback=fallback,
            empty_rows="fallback",
            front_end=f"sparse_attention({name})",
        )

    who = f"splat.sparse_attention({name})"
    checker = CallChecker(who, mask, backend, fallback=fallback, dense_name="the original dense function")
    sig = inspect.signature(fn)
    params = list(sig.parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    has_varargs = any(p.kind == p.VAR_POSITIONAL for p in params)
    if len(positional) < 3 and not has_varargs:
        raise TypeError(
            f"sparse_attention needs a function taking (query, key, value, ...); {fn.__name__}{sig}"
        )
    qkv_names = [p.name for p in positional[:3]] if len(positional) >= 3 else ["query", "key", "value"]
    defaults = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}

    def call_args(args, kwargs) -> dict:
        """The call's arguments by name, defaults filled in, ``*args``/``**kwargs`` spread out."""
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

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        call = call_args(args, kwargs)
        q, k, v = (call.pop(n) for n in qkv_names)
        return checker(q, k, v, call, defaults, dense=lambda: fn(*args, **kwargs))

    wrapper.splat_mask = mask
    return wrapper
