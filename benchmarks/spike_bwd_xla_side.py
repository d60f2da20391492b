#!/usr/bin/env python3
"""How much of the cuda backward's time is XLA's work around the kernel (one H100/H200).

Per mask and length (bf16, B=1, H=16, D=128): the backend's whole backward (``attention_bwd``:
delta, ``lse2``, the kernel, dq's rows), and XLA's delta (``rowsum(dout * out)``) alone on arrays
of the same shapes, as an einsum (the backend's until ``bwd_passes``) and as a sum over the last
axis; for a band in phases also
the band it folds to, called on the folded arrays directly. Each timed as 10 calls chained in
one jitted program, each call's input taking a scalar of the last call's output. Prints a
table; ``--out`` writes the JSON. (Before ``bwd_passes``, the backward reordered ``dq_acc`` in
XLA: ``spike-bwd-xla-side-before-*.json`` timed that too. These chained standalone timings
overstated XLA's passes about 1.7x against Nsight Compute's in the program: NOTES, session 21.)
"""

from __future__ import annotations

import argparse
import json
import sys

import jax
import jax.numpy as jnp
from cuda_spike_cases import SCALE, D, H  # beside this script

from jax_bindings._cuda import backend as cb
from jax_bindings._cuda import phases, plan
from splat import catalogue, masks
from splat.tools import timing

MASKS = {name: catalogue.named(name)
         for name in ("causal_window", "sliding_window", "dilated_window", "block_local", "causal")}


def ms(fn, *args):
    return timing.chained_ms(fn, *args)


def delta_einsum(carry, fo, fdo):
    """The backend's delta; ``carry`` (the last call's delta) adds a scalar, so no call is dead code."""
    fo = fo + carry[0, 0, 0].astype(fo.dtype)
    return jnp.einsum("bshd,bshd->bhs", fdo.astype(jnp.float32), fo.astype(jnp.float32))


def delta_rowsum(carry, fo, fdo):
    fo = fo + carry[0, 0, 0].astype(fo.dtype)
    x = jnp.sum(fdo.astype(jnp.float32) * fo.astype(jnp.float32), axis=-1)
    return jnp.transpose(x, (0, 2, 1))


def backward_ms(layout, *args) -> float:
    def backward(q, k, v, out, lse, do):
        return cb.attention_bwd(q, k, v, None, out, lse, do, layout, SCALE)

    return ms(backward, *args)


def time_row(name: str, S: int) -> dict:
    layout = MASKS[name].to_acsr(S, S)
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, do = (jax.random.normal(x, (1, S, H, D), jnp.bfloat16) for x in keys)
    out, lse = jax.jit(lambda q, k, v: cb.attention_fwd(q, k, v, None, layout, SCALE))(q, k, v)
    d = plan.band_form(layout, D, "bfloat16", "").phases
    fq, fk, fv, fo, fdo = (phases.fold(x, d) for x in (q, k, v, out, do))
    flse = phases.fold_rows(lse, d)
    carry = jnp.zeros(flse.shape, jnp.float32)
    row = {"mask": name, "S": S, "phases": d, "whole_ms": backward_ms(layout, q, k, v, out, lse, do),
           "delta_einsum_ms": ms(delta_einsum, carry, fo, fdo),
           "delta_rowsum_ms": ms(delta_rowsum, carry, fo, fdo)}
    if d > 1:  # the band the folded call runs, called on the folded arrays directly
        band = plan.band_form(layout, D, "bfloat16", "").band
        folded = masks.sliding_window(band.left, band.right).to_acsr(S // d, S // d)
        row["folded_band_ms"] = backward_ms(folded, fq, fk, fv, fo, flse, fdo)
    row["delta_share"] = row["delta_einsum_ms"] / row["whole_ms"]
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384])
    p.add_argument("--masks", nargs="+", default=list(MASKS))
    p.add_argument("--out")
    a = p.parse_args(argv)
    rows = []
    for name in a.masks:
        for S in a.lengths:
            rows.append(time_row(name, S))
            print(json.dumps(rows[-1]), flush=True)
    keys = ["whole_ms", "folded_band_ms", "delta_einsum_ms", "delta_rowsum_ms", "delta_share"]
    print(f"{'mask':24} {'S':>6} " + " ".join(f"{k.removesuffix('_ms'):>15}" for k in keys))
    for r in rows:
        print(f"{r['mask']:24} {r['S']:>6} " + " ".join(f"{r.get(k, float('nan')):15.3f}" for k in keys))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": jax.devices()[0].device_kind, "rows": rows,
                       "timing": "10 calls chained in one jitted program (splat.tools.timing.chained_ms)"},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
