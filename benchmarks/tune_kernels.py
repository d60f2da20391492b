#!/usr/bin/env python3
# ruff: noqa: B023  (closures are timed inside the loop iteration that builds them)
"""Kernel-structure experiments on the GPU machine: variants of the generated source, timed alone.

Each variant is the generator's source for a spec plus named text patches
(``PATCHES``) and a tile config; the patched module is imported from a temp
folder and launched through torch (the same launch the JAX binding makes,
without jaxlib's ~6% launch overhead, see NOTES.md). Every variant's output is
compared with the unpatched default kernel's (relative L2 error), so a patch
that breaks the numerics shows up next to its time.

Useful TFLOP/s = 4·B·H·nnz·D / t (forward); dq counts 1.5x, dk/dv 2x that work.
Also times dense torch SDPA (flash backend, and cuDNN where torch has it) on
the same shapes, no mask, as the per-tile ceiling.

    python3 benchmarks/tune_kernels.py [--seq-len 16384] [--out $OUT/tune.json] [--quick]

Patches that win move into ``jax_bindings/_triton/render.py``; this file keeps the
experiment reproducible.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import re
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

B, H, D = 1, 16, 128


# -- source patches -------------------------------------------------------------


def _sub_once(src: str, old: str, new: str) -> str:
    if src.count(old) < 1:
        raise ValueError(f"patch target not found: {old.strip()[:80]}")
    return src.replace(old, new, 1)


def _func(src: str, name: str) -> tuple[int, int]:
    """[start, end) of ``def name`` (through the line before the next decorator/def)."""
    a = src.index(f"def {name}(")
    nxt = re.compile(r"^(@triton\.jit|def |[A-Z_]+ = )", re.M)
    m = nxt.search(src, a + 1)
    return a, (m.start() if m else len(src))


def _in_func(src: str, name: str, old: str, new: str) -> str:
    a, b = _func(src, name)
    return src[:a] + _sub_once(src[a:b], old, new) + src[b:]


def _re_in_func(src: str, name: str, pattern: str, repl: str) -> str:
    a, b = _func(src, name)
    body, n = re.subn(pattern, repl, src[a:b], count=1)
    if not n:
        raise ValueError(f"patch target not found in {name}: {pattern}")
    return src[:a] + body + src[b:]


def p_dotacc(src: str) -> str:
    """Accumulate P·V into the rescaled accumulator inside the dot (``tl.dot(p, v, acc)``)."""
    return _re_in_func(
        src,
        "_fwd_tile",
        r"acc = acc \* alpha\[:, None\] \+ tl\.dot\(p\.to\(v\.dtype\), v, (input_precision=\"\w+\")\)",
        r"acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], \1)",
    )


def p_vlate(src: str) -> str:
    """Load V after the softmax step (the tutorial's order), not next to K."""
    line = "    v = _load_rows(Vb, cols, cols < KV_LEN, KV_ROW, MASK == 0)\n"
    src = _in_func(src, "_fwd_tile", line, "")
    return _in_func(
        src,
        "_fwd_tile",
        "    alpha = tl.math.exp2(m_i - m_use)\n",
        "    alpha = tl.math.exp2(m_i - m_use)\n" + line,
    )


def p_dq_dotacc(src: str) -> str:
    return _re_in_func(
        src,
        "_dq_tile",
        r"dq \+= tl\.dot\(ds\.to\(k\.dtype\), k, (input_precision=\"\w+\")\)",
        r"dq = tl.dot(ds.to(k.dtype), k, dq, \1)",
    )


def p_dkdv_dotacc(src: str) -> str:
    src = _re_in_func(
        src,
        "_dkdv_tile",
        r"dv \+= tl\.dot\(pt\.to\(do\.dtype\), do, (input_precision=\"\w+\")\)",
        r"dv = tl.dot(pt.to(do.dtype), do, dv, \1)",
    )
    return _re_in_func(
        src,
        "_dkdv_tile",
        r"dk \+= tl\.dot\(dst\.to\(q\.dtype\), q, (input_precision=\"\w+\")\)",
        r"dk = tl.dot(dst.to(q.dtype), q, dk, \1)",
    )


PATCHES = {
    "dotacc": p_dotacc,
    "vlate": p_vlate,
    "dq_dotacc": p_dq_dotacc,
    "dkdv_dotacc": p_dkdv_dotacc,
}

# (name, patches, tiles); tiles = (block_m, block_n, warps, stages, loop),
# see jax_bindings._triton.spec.Tiles.
# The first session's table (NOTES.md) also tried a warp-specialised full-tile loop
# (`tl.range(..., warp_specialize=True)`: no gain, fails to compile at 64x64) and the
# patches above (dotacc, vlate: within 1%); the run-time edge test ("rt") became loop="fused".
FWD_VARIANTS = [
    ("fused", (), (64, 64, 4, 3, "fused")),
    ("split", (), (64, 64, 4, 3, "split")),
    ("single", (), (64, 64, 4, 3, "single")),
    ("fused", (), (64, 32, 4, 3, "fused")),
    ("fused", (), (128, 64, 8, 3, "fused")),
    ("fused", (), (128, 128, 8, 3, "fused")),
    ("split", (), (128, 128, 8, 3, "split")),
    ("fused", (), (64, 64, 4, 2, "fused")),
    ("fused+dotacc", ("dotacc",), (64, 64, 4, 3, "fused")),
]
QUICK_FWD = [v for v in FWD_VARIANTS if v[2][:2] == (64, 64)]
DQ_VARIANTS = [
    ("fused", (), None),
    ("split", (), (64, 32, 4, 3, "split")),
    ("fused", (), (64, 64, 4, 3, "fused")),
    ("fused", (), (128, 64, 8, 3, "fused")),
]
DKDV_VARIANTS = [
    ("fused", (), None),
    ("split", (), (64, 64, 4, 2, "split")),
    ("fused", (), (64, 64, 4, 3, "fused")),
    ("fused", (), (64, 32, 4, 3, "fused")),
]

# unfused ops: (block_m, block_n, warps, stages)
SDDMM_TILES = [(64, 64, 4, 2), (64, 128, 4, 2), (128, 64, 8, 2), (64, 64, 4, 3), (32, 128, 4, 3)]
SOFTMAX_TILES = [
    (64, 64, 4, 1),
    (32, 128, 4, 2),
    (16, 256, 4, 2),
    (64, 128, 8, 2),
    (16, 512, 8, 2),
    (32, 256, 8, 3),
]
SPMM_TILES = [(64, 64, 4, 2), (64, 128, 4, 2), (128, 64, 8, 2), (64, 32, 4, 3), (64, 64, 4, 3)]
UNFUSED_PATTERNS = ("sliding_window", "dilated_window")

FWD_PATTERNS = ("sliding_window", "causal_window", "dilated_window", "block_local", "causal", "full")
BWD_PATTERNS = ("sliding_window", "dilated_window", "causal_window", "causal")


def patterns():
    """The catalogue's masks by name (``splat.catalogue.named``: the suite and the baselines)."""
    from splat import catalogue

    return {name: catalogue.named(name) for name in {*UNFUSED_PATTERNS, *FWD_PATTERNS, *BWD_PATTERNS}}


_TMP = tempfile.mkdtemp(prefix="splat-tune-")


def load_patched(spec, patches: tuple[str, ...]):
    """The kernel of ``spec``'s generated source with ``patches`` applied (imported from a temp file)."""
    from jax_bindings._triton.render import render

    src = render(spec)
    for p in patches:
        src = PATCHES[p](src)
    tag = f"{spec.op}_{abs(hash((spec, patches))):x}"
    path = os.path.join(_TMP, f"{tag}.py")
    with open(path, "w") as f:
        f.write(src)
    ispec = importlib.util.spec_from_file_location(f"_tune_{tag}", path)
    mod = importlib.util.module_from_spec(ispec)
    sys.modules[ispec.name] = mod
    ispec.loader.exec_module(mod)
    return mod.kernel


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-len", type=int, default=16384)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "tune.json"))
    ap.add_argument("--quick", action="store_true", help="64x64 variants only")
    ap.add_argument("--no-bwd", action="store_true")
    ap.add_argument("--only", choices=["all", "fused", "unfused"], default="all")
    a = ap.parse_args(argv)

    import torch
    import triton

    from jax_bindings._triton import ops as cg
    from jax_bindings._triton.launch import run_torch
    from splat.tools.bench import environment

    S = a.seq_len
    bt = lambda f: triton.testing.do_bench(f, warmup=25, rep=100, return_mode="median")
    g = torch.Generator(device="cuda").manual_seed(1)
    mk = lambda: torch.randn((B, S, H, D), device="cuda", dtype=torch.bfloat16, generator=g)
    q, k, v, do = mk(), mk(), mk(), mk()
    scale = D**-0.5
    rel = lambda x, y: float((x.float() - y.float()).norm() / y.float().norm())
    out = {
        "device": torch.cuda.get_device_name(),
        "environment": environment(),
        "S": S,
        "shape": [B, S, H, D],
        "dtype": "bfloat16",
        "flop_formula": "fwd 4*B*H*nnz*D; dq 1.5x, dkdv 2x that",
        "rows": [],
    }

    def save():
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)

    def record(**r):
        out["rows"].append(r)
        print("TUNE", json.dumps(r), flush=True)

    # dense ceilings (no mask)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    for causal in (False, True):
        for be in ("FLASH_ATTENTION", "CUDNN_ATTENTION"):
            try:
                with sdpa_kernel([getattr(SDPBackend, be)]):
                    f = lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
                    f()
                    ms = bt(f)
                nnz = S * (S + 1) // 2 if causal else S * S
                record(
                    kind="sdpa",
                    pattern="causal" if causal else "full",
                    impl=be,
                    ms=ms,
                    tflops=4 * B * H * nnz * D / ms * 1e-9,
                )
            except Exception as e:
                record(
                    kind="sdpa",
                    pattern="causal" if causal else "full",
                    impl=be,
                    error=f"{type(e).__name__}: {e}"[:200],
                )

    pats = patterns()
    variants = QUICK_FWD if a.quick else FWD_VARIANTS
    if a.only == "unfused":
        variants = []
    for name in UNFUSED_PATTERNS if a.only != "fused" else ():
        layout = pats[name].to_acsr(S, S)
        flops = 2 * B * H * layout.nnz * D
        vals = probs = None
        for op, grid in (("sddmm", SDDMM_TILES), ("softmax", SOFTMAX_TILES), ("spmm", SPMM_TILES)):
            ref = None
            for tiles in grid:
                try:
                    if op == "sddmm":
                        c = cg.sddmm_call(layout, q.shape, k.shape, "bfloat16", tiles=tiles)
                        args = (q, k)
                    elif op == "softmax":
                        c = cg.softmax_call(layout, vals.shape, "bfloat16", scale, tiles=tiles)
                        args = (vals,)
                    else:
                        c = cg.spmm_call(layout, probs.shape, v.shape, "bfloat16", tiles=tiles)
                        args = (probs, v)
                    (o,) = run_torch(c, *args)
                    if ref is None:
                        ref = o
                        if op == "sddmm":
                            vals = o
                        elif op == "softmax":
                            probs = o
                    ms = bt(lambda: run_torch(c, *args))
                    nbytes = sum(x.numel() * x.element_size() for x in (*args, o))
                    record(
                        kind=op,
                        pattern=name,
                        tiles=list(tiles),
                        ms=ms,
                        tflops=0 if op == "softmax" else flops / ms * 1e-9,
                        gbps_naive=nbytes / ms * 1e-6,
                        err_vs_first=rel(o, ref),
                    )
                except Exception as e:
                    record(kind=op, pattern=name, tiles=list(tiles), error=f"{type(e).__name__}: {e}"[:400])
        save()
    for name in FWD_PATTERNS if variants else ():
        layout = pats[name].to_acsr(S, S)
        flops = 4 * B * H * layout.nnz * D
        ref = None
        for vname, patches, tiles in variants:
            if name in ("causal", "full") and tiles[0] == 64 and tiles[4] != "fused":
                continue
            try:
                t0 = time.perf_counter()
                c = cg.fwd_call(layout, q.shape, k.shape, "bfloat16", scale, tiles=tiles)
                if patches:
                    c = dataclasses.replace(c, kernel=load_patched(c.plan.spec, patches))
                o, _ = run_torch(c, q, k, v)
                torch.cuda.synchronize()
                compile_s = time.perf_counter() - t0
                if ref is None:
                    ref = o
                ms = bt(lambda: run_torch(c, q, k, v))
                record(
                    kind="fwd",
                    pattern=name,
                    variant=vname,
                    tiles=list(tiles),
                    ms=ms,
                    tflops=flops / ms * 1e-9,
                    err_vs_first=rel(o, ref),
                    first_call_s=compile_s,
                )
            except Exception as e:
                record(
                    kind="fwd",
                    pattern=name,
                    variant=vname,
                    tiles=list(tiles),
                    error=f"{type(e).__name__}: {e}"[:400],
                )
                traceback.print_exc()
        save()

    if not a.no_bwd and a.only != "unfused":
        for name in BWD_PATTERNS:
            layout = pats[name].to_acsr(S, S)
            flops = 4 * B * H * layout.nnz * D
            c = cg.fwd_call(layout, q.shape, k.shape, "bfloat16", scale)
            o, lse = run_torch(c, q, k, v)
            cq0, ck0 = cg.bwd_calls(layout, q.shape, k.shape, "bfloat16", scale)
            dq0, delta = run_torch(cq0, q, k, v, do, o, lse)
            dk0, _ = run_torch(ck0, q, k, v, do, lse, delta)
            for vname, patches, tiles in DQ_VARIANTS:
                try:
                    cq, _ = cg.bwd_calls(layout, q.shape, k.shape, "bfloat16", scale, tiles=(tiles, None))
                    if patches:
                        cq = dataclasses.replace(cq, kernel=load_patched(cq.plan.spec, patches))
                    dq, _ = run_torch(cq, q, k, v, do, o, lse)
                    ms = bt(lambda: run_torch(cq, q, k, v, do, o, lse))
                    record(
                        kind="dq",
                        pattern=name,
                        variant=vname,
                        tiles=tiles and list(tiles),
                        ms=ms,
                        tflops=1.5 * flops / ms * 1e-9,
                        err_vs_first=rel(dq, dq0),
                    )
                except Exception as e:
                    record(kind="dq", pattern=name, variant=vname, error=f"{type(e).__name__}: {e}"[:400])
            for vname, patches, tiles in DKDV_VARIANTS:
                try:
                    _, ck = cg.bwd_calls(layout, q.shape, k.shape, "bfloat16", scale, tiles=(None, tiles))
                    if patches:
                        ck = dataclasses.replace(ck, kernel=load_patched(ck.plan.spec, patches))
                    dk, _ = run_torch(ck, q, k, v, do, lse, delta)
                    ms = bt(lambda: run_torch(ck, q, k, v, do, lse, delta))
                    record(
                        kind="dkdv",
                        pattern=name,
                        variant=vname,
                        tiles=tiles and list(tiles),
                        ms=ms,
                        tflops=2.0 * flops / ms * 1e-9,
                        err_vs_first=rel(dk, dk0),
                    )
                except Exception as e:
                    record(kind="dkdv", pattern=name, variant=vname, error=f"{type(e).__name__}: {e}"[:400])
            save()
    save()
    # short table: best forward variant per pattern
    print("\nbest forward per pattern (useful TF/s):")
    for name in FWD_PATTERNS:
        rows = [r for r in out["rows"] if r.get("kind") == "fwd" and r["pattern"] == name and "ms" in r]
        base = next((r for r in rows if r["variant"] == "split" and r["tiles"][:2] == [64, 64]), None)
        best = max(rows, key=lambda r: r["tflops"], default=None)
        if best and base:
            print(
                f"  {name:20s} split 64x64 {base['tflops']:6.1f}  best {best['tflops']:6.1f} "
                f"({best['variant']} {best['tiles']}, err {best['err_vs_first']:.1e})"
            )
    return out


if __name__ == "__main__":
    main()
