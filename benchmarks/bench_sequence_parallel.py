"""Sequence-parallel benchmark: one GPU against the local GPUs, and an all-gather baseline, in one process.

Every scaling claim about ``splat.sharded_attention`` comes from this script. Each case runs, on the
same kind of inputs, forward and forward+backward:

================  ================================================================================
peer              what
================  ================================================================================
one_device        ``splat.attention`` on the first device, at the case's ``single_length`` (the
                  length one device holds; speed-ups are per token where it differs from S)
sharded           ``splat.sharded_attention`` over the first ``n`` devices (``--parts``), at S
allgather         the generic recipe over the same ``n`` devices: contiguous shards (no balancing),
                  inside ``shard_map`` K, V (and key ids) gathered with ``jax.lax.all_gather``,
                  then ``splat.attention`` of the local queries against every key (each device its
                  own rows' layout, by ``lax.switch`` on the axis index); gradients through
                  ``all_gather``'s transpose
================  ================================================================================

Cases (full profile: bf16, B = 1, H = Hk = 16, D = 128; ``--smoke`` shrinks them to float32, H = 2,
D = 16 and S of a few hundred, on CPU devices):

=================  ===============================================================================
case              what
=================  ===============================================================================
window_131k        ``sliding_window(4095, 0)`` (a causal window of 4096), S = 131072: a halo
window_262k        the same at S = 262144; one device runs 131072 (per-token speed-up)
causal_131k        ``causal()``, S = 131072, zigzag order: the balanced ring
documents_262k     ``causal()`` + segment ids, documents of 4K-32K tokens, S = 262144; one device
                   runs 65536 of the same kind (per-token speed-up)
video_3d           ``neighborhood((32, 64, 64), (5, 9, 9), is_causal=(True, False, False))``
                   (S = 131072) sharded on time: a halo of 4 frames
=================  ===============================================================================

Rates: ``speedup`` = one_device ms per token / peer ms per token (tokens = S of the run);
``tflops`` = useful FLOPs / ms with FLOPs = 4 * B * H * D * (visible (query, key) pairs), times 3.5
for forward+backward. Timing: :data:`splat.tools.timing.TIMING_METHOD` (on a GPU 10 calls chained
in one jitted program, each call's q the previous call's output or dq). Memory per device: XLA's
``memory_analysis`` of the compiled program (arguments + outputs + temporaries, per device for the
sharded programs), and ``peak_bytes_in_use`` of each device after the peer ran (cumulative over the
process: peers run in order one_device, sharded, allgather per case).

Targets (``--assert`` exits 1 on a miss or a target it cannot judge; the issue's, forward+backward):
window cases >= 1.9x at 2 GPUs and >= 3.6x at 4; causal_131k >= 1.8x at 2, >= 3.3x at 4 and >= 1.3x
the all-gather baseline at 4; documents_262k >= 3.3x at 4 (per token); video_3d >= 1.8x at 2.

Run on a GPU host (all its GPUs; ``--parts 2 4`` times both on a 4-GPU host)::

    python3 benchmarks/bench_sequence_parallel.py --out benchmarks/results/sp-<device>.json \
        --plot benchmarks/results/sp-<device>.png
    python3 benchmarks/bench_sequence_parallel.py --parts 2 4 --cases 'window*' causal_131k --assert
    python3 benchmarks/bench_sequence_parallel.py --smoke            # CPU devices, tiny: a set-up check
"""

from __future__ import annotations

import argparse
import datetime as _dt
import fnmatch
import functools
import importlib.util
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

SCHEMA = "splat-bench-sequence-parallel/1"
FLOP_FORMULA = (
    "useful FLOPs = 4 * B * H * D * (visible (query, key) pairs of the run's S, segment ids included); "
    "forward+backward: 3.5 x that"
)
SPEEDUP_DEFINITION = (
    "speedup = (one_device median ms / one_device tokens) / (peer median ms / peer tokens): > 1, the "
    "peer is faster per token; vs_allgather = allgather ms / sharded ms (same S, same devices)"
)
# output check against one_device (where it ran the same S) or the all-gather baseline
ABS_TOL = {"bfloat16": 2e-2, "float16": 1e-2, "float32": 1e-4}
REL_TOL = {"bfloat16": 3e-2, "float16": 5e-3, "float32": 1e-4}
MODES = ("fwd", "fwd_bwd")
PEERS = ("one_device", "sharded", "allgather")


@dataclass(frozen=True)
class Profile:
    """Sizes of one run. ``heads``/``kv_heads``/``head_dim``/``dtype``: every case's; ``window``: the
    causal window's keys; ``docs``: (min, max) document lengths; ``video``: (grid, kernel)."""

    name: str
    heads: int
    kv_heads: int
    head_dim: int
    dtype: str
    batch: int
    lengths: dict
    window: int
    docs: tuple[int, int]
    video: tuple[tuple[int, int, int], tuple[int, int, int]]
    warmup: int
    repeats: int


FULL = Profile(
    "full", 16, 16, 128, "bfloat16", 1,
    {"window_131k": (131072, 131072), "window_262k": (262144, 131072), "causal_131k": (131072, 131072),
     "documents_262k": (262144, 65536), "video_3d": (131072, 131072)},
    4096, (4096, 32768), ((32, 64, 64), (5, 9, 9)), 2, 10,
)  # fmt: skip
SMOKE = Profile(
    "smoke", 2, 2, 16, "float32", 1,
    {"window_131k": (512, 512), "window_262k": (1024, 512), "causal_131k": (256, 256),
     "documents_262k": (1024, 512), "video_3d": (512, 512)},
    64, (16, 96), ((8, 8, 8), (3, 3, 3)), 0, 2,
)  # fmt: skip
PROFILES = {p.name: p for p in (FULL, SMOKE)}


@dataclass(frozen=True)
class Target:
    """A speed-up a case must reach under ``--assert`` at ``parts`` devices, forward+backward:
    ``metric`` "speedup" (over one device, per token) or "vs_allgather"."""

    parts: int
    threshold: float
    metric: str = "speedup"

    def describe(self) -> str:
        what = "one device (per token)" if self.metric == "speedup" else "the all-gather baseline"
        return f"fwd+bwd at {self.parts} devices >= {self.threshold:g}x {what}"


@dataclass(frozen=True)
class Case:
    """One problem. ``length``: S of the sharded runs; ``single_length``: S one device runs;
    ``mask_expr``: a :func:`splat.masks.parse` expression; ``order``: the chunk order;
    ``documents``: packed segment ids."""

    name: str
    what: str
    mask_expr: str
    length: int
    single_length: int
    order: str = "contiguous"
    documents: bool = False
    targets: tuple[Target, ...] = ()

    @functools.cached_property
    def mask(self):
        from splat import masks

        return masks.parse(self.mask_expr)


def make_cases(p: Profile) -> list[Case]:
    w, (grid, kernel) = p.window, p.video
    win = f"sliding_window({w - 1}, 0)"
    band = (Target(2, 1.9), Target(4, 3.6))
    return [
        Case("window_131k", f"causal window {w}", win, *p.lengths["window_131k"], targets=band),
        Case("window_262k", f"causal window {w}", win, *p.lengths["window_262k"], targets=band),
        Case(
            "causal_131k",
            "causal, zigzag order (balanced ring)",
            "causal()",
            *p.lengths["causal_131k"],
            order="zigzag",
            targets=(Target(2, 1.8), Target(4, 3.3), Target(4, 1.3, "vs_allgather")),
        ),
        Case(
            "documents_262k",
            f"packed documents of {p.docs[0]}-{p.docs[1]} tokens, causal",
            "causal()",
            *p.lengths["documents_262k"],
            documents=True,
            targets=(Target(4, 3.3),),
        ),
        Case(
            "video_3d",
            f"video {grid}, window {kernel} causal in time, sharded on time",
            f"neighborhood({grid}, {kernel}, is_causal=(True, False, False))",
            *p.lengths["video_3d"],
            targets=(Target(2, 1.8),),
        ),
    ]


def select_cases(cases: list[Case], patterns: Sequence[str] | None) -> list[Case]:
    if not patterns:
        return cases
    names = [c.name for c in cases]
    bad = [p for p in patterns if not fnmatch.filter(names, p)]
    if bad:
        raise ValueError(f"no case matches {bad}; cases: {', '.join(names)}")
    return [c for c in cases if any(fnmatch.fnmatchcase(c.name, p) for p in patterns)]


# --- inputs -------------------------------------------------------------------------------------


def _pack_documents():
    path = Path(__file__).resolve().parent / "bench_decode.py"
    spec = importlib.util.spec_from_file_location("bench_decode_for_sp", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up while it executes
    spec.loader.exec_module(mod)
    return mod.pack_documents


def _ids(case: Case, p: Profile, length: int, seed: int) -> np.ndarray | None:
    if not case.documents:
        return None
    return _pack_documents()(np.random.default_rng(seed), p.batch, length, *p.docs)


def _pairs(case: Case, length: int, ids: np.ndarray | None) -> int:
    """Visible (query, key) pairs at ``length`` (with the documents, for causal masks)."""
    if ids is None:
        return int(case.mask.to_acsr(length).nnz)
    total = 0
    for row in ids:
        _, lens = np.unique(row, return_counts=True)
        total += int((lens * (lens + 1) // 2).sum())
    return total


def _arrays(p: Profile, length: int, sharding, seed: int):
    """``q, k, v, dout`` ``[B, length, H(k), D]`` made on the devices of ``sharding``."""
    import jax
    import jax.numpy as jnp

    dt = jnp.dtype(p.dtype)
    shapes = [(p.batch, length, p.heads, p.head_dim), (p.batch, length, p.kv_heads, p.head_dim)]
    shapes = [shapes[0], shapes[1], shapes[1], shapes[0]]
    keys = jax.random.split(jax.random.key(seed), 4)
    return tuple(
        jax.jit(lambda key, s=s: jax.random.normal(key, s, dt), out_shardings=sharding)(key)
        for key, s in zip(keys, shapes, strict=True)
    )


# --- peers ---------------------------------------------------------------------------------------


@dataclass
class Run:
    impl: str
    parts: int
    length: int
    fn: Callable
    args: tuple


def _call(kind: str, attend: Callable):
    """``attend(q, k, v, *ids)`` as the timed function of a mode: forward, or forward+backward
    (``dq, dk, dv`` of ``sum(out * dout)``; dq feeds the next call's q)."""
    import jax

    if kind == "fwd":
        return lambda q, k, v, do, *ids: attend(q, k, v, *ids)

    def fwd_bwd(q, k, v, do, *ids):
        out, vjp = jax.vjp(lambda q, k, v: attend(q, k, v, *ids), q, k, v)
        return vjp(do)

    return fwd_bwd


def _one_device(case: Case, p: Profile, ctx: dict) -> Run:
    import jax
    import jax.numpy as jnp

    import splat

    dev = jax.devices()[0]
    length = case.single_length
    x = _arrays(p, length, jax.sharding.SingleDeviceSharding(dev), ctx["seed"])
    ids = _ids(case, p, length, ctx["seed"])
    extra = () if ids is None else (jax.device_put(jnp.asarray(ids), dev),)
    mask, backend = case.mask, ctx["backend"]

    def attend(q, k, v, *ids):
        kw = {"segment_ids": ids[0]} if ids else {}
        return splat.attention(q, k, v, mask, backend=backend, **kw)

    return Run("one_device", 1, length, attend, (*x, *extra))


def _mesh(parts: int):
    import jax

    return jax.sharding.Mesh(np.array(jax.devices()[:parts]), ("sp",))


def _sharded_inputs(case: Case, p: Profile, parts: int, ctx: dict, order: str):
    """The case's inputs over the first ``parts`` devices, held in ``order``."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import splat

    mesh = _mesh(parts)
    sharding = NamedSharding(mesh, P(None, "sp"))
    x = _arrays(p, case.length, sharding, ctx["seed"])
    if order == "zigzag":  # the same tokens as one_device's, held in zigzag order
        x = tuple(jax.jit(lambda a: splat.zigzag(a, parts), out_shardings=sharding)(a) for a in x)
    ids = _ids(case, p, case.length, ctx["seed"])
    extra = ()
    if ids is not None:
        held = splat.zigzag(ids, parts) if order == "zigzag" else ids
        extra = (jax.device_put(jnp.asarray(held), NamedSharding(mesh, P(None, "sp"))),)
    return mesh, x, extra


def _sharded(case: Case, p: Profile, parts: int, ctx: dict) -> Run:
    import splat

    mesh, x, extra = _sharded_inputs(case, p, parts, ctx, case.order)
    mask, backend, order = case.mask, ctx["backend"], case.order

    def attend(q, k, v, *ids):
        kw = {"segment_ids": ids[0]} if ids else {}
        return splat.sharded_attention(
            q, k, v, mask, mesh=mesh, axis="sp", order=order, backend=backend, **kw
        )

    return Run("sharded", parts, case.length, attend, (*x, *extra))


def _allgather(case: Case, p: Profile, parts: int, ctx: dict) -> Run:
    import jax
    from jax.sharding import PartitionSpec as P

    import splat
    from splat._sharded import _plan

    mesh, x, extra = _sharded_inputs(case, p, parts, ctx, "contiguous")
    layout = splat.analyze(case.mask, case.length)
    rows = [_plan.rows_layout(layout, parts, "contiguous", d) for d in range(parts)]
    backend = ctx["backend"]

    def local(q, k, v, *ids):
        gather = lambda a: jax.lax.all_gather(a, "sp", axis=1, tiled=True)

        keys, values = gather(k), gather(v)
        kw = {"segment_ids": ids[0], "kv_segment_ids": gather(ids[0])} if ids else {}
        branches = [
            lambda q, kk, vv, lay=lay: splat.attention(q, kk, vv, lay, backend=backend, **kw) for lay in rows
        ]
        return jax.lax.switch(jax.lax.axis_index("sp"), branches, q, keys, values)

    seq = P(None, "sp")
    mapped = jax.shard_map(
        local, mesh=mesh, in_specs=(seq,) * (3 + len(extra)), out_specs=seq, check_vma=False
    )
    return Run("allgather", parts, case.length, mapped, (*x, *extra))


# --- measuring -----------------------------------------------------------------------------------


def _memory(compiled, devices) -> dict:
    """Bytes per device: XLA's memory analysis of ``compiled``, and the devices' peak so far."""
    out = {}
    try:
        m = compiled.memory_analysis()
        args, outs, temp = (int(getattr(m, f"{a}_size_in_bytes")) for a in ("argument", "output", "temp"))
        out.update(argument_bytes=args, output_bytes=outs, temp_bytes=temp, program_bytes=args + outs + temp)
    except Exception as e:  # not every platform analyses memory
        out["memory_analysis"] = f"unavailable: {type(e).__name__}"
    peaks = []
    for d in devices:
        try:
            stats = d.memory_stats() or {}
        except Exception:
            stats = {}
        peaks.append(stats.get("peak_bytes_in_use"))
    out["peak_bytes_in_use"] = peaks if any(x is not None for x in peaks) else None
    return out


def _measure(run: Run, kind: str, ctx: dict, warmup: int, repeats: int, devices) -> tuple[dict, np.ndarray]:
    """``(row, output)``: the run's timing and memory in ``kind`` mode, and its first output."""
    import jax
    import jax.numpy as jnp

    from splat.tools.timing import compile_timed, time_call

    fn = _call(kind, run.fn)
    n = ctx["per_sample"]
    compiled, launch, sync = compile_timed(fn, run.args, n, {0: 0})
    t = time_call(
        None,
        warmup,
        repeats,
        launch=launch,
        sync=sync,
        per_sample=n,
        calls_per_launch=n,
        min_sample_ms=ctx["min_sample_ms"],
    )
    first = jax.tree.leaves(compiled(*run.args))[0]
    out = np.asarray(jax.block_until_ready(first).astype(jnp.float32))
    return {**t, **_memory(compiled, devices)}, out


def _verdict(out: np.ndarray, ref: np.ndarray | None, ref_name: str | None, dtype: str) -> dict:
    if ref is None:
        return {"max_abs_diff": None, "agrees": None, "check": "no reference of the same length"}
    if not np.isfinite(out).all():
        return {"max_abs_diff": None, "agrees": False, "check": "non-finite output"}
    err = float(np.max(np.abs(out - ref)))
    scale = float(np.max(np.abs(ref)))
    ok = err <= ABS_TOL[dtype] and err <= REL_TOL[dtype] * max(scale, 1.0)
    return {"max_abs_diff": err, "agrees": bool(ok), "check": f"vs {ref_name}"}


def run_case(
    case: Case, p: Profile, parts_list: list[int], peers: list[str], modes: tuple[str, ...], ctx: dict, log
) -> tuple[list, list]:
    """Every peer and mode of one case; returns ``(rows, skipped)``."""
    import gc

    import jax

    from splat.tools.check import short_error

    rows, skipped = [], []
    ids_full = _ids(case, p, case.length, ctx["seed"])
    flops_fwd = {
        length: 4.0 * p.batch * p.heads * p.head_dim * _pairs(case, length, ids)
        for length, ids in {
            case.length: ids_full,
            case.single_length: _ids(case, p, case.single_length, ctx["seed"]),
        }.items()
    }
    plans = {}
    for kind in modes:
        outs: dict[str, np.ndarray] = {}
        for impl in peers:
            for parts in [1] if impl == "one_device" else parts_list:
                label = impl if impl == "one_device" else f"{impl}[{parts}]"
                try:
                    if impl == "one_device":
                        run = _one_device(case, p, ctx)
                    elif impl == "sharded":
                        run = _sharded(case, p, parts, ctx)
                        plans[parts] = _plan_text(case, parts)
                    else:
                        run = _allgather(case, p, parts, ctx)
                    row, out = _measure(run, kind, ctx, p.warmup, p.repeats, jax.devices()[: run.parts])
                except Exception as e:  # out of memory, a refusal: record why and go on
                    skipped.append(
                        {"case": case.name, "mode": kind, "label": label, "reason": short_error(e)}
                    )
                    log(f"  skip {label} {kind}: {short_error(e)}")
                    continue
                if case.order == "zigzag" and impl == "sharded":
                    import splat

                    out = np.asarray(splat.unzigzag(out, parts))
                outs[label] = out
                flops = flops_fwd[run.length] * (3.5 if kind == "fwd_bwd" else 1.0)
                rows.append(
                    {
                        "case": case.name,
                        "mode": kind,
                        "impl": impl,
                        "label": label,
                        "parts": run.parts,
                        "S": run.length,
                        **row,
                        "us_per_token": row["ms"] * 1e3 / (p.batch * run.length),
                        "flops": flops,
                        "tflops": flops / (row["ms"] * 1e-3) / 1e12,
                    }
                )
                log(f"  {label:16s} {kind:8s} {row['ms']:10.3f} ms  {rows[-1]['tflops']:8.2f} TFLOP/s")
                del run
                gc.collect()
        ref_name = "one_device" if case.single_length == case.length else None
        for r in rows:
            if r["mode"] != kind:
                continue
            name = ref_name
            if name is None and r["impl"] == "sharded":
                name = f"allgather[{r['parts']}]"
            ref = outs.get(name) if name and name != r["label"] else None
            r.update(_verdict(outs[r["label"]], ref, name, p.dtype) if r["label"] in outs else {})
    one = {r["mode"]: r for r in rows if r["impl"] == "one_device"}
    for r in rows:
        base = one.get(r["mode"])
        r["speedup"] = base["us_per_token"] / r["us_per_token"] if base else None
        ag = next(
            (
                x
                for x in rows
                if x["mode"] == r["mode"] and x["impl"] == "allgather" and x["parts"] == r["parts"]
            ),
            None,
        )
        r["vs_allgather"] = ag["ms"] / r["ms"] if ag and r["impl"] == "sharded" else None
    for r in rows:
        r["plan"] = plans.get(r["parts"]) if r["impl"] == "sharded" else None
    return rows, skipped


def _plan_text(case: Case, parts: int) -> str:
    import splat
    from splat._sharded import plan

    return plan(splat.analyze(case.mask, case.length), parts, case.order).describe()


def evaluate_targets(cases: list[Case], rows: list[dict]) -> list[dict]:
    """Each case's targets: ``{"case", "target", "value", "met", "detail"}`` (``met`` None: not judged)."""
    out = []
    for case in cases:
        for t in case.targets:
            r = next(
                (
                    x
                    for x in rows
                    if x["case"] == case.name and x["mode"] == "fwd_bwd" and x["impl"] == "sharded"
                    and x["parts"] == t.parts and x.get("agrees") is not False
                ),
                None,
            )  # fmt: skip
            value = None if r is None else r.get(t.metric)
            detail = "no agreeing sharded run at that size" if r is None else f"{r['ms']:.3f} ms"
            if r is not None and value is None:
                detail = "one_device or allgather did not run"
            out.append(
                {
                    "case": case.name,
                    "target": t.describe(),
                    "value": value,
                    "met": None if value is None else bool(value >= t.threshold),
                    "detail": detail,
                }
            )
    return out


def run_bench(
    profile: Profile,
    cases: list[Case],
    parts_list: list[int],
    peers: list[str],
    modes: tuple[str, ...],
    ctx: dict,
    log=print,
):
    """Runs every case; the JSON-ready result."""
    import jax

    from splat.tools.bench import environment
    from splat.tools.timing import TIMING_METHOD

    env = environment()
    log(f"bench_sequence_parallel on {jax.device_count()} x {env['device']}, profile {profile.name}")
    rows, skipped = [], []
    for case in cases:
        log(f"{case.name}: {case.what}, S={case.length} (one device: {case.single_length})")
        r, s = run_case(case, profile, parts_list, peers, modes, ctx, log)
        rows += r
        skipped += s
    return {
        "schema": SCHEMA,
        "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "environment": env,
        "settings": {"profile": asdict(profile), "parts": parts_list, "peers": peers, "modes": modes, **ctx},
        "cases": {
            c.name: {
                "what": c.what,
                "mask": c.mask_expr,
                "S": c.length,
                "single_S": c.single_length,
                "order": c.order,
                "documents": c.documents,
                "targets": [t.describe() for t in c.targets],
            }
            for c in cases
        },  # fmt: skip
        "flop_formula": FLOP_FORMULA,
        "speedup_definition": SPEEDUP_DEFINITION,
        "timing_method": TIMING_METHOD,
        "results": rows,
        "skipped": skipped,
        "targets": evaluate_targets(cases, rows),
    }


# --- reporting ----------------------------------------------------------------------------------


def _gib(x) -> str:
    return "-" if x is None else f"{x / 2**30:.2f}"


def format_table(result: dict) -> str:
    hdr = (
        f"{'case':15s} {'mode':8s} {'peer':15s} {'S':>7s} {'ms':>10s} {'TFLOP/s':>8s} {'speedup':>7s} "
        f"{'x allg':>6s} {'GiB/dev':>7s} {'check':>5s}"
    )
    lines = [result["speedup_definition"], "", hdr, "-" * len(hdr)]
    for r in result["results"]:
        sp = "-" if r["speedup"] is None else f"{r['speedup']:.2f}"
        ag = "-" if r["vs_allgather"] is None else f"{r['vs_allgather']:.2f}"
        chk = {True: "ok", False: "DIFF"}.get(r.get("agrees"), "-")
        lines.append(
            f"{r['case']:15s} {r['mode']:8s} {r['label']:15s} {r['S']:7d} {r['ms']:10.3f} {r['tflops']:8.2f} "
            f"{sp:>7s} {ag:>6s} {_gib(r.get('program_bytes')):>7s} {chk:>5s}"
        )
    if result["skipped"]:
        lines += ["", "skipped:"] + [
            f"  {s['case']} {s['mode']} {s['label']}: {s['reason'][:120]}" for s in result["skipped"]
        ]
    lines += ["", "targets:"]
    for t in result["targets"]:
        mark = {True: "met   ", False: "MISSED", None: "n/a   "}[t["met"]]
        val = "-" if t["value"] is None else f"{t['value']:.2f}"
        lines.append(f"  {mark} {t['case']:15s} {t['target']:48s} {val:>6s}  {t['detail']}")
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    """Speed-up over one device per case, forward and forward+backward, sharded and all-gather bars."""
    from splat.tools.plot import _pyplot

    plt = _pyplot()
    rows = [r for r in result["results"] if r["impl"] != "one_device" and r["speedup"] is not None]
    cases = list(dict.fromkeys(r["case"] for r in rows))
    labels = sorted({r["label"] for r in rows})
    fig, axes = plt.subplots(
        1, 2, figsize=(max(9, 2.2 * len(cases) + 3), 4.5), layout="constrained", sharey=True
    )
    width = 0.8 / max(len(labels), 1)
    for ax, kind in zip(axes, MODES, strict=True):
        for i, label in enumerate(labels):
            xs, ys = [], []
            for c, case in enumerate(cases):
                r = next(
                    (r for r in rows if r["case"] == case and r["label"] == label and r["mode"] == kind), None
                )
                if r is not None:
                    xs.append(c + (i - (len(labels) - 1) / 2) * width)
                    ys.append(r["speedup"])
            ax.bar(xs, ys, width, label=label)
        ax.axhline(1.0, color="k", linewidth=0.8)
        ax.set_xticks(range(len(cases)), cases, rotation=30, ha="right")
        ax.set_title("forward" if kind == "fwd" else "forward+backward")
    axes[0].set_ylabel("speed-up over one device (per token)")
    axes[1].legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    env = result["environment"]
    fig.suptitle(f"sequence-parallel splat on {env['device_count']} x {env['device']}")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- CLI -----------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--cases", nargs="+", help="case names or shell globs (default: all)")
    p.add_argument("--parts", nargs="+", type=int, help="device counts of the sharded runs (default: all)")
    p.add_argument("--peers", nargs="+", choices=PEERS, help="peers to run (default: all)")
    p.add_argument("--modes", nargs="+", choices=MODES, help="fwd, fwd_bwd (default: both)")
    p.add_argument("--smoke", action="store_true", help="tiny float32 sizes on CPU devices (a set-up check)")
    p.add_argument("--devices", type=int, default=4, help="--smoke: CPU devices to create (default 4)")
    p.add_argument("--backend", default="auto", help="splat's backend")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the JSON here")
    p.add_argument("--plot", help="write a PNG of the speed-ups here")
    p.add_argument(
        "--assert",
        dest="check_targets",
        action="store_true",
        help="exit 1 when a target is missed or not judged",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.smoke:  # before JAX starts: the CPU devices the sharded runs use
        flag = f"--xla_force_host_platform_device_count={args.devices}"
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax

    from splat.tools.bench import write_json
    from splat.tools.timing import on_gpu, sampling

    profile = SMOKE if args.smoke else FULL
    if not args.smoke and not on_gpu():
        print(
            "bench_sequence_parallel: the full sizes need GPUs (JAX sees none); use --smoke", file=sys.stderr
        )
        return 2
    n = jax.device_count()
    parts_list = args.parts or [n]
    bad = [k for k in parts_list if not 2 <= k <= n]
    if bad:
        print(f"bench_sequence_parallel: --parts {bad}: between 2 and the {n} devices here", file=sys.stderr)
        return 2
    try:
        cases = select_cases(make_cases(profile), args.cases)
    except ValueError as e:
        print(f"bench_sequence_parallel: {e}", file=sys.stderr)
        return 2
    per_sample, min_sample_ms = sampling()
    ctx = {
        "backend": args.backend,
        "seed": args.seed,
        "per_sample": per_sample,
        "min_sample_ms": min_sample_ms,
    }
    modes = tuple(m for m in MODES if m in (args.modes or MODES))
    result = run_bench(profile, cases, parts_list, list(args.peers or PEERS), modes, ctx)
    if args.out:
        write_json(result, args.out)
        print(f"wrote {args.out}")
    if args.plot:
        plot(result, args.plot)
        print(f"wrote {args.plot}")
    print(format_table(result))
    if args.check_targets:
        misses = [t for t in result["targets"] if t["met"] is not True]
        for t in misses:
            why = "cannot judge" if t["met"] is None else "MISSED"
            print(f"target {why}: {t['case']}: {t['target']} ({t['detail']})", file=sys.stderr)
        if misses:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
