"""Every CUDA-backend kernel variant the gpu tests build, launched once for compute-sanitizer.

The variants and shapes of ``tests/test_cuda_gpu.py`` (``tests/cuda_cases.py``: dense, causal
top-left and bottom-right, windows, bands off the diagonal with fully masked rows, bands
measured from blocks of rows; GQA; lengths that are not tile multiples; a band in phases runs
the same kernels on folded shapes), in bfloat16 and float16: the forward in every schedule (on 5
CTAs too, so that each takes several work tiles, the queue also on one per SM
and in sections of 3 heads), the backward with dQ added in order (in every key order) and in
arrival order, with the passes around it (delta, dq's rows); each compiled as the backend
compiles it (``jax_bindings._cuda.plan``, ``bwd_passes``) and launched with CuPy (JAX runs on
the CPU only), so no XLA kernel runs under the sanitizer. Each
output is checked against a float32 NumPy reference, and so is every row's ``lse``; fully
masked rows must give 0 and ``-inf``, and zero gradients. Then the runtime-mask variants
(lengths, segment ids) on ``tests/cuda_cases.RUNTIME_CASES``, forward and backward (in every
key order), their arrays built by ``jax_bindings._cuda.runtime_tables`` with JAX on the CPU; the
shifted forward (chunked prefill: queries at offsets, rows before and past the layout) on
``tests/prefill_cases.CASES``; and the grid forward (N-D neighborhoods) on
``tests/cuda_cases.GRID_CASES``.

    compute-sanitizer --tool memcheck --error-exitcode 9 python3 benchmarks/sanitize_cuda.py \
        [grid | shifted | head_dims | NAME ...]

(``grid``, ``shifted``, ``head_dims``: the grid forward's, the shifted forward's or the other head
dims' cases alone (every head dim besides 128, the soft cap, forward and backward); band case names
(``tests/cuda_cases.CASES``, e.g. ``block_local block_local_96``): those cases alone, forward and
backward, without the runtime and grid cases, for a change that touches only their kernels.)
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import sys
import tempfile

os.environ["JAX_PLATFORMS"] = "cpu"  # the runtime masks' arrays are built by JAX, on the CPU

import cupy as cp
import ml_dtypes
import numpy as np

sys.path.insert(0, "tests")
import prefill_cases  # noqa: E402
from cuda_cases import CASES, GRID_CASES, RUNTIME_CASES, band_layout, other_key_orders  # noqa: E402
from runtime_masks import build_arguments, runtime_dense  # noqa: E402

from jax_bindings import _runtime  # noqa: E402
from jax_bindings._cuda import (  # noqa: E402
    bwd_passes,
    bwd_source,
    grid_tiles,
    plan,
    runtime_tables,
    source,
    tile_shapes,
)
from splat import masks  # noqa: E402

NP = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
# (forward schedule, CTAs of a persistent one: None for one per SM, else at most that many; on 5,
# each CTA takes several work tiles; the queue's sections of (batch, head)s: 0 one after another;
# Q tiles: 2 where they fit beside the K/V ring; the epilogue's o_store, None for the plan's; see
# plan.rescheduled)
LAUNCHES = (("strided", None, 0, 1, "registers"), ("strided", 5, 0, 1, None), ("strided", 5, 0, 2, None),
            ("queue", None, 0, 2, None), ("queue", 5, 3, 2, None), ("queue", 5, 0, 2, "registers"),
            ("queue", 5, 0, 1, None))


def _capped(s, cap):
    """``(cap * tanh(s / cap), its derivative)``, or ``(s, 1)`` without a cap."""
    if cap is None:
        return s, 1.0
    t = np.tanh(s / cap)
    return cap * t, 1 - t * t


def reference(q, k, v, mask, scale, cap=None):
    """Float32 ``(out [B, Sq, H, D], lse [B, H, Sq])``; empty rows 0 and -inf. ``mask``: ``[Sq,
    Skv]``, or ``[B, 1, Sq, Skv]`` per batch row (here and in :func:`grads_reference`); ``cap``:
    the soft cap of the scores (here and there)."""
    g = q.shape[2] // k.shape[2]
    kf, vf = (np.repeat(x.astype(np.float32), g, axis=2) for x in (k, v))
    s = _capped(np.einsum("bqhd,bkhd->bhqk", q.astype(np.float32), kf) * scale, cap)[0]
    s = np.where(mask, s, -np.inf)
    m = s.max(-1, keepdims=True)
    e = np.exp(s - np.where(np.isfinite(m), m, 0))
    tot = e.sum(-1, keepdims=True)
    p = e / np.where(tot > 0, tot, 1)
    lse = np.where(tot[..., 0] > 0, np.log(np.where(tot[..., 0] > 0, tot[..., 0], 1)) + m[..., 0], -np.inf)
    return np.einsum("bhqk,bkhd->bqhd", p, vf), lse


def grads_reference(q, k, v, do, mask, scale, cap=None):
    """Float32 ``(dq, dk, dv)`` of ``sum(attention * do)``."""
    g = q.shape[2] // k.shape[2]
    qf, dof = q.astype(np.float32), do.astype(np.float32)
    kf, vf = (np.repeat(x.astype(np.float32), g, axis=2) for x in (k, v))
    s, dcap = _capped(np.einsum("bqhd,bkhd->bhqk", qf, kf) * scale, cap)
    s = np.where(mask, s, -np.inf)
    m = s.max(-1, keepdims=True)
    e = np.exp(s - np.where(np.isfinite(m), m, 0))
    tot = e.sum(-1, keepdims=True)
    p = e / np.where(tot > 0, tot, 1)
    dp = np.einsum("bqhd,bkhd->bhqk", dof, vf)
    ds = p * (dp - (p * dp).sum(-1, keepdims=True)) * dcap
    dq = np.einsum("bhqk,bkhd->bqhd", ds, kf) * scale
    dk = np.einsum("bhqk,bqhd->bkhd", ds, qf) * scale
    dv = np.einsum("bhqk,bqhd->bkhd", p, dof)
    fold = lambda x: x.reshape(*x.shape[:2], k.shape[2], g, x.shape[-1]).sum(3)
    return dq, fold(dk), fold(dv)


def _loaded(name: str, image: bytes):
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(image)
        f.flush()
        return cp.RawModule(path=f.name).get_function(name)


def _kernel(variant):
    fn = _loaded(*plan.compiled(variant))
    fn.max_dynamic_shared_size_bytes = variant.smem
    return fn


def launch_bwd(variant, q, k, v, out, lse, do, scale, rt_arrays=()):
    """``(dq, dk, dv)`` of the backward kernel with the passes around it (``bwd_passes``: delta
    and lse2 before, dq's rows after); ``rt_arrays``: the runtime mask's
    (``runtime_tables.bwd_arrays``)."""
    fn = _kernel(variant)
    B, Sq, H, D = q.shape
    nq = bwd_source.num_q_blocks(Sq)
    sq_pad = nq * bwd_source.BM
    delta, lse2 = (cp.full((B, H, sq_pad), np.nan, dtype=np.float32) for _ in range(2))  # the pass writes all
    _loaded(*bwd_passes.compiled("delta", variant.dtype, D))(
        (-(-B * sq_pad * H // bwd_passes.ROWS_PER_CTA),), (bwd_passes.THREADS,),
        (cp.asarray(out), cp.asarray(do), cp.asarray(lse, dtype=np.float32), np.int32(B), np.int32(Sq),
         np.int32(H), np.int32(sq_pad), delta, lse2))
    grid = plan.bwd_grid(k.shape, cp.cuda.Device().attributes["MultiProcessorCount"])
    maps = cp.asarray(np.frombuffer(plan.bwd_tensor_maps(q.shape, k.shape), np.uint8))
    dk, dv = (cp.full(k.shape, np.nan, dtype=k.dtype) for _ in range(2))
    # the ordered kernel stores each query block's first part: NaN where it writes nothing (blocks
    # no key block reaches), which the dq pass must turn into 0
    dq_acc = cp.full(bwd_source.dq_acc_shape(B, H, Sq, D), np.nan if variant.ordered else 0, dtype=np.float32)
    sem = cp.zeros(bwd_source.sem_words(B, H, Sq), dtype=np.int32)
    slots = cp.zeros(grid[0] * grid[1] * grid[2] * bwd_source.SLOT_BYTES, dtype=np.uint8)
    args = (*(cp.asarray(x) for x in (q, k, v, do)), lse2, delta, maps,
            *(cp.asarray(np.asarray(x)) for x in rt_arrays), np.int32(Sq), np.int32(k.shape[1]),
            np.int32(H), np.int32(k.shape[2]), np.int32(B), np.float32(scale * math.log2(math.e)),
            np.float32(scale), dk, dv, dq_acc, sem, slots)
    fn(grid, (variant.threads,), args, shared_mem=variant.smem)
    dq = cp.full(q.shape, np.nan, dtype=q.dtype)
    _loaded(*bwd_passes.compiled("dq_rows", variant.dtype, D))(
        (B * H * nq,), (bwd_passes.THREADS,),
        (dq_acc, lse2, np.int32(Sq), np.int32(H), np.int32(nq), np.float32(scale), dq))
    cp.cuda.runtime.deviceSynchronize()
    return tuple(cp.asnumpy(x).astype(np.float32) for x in (dq, dk, dv))


def launch(variant, q, k, v, scale, ctas=None, rt_arrays=()):
    """``(out, lse)`` of the forward kernel; a persistent schedule on at most ``ctas`` CTAs (None:
    one per SM); ``rt_arrays``: the runtime mask's (``runtime_tables.fwd_arrays``), or a grid
    variant's tables."""
    fn = _kernel(variant)
    B, Sq, H, D = q.shape
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    if isinstance(variant, plan.GridFwdVariant):
        grid = plan.grid(q.shape, variant.schedule, sms if ctas is None else ctas, variant.tiles.n_patches)
        tmpl = plan.grid_tensor_maps(variant.tiles, q.shape, k.shape, v.shape)
    else:
        grid = plan.grid(q.shape, variant.schedule, sms if ctas is None else ctas)
        tmpl = plan.tensor_maps(variant.block_n, q.shape, k.shape, v.shape)
    dq, dk, dv = (cp.asarray(x) for x in (q, k, v))
    maps = cp.asarray(np.frombuffer(tmpl, np.uint8))
    out = cp.full(q.shape, np.nan, dtype=q.dtype)
    lse = cp.full((B, H, Sq), np.nan, dtype=np.float32)
    sem = cp.zeros(1, dtype=np.int32)
    slots = cp.zeros(grid[0] * grid[1] * grid[2] * source.SLOT_BYTES, dtype=np.uint8)
    args = (dq, dk, dv, maps, *(cp.asarray(np.asarray(x)) for x in rt_arrays), np.int32(Sq),
            np.int32(k.shape[1]), np.int32(H), np.int32(k.shape[2]), np.int32(B),
            np.float32(scale * math.log2(math.e)), out, lse, sem, slots)
    fn(grid, (variant.threads,), args, shared_mem=variant.smem)
    cp.cuda.runtime.deviceSynchronize()
    return cp.asnumpy(out), cp.asnumpy(lse)


HEAD_DIM_CASES = ("dense", "causal", "causal_window", "sliding_window", "off_diagonal")


def run_head_dim_cases() -> int:
    """The planned forward at every head dim besides 128 (5 CTAs), with and without the soft cap, on
    a few bands; the backward at those its head dims take, the cap's too; two runtime-mask cases
    (segment ids, lengths) at each; returns the launches."""
    launched = 0
    cases = [c for c in CASES if c.name in HEAD_DIM_CASES] + [c for c in CASES if c.block > 1][:1]
    for d, case, cap in itertools.product([x for x in tile_shapes.HEAD_DIMS if x != 128], cases, (None, 5.0)):
        if cap is not None and case.name not in ("causal", "sliding_window"):
            continue
        sq, skv, h, hk = case.q_len, case.kv_len, case.heads, case.kv_heads
        layout = case.layout()
        rng = np.random.default_rng(d + sq)
        q = (rng.standard_normal((2, sq, h, d)) * (2 if cap else 1)).astype(ml_dtypes.bfloat16)
        k, v, do = (rng.standard_normal(x).astype(ml_dtypes.bfloat16)
                    for x in ((2, skv, hk, d), (2, skv, hk, d), (2, sq, h, d)))
        scale, mask = d**-0.5, layout.to_dense()
        out, lse = launch(plan.fwd_variant(layout, d, "bfloat16", soft_cap=cap), q, k, v, scale, ctas=5)
        launched += 1
        ref_out, _ = reference(q, k, v, mask, scale, cap)
        err = np.abs(out.astype(np.float32) - ref_out).max()
        assert err < 3e-2, f"{case.name} d={d} cap={cap}: out differs by {err:.3g}"
        empty = ~mask.any(1)
        assert np.all(out[:, empty] == 0) and np.all(np.isneginf(lse[:, :, empty])), case.name
        line = f"{case.name:22s} d={d:3d} cap={cap!s:5s} fwd ok ({err:.1e})"
        if d in tile_shapes.BWD_HEAD_DIMS:
            bwd = plan.bwd_variant(layout, d, "bfloat16", soft_cap=cap)
            got = launch_bwd(bwd, q, k, v, out, lse, do, scale)
            launched += 1
            refs = grads_reference(q, k, v, do, mask, scale, cap)
            pairs = zip(got, refs, strict=True)
            errs = [float(np.abs(x - r).max() / max(1.0, np.abs(r).max())) for x, r in pairs]
            assert max(errs) < 3e-2, f"{case.name} d={d} cap={cap}: gradients differ by {errs}"
            line += f", bwd ok ({max(errs):.1e})"
        print(line)
    for d in (x for x in tile_shapes.HEAD_DIMS if x != 128):
        launched += run_runtime_cases(d, ("document_causal", "everything_window"))
    return launched


def main() -> int:
    args = sys.argv[1:]
    alone = {"grid": run_grid_cases, "shifted": run_shifted_cases, "head_dims": run_head_dim_cases}
    if len(args) == 1 and args[0] in alone:
        launched = alone[args[0]]()
        print(f"{launched} launches of {launched} cuda kernel variants")
        return 0
    unknown = set(args) - {c.name for c in CASES}
    if unknown:
        raise SystemExit(
            f"unknown band cases {sorted(unknown)}: 'grid', 'shifted', 'head_dims' or names of "
            "cuda_cases.CASES")
    cases = [c for c in CASES if c.name in args] if args else CASES
    launched = 0
    for dtype, (schedule, ctas, section, q_stages, o_store) in itertools.product(NP, LAUNCHES):
        for case in cases:
            name, sq, skv, h, hk = case.name, case.q_len, case.kv_len, case.heads, case.kv_heads
            layout = case.layout()
            variant = plan.rescheduled(plan.fwd_variant(layout, 128, dtype), schedule,
                                       source.section_bytes_of(section, skv), q_stages, o_store)
            rng = np.random.default_rng(sq + skv)
            q = rng.standard_normal((2, sq, h, 128)).astype(NP[dtype])
            k, v = (rng.standard_normal((2, skv, hk, 128)).astype(NP[dtype]) for _ in range(2))
            scale = 128**-0.5
            out, lse = launch(variant, q, k, v, scale, ctas)
            launched += 1
            mask = layout.to_dense()
            ref_out, ref_lse = reference(q, k, v, mask, scale)
            empty = ~mask.any(1)
            err = np.abs(out.astype(np.float32) - ref_out).max()
            assert np.isfinite(out.astype(np.float32)).all(), f"{name} {dtype}: non-finite out"
            assert err < 3e-2, f"{name} {dtype}: out differs from the reference by {err:.3g}"
            assert np.all(out[:, empty] == 0) and np.all(np.isneginf(lse[:, :, empty])), f"{name}: empty rows"
            lerr = np.abs(lse[:, :, ~empty] - ref_lse[:, :, ~empty]).max()
            assert lerr < 2e-2, f"{name} {dtype}: lse differs by {lerr:.3g}"
            kind = ((schedule if ctas is None else f"{schedule}/{ctas}") + (f"/{section}h" if section else "")
                    + f"/q{variant.q_stages}/{variant.o_store}")
            print(f"{name:22s} {dtype:9s} {kind:10s} ok (out {err:.1e}, lse {lerr:.1e})")
            # the backward once per case and dtype in each key order, and in arrival order
            if (schedule, ctas, section, q_stages, o_store) == LAUNCHES[-1]:
                do = rng.standard_normal(q.shape).astype(NP[dtype])
                refs = grads_reference(q, k, v, do, mask, scale)
                planned = plan.bwd_variant(layout, 128, dtype)
                for bv in (planned, *other_key_orders(planned, q.shape, k.shape),
                           dataclasses.replace(planned, ordered=False)):
                    ordered = f"{bv.ordered}/{bv.key_order}"
                    got = launch_bwd(bv, q, k, v, out, lse, do, scale)
                    launched += 1
                    pairs = zip(got, refs, strict=True)
                    errs = [float(np.abs(x - r).max() / max(1.0, np.abs(r).max())) for x, r in pairs]
                    assert all(np.isfinite(x).all() for x in got), f"{name} {dtype}: non-finite gradients"
                    assert max(errs) < 3e-2, f"{name} {dtype} ordered={ordered}: gradients differ by {errs}"
                    assert np.all(got[0][:, empty] == 0), f"{name}: a row with no key must get dq 0"
                    print(f"{name:22s} {dtype:9s} bwd ordered={ordered:16s} ok (rel. {max(errs):.1e})")
    if not args:
        launched += run_runtime_cases()
        launched += run_shifted_cases()
        launched += run_grid_cases()
        launched += run_head_dim_cases()
    print(f"{launched} launches of {launched} cuda kernel variants")
    return 0


def run_runtime_cases(head_dim: int = 128, names: tuple[str, ...] | None = None) -> int:
    """The runtime-mask variants, forward (the plan's schedule, and the queue on 5 CTAs) and
    backward (where it takes ``head_dim``), on the runtime cases (``names``; None: every one) in
    bfloat16; returns the launches."""
    launched = 0
    for name, sq, skv, left, right, h, hk, b, make in RUNTIME_CASES:
        if names is not None and name not in names:
            continue
        rng = np.random.default_rng(sq + skv)
        rt_args = make(rng)
        layout = band_layout(sq, skv, left, right)
        mask = runtime_dense(layout.to_dense(), b, sq, skv, **rt_args)[:, None]
        runtime = _runtime.build(b, sq, skv, **build_arguments(rt_args))
        kind = runtime_tables.kind(runtime)
        q, do = (rng.standard_normal((b, sq, h, head_dim)).astype(ml_dtypes.bfloat16) for _ in range(2))
        k, v = (rng.standard_normal((b, skv, hk, head_dim)).astype(ml_dtypes.bfloat16) for _ in range(2))
        scale = head_dim**-0.5
        ref_out, ref_lse = reference(q, k, v, mask, scale)
        empty = ~mask[:, 0].any(-1)  # [B, Sq]
        planned = plan.fwd_variant(layout, head_dim, "bfloat16", kind)
        for variant, ctas in ((planned, None), (dataclasses.replace(planned, schedule="queue"), 5)):
            arrays = runtime_tables.fwd_arrays(runtime, variant.block_n)
            out, lse = launch(variant, q, k, v, scale, ctas, arrays)
            launched += 1
            err = np.abs(out.astype(np.float32) - ref_out).max()
            assert err < 3e-2, f"{name}: out differs from the reference by {err:.3g}"
            assert not out[empty].astype(np.float32).any(), f"{name}: a row that sees nothing must output 0"
            assert np.all(np.isneginf(lse.transpose(0, 2, 1)[empty])), f"{name}: lse of an empty row"
            lerr = np.abs(lse - ref_lse)[np.isfinite(ref_lse)].max()
            assert lerr < 2e-2, f"{name}: lse differs by {lerr:.3g}"
            print(f"{name:22s} d={head_dim:3d} runtime {kind:7s} {variant.schedule}/{ctas} ok "
                  f"(out {err:.1e}, lse {lerr:.1e})")
        if head_dim not in tile_shapes.BWD_HEAD_DIMS:
            continue
        refs = grads_reference(q, k, v, do, mask, scale)
        planned = plan.bwd_variant(layout, head_dim, "bfloat16", kind)
        arrays = runtime_tables.bwd_arrays(runtime, planned.block_n)
        for bv in (planned, *other_key_orders(planned, q.shape, k.shape)):
            got = launch_bwd(bv, q, k, v, out, lse, do, scale, arrays)
            launched += 1
            pairs = zip(got, refs, strict=True)
            errs = [float(np.abs(x - r).max() / max(1.0, np.abs(r).max())) for x, r in pairs]
            assert all(np.isfinite(x).all() for x in got), f"{name}: non-finite gradients"
            assert max(errs) < 3e-2, f"{name} {bv.key_order}: gradients differ by {errs}"
            assert not got[0][empty].any(), f"{name}: a row that sees nothing must get dq 0"
            print(f"{name:22s} runtime {kind:7s} bwd {bv.key_order:11s} ok (rel. {max(errs):.1e})")
    return launched


def run_shifted_cases() -> int:
    """The shifted forward (chunked prefill) on every ``prefill_cases.CASES`` case in bfloat16,
    the plan's schedule and the queue on 5 CTAs; returns the launches."""
    launched = 0
    for case in prefill_cases.CASES:
        x = prefill_cases.inputs(case)
        b, sq, length = len(x.offsets), prefill_cases.SQ, prefill_cases.L
        layout = prefill_cases.MASKS[case[0]].to_acsr(length)
        args = {prefill_cases.BUILD_NAMES[n]: a for n, a in x.runtime.items()}
        runtime = _runtime.build(b, sq, length, q_offset=x.offsets, layout_rows=length, **args)
        kind = runtime_tables.kind(runtime, positions=True)
        q, k, v = (a.astype(ml_dtypes.bfloat16) for a in (x.q, x.k, x.v))
        scale = 128**-0.5
        ref_out, ref_lse = reference(q, k, v, x.dense[:, None], scale)
        empty = ~x.dense.any(-1)
        planned = plan.fwd_variant(layout, 128, "bfloat16", kind, shifted=True)
        arrays = runtime_tables.fwd_arrays(runtime, planned.block_n, length)
        for variant, ctas in ((planned, None), (dataclasses.replace(planned, schedule="queue"), 5)):
            out, lse = launch(variant, q, k, v, scale, ctas, arrays)
            launched += 1
            err = np.abs(out.astype(np.float32) - ref_out).max()
            tag = prefill_cases.case_id(case)
            assert err < 3e-2, f"{tag}: out differs from the reference by {err:.3g}"
            assert not out[empty].astype(np.float32).any(), f"{tag}: a row that sees nothing must output 0"
            assert np.all(np.isneginf(lse.transpose(0, 2, 1)[empty])), f"{tag}: lse of an empty row"
            lerr = np.abs(lse - ref_lse)[np.isfinite(ref_lse)].max()
            assert lerr < 2e-2, f"{tag}: lse differs by {lerr:.3g}"
            print(f"{tag:28s} shifted {kind:7s} {variant.schedule}/{ctas} ok (out {err:.1e}, lse {lerr:.1e})")
    return launched


def run_grid_cases() -> int:
    """The grid forward (N-D neighborhoods) on every ``GRID_CASES`` case, in both dtypes, on one
    CTA per SM and on 5 (several patches each), its schedule's sections as planned (at these
    lengths: every head) and of one head; returns the launches."""
    launched = 0
    for dtype, (grid, kernel, kw, h, hk) in itertools.product(NP, GRID_CASES):
        layout = masks.neighborhood(grid, kernel, **kw).to_acsr()
        variant = plan.fwd_variant(layout, 128, dtype)
        tables = grid_tiles.grid_plan(layout.grid).tables
        rng = np.random.default_rng(sum(grid))
        s = layout.q_len
        q = rng.standard_normal((2, s, h, 128)).astype(NP[dtype])
        k, v = (rng.standard_normal((2, s, hk, 128)).astype(NP[dtype]) for _ in range(2))
        scale = 128**-0.5
        mask = layout.to_dense()
        ref_out, ref_lse = reference(q, k, v, mask, scale)
        for ctas, section in ((None, variant.section_bytes), (5, variant.section_bytes), (None, 1)):
            out, lse = launch(dataclasses.replace(variant, section_bytes=section), q, k, v, scale, ctas,
                              (tables,))
            launched += 1
            err = np.abs(out.astype(np.float32) - ref_out).max()
            assert np.isfinite(out.astype(np.float32)).all(), f"grid {grid} {kernel} {kw}: non-finite out"
            assert err < 3e-2, f"grid {grid} {kernel} {kw} {dtype}: out differs by {err:.3g}"
            lerr = np.abs(lse - ref_lse).max()
            assert lerr < 2e-2, f"grid {grid} {kernel} {kw} {dtype}: lse differs by {lerr:.3g}"
            print(f"grid {grid!s:14s} k{kernel!s:10s} {kw!s:40s} {dtype:9s} ctas={ctas} section={section} "
                  f"ok (out {err:.1e})")
    return launched


if __name__ == "__main__":
    sys.exit(main())
