"""Every generated Triton kernel variant, launched once on the GPU for compute-sanitizer.

Uses the interpreter suite's cases (tests/test_triton_kernels.py: windows, dilated,
strided, block-local, unions, residual, masked rows, per-row-array and modular walks)
at head dim 64 in float16, through the torch launcher, so no XLA kernels run under
the sanitizer. Checks the fused output against the unfused SDDMM -> softmax -> SpMM
path and every result for finiteness. Then every tile config the shipped tuning
stores (``jax_bindings/tuning/*.json``) can choose, per op, on a window, a dilated
and a residual (random) layout of 300 rows (not a multiple of any tile), bf16, head dim 128.
Then the decode kernel (``jax_bindings._triton.decode``) on every ``tests/decode_cases`` case it
takes, bf16, against the float64 reference (page pools with NaN in the pages nobody maps).

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 9 \
        python3 benchmarks/sanitize_kernels.py [decode]

(``decode``: the decode kernel's cases alone.)
"""

from __future__ import annotations

import glob
import json
import os

import numpy as np
import torch

from jax_bindings._triton import ops as cg
from jax_bindings._triton.launch import run_torch
from tests.test_triton_kernels import CASES, _inputs, _layout


def _fused(label: str, cf, cq, ck, q, k, v, do, rq=(), rk=()):
    """Launches the fused forward ``cf`` and backward (``cq``: dq, ``ck``: dk/dv; ``rq`` / ``rk``:
    their runtime-mask operands), waits, checks every output is finite; returns ``out``."""
    out, lse = run_torch(cf, q, k, v, *rq)
    dq, delta = run_torch(cq, q, k, v, do, out, lse, *rq)
    dk, dv = run_torch(ck, q, k, v, do, lse, delta, *rk)
    torch.cuda.synchronize()
    for what, t in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert torch.isfinite(t.float()).all(), f"{label}: non-finite {what}"
    return out


def main() -> None:
    launched = 0
    for name in CASES:
        layout = _layout(name)
        arrays = _inputs(layout, seed=1, H=2, Hkv=1, D=64, dtype=np.float16)
        q, k, v, do = (torch.from_numpy(a).cuda() for a in arrays)
        scale = 64**-0.5
        cf = cg.fwd_call(layout, q.shape, k.shape, "float16", scale)
        out = _fused(name, cf, *cg.bwd_calls(layout, q.shape, k.shape, "float16", scale), q, k, v, do)
        (s,) = run_torch(cg.sddmm_call(layout, q.shape, k.shape, "float16"), q, k)
        (p,) = run_torch(cg.softmax_call(layout, s.shape, "float16", scale), s)
        (o,) = run_torch(cg.spmm_call(layout, p.shape, v.shape, "float16"), p, v)
        torch.cuda.synchronize()
        launched += 7
        assert torch.isfinite(o.float()).all(), f"{name}: non-finite spmm"
        err = ((o.float() - out.float()).abs().max() / out.float().abs().max().clamp(min=1)).item()
        assert err < 2e-2, f"{name}: fused and unfused outputs differ by {err:.3g}"
        print(f"{name:18s} 7 kernels ok (fused vs unfused {err:.1e})")
    print(f"{launched} launches over {len(CASES)} layouts")
    print(f"{tuned_configs()} launches of the tuned tile configs")
    print(f"{wide_heads()} launches at head dim 256 (their default tiles)")
    print(f"{runtime_masks()} launches with runtime masks and a soft cap")
    print(f"{grid_layouts()} launches of the grid (N-D neighborhood) kernels")


def grid_layouts() -> int:
    """The grid kernels (fwd, dq, dk/dv) on the interpreter suite's neighborhoods (1-3 axes,
    strides, dilations, causal axes, full tiles), GQA; returns launches."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    from test_triton_grid import CASES as GRID_CASES  # imports like pytest does (tests/ on the path)

    from splat import masks

    launched = 0
    for grid, kernel, kw in GRID_CASES:
        layout = masks.neighborhood(grid, kernel, **kw).to_acsr()
        arrays = _inputs(layout, seed=1, B=2, H=4, Hkv=2, D=64, dtype=np.float16)
        q, k, v, do = (torch.from_numpy(a).cuda() for a in arrays)
        cf = cg.fwd_call(layout, q.shape, k.shape, "float16", 0.125)
        cq, ck = cg.bwd_calls(layout, q.shape, k.shape, "float16", 0.125)
        _fused(f"grid {grid} {kernel}", cf, cq, ck, q, k, v, do)
        launched += 3
        print(f"grid {str(grid):12s} kernel {str(kernel):10s} 3 kernels ok")
    return launched


def runtime_masks() -> int:
    """The fused kernels with each runtime mask (lengths, sorted ids, unsorted ids) and a soft cap,
    on the interpreter suite's layouts of every walk; returns launches."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    from test_triton_runtime import _operands, _runtime_case  # imports like pytest does (tests/ on the path)

    launched = 0
    cases = [("causal_window", "sorted_ids"), ("strided", "lengths"), ("varying_stride", "unsorted_ids"),
             ("strided_residual", "sorted_ids"), ("masked_rows", "lengths")]  # fmt: skip
    for name, kind in cases:
        layout = _layout(name)
        rt, _ = _runtime_case(kind, layout.q_len, layout.kv_len, np.random.default_rng(2))
        arrays = _inputs(layout, seed=1, B=2, H=2, Hkv=1, D=64, dtype=np.float16)
        q, k, v, do = (torch.from_numpy(a).cuda() for a in arrays)
        rq = [torch.from_numpy(x).cuda() for x in _operands(rt, keys=False)]
        rk = [torch.from_numpy(x).cuda() for x in _operands(rt, keys=True)]
        kind_name = "ranges" if rt.q_ids is None else "ids"
        kw = dict(runtime=kind_name, soft_cap=3.0)
        cf = cg.fwd_call(layout, q.shape, k.shape, "float16", 0.125, **kw)
        cq, ck = cg.bwd_calls(layout, q.shape, k.shape, "float16", 0.125, **kw)
        _fused(f"{name}/{kind}", cf, cq, ck, q, k, v, do, rq, rk)
        launched += 3
        print(f"{name:18s} {kind:13s} 3 kernels ok")
    return launched


def wide_heads() -> int:
    """The fused kernels with their default tiles at head dim 256 (bf16 and fp16), on three layouts
    of odd size; returns launches."""
    launched = 0
    for name in ("window", "dilated", "random"):
        layout = _layout(name, 300, 300)
        arrays = _inputs(layout, seed=3, H=2, Hkv=1, D=256, dtype=np.float16)
        for dtype in ("bfloat16", "float16"):
            q, k, v, do = (torch.from_numpy(a).cuda().to(getattr(torch, dtype)) for a in arrays)
            cf = cg.fwd_call(layout, q.shape, k.shape, dtype, 256**-0.5)
            _fused(f"{name} D=256 {dtype}", cf, *cg.bwd_calls(layout, q.shape, k.shape, dtype, 256**-0.5),
                   q, k, v, do)
            launched += 3
        print(f"{name:18s} head dim 256 ok")
    return launched


def tuned_configs() -> int:
    """Each (op, tiles) of the shipped tuning stores, on three layouts of odd size; returns launches."""
    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "jax_bindings", "tuning")
    configs = set()
    for path in glob.glob(os.path.join(root, "*.json")):
        with open(path) as f:
            for e in json.load(f)["tiles"]:
                if e["op"] in ("fwd", "bwd_dq", "bwd_dkdv"):
                    configs.add((e["op"], tuple(e["config"])))
    launched = 0
    for name in ("window", "dilated", "random"):
        layout = _layout(name, 300, 300)
        arrays = _inputs(layout, seed=2, H=4, Hkv=2, D=128, dtype=np.float16)
        q, k, v, do = (torch.from_numpy(a).cuda().to(torch.bfloat16) for a in arrays)
        scale = 128**-0.5
        for op, tiles in sorted(configs):
            fwd_tiles = tiles if op == "fwd" else None
            cf = cg.fwd_call(layout, q.shape, k.shape, "bfloat16", scale, tiles=fwd_tiles)
            pair = (tiles, None) if op == "bwd_dq" else (None, tiles) if op == "bwd_dkdv" else None
            cq, ck = cg.bwd_calls(layout, q.shape, k.shape, "bfloat16", scale, tiles=pair)
            _fused(f"{name} {op} {tiles}", cf, cq, ck, q, k, v, do)
            launched += 3
        print(f"{name:18s} {len(configs)} tuned (op, tiles) ok")
    return launched


def decode_kernels() -> int:
    """The decode kernel on every ``decode_cases`` case it takes, bf16, splits as planned, one and
    seven (merged in the kernel); then with segment ids (sorted and any, contiguous and paged);
    returns launches."""
    import sys

    import ml_dtypes

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    import decode_cases as dc

    import splat
    from jax_bindings._triton import decode

    rng = np.random.default_rng(0)
    cases = [(name, d, t, h, hk, page, splits, None) for name, d, t, h, hk, page, splits in dc.CASES]
    cases += [("sinks+window", 128, 2, 8, 2, page, 4, ids)
              for ids in ("documents", "any") for page in (0, 16)]
    launched = 0
    for name, d, t, h, hk, page, splits, ids in cases:
        layout = splat.analyze(dc.MASKS[name], dc.L, dc.L)
        if decode.refusal(layout, (3, t, h, d), hk, "bfloat16") is not None:
            continue
        x = dc.inputs(rng, 3, t, h, hk, d, dc.MASKS[name], ids=ids)
        q, k, v = (a.astype(ml_dtypes.bfloat16) for a in (x.q, x.k, x.v))
        ref_out, _ = dc.reference(*(a.astype(np.float32) for a in (q, k, v)), x.visible, d**-0.5)
        none = np.zeros(1, np.int32)
        table, id_args = none, (none, none, none)
        if page:
            kp, vp, table = dc.paged(rng, k.astype(np.float32), v.astype(np.float32), page)
            k, v = kp.astype(ml_dtypes.bfloat16), vp.astype(ml_dtypes.bfloat16)
        if ids is not None:  # the document bounds as jax_bindings._id_runs.document_keys gives them
            sorted_rows = (np.diff(x.q_ids, axis=1) >= 0).all(1) & (np.diff(x.kv_ids, axis=1) >= 0).all(1)
            doc = np.zeros((*x.q_ids.shape, 2), np.int32)
            for b in range(x.q_ids.shape[0]):
                doc[b] = (np.stack([np.searchsorted(x.kv_ids[b], x.q_ids[b], "left"),
                                    np.searchsorted(x.kv_ids[b], x.q_ids[b], "right")], -1)
                          if sorted_rows[b] else [0, dc.L])
            id_args = (x.q_ids, x.kv_ids, doc)
        for n in sorted({splits or 0, 1, 7}):
            p = decode.plan(q.shape, hk, "bfloat16", layout, d**-0.5, None, 132, page_size=page,
                            max_pages=table.shape[1] if page else 0, n_pages=k.shape[0] if page else 0,
                            ids=ids is not None, splits=n or None)
            data = [torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16).cuda()
                    for a in (q, k, v)]
            ints = (x.q_pos, x.q_len, x.kv_len, decode.segment_table(layout), table, *id_args)
            data += [torch.from_numpy(np.ascontiguousarray(a)).cuda() for a in ints]
            out, lse, *_scratch = run_torch(decode.call(p), *data)
            torch.cuda.synchronize()
            launched += 1
            out = out.float().cpu().numpy()
            assert np.isfinite(out).all(), f"decode {name} {d} {t}: non-finite out"
            err = np.abs(out - ref_out).max()
            what = f"decode {name} d={d} t={t} page={page} splits={p.splits} ids={ids}"
            assert err < 3e-2, f"{what}: out differs by {err:.3g}"
            print(f"{what} ok ({err:.1e})")
    return launched


if __name__ == "__main__":
    import sys as _sys

    if _sys.argv[1:] == ["decode"]:
        print(f"{decode_kernels()} launches of the decode kernel")
    else:
        main()
        print(f"{decode_kernels()} launches of the decode kernel")
