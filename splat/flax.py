"""Flax NNX hook: ``attention_fn`` for ``flax.nnx.MultiHeadAttention`` that runs splat.

``flax.nnx.MultiHeadAttention`` calls its ``attention_fn`` as
``attention_fn(query, key, value, mask=..., dropout_rng=..., dropout_rate=...,
broadcast_dropout=..., deterministic=..., dtype=..., precision=..., module=...,
is_causal=...)`` with layout ``[batch..., length, heads, head_dim]``. The
function returned here accepts exactly that, folds the batch axes into one and
calls :func:`splat.attention`. Flax itself is imported only for the fallback
(``pip install "splat-attention[flax]"``).

Decode (``MultiHeadAttention(decode=True)``, one token a call against the KV
cache): Flax passes the new token's query ``[batch..., 1, heads, head_dim]``,
the whole cache as key and value ``[batch..., max_length, kv_heads, head_dim]``
and a mask ``arange(max_length) <= cache_index`` (AND-ed with the call's own
``mask``). The hook reads the query's position off that mask -- the last key it
may see -- and applies the layer's mask at that row (``q_offset``), with the
keys past it unseen (``key_value_seq_lengths``). So a step of ``decode=True``
equals the same row of the full-sequence call, under ``jit`` or not, with one
compile for every step. See :mod:`splat._call_args` for the rule and its one
caveat (a mask that hides the new token's own key misplaces it).

Example:
  >>> import flax.nnx as nnx, splat, splat.flax
  >>> mha = nnx.MultiHeadAttention(num_heads=2, in_features=16, decode=False,
  ...     attention_fn=splat.flax.attention_fn(splat.masks.sliding_window(8, 0)),
  ...     rngs=nnx.Rngs(0))
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

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
        ``mask`` that varies along the query axis), False raises
        ``ValueError`` naming it; True runs ``flax.nnx.dot_product_attention``
        with the layer's ``mask`` (as a dense array) instead and warns once.

    Returns:
      ``fn(query, key, value, bias=None, mask=None, broadcast_dropout=True,
      dropout_rng=None, dropout_rate=0.0, deterministic=False, dtype=None,
      precision=None, module=None, promote_dtype=..., is_causal=False)`` with
      ``query: [batch..., q_len, heads, head_dim]``, ``key``/``value``:
      ``[batch..., kv_len, kv_heads, head_dim]``; returns
      ``[batch..., q_len, heads, head_dim]``. Call-time ``mask`` and
      ``is_causal`` are intersected with ``mask`` (a traced key padding
      mask ``[batch..., 1, 1, kv_len]`` at run time); a decode step
      (``decode=True``) applies ``mask`` at the cached token's position;
      further keywords are honoured or refused as :mod:`splat._call_args`
      lists. A query row left with no key outputs 0 (flax's dense attention
      would give mean(V) there). Each call (each trace, under ``jit``) leaves
      a :class:`splat.CallRecord` (``front_end="flax.attention_fn"``) in
      :func:`splat.call_log` and :func:`splat.call_counts`, also when it raises.

    Example:
      >>> import flax.nnx as nnx, jax.numpy as jnp, splat, splat.flax
      >>> mha = nnx.MultiHeadAttention(num_heads=2, in_features=16, decode=True,
      ...     attention_fn=splat.flax.attention_fn(splat.masks.sliding_window(7, 0)),
      ...     rngs=nnx.Rngs(0))
      >>> mha.init_cache((1, 32, 16))
      >>> y = mha(jnp.ones((1, 1, 16)))   # token 0; the next call is token 1, ...
      >>> y.shape
      (1, 1, 16)
    """
    from splat._call_args import CallChecker

    dense_name = "flax.nnx.dot_product_attention"
    checker = CallChecker("splat.flax.attention_fn", mask, backend, fallback=fallback, dense_name=dense_name)

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
        **extra,
    ):
        def dense():
            import flax.nnx as nnx
            import jax.numpy as jnp

            kw = {} if promote_dtype is None else {"promote_dtype": promote_dtype}
            own = checker.own_mask_dense(query, key, call)  # the layer's mask: dense attention lacks it
            m = own if mask is None else mask if own is None else jnp.logical_and(mask, own)
            return nnx.dot_product_attention(
                query, key, value, bias, m, broadcast_dropout, dropout_rng, dropout_rate,
                deterministic, dtype, precision, module, is_causal=is_causal, **kw,
            )  # fmt: skip

        call_mask = mask
        if call_mask is not None and getattr(getattr(call_mask, "dtype", None), "name", None) != "bool":
            call_mask = call_mask.astype(bool)  # flax masks may be 0/1 floats: nonzero attends
        call_dtype = dtype
        if call_dtype is None and not (query.dtype == key.dtype == value.dtype):
            import jax.numpy as jnp

            call_dtype = jnp.result_type(query, key, value)  # flax promotes q, k, v to one dtype
        call = dict(
            bias=bias,
            mask=call_mask,
            dropout_rate=dropout_rate,
            deterministic=deterministic,
            dtype=call_dtype,
            module=module,
            is_causal=is_causal,
            **extra,
        )
        return checker(query, key, value, call, dict.fromkeys(extra), dense)

    fn.splat_mask = mask
    return fn
