"""Sequence-parallel cases, each run in a process with N CPU devices (tests/test_sequence_parallel.py).

``python tests/sequence_parallel_cases.py --devices N CASE...`` sets
``--xla_force_host_platform_device_count=N`` before JAX starts, runs each case and prints one JSON
line: ``{case: {"ok": bool, "errors": {...}, "plan": str, "error": traceback or None}}``.

A case runs splat on global float32 arrays sharded over the N devices (``splat.sharded_attention``
under ``jit``, or ``splat.attention(sequence_axis=)`` inside a ``shard_map`` of the case's own),
forward and gradients of ``sum(out * dout)``, and compares them with the float64 dense reference
(``tests/reference.py``) and with ``splat.attention`` on one device. The rule: the sharded result's
error against float64 stays within ``max(1e-5, 2 x`` the one-device result's ``)`` (relative to the
reference's largest magnitude), and within 2e-5 of the one-device result. Rows a runtime mask
leaves empty must output exactly 0 and get exactly zero gradients.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
import zlib
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Case:
    """One sharded attention problem. ``mask``: a :func:`splat.masks.parse` expression (or ``fn:``
    and a lambda of ``(i, j)`` on numpy arrays); ``docs``: the longest packed document (segment
    ids), 0 for none; ``lengths``: draw query/key lengths below ``S`` (padding at the end)."""

    devices: int
    length: int
    mask: str
    order: str = "contiguous"
    batch: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    docs: int = 0
    lengths: bool = False
    soft_cap: float | None = None
    mesh_2d: bool = False  # a (dp=2, sp=devices/2) mesh; the case's own shard_map, batch on dp
    mode: str | None = None  # the plan's mode the case must get
    tags: tuple[str, ...] = field(default=())


CASES = {
    # 2 devices
    "window": Case(2, 96, "sliding_window(19, 0)", mode="halo"),
    "docs_lengths_softcap": Case(2, 96, "causal()", docs=40, lengths=True, soft_cap=5.0),
    "global_window": Case(2, 96, "global_tokens(3) | sliding_window(6)", heads=2, kv_heads=1),
    "neighborhood_rows": Case(2, 96, "neighborhood((12, 8), 5)", mode="halo"),
    # 4 devices
    "causal_zigzag": Case(4, 128, "causal()", order="zigzag", mode="ring"),
    "window_longer_than_shard": Case(4, 120, "sliding_window(44, 0)", mode="halo"),
    "docs_zigzag": Case(4, 128, "causal()", order="zigzag", docs=48, lengths=True, mode="ring"),
    "neighborhood_causal_rows": Case(4, 128, "neighborhood((16, 8), (3, 5), is_causal=(True, False))"),
    "prefix_lm": Case(4, 128, "fn:lambda i, j: (j <= i) | (j < 40)", mode="ring"),
    "mesh_2d_window": Case(4, 64, "sliding_window(9, 3)", mesh_2d=True, batch=4),
    "docs_4": Case(4, 160, "causal()", docs=30, soft_cap=3.0, mode="ring"),
    # 8 devices
    "causal_zigzag_8": Case(8, 128, "causal()", order="zigzag", lengths=True, mode="ring"),
    "window_8": Case(8, 128, "sliding_window(10, 10)", heads=2, kv_heads=2, mode="halo"),
    "docs_8": Case(8, 128, "causal()", docs=30, soft_cap=3.0, mode="ring"),
}


def _mask(expr: str):
    from splat import masks

    if expr.startswith("fn:"):
        return masks.from_fn(eval(expr[3:]))  # a test's own literal lambda
    return masks.parse(expr)


def _inputs(case: Case, rng):
    import numpy as np

    from tests.runtime_masks import packed_ids

    b, s, h, hk, d = case.batch, case.length, case.heads, case.kv_heads, case.head_dim
    q = rng.standard_normal((b, s, h, d), dtype=np.float32)
    k, v = rng.standard_normal((2, b, s, hk, d), dtype=np.float32)
    dout = rng.standard_normal((b, s, h, d), dtype=np.float32)
    rt = {}
    if case.docs:
        rt["ids"] = packed_ids(rng, b, s, case.docs)
    if case.lengths:
        rt["qlen"] = rng.integers(s // 2, s, size=b).astype(np.int32)
        rt["kvlen"] = rng.integers(s // 2, s + 1, size=b).astype(np.int32)
    return q, k, v, dout, rt


def run_case(name: str) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import PartitionSpec as P

    import splat
    from splat._sharded import plan as sp_plan
    from tests import reference
    from tests.runtime_masks import build_arguments, runtime_dense

    case = CASES[name]
    n = len(jax.devices())
    assert n == case.devices, f"{name} wants {case.devices} devices, this process has {n}"
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    mask = _mask(case.mask)
    q, k, v, dout, rt = _inputs(case, rng)
    kw = build_arguments(rt)
    layout = splat.analyze(mask, case.length)
    parts = n // 2 if case.mesh_2d else n
    the_plan = sp_plan(layout, parts, case.order)
    scale = case.head_dim**-0.5

    # one device, original order
    def single(q, k, v):
        return splat.attention(q, k, v, mask, logits_soft_cap=case.soft_cap, **kw)

    out1, vjp1 = jax.vjp(single, q, k, v)
    grads1 = vjp1(jnp.asarray(dout))

    # sharded: inputs (and ids, outputs) in the case's order
    order = (lambda x: splat.zigzag(x, parts)) if case.order == "zigzag" else (lambda x: x)
    back = (lambda x: splat.unzigzag(x, parts)) if case.order == "zigzag" else (lambda x: x)
    kw_o = {key: (order(x) if x.ndim == 2 else x) for key, x in kw.items()}
    if case.mesh_2d:
        mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, parts), ("dp", "sp"))
        spec, rep = P("dp", "sp"), P("dp")
        names = list(kw_o)

        def local(q, k, v, *extra):
            return splat.attention(
                q,
                k,
                v,
                mask,
                sequence_axis="sp",
                logits_soft_cap=case.soft_cap,
                **dict(zip(names, extra, strict=True)),
            )

        specs = (spec,) * 3 + tuple(spec if kw_o[key].ndim == 2 else rep for key in names)
        mapped = jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=spec, check_vma=False)

        def sharded(q, k, v):
            return mapped(q, k, v, *kw_o.values())
    else:
        mesh = jax.sharding.Mesh(jax.devices(), ("sp",))

        def sharded(q, k, v):
            return splat.sharded_attention(
                q, k, v, mask, mesh=mesh, axis="sp", order=case.order, logits_soft_cap=case.soft_cap, **kw_o
            )

    @jax.jit
    def fwd_bwd(q, k, v, dout):
        out, vjp = jax.vjp(sharded, q, k, v)
        return out, vjp(dout)

    out_s, grads_s = fwd_bwd(*(order(jnp.asarray(x)) for x in (q, k, v, dout)))
    out_s, grads_s = back(out_s), [back(g) for g in grads_s]

    # float64 reference
    static = layout.to_dense()
    m_b = runtime_dense(static, case.batch, case.length, case.length, **rt)
    out64, grads64 = reference.runtime_ref(q, k, v, m_b, scale, dout, case.soft_cap)

    errors, ok = {}, True
    for what, got, one, ref in zip(
        ("out", "dq", "dk", "dv"), (out_s, *grads_s), (out1, *grads1), (out64, *grads64), strict=True
    ):
        e_s, e_1, e_s1 = (reference.rel_error(a, b) for a, b in ((got, ref), (one, ref), (got, one)))
        good = bool(np.isfinite(np.asarray(got)).all()) and e_s <= max(1e-5, 2 * e_1) and e_s1 <= 2e-5
        errors[what] = {"vs_float64": e_s, "one_device_vs_float64": e_1, "vs_one_device": e_s1, "ok": good}
        ok &= good
    empty = ~m_b.any(axis=2)  # [B, S]: rows no key reaches
    if empty.any():
        zero_out = bool((np.asarray(out_s)[empty] == 0).all())
        zero_dq = bool((np.asarray(grads_s[0])[empty] == 0).all())
        errors["empty_rows"] = {"rows": int(empty.sum()), "out_zero": zero_out, "dq_zero": zero_dq}
        ok &= zero_out and zero_dq
    if the_plan.mode == "ring" and case.docs and not case.mesh_2d:
        errors["ring_reach"] = _ring_reach(the_plan, mesh, kw_o, q.shape[0])
    if case.mode is not None and the_plan.mode != case.mode:
        errors["mode"] = f"plan mode {the_plan.mode}, expected {case.mode}"
        ok = False
    return {"ok": bool(ok), "errors": errors, "plan": the_plan.describe(), "error": None}


def _ring_reach(plan, mesh, kw: dict, batch: int) -> int:
    """The last ring step the runtime mask leaves work at (what the sharded call computes)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from jax_bindings import _runtime
    from splat._sharded import _api, _blocks, _vjp

    names = list(kw)

    def local(*arrays):
        a = dict(zip(names, arrays, strict=True))
        n = a["segment_ids"].shape[1] if "segment_ids" in a else plan.q_local
        ids, lens = a.get("segment_ids"), (a.get("query_seq_lengths"), a.get("key_value_seq_lengths"))
        n = plan.q_local
        runtime = _runtime.build(
            batch, n, n, segment_ids=ids, query_seq_lengths=lens[0], key_value_seq_lengths=lens[1]
        )
        rt = _api._local_runtime(runtime, *lens)
        ctx = _blocks.Context(plan, 1.0, None, "auto")
        return _vjp._ring_reach(ctx, rt, "sp", jax.lax.axis_index("sp"))[None]

    specs = tuple(P(None, "sp") if kw[n].ndim == 2 else P() for n in names)
    run = jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=P("sp"), check_vma=False)
    reach = jax.device_get(run(*(jnp.asarray(kw[n]) for n in names)))
    assert len(set(reach.tolist())) == 1, f"reach differs across devices: {reach}"
    return int(reach[0])


def bad_length_error() -> str:
    """The message of sharded_attention on a sequence the axis does not divide."""
    import jax
    import jax.numpy as jnp

    import splat

    mesh = jax.sharding.Mesh(jax.devices(), ("sp",))
    x = jnp.ones((1, 4 * len(jax.devices()) + 1, 2, 8))
    try:
        splat.sharded_attention(x, x, x, splat.masks.causal(), mesh=mesh, axis="sp")
    except ValueError as e:
        return str(e)
    return "no error"


def main(argv: list[str]) -> int:
    devices = int(argv[argv.index("--devices") + 1])
    names = [a for a in argv if a in CASES or a == "bad_length"]
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}"
    ).strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    results = {}
    for name in names:
        try:
            results[name] = bad_length_error() if name == "bad_length" else run_case(name)
        except Exception:
            results[name] = {"ok": False, "errors": {}, "plan": "", "error": traceback.format_exc()}
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
