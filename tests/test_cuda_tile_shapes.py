"""The cuda kernels' tile shapes by head dim (``jax_bindings._cuda.tile_shapes``), on CPU.

Every head dim the forward takes gets a tile that fits shared memory, with its planned variants
(dense's long rows, causal's queue with segment ids, a window's strided schedule shifted to a
chunk, the soft cap) compiling for sm_90a with NVRTC within the registers ``setmaxnreg`` leaves
and at most a few bytes spilled (at 192 and 256, with segment ids or the cap: a bounded few more); so do the
backward's at the head dims it takes, the cap included. The head dim, its padded tile width and
the cap are baked into the variant's constants; bad head dims and caps are refused by name.
Their numerics are checked on a GPU (``test_cuda_head_dims_gpu.py``).
"""

from __future__ import annotations

import re

import pytest

from jax_bindings._cuda import bwd_source, plan, source, tile_shapes
from splat import masks


@pytest.mark.parametrize("head_dim", tile_shapes.HEAD_DIMS)
@pytest.mark.parametrize("rows", ["band", "long"])
def test_every_head_dim_has_a_tile_that_fits(head_dim, rows):
    tile = tile_shapes.fwd_tile(head_dim, "bfloat16", rows)
    assert tile.padded % 64 == 0 and 0 <= tile.padded - head_dim < 64
    assert tile.block_n % 16 == 0 and tile.fits("ids", 1, "tma")


def test_the_tiles_take_what_shared_memory_holds_and_no_more():
    assert source.padded_head_dim(96) == 128 and source.padded_head_dim(192) == 192
    # a key tile of 128 at head dim 256 needs more shared memory than a CTA has
    assert not tile_shapes.FwdTile(256, 128).fits()
    assert tile_shapes.FwdTile(256, 64).smem() < tile_shapes.FwdTile(256, 80).smem() <= source.SMEM_LIMIT
    # the backward: two Q/dO and two dQ buffers up to 128 columns; the wide kernel (items of 64
    # keys) at 192 with one dQ buffer, at 256 with one of each: a second of either would not fit
    for d in (64, 128):
        tile = tile_shapes.bwd_tile(d, "bfloat16")
        assert (tile.block_n, tile.stages, tile.dq_buffers) == (128, 2, 2)
    wide = tile_shapes.bwd_tile(256, "bfloat16")
    assert (wide.block_n, wide.stages, wide.dq_buffers) == (64, 1, 1) and wide.smem() <= source.SMEM_LIMIT
    assert bwd_source.smem_bytes(2, 256, 1) > source.SMEM_LIMIT < bwd_source.smem_bytes(1, 256, 2)
    with pytest.raises(ValueError, match="shared memory"):
        bwd_source.program(None, 0, head_dim=256, stages=2, dq_buffers=1)
    mid = tile_shapes.bwd_tile(192, "bfloat16")
    assert (mid.block_n, mid.stages, mid.dq_buffers) == (64, 2, 1) and mid.smem() <= source.SMEM_LIMIT
    assert bwd_source.smem_bytes(2, 192, 2) > source.SMEM_LIMIT


@pytest.mark.parametrize("head_dim, dtype, why", [(80, "bfloat16", "head dims"), (128, "float32", "dtypes"),
                                                  (272, "bfloat16", "head dims")])
def test_calls_the_kernels_do_not_take_are_refused_by_name(head_dim, dtype, why):
    layout = masks.causal().to_acsr(256)
    for variant in (plan.fwd_variant, plan.bwd_variant):
        with pytest.raises(NotImplementedError, match=why):
            variant(layout, head_dim, dtype)


@pytest.mark.parametrize("kwargs, name", [(dict(head_dim=100), "head_dim"), (dict(head_dim=272), "head_dim"),
                                          (dict(head_dim=True), "head_dim"), (dict(soft_cap=0.0), "soft_cap"),
                                          (dict(soft_cap=float("inf")), "soft_cap"),
                                          (dict(soft_cap="30"), "soft_cap")])
def test_bad_head_dims_and_caps_are_named(kwargs, name):
    with pytest.raises(ValueError, match=name):
        source.program(255, 0, **kwargs)


def _planned(head_dim):
    """The planned forward variants at ``head_dim`` that differ in what the tile holds: dense's
    long rows, causal's queue with segment ids, a causal window shifted to a chunk with a cap."""
    n = 1024
    return {
        "dense": plan.fwd_variant(masks.full().to_acsr(n), head_dim, "bfloat16"),
        "causal-ids": plan.fwd_variant(masks.causal().to_acsr(n), head_dim, "float16", "ids"),
        "window-shifted-cap": plan.fwd_variant(masks.sliding_window(255, 0).to_acsr(n), head_dim, "bfloat16",
                                               "lengths", shifted=True, soft_cap=30.0),
    }


@pytest.mark.parametrize("head_dim", [d for d in tile_shapes.HEAD_DIMS if d != 128])
def test_planned_variants_compile_at_every_head_dim(cuda_compiler, head_dim):
    """Every planned form at the narrowest and widest head dims; the capped window at the others
    (their tiles differ in width only)."""
    for what, variant in _planned(head_dim).items():
        if head_dim not in (64, 256) and what != "window-shifted-cap":
            continue
        text = variant.named_source()[1]
        assert f"constexpr int HEAD_DIM = {head_dim};" in text, what
        assert f"constexpr int HD = {source.padded_head_dim(head_dim)};" in text, what
        assert ("constexpr float SOFT_CAP = 30.0f;" in text) == what.endswith("cap"), what
        assert variant.smem <= source.SMEM_LIMIT, what
        image, log = cuda_compiler.compile(text, verbose=True)
        assert image[:4] == b"\x7fELF", what
        assert "warning" not in log.lower(), (what, log)
        # at 192 and 256 the 96-128 output accumulators leave little room: walks by segment ids and
        # the soft cap spill some state (56-168 bytes with NVRTC 13; the capped forward measured
        # 3.9x FlexAttention at 256 all the same): bounded, so that more shows
        limit = 16 if head_dim <= 128 else 192
        assert int(re.search(r"(\d+) bytes spill stores", log).group(1)) <= limit, (what, log)
        assert int(re.search(r"Used (\d+) registers", log).group(1)) <= 168, (what, log)


@pytest.mark.parametrize("head_dim", tile_shapes.BWD_HEAD_DIMS)
def test_backward_variants_compile_at_every_head_dim_it_takes(cuda_compiler, head_dim):
    """The backward's producer spills some of its item state (``test_cuda_source``); the soft cap's
    derivative, held per element until dS, spills some more at 96 and 128 (a bounded 248-324 bytes
    with NVRTC 13). At 256 the wide kernel holds dK, dV and dQ accumulators of 64 values each."""
    # every runtime kind with and without the cap at 64; the capped ids walk (the most state) at
    # the others, and the plain band at 256 (the wide kernel)
    for runtime, cap in ((r, c) for r in ("", "ids") for c in (None, 30.0)
                         if head_dim == 64 or (r, c) == ("ids", 30.0) or (head_dim, r, c) == (256, "", None)):
        layout = masks.causal().to_acsr(1024)
        variant = plan.bwd_variant(layout, head_dim, "bfloat16", runtime, cap)
        text = variant.named_source()[1]
        assert f"constexpr int HEAD_DIM = {head_dim};" in text
        assert variant.smem <= source.SMEM_LIMIT
        image, log = cuda_compiler.compile(text, verbose=True)
        assert image[:4] == b"\x7fELF" and "warning" not in log.lower(), log
        limit = 192 if cap is None else 336
        assert int(re.search(r"(\d+) bytes spill stores", log).group(1)) <= limit, log
        assert int(re.search(r"Used (\d+) registers", log).group(1)) <= 168, log
