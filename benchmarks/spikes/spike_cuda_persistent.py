#!/usr/bin/env python3
"""Spike: the cuda backend's forward in its CTA schedules, beside FlashAttention-3.

One process, one H100/H200, bf16, B=1, H=16, D=128: for each one-band mask and S, the backend's
forward (the plan's variant, ``jax_bindings._cuda.plan.fwd_variant``, launched by
``jax_bindings._cuda.backend.run_forward``) built with each schedule of
``jax_bindings._cuda.source.source``: ``grid`` (a CTA per row block, Q by cp.async), ``strided``
(a CTA per SM taking every ``gridDim.x``-th work tile) and ``queue`` (a CTA per SM taking work
tiles by ticket; ``queue@N`` takes them in sections of as many heads as N MiB of K/V hold,
longest walks first across a section's heads; ``plan`` is the planner's own choice) and with
``/q1`` or ``/q2`` after it, one or two Q tiles (``q_stages``; a spec whose shared memory does not
fit is skipped), ``/tma`` or ``/registers``, how the epilogue writes ``out`` (``o_store``), or
``base:`` before any of those: that variant as another revision's generator
writes it (``--baseline``); and FA3's ``flash_mha`` where ``flash_attn3_jax``
imports; each as 10 calls chained in one jitted program. Every schedule's ``out`` and ``lse``
must be bit-identical to the first one's. By default: ``plan``, ``strided``, ``queue`` (``grid``
only while the generator still offers it).

    python3 -m benchmarks.spikes.spike_cuda_persistent [--lengths 8192 16384] [--masks causal]
        [--schedules plan strided queue queue@32 plan/q1 plan/q2 base:plan] [--repeat 3]
        [--baseline /tmp/base_source.py] [--out PATH]
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.profile_cases import MASKS, SCALE, D, H
from benchmarks.spikes.baseline import generating_with, load_generator
from jax_bindings._cuda import backend, compiler, plan, source
from splat.tools import peers, timing

SCHEDULES = ("plan", "strided", "queue")


def variant_of(layout, spec: str):
    """The backend's forward variant on ``layout`` for ``spec`` (see the module's docstring)."""
    spec, *options = spec.removeprefix("base:").split("/")
    variant = plan.fwd_variant(layout, D, "bfloat16")
    schedule, section_bytes = variant.schedule, variant.section_bytes
    if spec != "plan":
        schedule, _, mib = spec.partition("@")
        section_bytes = int(float(mib or 0) * 2**20)
    o_store = next((x for x in options if x in source.O_STORES), None)
    q_stages = next((int(x.removeprefix("q")) for x in options if x not in source.O_STORES), None)
    return plan.rescheduled(variant, schedule, section_bytes, q_stages, o_store)


def forward(variant, generator=None):
    """``(q, k, v) -> (out, lse)``: the backend's forward as ``variant`` (written by ``generator``,
    another revision's source module, if given)."""
    if generator is None:
        name, image = plan.compiled(variant)
    else:
        with generating_with(generator):
            name, text = variant.named_source()
        image = compiler.cubin(text)
    schedule = variant.schedule

    def fn(q, k, v):
        grid = plan.grid(q.shape, schedule, backend._sm_count())
        maps = plan.tensor_maps(variant.block_n, q.shape, k.shape, v.shape)
        return backend.run_forward(name, image, grid, variant.smem, maps, q, k, v, SCALE)

    return fn


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384])
    p.add_argument("--masks", nargs="+", default=list(MASKS), choices=list(MASKS))
    p.add_argument("--schedules", nargs="+", default=list(SCHEDULES),
                   help="schedule names, or queue@N (sections of N MiB of K/V); the first is the baseline")
    p.add_argument("--baseline", default=None, help="another revision's jax_bindings/_cuda/source.py (base:)")
    p.add_argument("--repeat", type=int, default=1, help="times each callable this often in turn; the median")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    specs, base = a.schedules, a.schedules[0]
    generator = load_generator(a.baseline) if a.baseline else None
    try:
        from flash_attn3_jax import flash_mha as fa3
    except ImportError:
        fa3 = None

    rows = []
    for S in a.lengths:
        key = jax.random.split(jax.random.key(S), 3)
        q, k, v = (jax.random.normal(x, (1, S, H, D), jnp.bfloat16) for x in key)
        for mname in a.masks:
            layout = MASKS[mname].to_acsr(S, S)
            flops = 4 * H * layout.nnz * D
            row = {"mask": mname, "S": S}
            fns = {}
            got = {}
            for s in specs:
                variant = variant_of(layout, s)
                if variant.smem > source.SMEM_LIMIT:
                    continue
                f = forward(variant, generator if s.startswith("base:") else None)
                got[s] = [np.asarray(x) for x in jax.jit(f)(q, k, v)]
                fns[s] = lambda q, k, v, f=f: f(q, k, v)[0]
            row["schedules_bit_identical"] = all(
                x.tobytes() == y.tobytes()
                for s in specs[1:] if s in got for x, y in zip(got[s], got[base], strict=True))
            if fa3 is not None:
                kw = peers.flash_attn3_arguments(layout)
                fns["fa3"] = lambda q, k, v, kw=kw: fa3(q, k, v, softmax_scale=SCALE, **kw)
                ref = np.asarray(jax.jit(fns["fa3"])(q, k, v), np.float32)
                row[f"fa3_vs_{base}_max_diff"] = float(np.abs(ref - got[base][0].astype(np.float32)).max())
            times = {n: [] for n in fns}
            for _ in range(a.repeat):  # in turn, so that drift over seconds reaches every callable
                for n, f in fns.items():
                    times[n].append(timing.chained_ms(f, q, k, v))
            for n, ms_all in times.items():
                ms = float(np.median(ms_all))
                row[f"{n}_ms"], row[f"{n}_tflops"], row[f"{n}_ms_all"] = ms, flops / ms * 1e-9, ms_all
            for s in specs[1:]:
                if s not in got:
                    continue
                row[f"{s}_x_{base}"] = row[f"{base}_ms"] / row[f"{s}_ms"]
            if fa3 is not None:
                for s in got:
                    row[f"{s}_x_fa3"] = row["fa3_ms"] / row[f"{s}_ms"]
            rows.append(row)
            shown = {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items() if "_all" not in k}
            print(json.dumps(shown), flush=True)
    doc = {"schema": "splat-spike-cuda-persistent/3", "device": jax.devices()[0].device_kind,
           "date": datetime.datetime.now().isoformat(timespec="seconds"),
           "settings": {"B": 1, "H": H, "D": D, "dtype": "bfloat16", "chained_calls": 10,
                        "sm_count": backend._sm_count(), "fa3": fa3 is not None,
                        "schedules": specs, "flops": "useful: 4*H*nnz*D"},
           "rows": rows}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=1)
    nan = float("nan")
    print(f"{'mask':>20} {'S':>6} " + " ".join(f"{s:>10}" for s in [*specs, "fa3"])
          + " " + " ".join(f"{s + '/fa3':>14}" for s in specs) + " same")
    for r in rows:
        print(f"{r['mask']:>20} {r['S']:>6} "
              + " ".join(f"{r.get(s + '_tflops', nan):10.1f}" for s in [*specs, "fa3"]) + " "
              + " ".join(f"{r.get(s + '_x_fa3', nan):14.3f}" for s in specs)
              + f" {r['schedules_bit_identical']}")
    return 0 if all(r["schedules_bit_identical"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
