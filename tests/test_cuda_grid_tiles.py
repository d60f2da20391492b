"""The CUDA grid forward's tiles and source on CPU (``jax_bindings._cuda.grid_tiles``).

The tables are checked against the layout's own windows: every query of the grid lies in
exactly one patch (a strided box of one phase), every key a patch's queries see lies in the
patch's walked tiles on the patch's phase, and the tiles marked interior are seen by every
query of the patch. The generated grid kernels compile for sm_90a without spills where a
compiler is found; bad combinations are refused by name. Numerics: ``test_cuda_grid_gpu.py``.
"""

from __future__ import annotations

import itertools
import math
import re

import numpy as np
import pytest
from cuda_cases import GRID_CASES, GRID_SHAPE_CASES

from jax_bindings._cuda import grid_tiles, plan
from jax_bindings._cuda import source as gen
from splat import masks

PLAN_CASES = [(g, k, kw) for g, k, kw, _, _ in GRID_CASES] + [
    ((128, 128), 15, {}),
    ((128, 128), 63, {}),
    ((16, 32, 32), (5, 9, 9), {"is_causal": (True, False, False)}),
    ((100, 60), (7, 5), {"dilation": (3, 2)}),
]


def _tables(p: grid_tiles.GridPlan):
    t = p.tiles
    patches = p.tables[: 3 * t.pmax * 8].reshape(3, t.pmax, 8)
    windows = p.tables[3 * t.pmax * 8 :].reshape(3, t.nmax, 2)
    return patches, windows


@pytest.mark.parametrize(("grid", "kernel", "kw"), PLAN_CASES, ids=lambda x: str(x).replace(" ", ""))
def test_patches_cover_the_grid_and_tiles_cover_the_windows(grid, kernel, kw):
    layout = masks.neighborhood(grid, kernel, **kw).to_acsr()
    _check_tables(layout, grid_tiles.grid_plan(layout.grid))


@pytest.mark.parametrize(("case", "shape"), GRID_SHAPE_CASES, ids=lambda x: str(x).replace(" ", ""))
def test_forced_shapes_give_tables_as_good(case, shape):
    grid, kernel, kw = case
    layout = masks.neighborhood(grid, kernel, **kw).to_acsr()
    p = grid_tiles.grid_plan(layout.grid, shape)
    assert (p.tiles.q_tile, p.tiles.k_tile) == shape
    _check_tables(layout, p)


def test_a_bad_forced_shape_is_named():
    windows = masks.neighborhood((16, 20), 5).to_acsr().grid
    for bad in [((1, 8, 8), (1, 8, 16)), ((1, 8, 16), (1, 3, 12)), ((1, 8, 16), (1, 1, 200)), (1, 2)]:
        with pytest.raises(ValueError, match="shape must be"):
            grid_tiles.grid_plan(windows, bad)


def _check_tables(layout, p: grid_tiles.GridPlan) -> None:
    """Every query in exactly one patch, every key a query sees in its patch's walked tiles on
    its phase, the tiles marked interior seen by every query of the patch."""
    t = p.tiles
    assert p.tables.dtype == np.int32 and not p.tables.flags.writeable
    assert math.prod(t.q_tile) == grid_tiles.ROWS and t.k_tile[2] % 8 == 0 and t.block_n % 16 == 0
    patches, windows = _tables(p)
    axes = (None,) * (3 - len(layout.grid.axes)) + tuple(layout.grid.axes)
    for a in range(3):
        n, d, q, k = t.grid[a], t.dilation[a], t.q_tile[a], t.k_tile[a]
        seen = []
        for j in range(t.patches[a]):
            q_start, first, n_tiles, lo, hi = patches[a, j, :5].tolist()
            queries = [x for x in range(q_start, q_start + d * q, d) if x < n]
            seen += queries
            keys = set(range(first, first + n_tiles * k * d, d))
            inner = None
            for x in queries:
                wf, we = windows[a, x]
                want = set(range(n)) if axes[a] is None else set(np.flatnonzero(axes[a].dense()[x]).tolist())
                assert want == set(range(wf, we, d)) & set(range(n)) or axes[a] is None
                assert want <= keys, f"axis {a} patch {j}: query {x}'s keys are not all walked"
                inner = want if inner is None else inner & want
            for i in range(lo, hi):  # interior tiles: seen by every query of the patch
                tile = set(range(first + i * k * d, first + (i + 1) * k * d, d))
                assert tile <= inner, f"axis {a} patch {j}: tile {i} is marked interior"
        assert sorted(seen) == list(range(n)), f"axis {a}: every query in exactly one patch"


def test_the_benchmark_grids_get_the_modelled_tiles():
    """128x128 with 15x15: 8x16 patches, 22x8 key tiles (4 a patch: 704 keys for a 22x30 box);
    3-D (5, 9, 9): 2x8x8 patches."""
    tiles = grid_tiles.grid_plan(masks.neighborhood((128, 128), 15).to_acsr().grid).tiles
    assert (tiles.q_tile, tiles.k_tile, tiles.n_patches) == ((1, 8, 16), (1, 22, 8), 128)
    layout = masks.neighborhood((16, 32, 32), (5, 9, 9), is_causal=(True, False, False)).to_acsr()
    assert grid_tiles.grid_plan(layout.grid).tiles.q_tile == (2, 8, 8)


def test_long_walks_take_heads_in_sections():
    """Patches walking > GRID_SECTION_MIN_KEYS keys (63x63) take a few heads at a time; shorter
    walks (15x15, 3-D) interleave every head."""
    long = plan.fwd_variant(masks.neighborhood((128, 128), 63).to_acsr(), 128, "bfloat16")
    short = plan.fwd_variant(masks.neighborhood((128, 128), 15).to_acsr(), 128, "bfloat16")
    assert long.section_bytes == plan.GRID_SECTION_BYTES and short.section_bytes == 0
    assert f"constexpr int SECTION_BYTES = {plan.GRID_SECTION_BYTES};" in long.named_source()[1]
    assert "constexpr int SECTION_BYTES = 0;" in short.named_source()[1]


def test_refusals_name_why():
    big = masks.neighborhood((60, 60), 5, dilation=9).to_acsr()
    assert big.grid is not None
    with pytest.raises(NotImplementedError, match="dilation 9"):
        grid_tiles.grid_plan(big.grid)
    layout = masks.neighborhood((16, 20), 5).to_acsr()
    with pytest.raises(NotImplementedError, match="runtime mask"):
        plan.fwd_variant(layout, 128, "bfloat16", "ids")
    with pytest.raises(NotImplementedError, match="head dim"):
        plan.fwd_variant(layout, 80, "bfloat16")
    with pytest.raises(NotImplementedError, match="grid layout"):
        plan.bwd_variant(layout, 128, "bfloat16")


def test_bad_grid_source_arguments_are_named():
    tiles = grid_tiles.grid_plan(masks.neighborhood((16, 20), 5).to_acsr().grid).tiles
    with pytest.raises(ValueError, match="no band"):
        gen.source(1023, 0, block_n=tiles.block_n, grid=tiles)
    with pytest.raises(ValueError, match="block_n"):
        gen.source(None, None, block_n=tiles.block_n + 16, schedule="strided", grid=tiles)
    with pytest.raises(ValueError, match="runtime"):
        gen.source(None, None, block_n=tiles.block_n, schedule="strided", grid=tiles, runtime="lengths")


def test_the_grid_kernel_takes_its_tables_after_the_templates():
    variant = plan.fwd_variant(masks.neighborhood((16, 20), 5).to_acsr(), 128, "bfloat16")
    _, text = variant.named_source()
    assert "const uint8_t* __restrict__ tmap_templates,\n    SPLAT_FWD_TABLES int Sq," in text
    params = text[text.index("#define SPLAT_FWD_TABLES ") :].split("\n", 1)[0].split(",")
    first = params[0].removeprefix("#define SPLAT_FWD_TABLES ").strip()
    assert first == "const int* __restrict__ grid_tables"
    assert "constexpr bool GRID = true;" in text
    band = gen.source(None, 0)
    assert "constexpr bool GRID = false;" in band and "const int* grid_tables = nullptr;" in band
    placeholders = set(re.findall(r"__[A-Z][A-Z_0-9]*__", text)) - {"__CUDACC_RTC__"}
    assert not placeholders, f"template placeholders left unfilled: {placeholders}"


@pytest.mark.parametrize(
    ("case", "dtype"),
    list(itertools.product(PLAN_CASES[-4:-1], ["bfloat16"])) + [(PLAN_CASES[2], "float16")],
    ids=lambda x: str(x).replace(" ", ""),
)
def test_grid_variants_compile_without_spills(cuda_compiler, case, dtype):
    grid, kernel, kw = case
    variant = plan.fwd_variant(masks.neighborhood(grid, kernel, **kw).to_acsr(), 128, dtype)
    image, log = cuda_compiler.compile(variant.named_source()[1], verbose=True)
    assert image[:4] == b"\x7fELF" and "warning" not in log.lower(), log
    assert int(re.search(r"(\d+) bytes spill stores", log).group(1)) <= 16, log
    assert int(re.search(r"Used (\d+) registers", log).group(1)) <= 168, log
