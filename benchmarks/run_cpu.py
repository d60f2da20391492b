"""CPU acceptance numbers for splat, written to ``benchmarks/results/cpu-<date>.json``.

Measures, on whatever CPU this is:

1. layout construction ``mask.to_acsr(S, S)`` at S = 65536 for every pattern of
   ``splat.catalogue.BENCH`` (layout caches cleared before each run);
2. ``splat.analyze`` of each pattern's dense 8192 x 8192 bool rendering;
3. attention at S = 8192, H = 4 (``--heads``), D = 64, float32, ``sliding_window(256, 256)``:
   splat vs dense XLA masked attention (and splat's unfused ops), same process,
   with the speed ratio (dense ms / splat ms) and the XLA temp-memory ratio
   (dense temp bytes / splat temp bytes).

Usage (from the repository root, with the venv ``make test`` builds)::

    .venv/bin/python benchmarks/run_cpu.py                 # the real numbers (a few minutes)
    .venv/bin/python benchmarks/run_cpu.py --mode both     # also forward+backward
    .venv/bin/python benchmarks/run_cpu.py --mode both --heads 8 --out benchmarks/results/cpu-h8-<date>.json
    .venv/bin/python benchmarks/run_cpu.py --quick --out /tmp/cpu.json   # smoke run, seconds
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=["fwd", "fwdbwd", "both"], default="fwd")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--heads", type=int, default=4, help="attention heads of the window case (default 4)")
    p.add_argument("--quick", action="store_true", help="tiny sizes: checks the script, not the machine")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/cpu-<date>.json)")
    args = p.parse_args(argv)

    from splat import catalogue
    from splat.tools import bench

    load_before = os.getloadavg()  # other work on the machine slows both sides, not always alike

    if args.quick:
        s, build_len, analyze_len, heads, repeats = 512, 4096, 512, 2, 1
    else:
        s, build_len, analyze_len, heads, repeats = 8192, 65536, 8192, args.heads, args.repeats
    window = {"sliding_window(256,256)": catalogue.BENCH["sliding_window"]}
    config = bench.BenchConfig(
        patterns=tuple(window),
        lengths=(s,),
        heads=heads,
        head_dim=64,
        batch=1,
        dtype="float32",
        mode=args.mode,
        backend="jax",
        peers=("splat", "dense_xla", "splat_unfused"),
        warmup=1,
        repeats=repeats,
        build_length=build_len,
        analyze_length=analyze_len,
    )
    result = bench.run_bench(config, window)
    all_patterns = bench.resolve_patterns(None, catalogue.BENCH)
    result["build"] = bench.build_section(all_patterns, build_len, analyze_len)

    acceptance = {
        "S": s,
        "heads": heads,
        "head_dim": 64,
        "dtype": "float32",
        "pattern": "sliding_window(256,256)",
    }
    for mode in config.modes:
        rows = {r["impl"]: r for r in result["results"] if r["mode"] == mode}
        sp, dn = rows.get("splat"), rows.get("dense_xla")
        entry = {"splat_ms": sp and sp["ms"], "dense_ms": dn and dn["ms"]}
        if sp and dn:
            entry["speed_ratio_dense_over_splat"] = dn["ms"] / sp["ms"]
            if sp["temp_bytes"] is not None and dn["temp_bytes"] is not None:
                entry["splat_temp_bytes"], entry["dense_temp_bytes"] = sp["temp_bytes"], dn["temp_bytes"]
                entry["memory_ratio_dense_over_splat"] = dn["temp_bytes"] / max(sp["temp_bytes"], 1)
        acceptance[mode] = entry
    b = result["build"]["patterns"]
    acceptance["build_ms_max"] = max(r["build_ms"] for r in b)
    acceptance["analyze_dense_ms_max"] = max(r["analyze_ms"] for r in b)
    acceptance["load_average_1_5_15min"] = {"before": load_before, "after": os.getloadavg()}
    result["acceptance"] = acceptance

    out = args.out or os.path.join(HERE, "results", f"cpu-{dt.date.today().isoformat()}.json")
    bench.write_json(result, out)
    print(bench.format_table(result))
    print("\nacceptance:")
    for k, v in acceptance.items():
        print(f"  {k}: {v}")
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
