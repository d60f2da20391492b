"""Flax NNX hook: ``attention_fn`` for ``flax.nnx.MultiHeadAttention`` that runs splat.

``flax.nnx.MultiHeadAttention`` calls its ``attention_fn`` as
``attention_fn(query, key, value, mask=..., dropout_rng=..., dropout_rate=...,
broadcast_dropout=..., deterministic=..., dtype=..., precision=..., module=...,
is_causal=...)`` with layout ``[batch..., length, heads, head_dim]``. The
function returned here accepts exactly that, folds the batch axes into one and
calls :func:`splat.attention`. Flax itself is imported only for the fallback
(``pip install splat[flax]``).

Example:
  >>> import flax.nnx as nnx, splat, splat.flax
  >>> mha = nnx.MultiHeadAttention(num_heads=2, in_features=16, decode=False,
  ...     attention_fn=splat.flax.attention_fn(splat.masks.sliding_window(8, 0)),
  ...     rngs=nnx.Rngs(0))
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

from jax_bindings import check_backend

__all__ = ["attention_fn"]


def attention_fn(mask: Any = None, backend: str = "auto", *, fallback: bool = False) -> Callable:
    """An ``attention_fn`` for ``flax.nnx.MultiHeadAttention`` that runs :func:`splat.attention`.

    Args:
      mask: the layer's mask: a :class:`splat.masks.Mask`, a boolean
        ``[q_len, kv_len]`` array or a vectorised ``f(q_idx, kv_idx)``; None
        means full attention (useful with ``is_causal`` or a call-time mask).
        Each layer may get its own (e.g. alternating local/global layers).
      backend: one of ``jax_bindings.BACKENDS`` (see :func:`splat.attention`).
      fallback: when a call asks for what splat cannot do (an attention
        ``bias``, dropout during training, ``sow_weights``, a traced or per-head
        ``mask``), False raises ``ValueError`` naming it; True runs
        ``flax.nnx.dot_product_attention`` instead and warns once.

    Returns:
      ``fn(query, key, value, bias=None, mask=None, broadcast_dropout=True,
      dropout_rng=None, dropout_rate=0.0, deterministic=False, dtype=None,
      precision=None, module=None, promote_dtype=..., is_causal=False)`` with
      ``query: [batch..., q_len, heads, head_dim]``, ``key``/``value``:
      ``[batch..., kv_len, kv_heads, head_dim]``; returns
      ``[batch..., q_len, heads, head_dim]``. Call-time ``mask`` and
      ``is_causal`` are intersected with ``mask``. A query row left with no
      key outputs 0 (flax's dense attention would give mean(V) there).
    """
    from splat._decorator import _as_base_mask, _Unsupported, combine_call_masks, mask_from_array

    check_backend(backend)
    base = _as_base_mask(mask)
    base_array = mask if base is None and mask is not None else None
    warned: set = set()

    def fn(
        query,
        key,
        value,
        bias=None,
        mask=None,
        broadcast_dropout: bool = True,
        dropout_rng=None,
        dropout_rate: float = 0.0,
        deterministic: bool = False,
        dtype=None,
        precision=None,
        module=None,
        promote_dtype=None,
        is_causal: bool = False,
        **unused,
    ):
        problems = []
        if bias is not None:
            problems.append("`bias` (an additive bias) is not supported by splat")
        if dropout_rate and not deterministic:
            problems.append(
                f"dropout (`dropout_rate`={dropout_rate}, deterministic=False) is not supported by splat"
            )
        if module is not None:
            problems.append("`module` (sow_weights=True) needs the dense attention weights")
        if query.ndim < 3:
            raise ValueError(f"query must be [batch..., q_len, heads, head_dim], got shape {query.shape}")
        q_len, kv_len = query.shape[-3], key.shape[-3]
        m = None
        if not problems:
            try:
                b = (
                    base
                    if base_array is None
                    else mask_from_array(base_array, q_len, kv_len, "attention_fn(mask=)")
                )
                if mask is not None:  # flax masks are [batch..., heads, q, kv]; fold batch axes
                    mask = mask.reshape((-1,) + tuple(mask.shape[-3:])) if mask.ndim > 4 else mask
                    if not hasattr(mask, "dtype") or mask.dtype != bool:
                        mask = mask.astype(bool)
                m = combine_call_masks(b, q_len, kv_len, mask=mask, is_causal=is_causal)
            except _Unsupported as e:
                problems.append(str(e))
        if problems:
            msg = "; ".join(problems)
            if not fallback:
                raise ValueError(
                    f"splat.flax.attention_fn: {msg}. Pass fallback=True to run dense attention instead"
                )
            if msg not in warned:
                warned.add(msg)
                warnings.warn(
                    f"splat.flax.attention_fn: {msg}; running flax.nnx.dot_product_attention", stacklevel=2
                )
            import flax.nnx as nnx

            kw = {} if promote_dtype is None else {"promote_dtype": promote_dtype}
            return nnx.dot_product_attention(
                query, key, value, bias, mask, broadcast_dropout, dropout_rng, dropout_rate,
                deterministic, dtype, precision, module, is_causal=is_causal, **kw,
            )  # fmt: skip
        from splat._attention import attention

        if dtype is not None:
            query, key, value = query.astype(dtype), key.astype(dtype), value.astype(dtype)
        else:
            dt = query.dtype if query.dtype == key.dtype == value.dtype else None
            if dt is None:
                import jax.numpy as jnp

                dt = jnp.result_type(query, key, value)
                query, key, value = query.astype(dt), key.astype(dt), value.astype(dt)
        batch = query.shape[:-3]
        b = math.prod(batch)
        q4 = query.reshape((b,) + query.shape[-3:])
        k4 = key.reshape((b,) + key.shape[-3:])
        v4 = value.reshape((b,) + value.shape[-3:])
        out = attention(q4, k4, v4, mask=m, backend=backend)
        return out.reshape(batch + out.shape[1:])

    fn.splat_mask = mask
    return fn
