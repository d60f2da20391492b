"""Values closed over from an enclosing trace: recover how a constant mask was built.

When ``sparsify``'s function runs inside an outer ``jax.jit`` (a Keras or Flax model compiled
as a whole), a mask built outside it, e.g. by the model from ``jnp.arange``, reaches the inner
jaxpr as a tracer of the outer trace: a constant without a known value. Reading it as an input
would report a constant mask as input-dependent. :func:`outer_graph` walks the tracer's
recorded equations back (``DynamicJaxprTracer.parent``, JAX internals, read defensively: any
surprise means "not recoverable") and returns them when they reach only literals, concrete
constants and input-free primitives (``iota``), so the IR can add them as analysis-only
equations: the mask is then analysed like one built inside the function, while the run keeps
using the outer value itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.extend import core as jex_core

__all__ = ["OuterEqn", "outer_graph"]

# the walk gives up past this many equations (a model's activations, not a mask)
_MAX_EQNS = 2000


@dataclass
class OuterEqn:
    """One recorded equation of the outer trace, its operands as tracers or concrete values."""

    prim: Any
    params: dict
    ins: list  # each: ("tracer", tracer) or ("value", concrete array)
    outvars: list
    ctx: Any


def _leaf_value(tracer):
    """The concrete value of a parentless outer tracer (a literal or a constant), else None."""
    val = getattr(tracer, "val", None)
    if isinstance(val, jex_core.Literal):
        return np.asarray(val.val)
    frame = getattr(getattr(tracer, "_trace", None), "frame", None)
    consts = getattr(frame, "constvar_to_val", None)
    if consts is not None and val is not None:
        try:
            if val in consts:
                c = consts[val]
                return None if isinstance(c, jax.core.Tracer) else np.asarray(c)
        except TypeError:
            return None
    return None


def outer_graph(tracer) -> tuple[list[OuterEqn], Any] | None:
    """The outer equations computing ``tracer``, in program order, when it is input-free.

    Returns:
      ``(eqns, out)``: ``out`` is the tracer's own ``val`` (the outvar to map), or, for a
      constant of the outer trace (no equations), its concrete value; None when the tracer
      depends on the outer function's inputs, or its trace cannot be read.
    """
    if not hasattr(tracer, "parent"):  # not a tracer of a jaxpr being staged (vmap, jvp, ...)
        return None
    if tracer.parent is None:
        value = _leaf_value(tracer)
        return None if value is None else ([], value)
    order: list = []
    seen: dict[int, Any] = {}
    stack = [(tracer, False)]
    while stack:
        t, ready = stack.pop()
        parent = getattr(t, "parent", None)
        if parent is None:
            continue
        if ready:
            if id(parent) not in seen:
                seen[id(parent)] = parent
                order.append(parent)
            continue
        if id(parent) in seen:
            continue
        stack.append((t, True))
        ins = getattr(parent, "in_tracers", None)
        if ins is None or len(seen) + len(stack) > _MAX_EQNS:
            return None
        for u in ins:
            if not isinstance(u, jax.core.Tracer):
                continue
            if getattr(u, "parent", None) is None:
                if _leaf_value(u) is None:
                    return None  # an input of the outer function (or something unknown)
                continue
            stack.append((u, False))
    eqns = []
    for p in order:
        name = p.primitive.name
        if name.startswith("random_") or "rng" in name or name.startswith("threefry") or p.effects:
            return None
        ins = []
        for u in p.in_tracers:
            if isinstance(u, jax.core.Tracer):
                ins.append(("tracer", u) if u.parent is not None else ("value", _leaf_value(u)))
            else:
                ins.append(("value", np.asarray(u)))
        eqns.append(OuterEqn(p.primitive, p.params, ins, list(p.outvars), p.ctx))
    return eqns, tracer.val
