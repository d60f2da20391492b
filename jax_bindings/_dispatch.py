"""The backend seam: backend selection, ``custom_vjp`` wrappers, vmap folding.

Backend contract
================

A backend is a module exposing the functions below. Every one is a
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

``attention_fwd(q, k, v, runtime, layout, scale, soft_cap) -> (out, lse)``
    ``q: [B, Sq, H, D]``, ``k, v: [B, Skv, Hk, D]``; ``runtime``: a
    :class:`~jax_bindings._runtime.RuntimeMask` (arrays, ``B`` at axis 0) AND-ed
    with ``layout``, or None; ``soft_cap``: a positive float, or None: scores
    ``z = scale * q . k`` become ``soft_cap * tanh(z / soft_cap)`` before
    masking.
    ``out: [B, Sq, H, D]`` in ``q.dtype``: ``softmax(scale * q k^T | mask) v``.
    ``lse: [B, H, Sq]`` float32: ``log sum_j exp(z_ij)`` over the row's mask
    columns (natural log, scale and soft cap applied); ``-inf`` for empty rows.
    A backend that cannot take a ``runtime`` (or a part of it, such as
    ``q_pos``) or a ``soft_cap`` refuses the call (below).

``attention_bwd(q, k, v, runtime, out, lse, dout, layout, scale, soft_cap) -> (dq, dk, dv)``
    ``out``/``lse`` as returned by ``attention_fwd`` (any backend's: the
    meaning is fixed above), ``dout: [B, Sq, H, D]``. Returns gradients with
    the shapes and dtypes of ``q, k, v``. ``lse`` may contain ``-inf``. ``runtime``
    gets no gradient.

Paged KV cache (decode, forward only)
-------------------------------------

``attention_paged(q, k_pages, v_pages, page_table, runtime, layout, scale, soft_cap) -> out``
    ``q: [B, Sq, H, D]``; ``k_pages, v_pages: [P, page_size, Hk, D]``, a page
    pool shared by the batch rows; ``page_table: int32 [B, max_pages]``:
    logical key ``j`` of row ``b`` lives at ``k_pages[page_table[b, j //
    page_size], j % page_size]``. ``layout``: ``(L, L)``, ``L = max_pages *
    page_size``; ``runtime``: a RuntimeMask with ``q_pos`` (always), ``kv_len``
    (the cache lengths) and ids over logical key positions (``[B, L]``).
    ``out: [B, Sq, H, D]`` in ``q.dtype``, as ``attention_fwd``'s ``out`` over
    the gathered keys. A page id outside ``[0, P)`` hides its keys (they are
    not seen, and nothing is read out of bounds). Forward only (serving): the
    dispatcher makes ``jax.grad`` through it raise; no backward op exists. A
    vmapped axis folds into ``B`` for ``q``, ``page_table`` and ``runtime``;
    an unbatched page pool is shared, a batched one ``[V, P, ...]`` becomes
    ``[V * P, ...]`` with the page table offset by ``v * P``.

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

Declaring a backend, and refusing a call
----------------------------------------

A backend is one module defining every function above plus one
:class:`~jax_bindings._registry.Backend` entry in
:data:`jax_bindings._registry.ENTRIES`: its name (the ``backend=`` value), the
module path (imported on first use, only on the platforms the entry names), a
one-line description, and those platforms. A module whose requirements are
missing raises ImportError on import; :func:`available_backends` reports it.

Grid layouts (``layout.grid``, N-D neighborhoods: :mod:`acsr._grid`) reach a backend's op
only where the module lists the op in ``GRID_OPS``; elsewhere the dispatcher passes
``layout.flat``, the same mask as segments and residual.

A module may also define ``attention(q, k, v, runtime, layout, scale, soft_cap) -> out``: a fused
attention that JAX differentiates and batches by itself (a call of
``jax.nn.dot_product_attention``, say). Where it does, the differentiable
:func:`attention` calls it as it is, with no ``custom_vjp`` or ``custom_vmap``
around it, and ``attention_fwd`` serves only :func:`attention_with_lse`.

A backend refuses a call it cannot take (a head dim, a dtype, a mask, a
platform) by raising ``NotImplementedError("<why>")`` at trace time, and for
that raises nothing else. ``backend="auto"`` tries the backends available here
in the order of :func:`jax_bindings._registry.auto_order` (the tuning store's
ranking for the fused ops, ``"jax"`` last: it takes every call) and moves to
the next one only on ``NotImplementedError``; any other exception is a bug and
reaches the caller. Each op is placed on its own: a backward op goes to the
first backend, from the forward's onward, that takes it (``out``/``lse`` mean
the same from every backend). Landing on ``"jax"`` when a backend meant for
this platform refused or could not load warns once per reason. A backend named
explicitly gets no fallback: its ``NotImplementedError`` reaches the caller,
and :class:`BackendUnavailableError` says why it cannot run here at all.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp

from acsr import ACSR
from jax_bindings import _registry
from jax_bindings._registry import (
    BACKENDS,
    FALLBACK,
    BackendUnavailableError,
    available_backends,
    check_backend,
)

__all__ = [
    "BACKENDS",
    "BackendUnavailableError",
    "attention",
    "attention_paged",
    "attention_with_lse",
    "available_backends",
    "check_backend",
    "sddmm",
    "selected_backend",
    "softmax",
    "spmm",
]

# op -> (array arguments, static arguments), as the public functions below take them ("runtime": a
# RuntimeMask pytree or None; "soft_cap": a float or None)
_SIGNATURES = {
    "attention": (("q", "k", "v", "runtime"), ("layout", "scale", "soft_cap")),
    "attention_with_lse": (("q", "k", "v", "runtime"), ("layout", "scale", "soft_cap")),
    "attention_paged": (
        ("q", "k_pages", "v_pages", "page_table", "runtime"),
        ("layout", "scale", "soft_cap"),
    ),
    "sddmm": (("q", "k"), ("layout",)),
    "softmax": (("scores",), ("layout", "scale")),
    "spmm": (("probs", "v"), ("layout",)),
}


# -----------------------------------------------------------------------------
# the one call point: the backends to try, and trying them
# -----------------------------------------------------------------------------


def _order(op: str, backend: str, arrays: tuple, static: tuple) -> tuple[str, ...]:
    """The backends to try for this call, in order (outside jit: the tuple is a static argument)."""
    check_backend(backend)
    if backend != "auto":
        why = _registry.unavailable(backend)
        if why is not None:
            raise BackendUnavailableError(
                f'backend="{backend}" was requested but cannot be used here: {why}. Use backend="auto" '
                f'to run the best backend available here, or backend="{FALLBACK}" (every platform).'
            )
        return (backend,)
    head_dim = arrays[0].shape[-1] if op in _registry.RANKED_OPS else None  # q: [B, Sq, H, D]
    return _registry.auto_order(op, static[0], head_dim, arrays[0].dtype)


def _first(names: tuple[str, ...], what: str, run, *, auto: bool = False, quiet: bool = False):
    """``(name, run(i))`` for the first ``names[i]`` that does not refuse (NotImplementedError).

    Only ``NotImplementedError`` moves on; the last name's refusal (an explicit
    backend's, the only name then) reaches the caller, with a note. Landing on
    the pure-JAX backend after a refusal, or under "auto" while a backend meant
    for this platform cannot load, warns unless ``quiet``.
    """
    refused = []
    for i, name in enumerate(names):
        try:
            result = run(i)
        except NotImplementedError as e:
            if i < len(names) - 1:
                refused.append(f"{name}: {e}")
                continue
            if refused:
                e.add_note(f"every backend refused {what}: " + "; ".join(refused))
            else:
                e.add_note(f'backend "{name}" refused {what}; only backend="auto" moves on to another one')
            raise
        if name == FALLBACK and not quiet:
            _warn_fallback(what, refused, auto)
        return name, result
    raise ValueError(f"no backend to try for {what}")


def _warn_fallback(what: str, refused: list[str], auto: bool) -> None:
    """Warns once per reason: the pure-JAX backend runs though another backend was meant to."""
    unavailable = [f"{n}: {why}" for n, why in _registry.unavailable_here().items()] if auto else []
    if refused or unavailable:
        reasons = "; ".join(refused + unavailable)
        _warn_once(f'backend="auto" falls back to the pure-JAX backend for {what}: {reasons}')


@functools.cache
def _warn_once(message: str) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=5)


def _call(name: str, op: str, *args):
    """Contract function ``op`` of backend ``name``; a grid layout reaches it as its
    ``layout.flat`` rows unless the backend lists ``op`` in its ``GRID_OPS``."""
    module = _registry.module(name)
    if op not in getattr(module, "GRID_OPS", ()):
        args = tuple(a.flat if isinstance(a, ACSR) else a for a in args)
    return getattr(module, op)(*args)


# -----------------------------------------------------------------------------
# vmap folding: a vmapped axis becomes part of the batch axis B
# -----------------------------------------------------------------------------


def _folded(name: str, op: str, static: tuple):
    """``op`` of backend ``name`` as a ``custom_vmap`` function of its array arguments.

    Every contract op is independent per batch row and has ``B`` at axis 0 of
    each array in and out, so a vmapped axis (moved to axis 0 by custom_vmap)
    is merged into ``B``; unbatched arguments are broadcast.
    """

    @jax.custom_batching.custom_vmap
    def f(*arrays):
        return _call(name, op, *arrays, *static)

    def fold(axis_size, x, batched):
        if not batched:
            x = jnp.broadcast_to(x, (axis_size, *x.shape))
        return x.reshape(axis_size * x.shape[1], *x.shape[2:])

    @f.def_vmap
    def rule(axis_size, in_batched, *arrays):
        # an argument may be a pytree (a RuntimeMask, None): fold each of its arrays
        flat = [
            jax.tree.map(functools.partial(fold, axis_size), x, bat)
            for x, bat in zip(arrays, in_batched, strict=True)
        ]
        out = f(*flat)
        unfold = lambda y: y.reshape(axis_size, y.shape[0] // axis_size, *y.shape[1:])
        out = jax.tree.map(unfold, out)
        return out, jax.tree.map(lambda _: True, out)

    return f


def _folded_paged(name: str, static: tuple):
    """``attention_paged`` of backend ``name`` as a ``custom_vmap`` function of its arrays.

    A vmapped axis folds into ``B`` for ``q``, ``page_table`` and ``runtime`` (unbatched ones
    broadcast). An unbatched page pool is shared by every mapped row; a batched one ``[V, P, ...]``
    (either pool: both are then taken per row) becomes ``[V * P, ...]`` and row ``v``'s page ids
    are offset by ``v * P``, ids outside ``[0, P)`` becoming -1 (still outside: still hidden).
    """

    @jax.custom_batching.custom_vmap
    def f(q, k_pages, v_pages, page_table, runtime):
        return _call(name, "attention_paged", q, k_pages, v_pages, page_table, runtime, *static)

    @f.def_vmap
    def rule(axis_size, in_batched, q, k_pages, v_pages, page_table, runtime):
        q_b, k_b, v_b, pt_b, rt_b = in_batched

        def fold(x, batched):
            if not batched:
                x = jnp.broadcast_to(x, (axis_size, *x.shape))
            return x.reshape(axis_size * x.shape[1], *x.shape[2:])

        if k_b or v_b:
            pools = []
            for x, batched in ((k_pages, k_b), (v_pages, v_b)):
                pools.append(x if batched else jnp.broadcast_to(x, (axis_size, *x.shape)))
            n_pages = pools[0].shape[1]
            pt = page_table if pt_b else jnp.broadcast_to(page_table, (axis_size, *page_table.shape))
            shift = (jnp.arange(axis_size, dtype=pt.dtype) * n_pages)[:, None, None]
            page_table = jnp.where((pt >= 0) & (pt < n_pages), pt + shift, -1)
            pt_b = True
            k_pages, v_pages = (x.reshape(axis_size * n_pages, *x.shape[2:]) for x in pools)
        runtime = jax.tree.map(fold, runtime, rt_b)
        out = f(fold(q, q_b), k_pages, v_pages, fold(page_table, pt_b), runtime)
        return out.reshape(axis_size, out.shape[0] // axis_size, *out.shape[1:]), True

    return f


PAGED_NOT_DIFFERENTIABLE = (
    "attention against a paged KV cache (splat.attention_with_kvcache with page_table=...) is "
    "forward only (serving) and has no gradient; for gradients use a contiguous cache "
    "(attention_with_kvcache without page_table, or splat.attention)"
)


@functools.partial(jax.custom_jvp, nondiff_argnums=(5, 6, 7, 8))
def _attention_paged(q, k_pages, v_pages, page_table, runtime, layout, scale, soft_cap, chain):
    static = (layout, scale, soft_cap)
    return _folded_paged(chain[0], static)(q, k_pages, v_pages, page_table, runtime)


@_attention_paged.defjvp
def _attention_paged_jvp(layout, scale, soft_cap, chain, primals, tangents):
    raise TypeError(PAGED_NOT_DIFFERENTIABLE)


def _op(name: str, op: str, *args, static: tuple = ()):
    return _folded(name, op, static)(*args)


def _backward(chain: tuple[str, ...], op: str, *args, static: tuple):
    """Backward op ``op`` on the first backend of ``chain`` (the forward's, then the rest) that takes it."""
    return _first(chain, op, lambda i: _op(chain[i], op, *args, static=static))[1]


# -----------------------------------------------------------------------------
# differentiable ops (custom_vjp outside, custom_vmap inside); ``chain`` is the
# forward's backend followed by those a backward op may fall back to
# -----------------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _attention_vjp(q, k, v, runtime, layout: ACSR, scale: float, soft_cap, chain: tuple[str, ...]):
    return _op(chain[0], "attention_fwd", q, k, v, runtime, static=(layout, scale, soft_cap))[0]


def _attention_fwd(q, k, v, runtime, layout, scale, soft_cap, chain):
    out, lse = _op(chain[0], "attention_fwd", q, k, v, runtime, static=(layout, scale, soft_cap))
    return out, (q, k, v, runtime, out, lse)


def _attention_bwd(layout, scale, soft_cap, chain, res, dout):
    q, k, v, runtime, out, lse = res
    static = (layout, scale, soft_cap)
    dq, dk, dv = _backward(chain, "attention_bwd", q, k, v, runtime, out, lse, dout, static=static)
    return dq, dk, dv, None  # the runtime mask's integer arrays get no gradient


_attention_vjp.defvjp(_attention_fwd, _attention_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _sddmm(q, k, layout: ACSR, chain: tuple[str, ...]):
    return _op(chain[0], "sddmm", q, k, static=(layout,))


def _sddmm_fwd(q, k, layout, chain):
    return _sddmm(q, k, layout, chain), (q, k)


def _sddmm_bwd(layout, chain, res, ds):
    q, k = res
    return _backward(chain, "sddmm_bwd", q, k, ds, static=(layout,))


_sddmm.defvjp(_sddmm_fwd, _sddmm_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _softmax(scores, layout: ACSR, scale: float, chain: tuple[str, ...]):
    return _op(chain[0], "softmax", scores, static=(layout, scale))


def _softmax_fwd(scores, layout, scale, chain):
    p = _softmax(scores, layout, scale, chain)
    return p, p


def _softmax_bwd(layout, scale, chain, p, dp):
    return (_backward(chain, "softmax_bwd", p, dp, static=(layout, scale)),)


_softmax.defvjp(_softmax_fwd, _softmax_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _spmm(probs, v, layout: ACSR, chain: tuple[str, ...]):
    return _op(chain[0], "spmm", probs, v, static=(layout,))


def _spmm_fwd(probs, v, layout, chain):
    return _spmm(probs, v, layout, chain), (probs, v)


def _spmm_bwd(layout, chain, res, dout):
    probs, v = res
    return _backward(chain, "spmm_bwd", probs, v, dout, static=(layout,))


_spmm.defvjp(_spmm_fwd, _spmm_bwd)


def _attention_on(chain, arrays, static):
    mod = _registry.module(chain[0])
    if callable(getattr(mod, _registry.DIFFERENTIABLE_ATTENTION, None)):
        return mod.attention(*arrays, *static)  # JAX differentiates and batches it itself
    return _attention_vjp(*arrays, *static, chain)


# op -> how backend chain[0] runs it (chain[1:]: where its backward ops may fall back)
_RUN = {
    "attention": _attention_on,
    "attention_with_lse": lambda chain, a, s: _op(chain[0], "attention_fwd", *a, static=s),
    "attention_paged": lambda chain, a, s: _attention_paged(*a, *s, chain),
    "sddmm": lambda chain, a, s: _sddmm(*a, *s, chain),
    "softmax": lambda chain, a, s: _softmax(*a, *s, chain),
    "spmm": lambda chain, a, s: _spmm(*a, *s, chain),
}


def _dispatch(op: str, names: tuple[str, ...], arrays: tuple, static: tuple, *, auto: bool, quiet=False):
    """``(backend, result)`` of ``op`` on the first of ``names`` that takes it."""
    return _first(names, op, lambda i: _RUN[op](names[i:], arrays, static), auto=auto, quiet=quiet)


def _jitted(op: str):
    """``op`` jitted with its static arguments and the backend order static, so equal calls compile once."""
    n_arrays, n_static = (len(x) for x in _SIGNATURES[op])

    def run(*args):
        arrays, static, (names, auto) = args[:n_arrays], args[n_arrays:-2], args[-2:]
        return _dispatch(op, names, arrays, static, auto=auto)[1]

    run.__name__ = run.__qualname__ = f"splat_{op}"
    return jax.jit(run, static_argnums=tuple(range(n_arrays, n_arrays + n_static + 2)))


_JIT = {op: _jitted(op) for op in _SIGNATURES}


def attention_led_by(first: str, q, k, v, layout: ACSR, scale: float) -> jax.Array:
    """The differentiable :func:`attention` as ``backend="auto"`` runs it when ``first`` ranks first.

    ``first`` runs the forward; each backward op goes to the first backend, from ``first`` onward
    in auto's order, that takes it. What the tuner times as ``first``'s forward+backward: for a
    backend with no backward of its own (``"cuda"``) that is its forward and another's backward.
    Raises ``NotImplementedError`` when ``first`` refuses the forward, and what :func:`attention`
    raises for bad arguments.
    """
    arrays, static = (q, k, v, None), (layout, scale, None)
    selected_backend("attention", q, k, v, layout, scale, backend=first)  # refuses, or runs there
    rest = tuple(n for n in _order("attention", "auto", arrays, static) if n != first)
    return _JIT["attention"](*arrays, *static, (first, *rest), True)


def _run(op: str, backend: str, arrays: tuple, static: tuple):
    return _JIT[op](*arrays, *static, _order(op, backend, arrays, static), backend == "auto")


def selected_backend(op: str, *args, backend: str = "auto", runtime=None, soft_cap=None) -> str:
    """The backend that would run ``op`` for these arguments here (nothing is computed).

    Args:
      op: "attention", "attention_with_lse", "attention_paged", "sddmm", "softmax" or "spmm".
      *args: the op's arguments as :func:`attention` and friends take them;
        arrays may be abstract (``jax.ShapeDtypeStruct``).
      backend: "auto" or a backend name (which is then returned, or raises
        what the call would raise).
      runtime, soft_cap: as :func:`attention` takes them (fused ops only;
        "attention_paged" needs ``runtime``).

    Returns:
      The backend name. For "attention", the one running the forward pass (its
      backward goes to the same backend where it takes it).

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np, acsr, jax_bindings
      >>> x = jax.ShapeDtypeStruct((1, 64, 2, 16), jnp.float32)
      >>> layout = acsr.from_dense(np.tril(np.ones((64, 64), bool)))
      >>> jax_bindings.selected_backend("attention", x, x, x, layout, 0.25)  # on a CPU
      'jax'
    """
    if op not in _SIGNATURES:
        raise ValueError(f"op must be one of {tuple(_SIGNATURES)}, got {op!r}")
    array_names, static_names = _SIGNATURES[op]
    fused = "runtime" in array_names
    positional = [n for n in array_names + static_names if n not in ("runtime", "soft_cap")]
    if len(args) != len(positional):
        raise TypeError(
            f"selected_backend({op!r}, ...) takes {', '.join(positional)}; got {len(args)} arguments"
        )
    if not fused and (runtime is not None or soft_cap is not None):
        raise TypeError(f"selected_backend({op!r}, ...) takes no runtime or soft_cap")
    if op == "attention_paged" and runtime is None:
        raise TypeError("selected_backend('attention_paged', ...) needs runtime= (a RuntimeMask with q_pos)")
    n = len(array_names) - fused
    arrays, static = args[:n], tuple(args[n:])
    if fused:
        arrays, static = (*arrays, runtime), (static[0], float(static[1]), _cap(soft_cap))
    elif "scale" in static_names:
        static = (*static[:-1], float(static[-1]))
    names = _order(op, backend, arrays, static)
    chosen = []

    def trace(*arrays):
        name, out = _dispatch(op, names, arrays, static, auto=backend == "auto", quiet=True)
        chosen.append(name)
        return out

    jax.eval_shape(trace, *arrays)
    return chosen[0]


def _cap(soft_cap) -> float | None:
    return None if soft_cap is None else float(soft_cap)


def attention(q, k, v, layout: ACSR, scale: float, backend: str = "auto", *, runtime=None, soft_cap=None):
    """Fused sparse attention ``[B, Sq, H, D]``; differentiable in q, k, v. No input checks.

    ``runtime``: a :class:`~jax_bindings._runtime.RuntimeMask` or None; ``soft_cap``: a float or None.
    """
    return _run("attention", backend, (q, k, v, runtime), (layout, float(scale), _cap(soft_cap)))


def attention_with_lse(
    q, k, v, layout: ACSR, scale: float, backend: str = "auto", *, runtime=None, soft_cap=None
):
    """``(out, lse)`` of the fused forward, not differentiable (for inspection and tests)."""
    return _run("attention_with_lse", backend, (q, k, v, runtime), (layout, float(scale), _cap(soft_cap)))


def attention_paged(
    q,
    k_pages,
    v_pages,
    page_table,
    layout: ACSR,
    scale: float,
    backend: str = "auto",
    *,
    runtime,
    soft_cap=None,
):
    """Attention against a paged KV cache ``[B, Sq, H, D]`` (see the contract); forward only:
    ``jax.grad`` through it raises. No input checks (``splat.attention_with_kvcache`` makes them).

    ``runtime``: a :class:`~jax_bindings._runtime.RuntimeMask` with ``q_pos``; ``soft_cap``: a float
    or None.
    """
    arrays = (q, k_pages, v_pages, page_table, runtime)
    return _run("attention_paged", backend, arrays, (layout, float(scale), _cap(soft_cap)))


def sddmm(q, k, layout: ACSR, backend: str = "auto"):
    """Differentiable SDDMM (see the contract). No input checks."""
    return _run("sddmm", backend, (q, k), (layout,))


def softmax(scores, layout: ACSR, scale: float, backend: str = "auto"):
    """Differentiable ACSR-row softmax (see the contract). No input checks."""
    return _run("softmax", backend, (scores,), (layout, float(scale)))


def spmm(probs, v, layout: ACSR, backend: str = "auto"):
    """Differentiable SpMM (see the contract). No input checks."""
    return _run("spmm", backend, (probs, v), (layout,))
