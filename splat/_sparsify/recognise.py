"""Symbolic mask values -> splat's constructors, exact on the whole grid.

The values of :mod:`splat._sparsify.symbolic` become a formula: sets of t where each line
function holds, and/or/not of them (a :class:`symbolic.Table` through its truth table, read as
an and/or of its predicates where it is one). The sets are then matched against the
constructors (intervals of d -> causal / sliding_window, progressions of d -> strided /
dilated_window, prefixes of j -> sink, prefixes of i or j -> global_tokens) and every candidate
is checked against the samples, so a recognised mask equals the user's mask on the whole
q_len x kv_len grid.

Entry point: :func:`recognise`; it returns None where the terms are not such a mask (the
matcher then builds an exact ``masks.from_fn`` predicate).
"""

from __future__ import annotations

import numpy as np

from splat import masks
from splat._sparsify.numeric import Slices, kept
from splat._sparsify.symbolic import DIRS, Aff, Const, Form, Line, Logic, Opaque, Symbolic, Table, samples

__all__ = ["recognise"]


def _truth_formula(lits: list, table: dict):
    """An and/or formula over literals ``lits`` (formulas) with truth table ``table``.

    ``table`` maps each assignment (a tuple of bools, one per literal) to a bool. Shannon
    expansion on a variable with a constant cofactor gives and/or trees (what min/max/mul/1-x
    of 0/1 masks make); otherwise the disjunction of the true assignments.
    """
    vals = set(table.values())
    if len(vals) == 1:
        return ("const", vals.pop())
    for k, lit in enumerate(lits):
        rest = lits[:k] + lits[k + 1 :]
        f0 = {a[:k] + a[k + 1 :]: v for a, v in table.items() if not a[k]}
        f1 = {a[:k] + a[k + 1 :]: v for a, v in table.items() if a[k]}
        neg = _negate(lit)
        if not any(f0.values()):
            return ("and", [lit, _truth_formula(rest, f1)])
        if not any(f1.values()):
            return ("and", [neg, _truth_formula(rest, f0)])
        if all(f1.values()):
            return ("or", [lit, _truth_formula(rest, f0)])
        if all(f0.values()):
            return ("or", [neg, _truth_formula(rest, f1)])
    terms = [
        ("and", [x if b else _negate(x) for x, b in zip(lits, a, strict=True)]) for a, v in table.items() if v
    ]
    return ("or", terms)


def _negate(f):
    if f[0] == "const":
        return ("const", not f[1])
    if f[0] == "set":
        return ("set", f[1], ~f[2])
    return ("or" if f[0] == "and" else "and", [_negate(x) for x in f[1]])


class _Recogniser:
    """Turns the symbolic mask terms into a Mask made of constructors, or None."""

    def __init__(self, sym: Symbolic, q_len: int, kv_len: int):
        self.sym, self.q_len, self.kv_len = sym, q_len, kv_len
        self.memo: dict = {}

    # -- formulas ----------------------------------------------------------------------
    def formula(self, v, kind="where"):
        """NNF-ready formula: ('set', dir, bool array) | ('and'|'or', [..]) | ('const', bool)."""
        if isinstance(v, Const):
            return ("const", bool(kept(np.asarray(v.value), kind)))
        if isinstance(v, Line):
            name, vals = self.sym.line_values(v, self.memo)
            return ("set", name, kept(vals, kind))
        if isinstance(v, Aff) and isinstance(kind, tuple):  # a test on an index: e.g. (i - j) < w
            d = v.form.direction()
            if d is None:
                return ("const", bool(kept(np.asarray(v.form.c), kind)))
            name = DIRS.get(d)
            if name is None:
                raise Opaque
            _, i, j = samples(name, self.q_len, self.kv_len)
            return ("set", name, kept(v.form.at(i, j), kind))
        if isinstance(v, Table):
            keep = [bool(kept(np.asarray(c), kind)) for c in v.values]
            lits = [self.formula(p) for p in v.preds]
            n = len(v.preds)
            table = {tuple(bool(k >> b & 1) for b in range(n)): keep[k] for k in range(2**n)}
            return _truth_formula(lits, table)
        if isinstance(v, Logic) and kind == "where":
            parts = [self.formula(a) for a in v.args]
            if v.op == "not":
                return _negate(parts[0])
            return (v.op, parts)
        raise Opaque

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
                raise Opaque  # rows outside the set would be empty: let the exact path decide
        if "j" in sets:
            n = self._prefix(sets["j"])
            if n == 0:
                return None
            if n is None:
                raise Opaque
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
            raise Opaque
        if nr >= self.q_len or nc >= self.kv_len:
            return masks.full()
        if nr and nr > nc:
            raise Opaque  # query rows without their key columns: no constructor for that
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
        t, i, j = samples("d", self.q_len, self.kv_len)
        if s.all():
            return masks.full()
        sel = t[s]
        if 0 not in sel:
            raise Opaque  # bands that exclude the diagonal are not a single constructor
        lo, hi = int(sel[0]), int(sel[-1])
        steps = np.unique(np.diff(sel))
        if steps.size > 1:
            raise Opaque
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
        raise Opaque


def recognise(sl: Slices, parts, q_len: int, kv_len: int) -> masks.Mask | None:
    """Constructor expression equal to the AND of the mask ``parts``, or None (use from_fn).

    Args:
      sl: the slices of the IR the parts live in.
      parts: ``(kind, vid, negate, roles)`` per mask term: ``kind`` "where" (boolean predicate),
        "bias" (0 / -inf) or a comparison test (see ``numeric.kept``), ``negate`` when the
        term masks where it holds, ``roles`` one of "q" (query index), "k" (key index) or "0"
        (size-1 axis) per axis of ``vid``.
      q_len, kv_len: the grid the mask must match exactly.
    """
    sym = Symbolic(sl, q_len, kv_len)
    rec = _Recogniser(sym, q_len, kv_len)
    roles_form = {"q": Form(1, 0, 0), "k": Form(0, 1, 0), "0": Form()}
    try:
        formulas = []
        for kind, vid, negate, roles in parts:
            v = sym.sym(vid, tuple(roles_form[r] for r in roles))
            f = rec.formula(v, kind)
            formulas.append(_negate(f) if negate else f)
        f = formulas[0] if len(formulas) == 1 else ("and", formulas)
        return rec.to_mask(f)
    except Opaque:
        return None
