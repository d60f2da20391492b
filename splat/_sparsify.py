"""Trace-time mask detection: ``splat.sparsify`` finds dense attention in a jaxpr.

How it works (the *recognisable subgraph* approach; nothing is monkey-patched):

1. When the wrapped function is called, it is traced with ``jax.make_jaxpr`` on
   the abstract shapes of its array arguments (cached per function and shapes).
   Nested ``jit`` calls are inlined into one flat list of equations, so
   ``jax.nn.dot_product_attention``, ``flax.nnx.dot_product_attention`` (which
   calls it) and hand-written einsum/matmul attention all look alike.
2. Every ``dot_general`` whose operand is a softmax (``exp(x - max) / sum``, or
   a ``custom_jvp`` softmax) is a candidate ``P @ V``. From the softmax input we
   walk back to the ``Q @ K^T`` ``dot_general`` through converts, transposes,
   scalar ``mul``/``div`` (the scale), ``select_n`` against a large negative
   fill (``jnp.where(mask, s, -inf)``) and ``add`` of a 0/-inf bias.
3. Each mask operand must be a compile-time constant: its backward slice may
   only reach literals, closed-over constants and ``iota``. A symbolic pass
   (``_recognise``) first tries to name it with splat's constructors: indices
   are affine forms in the query index i and key index j; sub-expressions that
   depend on (i, j) only through i, j or d = i - j are evaluated exactly on
   O(q_len + kv_len) samples, and and/or/not of them are matched to
   ``causal``, ``sliding_window``, ``strided``, ``dilated_window``, ``sink``,
   ``global_tokens`` and their ``&``/``|`` (every candidate is checked against
   the samples, so a recognised mask is exact). Their layouts cost O(S), not
   O(S^2). Anything else becomes an exact ``splat.masks.from_fn`` predicate
   evaluated by *index-space evaluation*: the slice is evaluated at the
   requested index arrays only (``iota`` reads the index of its dimension,
   ``broadcast_in_dim``/``transpose``/``reshape`` map indices, constants are
   gathered), in row chunks, so S x S is never materialised at once. Equal
   slices share one Mask value (a 12-layer model analyses each distinct mask
   once).
4. The jaxpr is re-evaluated with each matched ``P @ V`` replaced by
   ``splat.attention`` on the matched Q, K, V (rearranged to ``[B, S, H, D]``,
   grouped-query heads kept). Everything else, including any other use of the
   scores, runs as traced, so ``jit``, ``vmap`` and ``grad`` work as usual.

Where nothing is found, or a mask depends on the inputs, the original function
runs and a :class:`SparsifyWarning` says why (once per reason).

Fully masked rows: splat outputs 0 on a query row with no key, where dense
attention outputs mean(V) (finite fill such as -1e9 or ``finfo.min``) or NaN
(-inf fill or bias). So that results never change silently, an attention whose
detected mask has such rows stays dense (with a one-time warning) unless the
caller passes ``empty_rows="zero"``.

Limits: masks that vary across batch or heads, non-0/-inf additive biases,
logit soft-capping, dropout on the probabilities, and the cuDNN
``implementation="cudnn"`` path (a custom call that hides its mask) are not
detected.
"""

from __future__ import annotations

import functools
import hashlib
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core

from jax_bindings import check_backend

__all__ = ["SparsifyWarning", "sparsify"]

# A where-fill or additive-bias entry at or below this counts as "masked out".
_NEG_THRESHOLD = -1e4
# Unsupported mask primitives are evaluated whole when their output is at most this big.
_MAX_DENSE_EVAL = 1 << 22
_INLINE = ("jit", "pjit", "closed_call", "core_call")


class SparsifyWarning(UserWarning):
    """splat.sparsify could not (fully) replace dense attention; says why."""


class _NotSparsifiable(Exception):
    """A candidate attention was found but cannot be handed to splat (message says why)."""


# --------------------------------------------------------------------------------------
# A flat IR over the jaxpr: nested jit calls inlined, values numbered.
# --------------------------------------------------------------------------------------


@dataclass
class _Node:
    prim: Any  # jax Primitive
    params: dict
    ins: list[int]
    outs: list[int]
    ctx: Any = None


@dataclass
class _IR:
    nodes: list[_Node] = field(default_factory=list)
    avals: list[Any] = field(default_factory=list)
    consts: dict[int, Any] = field(default_factory=dict)  # value id -> concrete value (or outer tracer)
    inputs: list[int] = field(default_factory=list)
    outputs: list[int] = field(default_factory=list)
    prod: dict[int, tuple[int, int]] = field(default_factory=dict)  # value id -> (node index, out pos)

    def new(self, aval) -> int:
        self.avals.append(aval)
        return len(self.avals) - 1

    def node_of(self, vid: int) -> _Node | None:
        p = self.prod.get(vid)
        return None if p is None else self.nodes[p[0]]

    def shape(self, vid: int) -> tuple[int, ...]:
        return tuple(self.avals[vid].shape)


def _build_ir(closed) -> _IR:
    ir = _IR()
    env: dict[Any, int] = {}
    for v, c in zip(closed.jaxpr.constvars, closed.consts, strict=False):
        env[v] = ir.new(v.aval)
        ir.consts[env[v]] = c
    for v in closed.jaxpr.invars:
        env[v] = ir.new(v.aval)
        ir.inputs.append(env[v])
    _emit(ir, closed.jaxpr.eqns, env)
    ir.outputs = [_ref(ir, env, a) for a in closed.jaxpr.outvars]
    return ir


def _ref(ir: _IR, env: dict, atom) -> int:
    if isinstance(atom, jex_core.Literal):
        vid = ir.new(atom.aval)
        ir.consts[vid] = atom.val
        return vid
    return env[atom]


def _emit(ir: _IR, eqns, env: dict) -> None:
    for eqn in eqns:
        ins = [_ref(ir, env, a) for a in eqn.invars]
        name = eqn.primitive.name
        inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr")) if name in _INLINE else None
        if inner is not None:
            if isinstance(inner, jex_core.ClosedJaxpr):
                jaxpr, consts = inner.jaxpr, inner.consts
            else:
                jaxpr, consts = inner, ()
            sub: dict[Any, int] = {}
            for v, c in zip(jaxpr.constvars, consts, strict=False):
                sub[v] = ir.new(v.aval)
                ir.consts[sub[v]] = c
            for v, vid in zip(jaxpr.invars, ins, strict=False):
                sub[v] = vid
            _emit(ir, jaxpr.eqns, sub)
            for outer, atom in zip(eqn.outvars, jaxpr.outvars, strict=False):
                env[outer] = _ref(ir, sub, atom)
            continue
        outs = []
        for v in eqn.outvars:
            vid = ir.new(v.aval)
            outs.append(vid)
            if not isinstance(v, jex_core.DropVar):
                env[v] = vid
        for k, vid in enumerate(outs):
            ir.prod[vid] = (len(ir.nodes), k)
        ir.nodes.append(_Node(eqn.primitive, eqn.params, ins, outs, getattr(eqn, "ctx", None)))


def _bind_params(node: _Node) -> tuple[list, dict]:
    """(subfuns, params) for ``prim.bind``; jax >= 0.7 returns params only."""
    got = node.prim.get_bind_params(node.params)
    if isinstance(got, tuple):
        return list(got[0]), got[1]
    return [], got


def _run_ir(ir: _IR, args: list, replace: dict[int, tuple[list[int], Callable]]) -> list:
    """Evaluate ``ir`` on ``args``; ``replace[vid] = (inputs, f)`` computes ``vid`` as ``f(*inputs)``."""
    need = set(ir.outputs)
    live = [False] * len(ir.nodes)
    for i in range(len(ir.nodes) - 1, -1, -1):
        node = ir.nodes[i]
        if not any(o in need for o in node.outs):
            continue
        live[i] = True
        for o in node.outs:
            if o in replace and o in need:
                need.update(replace[o][0])
        if not all(o in replace for o in node.outs if o in need):
            need.update(node.ins)
    env: dict[int, Any] = dict(ir.consts)
    env.update(zip(ir.inputs, args, strict=False))
    for i, node in enumerate(ir.nodes):
        if not live[i]:
            continue
        if all(o in replace for o in node.outs if o in need):
            for o in node.outs:
                if o in need:
                    ins, f = replace[o]
                    env[o] = f(*[env[v] for v in ins])
            continue
        subfuns, bind_params = _bind_params(node)
        invals = [env[v] for v in node.ins]
        manager = getattr(node.ctx, "manager", None)
        if manager is not None:
            with manager:
                ans = node.prim.bind(*subfuns, *invals, **bind_params)
        else:
            ans = node.prim.bind(*subfuns, *invals, **bind_params)
        if node.prim.multiple_results:
            env.update(zip(node.outs, ans, strict=False))
        else:
            env[node.outs[0]] = ans
    return [env[v] for v in ir.outputs]


# --------------------------------------------------------------------------------------
# Index-space evaluation of constant slices (masks, fills, scales).
# --------------------------------------------------------------------------------------


def _trunc_div(a, b):
    a, b = np.asarray(a), np.asarray(b)
    if np.issubdtype(np.result_type(a, b), np.integer):
        q = np.abs(a) // np.maximum(np.abs(b), 1)
        return np.where((a < 0) != (b < 0), -q, q).astype(np.result_type(a, b))
    return a / b


def _bitwise(f_bool, f_int):
    def op(a, b=None):
        a = np.asarray(a)
        if b is None:
            return f_bool(a) if a.dtype == np.bool_ else f_int(a)
        b = np.asarray(b)
        return f_bool(a, b) if a.dtype == np.bool_ else f_int(a, b)

    return op


_ELEMENTWISE: dict[str, Callable] = {
    "add": np.add,
    "sub": np.subtract,
    "mul": np.multiply,
    "div": _trunc_div,
    "rem": np.fmod,
    "max": np.maximum,
    "min": np.minimum,
    "pow": np.power,
    "and": _bitwise(np.logical_and, np.bitwise_and),
    "or": _bitwise(np.logical_or, np.bitwise_or),
    "xor": _bitwise(np.logical_xor, np.bitwise_xor),
    "not": _bitwise(np.logical_not, np.invert),
    "eq": np.equal,
    "ne": np.not_equal,
    "lt": np.less,
    "le": np.less_equal,
    "gt": np.greater,
    "ge": np.greater_equal,
    "abs": np.abs,
    "neg": np.negative,
    "sign": np.sign,
    "exp": np.exp,
    "log": np.log,
    "sqrt": np.sqrt,
    "floor": np.floor,
    "ceil": np.ceil,
    "is_finite": np.isfinite,
    "shift_left": np.left_shift,
    "shift_right_arithmetic": np.right_shift,
    "stop_gradient": lambda x: x,
    "copy": lambda x: x,
    "copy_p": lambda x: x,
    "optimization_barrier": lambda x: x,
}
_SHAPE_OPS = (
    "broadcast_in_dim",
    "transpose",
    "reshape",
    "squeeze",
    "slice",
    "rev",
    "iota",
    "convert_element_type",
)
_EXTRA_ELEMENTWISE = ("select_n", "clamp", "integer_pow")


def _reshape_index(in_shape, out_shape, idx):
    flat = 0
    for i, n in enumerate(out_shape):
        flat = flat * n + idx[i]
    res = []
    for n in reversed(in_shape):
        res.append(flat % n if n > 1 else 0)
        flat = flat // n
    return tuple(reversed(res))


def _size1_map(in_shape, out_shape):
    """Axis map out -> in when a reshape only adds/removes size-1 axes, else None."""
    a = [i for i, n in enumerate(in_shape) if n != 1]
    b = [i for i, n in enumerate(out_shape) if n != 1]
    if [in_shape[i] for i in a] != [out_shape[i] for i in b]:
        return None
    return dict(zip(b, a, strict=False))


class _Slices:
    """Questions about constant sub-graphs of an IR: independence, dependence axes, values."""

    def __init__(self, ir: _IR):
        self.ir = ir
        self._indep: dict[int, bool] = {}
        self._deps: dict[int, frozenset] = {}
        self._dense: dict[int, np.ndarray] = {}
        self._fp: dict[int, str] = {}

    # -- input independence ------------------------------------------------------------
    def independent(self, vid: int) -> bool:
        """True when ``vid`` depends only on literals, constants and iota (no inputs)."""
        ir = self.ir
        stack = [(vid, False)]
        while stack:
            v, ready = stack.pop()
            if v in self._indep:
                continue
            if v in ir.consts:
                self._indep[v] = not isinstance(ir.consts[v], jax.core.Tracer)
                continue
            node = ir.node_of(v)
            if node is None:  # a function input
                self._indep[v] = False
            elif not ready:
                stack.append((v, True))
                stack.extend((u, False) for u in node.ins if u not in self._indep)
            else:
                name = node.prim.name
                random = name.startswith("random_") or "rng" in name or node.prim.multiple_results
                self._indep[v] = not random and all(self._indep[u] for u in node.ins)
        return self._indep[vid]

    # -- axes a constant value varies along --------------------------------------------
    def deps(self, vid: int) -> frozenset:
        if vid in self._deps:
            return self._deps[vid]
        ir = self.ir
        shape = ir.shape(vid)
        node = ir.node_of(vid)
        if vid in ir.consts or vid in self._dense:
            c = self._dense[vid] if vid in self._dense else np.asarray(ir.consts[vid])
            d = frozenset(a for a in range(c.ndim) if c.shape[a] > 1 and np.any(np.take(c, [0], axis=a) != c))
        else:
            name = node.prim.name
            p = node.params
            ins = node.ins
            if name == "iota":
                d = frozenset([p["dimension"]]) if shape[p["dimension"]] > 1 else frozenset()
            elif name == "broadcast_in_dim":
                d = frozenset(p["broadcast_dimensions"][a] for a in self.deps(ins[0]))
            elif name == "transpose":
                src = self.deps(ins[0])
                d = frozenset(j for j, a in enumerate(p["permutation"]) if a in src)
            elif name in ("reshape", "squeeze"):
                src = self.deps(ins[0])
                m = _size1_map(ir.shape(ins[0]), shape)
                if m is not None:
                    d = frozenset(o for o, i in m.items() if i in src)
                else:
                    d = frozenset(a for a, n in enumerate(shape) if n > 1) if src else frozenset()
            elif (
                name in ("slice", "rev", "convert_element_type")
                or name in _ELEMENTWISE
                or name in _EXTRA_ELEMENTWISE
            ):
                d = frozenset()
                for u in ins:
                    if len(ir.shape(u)) == len(shape):
                        d |= self.deps(u)
                d = frozenset(a for a in d if shape[a] > 1)
            else:
                self._materialise(vid)
                return self.deps(vid)
        self._deps[vid] = d
        return d

    def _materialise(self, vid: int) -> None:
        """Evaluate an unsupported primitive's output whole (only when small)."""
        ir = self.ir
        node = ir.node_of(vid)
        size = math.prod(ir.shape(vid))
        if size > _MAX_DENSE_EVAL:
            raise _NotSparsifiable(
                f"the mask uses `{node.prim.name}` on a {ir.shape(vid)} array, "
                "which splat cannot evaluate lazily"
            )
        invals = [self.full(u) for u in node.ins]
        subfuns, bind_params = _bind_params(node)
        with jax.ensure_compile_time_eval():
            ans = node.prim.bind(*subfuns, *invals, **bind_params)
        if node.prim.multiple_results:
            raise _NotSparsifiable(f"the mask uses `{node.prim.name}`, which splat cannot evaluate")
        self._dense[vid] = np.asarray(ans)

    def full(self, vid: int) -> np.ndarray:
        shape = self.ir.shape(vid)
        idx = tuple(np.indices(shape, sparse=True)) if shape else ()
        return np.broadcast_to(self.value(vid, idx, {}), shape)

    # -- values at index arrays --------------------------------------------------------
    def value(self, vid: int, idx: tuple, memo: dict) -> np.ndarray:
        """Value of constant ``vid`` at broadcastable index arrays ``idx`` (one per axis)."""
        key = (vid, tuple(id(i) for i in idx))
        hit = memo.get(key)
        if hit is not None:
            return hit[0]
        out = self._value(vid, idx, memo)
        memo[key] = (out, idx)  # keep idx alive so ids stay unique
        return out

    def _value(self, vid, idx, memo):
        ir = self.ir
        shape = ir.shape(vid)
        if vid in ir.consts or vid in self._dense:
            c = self._dense[vid] if vid in self._dense else np.asarray(ir.consts[vid])
            if c.ndim == 0:
                return c
            return c[tuple(i if c.shape[a] > 1 else 0 for a, i in enumerate(idx))]
        node = ir.node_of(vid)
        name, p, ins = node.prim.name, node.params, node.ins

        def sub(u, uidx):
            return self.value(u, uidx, memo)

        def same(u):  # operand of an elementwise op: same index, or a scalar
            return sub(u, idx if len(ir.shape(u)) == len(shape) else ())

        if name == "iota":
            return np.asarray(idx[p["dimension"]]).astype(p["dtype"])
        if name == "broadcast_in_dim":
            ishape = ir.shape(ins[0])
            bd = p["broadcast_dimensions"]
            return sub(ins[0], tuple(idx[bd[a]] if ishape[a] > 1 else 0 for a in range(len(ishape))))
        if name == "transpose":
            perm = p["permutation"]
            inv = [0] * len(perm)
            for j, a in enumerate(perm):
                inv[a] = idx[j]
            return sub(ins[0], tuple(inv))
        if name in ("reshape", "squeeze"):
            ishape = ir.shape(ins[0])
            m = _size1_map(ishape, shape)
            if m is not None:
                back = {i: o for o, i in m.items()}
                return sub(ins[0], tuple(idx[back[a]] if a in back else 0 for a in range(len(ishape))))
            return sub(ins[0], _reshape_index(ishape, shape, idx))
        if name == "slice":
            strides = p["strides"] or (1,) * len(shape)
            return sub(
                ins[0], tuple(s + i * st for s, i, st in zip(p["start_indices"], idx, strides, strict=False))
            )
        if name == "rev":
            ishape = ir.shape(ins[0])
            return sub(
                ins[0], tuple(ishape[a] - 1 - i if a in p["dimensions"] else i for a, i in enumerate(idx))
            )
        if name == "convert_element_type":
            return np.asarray(same(ins[0])).astype(p["new_dtype"])
        if name == "select_n":
            pred = np.asarray(same(ins[0]))
            cases = [same(u) for u in ins[1:]]
            if pred.dtype == np.bool_:
                return np.where(pred, cases[1], cases[0])
            return np.choose(pred, cases)
        if name == "clamp":
            lo, x, hi = (same(u) for u in ins)
            return np.minimum(np.maximum(x, lo), hi)
        if name == "integer_pow":
            return np.power(same(ins[0]), p["y"])
        if name in _ELEMENTWISE:
            return np.asarray(_ELEMENTWISE[name](*[same(u) for u in ins]))
        self._materialise(vid)
        return self._value(vid, idx, memo)

    def scalar(self, vid: int) -> float:
        """The value of a constant that is the same everywhere."""
        if self.deps(vid):
            raise _NotSparsifiable("a scale or fill value varies across positions")
        return np.asarray(self.value(vid, (0,) * len(self.ir.shape(vid)), {})).item()

    # -- structural fingerprints (equal slices -> one shared Mask) ----------------------
    def fingerprint(self, vid: int) -> str:
        if vid in self._fp:
            return self._fp[vid]
        ir = self.ir
        if vid in ir.consts:
            c = np.asarray(ir.consts[vid])
            h = hashlib.blake2b(np.ascontiguousarray(c).tobytes(), digest_size=12).hexdigest()
            fp = f"c({c.dtype},{c.shape},{h})"
        else:
            node = ir.node_of(vid)
            k = ir.prod[vid][1]
            params = ",".join(f"{n}={node.params[n]!r}" for n in sorted(node.params))
            fp = f"{node.prim.name}[{params}]#{k}(" + ";".join(self.fingerprint(u) for u in node.ins) + ")"
        fp = hashlib.blake2b(fp.encode(), digest_size=16).hexdigest()
        self._fp[vid] = fp
        return fp


# --------------------------------------------------------------------------------------
# Pattern matching: softmax(Q K^T * scale masked) @ V
# --------------------------------------------------------------------------------------

_PASS = ("convert_element_type", "copy", "copy_p")


@dataclass(frozen=True)
class Found:
    """One dense attention that ``sparsify`` replaced.

    Attributes:
      mask: the detected :class:`splat.masks.Mask`: constructors (e.g.
        ``SlidingWindow(left=1023, right=0)``) where recognised, else an exact
        ``from_fn`` predicate.
      q_len, kv_len: sequence lengths of the matched attention.
      scale: the logit scale found.
      heads: ``(kv_heads, group)``: query heads = kv_heads * group (GQA).
    """

    mask: Any
    q_len: int
    kv_len: int
    scale: float
    heads: tuple[int, int]


@dataclass
class _Match:
    pv_out: int
    q: int
    k: int
    v: int
    fn: Callable
    found: Found


def _strip_back(ir: _IR, vid: int, ops=_PASS + ("transpose",)) -> tuple[int, list[_Node]]:
    """Walk back from ``vid`` through pass-through ops; returns (source vid, ops forward-ordered)."""
    chain = []
    while True:
        node = ir.node_of(vid)
        if node is None or node.prim.name not in ops:
            return vid, chain[::-1]
        chain.append(node)
        vid = node.ins[0]


def _forward_labels(labels: list, chain: list[_Node]) -> list:
    for node in chain:
        if node.prim.name == "transpose":
            labels = [labels[a] for a in node.params["permutation"]]
    return labels


def _match_softmax(ir: _IR, sl: _Slices, vid: int) -> tuple[int, int] | None:
    """(softmax input vid, reduce axis) when ``vid`` is softmax(x) along one axis."""
    node = ir.node_of(vid)
    if node is None:
        return None
    if node.prim.name == "custom_jvp_call":
        inner = node.params.get("call_jaxpr")
        if inner is None or len(node.ins) != 1 or len(node.outs) != 1:
            return None
        sub_ir = _build_ir(
            inner if isinstance(inner, jex_core.ClosedJaxpr) else jex_core.ClosedJaxpr(inner, ())
        )
        m = _match_softmax(sub_ir, _Slices(sub_ir), sub_ir.outputs[0])
        if m is None or m[0] != sub_ir.inputs[0]:
            return None
        return node.ins[0], m[1]
    if node.prim.name != "div":
        return None
    e, z = node.ins
    zsrc, _ = _strip_back(ir, z, _PASS + ("broadcast_in_dim", "reshape"))
    red = ir.node_of(zsrc)
    if red is None or red.prim.name != "reduce_sum" or len(red.params["axes"]) != 1:
        return None
    axis = int(red.params["axes"][0])
    if _strip_back(ir, red.ins[0], _PASS)[0] != _strip_back(ir, e, _PASS)[0]:
        return None
    ex = ir.node_of(_strip_back(ir, e, _PASS)[0])
    if ex is None or ex.prim.name != "exp":
        return None
    y = ex.ins[0]
    sub = ir.node_of(y)
    if sub is not None and sub.prim.name == "sub":
        x, m = sub.ins
        if not _is_row_shift(ir, m, x):
            return None
        return x, axis
    return y, axis


def _is_row_shift(ir: _IR, m: int, x: int) -> bool:
    """True when ``m`` is computed from ``x`` by reductions/broadcasts only (a per-row shift)."""
    ok = ("reduce_max", "max", "broadcast_in_dim", "reshape", "squeeze", "stop_gradient") + _PASS
    stack, seen_x = [m], False
    while stack:
        v = stack.pop()
        if v == x:
            seen_x = True
            continue
        if v in ir.consts:
            continue
        node = ir.node_of(v)
        if node is None or node.prim.name not in ok:
            return False
        stack.extend(node.ins)
    return seen_x


def _match_pv(
    ir: _IR, sl: _Slices, pv: _Node, masks_mod, backend: str, empty_rows: str = "fallback"
) -> _Match | None:
    """Match one ``dot_general`` as ``softmax(...) @ V``; None if it is not attention.

    Raises:
      _NotSparsifiable: it is attention, but splat cannot take it (message says why).
    """
    (lc, rc), (lb, rb) = pv.params["dimension_numbers"]
    if len(lc) != 1:
        return None
    for side in (0, 1):
        src, p_chain = _strip_back(ir, pv.ins[side])
        sm = _match_softmax(ir, sl, src)
        if sm is not None:
            break
    else:
        return None
    x, axis = sm
    # walk back from the softmax input to Q K^T
    chain: list[tuple[str, _Node, Any]] = []
    scale = 1.0
    cur = x
    while True:
        node = ir.node_of(cur)
        if node is None:
            return None
        name = node.prim.name
        if name in _PASS or name == "transpose":
            chain.append(("pass", node, None))
            cur = node.ins[0]
        elif name in ("mul", "div", "add", "select_n"):
            dyn = [u for u in node.ins if not sl.independent(u)]
            const = [u for u in node.ins if sl.independent(u)]
            if name == "select_n":
                pred, cases = node.ins[0], node.ins[1:]
                if len(cases) != 2:
                    return None
                if not sl.independent(pred):
                    raise _NotSparsifiable("the attention mask depends on the function's inputs")
                fill = [i for i, u in enumerate(cases) if sl.independent(u)]
                if len(fill) != 1:
                    return None
                f = sl.scalar(cases[fill[0]])
                if not f <= _NEG_THRESHOLD:
                    raise _NotSparsifiable(f"masked logits are filled with {f}, not a large negative value")
                chain.append(("mask", node, (pred, fill[0] == 1)))  # fill in case 1 -> mask = not pred
                cur = cases[1 - fill[0]]
            elif len(dyn) != 1:
                if name == "add":
                    raise _NotSparsifiable("the additive attention bias depends on the function's inputs")
                if name in ("mul", "div"):
                    raise _NotSparsifiable("the logit scale depends on the function's inputs")
                return None
            elif name == "add":
                chain.append(("bias", node, const[0]))
                cur = dyn[0]
            else:
                if name == "div" and node.ins[0] != dyn[0]:
                    return None
                c = sl.scalar(const[0])
                scale *= c if name == "mul" else 1.0 / c
                cur = dyn[0]
        elif name == "dot_general":
            qk = node
            break
        else:
            raise _NotSparsifiable(f"the attention logits pass through `{name}`, which splat cannot express")
    chain.reverse()
    # labels: QK^T output axis numbers, carried forward to the softmax and to P
    qk_shape = ir.shape(qk.outs[0])
    labels = list(range(len(qk_shape)))
    mask_terms = []
    for kind, node, info in chain:
        if kind == "pass" and node.prim.name == "transpose":
            labels = [labels[a] for a in node.params["permutation"]]
        elif kind == "mask":
            mask_terms.append(("where", info[0], info[1], labels))
        elif kind == "bias":
            mask_terms.append(("bias", info, False, labels))
    kv = labels[axis]
    p_labels = _forward_labels(labels, p_chain)

    (qlc, qrc), (qlb, qrb) = qk.params["dimension_numbers"]
    if len(qlc) != 1:
        return None
    nb = len(qlb)
    lrank, rrank = len(ir.shape(qk.ins[0])), len(ir.shape(qk.ins[1]))
    lfree = [a for a in range(lrank) if a not in qlb and a not in qlc]
    rfree = [a for a in range(rrank) if a not in qrb and a not in qrc]

    def operand_labels(rank, batch, contract, free, offset):
        lab = [None] * rank
        for j, a in enumerate(batch):
            lab[a] = j
        lab[contract[0]] = "d"
        for j, a in enumerate(free):
            lab[a] = offset + j
        return lab

    l_lab = operand_labels(lrank, qlb, qlc, lfree, nb)
    r_lab = operand_labels(rrank, qrb, qrc, rfree, nb + len(lfree))
    if kv in r_lab:
        q_vid, k_vid, q_lab, k_lab = qk.ins[0], qk.ins[1], l_lab, r_lab
    elif kv in l_lab:
        q_vid, k_vid, q_lab, k_lab = qk.ins[1], qk.ins[0], r_lab, l_lab
    else:
        return None
    k_free = [lab for lab in k_lab if isinstance(lab, int) and lab >= nb]
    if any(lab != kv and qk_shape[lab] != 1 for lab in k_free):
        return None
    q_free = [lab for lab in q_lab if isinstance(lab, int) and lab >= nb]

    # P @ V: P's contracting axis must be the kv axis
    p_side = side
    v_vid = pv.ins[1 - p_side]
    p_con = (lc, rc)[p_side][0]
    v_con = (lc, rc)[1 - p_side][0]
    p_bat = (lb, rb)[p_side]
    v_bat = (lb, rb)[1 - p_side]
    if p_labels[p_con] != kv:
        return None
    v_rank = len(ir.shape(v_vid))
    v_lab: list = [None] * v_rank
    v_lab[v_con] = kv
    for pa, va in zip(p_bat, v_bat, strict=False):
        if not (isinstance(p_labels[pa], int) and p_labels[pa] < nb):
            raise _NotSparsifiable("P @ V batches over a query axis; splat cannot express it")
        v_lab[va] = p_labels[pa]
    v_free = [a for a in range(v_rank) if v_lab[a] is None]
    if len(v_free) != 1:
        return None
    v_lab[v_free[0]] = "e"
    p_free = [p_labels[a] for a in range(len(p_labels)) if a != p_con and a not in p_bat]
    out_labels = [p_labels[a] for a in p_bat]
    out_labels += p_free + ["e"] if p_side == 0 else ["e"] + p_free

    # which query-free axis is the sequence axis? the one the masks vary along
    mask_axes: set = set()
    for _, vid, _, lab in mask_terms:
        if len(ir.shape(vid)) == len(lab):
            mask_axes |= {lab[a] for a in sl.deps(vid)}
    if not mask_terms:
        raise _NotSparsifiable("found dense attention without a mask; nothing to sparsify")
    if mask_axes - set(q_free) - {kv}:
        raise _NotSparsifiable("the attention mask differs across batch or heads")
    seq = [lab for lab in q_free if lab in mask_axes]
    if len(seq) > 1:
        raise _NotSparsifiable("the attention mask varies along two query axes")
    if not seq:
        seq = [lab for lab in q_free if qk_shape[lab] == qk_shape[kv]] if len(q_free) > 1 else q_free
        if len(seq) != 1:
            raise _NotSparsifiable("cannot tell which axis of the queries is the sequence axis")
    t = seq[0]
    q_len, kv_len = qk_shape[t], qk_shape[kv]

    mask = _make_mask(sl, mask_terms, t, kv, q_len, kv_len, masks_mod)
    try:
        from splat._analyzer import analyze

        layout = analyze(mask, q_len, kv_len)  # evaluates (and caches) the layout now: errors surface here
    except _NotSparsifiable:
        raise
    except Exception as e:  # a mask splat cannot analyse: report, do not crash the user's model
        raise _NotSparsifiable(f"the detected mask could not be analysed ({type(e).__name__}: {e})") from e
    empty = np.flatnonzero(layout.row_counts() == 0)
    if empty.size and empty_rows != "zero":
        fills = [sl.scalar(n.ins[1 + int(info[1])]) for kind, n, info in chain if kind == "mask"]
        dense = (
            "NaN"
            if any(not np.isfinite(f) for f in fills) or any(k == "bias" for k, _, _ in chain)
            else "mean(V)"
        )
        raise _NotSparsifiable(
            f"the mask leaves {empty.size} query row(s) fully masked (first: row {int(empty[0])}); splat "
            f"outputs 0 there but this function outputs {dense}, so it was left dense "
            '(pass empty_rows="zero" to accept zeros on those rows)'
        )

    # arrangement for splat: q [B, T, heads*group, D], k/v [B, S, heads, D]
    sizes = {lab: qk_shape[lab] for lab in range(len(qk_shape))}
    sizes["e"] = ir.shape(v_vid)[v_free[0]]
    t_pos = q_lab.index(t)
    batch = [lab for i, lab in enumerate(q_lab) if isinstance(lab, int) and lab < nb and i < t_pos]
    heads = [lab for i, lab in enumerate(q_lab) if isinstance(lab, int) and lab < nb and i > t_pos]
    group = [lab for lab in q_free if lab != t]
    n_heads, n_group = math.prod(sizes[h] for h in heads), math.prod(sizes[g] for g in group)
    out_dtype = ir.avals[pv.outs[0]].dtype

    def arrange(x, lab, order, tail):
        present = [lab.index(o) for o in order + [tail] if o in lab]
        extra = [a for a in range(len(lab)) if lab[a] not in order and lab[a] != tail]  # size-1 axes
        x = jnp.transpose(x, present + extra).reshape([x.shape[a] for a in present])
        for i, o in enumerate(order + [tail]):
            if o not in lab:
                x = jnp.expand_dims(x, i)
        return x

    def run(qv, kv_arr, vv):
        from splat._attention import attention

        b = math.prod(sizes[lab] for lab in batch)
        qs = arrange(qv, q_lab, batch + [t] + heads + group, "d").reshape(b, q_len, n_heads * n_group, -1)
        ks = arrange(kv_arr, k_lab, batch + [kv] + heads, "d").reshape(b, kv_len, n_heads, -1)
        vs = arrange(vv, v_lab, batch + [kv] + heads, "e")
        vs = jnp.broadcast_to(vs, [sizes[lab] for lab in batch + [kv] + heads] + [sizes["e"]])
        vs = vs.reshape(b, kv_len, n_heads, -1)
        o = attention(qs, ks, vs, mask=mask, scale=scale, backend=backend)
        order = batch + [t] + heads + group + ["e"]
        o = o.reshape([sizes[lab] for lab in order])
        return jnp.transpose(o, [order.index(lab) for lab in out_labels]).astype(out_dtype)

    found = Found(mask=mask, q_len=q_len, kv_len=kv_len, scale=float(scale), heads=(n_heads, n_group))
    return _Match(pv.outs[0], q_vid, k_vid, v_vid, run, found)


_MASK_CACHE: dict[str, Any] = {}


def _make_mask(sl: _Slices, terms, t, kv, q_len: int, kv_len: int, masks_mod):
    """The Mask of the constant mask terms; equal terms share one Mask value.

    Constructors when the symbolic pass recognises the terms (O(q_len + kv_len) work,
    see ``_recognise``), else an exact ``masks.from_fn`` predicate evaluated in row chunks.
    """
    ir = sl.ir
    parts = []
    for kind, vid, negate, lab in terms:
        roles = tuple("q" if x == t else "k" if x == kv else "0" for x in lab) if ir.shape(vid) else ()
        parts.append((kind, vid, negate, roles))
    key = f"{q_len}x{kv_len}|" + "|".join(f"{k}:{sl.fingerprint(v)}:{n}:{''.join(r)}" for k, v, n, r in parts)
    if key in _MASK_CACHE:
        return _MASK_CACHE[key]
    if len(_MASK_CACHE) > 256:
        _MASK_CACHE.clear()
    mask = _recognise(sl, parts, q_len, kv_len, masks_mod)
    if mask is not None:
        _MASK_CACHE[key] = mask
        return mask

    def predicate(q_idx, kv_idx):
        q_idx, kv_idx = np.asarray(q_idx), np.asarray(kv_idx)
        memo: dict = {}
        out = np.ones(np.broadcast_shapes(q_idx.shape, kv_idx.shape), dtype=bool)
        for kind, vid, negate, roles in parts:
            idx = tuple(q_idx if r == "q" else kv_idx if r == "k" else 0 for r in roles)
            val = np.asarray(sl.value(vid, idx, memo))
            if kind == "bias":
                keep = val > _NEG_THRESHOLD
                if np.any(keep & (val != 0)):
                    raise _NotSparsifiable("the additive attention bias is not a 0 / -inf mask")
                val = keep
            out &= ~val if negate else val.astype(bool)
        return out

    _MASK_CACHE[key] = mask = masks_mod.from_fn(predicate)
    return mask


# --------------------------------------------------------------------------------------
# Symbolic recognition: masks built from iota comparisons -> splat's constructors.
# --------------------------------------------------------------------------------------
#
# Every index of a mask slice is an affine form ``a*i + b*j + c`` in the query index i and
# the key index j. A sub-expression whose value depends on (i, j) only through one
# direction ``t = a*i + b*j`` (``i``, ``j`` or ``d = i - j``) is a *line function*: its value
# at any (i, j) is its value at one sample pair with the same t, so it is known exactly
# from O(q_len + kv_len) samples (evaluated numerically with ``_Slices.value``, whatever
# primitives it uses: rem, floor-div's select dance, abs, clamp, ...). Boolean and/or/not
# of line functions along different directions stay symbolic. The sets of t where each
# line function holds are then matched against the constructors (intervals of d ->
# causal / sliding_window, progressions of d -> strided / dilated_window, prefixes of j
# -> sink, prefixes of i or j -> global_tokens) and every candidate is checked against the
# samples, so a recognised mask equals the user's mask on the whole q_len x kv_len grid.

_DIRS = {(1, 0): "i", (0, 1): "j", (1, -1): "d"}


class _Opaque(Exception):
    """A sub-expression the symbolic pass cannot follow (recognition falls back to from_fn)."""


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


@dataclass(frozen=True)
class _Form:
    """``a*i + b*j + c`` with integer coefficients (an index, or an integer value)."""

    a: int = 0
    b: int = 0
    c: int = 0

    def __add__(self, o):
        if isinstance(o, _Form):
            return _Form(self.a + o.a, self.b + o.b, self.c + o.c)
        if _is_int(o):
            return _Form(self.a, self.b, self.c + int(o))
        raise _Opaque

    __radd__ = __add__

    def __neg__(self):
        return _Form(-self.a, -self.b, -self.c)

    def __sub__(self, o):
        return self + (-o)

    def __rsub__(self, o):
        return (-self) + o

    def __mul__(self, o):
        if _is_int(o):
            k = int(o)
            return _Form(self.a * k, self.b * k, self.c * k)
        raise _Opaque

    __rmul__ = __mul__

    def __floordiv__(self, o):
        raise _Opaque

    __mod__ = __rfloordiv__ = __rmod__ = __floordiv__

    def direction(self) -> tuple[int, int] | None:
        if self.a == 0 and self.b == 0:
            return None
        g = math.gcd(self.a, self.b)
        a, b = self.a // g, self.b // g
        return (a, b) if (a > 0 or (a == 0 and b > 0)) else (-a, -b)

    def at(self, i, j):
        return self.a * i + self.b * j + self.c


def _form(x) -> _Form:
    if isinstance(x, _Form):
        return x
    if _is_int(x):
        return _Form(0, 0, int(x))
    raise _Opaque


@dataclass(frozen=True)
class _Const:
    value: Any  # numpy scalar


@dataclass(frozen=True)
class _Aff:
    form: _Form  # an integer value


@dataclass(frozen=True)
class _Line:
    """Value of node ``vid`` at index forms ``idx``; depends on (i, j) only through ``dir``."""

    dir: tuple[int, int]
    vid: int
    idx: tuple


@dataclass(frozen=True)
class _Logic:
    """``op`` in and / or / not over boolean values (lines along different directions)."""

    op: str
    args: tuple


@dataclass(frozen=True)
class _Select:
    """``select_n(pred, c0, c1)`` with a logical ``pred`` and constant cases (e.g. a 0/-inf bias)."""

    pred: Any
    cases: tuple


_CMP = ("eq", "ne", "lt", "le", "gt", "ge")


def _direction(v) -> tuple[int, int] | None:
    if isinstance(v, _Const):
        return None
    if isinstance(v, _Aff):
        return v.form.direction()
    if isinstance(v, _Line):
        return v.dir
    raise _Opaque


class _Symbolic:
    """The symbolic pass over one IR's constant slices (memoised per (vid, index forms))."""

    def __init__(self, sl: _Slices):
        self.sl = sl
        self.memo: dict = {}
        self._line_of: dict[int, Any] = {}

    def sym(self, vid: int, idx: tuple):
        key = (vid, idx)
        if key not in self.memo:
            try:
                self.memo[key] = self._sym(vid, idx)
            except _Opaque:
                self.memo[key] = None
        out = self.memo[key]
        if out is None:
            raise _Opaque
        return out

    def numeric(self, vid: int, idx: tuple, i, j, memo: dict):
        return np.asarray(self.sl.value(vid, tuple(np.asarray(f.at(i, j)) for f in idx), memo))

    def _const(self, vid, idx):
        return _Const(self.numeric(vid, idx, 0, 0, {})[()])

    def _sym(self, vid: int, idx: tuple):
        sl, ir = self.sl, self.sl.ir
        shape = ir.shape(vid)
        dtype = np.dtype(ir.avals[vid].dtype)
        if vid in ir.consts or vid in sl._dense:
            c = sl._dense[vid] if vid in sl._dense else np.asarray(ir.consts[vid])
            if isinstance(ir.consts.get(vid), jax.core.Tracer):
                raise _Opaque
            vary = sorted(sl.deps(vid))
            dirs = {idx[a].direction() for a in vary} - {None}
            if not dirs:
                return self._const(vid, idx)
            if len(dirs) > 1:
                raise _Opaque
            if len(vary) == 1 and np.issubdtype(c.dtype, np.integer):
                a = vary[0]
                line = np.moveaxis(c, a, 0).reshape(c.shape[a], -1)[:, 0].astype(np.int64)
                step = int(line[1] - line[0])
                if np.all(np.diff(line) == step):  # an arange computed outside the trace
                    return _Aff(idx[a] * step + int(line[0]))
            return _Line(dirs.pop(), vid, idx)
        node = ir.node_of(vid)
        name, p, ins = node.prim.name, node.params, node.ins

        def sub(u, uidx):
            return self.sym(u, tuple(_form(x) for x in uidx))

        def same(u):
            return sub(u, idx if len(ir.shape(u)) == len(shape) else ())

        if name == "iota":
            f = idx[p["dimension"]]
            return _Aff(f) if np.issubdtype(dtype, np.integer) else self._line(vid, idx, [_Aff(f)])
        if name == "broadcast_in_dim":
            ishape = ir.shape(ins[0])
            bd = p["broadcast_dimensions"]
            return sub(ins[0], tuple(idx[bd[a]] if ishape[a] > 1 else 0 for a in range(len(ishape))))
        if name == "transpose":
            inv = [None] * len(p["permutation"])
            for k, a in enumerate(p["permutation"]):
                inv[a] = idx[k]
            return sub(ins[0], tuple(inv))
        if name in ("reshape", "squeeze"):
            ishape = ir.shape(ins[0])
            m = _size1_map(ishape, shape)
            if m is None:
                raise _Opaque
            back = {i: o for o, i in m.items()}
            return sub(ins[0], tuple(idx[back[a]] if a in back else 0 for a in range(len(ishape))))
        if name == "slice":
            strides = p["strides"] or (1,) * len(shape)
            return sub(
                ins[0], tuple(s + i * st for s, i, st in zip(p["start_indices"], idx, strides, strict=False))
            )
        if name == "rev":
            ishape = ir.shape(ins[0])
            return sub(
                ins[0], tuple(ishape[a] - 1 - i if a in p["dimensions"] else i for a, i in enumerate(idx))
            )
        if name == "convert_element_type":
            v = same(ins[0])
            if isinstance(v, _Const):
                return self._const(vid, idx)
            if isinstance(v, _Aff) and np.issubdtype(dtype, np.integer):
                return v
            if (
                isinstance(v, (_Logic, _Select))
                and dtype == np.bool_
                and np.dtype(ir.avals[ins[0]].dtype) == np.bool_
            ):
                return v
            if isinstance(v, _Logic):  # bool -> number: a select between 0 and 1
                v = _Select(v, (np.bool_(False), np.bool_(True)))
            if isinstance(v, _Select):
                return _Select(v.pred, tuple(np.asarray(c).astype(dtype)[()] for c in v.cases))
            return self._line(vid, idx, [v])
        if name not in _ELEMENTWISE and name not in _EXTRA_ELEMENTWISE:
            raise _Opaque
        args = [same(u) for u in ins]
        if all(isinstance(v, _Const) for v in args):
            return self._const(vid, idx)
        if np.issubdtype(dtype, np.integer) and all(isinstance(v, (_Const, _Aff)) for v in args):
            forms = [v.form if isinstance(v, _Aff) else v.value for v in args]
            if all(isinstance(f, _Form) or _is_int(f) for f in forms):
                if name in ("add", "sub") or (name == "mul" and any(_is_int(f) for f in forms)):
                    x, y = forms
                    return _Aff(_form(x + y if name == "add" else x - y if name == "sub" else x * y))
                if name == "neg":
                    return _Aff(-forms[0])
        if name in _CMP and all(isinstance(v, (_Const, _Aff)) for v in args):
            try:
                x, y = (_form(v.form if isinstance(v, _Aff) else v.value) for v in args)
            except _Opaque:  # e.g. a float threshold: the generic rule below still applies
                pass
            else:
                d = (x - y).direction()  # a comparison of two forms only sees their difference
                return self._const(vid, idx) if d is None else _Line(d, vid, idx)
        logic = any(isinstance(v, (_Logic, _Select)) for v in args)
        if not logic:
            dirs = {_direction(v) for v in args} - {None}
            if len(dirs) == 1:
                return _Line(dirs.pop(), vid, idx)
        if dtype == np.bool_ and name in ("and", "or", "not"):
            return _Logic(name, tuple(args))
        if name == "select_n" and len(args) == 3 and isinstance(args[0], (_Logic, _Line)):
            if all(isinstance(v, _Const) for v in args[1:]):
                return _Select(args[0], tuple(v.value for v in args[1:]))
        raise _Opaque

    def _line(self, vid, idx, args):
        dirs = {_direction(v) for v in args} - {None}
        if len(dirs) != 1:
            raise _Opaque
        return _Line(dirs.pop(), vid, idx)


def _samples(direction: str, q_len: int, kv_len: int):
    """(t values, i, j): one in-range (i, j) per value t of the direction."""
    if direction == "i":
        t = np.arange(q_len)
        return t, t, np.zeros_like(t)
    if direction == "j":
        t = np.arange(kv_len)
        return t, np.zeros_like(t), t
    t = np.arange(-(kv_len - 1), q_len)
    return t, np.maximum(t, 0), np.maximum(-t, 0)


class _Recogniser:
    """Turns the symbolic mask terms into a Mask made of constructors, or None."""

    def __init__(self, sym: _Symbolic, q_len: int, kv_len: int, masks_mod):
        self.sym, self.q_len, self.kv_len, self.m = sym, q_len, kv_len, masks_mod
        self.memo: dict = {}

    # -- sets of t where a line function holds ----------------------------------------
    def line_set(self, v: _Line, kind: str = "where") -> tuple[str, np.ndarray]:
        name = _DIRS.get(v.dir)
        if name is None:
            raise _Opaque
        _, i, j = _samples(name, self.q_len, self.kv_len)
        a, b = v.dir
        # the node sees t through its own forms; any (i, j) with a*i + b*j = t gives the same value
        vals = np.broadcast_to(self.sym.numeric(v.vid, v.idx, i, j, self.memo), i.shape)
        return name, self._keep(vals, kind)

    @staticmethod
    def _keep(vals, kind):
        vals = np.asarray(vals)
        if kind == "where":
            return vals.astype(bool)
        keep = vals > _NEG_THRESHOLD
        if np.any(keep & (vals != 0)):
            raise _NotSparsifiable("the additive attention bias is not a 0 / -inf mask")
        return keep

    # -- formulas ----------------------------------------------------------------------
    def formula(self, v, kind: str = "where"):
        """NNF-ready formula: ('set', dir, bool array) | ('and'|'or', [..]) | ('const', bool)."""
        if isinstance(v, _Const):
            return ("const", bool(self._keep(np.asarray(v.value), kind)))
        if isinstance(v, _Line):
            return ("set",) + self.line_set(v, kind)
        if isinstance(v, _Select):
            keep = [bool(self._keep(np.asarray(c), kind)) for c in v.cases]
            pred = self.formula(v.pred)
            if keep == [False, True]:
                return pred
            if keep == [True, False]:
                return self.negate(pred)
            return ("const", keep[0])
        if isinstance(v, _Logic) and kind == "where":
            parts = [self.formula(a) for a in v.args]
            if v.op == "not":
                return self.negate(parts[0])
            return (v.op, parts)
        raise _Opaque

    def negate(self, f):
        if f[0] == "const":
            return ("const", not f[1])
        if f[0] == "set":
            return ("set", f[1], ~f[2])
        return ("or" if f[0] == "and" else "and", [self.negate(x) for x in f[1]])

    # -- formula -> Mask ----------------------------------------------------------------
    def to_mask(self, f):
        """A Mask equal to formula ``f`` on the grid; None when f holds nowhere."""
        if f[0] == "const":
            return self.m.full() if f[1] else None
        if f[0] == "set":
            return self.and_sets({f[1]: f[2]}, [])
        op, parts = f
        flat, stack = [], list(parts)
        while stack:  # (a | b) | c -> a | b | c, so rows and columns of global tokens meet
            x = stack.pop()
            if x[0] == op:
                stack.extend(x[1])
            else:
                flat.append(x)
        parts = flat[::-1]
        sets: dict[str, np.ndarray] = {}
        others = []
        for x in parts:
            if x[0] == "const":
                if x[1] == (op == "or"):
                    return self.m.full() if op == "or" else None
                continue
            if x[0] == "set":
                prev = sets.get(x[1])
                sets[x[1]] = x[2] if prev is None else (prev | x[2] if op == "or" else prev & x[2])
            else:
                others.append(self.to_mask(x))
        if op == "and":
            if any(o is None for o in others):
                return None
            return self.and_sets(sets, others)
        return self.or_sets(sets, [o for o in others if o is not None])

    @staticmethod
    def _prefix(s: np.ndarray) -> int | None:
        """n when ``s`` is True exactly on [0, n), else None."""
        n = int(s.sum())
        return n if s[:n].all() else None

    def and_sets(self, sets, others):
        m = self.m
        parts = list(others)
        if "i" in sets:
            if not sets["i"].any():
                return None
            if not sets["i"].all():
                raise _Opaque  # rows outside the set would be empty: let the exact path decide
        if "j" in sets:
            n = self._prefix(sets["j"])
            if n == 0:
                return None
            if n is None:
                raise _Opaque
            if n < self.kv_len:
                parts.append(m.sink(n))
        if "d" in sets:
            if not sets["d"].any():
                return None
            parts.append(self.d_mask(sets["d"]))
        return self._combine(parts, "and")

    def or_sets(self, sets, others):
        m = self.m
        parts = list(others)
        rows = sets.get("i", np.zeros(self.q_len, bool))
        cols = sets.get("j", np.zeros(self.kv_len, bool))
        nr, nc = self._prefix(rows), self._prefix(cols)
        if nr is None or nc is None:
            raise _Opaque
        if nr >= self.q_len or nc >= self.kv_len:
            return m.full()
        if nr and nr > nc:
            raise _Opaque  # query rows without their key columns: no constructor for that
        if nr:
            parts.append(m.global_tokens(nr))
        if nc > nr:
            parts.append(m.sink(nc))
        if "d" in sets and sets["d"].any():
            parts.append(self.d_mask(sets["d"]))
        return self._combine(parts, "or")

    def _combine(self, parts, op):
        if not parts:
            return self.m.full() if op == "and" else None
        out = parts[0]
        for x in parts[1:]:
            out = (out & x) if op == "and" else (out | x)
        return out

    def d_mask(self, s: np.ndarray):
        """Constructor(s) for the set of d = i - j in ``s`` (over d in [-(kv_len-1), q_len-1])."""
        m = self.m
        t, i, j = _samples("d", self.q_len, self.kv_len)
        if s.all():
            return m.full()
        sel = t[s]
        if 0 not in sel:
            raise _Opaque  # bands that exclude the diagonal are not a single constructor
        lo, hi = int(sel[0]), int(sel[-1])
        steps = np.unique(np.diff(sel))
        if steps.size > 1:
            raise _Opaque
        p = int(steps[0]) if steps.size else 1
        if p == 1:
            cands = [m.causal()] if (lo, hi) == (0, self.q_len - 1) else []
            cands.append(m.sliding_window(hi, -lo))
        elif lo == 0:
            cands = [m.strided(p), m.strided(p) & m.sliding_window(hi, 0)]
        else:
            r = max(-lo, hi)
            cands = [m.dilated_window(r, p), m.dilated_window(r, p) & m.sliding_window(hi, -lo)]
        for c in cands:
            if np.array_equal(np.asarray(c(i, j), bool), s):  # exact on every d of the grid
                return c
        raise _Opaque


def _recognise(sl: _Slices, parts, q_len: int, kv_len: int, masks_mod):
    """Constructor expression equal to the AND of the mask ``parts``, or None (use from_fn)."""
    sym = _Symbolic(sl)
    rec = _Recogniser(sym, q_len, kv_len, masks_mod)
    roles_form = {"q": _Form(1, 0, 0), "k": _Form(0, 1, 0), "0": _Form()}
    try:
        formulas = []
        for kind, vid, negate, roles in parts:
            v = sym.sym(vid, tuple(roles_form[r] for r in roles))
            f = rec.formula(v, "where" if kind == "where" else "bias")
            formulas.append(rec.negate(f) if negate else f)
        f = formulas[0] if len(formulas) == 1 else ("and", formulas)
        return rec.to_mask(f)
    except _Opaque:
        return None


# --------------------------------------------------------------------------------------
# The decorator
# --------------------------------------------------------------------------------------


@dataclass
class _Plan:
    ir: _IR | None
    matches: list[_Match]
    problems: list[str]
    out_tree: Any
    cacheable: bool


def _is_static(x) -> bool:
    if isinstance(x, jax.core.Tracer):
        return False
    if isinstance(x, (np.ndarray, jax.Array)):
        return x.dtype == np.bool_
    return not hasattr(x, "shape")


def _static_key(x):
    if isinstance(x, (np.ndarray, jax.Array)):
        a = np.asarray(x)
        return ("bool", a.shape, hashlib.blake2b(np.packbits(a).tobytes(), digest_size=16).hexdigest())
    try:
        hash(x)
        return x
    except TypeError:
        return ("id", id(x))


def _analyse(fn, args, kwargs, backend: str, empty_rows: str = "fallback") -> tuple[_Plan, list, Any]:
    from splat import masks as masks_mod

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
    ir = _build_ir(closed)
    sl = _Slices(ir)
    matches, problems = [], []
    for node in ir.nodes:
        if node.prim.name != "dot_general":
            continue
        try:
            m = _match_pv(ir, sl, node, masks_mod, backend, empty_rows)
        except _NotSparsifiable as e:
            problems.append(str(e))
            continue
        if m is not None:
            matches.append(m)
    cacheable = not any(isinstance(c, jax.core.Tracer) for c in ir.consts.values())
    return _Plan(ir, matches, problems, out_tree, cacheable), dyn, treedef


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
    masked) @ v`` (einsum or matmul form, ``jax.nn.dot_product_attention``,
    ``flax.nnx.dot_product_attention``) whose mask is a compile-time constant
    (built from ``jnp.arange``/iota comparisons or constant arrays) is replaced
    by :func:`splat.attention` with that mask. Masks made of iota comparisons
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
    cache: dict = {}
    warned: set = set()
    name = getattr(fn, "__qualname__", repr(fn))

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

    def report(problems: list[str], none_found: bool):
        reasons = sorted(set(problems)) or ["no dense attention with a constant mask was found"]
        msg = "; ".join(reasons)
        if none_found and not fallback:
            raise ValueError(f"splat.sparsify({name}): {msg} (pass fallback=True to run the dense function)")
        if msg not in warned:
            warned.add(msg)
            tail = "running the original dense function" if none_found else "those attentions stay dense"
            warnings.warn(f"splat.sparsify({name}): {msg}; {tail}", SparsifyWarning, stacklevel=3)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        plan, dyn = plan_for(args, kwargs)
        if not plan.matches:
            report(plan.problems, True)
            return fn(*args, **kwargs)
        if plan.problems:
            report(plan.problems, False)
        replace = {m.pv_out: ([m.q, m.k, m.v], m.fn) for m in plan.matches}
        outs = _run_ir(plan.ir, dyn, replace)
        return jax.tree.unflatten(plan.out_tree, outs)

    def inspect(*args, **kwargs) -> list[Found]:
        return [m.found for m in plan_for(args, kwargs)[0].matches]

    def problems(*args, **kwargs) -> list[str]:
        return list(plan_for(args, kwargs)[0].problems)

    wrapper.inspect = inspect
    wrapper.problems = problems
    return wrapper
