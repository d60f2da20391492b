"""splat.tools.plot: the pooled mask picture (exact, no dense mask), figure layout, the speed-up panel."""

from __future__ import annotations

import re

import numpy as np
import pytest

import acsr
import splat
from splat import catalogue, masks
from splat.tools.plot import bench_ratios, segment_image


def _label_picture(layout) -> np.ndarray:
    """Per mask entry, the highest label on it (k + 1 for segment k, K + 1 for the residual), densely."""
    pic = np.zeros(layout.shape, np.int16)
    for k, seg in enumerate(layout.segments):
        alone = acsr.ACSR(layout.q_len, layout.kv_len, (seg,)).to_dense()
        pic[alone] = k + 1
    if layout.residual is not None:
        pic[layout.residual.dense(*layout.shape)] = len(layout.segments) + 1
    return pic


def _max_pool(pic: np.ndarray, fr: int, fc: int) -> np.ndarray:
    q, kv = pic.shape
    padded = np.zeros((-(-q // fr) * fr, -(-kv // fc) * fc), pic.dtype)
    padded[:q, :kv] = pic
    return padded.reshape(padded.shape[0] // fr, fr, padded.shape[1] // fc, fc).max(axis=(1, 3))


@pytest.mark.parametrize("name", ["global_window", "sink_causal_window", "dilated_window", "strided_local"])
def test_segment_image_labels_each_segment(name):
    layout = catalogue.SMALL[name].to_acsr(150, 170)
    img = segment_image(layout, max_pixels=1024)
    np.testing.assert_array_equal(img > 0, layout.to_dense())
    np.testing.assert_array_equal(img, _label_picture(layout))


@pytest.mark.parametrize(
    "mask, shape, max_pixels",
    [
        (masks.sliding_window(3), (300, 300), 150),  # 2 x 2 cells
        (masks.strided(7) | masks.sliding_window(2, 0), (301, 299), 40),  # strides longer than a cell
        (masks.dilated_window(30, 3), (257, 259), 50),  # strides shorter than a cell
        (masks.global_tokens(3) | masks.block_local(16), (333, 200), 64),
        (None, (128, 128), 30),  # the residual
    ],
)
def test_segment_image_pools_each_cell_exactly(mask, shape, max_pixels):
    if mask is None:
        layout = splat.analyze(catalogue.random_mask(*shape, density=0.2, seed=5))
        assert layout.residual is not None
    else:
        layout = mask.to_acsr(*shape)
    img = segment_image(layout, max_pixels=max_pixels)
    fr, fc = -(-shape[0] // max_pixels), -(-shape[1] // max_pixels)
    assert img.shape == (-(-shape[0] // fr), -(-shape[1] // fc)) and max(img.shape) <= max_pixels
    np.testing.assert_array_equal(img, _max_pool(_label_picture(layout), fr, fc))


def test_thin_parts_survive_downsampling():
    """4 global rows/columns of a 2048 x 2048 mask, and one lone row, at 256 pixels a side."""
    layout = (masks.global_tokens(4) | masks.sliding_window(256, 256)).to_acsr(2048, 2048)
    img = segment_image(layout, max_pixels=256)  # cells of 8 x 8 entries
    assert img.shape == (256, 256)
    assert (img[0] > 0).all() and (img[:, 0] > 0).all()  # the global rows and columns
    assert not (img[100, 1:50] > 0).any()  # and not everything: far from the window is empty
    lone = np.zeros((2048, 2048), bool)
    lone[1001, ::64] = True  # a row no stride-8 sampling of rows would meet, with sparse columns
    img = segment_image(splat.analyze(lone), max_pixels=256)
    assert np.count_nonzero(img) == 32 and (img[1001 // 8, ::8] > 0).all()


def test_segment_image_of_a_long_mask_is_quick():
    import time

    window = (masks.global_tokens(4) | masks.sliding_window(100)).to_acsr(65536, 65536)
    strided = masks.strided(64).to_acsr(65536, 65536)
    t0 = time.perf_counter()
    img, img_strided = segment_image(window, max_pixels=512), segment_image(strided, max_pixels=512)
    assert time.perf_counter() - t0 < 5  # O(q_len + pixels): no dense 65536^2 mask, no per-entry loop
    assert img.shape == (512, 512) and (img[0] > 0).all() and (img[:, 0] > 0).all()
    assert np.array_equal(img_strided > 0, np.tril(np.ones((512, 512), bool)))


def _inside(fig, artist) -> bool:
    box = artist.get_window_extent(renderer=fig.canvas.get_renderer())
    fb = fig.bbox
    return fb.x0 - 0.5 <= box.x0 and box.x1 <= fb.x1 + 0.5 and fb.y0 - 0.5 <= box.y0 and box.y1 <= fb.y1 + 0.5


def test_mask_figure_title_stays_inside_the_figure():
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from splat.tools.plot import mask_figure

    title = "sliding_window(256, 256) | global_tokens(4) | sink(4) | block_local(512, 1) | causal()"
    fig = mask_figure(masks.parse(title).to_acsr(2048, 2048), title=title, max_pixels=256)
    fig.canvas.draw()
    (ax,) = fig.axes
    assert _inside(fig, ax.title) and _inside(fig, ax.xaxis.label) and _inside(fig, fig.legends[0])
    assert re.fullmatch(r"key j +\(a pixel is \d+x\d+ entries, lit where any is\)", ax.get_xlabel())
    # no more picture pixels than screen pixels: the renderer drops none of the global rows
    rows, cols = ax.images[0].get_array().shape
    box = ax.get_window_extent()
    assert rows <= box.height and cols <= box.width and (ax.images[0].get_array()[0] > 0).all()
    plt.close(fig)


def _result(rows):
    return {"results": rows, "environment": {"device": "cpu"}, "flop_formula": "4*B*H*nnz*D"}


def _row(pattern, s, mode, impl, ms, splat_ms):
    ratio = None if splat_ms is None else ms / splat_ms
    row = {"pattern": pattern, "S": s, "mode": mode, "impl": impl, "ms": ms, "tflops": 1 / ms}
    return {**row, "vs_splat": ratio}


def test_bench_ratios_per_peer_and_pattern():
    rows = [
        _row("window", 64, "fwd", "splat", 2.0, 2.0),
        _row("window", 64, "fwd", "dense_xla", 6.0, 2.0),
        _row("window", 64, "fwd", "flex", 3.0, 2.0),
        _row("dilated", 64, "fwd", "splat", 4.0, 4.0),
        _row("dilated", 64, "fwd", "dense_xla", 2.0, 4.0),
        _row("causal", 64, "fwd", "cudnn", 1.0, None),  # splat did not run: no ratio
    ]
    assert bench_ratios(_result(rows)) == {
        "dense_xla": {("window", 64, "fwd"): 3.0, ("dilated", 64, "fwd"): 0.5},
        "flex": {("window", 64, "fwd"): 1.5},
    }


def test_bench_figure_has_a_speedup_panel_per_mode():
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from splat.tools.plot import bench_figure

    timings = [("w", "splat", 2.0, 2.0), ("w", "dense_xla", 6.0, 2.0), ("d", "splat", 1, 1)]
    timings += [("d", "dense_xla", 4.0, 1.0)]
    rows = [_row(p, 64, mode, impl, ms, sm) for mode in ("fwd", "fwdbwd") for p, impl, ms, sm in timings]
    fig = bench_figure(_result(rows))
    fig.canvas.draw()
    assert len(fig.axes) == 4  # TFLOP/s and speed-up, per mode
    speedup = fig.axes[1]
    assert speedup.get_ylabel() == "splat speed-up (x)" and speedup.get_yscale() == "log"
    heights = sorted(p.get_height() for p in speedup.patches)
    assert heights == [3.0, 4.0]  # dense_xla: 6/2 on w, 4/1 on d
    assert all(_inside(fig, ax.title) for ax in fig.axes)
    plt.close(fig)
    # splat not among the rows (no ratios): the TFLOP/s panels only
    fig = bench_figure(_result([{**r, "vs_splat": None} for r in rows if r["impl"] != "splat"]))
    assert len(fig.axes) == 2
    plt.close(fig)
