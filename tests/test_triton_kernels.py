"""Every generated Triton kernel variant, run by Triton's CPU interpreter.

Tiny shapes, tiles of 16, against a dense float64 reference. The same
generated source runs compiled on the GPU (``tests/test_triton_gpu.py``).
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest

import acsr
from acsr import ACSR, Segment
from jax_bindings._triton import ops
from jax_bindings._triton.launch import run_numpy
from jax_bindings._triton.spec import plan, transpose_slots, transposed

TILES = (16, 16, 4, 1)


# -- masks (dense bool [Sq, Skv]) ---------------------------------------------


def _ij(sq, skv):
    return np.arange(sq)[:, None], np.arange(skv)[None, :]


def _mask(name: str, sq: int = 64, skv: int = 64) -> np.ndarray:
    i, j = _ij(sq, skv)
    rng = np.random.default_rng(7)
    if name == "window":
        return np.abs(i - j) <= 20  # wide enough for full (unmasked) tiles
    if name == "causal_window":
        return (j <= i) & (i - j <= 30)
    if name == "dilated":
        return (np.abs(i - j) <= 40) & ((i - j) % 2 == 0)
    if name == "strided":
        return (j <= i) & ((i - j) % 4 == 0)
    if name == "block_local":
        return (j // 16 <= i // 16) & (j // 16 >= i // 16 - 1)
    if name == "global_window":
        return (np.abs(i - j) <= 20) | (i < 2) | (j < 2)
    if name == "sink_window":
        return (j <= i) & ((j < 3) | (i - j <= 24))
    if name == "random":
        return rng.random((sq, skv)) < 0.3
    if name == "masked_rows":
        m = np.abs(i - j) <= 20
        m[5:9] = False
        m[-3:] = False
        return m
    if name == "rect":  # q_len != kv_len: queries sit at the end of the keys
        return (j <= i + (skv - sq)) & (i + (skv - sq) - j <= 7)
    if name == "varying_stride":
        m = np.zeros((sq, skv), bool)
        for r in range(sq):
            st = 2 + r % 3
            m[r, np.arange(r % 5, min(skv, r % 5 + 6 * st), st)] = True
        return m
    raise KeyError(name)


def _layout(name: str, sq: int = 64, skv: int = 64) -> ACSR:
    if name == "window_arrays":  # same mask, closed forms dropped: per-row arrays path
        lay = acsr.from_dense(_mask("window", sq, skv), block=(16, 16))
        return ACSR(sq, skv, tuple(Segment(s.base, s.stride, s.count, None) for s in lay.segments))
    if name == "strided_arrays":  # aligned walk reading per-row arrays
        lay = acsr.from_dense(_mask("strided", sq, skv), block=(16, 16))
        return ACSR(sq, skv, tuple(Segment(s.base, s.stride, s.count, None) for s in lay.segments))
    if name == "strided_residual":  # strided segments + a residual: no permutation, modular walk
        m = _mask("strided", sq, skv)
        seg = acsr.from_dense(m, block=(16, 16)).segments
        extra = (np.random.default_rng(3).random((sq, skv)) < 0.05) & ~m
        indptr = np.concatenate([[0], np.cumsum(extra.sum(1))])
        res = acsr.residual_from_csr(indptr, np.nonzero(extra)[1], sq, skv, (16, 16))
        return ACSR(sq, skv, seg, res).validate()
    return acsr.from_dense(_mask(name, sq, skv), block=(16, 16))


CASES = [
    "window",
    "causal_window",
    "dilated",
    "strided",
    "block_local",
    "global_window",
    "sink_window",
    "random",
    "masked_rows",
    "window_arrays",
    "strided_arrays",
    "varying_stride",
    "strided_residual",
]


# -- dense float64 reference --------------------------------------------------


def _ref_fwd(q, k, v, mask, scale):
    g = q.shape[2] // k.shape[2]
    kk = np.repeat(k, g, axis=2).astype(np.float64)
    vv = np.repeat(v, g, axis=2).astype(np.float64)
    s = np.einsum("bqhd,bkhd->bhqk", q.astype(np.float64), kk) * scale
    s = np.where(mask, s, -np.inf)
    m = s.max(-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(s - m)
    lsum = e.sum(-1, keepdims=True)
    p = e / np.where(lsum > 0, lsum, 1.0)
    out = np.einsum("bhqk,bkhd->bqhd", p, vv)
    l0 = lsum[..., 0]
    lse = np.where(l0 > 0, np.log(np.where(l0 > 0, l0, 1.0)) + m[..., 0], -np.inf)
    return out, lse, p


def _ref_bwd(q, k, v, mask, scale, dout):
    g = q.shape[2] // k.shape[2]
    _, _, p = _ref_fwd(q, k, v, mask, scale)
    kk = np.repeat(k, g, axis=2).astype(np.float64)
    vv = np.repeat(v, g, axis=2).astype(np.float64)
    do = dout.astype(np.float64)
    dp = np.einsum("bqhd,bkhd->bhqk", do, vv)
    ds = p * (dp - (p * dp).sum(-1, keepdims=True))
    dq = scale * np.einsum("bhqk,bkhd->bqhd", ds, kk)
    dk = scale * np.einsum("bhqk,bqhd->bkhd", ds, q.astype(np.float64))
    dv = np.einsum("bhqk,bqhd->bkhd", p, do)
    B, Skv, Hkv, D = k.shape
    dk = dk.reshape(B, Skv, Hkv, g, D).sum(3)
    dv = dv.reshape(B, Skv, Hkv, g, D).sum(3)
    return dq, dk, dv


def _rand(rng, shape, dtype):
    return rng.standard_normal(shape).astype(dtype)


def _close(got, want, tol, what):
    got = got.astype(np.float64)
    assert np.all(np.isfinite(got)), f"{what}: non-finite values (unwritten or NaN)"
    err = np.abs(got - want).max() / max(1.0, np.abs(want).max())
    assert err < tol, f"{what}: max error {err:.3g} >= {tol}"


def _inputs(layout, seed, *, B=1, H=2, Hkv=1, D=16, dtype=np.float32):
    rng = np.random.default_rng(seed)
    q = _rand(rng, (B, layout.q_len, H, D), dtype)
    k = _rand(rng, (B, layout.kv_len, Hkv, D), dtype)
    v = _rand(rng, (B, layout.kv_len, Hkv, D), dtype)
    do = _rand(rng, (B, layout.q_len, H, D), dtype)
    return q, k, v, do


# -- fused forward + backward --------------------------------------------------


def _fused(layout, q, k, v, do, scale):
    dt = q.dtype.name
    out, lse = run_numpy(
        ops.fwd_call(layout, q.shape, k.shape, dt, scale, tiles=TILES, interpret=True), q, k, v
    )
    cq, ck = ops.bwd_calls(layout, q.shape, k.shape, dt, scale, tiles=(TILES, TILES), interpret=True)
    dq, delta = run_numpy(cq, q, k, v, do, out, lse)
    want = np.einsum("bqhd,bqhd->bhq", do.astype(np.float64), out.astype(np.float64))
    assert np.allclose(delta, want, rtol=1e-4, atol=1e-4), "delta = rowsum(dout * out)"
    dk, dv = run_numpy(ck, q, k, v, do, lse, delta)
    return out, lse, dq, dk, dv


@pytest.mark.parametrize("name", CASES)
def test_fused_forward_backward(name):
    layout = _layout(name)
    mask = layout.to_dense()
    q, k, v, do = _inputs(layout, seed=zlib.crc32(name.encode()))
    scale = 0.3
    out, lse, dq, dk, dv = _fused(layout, q, k, v, do, scale)
    r_out, r_lse, _ = _ref_fwd(q, k, v, mask, scale)
    _close(out, r_out, 1e-5, "out")
    empty = ~mask.any(1)
    assert np.all(np.isneginf(lse[:, :, empty])), "fully masked rows need lse = -inf"
    assert np.allclose(lse[:, :, ~empty], r_lse[:, :, ~empty], atol=1e-5)
    r_dq, r_dk, r_dv = _ref_bwd(q, k, v, mask, scale, do)
    _close(dq, r_dq, 1e-5, "dq")
    _close(dk, r_dk, 1e-5, "dk")
    _close(dv, r_dv, 1e-5, "dv")


@pytest.mark.parametrize(
    "name,H,Hkv,D,dtype,sq",
    [
        ("window", 4, 2, 24, np.float16, 64),  # GQA, odd head dim, fp16
        ("rect", 2, 2, 16, np.float32, 40),  # q_len != kv_len
        ("dilated", 3, 1, 16, np.float16, 53),  # MQA, odd S
    ],
)
def test_fused_shapes(name, H, Hkv, D, dtype, sq):
    skv = 64
    layout = acsr.from_dense(_mask(name, sq, skv), block=(16, 16))
    mask = layout.to_dense()
    q, k, v, do = _inputs(layout, seed=11, H=H, Hkv=Hkv, D=D, dtype=dtype)
    scale = D**-0.5
    out, lse, dq, dk, dv = _fused(layout, q, k, v, do, scale)
    tol = 1e-5 if dtype == np.float32 else 2e-2
    r_out, _, _ = _ref_fwd(q, k, v, mask, scale)
    _close(out, r_out, tol, "out")
    for got, want, what in zip(
        (dq, dk, dv), _ref_bwd(q, k, v, mask, scale, do), ("dq", "dk", "dv"), strict=True
    ):
        _close(got, want, tol * 4, what)


# -- unfused ops ---------------------------------------------------------------


def _values_ref(layout, q, k):
    """Reference SDDMM values [B, H, Sq, nnz_max] (padding 0) and the slot columns."""
    g = q.shape[2] // k.shape[2]
    cols = layout.slot_columns()
    kk = np.repeat(k, g, axis=2).astype(np.float64)
    full = np.einsum("bqhd,bkhd->bhqk", q.astype(np.float64), kk)
    vals = np.take_along_axis(full, np.maximum(cols, 0)[None, None], axis=-1)
    return np.where(cols >= 0, vals, 0.0), cols


@pytest.mark.parametrize("name", CASES)
def test_unfused_ops(name):
    layout = _layout(name)
    q, k, v, _ = _inputs(layout, seed=5, H=2, Hkv=1)
    want_s, cols = _values_ref(layout, q, k)
    (s,) = run_numpy(ops.sddmm_call(layout, q.shape, k.shape, "float32", tiles=TILES, interpret=True), q, k)
    _close(s, want_s, 1e-5, "sddmm")

    scale = 0.4
    x = np.where(cols >= 0, s.astype(np.float64) * scale, -np.inf)
    m = np.max(x, -1, keepdims=True)
    e = np.exp(x - np.where(np.isfinite(m), m, 0))
    want_p = e / np.maximum(e.sum(-1, keepdims=True), 1e-300)
    (p,) = run_numpy(ops.softmax_call(layout, s.shape, "float32", scale, tiles=TILES, interpret=True), s)
    _close(p, want_p, 1e-5, "softmax")

    vv = np.repeat(v, 2, axis=2).astype(np.float64)
    gathered = vv[:, np.maximum(cols, 0)]  # [B, Sq, N, H, D]
    want_o = np.einsum("bhqn,bqnhd->bqhd", np.where(cols >= 0, p, 0.0), gathered)
    (o,) = run_numpy(ops.spmm_call(layout, p.shape, v.shape, "float32", tiles=TILES, interpret=True), p, v)
    _close(o, want_o, 1e-5, "spmm")


def test_transpose_slots_roundtrip():
    layout = _layout("global_window")
    idx = transpose_slots(layout)
    lt = transposed(layout)
    vals = np.arange(layout.q_len * layout.nnz_max, dtype=np.float64)
    flat = np.concatenate([vals, [0.0]])
    got = flat[idx]
    tcols = lt.slot_columns()
    rows, slots = np.nonzero(tcols >= 0)
    # value (i, j) lives at row i of the original at the slot whose column is j
    ocols = layout.slot_columns()
    for r, t in list(zip(rows, slots, strict=True))[:200]:
        i = tcols[r, t]
        (slot,) = np.nonzero(ocols[i] == r)
        assert got[r, t] == i * layout.nnz_max + slot[0]
    assert np.all(got[tcols < 0] == 0)


@pytest.mark.parametrize("name", ["global_window", "dilated", "window"])
@pytest.mark.parametrize("loop", ["fused", "split", "single"])
def test_fused_walk_variants(name, loop):
    """Each tile walk (fused run-time edge test, split runs, single masked loop) and
    heaviest-row-blocks-first launch order."""
    sq = 256
    layout = acsr.from_dense(_mask(name, sq, sq), block=(16, 16))
    mask = layout.to_dense()
    tiles = (*TILES, loop)
    p = plan("fwd", layout, dtype="float32", head_dim=16, num_heads=2, num_kv_heads=1, tiles=tiles)
    assert p.spec.loop == loop
    # global rows walk all 256 columns, window row blocks ~60: their row block goes first
    assert p.spec.ordered is (name == "global_window")
    q, k, v, do = _inputs(layout, seed=21)
    scale = 0.25
    out, lse = run_numpy(
        ops.fwd_call(layout, q.shape, k.shape, "float32", scale, tiles=tiles, interpret=True), q, k, v
    )
    cq, ck = ops.bwd_calls(layout, q.shape, k.shape, "float32", scale, tiles=(tiles, tiles), interpret=True)
    dq, delta = run_numpy(cq, q, k, v, do, out, lse)
    dk, dv = run_numpy(ck, q, k, v, do, lse, delta)
    r_out, _, _ = _ref_fwd(q, k, v, mask, scale)
    _close(out, r_out, 1e-5, "out")
    for got, want, what in zip(
        (dq, dk, dv), _ref_bwd(q, k, v, mask, scale, do), ("dq", "dk", "dv"), strict=True
    ):
        _close(got, want, 1e-5, what)
