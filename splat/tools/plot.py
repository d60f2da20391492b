"""PNG plots for the CLI: a mask coloured by ACSR segment, and benchmark results.

matplotlib is imported lazily (``pip install "splat[plot]"``), with the Agg
backend, so plotting works on machines with no screen.
"""

from __future__ import annotations

import os

import numpy as np

__all__ = ["plot_bench", "plot_mask", "segment_image"]


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ImportError(
            "plotting needs matplotlib: pip install matplotlib (or the extra: pip install -e '.[plot]')"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def segment_image(layout, max_pixels: int = 1024) -> np.ndarray:
    """Label picture of a layout, int16 ``[rows, cols]``: 0 empty, k + 1 segment k, K + 1 residual.

    Layouts larger than ``max_pixels`` on a side are sampled: every ``f``-th row
    is drawn, and columns are binned by ``f`` (a bin shows the last segment that
    falls in it). Works row chunk by row chunk from ``layout.slot_columns``, so
    the dense ``q_len x kv_len`` mask is never built.

    Args:
      layout: an :class:`acsr.ACSR`.
      max_pixels: the largest side of the picture.
    """
    fr = max(1, -(-layout.q_len // max_pixels))
    fc = max(1, -(-layout.kv_len // max_pixels))
    rows = np.arange(0, layout.q_len, fr)
    img = np.zeros((rows.size, -(-layout.kv_len // fc)), np.int16)
    offs = layout.slot_offsets  # segment k owns [offs[k], offs[k+1]); residual from offs[-1]
    label_of_slot = np.zeros(layout.nnz_max, np.int16)
    for k in range(len(layout.segments)):
        label_of_slot[offs[k] : offs[k + 1]] = k + 1
    label_of_slot[offs[-1] :] = len(layout.segments) + 1
    chunk = max(1, (1 << 22) // max(layout.nnz_max, 1))
    for i0 in range(0, rows.size, chunk):
        sel = rows[i0 : i0 + chunk]
        cols = layout.slot_columns(slice(int(sel[0]), int(sel[-1]) + 1, fr))
        r, slot = np.nonzero(cols >= 0)
        img[i0 + r, cols[r, slot] // fc] = label_of_slot[slot]
    return img


def plot_mask(layout, path: str, title: str | None = None, max_pixels: int = 1024) -> None:
    """Writes a PNG of the mask, each ACSR segment (and the residual) in its own colour.

    Args:
      layout: an :class:`acsr.ACSR` (e.g. from ``splat.analyze``).
      path: where the PNG goes (folders are created).
      title: optional title (the mask expression, say).
      max_pixels: larger masks are sampled down to this many pixels a side.
    """
    plt = _pyplot()
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    img = segment_image(layout, max_pixels)
    n_seg = len(layout.segments)
    palette = ["#ffffff", "#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf"]
    colors = palette[: n_seg + 1] + ["#d62728"]  # residual in red
    fig, ax = plt.subplots(figsize=(6.4, 6.4 * min(2.0, max(0.3, layout.q_len / layout.kv_len))))
    ax.imshow(
        img,
        cmap=ListedColormap(colors),
        vmin=0,
        vmax=len(colors) - 1,
        interpolation="nearest",
        extent=(0, layout.kv_len, layout.q_len, 0),
        aspect="auto",
    )
    ax.set_xlabel("key j")
    ax.set_ylabel("query i")
    handles = []
    for k, s in enumerate(layout.segments):
        st = s.uniform_stride
        law = "closed form" if s.closed_form is not None else "per-row arrays"
        handles.append(Patch(color=colors[k + 1], label=f"segment {k} (stride {st or 'varies'}, {law})"))
    if layout.residual is not None:
        handles.append(
            Patch(color=colors[-1], label=f"residual ({int(layout.residual.num_blocks.sum())} blocks)")
        )
    if handles:
        ax.legend(handles=handles, loc="upper right", fontsize=8, framealpha=0.9)
    head = f"{title}\n" if title else ""
    ax.set_title(
        f"{head}{layout.q_len}x{layout.kv_len}, nnz {layout.nnz}, density {layout.density():.4f}", fontsize=9
    )
    _save(fig, path)


def plot_bench(result: dict, path: str) -> None:
    """Writes a PNG of a ``splat bench`` result: useful TFLOP/s per implementation, one panel per mode.

    Args:
      result: the dict returned by ``splat._bench.run_bench`` (or loaded from its JSON).
      path: where the PNG goes (folders are created).
    """
    plt = _pyplot()
    rows = result["results"]
    if not rows:
        raise ValueError("the benchmark result has no timed rows to plot")
    modes = sorted({r["mode"] for r in rows}, key=["fwd", "fwdbwd"].index)
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    groups = list(dict.fromkeys((r["pattern"], r["S"]) for r in rows))
    fig, axes = plt.subplots(
        len(modes),
        1,
        figsize=(max(6.4, 1.0 * len(groups) * max(1, len(impls)) / 2.5), 3.6 * len(modes)),
        squeeze=False,
    )
    width = 0.8 / len(impls)
    for ax, mode in zip(axes[:, 0], modes, strict=True):
        by = {(r["pattern"], r["S"], r["impl"]): r["tflops"] for r in rows if r["mode"] == mode}
        x = np.arange(len(groups))
        for i, impl in enumerate(impls):
            vals = [by.get((p, s, impl), np.nan) for p, s in groups]
            ax.bar(x + (i - (len(impls) - 1) / 2) * width, vals, width, label=impl)
        ax.set_xticks(x, [f"{p}\nS={s}" for p, s in groups], fontsize=7)
        ax.set_ylabel("useful TFLOP/s")
        ax.set_title(
            f"{mode} on {result['environment']['device']}  ({result.get('flop_formula', '')})", fontsize=8
        )
        ax.legend(fontsize=7)
    fig.tight_layout()
    _save(fig, path)


def _save(fig, path: str) -> None:
    import matplotlib.pyplot as plt

    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
