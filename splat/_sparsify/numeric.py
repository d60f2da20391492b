"""Numeric slices: exact values of a mask's constant sub-graph at chosen index arrays.

A mask, fill or scale in an attention jaxpr is a *constant slice*: its backward slice reaches only
literals, closed-over constants and ``iota``. :class:`Slices` answers three questions about such a
value without materialising it: is it constant (``independent``), along which axes does it vary
(``deps``), and what is it at given broadcastable index arrays (``value``: ``iota`` reads the index
of its dimension, shape ops remap indices with :func:`indexing.operand_index`, constants are
gathered, elementwise ops run in numpy). Primitives it does not know are evaluated whole, when small.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections.abc import Callable

import jax
import numpy as np

from splat._sparsify.indexing import SHAPE_OPS, operand_index, reshape_groups, size1_map
from splat._sparsify.ir import IR, bind_params

__all__ = [
    "ELEMENTWISE",
    "EXTRA_ELEMENTWISE",
    "NEG_THRESHOLD",
    "NotSparsifiable",
    "TESTS",
    "Slices",
    "is_random",
    "kept",
    "operand_idx",
]

# A where-fill or additive-bias entry at or below this counts as "masked out".
NEG_THRESHOLD = -1e4
# Unsupported mask primitives are evaluated whole when their output is at most this big.
_MAX_DENSE_EVAL = 1 << 22


class NotSparsifiable(Exception):
    """A candidate attention was found but cannot be handed to splat (message says why)."""


# comparison tests a mask term may apply to its value (``kind`` ("test", op, c), see ``kept``)
TESTS: dict[str, Callable] = {
    "eq": np.equal,
    "ne": np.not_equal,
    "lt": np.less,
    "le": np.less_equal,
    "gt": np.greater,
    "ge": np.greater_equal,
}


def kept(vals, kind) -> np.ndarray:
    """Where a mask term keeps the logit.

    ``kind``: "where" (a predicate, kept where nonzero), "bias" (0 / -inf), or
    ``("test", op, c)``: kept where ``op(value, c)`` (a comparison pushed down through
    ``min``/``max`` of integer masks, see ``predicate.split_predicate``).

    Raises:
      NotSparsifiable: a bias entry is neither 0 nor at most ``NEG_THRESHOLD``.
    """
    vals = np.asarray(vals)
    if isinstance(kind, tuple):
        return TESTS[kind[1]](vals, kind[2])
    if kind == "where":
        return vals.astype(bool)
    keep = vals > NEG_THRESHOLD
    if np.any(keep & (vals != 0)):
        raise NotSparsifiable("the additive attention bias is not a 0 / -inf mask")
    return keep


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


# lax elementwise primitive -> numpy function with the same semantics
ELEMENTWISE: dict[str, Callable] = {
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
    **TESTS,
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
# elementwise primitives with parameters or a predicate operand, handled one by one
EXTRA_ELEMENTWISE = ("select_n", "clamp", "integer_pow")


def is_random(node) -> bool:
    """A primitive whose value is not a function of its operands (random bits, side effects)."""
    name = node.prim.name
    return name.startswith(("random_", "threefry")) or "rng" in name or bool(node.effects)


def operand_idx(idx: tuple, shape, operand_shape) -> tuple:
    """The index of an elementwise operand: the same, or () for a scalar; 0 on its size-1 axes.

    Since jax 0.10 elementwise primitives broadcast size-1 axes implicitly (vmapped softmaxes
    subtract a ``[..., 1]`` row max from ``[..., S]`` logits), so an operand's size-1 axis must
    read index 0 whatever the output index is.
    """
    if len(operand_shape) != len(shape):
        return ()
    return tuple(0 if n == 1 and m != 1 else i for i, n, m in zip(idx, operand_shape, shape, strict=True))


class Slices:
    """Questions about constant sub-graphs of an IR: independence, dependence axes, values.

    ``index_of``: value id -> ``(axis, side)``, side "q", "k" or "qk" (one array for both, read
    along its axis). Such a value is read as the
    query (key) index, like an ``iota`` along that axis: a position array computed from the
    inputs (``cumsum(mask) - 1``, a cache's ``cache_index + i``) stands for the index, so that a
    mask built on positions is a constant mask *at* those positions (see ``positions``). While a
    mask is evaluated on a grid (:meth:`at_grid`), it reads the grid's query (key) indices
    directly: a one-token query's axis has size 1, and shape ops would read index 0 there.

    Side "start" marks a scalar computed from the inputs that starts a ``dynamic_slice`` of a
    constant along the query axis (a constant mask's rows taken at a cache index): the slice's
    row ``i`` is the constant's row ``start + i``, the query's position, so the slice reads the
    constant at the query index (on a grid, at the grid's query index).

    Side "held" marks a position array held still: independent of the inputs, and the same
    (0) everywhere, so that :meth:`deps` tells the axes a mask term reads by *index*
    (``positions.index_atoms``).
    """

    def __init__(self, ir: IR, index_of: dict[int, tuple[int, str]] | None = None):
        self.ir = ir
        self.index_of: dict[int, tuple[int, str]] = dict(index_of or {})
        self.grid: tuple | None = None
        self._indep: dict[int, bool] = {}
        self._deps: dict[int, frozenset] = {}
        self._dense: dict[int, np.ndarray] = {}
        self._fp: dict[int, str] = {}

    def constant(self, vid: int) -> np.ndarray | None:
        """The whole value of ``vid`` when it is known as an array (a constant, or evaluated whole)."""
        if vid in self._dense:
            return self._dense[vid]
        c = self.ir.consts.get(vid)
        if c is not None and not isinstance(c, jax.core.Tracer):
            return np.asarray(c)
        return None

    # -- input independence ------------------------------------------------------------
    def independent(self, vid: int) -> bool:
        """True when ``vid`` depends only on literals, constants and iota (no inputs)."""
        ir = self.ir
        stack = [(vid, False)]
        while stack:
            v, ready = stack.pop()
            if v in self._indep:
                continue
            if v in self.index_of:
                self._indep[v] = True
                continue
            node = ir.node_of(v)
            if node is None:  # a function input, or a constant (a tracer of an enclosing trace is not)
                self._indep[v] = v in ir.consts and not isinstance(ir.consts[v], jax.core.Tracer)
            elif not ready:
                stack.append((v, True))
                stack.extend((u, False) for u in node.ins if u not in self._indep)
            else:
                # a constant through any pure primitive stays constant, multiple-result ones
                # (custom_jvp functions such as relu, sorts) included
                self._indep[v] = not is_random(node) and all(self._indep[u] for u in node.ins)
        return self._indep[vid]

    # -- axes a constant value varies along --------------------------------------------
    def deps(self, vid: int) -> frozenset:
        """The axes of ``vid`` along which its value is not constant."""
        if vid in self._deps:
            return self._deps[vid]
        ir = self.ir
        shape = ir.shape(vid)
        c = self.constant(vid)
        node = ir.node_of(vid)
        if vid in self.index_of:
            a, side = self.index_of[vid]
            d = frozenset([a]) if side not in ("start", "held") and shape[a] > 1 else frozenset()
        elif c is not None:
            d = frozenset(a for a in range(c.ndim) if c.shape[a] > 1 and np.any(np.take(c, [0], axis=a) != c))
        elif node is None:  # an input or an outer tracer: may vary along every axis
            d = frozenset(a for a, n in enumerate(shape) if n > 1)
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
                m = size1_map(ir.shape(ins[0]), shape)
                if m is not None:
                    d = frozenset(o for o, i in m.items() if i in src)
                else:  # an output axis varies only if an input axis of its reshape group does
                    groups = reshape_groups(ir.shape(ins[0]), shape)
                    d = frozenset(o for gi, go in groups if src & set(gi) for o in go if shape[o] > 1)
            elif (
                name in ("slice", "dynamic_slice", "rev", "convert_element_type")
                or name in ELEMENTWISE
                or name in EXTRA_ELEMENTWISE
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
            raise NotSparsifiable(
                f"the mask uses `{node.prim.name}` on a {ir.shape(vid)} array, "
                "which splat cannot evaluate lazily"
            )
        invals = [self.full(u) for u in node.ins]
        subfuns, params = bind_params(node)
        try:
            with jax.ensure_compile_time_eval():
                ans = node.prim.bind(*subfuns, *invals, **params)
        except Exception as e:
            raise NotSparsifiable(
                f"the mask uses `{node.prim.name}`, which splat cannot evaluate ({type(e).__name__})"
            ) from e
        if node.prim.multiple_results:  # e.g. a custom_jvp function: keep every output
            for o, a in zip(node.outs, ans, strict=True):
                self._dense[o] = np.asarray(a)
        else:
            self._dense[vid] = np.asarray(ans)

    @contextlib.contextmanager
    def at_grid(self, i, j):
        """Evaluate with the position arrays reading query indices ``i`` and key indices ``j``."""
        prev, self.grid = self.grid, (np.asarray(i), np.asarray(j))
        try:
            yield
        finally:
            self.grid = prev

    def full(self, vid: int) -> np.ndarray:
        """The whole value of ``vid`` (small values only: used to evaluate unknown primitives)."""
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
        if vid in self.index_of:
            a, side = self.index_of[vid]
            if side == "held":
                return np.zeros((), ir.avals[vid].dtype)
            x = idx[a] if self.grid is None or side == "qk" else self.grid[0 if side == "q" else 1]
            return np.asarray(x).astype(ir.avals[vid].dtype)
        c = self.constant(vid)
        if c is not None:
            if c.ndim == 0:
                return c
            return c[tuple(i if c.shape[a] > 1 else 0 for a, i in enumerate(idx))]
        node = ir.node_of(vid)
        name, p, ins = node.prim.name, node.params, node.ins

        def same(u):  # operand of an elementwise op: same index, or a scalar
            return self.value(u, operand_idx(idx, shape, ir.shape(u)), memo)

        if name in SHAPE_OPS:
            return self.value(ins[0], operand_index(name, p, ir.shape(ins[0]), shape, idx), memo)
        if name == "dynamic_slice":
            query = None if self.grid is None else self.grid[0]
            return self.value(ins[0], self.slice_index(vid, idx, query), memo)
        if name == "iota":
            return np.asarray(idx[p["dimension"]]).astype(p["dtype"])
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
        if name in ELEMENTWISE:
            return np.asarray(ELEMENTWISE[name](*[same(u) for u in ins]))
        self._materialise(vid)
        return self._value(vid, idx, memo)

    def slice_index(self, vid: int, idx: tuple, query=None) -> tuple:
        """The operand index that output ``idx`` of ``dynamic_slice`` ``vid`` reads: each start
        clamped into the operand as ``lax.dynamic_slice`` does, plus the index; along the axis of
        a "start" (see the class), the query index ``query`` (the grid's, or a symbolic form; by
        default the axis' own index)."""
        ir = self.ir
        node = ir.node_of(vid)
        in_shape, out_shape = ir.shape(node.ins[0]), ir.shape(vid)
        src = []
        for a, u in enumerate(node.ins[1:]):
            if self.index_of.get(u, (0, ""))[1] == "start":
                src.append(idx[a] if query is None else query)
                continue
            if not self.independent(u):
                raise NotSparsifiable("the mask slices a constant at a start computed from the inputs")
            start = int(self.scalar(u))
            src.append(idx[a] + min(max(start, 0), in_shape[a] - out_shape[a]))
        return tuple(src)

    def scalar(self, vid: int) -> float:
        """The value of a constant that is the same everywhere."""
        if self.deps(vid):
            raise NotSparsifiable("a scale or fill value varies across positions")
        return np.asarray(self.value(vid, (0,) * len(self.ir.shape(vid)), {})).item()

    # -- structural fingerprints (equal slices -> one shared Mask) ----------------------
    def _uniform(self, vid: int):
        """The value of a computed constant that is the same everywhere, else None."""
        try:
            if not self.independent(vid) or self.deps(vid):
                return None
            return self.scalar(vid)
        except NotSparsifiable:
            return None

    def fingerprint(self, vid: int) -> str:
        """A hash of ``vid``'s slice (primitives, parameters, constants; a computed constant the same
        everywhere by its value): equal slices, equal hashes."""
        if vid in self._fp:
            return self._fp[vid]
        ir = self.ir
        c = self.constant(vid) if ir.node_of(vid) is None else None
        if vid in self.index_of:  # a position array: an index, whatever computed it
            fp = f"index({self.index_of[vid][1]},{ir.avals[vid].dtype})"
        elif c is not None:
            h = hashlib.blake2b(np.ascontiguousarray(c).tobytes(), digest_size=12).hexdigest()
            fp = f"c({c.dtype},{c.shape},{h})"
        elif ir.node_of(vid) is None:  # an input, or an opaque outer tracer: only itself
            fp = f"input({vid})"
        elif (uniform := self._uniform(vid)) is not None:  # -inf and convert(-inf) alike
            fp = f"u({ir.avals[vid].dtype},{ir.shape(vid)},{uniform!r})"
        else:
            node = ir.node_of(vid)
            k = ir.prod[vid][1]
            params = ",".join(f"{n}={node.params[n]!r}" for n in sorted(node.params))
            fp = f"{node.prim.name}[{params}]#{k}(" + ";".join(self.fingerprint(u) for u in node.ins) + ")"
        fp = hashlib.blake2b(fp.encode(), digest_size=16).hexdigest()
        self._fp[vid] = fp
        return fp
