"""The backend seam: backend selection, ``custom_vjp`` wrappers, vmap folding.

Backend contract
================

A backend is a module exposing exactly the functions below. Every one is a
pure function of jax arrays plus two static arguments, ``layout`` (an
:class:`acsr.ACSR`, hashable, sizes ``q_len = Sq`` and ``kv_len = Skv``) and
``scale`` (a positive Python float). ``G = H // Hk`` query heads share one KV
head: query head ``h`` reads KV head ``h // G``. ``N = layout.nnz_max``.

Backends need not support ``jax.vmap`` nor be differentiable: this module
wraps each call in ``jax.custom_batching.custom_vmap`` (a vmapped axis is
folded into ``B``, since every op is independent per batch row) and the
public ops in ``jax.custom_vjp`` (the rules call the ``*_bwd`` functions).
They must work under ``jax.jit`` (shapes are static; call at trace time).

Dtypes: ``q, k, v`` share one dtype in {float32, bfloat16, float16}; compute
and accumulate in float32 and return results in the input dtype unless said
otherwise. A fully masked row (no column in ``layout``) has output 0, lse
``-inf``, and zero gradients; no NaN may appear in any output.

Fused attention
---------------

``attention_fwd(q, k, v, layout, scale) -> (out, lse)``
    ``q: [B, Sq, H, D]``, ``k, v: [B, Skv, Hk, D]``.
    ``out: [B, Sq, H, D]`` in ``q.dtype``: ``softmax(scale * q k^T | mask) v``.
    ``lse: [B, H, Sq]`` float32: ``log sum_j exp(scale * q_i . k_j)`` over the
    row's mask columns (natural log, scale applied); ``-inf`` for empty rows.

``attention_bwd(q, k, v, out, lse, dout, layout, scale) -> (dq, dk, dv)``
    ``out``/``lse`` as returned by ``attention_fwd`` (any backend's: the
    meaning is fixed above), ``dout: [B, Sq, H, D]``. Returns gradients with
    the shapes and dtypes of ``q, k, v``. ``lse`` may contain ``-inf``.

Unfused ops (padded value arrays ``[B, H, Sq, N]``, slots as in
:mod:`acsr._format`; padding slots hold 0 in outputs and are ignored in inputs)
---------------------------------------------------------------------------

``sddmm(q, k, layout) -> scores``
    ``scores: [B, H, Sq, N]`` in ``q.dtype``: ``q_i . k_col(i, t)`` (no scale).
``sddmm_bwd(q, k, dscores, layout) -> (dq, dk)``
    ``dscores: [B, H, Sq, N]``; gradients shaped like ``q``, ``k``.
``softmax(scores, layout, scale) -> probs``
    ``probs: [B, H, Sq, N]`` in ``scores.dtype``: softmax of ``scale * scores``
    over each row's valid slots; padding slots and empty rows give 0.
``softmax_bwd(probs, dprobs, layout, scale) -> dscores``
    From the forward *output* ``probs`` and its cotangent ``dprobs``;
    ``dscores`` in ``probs.dtype``, 0 at padding slots.
``spmm(probs, v, layout) -> out``
    ``probs: [B, H, Sq, N]``, ``v: [B, Skv, Hk, D]``; ``out: [B, Sq, H, D]`` in
    ``v.dtype``: ``sum_t probs[., h, i, t] v[., col(i, t), h // G]``.
``spmm_bwd(probs, v, dout, layout) -> (dprobs, dv)``
    ``dout: [B, Sq, H, D]``; ``dprobs`` like ``probs`` (0 at padding), ``dv``
    like ``v``.

A backend that cannot handle a particular call (a head dim, a layout) raises
``NotImplementedError`` at trace time; under ``backend="auto"`` the call then
falls back to the ``"jax"`` backend. Backends: ``"jax"`` =
:mod:`jax_bindings._pure`, ``"triton"`` = :mod:`jax_bindings._triton`
(imported lazily, only when selected).
"""

from __future__ import annotations

import functools
import importlib
import warnings
from types import ModuleType

import jax
import jax.numpy as jnp

from acsr import ACSR

BACKENDS = ("auto", "jax", "triton")
_MODULES = {"jax": "jax_bindings._pure", "triton": "jax_bindings._triton"}
_OPS = (
    "attention_fwd",
    "attention_bwd",
    "sddmm",
    "sddmm_bwd",
    "softmax",
    "softmax_bwd",
    "spmm",
    "spmm_bwd",
)


class BackendUnavailableError(RuntimeError):
    """``backend="triton"`` was asked for explicitly but cannot run here."""


@functools.cache
def _import(name: str) -> ModuleType:
    mod = importlib.import_module(_MODULES[name])
    missing = [op for op in _OPS if not callable(getattr(mod, op, None))]
    if missing:
        raise NotImplementedError(f"backend module {mod.__name__} lacks {', '.join(missing)}")
    return mod


def check_backend(backend) -> str:
    """Validates a ``backend=`` argument; returns it."""
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return backend


def resolve(backend: str) -> str:
    """The concrete backend name ("jax" or "triton") for a ``backend=`` argument.

    ``"auto"`` is ``"triton"`` when ``jax.default_backend() == "gpu"`` and the
    triton backend imports, else ``"jax"``. ``"triton"`` given explicitly raises
    :class:`BackendUnavailableError` when it cannot be imported.
    """
    check_backend(backend)
    if backend == "jax":
        return "jax"
    if backend == "triton":
        try:
            _import("triton")
        except (ImportError, NotImplementedError) as e:
            raise BackendUnavailableError(
                f'backend="triton" was requested but cannot be used here: {e}. '
                'It needs a CUDA GPU with triton and jax_triton installed; use backend="jax" '
                'or backend="auto" to run the pure-JAX implementation.'
            ) from e
        return "triton"
    if jax.default_backend() != "gpu":
        return "jax"
    try:
        _import("triton")
    except (ImportError, NotImplementedError) as e:
        _warn_fallback(str(e))
        return "jax"
    return "triton"


@functools.cache
def _warn_fallback(reason: str) -> None:
    warnings.warn(
        f'backend="auto" on a GPU falls back to the pure-JAX backend: the triton backend is '
        f"unavailable ({reason})",
        RuntimeWarning,
        stacklevel=4,
    )


def _call(backend: str, op: str, *args):
    """The one point where an op reaches a backend (and "auto" falls back)."""
    if backend == "auto-triton":
        try:
            return getattr(_import("triton"), op)(*args)
        except NotImplementedError as e:
            _warn_fallback(f"{op}: {e}")
            return getattr(_import("jax"), op)(*args)
    return getattr(_import(backend), op)(*args)


# -----------------------------------------------------------------------------
# vmap folding: a vmapped axis becomes part of the batch axis B
# -----------------------------------------------------------------------------


def _folded(backend: str, op: str, static: tuple, n_arrays: int):
    """``op`` as a ``custom_vmap`` function of its array arguments.

    Every contract op is independent per batch row and has ``B`` at axis 0 of
    each array in and out, so a vmapped axis (moved to axis 0 by custom_vmap)
    is merged into ``B``; unbatched arguments are broadcast.
    """

    @jax.custom_batching.custom_vmap
    def f(*arrays):
        return _call(backend, op, *arrays, *static)

    @f.def_vmap
    def rule(axis_size, in_batched, *arrays):
        flat = []
        for x, bat in zip(arrays, in_batched, strict=True):
            if not bat:
                x = jnp.broadcast_to(x, (axis_size, *x.shape))
            flat.append(x.reshape(axis_size * x.shape[1], *x.shape[2:]))
        out = f(*flat)
        unfold = lambda y: y.reshape(axis_size, y.shape[0] // axis_size, *y.shape[1:])
        out = jax.tree.map(unfold, out)
        return out, jax.tree.map(lambda _: True, out)

    return f


def _op(backend: str, op: str, *args, static: tuple = ()):
    return _folded(backend, op, static, len(args))(*args)


# -----------------------------------------------------------------------------
# differentiable ops (custom_vjp outside, custom_vmap inside)
# -----------------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _attention(q, k, v, layout: ACSR, scale: float, backend: str):
    return _op(backend, "attention_fwd", q, k, v, static=(layout, scale))[0]


def _attention_fwd(q, k, v, layout, scale, backend):
    out, lse = _op(backend, "attention_fwd", q, k, v, static=(layout, scale))
    return out, (q, k, v, out, lse)


def _attention_bwd(layout, scale, backend, res, dout):
    q, k, v, out, lse = res
    return _op(backend, "attention_bwd", q, k, v, out, lse, dout, static=(layout, scale))


_attention.defvjp(_attention_fwd, _attention_bwd)


def _attention_with_lse_impl(q, k, v, layout, scale, backend):
    return _op(backend, "attention_fwd", q, k, v, static=(layout, scale))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _sddmm(q, k, layout: ACSR, backend: str):
    return _op(backend, "sddmm", q, k, static=(layout,))


def _sddmm_fwd(q, k, layout, backend):
    return _sddmm(q, k, layout, backend), (q, k)


def _sddmm_bwd(layout, backend, res, ds):
    q, k = res
    return _op(backend, "sddmm_bwd", q, k, ds, static=(layout,))


_sddmm.defvjp(_sddmm_fwd, _sddmm_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _softmax(scores, layout: ACSR, scale: float, backend: str):
    return _op(backend, "softmax", scores, static=(layout, scale))


def _softmax_fwd(scores, layout, scale, backend):
    p = _softmax(scores, layout, scale, backend)
    return p, p


def _softmax_bwd(layout, scale, backend, p, dp):
    return (_op(backend, "softmax_bwd", p, dp, static=(layout, scale)),)


_softmax.defvjp(_softmax_fwd, _softmax_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _spmm(probs, v, layout: ACSR, backend: str):
    return _op(backend, "spmm", probs, v, static=(layout,))


def _spmm_fwd(probs, v, layout, backend):
    return _spmm(probs, v, layout, backend), (probs, v)


def _spmm_bwd(layout, backend, res, dout):
    probs, v = res
    return _op(backend, "spmm_bwd", probs, v, dout, static=(layout,))


_spmm.defvjp(_spmm_fwd, _spmm_bwd)


def _concrete(backend: str) -> str:
    """The name ``_call`` understands: "jax", "triton", or "auto-triton" (triton, falling back)."""
    name = resolve(backend)
    return "auto-triton" if (backend == "auto" and name == "triton") else name


# Jitted entry points: static layout (hashable by value), scale and backend, so
# eager calls compile once per layout and calls under an outer jit are inlined.
_attention_jit = jax.jit(_attention, static_argnums=(3, 4, 5))
_attention_with_lse_jit = jax.jit(_attention_with_lse_impl, static_argnums=(3, 4, 5))
_sddmm_jit = jax.jit(_sddmm, static_argnums=(2, 3))
_softmax_jit = jax.jit(_softmax, static_argnums=(1, 2, 3))
_spmm_jit = jax.jit(_spmm, static_argnums=(2, 3))


def attention(q, k, v, layout: ACSR, scale: float, backend: str = "auto"):
    """Fused sparse attention ``[B, Sq, H, D]``; differentiable in q, k, v. No input checks."""
    return _attention_jit(q, k, v, layout, float(scale), _concrete(backend))


def attention_with_lse(q, k, v, layout: ACSR, scale: float, backend: str = "auto"):
    """``(out, lse)`` of the fused forward, not differentiable (for inspection and tests)."""
    return _attention_with_lse_jit(q, k, v, layout, float(scale), _concrete(backend))


def sddmm(q, k, layout: ACSR, backend: str = "auto"):
    """Differentiable SDDMM (see the contract). No input checks."""
    return _sddmm_jit(q, k, layout, _concrete(backend))


def softmax(scores, layout: ACSR, scale: float, backend: str = "auto"):
    """Differentiable ACSR-row softmax (see the contract). No input checks."""
    return _softmax_jit(scores, layout, float(scale), _concrete(backend))


def spmm(probs, v, layout: ACSR, backend: str = "auto"):
    """Differentiable SpMM (see the contract). No input checks."""
    return _spmm_jit(probs, v, layout, _concrete(backend))
