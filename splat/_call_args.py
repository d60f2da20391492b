"""The arguments of a dense attention call, checked once: shared by ``@sparse_attention`` and the Flax hook.

Both front ends receive calls shaped like ``jax.nn.dot_product_attention`` (and Flax's
``attention_fn``): ``query, key, value`` of layout ``[batch..., S, H, D]``, then keywords.
:class:`CallChecker` decides, once per call, what splat honours and what it must refuse.

Honoured:

- ``mask`` (boolean, ``[batch..., heads, q_len, kv_len]`` with any axis broadcast):

  * constant at trace time and the same for every batch row and head: ``&`` the front end's own
    mask, as part of the static mask;
  * otherwise (traced, or differing across batch rows) it must vary along the key axis only
    (``[batch..., 1, 1, kv_len]``, a key padding mask, as Flax's decode mask is): it becomes
    per-row key ids (``kv_segment_ids``), applied at run time. Refused: such a mask that varies
    along the query axis, or a traced one that varies across heads;

- *a decode step*: a single query against a longer key sequence (``q_len == 1 < kv_len``, Flax's
  ``decode=True``: the query is the newest token, the keys the whole cache) that comes with a
  ``mask`` or ``key_value_seq_lengths``. The query sits at the last key the mask lets it see
  (Flax's decode mask ``arange(max_length) <= cache_index`` makes that the cache index), or at
  ``key_value_seq_lengths - 1``; the static mask is applied at that row (``q_offset``) and keys
  past it are not seen (``key_value_seq_lengths``). A decode step whose mask hides the query's
  own key (a padded query) places the query at an earlier position: its output is then as
  meaningless as the padded token;
- ``is_causal``: ``& masks.causal()``;
- ``local_window_size``: ``& masks.sliding_window(left, right)``; an int ``w`` means ``(w, w)``;
- ``query_seq_lengths``, ``key_value_seq_lengths`` (int ``[batch...]``): as in
  :func:`splat.attention` (query rows past the length output 0, keys past it are not seen);
- ``scale`` (default ``1 / sqrt(D)``) and ``dtype`` (q, k, v are cast to it);
- ``implementation``, ``precision``, ``promote_dtype``, ``broadcast_dropout``, ``dropout_rng``,
  ``deterministic``: no effect (splat picks its own kernels and accumulates in float32; the
  dropout arguments matter only with dropout).

Refused: ``bias`` (an additive bias), ``dropout_rate`` > 0 unless ``deterministic``, ``module``
(sowing the weights needs the dense weights), ``return_residual``, and any other argument that
differs from its default.

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
import jax.numpy as jnp
import numpy as np

from jax_bindings import check_backend
from splat import _attention, _call_log, _runtime_args, masks
from splat._analyzer import analyze

__all__ = [
    "DOT_PRODUCT_ATTENTION_ARGS",
    "CallChecker",
    "SparseAttentionFallbackWarning",
    "Unsupported",
    "base_mask",
    "combine_call_masks",
    "key_validity",
    "mask_from_array",
    "refusals",
    "runtime_args",
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
    if isinstance(mask, masks.Mask):
        parts.append(mask)
    elif mask is not None:
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
# run-time arguments: key padding masks, lengths, the position of a decode step
# -----------------------------------------------------------------------------


def _lengths(name: str, x, batch: tuple[int, ...]) -> jax.Array | None:
    """``query_seq_lengths`` / ``key_value_seq_lengths`` as int32 ``[prod(batch)]`` (None stays None)."""
    if x is None:
        return None
    a = jnp.asarray(x)
    if not jnp.issubdtype(a.dtype, jnp.integer):
        raise ValueError(f"`{name}` must be an int array [batch...], got dtype {a.dtype}")
    b = math.prod(batch)
    if a.ndim == 0:
        return jnp.full((b,), a, jnp.int32)
    if tuple(a.shape) not in (batch, (b,)):
        raise ValueError(f"`{name}` must have shape {batch} (one length per batch row), got {tuple(a.shape)}")
    return a.reshape(b).astype(jnp.int32)


def key_validity(mask, batch: tuple[int, ...], q_len: int, kv_len: int) -> jax.Array:
    """A call ``mask`` that varies along the key axis only, as ``valid: bool [prod(batch), kv_len]``.

    Args:
      mask: boolean, broadcastable to ``[batch..., heads, q_len, kv_len]``; traced or concrete.
      batch: the batch axes of the call.
      q_len, kv_len: the attention's lengths.

    Raises:
      Unsupported: the mask varies along the query axis (with ``q_len > 1``) or across heads.
      ValueError: wrong dtype or shape.
    """
    traced = _is_tracer(mask)
    shape = tuple(mask.shape)
    if np.dtype(mask.dtype) != np.bool_:
        raise ValueError(f"`mask` must be a boolean array, got dtype {mask.dtype}")
    if len(shape) < 2:
        raise ValueError(
            f"`mask` must be broadcastable to [batch..., heads, q_len, kv_len], got shape {shape}"
        )
    if shape[-2] not in (1, q_len) or shape[-1] not in (1, kv_len):
        raise ValueError(f"`mask` of shape {shape} does not broadcast to [..., {q_len}, {kv_len}]")
    what = "is a traced array" if traced else "differs across batch rows"
    if shape[-2] != 1:
        raise Unsupported(
            f"`mask` {what} and varies along the query axis (splat takes such a mask only when it is "
            "constant at trace time and the same for every batch row and head; at run time it takes a "
            "key padding mask [batch..., 1, 1, kv_len])"
        )
    m = mask[..., 0, :]
    if len(shape) >= 3:
        if shape[-3] != 1:
            if traced:
                raise Unsupported("`mask` is a traced per-head array (splat uses one mask for all heads)")
            a = np.asarray(m)
            if not (a == a[..., :1, :]).all():
                raise Unsupported("`mask` differs across heads (splat uses one mask for all heads)")
        m = m[..., 0, :]
    while m.ndim > len(batch) + 1 and m.shape[0] == 1:
        m = m[0]
    try:
        m = jnp.broadcast_to(m, batch + (kv_len,))
    except ValueError:
        raise ValueError(f"`mask` of shape {shape} does not broadcast to the batch axes {batch}") from None
    return m.reshape(math.prod(batch), kv_len)


def _is_decode(q_len: int, kv_len: int, mask, kv_lens) -> bool:
    """Whether a call is a decode step: one query against longer keys, with a mask or lengths to place it."""
    return q_len == 1 < kv_len and (mask is not None or kv_lens is not None)


def _decode_position(valid: jax.Array | None, kv_lens: jax.Array | None, b: int, kv_len: int) -> jax.Array:
    """A decode step's query position, int32 ``[b]``: the last key it may see (-1: none)."""
    last = jnp.full((b,), kv_len - 1, jnp.int32) if kv_lens is None else jnp.minimum(kv_lens, kv_len) - 1
    if valid is not None:
        seen = jnp.where(valid, jnp.arange(kv_len, dtype=jnp.int32), -1)
        last = jnp.minimum(last, jnp.max(seen, axis=1))
    return last


def runtime_args(
    call: Mapping[str, Any], batch: tuple[int, ...], q_len: int, kv_len: int
) -> tuple[Any, dict[str, jax.Array], bool]:
    """Splits a call into its static ``mask`` part and :func:`splat.attention`'s run-time arguments.

    Returns:
      ``(static_mask, runtime, decode)``: the call ``mask`` as a Mask when it belongs to the
      static mask (else None); ``segment_ids``, ``kv_segment_ids``, ``query_seq_lengths``,
      ``key_value_seq_lengths`` and ``q_offset`` as present, each ``[prod(batch), ...]`` int32;
      whether the call is a decode step (the static mask then has ``kv_len`` rows).

    Raises:
      Unsupported, ValueError: as :func:`key_validity`, :func:`mask_from_array`.
    """
    mask = call.get("mask")
    q_lens = _lengths("query_seq_lengths", call.get("query_seq_lengths"), batch)
    kv_lens = _lengths("key_value_seq_lengths", call.get("key_value_seq_lengths"), batch)
    decode = _is_decode(q_len, kv_len, mask, kv_lens)
    static, valid = None, None
    if mask is not None:
        if decode or _is_tracer(mask):
            valid = key_validity(mask, batch, q_len, kv_len)
        else:
            try:
                static = mask_from_array(mask, q_len, kv_len)
            except Unsupported:  # differs across batch or heads: a key padding mask still works
                if mask.shape[-2] != 1:
                    raise
                valid = key_validity(mask, batch, q_len, kv_len)
    b = math.prod(batch)
    runtime = {}
    if valid is not None:
        # one segment for the queries; padded keys in another (non-decreasing for a prefix: the fast case)
        runtime["segment_ids"] = jnp.zeros((b, q_len), jnp.int32)
        runtime["kv_segment_ids"] = jnp.where(valid, 0, 1).astype(jnp.int32)
    if decode:
        last = _decode_position(valid, kv_lens, b, kv_len)
        runtime["q_offset"] = jnp.maximum(last, 0)
        kv_lens = last + 1
    if q_lens is not None:
        runtime["query_seq_lengths"] = q_lens
    if kv_lens is not None:
        runtime["key_value_seq_lengths"] = kv_lens
    return static, runtime, decode


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
        self.front_end = who.removeprefix("splat.")  # as call records name it
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

        Every call leaves one :class:`splat.CallRecord` (:mod:`splat._call_log`): "splat",
        "fallback" with the reasons, or "error" with the exception, written before it propagates.
        """
        info: dict[str, Any] = {"q": query, "k": key, "backend": self.backend}
        try:
            out, outcome = self._run(query, key, value, call, defaults, dense, info)
        except Exception as e:
            _call_log.record(self.front_end, "error", **(info | {"reason": _call_log.error_message(e)}))
            raise
        _call_log.record(self.front_end, outcome, **info)
        return out

    def _run(self, query, key, value, call, defaults, dense, info: dict[str, Any]) -> tuple[Any, str]:
        """:meth:`__call__`'s work: ``(output, outcome)``; fills ``info`` for the call's record."""
        reasons = refusals(call, defaults)
        batch = _batch_axes(query, key, value)
        q_len, kv_len = query.shape[-3], key.shape[-3]
        info["decode"] = _is_decode(q_len, kv_len, call.get("mask"), call.get("key_value_seq_lengths"))
        info["mask"] = self.base
        mask, runtime, rows = None, {}, q_len
        if not reasons:
            try:
                static, runtime, decode = runtime_args(call, batch, q_len, kv_len)
                rows = kv_len if decode else q_len  # a decode step: the static mask at its row q_offset
                mask = combine_call_masks(
                    self._base(rows, kv_len),
                    rows,
                    kv_len,
                    mask=static,
                    is_causal=call.get("is_causal", False),
                    local_window_size=call.get("local_window_size"),
                )
            except Unsupported as e:
                reasons.append(str(e))
        if reasons:
            info["reason"] = "; ".join(reasons)
            return self._refuse(reasons, dense), "fallback"
        info["mask"], info["decode"] = mask, decode
        b = math.prod(batch)  # [batch..., S, H, D] -> [B, S, H, D]
        q, k, v = (x.reshape((b, *x.shape[-3:])) for x in (query, key, value))
        dtype = call.get("dtype")
        if dtype is not None:
            q, k, v = q.astype(dtype), k.astype(dtype), v.astype(dtype)
        q, k, v, scale = _attention._check_qkv(q, k, v, call.get("scale"))
        rt = _runtime_args.runtime_mask(b, q_len, kv_len, **runtime) if runtime else None
        out = _attention._attend(q, k, v, analyze(mask, rows, kv_len), scale, self.backend, runtime=rt)
        return out.reshape(batch + out.shape[1:]), "splat"

    def own_mask_dense(self, query, key, call: Mapping[str, Any]):
        """The front end's own mask as a dense boolean array, for a dense fallback that lacks it.

        Returns:
          None without an own mask; else ``[q_len, kv_len]``, or at a decode step (see the module
          docstring) the row at the query's position, ``[batch..., 1, 1, kv_len]``; the position
          is read off the call's ``mask`` (any head) and ``key_value_seq_lengths``.
        """
        if self.base is None and self._base_array is None:
            return None
        batch = tuple(query.shape[:-3])
        q_len, kv_len = query.shape[-3], key.shape[-3]
        mask = call.get("mask")
        kv_lens = _lengths("key_value_seq_lengths", call.get("key_value_seq_lengths"), batch)
        rows = kv_len if _is_decode(q_len, kv_len, mask, kv_lens) else q_len
        i, j = np.arange(rows)[:, None], np.arange(kv_len)[None, :]
        own = np.asarray(self._base(rows, kv_len)(i, j), bool)
        if rows == q_len:
            return own
        valid = None
        if mask is not None:
            m = jnp.asarray(mask, bool)
            m = m.any(axis=tuple(range(max(m.ndim - 3, 0), m.ndim - 1)))  # heads, queries -> [lead..., kv]
            while m.ndim > len(batch) + 1 and m.shape[0] == 1:
                m = m[0]
            valid = jnp.broadcast_to(m, batch + (kv_len,)).reshape(-1, kv_len)
        pos = jnp.maximum(_decode_position(valid, kv_lens, math.prod(batch), kv_len), 0)
        return jnp.take(jnp.asarray(own), pos, axis=0).reshape(batch + (1, 1, kv_len))

    def _refuse(self, reasons: list[str], dense: Callable[[], Any]):
        msg = "; ".join(reasons)
        if not self.fallback:
            raise ValueError(
                f"{self.who}: {msg}. Remove it, or pass fallback=True to run {self.dense_name} instead"
            )
        if msg not in self._warned:
            self._warned.add(msg)
            warnings.warn(
                f"{self.who}: {msg}; running {self.dense_name}", SparseAttentionFallbackWarning, stacklevel=5
            )
        return dense()
