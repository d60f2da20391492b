"""Spike: where the document-causal forward spends its time (one GPU, one process).

Times the Triton forward on B x S packed documents (causal & segment ids) against
the same kernel without a runtime mask (plain causal), with lengths only, and with
the ids made unsorted (every tile compared), and prints the tile counts a perfect
walk would visit, so the kernel's rate per visited tile can be compared.

    python benchmarks/spike_runtime.py [--seq-len 8192] [--batch 4]
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

import jax_bindings
import splat
from jax_bindings import _runtime
from splat import masks
from splat.tools import timing
from splat.tools.bench_runtime import pack_documents


def _tiles(ids: np.ndarray, bm: int, bn: int) -> tuple[int, int]:
    """(tiles a causal walk visits, tiles a document-causal walk visits) over all batch rows."""
    b, s = ids.shape
    causal = doc = 0
    for r in range(b):
        for m0 in range(0, s, bm):
            rows = ids[r, m0 : m0 + bm]
            hi = m0 + len(rows)
            causal += -(-hi // bn)
            lo = int(np.searchsorted(ids[r], rows.min(), "left"))
            doc += -(-hi // bn) - lo // bn
    return causal, doc


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--out", default=None)
    ap.add_argument("--tiles", nargs="*", default=[], help="forward tile configs bm,bn,warps,stages to try")
    ap.add_argument(
        "--decode", nargs="*", type=int, default=[], help="KV cache lengths to time one decode step at"
    )
    a = ap.parse_args()
    b, s, h, d = a.batch, a.seq_len, a.heads, 128
    rng = np.random.default_rng(0)
    ids = pack_documents(rng, b, s, 256, 4096)
    q, k, v = (jnp.asarray(rng.standard_normal((b, s, h, d)), jnp.bfloat16) for _ in range(3))
    layout = masks.causal().to_acsr(s)
    scale = d**-0.5
    cases = {
        "causal (no runtime)": None,
        "doc ids (sorted)": dict(segment_ids=jnp.asarray(ids)),
        "doc ids (unsorted)": dict(segment_ids=jnp.asarray(-ids)),
        "lengths only": dict(
            query_seq_lengths=jnp.full((b,), s - 100), key_value_seq_lengths=jnp.full((b,), s)
        ),
    }
    rows = []
    for name, kw in cases.items():

        def fwd(q, k, v, kw=kw):
            rt = None if kw is None else _runtime.build(b, s, s, **kw)
            return jax_bindings.attention_with_lse(q, k, v, layout, scale, "triton", runtime=rt)[0]

        ms = timing.chained_ms(fwd, q, k, v)
        rows.append({"case": name, "ms": ms})
        print(f"{name:24s} {ms:.3f} ms", flush=True)
    # forward tile configs on the sorted-ids case (the heuristic / tuned one is the first row above)
    from jax_bindings._triton import spec as _spec

    tiles_for = _spec.tiles_for
    ids_kw = dict(segment_ids=jnp.asarray(ids))
    for cfg in a.tiles:
        bm, bn, w, st = (int(x) for x in cfg.split(","))
        _spec.tiles_for = lambda op, *args, cfg=(bm, bn, w, st): (
            _spec.Tiles.of(cfg) if op == "fwd" else tiles_for(op, *args)
        )
        _spec._plan_cached.cache_clear()
        jax.clear_caches()

        def fwd(q, k, v):
            rt = _runtime.build(b, s, s, **ids_kw)
            return jax_bindings.attention_with_lse(q, k, v, layout, scale, "triton", runtime=rt)[0]

        ms = timing.chained_ms(fwd, q, k, v)
        rows.append({"case": f"doc ids, fwd tiles {cfg}", "ms": ms})
        print(f"doc ids, tiles {cfg:14s} {ms:.3f} ms", flush=True)
    _spec.tiles_for = tiles_for
    # decode: one query per batch row against a KV cache (q_offset: the pure-JAX path on every backend)
    for kv in a.decode:
        kc, vc = (jnp.asarray(rng.standard_normal((b, kv, h // 2, d)), jnp.bfloat16) for _ in range(2))
        q1 = q[:, :1]
        for name, mask in (("causal", masks.causal()), ("window 4096", masks.sliding_window(4095, 0))):

            def step(q1, kc, vc, mask=mask, kv=kv):
                pos = jnp.full((b,), kv - 1)
                return splat.attention(q1, kc, vc, mask, q_offset=pos, key_value_seq_lengths=pos + 1)

            ms = timing.chained_ms(step, q1, kc, vc)
            rows.append({"case": f"decode {name}", "kv_len": kv, "gqa": 2, "ms": ms})
            print(f"decode {name:12s} kv {kv:7d} (GQA 2) {ms:.3f} ms", flush=True)
    for bm, bn in ((128, 128), (128, 64), (64, 64)):
        c, dc = _tiles(ids, bm, bn)
        print(f"tiles {bm}x{bn}: causal {c}, document-causal {dc} ({dc / c:.2f})")
        rows.append({"tiles": [bm, bn], "causal": c, "doc": dc})
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": jax.devices()[0].device_kind, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
