#!/usr/bin/env python3
"""Spike: the cuda backend's generated backward against splat's Triton backward and FlashAttention-3.

One process, one H100/H200, bf16, B=1, H=16, D=128: for each one-band mask and S,
* the backward alone (given ``out`` and ``lse`` of the cuda forward): the cuda kernel with dQ added
  in a fixed order (the default: bit-identical reruns) and in arrival order, and the Triton
  backend's backward; with ``--baseline FILE``, the route ``base``: the ordered cuda kernel as
  another revision's ``bwd_source.py`` writes it (launched with ``dq_acc`` zeroed, as the
  unordered kernel is, unless ``--baseline-ordered`` says that revision stores each query
  block's first part, as every revision from ee68b78 on does);
* forward+backward (one ``jax.vjp``): cuda forward + cuda backward, cuda forward + Triton
  backward, and FA3's ``flash_mha``;
each as 10 calls chained in one jitted program (the gradient fed back as the next call's
cotangent). Gradients of every route are checked against the ordered cuda one.

    python3 -m benchmarks.spikes.spike_cuda_bwd [--lengths 8192 16384] [--bwd-routes base triton]
        [--baseline /tmp/base_bwd_source.py [--baseline-ordered]] [--out PATH]
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

from benchmarks.profile_cases import MASKS, SCALE, D, H, chained_ms
from benchmarks.spikes.baseline import generating_with, load_generator
from jax_bindings._cuda import backend as cb
from jax_bindings._cuda import bwd_source, compiler, plan
from jax_bindings._triton import backend as tb
from splat.tools import peers


def _bwd_cuda(layout, ordered: bool = True, generator=None, section_bytes=None, key_order=None,
              generator_ordered: bool = False):
    variant = dataclasses.replace(plan.bwd_variant(layout, D, "bfloat16"), ordered=ordered)
    if section_bytes is not None:
        variant = dataclasses.replace(variant, section_bytes=section_bytes)
    if key_order is not None:
        variant = dataclasses.replace(variant, key_order=key_order)
    if generator is None:
        name, image = plan.compiled(variant)
    else:
        with generating_with(generator, bwd_source):
            name, text = variant.named_source()
        image = compiler.cubin(text)

    def fn(do, q, k, v, out, lse):
        maps = plan.bwd_tensor_maps(q.shape, k.shape)
        # a baseline kernel may add every part (zeroed dq_acc): launched as the unordered one is,
        # unless it is known to store the first part
        return cb.run_backward(name, image, variant.smem, maps, q, k, v, out, lse, do, SCALE,
                               ordered=variant.ordered and (generator is None or generator_ordered))

    return fn


def _bwd_triton(layout):
    def fn(do, q, k, v, out, lse):
        return tb.attention_bwd(q, k, v, None, out, lse, do, layout, SCALE)

    return fn


def _bwd_route(name: str, layout, generator=None, generator_ordered: bool = False):
    if name == "triton":
        return _bwd_triton(layout)
    if name == "base":
        return _bwd_cuda(layout, generator=generator, generator_ordered=generator_ordered)
    if name.startswith("cuda@"):  # ordered, in sections of as many heads as N MiB of Q and dO hold
        return _bwd_cuda(layout, section_bytes=int(float(name.removeprefix("cuda@")) * 2**20))
    if name in bwd_source.KEY_ORDERS:  # ordered, in that key order
        return _bwd_cuda(layout, key_order=name)
    return _bwd_cuda(layout, ordered=name != "cuda_unordered")


def _cuda_fwd_then(layout, bwd):
    """The cuda forward, differentiable through ``bwd(do, q, k, v, out, lse) -> (dq, dk, dv)``."""

    @jax.custom_vjp
    def attn(q, k, v):
        return cb.attention_fwd(q, k, v, None, layout, SCALE)[0]

    def fwd(q, k, v):
        out, lse = cb.attention_fwd(q, k, v, None, layout, SCALE)
        return out, (q, k, v, out, lse)

    def back(res, do):
        return tuple(bwd(do, *res))

    attn.defvjp(fwd, back)
    return attn


def _fwd_bwd(attn):
    def fn(q, k, v, do):
        out, vjp = jax.vjp(attn, q, k, v)
        return out, vjp(do)

    return fn


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384])
    p.add_argument("--masks", nargs="+", default=list(MASKS))
    p.add_argument("--bwd-routes", nargs="+", default=["cuda_unordered", "triton"],
                   help="backward routes timed besides the default cuda one: cuda_unordered (dQ in "
                        "arrival order), cuda@N (ordered, items in sections of the heads whose Q and "
                        "dO fit N MiB), a key order of bwd_source.KEY_ORDERS (ordered, in it), triton, "
                        "base (--baseline's kernel)")
    p.add_argument("--baseline", default=None, help="another revision's jax_bindings/_cuda/bwd_source.py")
    p.add_argument("--baseline-ordered", action="store_true",
                   help="the baseline stores each query block's first part of dQ (revisions from ee68b78 "
                        "on): launch it ordered, dq_acc not zeroed, as the current kernel")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    try:
        from flash_attn3_jax import flash_mha as fa3
    except ImportError:
        fa3 = None

    generator = load_generator(a.baseline) if a.baseline else None
    dev = jax.devices()[0].device_kind
    rows = []
    for S in a.lengths:
        key = jax.random.split(jax.random.key(S), 4)
        q, k, v, do = (jax.random.normal(x, (1, S, H, D), jnp.bfloat16) for x in key)
        for mname in a.masks:
            layout = MASKS[mname].to_acsr(S, S)
            fwd_flops = 4 * H * layout.nnz * D
            out, lse = jax.jit(lambda q, k, v, layout=layout: cb.attention_fwd(q, k, v, None, layout, SCALE))(
                q, k, v)
            row = {"mask": mname, "S": S}
            bwds = {n: _bwd_route(n, layout, generator, a.baseline_ordered) for n in ("cuda", *a.bwd_routes)}
            # every route's gradients stay on the device until all have run: a route whose kernel
            # left an output unwritten would otherwise get the buffer of one the route before
            # filled, freed once copied out, and match it (session 24's probe did)
            on_device = {n: jax.jit(f)(do, q, k, v, out, lse) for n, f in bwds.items()}
            grads = {n: [np.asarray(g, np.float32) for g in gs] for n, gs in on_device.items()}
            del on_device
            for n, g in grads.items():
                pairs = zip(g, grads["cuda"], strict=True)
                # np.max, not max(): a NaN in any gradient is the row's difference
                row[f"{n}_bwd_max_diff"] = float(np.max([np.abs(x - y).max() for x, y in pairs]))
            for n, f in bwds.items():
                ms = chained_ms(f, (do, q, k, v, out, lse), {0: 0})
                row[f"{n}_bwd_ms"], row[f"{n}_bwd_tflops"] = ms, 2.5 * fwd_flops / ms * 1e-9
            fb = {
                "cuda": _fwd_bwd(_cuda_fwd_then(layout, bwds["cuda"])),
            }
            if "triton" in bwds:
                fb["cuda_fwd_triton_bwd"] = _fwd_bwd(_cuda_fwd_then(layout, bwds["triton"]))
            kw = peers.flash_attn3_arguments(layout)
            if fa3 is not None and kw is not None:
                fb["fa3"] = _fwd_bwd(lambda q, k, v, kw=kw: fa3(q, k, v, softmax_scale=SCALE, **kw))
            for n, f in fb.items():
                ms = chained_ms(f, (q, k, v, do), {0: 0, 3: 1})
                row[f"{n}_fwdbwd_ms"], row[f"{n}_fwdbwd_tflops"] = ms, 3.5 * fwd_flops / ms * 1e-9
            if "fa3_fwdbwd_ms" in row:
                row["cuda_fwdbwd_x_fa3"] = row["fa3_fwdbwd_ms"] / row["cuda_fwdbwd_ms"]
            if "triton" in bwds:
                row["cuda_bwd_x_triton"] = row["triton_bwd_ms"] / row["cuda_bwd_ms"]
            if "cuda_unordered" in bwds:
                row["ordered_cost"] = row["cuda_bwd_ms"] / row["cuda_unordered_bwd_ms"]
            rows.append(row)
            shown = {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}
            print(json.dumps(shown), flush=True)
    doc = {"schema": "splat-spike-cuda-bwd/1", "device": dev,
           "date": datetime.datetime.now().isoformat(timespec="seconds"),
           "settings": {"B": 1, "H": H, "D": D, "dtype": "bfloat16", "chained_calls": 10,
                        "flops": "useful: forward 4*H*nnz*D; backward 2.5x, forward+backward 3.5x that"},
           "rows": rows}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=1)
    nan = float("nan")
    cols = [f"{n}_bwd_tflops" for n in bwds] + [f"{n}_fwdbwd_tflops" for n in fb] + ["cuda_fwdbwd_x_fa3"]
    print(f"{'mask':>20} {'S':>6} " + " ".join(f"{c.replace('_tflops', ''):>14}" for c in cols))
    for r in rows:
        print(f"{r['mask']:>20} {r['S']:>6} " + " ".join(f"{r.get(c, nan):14.3f}" for c in cols))
    return 0


if __name__ == "__main__":
    sys.exit(main())
