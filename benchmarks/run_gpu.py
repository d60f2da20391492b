"""The GPU benchmark suite: every pattern of ``splat.catalogue.suite()`` against every peer.

``BENCH`` patterns run at each ``--lengths`` S; the neighborhood patterns of
``GRID`` (2-D images, 3-D video) exist only at their grid's S = 16384 and run
there once (``splat.tools.bench.pattern_lengths``).

Writes ``benchmarks/results/<device>-<date>.json`` and a PNG beside it. Peers that
are not installed or do not support a mask are skipped with the reason printed
(cuDNN: full/causal/causal-window only; FlexAttention and torch SDPA need torch
with CUDA; tokamax needs tokamax). Every peer's output is checked against
splat's on the same inputs (torch SDPA excepted: it runs with no mask); a peer
that disagrees is printed with a warning, still timed, and listed under
``disagreements`` in the JSON.

Usage (on a CUDA machine, after ``make test`` has built the venv with the cuda extra)::

    .venv/bin/python benchmarks/run_gpu.py                       # bf16, fwd and fwd+bwd, S = 4096..32768
    .venv/bin/python benchmarks/run_gpu.py --lengths 8192 --dtype float16 --mode fwd
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def main(argv: list[str] | None = None) -> dict:
    from jax_bindings import BACKENDS

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--patterns", nargs="+", default=None)
    p.add_argument("--lengths", nargs="+", type=int, default=[4096, 8192, 16384, 32768])
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--mode", default="both", choices=["fwd", "fwdbwd", "both"])
    p.add_argument("--backend", default="auto", choices=list(BACKENDS))
    p.add_argument("--peers", nargs="+", default=None)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--build", action="store_true", help="also the layout construction section")
    p.add_argument("--quick", action="store_true", help="one short length, few repeats: checks the set-up")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    import jax

    from splat import catalogue
    from splat.tools import bench
    from splat.tools.plot import plot_bench

    if jax.default_backend() != "gpu":
        print("warning: no GPU visible to JAX; timing the CPU instead", file=sys.stderr)
    quick = bench.BenchConfig.defaults(quick=True) if args.quick else {}
    names = list(args.patterns) if args.patterns else catalogue.suite()
    if args.quick:
        names = names[:3]
    result, out = None, args.out
    # one pattern at a time, the JSON rewritten after each: a run cut short keeps what it measured
    for name in names:
        config = bench.BenchConfig(
            patterns=(name,),
            lengths=tuple(quick.get("lengths", args.lengths)),
            heads=args.heads,
            head_dim=args.head_dim,
            batch=args.batch,
            dtype=args.dtype,
            mode=args.mode,
            backend=args.backend,
            peers=tuple(args.peers) if args.peers else None,
            warmup=quick.get("warmup", 3),
            repeats=quick.get("repeats", args.repeats),
            build=args.build and name == names[0],
        )
        part = bench.run_bench(config)
        if result is None:
            result = part
            result["settings"]["patterns"] = names
        else:
            for key in ("results", "skipped", "memory", "disagreements"):
                result[key] += part[key]
        if out is None:
            device = re.sub(r"[^A-Za-z0-9]+", "-", result["environment"]["device"]).strip("-").lower()
            out = os.path.join(HERE, "results", f"{device}-{dt.date.today().isoformat()}.json")
        bench.write_json(result, out)
        print(f"wrote {out} ({len(result['results'])} timings)", flush=True)
    try:
        plot_bench(result, os.path.splitext(out)[0] + ".png")
    except ImportError as e:
        print(f"no plot: {e}", file=sys.stderr)
    bad = result["disagreements"]
    if bad:
        print(f"WARNING: {len(bad)} peer output(s) disagree with splat's:", file=sys.stderr)
        for d in bad:
            err, tol = d["max_abs_err_vs_splat"], d["check_tolerance"]
            what = d["check"] if err is None else f"max|diff| {err:.4g} > tolerance {tol:.4g}"
            print(f"  {d['impl']} {d['pattern']} S={d['S']} {d['dtype']}: {what}", file=sys.stderr)
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
