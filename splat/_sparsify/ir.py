"""A flat IR over a closed jaxpr: nested ``jit`` calls inlined, every value numbered.

``build_ir`` turns ``jax.make_jaxpr``'s output into an :class:`IR` whose values are ints
(``vid``): inputs, closed-over constants, literals and equation outputs alike. The matcher
walks it backwards (``IR.node_of``), the slice evaluators read its constants, and ``run_ir``
evaluates it again with some values computed by replacement functions.

A value closed over from an enclosing trace (see :mod:`splat._sparsify.outer`) keeps its tracer
for the run (``IR.outer``) and, when its outer equations are input-free, gets them as
*analysis-only* nodes, so that the slice evaluators see how it was built.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
from jax.extend import core as jex_core

from splat._sparsify.outer import outer_graph

__all__ = ["IR", "Node", "between", "bind_params", "build_ir", "reads_any", "run_ir", "run_nodes"]

# call primitives whose body is inlined into the flat IR
_INLINE = ("jit", "pjit", "closed_call", "core_call")
# rematerialised calls (jax.checkpoint): inlined too, and run again as one checkpointed region
_REMAT = ("remat2", "checkpoint", "remat")


@dataclass
class Node:
    """One equation: ``outs = prim.bind(*ins, **params)`` (value ids in, value ids out)."""

    prim: Any  # jax Primitive
    params: dict
    ins: list[int]
    outs: list[int]
    ctx: Any = None
    analysis_only: bool = False  # rebuilds an outer-trace constant; never run (IR.outer has the value)
    effects: Any = ()


@dataclass(eq=False)
class Region:
    """Nodes ``start .. end - 1`` inlined from a ``jax.checkpoint`` call on ``ins`` giving ``outs``;
    :func:`run_ir` runs them under ``jax.checkpoint`` again, with ``params`` (policy,
    prevent_cse), so that a substituted attention inside is rematerialised as the original was."""

    start: int
    end: int
    ins: list[int]
    outs: list[int]
    params: dict


@dataclass
class IR:
    """Equations in program order over numbered values; ``avals[vid]`` is each value's aval."""

    nodes: list[Node] = field(default_factory=list)
    avals: list[Any] = field(default_factory=list)
    consts: dict[int, Any] = field(default_factory=dict)  # value id -> concrete value (or outer tracer)
    inputs: list[int] = field(default_factory=list)
    outputs: list[int] = field(default_factory=list)
    prod: dict[int, tuple[int, int]] = field(default_factory=dict)  # value id -> (node index, out pos)
    outer: dict[int, Any] = field(default_factory=dict)  # value id -> outer-trace tracer, for the run
    regions: list[Region] = field(default_factory=list)
    _users: dict[int, list[Node]] | None = field(default=None, repr=False)

    def new(self, aval) -> int:
        self.avals.append(aval)
        return len(self.avals) - 1

    def node_of(self, vid: int) -> Node | None:
        """The equation producing ``vid``; None for inputs and constants."""
        p = self.prod.get(vid)
        return None if p is None else self.nodes[p[0]]

    def shape(self, vid: int) -> tuple[int, ...]:
        return tuple(self.avals[vid].shape)

    def users(self, vid: int) -> list[Node]:
        """The equations (run ones only) that read ``vid``."""
        if self._users is None:
            self._users = {}
            for node in self.nodes:
                if not node.analysis_only:
                    for u in dict.fromkeys(node.ins):
                        self._users.setdefault(u, []).append(node)
        return self._users.get(vid, [])


def build_ir(closed) -> IR:
    """The flat IR of a ``ClosedJaxpr``."""
    ir = IR()
    env: dict[Any, int] = {}
    outer_env: dict[Any, int] = {}  # outer-trace Var -> vid, shared by every outer constant
    for v, c in zip(closed.jaxpr.constvars, closed.consts, strict=False):
        if isinstance(c, jax.core.Tracer):
            vid = _splice_outer(ir, c, outer_env)
            same = vid is not None and (ir.avals[vid].shape, ir.avals[vid].dtype) == (
                v.aval.shape,
                v.aval.dtype,
            )
            if same:
                env[v] = vid
                ir.outer[vid] = c
                continue
        env[v] = ir.new(v.aval)
        ir.consts[env[v]] = c
    for v in closed.jaxpr.invars:
        env[v] = ir.new(v.aval)
        ir.inputs.append(env[v])
    _emit(ir, closed.jaxpr.eqns, env)
    ir.outputs = [_ref(ir, env, a) for a in closed.jaxpr.outvars]
    return ir


def _ref(ir: IR, env: dict, atom) -> int:
    if isinstance(atom, jex_core.Literal):
        vid = ir.new(atom.aval)
        ir.consts[vid] = atom.val
        return vid
    return env[atom]


def _emit(ir: IR, eqns, env: dict) -> None:
    for eqn in eqns:
        ins = [_ref(ir, env, a) for a in eqn.invars]
        _emit_one(
            ir,
            eqn.primitive,
            eqn.params,
            ins,
            eqn.outvars,
            getattr(eqn, "ctx", None),
            env,
            effects=getattr(eqn, "effects", ()),
        )


def _emit_one(
    ir: IR, prim, params, ins: list[int], outvars, ctx, env: dict, analysis_only=False, effects=()
) -> None:
    """Add one equation (inlining a nested ``jit``); ``env`` maps its outvars to new value ids."""
    name = prim.name
    inner = params.get("jaxpr", params.get("call_jaxpr")) if name in _INLINE + _REMAT else None
    if inner is not None:
        start = len(ir.nodes)
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
        for eqn in jaxpr.eqns:
            sub_ins = [_ref(ir, sub, a) for a in eqn.invars]
            ctx_, eff = getattr(eqn, "ctx", None), getattr(eqn, "effects", ())
            _emit_one(ir, eqn.primitive, eqn.params, sub_ins, eqn.outvars, ctx_, sub, analysis_only, eff)
        for outer, atom in zip(outvars, jaxpr.outvars, strict=False):
            env[outer] = _ref(ir, sub, atom)
        if name in _REMAT and not analysis_only:
            outs = [_ref(ir, sub, atom) for atom in jaxpr.outvars]
            ir.regions.append(Region(start, len(ir.nodes), list(ins), outs, dict(params)))
        return
    outs = []
    for v in outvars:
        vid = ir.new(v.aval)
        outs.append(vid)
        if not isinstance(v, jex_core.DropVar):
            env[v] = vid
    for k, vid in enumerate(outs):
        ir.prod[vid] = (len(ir.nodes), k)
    ir.nodes.append(Node(prim, params, ins, outs, ctx, analysis_only, effects))


def _splice_outer(ir: IR, tracer, env: dict) -> int | None:
    """The vid of an outer-trace constant rebuilt as analysis-only nodes, or None."""
    try:
        got = outer_graph(tracer)
    except Exception:  # JAX internals changed: read the value as opaque, as before
        return None
    if got is None:
        return None
    eqns, out = got
    if not eqns:  # a concrete constant of the outer trace
        vid = ir.new(jax.core.get_aval(out))
        ir.consts[vid] = out
        return vid
    try:
        for e in eqns:
            if any(o in env for o in e.outvars):
                continue
            ins = []
            for kind, x in e.ins:
                if kind == "tracer":
                    ins.append(env[x.val])
                else:
                    vid = ir.new(jax.core.get_aval(x))
                    ir.consts[vid] = x
                    ins.append(vid)
            _emit_one(ir, e.prim, e.params, ins, e.outvars, e.ctx, env, analysis_only=True)
        return env[out]
    except Exception:
        return None


def bind_params(node: Node) -> tuple[list, dict]:
    """(subfuns, params) for ``prim.bind``; jax >= 0.7 returns params only."""
    got = node.prim.get_bind_params(node.params)
    if isinstance(got, tuple):
        return list(got[0]), got[1]
    return [], got


def _bind(node: Node, invals: list):
    subfuns, params = bind_params(node)
    manager = getattr(node.ctx, "manager", None)
    if manager is not None:
        with manager:
            return node.prim.bind(*subfuns, *invals, **params)
    return node.prim.bind(*subfuns, *invals, **params)


def between(ir: IR, sources: set[int], out: int) -> tuple[list[Node], list[int]]:
    """``(nodes, reads)``: the equations on a path from ``sources`` to ``out``, in program order,
    and the other values they read (every value of ``out``'s slice that does not depend on
    ``sources``, at the frontier)."""
    need, back = {out}, set()
    for i in range(len(ir.nodes) - 1, -1, -1):
        node = ir.nodes[i]
        if not node.analysis_only and any(o in need for o in node.outs):
            back.add(i)
            need.update(node.ins)
    reach = set(sources)
    nodes = []
    for i in sorted(back):
        node = ir.nodes[i]
        if any(u in reach for u in node.ins):
            nodes.append(node)
            reach.update(node.outs)
    made = {o for node in nodes for o in node.outs}
    reads = list(dict.fromkeys(u for node in nodes for u in node.ins if u not in made))
    return nodes, reads


def reads_any(ir: IR, vid: int, sources: set[int]) -> bool:
    """Whether ``vid`` is one of ``sources`` or computed from one of them."""
    seen, stack = set(), [vid]
    while stack:
        v = stack.pop()
        if v in sources:
            return True
        if v in seen:
            continue
        seen.add(v)
        node = ir.node_of(v)
        if node is not None:
            stack.extend(node.ins)
    return False


def run_nodes(nodes: list[Node], reads: list[int], vals: list, consts: dict, out: int):
    """Evaluate ``nodes`` (from :func:`between`) on the values of ``reads``; the value of ``out``."""
    env = dict(consts)
    env.update(zip(reads, vals, strict=True))
    for node in nodes:
        ans = _bind(node, [env[v] for v in node.ins])
        if node.prim.multiple_results:
            env.update(zip(node.outs, ans, strict=False))
        else:
            env[node.outs[0]] = ans
    return env[out]


def run_ir(ir: IR, args: list, replace: dict[int, tuple[list[int], Callable]],
           subs: dict[int, Callable] | None = None) -> list:
    """Evaluate ``ir`` on ``args``; ``replace[vid] = (inputs, f)`` computes ``vid`` as ``f(*inputs)``,
    and ``subs[i]`` computes node ``i``'s outputs from its inputs (a loop run on a rewritten body)."""
    subs = subs or {}
    need = set(ir.outputs)
    live = [False] * len(ir.nodes)
    for i in range(len(ir.nodes) - 1, -1, -1):
        node = ir.nodes[i]
        if node.analysis_only or not any(o in need for o in node.outs):
            continue
        live[i] = True
        for o in node.outs:
            if o in replace and o in need:
                need.update(replace[o][0])
        if not all(o in replace for o in node.outs if o in need):
            need.update(node.ins)
    env: dict[int, Any] = dict(ir.consts)
    env.update(ir.outer)
    env.update(zip(ir.inputs, args, strict=False))
    starts: dict[int, list[Region]] = {}
    for r in sorted(ir.regions, key=lambda r: (r.start, -r.end)):  # outermost first
        starts.setdefault(r.start, []).append(r)

    def run_range(lo: int, hi: int, env: dict, active: tuple) -> None:
        i = lo
        while i < hi:
            region = next((r for r in starts.get(i, ()) if r.end <= hi and r not in active), None)
            if region is not None:
                run_region(region, env, active)
                i = max(region.end, i + 1)
                continue
            node = ir.nodes[i]
            i += 1
            if not live[i - 1]:
                continue
            if i - 1 in subs:
                env.update(zip(node.outs, subs[i - 1](*[env[v] for v in node.ins]), strict=True))
                continue
            if all(o in replace for o in node.outs if o in need):
                for o in node.outs:
                    if o in need:
                        ins, f = replace[o]
                        env[o] = f(*[env[v] for v in ins])
                continue
            ans = _bind(node, [env[v] for v in node.ins])
            if node.prim.multiple_results:
                env.update(zip(node.outs, ans, strict=False))
            else:
                env[node.outs[0]] = ans

    def read_outside(region: Region) -> list[int]:
        """Values the region makes that are read outside it: by live nodes, by replacements
        (an attention whose product lies outside may read its Q or K from inside), or as outputs."""
        made = {o for node in ir.nodes[region.start : region.end] for o in node.outs}
        reads = set(ir.outputs)
        for i, node in enumerate(ir.nodes):
            if region.start <= i < region.end or not live[i]:
                continue
            reads.update(node.ins)
            reads.update(v for o in node.outs if o in replace and o in need for v in replace[o][0])
        return sorted(reads & made)

    def run_region(region: Region, env: dict, active: tuple) -> None:
        outs = [o for o in dict.fromkeys(region.outs + read_outside(region)) if o in need and o not in env]
        if not outs:
            return

        def body(*ins):
            local = dict(env)
            local.update(zip(region.ins, ins, strict=True))
            run_range(region.start, region.end, local, (*active, region))
            return [local[o] for o in outs]

        remat = jax.checkpoint(body, prevent_cse=region.params.get("prevent_cse", True),
                               policy=region.params.get("policy"))
        env.update(zip(outs, remat(*[env[v] for v in region.ins]), strict=True))

    run_range(0, len(ir.nodes), env, ())
    return [env[v] for v in ir.outputs]
