"""Unfused op bandwidth: ``splat.sddmm``, ``splat.softmax`` and ``splat.spmm`` against the device's limits.

The GPU acceptance asks each unfused op to reach at least 50% of the device's
measured copy bandwidth on the bytes it must move, or of the matrix rate,
whichever bounds. This script measures both limits in the same process, then
times each op alone (jitted, ``backend`` as given: Triton on a CUDA GPU under
"auto") on the layouts of a few ``splat.catalogue.BENCH`` patterns.

Limits, measured here:

* copy bandwidth: ``x + 1`` over a float32 array of ``--copy-mib`` MiB (read
  once, written once): ``GB/s = 2 * bytes / t``;
* matrix rate: an ``n x n @ n x n`` matmul in ``--dtype`` (``--matmul-n``):
  ``TFLOP/s = 2 n^3 / t``.

Bytes each op must move (``e`` bytes per element of ``--dtype``; ``q: [B, Sq, H, D]``,
``k, v: [B, Skv, Hk, D]``; ``W = layout.nnz_max`` stored slots per row of the
value arrays ``[B, H, Sq, W]``; ``nnz`` the mask's nonzeros)::

    sddmm    e * (B*Sq*H*D + B*Skv*Hk*D + B*H*Sq*W)   read q; read K once; write every stored slot
    softmax  e * (B*H*nnz + B*H*Sq*W)                 read the valid scores; write every stored slot
    spmm     e * (B*H*nnz + B*Skv*Hk*D + B*Sq*H*D)    read the valid probs; read V once; write out

Stored slots are *written* in full (padding slots hold 0 by the value-array
contract), but padding need not be *read*, so reads count valid slots only;
``bytes_all_slots`` in each row counts padding reads too (the two differ only
where rows have unequal lengths, e.g. ``strided``). FLOPs: ``2*B*H*nnz*D`` for
``sddmm`` and ``spmm``; 0 for ``softmax`` (no matrix work: it is bounded by
memory).

Timing (``timing_method`` in the JSON): on a GPU one launch runs 10 calls of the
op chained inside one jitted executable (``splat.tools.timing.chain``: where an output
has an argument's shape it is that argument in the next call, and all inputs pass
through ``lax.optimization_barrier`` with the previous output), and a sample is
launches back to back, at least 20 ms of them, then one sync; ``ms`` is the
sample over the calls it made.

Bound: the op's ideal time is ``max(bytes / copy_bw, flops / matmul_rate)``;
``bound`` names the larger term ("memory" or "matrix") and ``frac_of_bound =
ideal / measured`` is the fraction of that limit reached (>= 0.5 meets the
acceptance).

Usage (from the repository root; the GPU numbers)::

    .venv/bin/python benchmarks/unfused_bw.py                       # bf16, H=16, D=128, S = 8192 16384
    .venv/bin/python benchmarks/unfused_bw.py --lengths 8192 --patterns strided --out /tmp/bw.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import re
import sys
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
SCHEMA = "splat-unfused-bw/1"
DEFAULT_PATTERNS = ("sliding_window", "dilated_window", "strided", "block_local")
OPS = ("sddmm", "softmax", "spmm")

BYTE_FORMULAS = {
    "sddmm": "e*(B*Sq*H*D + B*Skv*Hk*D + B*H*Sq*W): read q, read K once, write every stored slot",
    "softmax": "e*(B*H*nnz + B*H*Sq*W): read the valid scores, write every stored slot",
    "spmm": "e*(B*H*nnz + B*Skv*Hk*D + B*Sq*H*D): read the valid probs, read V once, write out",
    "symbols": "e bytes/element of dtype; W = layout.nnz_max (stored slots per row); nnz = mask nonzeros; "
    "bytes_all_slots counts padding reads too (B*H*Sq*W in place of B*H*nnz)",
}
FLOP_FORMULAS = {"sddmm": "2*B*H*nnz*D", "softmax": "0 (no matrix work)", "spmm": "2*B*H*nnz*D"}
BOUND_RULE = (
    "ideal = max(bytes / copy_bw, flops / matmul_rate); bound = the larger term; "
    "frac_of_bound = ideal / measured; the acceptance asks frac_of_bound >= 0.5"
)


def op_bytes(
    op: str, *, b: int, sq: int, skv: int, h: int, hk: int, d: int, w: int, nnz: int, e: int
) -> dict:
    """``{"bytes", "bytes_all_slots"}`` an op must move (formulas in the module docstring).

    ``w`` is ``layout.nnz_max``, ``nnz`` the layout's nonzeros, ``e`` bytes per element.
    """
    q_bytes, kv_bytes, out_bytes = b * sq * h * d * e, b * skv * hk * d * e, b * sq * h * d * e
    slots, valid = b * h * sq * w * e, b * h * nnz * e
    if op == "sddmm":
        n = q_bytes + kv_bytes + slots
        return {"bytes": n, "bytes_all_slots": n}
    if op == "softmax":
        return {"bytes": valid + slots, "bytes_all_slots": 2 * slots}
    if op == "spmm":
        return {"bytes": valid + kv_bytes + out_bytes, "bytes_all_slots": slots + kv_bytes + out_bytes}
    raise ValueError(f"unknown op {op!r}")


def op_flops(op: str, *, b: int, h: int, d: int, nnz: int) -> int:
    return 0 if op == "softmax" else 2 * b * h * nnz * d


def _time(
    fn, args, warmup: int, repeats: int, sampling: tuple[int, float], feed: dict
) -> tuple[object, dict]:
    """``(fn(*args), timing)``: a launch runs ``per_sample`` chained calls in one executable.

    ``sampling``: ``(per_sample, min_sample_ms)`` (``splat.tools.timing.sampling``).

    ``feed`` (``splat.tools.timing.chain``): ``{argument index: output leaf}`` that the
    output replaces in the next call of the chain.
    """
    import jax

    from splat.tools.timing import compile_timed, time_call

    per_sample, min_sample_ms = sampling
    compiled, launch, sync = compile_timed(fn, args, per_sample, feed)
    out = jax.block_until_ready(compiled(*args))
    t = time_call(
        None,
        warmup,
        repeats,
        launch=launch,
        sync=sync,
        per_sample=per_sample,
        calls_per_launch=per_sample,
        min_sample_ms=min_sample_ms,
    )
    return out, t


def measure_copy(mib: int, warmup: int, repeats: int, sampling: tuple[int, float]) -> dict:
    """Device copy bandwidth: ``x + 1`` over ``mib`` MiB of float32 (read + write)."""
    import jax.numpy as jnp

    n = mib * 2**20 // 4
    x = jnp.arange(n, dtype=jnp.float32)
    _, t = _time(lambda x: x + 1, (x,), warmup, repeats, sampling, feed={0: 0})
    nbytes = 2 * n * 4
    gbps = nbytes / (t["ms"] * 1e-3) / 1e9
    return {"method": "x + 1, float32", "bytes": nbytes, "ms": t["ms"], "gbps": gbps}


def measure_matmul(n: int, dtype, warmup: int, repeats: int, sampling: tuple[int, float]) -> dict:
    """Matrix rate: an ``n x n @ n x n`` matmul in ``dtype``."""
    import jax
    import jax.numpy as jnp

    ka, kb = jax.random.split(jax.random.key(1))
    a = jax.random.normal(ka, (n, n), jnp.float32).astype(dtype)
    b = jax.random.normal(kb, (n, n), jnp.float32).astype(dtype)
    _, t = _time(lambda a, b: a @ b, (a, b), warmup, repeats, sampling, feed={0: 0})
    flops = 2 * n**3
    return {
        "n": n,
        "dtype": jnp.dtype(dtype).name,
        "flops": flops,
        "ms": t["ms"],
        "tflops": flops / (t["ms"] * 1e-3) / 1e12,
    }


def _row(op, t, sizes, copy_gbps, mm_tflops) -> dict:
    by = op_bytes(op, **sizes)
    flops = op_flops(op, b=sizes["b"], h=sizes["h"], d=sizes["d"], nnz=sizes["nnz"])
    sec = t["ms"] * 1e-3
    t_mem = by["bytes"] / (copy_gbps * 1e9)
    t_mat = flops / (mm_tflops * 1e12)
    ideal = max(t_mem, t_mat)
    return {
        "op": op,
        **by,
        "flops": flops,
        **t,
        "gbps": by["bytes"] / sec / 1e9,
        "frac_copy_bw": by["bytes"] / sec / 1e9 / copy_gbps,
        "tflops": flops / sec / 1e12,
        "frac_matmul": flops / sec / 1e12 / mm_tflops,
        "bound": "memory" if t_mem >= t_mat else "matrix",
        "ideal_ms": ideal * 1e3,
        "frac_of_bound": ideal / sec,
        "meets_half": bool(ideal / sec >= 0.5),
    }


def format_table(result: dict) -> str:
    c, m = result["copy"], result["matmul"]
    lines = [
        f"{result['environment']['device']}: copy {c['gbps']:.1f} GB/s ({c['method']}), "
        f"matmul {m['tflops']:.2f} TFLOP/s ({m['n']}^3 {m['dtype']}); backend {result['backend']}",
        BOUND_RULE,
    ]
    hdr = (
        f"{'pattern':16s} {'S':>6s} {'op':8s} {'ms':>9s} {'GB/s':>8s} {'%copy':>6s} {'TF/s':>7s} "
        f"{'%mm':>5s} {'bound':7s} {'%bound':>6s}"
    )
    lines += [hdr, "-" * len(hdr)]
    for r in result["rows"]:
        lines.append(
            f"{r['pattern'][:16]:16s} {r['S']:6d} {r['op']:8s} {r['ms']:9.4f} {r['gbps']:8.1f} "
            f"{100 * r['frac_copy_bw']:6.1f} {r['tflops']:7.2f} {100 * r['frac_matmul']:5.1f} "
            f"{r['bound']:7s} {100 * r['frac_of_bound']:6.1f}{'' if r['meets_half'] else '  < 50%'}"
        )
    for s in result["skipped"]:
        lines.append(f"  skipped {s['pattern']} S={s['S']} {s['op']}: {s['reason']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    from jax_bindings import BACKENDS

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--patterns", nargs="+", default=list(DEFAULT_PATTERNS), help="catalogue names, mask specs"
    )
    p.add_argument("--lengths", nargs="+", type=int, default=[8192, 16384])
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--backend", default="auto", choices=list(BACKENDS))
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--copy-mib", type=int, default=1024, help="size of the copy-bandwidth array")
    p.add_argument("--matmul-n", type=int, default=8192, help="n of the n^3 matrix-rate matmul")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON path (default results/unfused-bw-<device>-<date>.json)")
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp

    import splat
    from jax_bindings import _dispatch
    from splat.tools import bench, timing

    if jax.default_backend() != "gpu":
        print("warning: no GPU visible to JAX; measuring the CPU instead", file=sys.stderr)
    sampling = timing.sampling()
    per_sample = sampling[0]
    env = bench.environment()
    dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}[args.dtype]
    e = jnp.dtype(dtype).itemsize
    out = args.out
    if out is None:
        device = re.sub(r"[^A-Za-z0-9]+", "-", env["device"]).strip("-").lower()
        out = os.path.join(HERE, "results", f"unfused-bw-{device}-{dt.date.today().isoformat()}.json")

    copy = measure_copy(args.copy_mib, args.warmup, args.repeats, sampling)
    print(f"copy bandwidth {copy['gbps']:.1f} GB/s ({args.copy_mib} MiB)", flush=True)
    mm = measure_matmul(args.matmul_n, dtype, args.warmup, args.repeats, sampling)
    print(f"matmul {mm['tflops']:.2f} TFLOP/s ({args.matmul_n}^3 {args.dtype})", flush=True)

    result = {
        "schema": SCHEMA,
        "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "environment": env,
        "settings": vars(args) | {"out": out},
        "backend": None,  # the backend running the first pattern's sddmm (set below)
        "byte_formulas": BYTE_FORMULAS,
        "flop_formulas": FLOP_FORMULAS,
        "bound_rule": BOUND_RULE,
        "timing_method": timing.TIMING_METHOD,
        "per_sample": per_sample,
        "copy": copy,
        "matmul": mm,
        "rows": [],
        "skipped": [],
        "warnings": [],
    }
    b, h, d, scale = args.batch, args.heads, args.head_dim, args.head_dim**-0.5
    backend = args.backend
    for name, make in bench.resolve_patterns(args.patterns):
        for s in args.lengths:
            mask = make(s)
            layout = splat.analyze(mask, q_len=s, kv_len=s)
            kq, kk, kv = jax.random.split(jax.random.key(args.seed), 3)
            q, k, v = (jax.random.normal(r, (b, s, h, d), jnp.float32).astype(dtype) for r in (kq, kk, kv))
            sizes = dict(b=b, sq=s, skv=s, h=h, hk=h, d=d, w=layout.nnz_max, nnz=int(layout.nnz), e=e)
            if result["backend"] is None:
                result["backend"] = _dispatch.selected_backend("sddmm", q, k, layout, backend=backend)
            base = {
                "pattern": name,
                "mask": repr(mask),
                "S": s,
                "B": b,
                "H": h,
                "D": d,
                "dtype": args.dtype,
                "nnz": int(layout.nnz),
                "nnz_max": int(layout.nnz_max),
            }
            fns = {
                "sddmm": lambda q, k, layout=layout: splat.sddmm(q, k, layout, backend=backend),
                "softmax": lambda x, layout=layout: splat.softmax(x, layout, scale=scale, backend=backend),
                "spmm": lambda x, v, layout=layout: splat.spmm(x, v, layout, backend=backend),
            }
            x = None  # scores, then probs: each op's input is the previous op's output
            # in a timing chain, the output stands in for the argument of its shape: probs for
            # the scores, out for v; sddmm's scores have no such argument (barrier only)
            feeds = {"sddmm": {}, "softmax": {0: 0}, "spmm": {1: 0}}
            for op in OPS:
                if op != "sddmm" and x is None:
                    result["skipped"].append({**base, "op": op, "reason": "its input (the op before) failed"})
                    continue
                args_ = {"sddmm": (q, k), "softmax": (x,), "spmm": (x, v)}[op]
                try:
                    with warnings.catch_warnings(record=True) as caught:
                        warnings.simplefilter("always")
                        y, t = _time(fns[op], args_, args.warmup, args.repeats, sampling, feeds[op])
                except Exception as err:  # out of memory, a kernel that fails: record, go on
                    msg = str(err).strip().splitlines()
                    reason = f"{type(err).__name__}: {msg[0][:200] if msg else ''}"
                    result["skipped"].append({**base, "op": op, "reason": reason})
                    print(f"  skip {name} S={s} {op}: {reason}", flush=True)
                    x = None
                    continue
                result["warnings"] += [f"{name} S={s} {op}: {w.message}" for w in caught]
                row = {**base, **_row(op, t, sizes, copy["gbps"], mm["tflops"])}
                result["rows"].append(row)
                print(
                    f"  {name} S={s} {op}: {row['ms']:.4f} ms, {row['gbps']:.1f} GB/s, "
                    f"{100 * row['frac_of_bound']:.1f}% of the {row['bound']} bound",
                    flush=True,
                )
                x = y if op != "spmm" else None
            del q, k, v, x
            bench.write_json(result, out)  # after each length: a run cut short keeps what it measured
    result["all_meet_half"] = bool(result["rows"]) and all(r["meets_half"] for r in result["rows"])
    bench.write_json(result, out)
    print(format_table(result))
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
