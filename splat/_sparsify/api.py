"""Trace-time mask detection: ``splat.sparsify`` finds dense attention in a jaxpr.

How it works (the *recognisable subgraph* approach; nothing is monkey-patched):

1. When the wrapped function is called, it is traced with ``jax.make_jaxpr`` on
   the abstract shapes of its array arguments (cached per function and shapes).
   Nested ``jit`` calls are inlined into one flat list of equations, so
   ``jax.nn.dot_product_attention``, ``flax.nnx.dot_product_attention`` (which
   calls it) and hand-written einsum/matmul attention all look alike.
2. Every ``dot_general`` whose operand is a softmax (``exp(x - max) / sum``, or
   a ``custom_jvp`` softmax) is a candidate ``P @ V``. The row max and row sum are
   matched through transposes, reshapes, broadcasts and copies (named-axis code
   such as penzai's ``nmap`` shifts a transposed copy of the scores), checking
   that they reduce the key axis (``softmax``). ``P`` may be masked again after
   the softmax with the same mask (Keras's ``Softmax(mask)``), and
   ``exp(x - max) @ V / rowsum`` (flash-style reference code) is a candidate
   too, and so is ``jax.nn.softmax(x, where=mask)`` (the logits masked twice, the
   row sum over the masked exponentials). A ``jax.checkpoint`` call is inlined and
   its nodes run again under ``jax.checkpoint`` (``ir.Region``); the body of a
   ``lax.scan`` is matched as a function of its own (a layer scanned over stacked
   weights) and the loop run on the rewritten body. From the softmax input we
   walk back to the ``Q @ K^T`` ``dot_general`` through converts, transposes,
   reshapes that merge or split whole axes (grouped-query 5-D einsums,
   ``labels``), scalar ``mul``/``div`` (the scale), one ``tanh`` between scalar
   factors (the logit soft cap), ``select_n`` against a large negative fill
   (``jnp.where(mask, s, -inf)``, or a finite fill at most ``NEG_THRESHOLD``)
   and ``add`` of a 0/-inf bias.
3. A ``where`` predicate is split into AND-ed terms (``predicate.split_predicate``;
   Keras-style integer masks too: ``minimum``/``*`` of 0/1 casts for AND, then
   ``> 0`` or a cast to bool). Terms that depend on the inputs become
   ``splat.attention``'s runtime arguments when they are a per-key (or per-query)
   padding mask or an equality of id arrays (``runtime.classify``); any other is
   reported. The remaining terms must be compile-time constants: their backward
   slice may only reach literals, closed-over constants and ``iota`` (a constant
   of an enclosing ``jit``, such as a mask a model built outside the function, is
   read through the outer trace's equations: ``outer``). A symbolic pass
   (``recognise``) first tries to name it with splat's constructors: indices
   are affine forms in the query index i and key index j (integer, or float
   while exact: ``jnp.arange(n, dtype=float32)``); sub-expressions that
   depend on (i, j) only through i, j or d = i - j are evaluated exactly on
   O(q_len + kv_len) samples, and and/or/not of them (and integer
   ``min``/``max``/``mul`` tables of them) are matched to
   ``causal``, ``sliding_window``, ``strided``, ``dilated_window``, ``sink``,
   ``global_tokens`` and their ``&``/``|`` (every candidate is checked against
   the samples, so a recognised mask is exact). Their layouts cost O(S), not
   O(S^2). Anything else becomes an exact ``splat.masks.from_fn`` predicate
   evaluated by *index-space evaluation*: the slice is evaluated at the
   requested index arrays only (``iota`` reads the index of its dimension,
   ``broadcast_in_dim``/``transpose``/``reshape`` map indices, constants are
   gathered), in row chunks, so S x S is never materialised at once. Equal
   slices share one Mask value (a 12-layer model analyses each distinct mask
   once). The analyzer finds grid products in such a predicate's rows
   (``acsr._grid_detect``): a neighbourhood written on flat token indices with
   ``//`` and ``%``, ``jnp.unravel_index`` or a reshaped ``[h, w, h, w]`` mask
   gets the grid layout ``masks.neighborhood`` builds.
4. The jaxpr is re-evaluated with each matched ``P @ V`` replaced by
   ``splat.attention`` on the matched Q, K, V (rearranged to ``[B, S, H, D]``,
   grouped-query heads kept). Everything else, including any other use of the
   scores, runs as traced, so ``jit``, ``vmap`` and ``grad`` work as usual.

Where nothing is found, or a mask depends on the inputs in a way splat cannot
take, the original function runs and a :class:`SparsifyWarning` says why (once
per reason); ``problems()`` lists the reasons.

Fully masked rows: splat outputs 0 on a query row with no key, where dense
attention outputs mean(V) (finite fill such as -1e9 or ``finfo.min``) or NaN
(-inf fill or bias). So that results never change silently, an attention whose
detected mask has such rows stays dense (with a one-time warning) unless the
caller passes ``empty_rows="zero"`` (or the function zeroes those rows itself:
Keras masks the probabilities again after the softmax). Rows emptied at run time by an
input-dependent padding term (a row whose visible keys are all padding) cannot
be known at trace time: there splat outputs 0 where the dense code outputs
mean(V) (finite fill). A query padding term empties its rows by construction
and so needs ``empty_rows="zero"``.

Modules, each one concern: ``ir`` (the flat IR and its re-evaluation), ``outer`` (constants
of an enclosing trace, rebuilt for analysis), ``indexing`` (index remapping through shape
ops), ``labels`` (axis labels through reshapes of the scores), ``numeric`` (values of constant
slices at index arrays), ``symbolic`` (mask slices as index forms, line functions, logic and
integer mask tables), ``recognise`` (those -> constructors), ``terms`` (mask terms -> one Mask),
``predicate`` (mask predicates -> AND-ed leaves, integer mask algebra included), ``runtime``
(input-dependent leaves -> runtime arguments), ``softmax`` (softmax and row reductions through
shape ops), ``matcher`` (the attention pattern), ``call`` (the replacement call) and ``api``
(this decorator, its cache and its warnings).

Limits: masks that vary across heads, input-dependent masks other than padding
and id equality (e.g. a window over positions computed from the inputs),
non-0/-inf additive biases, a mask inside the soft cap's ``tanh``, dropout on
the probabilities, and the cuDNN ``implementation="cudnn"`` path (a custom call
that hides its mask) are not detected.
"""

from __future__ import annotations

import functools
import hashlib
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_bindings import check_backend
from splat import _call_log
from splat._sparsify.ir import IR, build_ir, run_ir
from splat._sparsify.matcher import Found, Match, match_pv
from splat._sparsify.numeric import NotSparsifiable, Slices
from splat._sparsify.outer import outer_graph

__all__ = ["Found", "SparsifyWarning", "sparsify", "wrap"]


class SparsifyWarning(UserWarning):
    """splat.sparsify could not (fully) replace dense attention; says why."""


@dataclass
class _Body:
    """The attentions found in a loop's body (``lax.scan``'s), and in the loops inside it (by node)."""

    ir: IR
    matches: list[Match]
    loops: dict[int, _Body]

    def all_matches(self) -> list[Match]:
        return self.matches + [m for body in self.loops.values() for m in body.all_matches()]


@dataclass
class _Plan:
    ir: IR | None
    matches: list[Match]  # every attention found, those inside loops' bodies included
    problems: list[str]
    out_tree: Any
    cacheable: bool
    body: _Body | None = None  # the function's own IR as a body: where each match is replaced


def _is_static(x) -> bool:
    if isinstance(x, jax.core.Tracer):
        # a value of an enclosing jit computed without its inputs (a mask the model built from
        # iota): closed over, so the IR rebuilds how it was made (see ``outer``)
        return _outer_constant(x)
    if isinstance(x, (np.ndarray, jax.Array)):
        return x.dtype == np.bool_
    return not hasattr(x, "shape")


def _outer_constant(x) -> bool:
    try:
        return outer_graph(x) is not None
    except Exception:  # JAX internals changed: an ordinary traced argument
        return False


def _static_key(x):
    if isinstance(x, jax.core.Tracer):
        return ("tracer", id(x))  # never cached: the plan holds the tracer (``_Plan.cacheable``)
    if isinstance(x, (np.ndarray, jax.Array)):
        a = np.asarray(x)
        return ("bool", a.shape, hashlib.blake2b(np.packbits(a).tobytes(), digest_size=16).hexdigest())
    try:
        hash(x)
        return x
    except TypeError:
        return ("id", id(x))


def _analyse(fn, args, kwargs, backend: str, empty_rows: str = "fallback") -> tuple[_Plan, list, Any]:
    leaves, treedef = jax.tree.flatten((args, kwargs))
    static = [_is_static(x) for x in leaves]
    dyn = [x for x, s in zip(leaves, static, strict=False) if not s]

    def flat_fn(*dyn_vals):
        it = iter(dyn_vals)
        full = [x if s else next(it) for x, s in zip(leaves, static, strict=False)]
        a, kw = jax.tree.unflatten(treedef, full)
        return fn(*a, **kw)

    specs = [jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x), weak_type=_weak(x)) for x in dyn]
    closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*specs)
    out_tree = jax.tree.structure(out_shape)
    ir = build_ir(closed)
    problems: list[str] = []
    body = _match_body(ir, backend, empty_rows, problems)
    cacheable = not ir.outer and not any(isinstance(c, jax.core.Tracer) for c in ir.consts.values())
    return _Plan(ir, body.all_matches(), problems, out_tree, cacheable, body), dyn, treedef


def _match_body(ir: IR, backend: str, empty_rows: str, problems: list[str]) -> _Body:
    """The attentions of ``ir``, and of the bodies of the ``lax.scan`` loops in it (a layer scanned
    over stacked weights): each body is matched as a function of its consts, carry and slices, so
    a mask it builds from ``iota`` is a constant there; reasons left dense go to ``problems``."""
    sl = Slices(ir)
    matches, loops = [], {}
    for i, node in enumerate(ir.nodes):
        if node.analysis_only:
            continue
        if node.prim.name == "scan":
            body = _match_body(build_ir(node.params["jaxpr"]), backend, empty_rows, problems)
            if body.all_matches():
                loops[i] = body
        if node.prim.name != "dot_general":
            continue
        try:
            m = match_pv(ir, sl, node, backend, empty_rows)
        except NotSparsifiable as e:
            problems.append(str(e))
            continue
        if m is not None:
            matches.append(m)
    return _Body(ir, matches, loops)


def _run_body(body: _Body, args: list) -> list:
    """``body``'s IR on ``args`` with each found attention replaced by splat's, in loops too."""
    replace = {m.pv_out: ([m.q, m.k, m.v, *m.extra], m.fn) for m in body.matches}
    subs = {i: functools.partial(_run_scan, body.ir.nodes[i].params, inner)
            for i, inner in body.loops.items()}
    return run_ir(body.ir, args, replace, subs)


def _run_scan(params: dict, body: _Body, *ins):
    """A ``lax.scan`` node's outputs, its body run by :func:`_run_body`."""
    n_consts, n_carry = params["num_consts"], params["num_carry"]
    consts, init, xs = ins[:n_consts], ins[n_consts : n_consts + n_carry], ins[n_consts + n_carry :]

    def step(carry, x):
        outs = _run_body(body, [*consts, *carry, *x])
        return list(outs[:n_carry]), list(outs[n_carry:])

    carry, ys = jax.lax.scan(step, list(init), list(xs), length=params["length"], reverse=params["reverse"],
                             unroll=params["unroll"])
    return [*carry, *ys]


def _weak(x) -> bool:
    try:
        return bool(jax.typeof(x).weak_type)
    except Exception:
        return isinstance(x, (int, float, complex))


def sparsify(
    fn: Callable | None = None, *, backend: str = "auto", fallback: bool = True, empty_rows: str = "fallback"
) -> Callable:
    """Run the dense attention inside ``fn`` through splat, with the mask found at trace time.

    ``fn`` is traced on its arguments' shapes; every ``softmax(q k^T * scale
    masked) @ v`` (einsum or matmul form, grouped-query 5-D einsums with
    reshapes, ``jax.nn.dot_product_attention``, ``flax.nnx.dot_product_attention``,
    optionally soft-capped ``cap * tanh(x / cap)``) whose mask is a compile-time
    constant (built from ``jnp.arange``/iota comparisons or constant arrays),
    AND-ed with input-dependent padding or segment-id terms, is replaced by
    :func:`splat.attention` with that mask (and ``segment_ids`` /
    ``kv_segment_ids`` / ``logits_soft_cap``). Masks made of iota comparisons
    (bands, causal, sinks, global tokens, strided/dilated, and ``&``/``|`` of
    those) are recognised as splat's constructors in O(S); other constant masks
    become an exact predicate evaluated in row chunks. Nothing S x S is
    materialised. Detection is cached per function and argument shapes; equal
    masks (e.g. across layers) are analysed once. Works under ``jit``, ``vmap``
    and ``grad``.

    Args:
      fn: the function; its array arguments may be any pytree. Python scalars
        and concrete boolean arrays among the arguments are treated as static.
      backend: passed to :func:`splat.attention` (one of ``jax_bindings.BACKENDS``).
      fallback: when no attention can be replaced (none found, or its mask
        depends on the inputs), True runs ``fn`` unchanged and emits a
        :class:`SparsifyWarning` once per reason; False raises ``ValueError``.
      empty_rows: what to do when a detected mask leaves some query row with no
        key. splat outputs 0 on such a row, while the dense function outputs
        mean(V) (finite fill) or NaN (-inf). "fallback" (default) keeps that
        attention dense and warns once, so results never change silently;
        "zero" accepts splat's zeros (and zero gradients) on those rows.

    Returns:
      A function with ``fn``'s signature. Its ``.inspect(*args, **kwargs)``
      returns the list of :class:`Found` attentions (mask, lengths, scale)
      and ``.problems(*args, **kwargs)`` the reasons for those left dense.
      Each call (each trace, under ``jit``) leaves a :class:`splat.CallRecord`
      in :func:`splat.call_log` and :func:`splat.call_counts`: "splat",
      "fallback" with the reasons, or "error" with the exception.

    Example:
      >>> import jax, jax.numpy as jnp, splat
      >>> @splat.sparsify
      ... def attn(q, k, v):
      ...     i = jnp.arange(q.shape[1])
      ...     mask = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < 4)
      ...     return jax.nn.dot_product_attention(q, k, v, mask=mask[None, None])
      >>> q = jax.random.normal(jax.random.key(0), (1, 32, 2, 8))
      >>> attn(q, q, q).shape
      (1, 32, 2, 8)
    """
    check_backend(backend)
    if empty_rows not in ("fallback", "zero"):
        raise ValueError(f'empty_rows must be "fallback" or "zero", got {empty_rows!r}')
    if fn is None:
        return functools.partial(sparsify, backend=backend, fallback=fallback, empty_rows=empty_rows)
    if not callable(fn):
        raise TypeError(f"sparsify expects a function, got {type(fn).__name__}")
    return wrap(fn, backend=backend, fallback=fallback, empty_rows=empty_rows)


def wrap(
    fn: Callable, *, backend: str, fallback: bool, empty_rows: str, front_end: str | None = None
) -> Callable:
    """:func:`sparsify` past its argument checks; ``front_end`` names the wrapper in call records
    (default ``"sparsify(<fn name>)"``; ``@sparse_attention`` in detection mode passes its own)."""
    cache: dict = {}
    warned: set = set()
    name = getattr(fn, "__qualname__", repr(fn))
    front_end = front_end or f"sparsify({name})"

    def plan_for(args, kwargs):
        leaves, treedef = jax.tree.flatten((args, kwargs))
        key = (
            treedef,
            tuple(
                _static_key(x) if _is_static(x) else (np.shape(x), jnp.result_type(x), _weak(x))
                for x in leaves
            ),
        )
        hit = cache.get(key)
        if hit is not None:
            dyn = [x for x in leaves if not _is_static(x)]
            return hit, dyn
        plan, dyn, _ = _analyse(fn, args, kwargs, backend, empty_rows)
        if plan.cacheable:
            cache[key] = plan
        return plan, dyn

    def reasons(problems: list[str]) -> str:
        return "; ".join(sorted(set(problems)) or ["no dense attention with a constant mask was found"])

    def report(problems: list[str], none_found: bool):
        msg = reasons(problems)
        if none_found and not fallback:
            raise ValueError(f"splat.sparsify({name}): {msg} (pass fallback=True to run the dense function)")
        if msg not in warned:
            warned.add(msg)
            tail = "running the original dense function" if none_found else "those attentions stay dense"
            warnings.warn(f"splat.sparsify({name}): {msg}; {tail}", SparsifyWarning, stacklevel=4)

    def run(args, kwargs, info: dict) -> tuple[Any, str]:
        """The call: ``(output, outcome)``; fills ``info`` for its record."""
        plan, dyn = plan_for(args, kwargs)
        if not plan.matches:
            info["reason"] = reasons(plan.problems)
            report(plan.problems, True)
            return fn(*args, **kwargs), "fallback"
        if plan.problems:
            info["reason"] = "stayed dense: " + reasons(plan.problems)
            report(plan.problems, False)
        where = plan.body
        while not where.matches:  # the first attention may be inside a loop's body
            where = next(b for b in where.loops.values() if b.all_matches())
        first = where.matches[0]
        info["q"], info["k"] = where.ir.shape(first.q), where.ir.shape(first.k)
        info["mask"] = "; ".join(dict.fromkeys(repr(m.found.mask) for m in plan.matches))
        info["replaced"], info["dense"] = len(plan.matches), len(plan.problems)
        checked = sum("positions=indices" in m.found.runtime for m in plan.matches)
        if checked:  # the record is written now; which branch runs is known only on device
            note = (f"{checked} of them check at run time that positions equal indices where the mask "
                    "lets them be seen, and run the original dense attention where they do not")
            info["reason"] = f"{info['reason']}; {note}" if info.get("reason") else note
        # splat's decode path, for every attention: queries at rows known only at run time
        info["decode"] = all("positions" in m.found.runtime for m in plan.matches)
        outs = _run_body(plan.body, dyn)
        return jax.tree.unflatten(plan.out_tree, outs), "splat"

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        info: dict[str, Any] = {"backend": backend}
        try:
            out, outcome = run(args, kwargs, info)
        except Exception as e:  # recorded before it propagates: a framework may swallow it
            _call_log.record(front_end, "error", **(info | {"reason": _call_log.error_message(e)}))
            raise
        _call_log.record(front_end, outcome, **info)
        return out

    def inspect(*args, **kwargs) -> list[Found]:
        return [m.found for m in plan_for(args, kwargs)[0].matches]

    def problems(*args, **kwargs) -> list[str]:
        return list(plan_for(args, kwargs)[0].problems)

    wrapper.inspect = inspect
    wrapper.problems = problems
    return wrapper
