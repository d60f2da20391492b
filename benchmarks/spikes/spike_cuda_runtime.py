#!/usr/bin/env python3
"""Spike: the cuda kernels on packed documents (segment ids), part by part.

One process, one H100/H200, bf16, B=4, S=8192, H=16, D=128, documents of 256-4096 tokens
(``splat bench-runtime``'s doc_causal packing, one packing): the runtime arrays alone
(``runtime_tables``), the forward, the backward alone (dQ in a fixed order and in arrival order),
and the same kernels on plain causal (no runtime mask) for the rate they lose to short walks;
each as 10 calls chained in one jitted program. Useful FLOPs count only the unmasked entries.
Two experiments locate the cost: one document per row (the ids path on causal walks), and the
documents with the kernels' per-element id test cut out of their source (``no_id_test``: wrong
outputs, timing only).

    python3 -m benchmarks.spikes.spike_cuda_runtime [--out PATH]
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

from benchmarks.profile_cases import SCALE, D, H, chained_ms
from jax_bindings import _runtime
from jax_bindings._cuda import backend as cb
from jax_bindings._cuda import bwd_source, compiler, plan, runtime_tables, source
from splat import masks
from splat.tools.bench_runtime import doc_causal_nnz, pack_documents

# the per-element id test of each kernel, and what the no_id_test experiment makes of it
_ID_TESTS = {plan.FwdVariant: ("if (RT == IDS) ok &=", "if (RT == IDS) ok &= true ||"),
             plan.BwdVariant: ("if (RT == IDS) ok &=", "if (RT == IDS) ok &= true ||")}


def _compiled(variant, cut_id_test: bool):
    if not cut_id_test:
        return plan.compiled(variant)
    name, text = variant.named_source()
    test, cut = _ID_TESTS[type(variant)]
    assert text.count(test) == 1, test
    text = text.replace(test, cut)
    kernel = source.KERNEL_NAME if isinstance(variant, plan.FwdVariant) else bwd_source.KERNEL_NAME
    name, text = source.with_unique_name(text.replace(name, kernel), kernel, "spike")
    return name, compiler.cubin(text)


def _fwd(layout, kind: str, cut_id_test: bool = False):
    variant = plan.fwd_variant(layout, D, "bfloat16", kind)
    name, image = _compiled(variant, cut_id_test)

    def fn(q, k, v, runtime):
        grid = plan.grid(q.shape, variant.schedule, cb._sm_count())
        maps = plan.tensor_maps(variant.block_n, q.shape, k.shape, v.shape)
        rt = runtime_tables.fwd_arrays(runtime, variant.block_n) if kind else ()
        return cb.run_forward(name, image, grid, variant.smem, maps, q, k, v, SCALE, rt)

    return jax.jit(fn)


def _bwd(layout, kind: str, ordered: bool, cut_id_test: bool = False):
    variant = dataclasses.replace(plan.bwd_variant(layout, D, "bfloat16", kind), ordered=ordered)
    name, image = _compiled(variant, cut_id_test)

    def fn(do, q, k, v, out, lse, runtime):
        maps = plan.bwd_tensor_maps(q.shape, k.shape)
        rt = runtime_tables.bwd_arrays(runtime, bwd_source.BN) if kind else ()
        return cb.run_backward(name, image, variant.smem, maps, q, k, v, out, lse, do, SCALE, rt,
                               ordered=variant.ordered)

    return fn


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    B, S = a.batch, a.seq_len
    ids = pack_documents(np.random.default_rng(0), B, S, 256, 4096)
    layout = masks.causal().to_acsr(S, S)
    key = jax.random.split(jax.random.key(0), 4)
    q, k, v, do = (jax.random.normal(x, (B, S, H, D), jnp.bfloat16) for x in key)
    runtime = _runtime.build(B, S, S, segment_ids=jnp.asarray(ids))
    flops = {"documents": 4 * H * D * doc_causal_nnz(ids), "causal": 4 * B * H * D * layout.nnz}
    row = {"B": B, "S": S, "documents": int(ids.max(1).sum() + B)}
    def tables(ids):  # the ids back, depending on every array (so that the chained calls run)
        rt = _runtime.build(B, S, S, segment_ids=ids)
        arrays = (*runtime_tables.fwd_arrays(rt, source.BN), *runtime_tables.bwd_arrays(rt, bwd_source.BN))
        total = sum(x.sum() for x in arrays)
        return jnp.minimum(ids, ids + (total >= -1))

    row["tables_ms"] = chained_ms(tables, (jnp.asarray(ids),), {0: 0})
    one = _runtime.build(B, S, S, segment_ids=jnp.zeros((B, S), jnp.int32))
    flops["one_document"], flops["no_id_test"] = flops["causal"], flops["documents"]
    runs = (("documents", runtime, False, True), ("causal", None, False, True),
            ("one_document", one, False, False), ("no_id_test", runtime, True, False))
    for name, rt, cut, unordered in runs:
        kind = runtime_tables.kind(rt)
        fwd = _fwd(layout, kind, cut)
        out, lse = fwd(q, k, v, rt)
        ms = chained_ms(fwd, (q, k, v, rt), {0: 0})
        row[f"{name}_fwd_ms"], row[f"{name}_fwd_tflops"] = ms, flops[name] / ms * 1e-9
        for ordered in (True, False) if unordered else (True,):
            tag = f"{name}_bwd" + ("" if ordered else "_unordered")
            ms = chained_ms(_bwd(layout, kind, ordered, cut), (do, q, k, v, out, lse, rt), {0: 0})
            row[f"{tag}_ms"], row[f"{tag}_tflops"] = ms, 2.5 * flops[name] / ms * 1e-9
    shown = {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}
    print(json.dumps(shown, indent=1), flush=True)
    doc = {"schema": "splat-spike-cuda-runtime/1", "device": jax.devices()[0].device_kind,
           "date": datetime.datetime.now().isoformat(timespec="seconds"),
           "settings": {"H": H, "D": D, "dtype": "bfloat16", "chained_calls": 10,
                        "documents": "256-4096 tokens",
                        "flops": "useful: forward 4*H*D*(unmasked entries); backward 2.5x that"},
           "rows": [row]}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
