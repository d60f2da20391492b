"""The CUDA forward on grid layouts (N-D neighborhoods, spatial tiles) on a real Hopper GPU:
``pytest -m gpu``.

Skipped where the cuda backend cannot run. 1-D to 3-D grids, even kernels, strides, dilations
(one that does not divide its axis), causal axes, windows with key tiles inside every window
(the unmasked path), fully masked rows, GQA, bf16 and fp16, against the float64 reference of
the layout's dense mask; reruns bit-identical; under ``backend="auto"`` the forward runs here
and the gradients come from the next backend, all exact.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cuda_cases import GRID_CASES, GRID_SHAPE_CASES
from reference import assert_close, attention_dense, attention_ref

import acsr
from jax_bindings import _registry
from splat import masks

pytestmark = pytest.mark.gpu

if _registry.unavailable("cuda") is not None:
    pytest.skip(f"the cuda backend cannot run here: {_registry.unavailable('cuda')}", allow_module_level=True)

from test_cuda_gpu import assert_auto_forward_here_and_exact  # noqa: E402

from jax_bindings._cuda import backend as cb  # noqa: E402
from jax_bindings._cuda import grid_tiles, plan  # noqa: E402


def _id(case) -> str:
    grid, kernel, kw, h, hk = case
    extra = "-".join(f"{k}{v}" for k, v in kw.items())
    return f"{'x'.join(map(str, grid))}-k{kernel}{'-' + extra if extra else ''}-h{h}/{hk}".replace(" ", "")


def _inputs(seed, s, h, hk, dtype, b=2, d=128):
    rng = np.random.default_rng(seed)
    q, do = (jnp.asarray(rng.standard_normal((b, s, h, d)), dtype) for _ in range(2))
    k, v = (jnp.asarray(rng.standard_normal((b, s, hk, d)), dtype) for _ in range(2))
    return q, k, v, do


def _forward(layout, scale):
    return jax.jit(lambda q, k, v: cb.attention_fwd(q, k, v, None, layout, scale))


def _check(layout, q, k, v, scale, dtype):
    out, lse = _forward(layout, scale)(q, k, v)
    ref_out, ref_lse = attention_ref(q, k, v, layout, scale)
    assert out.dtype == q.dtype and out.shape == q.shape and lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    assert_close("out", out, ref_out, dtype, attention_dense(q, k, v, layout, scale))
    lse = np.asarray(lse, np.float64)
    empty = ~layout.to_dense().any(1)
    assert np.all(np.isneginf(lse[:, :, empty])), "a fully masked row must have lse -inf"
    assert np.all(np.asarray(out, np.float32)[:, empty] == 0), "a fully masked row must output 0"
    assert np.abs(lse[:, :, ~empty] - ref_lse[:, :, ~empty]).max() < 2e-2
    return out, lse


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("case", GRID_CASES, ids=[_id(c) for c in GRID_CASES])
def test_grid_forward_matches_the_float64_reference(case, dtype):
    grid, kernel, kw, h, hk = case
    layout = masks.neighborhood(grid, kernel, **kw).to_acsr()
    assert layout.grid is not None, "the case must exercise a grid layout"
    assert isinstance(plan.fwd_variant(layout, 128, jnp.dtype(dtype).name), plan.GridFwdVariant)
    q, k, v, _ = _inputs(sum(grid), layout.q_len, h, hk, dtype)
    _check(layout, q, k, v, 128**-0.5, dtype)


@pytest.mark.parametrize(("case", "shape"), GRID_SHAPE_CASES, ids=lambda x: str(x).replace(" ", ""))
def test_forced_shapes_where_warpgroups_skip_tiles(monkeypatch, case, shape):
    """Tile shapes the planner may not pick, where one warpgroup skips tiles the other walks."""
    grid, kernel, kw = case
    layout = masks.neighborhood(grid, kernel, **kw).to_acsr()
    planned = grid_tiles.grid_plan
    monkeypatch.setattr(grid_tiles, "grid_plan", lambda windows: planned(windows, shape))
    assert plan.fwd_variant(layout, 128, "bfloat16").tiles.k_tile == shape[1]
    q, k, v, _ = _inputs(sum(grid), layout.q_len, 2, 1, jnp.bfloat16)
    _check(layout, q, k, v, 128**-0.5, jnp.bfloat16)


def test_sections_of_one_head(monkeypatch):
    """The strided schedule in sections of one (batch, head) (at the benchmark's length on long
    walks, four at a time), with GQA and two batch rows."""
    monkeypatch.setattr(plan, "GRID_SECTION_BYTES", 1)
    monkeypatch.setattr(plan, "GRID_SECTION_MIN_KEYS", 0)
    layout = masks.neighborhood((24, 40), (7, 9), dilation=(1, 2)).to_acsr()
    variant = plan.fwd_variant(layout, 128, "bfloat16")
    assert variant.section_bytes == 1
    q, k, v, _ = _inputs(11, layout.q_len, 4, 2, jnp.bfloat16)
    _check(layout, q, k, v, 128**-0.5, jnp.bfloat16)


def test_fully_masked_rows_give_zero():
    """A grid product whose windows are empty on one coordinate (hand-built tables)."""
    n = 8
    axis = acsr.canonical_axis(n, 1, np.clip(np.arange(n) - 2, 0, n - 5), np.where(np.arange(n) == 5, 0, 5))
    inner = acsr.canonical_axis(24, 1, np.clip(np.arange(24) - 2, 0, 19), np.full(24, 5))
    layout = acsr.from_grid(acsr.GridWindows((axis, inner)))
    assert layout.grid is not None
    q, k, v, _ = _inputs(5, layout.q_len, 2, 1, jnp.bfloat16)
    _check(layout, q, k, v, 0.25, jnp.bfloat16)


def test_reruns_are_bit_identical():
    layout = masks.neighborhood((40, 48), 15).to_acsr()
    q, k, v, _ = _inputs(7, layout.q_len, 4, 2, jnp.bfloat16)
    f = _forward(layout, 0.1)
    first = [np.asarray(x) for x in f(q, k, v)]
    for _ in range(2):
        again = [np.asarray(x) for x in f(q, k, v)]
        assert all(np.array_equal(a, b) for a, b in zip(first, again, strict=True))


def test_the_plan_of_the_benchmark_grids():
    """128x128 with a 15x15 window: 8x16 query patches, key tiles of 176 keys (4 a patch)."""
    layout = masks.neighborhood((128, 128), 15).to_acsr()
    tiles = grid_tiles.grid_plan(layout.grid).tiles
    assert tiles.q_tile == (1, 8, 16) and tiles.block_n == 176 and tiles.n_patches == 128


def test_auto_runs_the_forward_here_and_the_gradients_elsewhere():
    layout = masks.neighborhood((20, 24), (7, 5), dilation=(1, 2)).to_acsr()
    q, k, v, do = _inputs(3, layout.q_len, 4, 2, jnp.bfloat16)
    assert_auto_forward_here_and_exact(layout, q, k, v, do, 128**-0.5)


def test_the_public_neighborhood_api_reaches_the_kernel():
    import splat

    rng = np.random.default_rng(1)
    q, k, v = (jnp.asarray(rng.standard_normal((1, 24, 32, 2, 128)), jnp.bfloat16) for _ in range(3))
    got = splat.neighborhood_attention(q, k, v, (7, 9), backend="cuda")
    ref = splat.neighborhood_attention(q, k, v, (7, 9), backend="triton")
    assert np.abs(np.asarray(got, np.float32) - np.asarray(ref, np.float32)).max() < 3e-2
