"""Symbolic recognition: masks built from iota comparisons become splat's constructors.

Every index of a mask slice is an affine form ``a*i + b*j + c`` in the query index i and
the key index j. A sub-expression whose value depends on (i, j) only through one
direction ``t = a*i + b*j`` (``i``, ``j`` or ``d = i - j``) is a *line function*: its value
at any (i, j) is its value at one sample pair with the same t, so it is known exactly
from O(q_len + kv_len) samples (evaluated numerically with ``Slices.value``, whatever
primitives it uses: rem, floor-div's select dance, abs, clamp, ...). Boolean and/or/not
of line functions along different directions stay symbolic. The sets of t where each
line function holds are then matched against the constructors (intervals of d ->
causal / sliding_window, progressions of d -> strided / dilated_window, prefixes of j
-> sink, prefixes of i or j -> global_tokens) and every candidate is checked against the
samples, so a recognised mask equals the user's mask on the whole q_len x kv_len grid.

Entry point: :func:`recognise`; it returns None where the terms are not such a mask (the
matcher then builds an exact ``masks.from_fn`` predicate).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from splat import masks
from splat._sparsify.indexing import SHAPE_OPS, operand_index
from splat._sparsify.numeric import ELEMENTWISE, EXTRA_ELEMENTWISE, Slices, kept

__all__ = ["recognise"]

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

    def __init__(self, sl: Slices):
        self.sl = sl
        self.memo: dict = {}

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
        if isinstance(ir.consts.get(vid), jax.core.Tracer):
            raise _Opaque
        c = sl.constant(vid)
        if c is not None:
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

        if name in SHAPE_OPS:  # a general reshape needs // and % of forms: _Form raises _Opaque there
            return sub(ins[0], operand_index(name, p, ir.shape(ins[0]), shape, idx))
        if name == "iota":
            f = idx[p["dimension"]]
            return _Aff(f) if np.issubdtype(dtype, np.integer) else self._line(vid, idx, [_Aff(f)])
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
        if name not in ELEMENTWISE and name not in EXTRA_ELEMENTWISE:
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

    def __init__(self, sym: _Symbolic, q_len: int, kv_len: int):
        self.sym, self.q_len, self.kv_len = sym, q_len, kv_len
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
        return name, kept(vals, kind)

    # -- formulas ----------------------------------------------------------------------
    def formula(self, v, kind: str = "where"):
        """NNF-ready formula: ('set', dir, bool array) | ('and'|'or', [..]) | ('const', bool)."""
        if isinstance(v, _Const):
            return ("const", bool(kept(np.asarray(v.value), kind)))
        if isinstance(v, _Line):
            return ("set",) + self.line_set(v, kind)
        if isinstance(v, _Select):
            keep = [bool(kept(np.asarray(c), kind)) for c in v.cases]
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
            return masks.full() if f[1] else None
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
                    return masks.full() if op == "or" else None
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
                parts.append(masks.sink(n, causal=False))
        if "d" in sets:
            if not sets["d"].any():
                return None
            parts.append(self.d_mask(sets["d"]))
        return self._combine(parts, "and")

    def or_sets(self, sets, others):
        parts = list(others)
        rows = sets.get("i", np.zeros(self.q_len, bool))
        cols = sets.get("j", np.zeros(self.kv_len, bool))
        nr, nc = self._prefix(rows), self._prefix(cols)
        if nr is None or nc is None:
            raise _Opaque
        if nr >= self.q_len or nc >= self.kv_len:
            return masks.full()
        if nr and nr > nc:
            raise _Opaque  # query rows without their key columns: no constructor for that
        if nr:
            parts.append(masks.global_tokens(nr))
        if nc > nr:
            parts.append(masks.sink(nc, causal=False))
        if "d" in sets and sets["d"].any():
            parts.append(self.d_mask(sets["d"]))
        return self._combine(parts, "or")

    def _combine(self, parts, op):
        if not parts:
            return masks.full() if op == "and" else None
        out = parts[0]
        for x in parts[1:]:
            out = (out & x) if op == "and" else (out | x)
        return out

    def d_mask(self, s: np.ndarray):
        """Constructor(s) for the set of d = i - j in ``s`` (over d in [-(kv_len-1), q_len-1])."""
        t, i, j = _samples("d", self.q_len, self.kv_len)
        if s.all():
            return masks.full()
        sel = t[s]
        if 0 not in sel:
            raise _Opaque  # bands that exclude the diagonal are not a single constructor
        lo, hi = int(sel[0]), int(sel[-1])
        steps = np.unique(np.diff(sel))
        if steps.size > 1:
            raise _Opaque
        p = int(steps[0]) if steps.size else 1
        if p == 1:
            cands = [masks.causal()] if (lo, hi) == (0, self.q_len - 1) else []
            cands.append(masks.sliding_window(hi, -lo))
        elif lo == 0:
            cands = [masks.strided(p), masks.strided(p) & masks.sliding_window(hi, 0)]
        else:
            r = max(-lo, hi)
            cands = [masks.dilated_window(r, p), masks.dilated_window(r, p) & masks.sliding_window(hi, -lo)]
        for c in cands:
            if np.array_equal(np.asarray(c(i, j), bool), s):  # exact on every d of the grid
                return c
        raise _Opaque


def recognise(sl: Slices, parts, q_len: int, kv_len: int) -> masks.Mask | None:
    """Constructor expression equal to the AND of the mask ``parts``, or None (use from_fn).

    Args:
      sl: the slices of the IR the parts live in.
      parts: ``(kind, vid, negate, roles)`` per mask term: ``kind`` "where" (boolean predicate)
        or "bias" (0 / -inf), ``negate`` when the term masks where it holds, ``roles`` one of
        "q" (query index), "k" (key index) or "0" (size-1 axis) per axis of ``vid``.
      q_len, kv_len: the grid the mask must match exactly.
    """
    sym = _Symbolic(sl)
    rec = _Recogniser(sym, q_len, kv_len)
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
