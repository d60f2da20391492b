"""One block of a larger attention: the contract's forward and backward ops, for callers that merge blocks.

Sequence-parallel attention (``splat._sharded``) splits one attention into blocks of queries x keys
held by different devices, runs each block's forward here, and merges the blocks' ``(out, lse)`` by
log-sum-exp. The contract's ``attention_bwd`` then gives each block's share of the gradients when it
is handed the *merged* ``out`` and ``lse`` (not the block's own): it recomputes the block's
probabilities as ``exp(z - lse)``, which are the merged softmax's at the block's columns, and
``delta = sum(dout * out)`` over the whole row, so ``dq`` summed over a row's blocks and ``dk, dv``
of each block are exactly those of the unsplit attention.

Both ops are plain functions (no ``custom_vjp``: the caller owns the differentiation); a vmapped
axis folds into ``B`` as in :mod:`jax_bindings._dispatch`. ``backend`` is placed per call as there:
``"auto"`` tries the backends in :func:`jax_bindings._registry.auto_order`'s order and moves on only
on ``NotImplementedError``; the backward tries the same order from its start (``out``/``lse`` mean
the same whichever backend made them), so a backend with a forward and no backward (``"cuda"``)
hands the backward to the next one that has it.
"""

from __future__ import annotations

import functools

import jax

from acsr import ACSR
from jax_bindings import _dispatch

__all__ = ["attention_bwd", "attention_fwd"]


def _names(backend: str, q, k, v, runtime, layout: ACSR, scale: float, soft_cap) -> tuple[str, ...]:
    """The backends to try, in order (ranked as the differentiable attention is: the blocks train)."""
    return _dispatch._order("attention", backend, (q, k, v, runtime), (layout, scale, soft_cap))


@functools.partial(jax.jit, static_argnums=(4, 5, 6, 7, 8))
def _fwd(q, k, v, runtime, layout, scale, soft_cap, names, auto):
    static = (layout, scale, soft_cap)
    run = lambda i: _dispatch._op(names[i], "attention_fwd", q, k, v, runtime, static=static)
    return _dispatch._first(names, "attention_fwd", run, auto=auto)[1]


@functools.partial(jax.jit, static_argnums=(7, 8, 9, 10, 11))
def _bwd(q, k, v, runtime, out, lse, dout, layout, scale, soft_cap, names, auto):
    static = (layout, scale, soft_cap)
    run = lambda i: _dispatch._op(names[i], "attention_bwd", q, k, v, runtime, out, lse, dout, static=static)
    return _dispatch._first(names, "attention_bwd", run, auto=auto, quiet=True)[1]


def attention_fwd(q, k, v, layout: ACSR, scale: float, backend: str = "auto", *, runtime=None, soft_cap=None):
    """``(out [B, Sq, H, D] in q.dtype, lse [B, H, Sq] float32)`` of one block (the contract's
    ``attention_fwd``); not differentiable. No input checks.

    Example:
      >>> import jax, numpy as np, acsr
      >>> q, k, v = jax.random.normal(jax.random.key(0), (3, 1, 16, 2, 8))
      >>> layout = acsr.from_dense(np.tril(np.ones((16, 16), bool)))
      >>> out, lse = attention_fwd(q, k, v, layout, 8 ** -0.5)
      >>> out.shape, lse.shape
      ((1, 16, 2, 8), (1, 2, 16))
    """
    scale, soft_cap = float(scale), None if soft_cap is None else float(soft_cap)
    names = _names(backend, q, k, v, runtime, layout, scale, soft_cap)
    return _fwd(q, k, v, runtime, layout, scale, soft_cap, names, backend == "auto")


def attention_bwd(
    q, k, v, out, lse, dout, layout: ACSR, scale: float, backend: str = "auto", *, runtime=None, soft_cap=None
):
    """``(dq, dk, dv)`` of one block, shaped and typed like ``q, k, v`` (the contract's
    ``attention_bwd``), given the *merged* ``out [B, Sq, H, D]`` and ``lse [B, H, Sq]`` of the rows
    the block belongs to (module docstring) and their cotangent ``dout``. No input checks.
    """
    scale, soft_cap = float(scale), None if soft_cap is None else float(soft_cap)
    names = _names(backend, q, k, v, runtime, layout, scale, soft_cap)
    return _bwd(q, k, v, runtime, out, lse, dout, layout, scale, soft_cap, names, backend == "auto")
