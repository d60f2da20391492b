"""Grid masks in the tools: catalogue, FlexAttention's predicate, bench at the grid's S, grid form, CLI."""

from __future__ import annotations

import json
import math

import jax
import numpy as np
import pytest

import splat
from splat import catalogue, masks
from splat.tools import bench, grid_view, mask_forms
from splat.tools.peers import PEERS, PeerUnavailable, Problem

# (grid, kernel_size, stride, dilation, is_causal): 1-D to 3-D, strides with short last groups,
# dilations that do not divide the axis, causal on some axes only, kernel == axis
PREDICATE_CASES = [
    ((13,), 5, 1, 1, False),
    ((17,), 3, 2, 5, True),
    ((11,), 5, 3, 1, False),
    ((7, 9), 3, 1, 1, False),
    ((8, 10), (3, 5), (2, 3), 1, False),
    ((9, 10), 3, 1, (2, 3), False),
    ((7, 9), (3, 9), 1, 1, False),
    ((10, 11), (3, 4), (2, 4), (3, 2), (True, False)),
    ((7, 9), (4, 5), (3, 2), 1, (False, True)),
    ((3, 4, 5), 3, 1, 1, False),
    ((4, 5, 6), (3, 2, 3), (1, 2, 3), (1, 2, 1), (True, False, True)),
    ((5, 6, 7), (3, 3, 5), 1, 1, (True, False, False)),
]


def _case_mask(case):
    grid, k, s, d, c = case
    return masks.neighborhood(grid, k, stride=s, dilation=d, is_causal=c)


# --- the catalogue ------------------------------------------------------------------------------


def test_grid_catalogue_patterns():
    assert set(catalogue.GRID) == set(catalogue.GRID_SMALL)
    assert {n: m.size for n, m in catalogue.GRID.items()} == dict.fromkeys(catalogue.GRID, 16384)
    nb = catalogue.GRID
    assert nb["neighborhood_2d"] == masks.neighborhood((128, 128), (15, 15))
    assert nb["neighborhood_2d_k63"].kernel_size == (63, 63)
    # the dilated pattern and its undilated twin: same kernel, same number of keys
    assert nb["neighborhood_2d_dilated"].dilation == (2, 2) and nb["neighborhood_2d_k7"].dilation == (1, 1)
    assert nb["neighborhood_2d_dilated"].to_acsr().nnz == nb["neighborhood_2d_k7"].to_acsr().nnz
    assert nb["neighborhood_3d"].grid == (16, 32, 32) and nb["neighborhood_3d"].kernel_size == (5, 9, 9)
    assert nb["neighborhood_3d"].is_causal == (True, False, False)
    for name, small in catalogue.GRID_SMALL.items():
        big = catalogue.GRID[name]
        assert len(small.grid) == len(big.grid) and small.is_causal == big.is_causal
        assert (max(small.dilation) > 1) == (max(big.dilation) > 1) and small.size < 256
    assert catalogue.named("neighborhood_3d") is nb["neighborhood_3d"]
    assert catalogue.suite() == [*catalogue.BENCH, *catalogue.GRID]
    assert [n for n, _ in bench.resolve_patterns(None)] == catalogue.suite()


# --- FlexAttention's mask_mod: the neighborhood from flattened indices ---------------------------------


@pytest.mark.parametrize("case", PREDICATE_CASES, ids=str)
def test_neighborhood_expression_equals_the_layout(case):
    """The operator-only predicate (FlexAttention's mask_mod) against the ACSR layout, densely.

    numpy runs the very function FlexAttention gets; torch too, where it can be imported.
    """
    m = _case_mask(case)
    s = m.size
    want = m.to_acsr().to_dense()
    f = mask_forms.mask_expression(m)
    q, kv = np.arange(s)[:, None], np.arange(s)[None, :]
    np.testing.assert_array_equal(np.broadcast_to(f(q, kv), (s, s)), want)
    try:
        import torch
    except ImportError:
        return
    got = f(torch.arange(s)[:, None], torch.arange(s)[None, :])
    np.testing.assert_array_equal(np.broadcast_to(got.numpy(), (s, s)), want)


def test_neighborhood_expression_in_combinations():
    m = catalogue.GRID_SMALL["neighborhood_2d"] | masks.global_tokens(2)
    s = catalogue.GRID_SMALL["neighborhood_2d"].size
    got = mask_forms.mask_expression(m)(np.arange(s)[:, None], np.arange(s)[None, :])
    np.testing.assert_array_equal(np.broadcast_to(got, (s, s)), m.to_acsr(s, s).to_dense())


def test_band_of_is_none_for_grid_layouts():
    for m in catalogue.GRID_SMALL.values():
        assert mask_forms.band_of(m.to_acsr()) is None
    assert mask_forms.flash_attn3_arguments(catalogue.GRID_SMALL["neighborhood_2d"].to_acsr()) is None


def test_cudnn_dense_peer_is_gpu_only_and_takes_any_mask():
    assert PEERS["cudnn_dense"].gpu_only and not PEERS["cudnn_dense"].no_check
    if jax.default_backend() == "gpu":
        pytest.skip("this checks the CPU skip path")
    m = catalogue.GRID_SMALL["neighborhood_2d"]
    rng = np.random.default_rng(0)
    q, k, v, do = (rng.standard_normal((1, m.size, 2, 8), dtype=np.float32) for _ in range(4))
    problem = Problem(q, k, v, do, m, m.to_acsr(), "bfloat16", "fwd", "jax")
    with pytest.raises(PeerUnavailable, match="CUDA GPU"):
        PEERS["cudnn_dense"].prepare(problem)


# --- bench: a grid pattern runs at its grid's S ------------------------------------------------------


def test_pattern_lengths():
    window = masks.sliding_window(4)
    nb = catalogue.GRID_SMALL["neighborhood_2d"]
    assert bench.pattern_lengths("w", lambda s: window, (64, 96)) == [(64, window), (96, window)]
    assert bench.pattern_lengths("nb", lambda s: nb, (64, 96)) == [(nb.size, nb)]
    both = nb | masks.global_tokens(1)
    assert bench.pattern_lengths("nb_global", lambda s: both, (64,)) == [(nb.size, both)]
    bad = nb | masks.neighborhood((4, 4), 3)
    with pytest.raises(ValueError, match="pattern 'bad'.*exists at no sequence length"):
        bench.pattern_lengths("bad", lambda s: bad, (64,))


@pytest.fixture(scope="module")
def grid_bench():
    tiny = {
        "window": masks.sliding_window(3),
        "neighborhood_2d_dilated": catalogue.GRID_SMALL["neighborhood_2d_dilated"],
        "neighborhood_3d": catalogue.GRID_SMALL["neighborhood_3d"],
    }
    cfg = bench.BenchConfig(
        patterns=None,
        lengths=(32, 48),
        heads=2,
        head_dim=8,
        mode="fwd",
        peers=("splat", "dense_xla", "cudnn_dense", "flex"),
        warmup=0,
        repeats=1,
        build=True,
        build_length=256,
        analyze_length=140,
    )
    lines = []
    return bench.run_bench(cfg, tiny, log=lines.append), "\n".join(lines)


def test_bench_runs_grid_patterns_at_their_own_length(grid_bench):
    result, printed = grid_bench
    ran = {(r["pattern"], r["S"]) for r in result["results"]}
    assert ran == {
        ("window", 32),
        ("window", 48),
        ("neighborhood_2d_dilated", 132),  # 12 x 11, not the --lengths
        ("neighborhood_3d", 210),  # 5 x 6 x 7
    }
    assert result["settings"]["fixed_lengths"] == {"neighborhood_2d_dilated": 132, "neighborhood_3d": 210}
    assert "neighborhood_3d: a mask on a 5x6x7 grid exists only at S=210; run there" in printed
    nb = [r for r in result["results"] if r["pattern"] == "neighborhood_3d"]
    assert {r["impl"] for r in nb} == {"splat", "dense_xla"} and all(r["agrees"] for r in nb)
    want_nnz = int(catalogue.GRID_SMALL["neighborhood_3d"].to_acsr().nnz)
    assert nb[0]["nnz"] == want_nnz
    assert nb[0]["tflops"] == pytest.approx(bench.useful_flops(1, 2, want_nnz, 8, "fwd") / nb[0]["ms"] / 1e9)
    if jax.default_backend() != "gpu":  # the GPU peers say why they skip, per pattern
        reasons = {(s["pattern"], s["impl"]) for s in result["skipped"]}
        assert ("neighborhood_3d", "cudnn_dense") in reasons and ("neighborhood_3d", "flex") in reasons


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="the rule is for machines without a GPU")
def test_default_suite_skips_large_grids_without_a_gpu():
    big = {"window": masks.sliding_window(3), "big_grid": masks.neighborhood((72, 64), 3)}  # 4608 tokens
    cfg = bench.BenchConfig(patterns=None, lengths=(32,), heads=1, head_dim=8, mode="fwd",
                            peers=("splat",), warmup=0, repeats=1)  # fmt: skip
    lines = []
    result = bench.run_bench(cfg, big, log=lines.append)
    assert {r["pattern"] for r in result["results"]} == {"window"}
    said = "big_grid: grid pattern of the default suite skipped without a GPU: S=4608 > 4096"
    assert any(said in x for x in lines)


def test_bench_records_and_prints_the_grid_form(grid_bench, tmp_path):
    result, printed = grid_bench
    grids = {g["pattern"]: g for g in result["grid_masks"]}
    assert set(grids) == {"neighborhood_2d_dilated", "neighborhood_3d"}
    g = grids["neighborhood_3d"]
    assert g["grid"] == [5, 6, 7] and g["S"] == 210
    assert masks.parse(g["expression"]) == catalogue.GRID_SMALL["neighborhood_3d"]
    probes = {p["name"]: p for p in g["probes"]}
    assert probes["centre"]["query"] == [2, 3, 3] and probes["centre"]["keys"] == 3 * 3 * 5
    assert probes["corner"]["keys"] == 1 * 3 * 5  # t = 0 sees itself only (causal); shifted inside elsewhere
    assert probes["centre"]["axes"] == ["0..2", "2..4", "1..5"]
    assert "grid masks (run at their grid's S)" in printed
    assert "\n".join("  " + t for t in g["text"].splitlines()) in printed
    assert "(the same keys in every slice it sees; shown: its own, axis 0 = 2)" in g["text"]
    path = tmp_path / "r.json"
    bench.write_json(result, str(path))
    assert json.loads(path.read_text())["grid_masks"][1]["probes"] == g["probes"]


def test_build_section_builds_grid_patterns_at_their_length(grid_bench):
    rows = {r["pattern"]: r for r in grid_bench[0]["build"]["patterns"]}
    assert rows["window"]["length"] == 256 and rows["window"]["analyze_length"] == 140
    assert rows["neighborhood_3d"]["length"] == 210 and rows["neighborhood_3d"]["grid"] == [5, 6, 7]
    assert rows["neighborhood_3d"]["analyze_ms"] is None  # 210 > analyze_length 140
    assert "exists only at S=210" in rows["neighborhood_3d"]["analyze_skipped"]
    dilated = rows["neighborhood_2d_dilated"]
    assert dilated["analyze_length"] == 132 and dilated["analyze_nnz"] == dilated["nnz"]
    assert grid_bench[0]["build"]["cache_cleared"]


# --- grid form: text and pictures -----------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(catalogue.GRID_SMALL))
def test_key_pictures_are_the_layout_rows(name):
    m = catalogue.GRID_SMALL[name]
    dense = m.to_acsr().to_dense()
    for query in grid_view.probe_queries(m.grid).values():
        pic = grid_view.key_picture(m, m.grid, query)
        assert pic.shape == m.grid
        np.testing.assert_array_equal(pic.reshape(-1), dense[np.ravel_multi_index(query, m.grid)])


def test_probe_queries():
    assert grid_view.probe_queries((16, 32, 32)) == {
        "centre": (8, 16, 16),
        "corner": (0, 0, 0),
        "edge": (8, 16, 31),
    }
    assert grid_view.probe_queries((9,)) == {"centre": (4,), "corner": (0,), "edge": (8,)}


def test_grid_text_crops_or_pools():
    small = grid_view.grid_text(masks.neighborhood((9, 9), 3, dilation=2), probes={"c": (4, 4)})
    assert small.splitlines() == [
        "c query (4, 4) = token 40: 9 keys; axis 0: 2..6 step 2, axis 1: 2..6 step 2",
        "  the whole 9x9:",
        "  .........",
        "  .........",
        "  ..#.#.#..",
        "  .........",
        "  ..#.Q.#..",
        "  .........",
        "  ..#.#.#..",
        "  .........",
        "  .........",
    ]
    big = grid_view.grid_text(catalogue.GRID["neighborhood_2d_k63"], probes={"c": (64, 64)}).splitlines()
    assert big[1] == "  the whole 128x128, a character for 4x4 tokens, # where any is seen:"
    rows = [r.strip() for r in big[2:]]
    assert len(rows) == 32 and all(len(r) == 32 for r in rows)
    assert rows[16] == "........########Q#######........"  # keys 33..95 in cells of 4
    video = grid_view.grid_text(catalogue.GRID["neighborhood_3d"], probes={"c": (8, 16, 16)}).splitlines()
    assert video[0].endswith("405 keys; axis 0: 4..8, axis 1: 12..20, axis 2: 12..20")
    assert "the same keys in every slice it sees" in video[1]
    assert video[2] == "  rows 10..22, columns 10..22 of 32x32:"
    with pytest.raises(ValueError, match="lives on no token grid"):
        grid_view.grid_text(masks.causal())


def test_grid_figure_panels():
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from splat.tools.plot import grid_figure

    fig = grid_figure(catalogue.GRID_SMALL["neighborhood_2d"])
    images = [ax.images[0].get_array() for ax in fig.axes if ax.images]
    assert len(images) == 3 and all(im.shape == (12, 10) for im in images)  # centre, corner, edge
    assert [int((im == 1).sum() + (im == 2).sum()) for im in images] == [25, 25, 25]
    assert [int((im == 2).sum()) for im in images] == [1, 1, 1]  # the query, in red
    plt.close(fig)
    video = catalogue.GRID_SMALL["neighborhood_3d"]  # 5 x 6 x 7, kernel (3, 3, 5) causal in time
    fig = grid_figure(video)
    shown = [ax for ax in fig.axes if ax.images]
    # centre (t = 2) sees slices 0..2, corner (t = 0) slice 0, edge (t = 2) slices 0..2
    assert len(shown) == 3 + 1 + 3 and all(ax.images[0].get_array().shape == (6, 7) for ax in shown)
    assert shown[2].get_title() == "centre (2, 3, 3), slice 2 (own)"
    centre = grid_view.key_picture(video, video.grid, (2, 3, 3))
    for t, ax in enumerate(shown[:3]):
        np.testing.assert_array_equal(ax.images[0].get_array() > 0, centre[t] | (t == 2) * _at(6, 7, 3, 3))
    plt.close(fig)
    fig = grid_figure(masks.neighborhood(20, 5, is_causal=True))
    assert [ax.images[0].get_array().shape for ax in fig.axes if ax.images] == [(1, 20)] * 3
    plt.close(fig)


def _at(h, w, r, c):
    out = np.zeros((h, w), bool)
    out[r, c] = True
    return out


def test_segment_image_of_a_grid_layout():
    from splat.tools.plot import segment_image

    layout = catalogue.GRID_SMALL["neighborhood_3d"].to_acsr()
    assert layout.grid is not None
    np.testing.assert_array_equal(segment_image(layout), layout.to_dense().astype(np.int16))
    big = catalogue.GRID["neighborhood_2d"].to_acsr()
    img = segment_image(big, max_pixels=128)  # cells of 128 x 128 tokens: one image row of the grid
    assert img.shape == (128, 128) and img[64, 64] == 1 and img[64, 0] == 0 and img[0, 0] == 1


def test_cli_analyze_and_bench_write_the_grid_form(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from splat.tools.cli import main

    png = tmp_path / "nb.png"
    assert main(["analyze", "neighborhood((12, 10), 5, dilation=(1, 2))", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "ACSR(120x120" in out and "grid form on the 12x10 grid" in out and "centre query (6, 5)" in out
    assert png.read_bytes()[:4] == b"\x89PNG" and (tmp_path / "nb_grid.png").read_bytes()[:4] == b"\x89PNG"

    res, plot = tmp_path / "b.json", tmp_path / "b.png"
    argv = ["bench", "--patterns", "neighborhood((8, 6), 3)", "--lengths", "32", "--heads", "1"]
    argv += ["--head-dim", "8", "--peers", "dense_xla", "--repeats", "1", "--warmup", "0"]
    assert main([*argv, "--out", str(res), "--plot", str(plot)]) == 0
    r = json.loads(res.read_text())
    assert [(x["impl"], x["S"]) for x in r["results"]] == [("dense_xla", 48)]
    grid_png = tmp_path / "b_neighborhood__8__6___3__grid.png"
    assert grid_png.read_bytes()[:4] == b"\x89PNG" and f"wrote {grid_png}" in capsys.readouterr().out


def test_attention_at_a_catalogue_grid_equals_dense_reference():
    """splat on a GRID_SMALL mask vs float64 dense masked attention (the oracle)."""
    m = catalogue.GRID_SMALL["neighborhood_3d"]
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((1, m.size, 2, 8)) for _ in range(3))
    got = np.asarray(splat.attention(*(x.astype(np.float32) for x in (q, k, v)), mask=m, backend="jax"))
    dense = m.to_acsr().to_dense()
    scores = np.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(8)
    scores = np.where(dense, scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    want = np.einsum("bhqk,bkhd->bqhd", p / p.sum(-1, keepdims=True), v)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_grid_view_docstring_example_runs():
    import doctest

    result = doctest.testmod(grid_view, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 3 and result.failed == 0
