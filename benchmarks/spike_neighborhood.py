"""Spike: the spatial-tile grid kernels on N-D neighborhoods against FlexAttention (one GPU, one process).

Times splat's forward and forward+backward (JAX, 10 calls chained in one jitted program) and
FlexAttention's (``torch.compile``, block mask built once from ``mask_forms.mask_expression``, as in
``splat bench``; the spike files of 2026-11-24 used per-axis table lookups in the ``mask_mod``), and
splat's dense (full mask) forward for its own dense-tile rate. Useful TFLOP/s = 4 B H nnz D / t
(forward), 2.5x that for forward+backward.

    python benchmarks/spike_neighborhood.py [--cases 2d15 ...] [--backends triton cuda] [--out x.json]

With ``--backends``, each backend's forward is timed (``splat_fwd_*`` is the first's); forward+backward
runs with ``backend="auto"`` for a backend that has no grid backward (cuda: its forward, Triton's
backward), and the dense rate is each backend's own.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

import splat
from splat import masks
from splat.tools import timing
from splat.tools.mask_forms import mask_expression

CASES = {
    "2d15": ((128, 128), 15, {}),
    "2d63": ((128, 128), 63, {}),
    "2d7": ((128, 128), 7, {}),
    "2d7d2": ((128, 128), 7, {"dilation": 2}),
    "3d": ((16, 32, 32), (5, 9, 9), {"is_causal": (True, False, False)}),
}


def _flex(mask, q, k, v, do, mode):
    import torch
    from torch.nn.attention import flex_attention as fa

    expr = mask_expression(mask)  # the bench's FlexAttention form of the neighborhood
    torch._dynamo.reset()  # a fresh compile per case and mode (past 8, dynamo falls back to eager)

    def mask_mod(b, h, qi, ki):
        return expr(qi, ki)

    s = mask.size
    t0 = time.perf_counter()
    bm = fa.create_block_mask(mask_mod, B=None, H=None, Q_LEN=s, KV_LEN=s, device="cuda")
    torch.cuda.synchronize()
    mask_ms = (time.perf_counter() - t0) * 1e3
    flex = torch.compile(fa.flex_attention, dynamic=False)
    tq, tk, tv, tdo = (
        torch.from_numpy(np.ascontiguousarray(np.asarray(x.astype(jnp.float32)).transpose(0, 2, 1, 3)))
        .to("cuda", torch.bfloat16)
        .requires_grad_(mode == "fwdbwd")
        for x in (q, k, v, do)
    )

    def step():
        if mode == "fwd":
            with torch.no_grad():
                return flex(tq, tk, tv, block_mask=bm)
        for t in (tq, tk, tv):
            t.grad = None
        o = flex(tq, tk, tv, block_mask=bm)
        o.backward(tdo)
        return o

    for _ in range(3):
        out = step()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(10):
            step()
        e1.record()
        torch.cuda.synchronize()
        times.append(e0.elapsed_time(e1) / 10)
    return float(np.median(times)), mask_ms, out.detach().float().cpu().numpy().transpose(0, 2, 1, 3)


def _sweep(a) -> None:
    """Forward time of each case under each grid-kernel config of ``--fwd-tiles``."""
    from jax_bindings._triton import grid_plan as gp

    default = gp._tiles_for
    rng = np.random.default_rng(0)
    rows = []
    for cfg in a.fwd_tiles:
        tiles = tuple(int(x) for x in cfg.split(","))
        gp._tiles_for = lambda op, tiles=tiles: tiles if op == "fwd" else default(op)
        gp.grid_plan.cache_clear()
        jax.clear_caches()
        for name in a.cases:
            grid, kern, kw = CASES[name]
            mask = masks.neighborhood(grid, kern, **kw)
            s, h, d = mask.size, a.heads, 128
            q, k, v = (jnp.asarray(rng.standard_normal((1, s, h, d)), jnp.bfloat16) for _ in range(3))
            try:
                ms = timing.chained_ms(
                    lambda q, k, v, mask=mask: splat.attention(q, k, v, mask, backend="triton"), q, k, v
                )
            except Exception as e:  # a config the compiler refuses: say so, go on
                print(f"{name:8s} {cfg:14s} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            tf = 4 * h * mask.to_acsr().nnz * d / ms / 1e9
            rows.append({"case": name, "fwd_tiles": tiles, "ms": ms, "tflops": tf})
            print(f"{name:8s} {cfg:14s} {ms:8.3f} ms {tf:7.1f} TF/s", flush=True)
    gp._tiles_for = default
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": jax.devices()[0].device_kind, "rows": rows}, f, indent=1)


def _cuda_sweep(a) -> None:
    """The cuda grid forward of each case under each modelled per-tile cost of ``--tile-costs``
    (``grid_tiles.TILE_COST``, in keys: it picks the query patch and key tile)."""
    from jax_bindings._cuda import grid_tiles

    default = grid_tiles.TILE_COST
    rng = np.random.default_rng(0)
    rows = []
    for cost in a.tile_costs:
        grid_tiles.TILE_COST = cost
        grid_tiles.grid_plan.cache_clear()
        for name in a.cases:
            grid, kern, kw = CASES[name]
            mask = masks.neighborhood(grid, kern, **kw)
            layout = mask.to_acsr()
            tiles = grid_tiles.grid_plan(layout.grid).tiles
            s, h, d = mask.size, a.heads, 128
            q, k, v = (jnp.asarray(rng.standard_normal((1, s, h, d)), jnp.bfloat16) for _ in range(3))
            def fwd(q, k, v, mask=mask):
                return splat.attention(q, k, v, mask, backend="cuda")

            ms = timing.chained_ms(fwd, q, k, v)
            tf = 4 * h * layout.nnz * d / ms / 1e9
            rows.append({"case": name, "tile_cost": cost, "q_tile": tiles.q_tile, "k_tile": tiles.k_tile,
                         "ms": ms, "tflops": tf})
            print(f"{name:8s} cost {cost:4d} q {tiles.q_tile} k {tiles.k_tile} {ms:8.3f} ms {tf:7.1f} TF/s",
                  flush=True)
    grid_tiles.TILE_COST = default
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": jax.devices()[0].device_kind, "rows": rows}, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", nargs="*", default=list(CASES))
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--backends", nargs="*", default=["triton"])
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--fwd-tiles", nargs="*", default=[], help="forward configs bm,bn,warps,stages to time (no Flex)"
    )
    ap.add_argument("--tile-costs", nargs="*", type=int, default=[],
                    help="cuda grid forward: modelled per-tile costs to time (no Flex)")
    a = ap.parse_args()
    if a.tile_costs:
        _cuda_sweep(a)
        return
    if a.fwd_tiles:
        _sweep(a)
        return
    h, d = a.heads, 128
    rng = np.random.default_rng(0)
    rows = []
    dense_rate = {}
    for name in a.cases:
        grid, kern, kw = CASES[name]
        mask = masks.neighborhood(grid, kern, **kw)
        t0 = time.perf_counter()
        layout = mask.to_acsr()
        analyze_s = time.perf_counter() - t0
        s = mask.size
        q, k, v, do = (jnp.asarray(rng.standard_normal((1, s, h, d)), jnp.bfloat16) for _ in range(4))

        flops = 4 * h * layout.nnz * d
        row = {
            "case": name,
            "grid": grid,
            "kernel": kern,
            **kw,
            "S": s,
            "nnz": layout.nnz,
            "analyze_s": analyze_s,
        }
        outs = {}
        for b in a.backends:
            def fwd(q, k, v, mask=mask, b=b):
                return splat.attention(q, k, v, mask, backend=b)

            def fwdbwd(q, k, v, mask=mask, b=b, do=do):
                back = b if b in ("triton", "jax") else "auto"
                def loss(q, k, v):
                    return (splat.attention(q, k, v, mask, backend=back).astype(jnp.float32) * do).sum()

                return jax.grad(loss, (0, 1, 2))(q, k, v)

            outs[b] = np.asarray(fwd(q, k, v).astype(jnp.float32))
            row[f"{b}_fwd_ms"] = timing.chained_ms(fwd, q, k, v)
            row[f"{b}_fwdbwd_ms"] = timing.chained_ms(fwdbwd, q, k, v)
            row[f"{b}_fwd_tflops"] = flops / row[f"{b}_fwd_ms"] / 1e9
            row[f"{b}_fwdbwd_tflops"] = 2.5 * flops / row[f"{b}_fwdbwd_ms"] / 1e9
            if (b, s) not in dense_rate:
                def dense(q, k, v, b=b):
                    return splat.attention(q, k, v, masks.full(), backend=b)

                dms = timing.chained_ms(dense, q, k, v)
                dense_rate[b, s] = 4 * h * s * s * d / dms / 1e9
            row[f"{b}_dense_fwd_tflops_same_S"] = dense_rate[b, s]
            row[f"{b}_x_own_dense"] = row[f"{b}_fwd_tflops"] / dense_rate[b, s]
            row[f"{b}_max_abs_diff_vs_{a.backends[0]}"] = float(np.abs(outs[b] - outs[a.backends[0]]).max())
        first = a.backends[0]
        for key in ("fwd_ms", "fwdbwd_ms", "fwd_tflops", "fwdbwd_tflops"):
            row[f"splat_{key}"] = row[f"{first}_{key}"]
        if not a.no_flex:
            ours = outs[first]
            for mode in ("fwd", "fwdbwd"):
                ms, mask_ms, out = _flex(mask, q, k, v, do, mode)
                row[f"flex_{mode}_ms"] = ms
                row["flex_block_mask_ms"] = mask_ms
                if mode == "fwd":
                    row["max_abs_diff_vs_flex"] = float(np.abs(out - ours).max())
            for b in a.backends:
                row[f"{b}_x_flex_fwd"] = row["flex_fwd_ms"] / row[f"{b}_fwd_ms"]
                row[f"{b}_x_flex_fwdbwd"] = row["flex_fwdbwd_ms"] / row[f"{b}_fwdbwd_ms"]
            row["x_flex_fwd"] = row[f"{first}_x_flex_fwd"]
            row["x_flex_fwdbwd"] = row[f"{first}_x_flex_fwdbwd"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\n{'case':8s} {'backend':8s} {'fwd ms':>8s} {'TF/s':>6s} {'xFlex':>6s} {'xdense':>6s} "
          f"{'fb ms':>8s} {'TF/s':>6s} {'xFlex':>6s}")
    for r in rows:
        for b in a.backends:
            xf, xb = r.get(f"{b}_x_flex_fwd", 0), r.get(f"{b}_x_flex_fwdbwd", 0)
            print(
                f"{r['case']:8s} {b:8s} {r[f'{b}_fwd_ms']:8.3f} {r[f'{b}_fwd_tflops']:6.1f} {xf:6.2f} "
                f"{r[f'{b}_x_own_dense']:6.2f} {r[f'{b}_fwdbwd_ms']:8.3f} {r[f'{b}_fwdbwd_tflops']:6.1f} "
                f"{xb:6.2f}"
            )
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": jax.devices()[0].device_kind, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
