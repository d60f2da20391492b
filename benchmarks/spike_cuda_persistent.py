#!/usr/bin/env python3
"""Spike: the cuda backend's forward with persistent CTAs against its one-CTA-per-row-block grid.

One process, one H100/H200: for each one-band mask and S, the backend's forward
(``jax_bindings._cuda.backend.attention_fwd``) built as a grid of (row blocks, H, B) CTAs and as
persistent CTAs (one per SM, Q by TMA, the next work tile's loads under the last one's epilogue;
``jax_bindings._cuda.source.source(persistent=)``), beside FlashAttention-3 for JAX, each as 10
calls chained in one jitted program. The two builds' outputs must be bit-identical.

    python3 benchmarks/spike_cuda_persistent.py [--lengths 8192 16384] [--out PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jax_bindings._cuda import backend, plan
from splat import masks
from splat.tools import peers, timing

D = 128
MASKS = {
    "full": masks.full(),
    "causal": masks.causal(),
    "causal_window_1024": masks.sliding_window(1023, 0),
    "sliding_window_256": masks.sliding_window(256, 256),
}


def forward(layout, persistent: bool):
    """The backend's forward on ``layout`` with the plan's variant, persistent or not."""
    chosen = plan.fwd_variant

    def pick(*args):
        return dataclasses.replace(chosen(*args), persistent=persistent)

    def fn(q, k, v):
        plan.fwd_variant = pick  # read while tracing, inside chained_ms's compile
        try:
            return backend.attention_fwd(q, k, v, None, layout, 128**-0.5)[0]
        finally:
            plan.fwd_variant = chosen

    return fn


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384])
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    from flash_attn3_jax import flash_mha as fa3

    dev = jax.devices()[0].device_kind
    rows = []
    for S in a.lengths:
        key = jax.random.split(jax.random.key(S), 3)
        q, k, v = (jax.random.normal(x, (1, S, 16, 128), jnp.bfloat16) for x in key)
        for name, mask in MASKS.items():
            layout = mask.to_acsr(S, S)
            flops = 4 * 16 * layout.nnz * 128
            fns = {"grid": forward(layout, False), "persistent": forward(layout, True)}
            kw = peers.flash_attn3_arguments(layout)
            fns["fa3"] = lambda q, k, v, kw=kw: fa3(q, k, v, softmax_scale=D**-0.5, **kw)
            outs = {n: np.asarray(jax.jit(f)(q, k, v).astype(jnp.float32)) for n, f in fns.items()}
            row = {"mask": name, "S": S,
                   "persistent_vs_grid_max_diff": float(np.abs(outs["persistent"] - outs["grid"]).max()),
                   "fa3_vs_grid_max_diff": float(np.abs(outs["fa3"] - outs["grid"]).max())}
            for n, f in fns.items():
                ms = timing.chained_ms(f, q, k, v)
                row[f"{n}_ms"], row[f"{n}_tflops"] = ms, flops / ms * 1e-9
            row["persistent_x_grid"] = row["grid_ms"] / row["persistent_ms"]
            row["persistent_x_fa3"] = row["fa3_ms"] / row["persistent_ms"]
            row["grid_x_fa3"] = row["fa3_ms"] / row["grid_ms"]
            rows.append(row)
            shown = {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}
            print(json.dumps(shown), flush=True)
    doc = {"schema": "splat-spike-cuda-persistent/1", "device": dev,
           "date": datetime.datetime.now().isoformat(timespec="seconds"),
           "settings": {"B": 1, "H": 16, "D": 128, "dtype": "bfloat16", "chained_calls": 10}, "rows": rows}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=1)
    print(f"{'mask':>20} {'S':>6} {'grid':>7} {'pers.':>7} {'fa3':>7} {'p/g':>6} {'p/fa3':>6} diff")
    for r in rows:
        print(f"{r['mask']:>20} {r['S']:>6} {r['grid_tflops']:7.1f} {r['persistent_tflops']:7.1f} "
              f"{r['fa3_tflops']:7.1f} {r['persistent_x_grid']:6.3f} {r['persistent_x_fa3']:6.3f} "
              f"{r['persistent_vs_grid_max_diff']:.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
