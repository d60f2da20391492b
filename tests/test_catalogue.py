"""splat.catalogue: every entry is the mask its name says, checked against independent numpy renderings."""

from __future__ import annotations

import numpy as np
import pytest

from splat import catalogue, masks


def _grid(q_len, kv_len):
    return np.arange(q_len)[:, None], np.arange(kv_len)[None, :]


def _odd_reference(name: str, i, j) -> np.ndarray:
    """``catalogue.ODD`` written out in numpy (not through splat's predicates or layouts)."""
    d = i - j
    if name == "random":
        a = np.random.default_rng(1234).random((i.size, j.size)) < 0.12
        a[:, 0] = True
        return a
    if name == "empty_rows":
        a = np.abs(d) <= 10
        a[[0, 1, 2, 3, 4, 50, i.size - 1]] = False
        a[60] = False
        a[60, 0] = True
        return a
    return {
        "full": np.ones((i.size, j.size), bool),
        "causal": j <= i,
        "sliding_window": np.abs(d) <= 16,
        "causal_window": (j <= i) & (j >= i - 31),
        "dilated_window": (np.abs(d) <= 24) & (d % 3 == 0),
        "strided": (j <= i) & (d % 7 == 0),
        "block_local": (j // 32 <= i // 32) & (j // 32 >= i // 32 - 1),
        "global_window": (np.abs(d) <= 8) | (j < 3) | (i < 3),
        "sink_causal_window": ((j < 4) | (j >= i - 16)) & (j <= i),
        "rect_wide": np.abs(j - 2 * i) <= 12,
        "rect_causal": j <= i - 50,
        "odd_window": (j >= i - 20) & (j <= i + 5),
    }[name]


@pytest.mark.parametrize("name", list(catalogue.ODD))
def test_odd_masks_are_what_their_names_say(name):
    q_len, kv_len, mask = catalogue.ODD[name]
    want = np.broadcast_to(_odd_reference(name, *_grid(q_len, kv_len)), (q_len, kv_len))
    np.testing.assert_array_equal(np.broadcast_to(mask(*_grid(q_len, kv_len)), want.shape), want)
    np.testing.assert_array_equal(mask.to_acsr(q_len, kv_len).to_dense(), want)


def test_odd_masks_cover_the_hard_cases():
    rows = {n: catalogue.ODD[n].mask.to_acsr(*catalogue.ODD[n][:2]) for n in ("random", "empty_rows")}
    assert rows["random"].residual is not None  # irregular: needs the block-sparse residual
    assert (rows["empty_rows"].row_counts() == 0).sum() == 7 and rows["empty_rows"].row_counts()[60] == 1
    assert any(q != kv for q, kv, _ in catalogue.ODD.values())  # rectangular sizes too


def test_named_looks_up_the_suite_then_the_baselines():
    assert catalogue.named("sliding_window") == masks.sliding_window(256, 256)
    assert catalogue.named("causal") == masks.causal()
    assert catalogue.named("neighborhood_2d") == masks.neighborhood((128, 128), 15)
    assert catalogue.names() == [*catalogue.BENCH, *catalogue.GRID, *catalogue.BASELINES]
    assert len(set(catalogue.names())) == len(catalogue.names())
    with pytest.raises(KeyError, match="no catalogue mask named 'nope'; known: sliding_window"):
        catalogue.named("nope")


def test_small_holds_the_bench_patterns_scaled_down():
    assert set(catalogue.BENCH) | set(catalogue.BASELINES) <= set(catalogue.SMALL)
    for name in [*catalogue.BENCH, *catalogue.BASELINES]:  # GRID has GRID_SMALL (test_grid_tools)
        assert type(catalogue.SMALL[name]) is type(catalogue.named(name))


def test_benchmark_scripts_draw_their_masks_from_the_catalogue():
    """No benchmark script builds its own list of masks (the catalogue is the one list)."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent / "benchmarks"
    for path in sorted(root.rglob("*.py")):  # the suite and spikes/
        text = path.read_text()
        for ctor in ("dilated_window(", "block_local(", "strided(", "global_tokens("):
            assert f"masks.{ctor}" not in text, f"{path.name} builds masks.{ctor}...) itself"
