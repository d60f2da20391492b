"""The symbolic pass: a constant mask slice as affine index forms, line functions and logic.

Every index of a mask slice is an affine form ``a*i + b*j + c`` in the query index i and
the key index j. A sub-expression whose value depends on (i, j) only through one
direction ``t = a*i + b*j`` (``i``, ``j`` or ``d = i - j``) is a *line function*: its value
at any (i, j) is its value at one sample pair with the same t, so it is known exactly
from O(q_len + kv_len) samples (evaluated numerically with ``Slices.value``, whatever
primitives it uses: rem, floor-div's select dance, abs, clamp, ...). Boolean and/or/not
of line functions along different directions stay symbolic (:class:`Logic`).

Integer (or float) masks built from boolean ones, as Keras writes them (``minimum`` of 0/1
``int32`` masks for AND, ``maximum`` for OR, ``1 - m`` for NOT, then ``!= 0`` or a cast to
bool), are :class:`Table` values: a few boolean predicates and the value for each of their
assignments, computed by running the primitive on the actual values (so a 0/2 mask or any
other integer stays exact, it is never assumed to be 0/1). Index arrays of float dtype
(``jnp.arange(n, dtype=float32)``) are affine forms too while every value they take is an
integer the dtype holds exactly.

:mod:`splat._sparsify.recognise` turns these values into splat's constructors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from splat._sparsify.indexing import SHAPE_OPS, operand_index
from splat._sparsify.numeric import ELEMENTWISE, EXTRA_ELEMENTWISE, Slices, operand_idx

__all__ = ["DIRS", "Aff", "Const", "Form", "Line", "Logic", "Opaque", "Symbolic", "Table", "samples"]

_MAX_PREDS = 4  # a Table over more boolean predicates is left to the exact from_fn path


class Opaque(Exception):
    """A sub-expression the symbolic pass cannot follow (recognition falls back to from_fn)."""


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _integral(x) -> int | None:
    """``x`` as an int when it is an integer-valued int or float scalar, else None."""
    if _is_int(x):
        return int(x)
    if isinstance(x, (float, np.floating)) and np.isfinite(x) and float(x).is_integer():
        return int(x)
    return None


@dataclass(frozen=True)
class Form:
    """``a*i + b*j + c`` with integer coefficients (an index, or an integer value)."""

    a: int = 0
    b: int = 0
    c: int = 0

    def __add__(self, o):
        if isinstance(o, Form):
            return Form(self.a + o.a, self.b + o.b, self.c + o.c)
        if _is_int(o):
            return Form(self.a, self.b, self.c + int(o))
        raise Opaque

    __radd__ = __add__

    def __neg__(self):
        return Form(-self.a, -self.b, -self.c)

    def __sub__(self, o):
        return self + (-o)

    def __rsub__(self, o):
        return (-self) + o

    def __mul__(self, o):
        if _is_int(o):
            k = int(o)
            return Form(self.a * k, self.b * k, self.c * k)
        raise Opaque

    __rmul__ = __mul__

    def __floordiv__(self, o):
        if self.a == 0 and self.b == 0 and _is_int(o):  # a constant index (a broadcast axis)
            return Form(0, 0, self.c // int(o))
        raise Opaque

    def __mod__(self, o):
        if self.a == 0 and self.b == 0 and _is_int(o):
            return Form(0, 0, self.c % int(o))
        raise Opaque

    def __rfloordiv__(self, o):
        raise Opaque

    __rmod__ = __rfloordiv__

    def direction(self) -> tuple[int, int] | None:
        if self.a == 0 and self.b == 0:
            return None
        g = math.gcd(self.a, self.b)
        a, b = self.a // g, self.b // g
        return (a, b) if (a > 0 or (a == 0 and b > 0)) else (-a, -b)

    def at(self, i, j):
        return self.a * i + self.b * j + self.c


def _form(x) -> Form:
    if isinstance(x, Form):
        return x
    n = _integral(x)
    if n is None:
        raise Opaque
    return Form(0, 0, n)


@dataclass(frozen=True)
class Const:
    value: Any  # numpy scalar


@dataclass(frozen=True)
class Aff:
    form: Form  # an integer value (held exactly, also by a float dtype)


@dataclass(frozen=True)
class Line:
    """Value of node ``vid`` at index forms ``idx``; depends on (i, j) only through ``dir``."""

    dir: tuple[int, int]
    vid: int
    idx: tuple


@dataclass(frozen=True)
class Logic:
    """``op`` in and / or / not over boolean values (lines along different directions)."""

    op: str
    args: tuple


@dataclass(frozen=True)
class Table:
    """A value that is a function of a few boolean predicates (``Logic``, boolean lines, or lines
    whose value is 0 or one other number, read as ``!= 0``): ``values[k]`` is the value where
    predicate ``n`` holds iff bit ``n`` of ``k`` is set."""

    preds: tuple
    values: tuple


_CMP = ("eq", "ne", "lt", "le", "gt", "ge")
DIRS = {(1, 0): "i", (0, 1): "j", (1, -1): "d"}  # the directions the recogniser has constructors for


def samples(direction: str, q_len: int, kv_len: int):
    """(t values, i, j): one in-range (i, j) per value t of the direction."""
    if direction == "i":
        t = np.arange(q_len)
        return t, t, np.zeros_like(t)
    if direction == "j":
        t = np.arange(kv_len)
        return t, np.zeros_like(t), t
    t = np.arange(-(kv_len - 1), q_len)
    return t, np.maximum(t, 0), np.maximum(-t, 0)


def _direction(v) -> tuple[int, int] | None:
    if isinstance(v, Const):
        return None
    if isinstance(v, Aff):
        return v.form.direction()
    if isinstance(v, Line):
        return v.dir
    raise Opaque


def _logical(v) -> bool:
    return isinstance(v, Logic) or (isinstance(v, Table) and all(isinstance(x, np.bool_) for x in v.values))


class Symbolic:
    """The symbolic pass over one IR's constant slices (memoised per (vid, index forms))."""

    def __init__(self, sl: Slices, q_len: int, kv_len: int):
        self.sl, self.q_len, self.kv_len = sl, q_len, kv_len
        self.memo: dict = {}

    def sym(self, vid: int, idx: tuple):
        key = (vid, idx)
        if key not in self.memo:
            try:
                self.memo[key] = self._sym(vid, idx)
            except Opaque:
                self.memo[key] = None
        out = self.memo[key]
        if out is None:
            raise Opaque
        return out

    def numeric(self, vid: int, idx: tuple, i, j, memo: dict):
        with self.sl.at_grid(i, j):
            return np.asarray(self.sl.value(vid, tuple(np.asarray(f.at(i, j)) for f in idx), memo))

    def line_values(self, v: Line, memo: dict | None = None) -> tuple[str, np.ndarray]:
        """(direction name, value at every t of the grid) of a line function."""
        name = DIRS.get(v.dir)
        if name is None:
            raise Opaque
        _, i, j = samples(name, self.q_len, self.kv_len)
        # the node sees t through its own forms; any (i, j) with a*i + b*j = t gives the same value
        return name, np.broadcast_to(self.numeric(v.vid, v.idx, i, j, {} if memo is None else memo), i.shape)

    def _const(self, vid, idx):
        return Const(self.numeric(vid, idx, 0, 0, {})[()])

    def _exact(self, form: Form, dtype) -> bool:
        """True when every value of ``form`` on the grid is an integer ``dtype`` holds exactly."""
        corners = [abs(form.at(i, j)) for i in (0, self.q_len - 1) for j in (0, self.kv_len - 1)]
        if np.issubdtype(dtype, np.integer):
            return max(corners) <= np.iinfo(dtype).max
        if np.issubdtype(dtype, np.floating):
            return max(corners) <= 2 ** (np.finfo(dtype).nmant + 1)
        return False

    def _aff(self, form: Form, dtype, vid, idx, args):
        if self._exact(form, dtype):
            return Aff(form)
        return self._line(vid, idx, args)

    def _sym(self, vid: int, idx: tuple):
        sl, ir = self.sl, self.sl.ir
        shape = ir.shape(vid)
        dtype = np.dtype(ir.avals[vid].dtype)
        if vid in sl.index_of:  # a position array: the query (key) index, whatever its shape
            a, side = sl.index_of[vid]
            form = idx[a] if side == "qk" else Form(1, 0, 0) if side == "q" else Form(0, 1, 0)
            return self._aff(form, dtype, vid, idx, [Aff(form)])
        node = ir.node_of(vid)
        if node is None and isinstance(ir.consts.get(vid), jax.core.Tracer):
            raise Opaque
        c = sl.constant(vid)
        if c is not None:
            vary = sorted(sl.deps(vid))
            dirs = {idx[a].direction() for a in vary} - {None}
            if not dirs:
                return self._const(vid, idx)
            if len(dirs) > 1:
                raise Opaque
            if len(vary) == 1 and (np.issubdtype(c.dtype, np.integer) or np.issubdtype(c.dtype, np.floating)):
                a = vary[0]
                line = np.moveaxis(c, a, 0).reshape(c.shape[a], -1)[:, 0]
                if (
                    np.all(np.isfinite(line))
                    and np.all(line == np.round(line))
                    and np.abs(line).max() < 2**31
                ):
                    line = line.astype(np.int64)
                    step = int(line[1] - line[0])
                    if np.all(np.diff(line) == step):  # an arange computed outside the trace
                        return Aff(idx[a] * step + int(line[0]))
            return Line(dirs.pop(), vid, idx)
        name, p, ins = node.prim.name, node.params, node.ins

        def sub(u, uidx):
            return self.sym(u, tuple(_form(x) for x in uidx))

        def same(u):
            return sub(u, operand_idx(idx, shape, ir.shape(u)))

        if name in SHAPE_OPS:  # a reshape group that merges axes needs // and % of forms: Opaque
            return sub(ins[0], operand_index(name, p, ir.shape(ins[0]), shape, idx))
        if name == "dynamic_slice":  # constant starts, or a start read at the query's position
            return sub(ins[0], sl.slice_index(vid, idx, Form(1, 0, 0)))
        if name == "iota":
            return self._aff(idx[p["dimension"]], dtype, vid, idx, [Aff(idx[p["dimension"]])])
        if name == "convert_element_type":
            return self._convert(vid, idx, same(ins[0]), np.dtype(ir.avals[ins[0]].dtype), dtype)
        if name in ("copy", "copy_p", "stop_gradient", "optimization_barrier") and len(ins) == 1:
            return same(ins[0])  # identities (vectorised code copies its operands)
        if name not in ELEMENTWISE and name not in EXTRA_ELEMENTWISE:
            raise Opaque
        args = [same(u) for u in ins]
        if all(isinstance(v, Const) for v in args):
            return self._const(vid, idx)
        if dtype != np.bool_ and all(isinstance(v, (Const, Aff)) for v in args):
            try:
                forms = [v.form if isinstance(v, Aff) else _form(v.value) for v in args]
            except Opaque:
                forms = None
            if forms is not None and name == "neg":
                return self._aff(-forms[0], dtype, vid, idx, args)
            if forms is not None and name in ("add", "sub"):
                x, y = forms
                return self._aff(x + y if name == "add" else x - y, dtype, vid, idx, args)
            if forms is not None and name == "mul":
                x, y = forms
                if x.direction() is None or y.direction() is None:  # a form times an integer
                    k, f = (x.c, y) if x.direction() is None else (y.c, x)
                    return self._aff(f * k, dtype, vid, idx, args)
        if name in _CMP and all(isinstance(v, (Const, Aff)) for v in args):
            try:
                x, y = (_form(v.form if isinstance(v, Aff) else v.value) for v in args)
            except Opaque:  # e.g. a non-integer threshold: the generic rule below still applies
                pass
            else:
                d = (x - y).direction()  # a comparison of two forms only sees their difference
                return self._const(vid, idx) if d is None else Line(d, vid, idx)
        if any(isinstance(v, (Logic, Table)) for v in args):
            if (
                dtype == np.bool_
                and name in ("and", "or", "not")
                and all(
                    _logical(v) or (isinstance(v, Line) and self._is_bool(v)) or isinstance(v, Const)
                    for v in args
                )
            ):
                return Logic(name, tuple(args))
            return self._table(name, p, args, dtype)
        dirs = {_direction(v) for v in args} - {None}
        if len(dirs) == 1:
            return Line(dirs.pop(), vid, idx)
        if dtype == np.bool_ and name in ("and", "or", "not"):
            return Logic(name, tuple(args))
        # e.g. min of 0/1 masks along different directions: exact values per predicate assignment
        return self._table(name, p, args, dtype)

    def _is_bool(self, v: Line) -> bool:
        return np.dtype(self.sl.ir.avals[v.vid].dtype) == np.bool_

    def _convert(self, vid, idx, v, src, dst):
        if isinstance(v, Const):
            return self._const(vid, idx)
        if isinstance(v, Aff):
            if dst == np.bool_:  # != 0 of an index: a comparison
                d = v.form.direction()
                return self._const(vid, idx) if d is None else Line(d, vid, idx)
            return self._aff(v.form, dst, vid, idx, [v])
        if src == np.bool_ and (isinstance(v, (Logic, Table)) or isinstance(v, Line)):
            if dst == np.bool_:
                return v
            if isinstance(v, Table):
                return Table(v.preds, tuple(np.asarray(x).astype(dst)[()] for x in v.values))
            return Table((v,), (np.zeros((), dst)[()], np.ones((), dst)[()]))
        if isinstance(v, Table):
            return Table(v.preds, tuple(np.asarray(x).astype(dst)[()] for x in v.values))
        return self._line(vid, idx, [v])

    def _as_table(self, v) -> Table:
        if isinstance(v, Table):
            return v
        if isinstance(v, Const):
            return Table((), (v.value,))
        if isinstance(v, Logic) or (isinstance(v, Line) and self._is_bool(v)):
            return Table((v,), (np.False_, np.True_))
        if isinstance(v, Line):  # a line holding 0 and one other value is that value where it is != 0
            _, vals = self.line_values(v)
            nonzero = np.unique(vals[vals != 0])
            if nonzero.size > 1 or not np.any(vals == 0):
                raise Opaque
            one = nonzero[0] if nonzero.size else vals.dtype.type(1)
            return Table((v,), (vals.dtype.type(0), one))
        raise Opaque

    def _table(self, name, params, args, dtype):
        """Run primitive ``name`` on every assignment of the predicates of its operands."""
        tables = [self._as_table(v) for v in args]
        preds: list = []
        for t in tables:
            preds += [x for x in t.preds if x not in preds]
        if len(preds) > _MAX_PREDS:
            raise Opaque
        out = []
        for k in range(2 ** len(preds)):
            vals = []
            for t in tables:
                sub_k = sum(1 << n for n, x in enumerate(t.preds) if k >> preds.index(x) & 1)
                vals.append(np.asarray(t.values[sub_k]))
            out.append(np.asarray(_apply(name, params, vals)).astype(dtype)[()])
        if all(x == out[0] for x in out):
            return Const(out[0])
        if len(preds) == 1 and dtype == np.bool_ and out == [False, True] and _logical(preds[0]):
            return preds[0]
        return Table(tuple(preds), tuple(out))

    def _line(self, vid, idx, args):
        dirs = {_direction(v) for v in args} - {None}
        if len(dirs) != 1:
            raise Opaque
        return Line(dirs.pop(), vid, idx)


def _apply(name, params, vals):
    if name == "select_n":
        pred, cases = vals[0], vals[1:]
        return cases[int(pred)]
    if name == "clamp":
        return np.minimum(np.maximum(vals[1], vals[0]), vals[2])
    if name == "integer_pow":
        return np.power(vals[0], params["y"])
    return ELEMENTWISE[name](*vals)
