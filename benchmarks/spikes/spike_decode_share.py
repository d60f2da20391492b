"""Spike: the Triton decode kernel's tiles and splits on short walks.

Routes of ``jax_bindings._triton.decode`` on ``bench_decode``'s cases (full sizes), timed in one
process beside splat's public call and FA3 ``flash_mha_with_kvcache``: ``bn{64,128}`` keys a
tile (64 lets more programs share an SM), ``x{1,2,4}`` times the planned splits, and
``cuda_kernel``: the CUDA decode kernel (``jax_bindings._cuda.decode``) on the same call. Every
output is checked against splat's public call (``bench_decode``'s check rule).

Its first version (commit 2a2c66f) timed the split share planned statically against one computed
at run time, and the merge in the kernel against XLA's (session 32 of ``../NOTES.md``).

    python3 -m benchmarks.spikes.spike_decode_share --cases window dilated --out /tmp/tiles.json
"""

from __future__ import annotations

import argparse
import functools
import sys

from benchmarks import bench_decode as bd

ROUTES = ("bn128_x1", "bn128_x2", "bn128_x4", "bn64_x1", "bn64_x2", "cuda_kernel")
CASES = ("window", "sink_window", "dilated", "documents", "causal")


def _prep(route: str):
    def prepare(case: bd.Case, x: bd.Inputs, ctx: bd.Context) -> list[bd.Run]:
        import jax.numpy as jnp

        import splat
        from jax_bindings import _runtime
        from jax_bindings._triton import backend as tb
        from jax_bindings._triton import decode

        layout = splat.analyze(case.mask, q_len=case.cache_len, kv_len=case.cache_len)
        b, sq, length = case.batch, case.sq, case.cache_len
        kw = {}
        if case.segments is not None:
            kw = dict(segment_ids=x.seg_q, kv_segment_ids=x.seg_kv)
        paged = case.page_size is not None
        scale = case.head_dim**-0.5

        def fn(q, k, v, lens, table, *ids):
            rt = _runtime.build(b, sq, length, key_value_seq_lengths=lens, q_offset=lens - sq,
                                layout_rows=length, **dict(zip(kw, ids, strict=True)))
            table = table if paged else None
            if route == "cuda_kernel":
                from jax_bindings._cuda import backend as cb
                from jax_bindings._cuda import decode as cuda_decode

                sms = cb._sm_count()
                out, _ = cuda_decode.forward(q, k, v, rt, layout, scale, None, sms, page_table=table)
                return out
            block_n, times = (int(t.lstrip("bnx")) for t in route.split("_"))
            planned = functools.partial(decode.plan, q.shape, k.shape[2], "bfloat16", layout, scale, None,
                                        tb._sm_count(), ids=bool(ids))
            real = decode.block_n_for
            decode.block_n_for = lambda *a: block_n  # noqa: E731 - the tile of this route, while it traces
            try:
                splits = planned().splits * times
                out, _ = tb.decode_forward(q, k, v, rt, layout, scale, None, table, splits=splits)
            finally:
                decode.block_n_for = real
            return out

        caches = (x.pool_k, x.pool_v, x.page_table) if paged else (x.k, x.v, jnp.zeros((1,), jnp.int32))
        args = (x.q, *caches[:2], x.lens, caches[2], *kw.values())
        return [bd._jax_run(f"triton_{route}", fn, args, ctx, kernels=True)]

    return prepare


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", nargs="+", default=list(CASES))
    p.add_argument("--routes", nargs="+", default=list(ROUTES), choices=list(ROUTES))
    p.add_argument("--peers", nargs="*", default=["flash_attn3"])
    p.add_argument("--fa3-splits", default="4,16,32")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out")
    args = p.parse_args(argv)
    from splat.tools.bench import write_json

    for route in args.routes:
        what = "the CUDA decode kernel" if route == "cuda_kernel" else f"the Triton decode kernel, {route}"
        bd.DECODE_PEERS[f"triton_{route}"] = bd.DecodePeer(f"triton_{route}", what, _prep(route))
    config = bd.DecodeBenchConfig(
        cases=tuple(args.cases), peers=(*args.peers, *(f"triton_{r}" for r in args.routes)), warmup=1,
        repeats=args.repeats, fa3_splits=tuple(int(s) for s in args.fa3_splits.split(",")))
    checkpoint = functools.partial(write_json, path=args.out) if args.out else None
    result = bd.run_decode_bench(config, checkpoint=checkpoint)
    result["spike"] = {"routes": args.routes, "script": "benchmarks/spikes/spike_decode_share.py"}
    if args.out:
        write_json(result, args.out)
    rows = [r for r in result["results"] if r["impl"] != "flash_attn3" or r.get("fa3_best")]
    print(f"{'case':12s} {'impl':24s} {'us':>8s} {'GB/s':>8s} {'HBM':>5s}")
    for r in rows:
        hbm = f"{r['hbm_fraction']:.2f}" if r["hbm_fraction"] else "-"
        print(f"{r['case']:12s} {r['label']:24s} {r['ms'] * 1e3:8.1f} {r['gbps']:8.0f} {hbm:>5s}")
    for s in result["skipped"]:
        print("skipped", s)
    return 1 if result["disagreements"] else 0


if __name__ == "__main__":
    sys.exit(main())
