"""Spike: how the Triton decode kernel cuts walks into splits and merges them.

Four routes of ``jax_bindings._triton.decode.plan`` on ``bench_decode``'s cases (full sizes),
timed in one process beside splat's public call and FA3 ``flash_mha_with_kvcache``:

* ``share``: ``static`` (each row's walk in the planned number of equal shares) or ``runtime``
  (programs of an equal share of every row's walk as the run-time positions make them);
* ``merge``: the splits merged by the row's last program (``kernel``) or by an XLA fusion
  (``xla``, the route before this spike).

and ``cuda_kernel``: the CUDA decode kernel (``jax_bindings._cuda.decode``) on the same call, the
route of strided masks before this spike. Every output is checked against splat's public call
(``bench_decode``'s check rule).

    python3 -m benchmarks.spikes.spike_decode_share --cases window documents --out /tmp/share.json
"""

from __future__ import annotations

import argparse
import functools
import sys

from benchmarks import bench_decode as bd

ROUTES = {
    f"{share}_{merge}": dict(share=share, merge=merge)
    for share in ("static", "runtime")
    for merge in ("kernel", "xla")
}
CASES = ("causal", "causal_long", "causal_wide", "window", "sink_window", "dilated", "documents", "paged16",
         "spec16")


def _prep(route: str):
    def prepare(case: bd.Case, x: bd.Inputs, ctx: bd.Context) -> list[bd.Run]:
        import jax.numpy as jnp

        import splat
        from jax_bindings import _runtime
        from jax_bindings._triton import backend as tb

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
            else:
                out, _ = tb.decode_forward(q, k, v, rt, layout, scale, None, table, **ROUTES[route])
            return out

        caches = (x.pool_k, x.pool_v, x.page_table) if paged else (x.k, x.v, jnp.zeros((1,), jnp.int32))
        args = (x.q, *caches[:2], x.lens, caches[2], *kw.values())
        return [bd._jax_run(f"triton_{route}", fn, args, ctx, kernels=True)]

    return prepare


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", nargs="+", default=list(CASES))
    p.add_argument("--routes", nargs="+", default=list(ROUTES), choices=[*ROUTES, "cuda_kernel"])
    p.add_argument("--peers", nargs="*", default=["flash_attn3"])
    p.add_argument("--fa3-splits", default="0,1,4,8,16,32")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out")
    args = p.parse_args(argv)
    from splat.tools.bench import write_json

    for route in args.routes:
        what = f"decode.plan {ROUTES[route]}" if route in ROUTES else "the CUDA decode kernel"
        bd.DECODE_PEERS[f"triton_{route}"] = bd.DecodePeer(f"triton_{route}", what, _prep(route))
    config = bd.DecodeBenchConfig(
        cases=tuple(args.cases), peers=(*args.peers, *(f"triton_{r}" for r in args.routes)), warmup=1,
        repeats=args.repeats, fa3_splits=tuple(int(s) for s in args.fa3_splits.split(",")))
    checkpoint = functools.partial(write_json, path=args.out) if args.out else None
    result = bd.run_decode_bench(config, checkpoint=checkpoint)
    result["spike"] = {"routes": ROUTES, "script": "benchmarks/spikes/spike_decode_share.py"}
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
