"""The spatial-tile grid kernels (N-D neighborhoods), run by Triton's CPU interpreter.

Forward, dq and dk/dv of grid layouts (1-D to 3-D grids, even kernels, strides, dilations
that do not divide the axis, causal axes, GQA, fully masked rows, fp16/bf16) against the
float64 reference of the layout's dense mask.
"""

from __future__ import annotations

import numpy as np
import pytest
from reference import attention_grads_ref, attention_ref
from test_triton_kernels import _close, _inputs

import acsr
from jax_bindings._triton import ops
from jax_bindings._triton.grid_plan import grid_plan
from jax_bindings._triton.launch import run_numpy
from splat import masks

CASES = [
    ((6, 10), (5, 3), {}),
    ((7, 9), (6, 4), {}),  # even kernels
    ((12, 11), (5, 3), {"dilation": (2, 3)}),  # 3 does not divide 11
    ((9, 11), (5, 3), {"stride": (2, 3)}),
    ((8, 12), (5, 5), {"is_causal": (True, False)}),
    ((4, 5, 6), (3, 3, 5), {"is_causal": (True, False, False)}),
    ((3, 6, 6), (2, 3, 3), {"dilation": (1, 2, 1), "stride": (1, 1, 2)}),
    ((16, 16), (15, 15), {}),  # key tiles inside every window: the unmasked branch
]


def _run(layout, q, k, v, do, scale):
    dt = q.dtype.name
    out, lse = run_numpy(ops.fwd_call(layout, q.shape, k.shape, dt, scale, interpret=True), q, k, v)
    cq, ck = ops.bwd_calls(layout, q.shape, k.shape, dt, scale, interpret=True)
    dq, delta = run_numpy(cq, q, k, v, do, out, lse)
    dk, dv = run_numpy(ck, q, k, v, do, lse, delta)
    return out, lse, dq, dk, dv


@pytest.mark.parametrize(("grid", "kernel", "kw"), CASES)
def test_grid_kernels_match_the_reference(grid, kernel, kw):
    layout = masks.neighborhood(grid, kernel, **kw).to_acsr()
    assert layout.grid is not None, "the case must exercise a grid layout"
    q, k, v, do = _inputs(layout, seed=sum(grid), B=2, H=4, Hkv=2)
    mask, scale = layout.to_dense(), 0.3
    out, lse, dq, dk, dv = _run(layout, q, k, v, do, scale)
    r_out, r_lse = attention_ref(q, k, v, mask, scale)
    _close(out, r_out, 1e-5, "out")
    _close(lse, r_lse, 1e-5, "lse")
    grads = attention_grads_ref(q, k, v, mask, scale, do)
    for got, want, what in zip((dq, dk, dv), grads, ("dq", "dk", "dv"), strict=True):
        _close(got, want, 1e-5, what)


def test_fully_masked_rows_give_zero_and_zero_gradients():
    """A grid product whose windows are empty on some coordinates (hand-built tables)."""
    n = 8
    first = np.clip(np.arange(n) - 2, 0, n - 5)
    count = np.where(np.arange(n) == 5, 0, 5)  # coordinate 5 sees nothing on this axis
    axis = acsr.canonical_axis(n, 1, first, count)
    inner = acsr.canonical_axis(9, 1, np.clip(np.arange(9) - 2, 0, 4), np.full(9, 5))
    w = acsr.GridWindows((axis, inner))
    layout = acsr.from_grid(w)
    assert layout.grid is not None
    q, k, v, do = _inputs(layout, seed=5, B=1, H=2, Hkv=1)
    out, lse, dq, dk, dv = _run(layout, q, k, v, do, 0.25)
    empty = ~layout.to_dense().any(-1)
    assert empty.sum() == 9
    assert not out[0][empty].any() and not dq[0][empty].any()
    assert np.all(np.isneginf(lse[0][:, empty]))
    r_dq, r_dk, r_dv = attention_grads_ref(q, k, v, layout.to_dense(), 0.25, do)
    _close(dk, r_dk, 1e-5, "dk")
    _close(dv, r_dv, 1e-5, "dv")


def test_half_precision():
    """fp16 here; bfloat16 runs with the gpu marker (the interpreter mis-rounds it, as for 1-D kernels)."""
    dt = np.float16
    layout = masks.neighborhood((6, 10), (5, 3), dilation=(1, 2)).to_acsr()
    q, k, v, do = _inputs(layout, seed=2, B=1, H=2, Hkv=1, dtype=dt)
    out, _, dq, dk, dv = _run(layout, q, k, v, do, 0.25)
    mask = layout.to_dense()
    _close(out, attention_ref(q, k, v, mask, 0.25)[0], 3e-2, "out")
    grads = attention_grads_ref(q, k, v, mask, 0.25, do)
    for got, want, what in zip((dq, dk, dv), grads, ("dq", "dk", "dv"), strict=True):
        _close(got, want, 8e-2, what)


def test_plan_tiles_cover_the_grid_with_patches():
    """128x128, kernel 15: 8x8 query patches (the smallest key box per query), 8x8 key tiles."""
    layout = masks.neighborhood((128, 128), 15).to_acsr()
    p = grid_plan("fwd", layout.grid, "bfloat16", 128, 16, 16)
    assert p.spec.q_tile == (1, 8, 8) and p.spec.block_m == 64
    assert p.spec.k_tile == (1, 8, 8)
    assert p.row_blocks == 16 * 16
    assert all(m.dtype == np.int32 for m in p.meta)
    # every query appears in exactly one patch
    qc = p.meta[0]
    for a, n in enumerate(p.spec.grid):
        got = qc[a][qc[a] >= 0]
        assert sorted(got.tolist()) == list(range(n))


def test_grid_layouts_refuse_runtime_masks_and_tiles():
    layout = masks.neighborhood((6, 10), (5, 3)).to_acsr()
    shape = (1, 60, 2, 16)
    with pytest.raises(NotImplementedError, match="runtime mask"):
        ops.fwd_call(layout, shape, shape, "float32", 0.25, interpret=True, runtime="ranges")
    with pytest.raises(ValueError, match="tiles cannot be given"):
        ops.fwd_call(layout, shape, shape, "float32", 0.25, interpret=True, tiles=(64, 64, 4, 2))


# -- on a real GPU (pytest -m gpu) ------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("grid", "kernel", "kw", "H", "Hkv", "D", "dtype"),
    [
        ((16, 20), (7, 5), {}, 2, 1, 128, "bfloat16"),
        ((20, 24), (17, 19), {}, 2, 2, 256, "bfloat16"),
        ((24, 24), (7, 7), {"dilation": 2}, 4, 2, 64, "float16"),
        ((6, 12, 12), (3, 5, 5), {"is_causal": (True, False, False)}, 2, 2, 128, "bfloat16"),
        ((15, 17), (6, 4), {"stride": (2, 3)}, 2, 2, 256, "float32"),
    ],
)
def test_grid_kernels_gpu(grid, kernel, kw, H, Hkv, D, dtype):
    jax = pytest.importorskip("jax")
    if jax.default_backend() != "gpu":
        pytest.skip("needs a CUDA GPU")
    import jax.numpy as jnp

    from jax_bindings._triton import backend as jt

    layout = masks.neighborhood(grid, kernel, **kw).to_acsr()
    assert layout.grid is not None
    rng = np.random.default_rng(sum(grid) + D)
    shapes = [
        (2, layout.q_len, H, D),
        (2, layout.q_len, Hkv, D),
        (2, layout.q_len, Hkv, D),
        (2, layout.q_len, H, D),
    ]
    q, k, v, do = (jnp.asarray(rng.standard_normal(s), dtype) for s in shapes)
    host = [np.asarray(x.astype(jnp.float32), np.float64) for x in (q, k, v, do)]
    scale, mask = D**-0.5, layout.to_dense()
    out, lse = jax.jit(lambda a, b, c: jt.attention_fwd(a, b, c, None, layout, scale))(q, k, v)
    grads = jax.jit(lambda *a: jt.attention_bwd(*a[:3], None, *a[3:], layout, scale))(q, k, v, out, lse, do)
    tol = {"float32": 2e-4, "float16": 6e-3, "bfloat16": 3e-2}[dtype]
    _close(np.asarray(out.astype(jnp.float32)), attention_ref(*host[:3], mask, scale)[0], tol, "out")
    want = attention_grads_ref(*host[:3], mask, scale, host[3])
    for got, ref, what in zip(grads, want, ("dq", "dk", "dv"), strict=True):
        _close(np.asarray(got.astype(jnp.float32)), ref, 2 * tol, what)
    again = jax.jit(lambda a, b, c: jt.attention_fwd(a, b, c, None, layout, scale))(q, k, v)[0]
    assert np.array_equal(np.asarray(again), np.asarray(out)), "reruns must be bit-identical"
