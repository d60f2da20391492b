"""PNG plots for the CLI: a mask coloured by ACSR segment, a grid mask in grid form, benchmark results.

matplotlib is imported lazily (``pip install "splat-attention[plot]"``), with the Agg
backend, so plotting works on machines with no screen. Figures use matplotlib's
constrained layout, so titles, labels and legends stay inside the picture.
"""

from __future__ import annotations

import os
import textwrap
from types import SimpleNamespace

import numpy as np

__all__ = [
    "bench_figure",
    "bench_label",
    "bench_ratios",
    "grid_figure",
    "mask_figure",
    "plot_bench",
    "plot_bench_grids",
    "plot_grid",
    "plot_mask",
    "segment_image",
]

# Largest number of (row, column) pairs enumerated at once while drawing a mask.
_CHUNK = 1 << 22
# Titles wrap at this many characters (a long mask expression would run past the figure).
_TITLE_WIDTH = 70
# Figures are drawn and saved at this resolution, so a mask picture can be sized to the screen pixels.
_DPI = 110
# Benchmark modes, as titles say them.
_MODE_NAMES = {"fwd": "forward", "fwdbwd": "forward+backward"}
# A benchmark plot's tick labels (7 points): characters an inch holds, with room between neighbours,
# and the most lines a label takes with the catalogue name beside the mask expression.
_LABEL_CHARS_PER_INCH = 15
_LABEL_LINES = 3
# Space left between a mask picture and the axes' frame, as a fraction of each side (keeps the first
# and last rows and columns, often the thin global ones, clear of the frame's lines).
_FRAME_PAD = 0.01


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ImportError(
            "plotting needs matplotlib: pip install matplotlib "
            '(or splat\'s extra: pip install "splat-attention[plot]")'
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _wrap(text: str) -> str:
    return "\n".join(textwrap.fill(line, _TITLE_WIDTH) for line in text.splitlines())


def segment_image(layout, max_pixels: int | tuple[int, int] = 1024) -> np.ndarray:
    """Label picture of a layout, int16 ``[rows, cols]``: 0 empty, k + 1 segment k, K + 1 residual
    (a grid layout: 1 wherever its grid product has a key).

    A layout larger than ``max_pixels`` on a side is pooled: each pixel stands
    for a cell of ``fr x fc`` mask entries (``fr = ceil(q_len / max_rows)``,
    ``fc = ceil(kv_len / max_cols)``) and shows the highest label of any nonzero in the cell, so
    thin parts (a few global rows or columns, a sparse stride) stay visible at
    any size. Works from the segments' ``base/stride/count`` rows (a grid
    layout's: its product's runs along the last axis) and the residual's
    blocks, never building the dense ``q_len x kv_len`` mask: the
    cost is O(q_len + pixels) plus the residual's nonzeros and those of rows
    whose stride is wider than a cell (each of their columns lights a cell of
    its own).

    Args:
      layout: an :class:`acsr.ACSR`.
      max_pixels: the largest side of the picture, or ``(max_rows, max_cols)``.
    """
    max_rows, max_cols = (max_pixels, max_pixels) if isinstance(max_pixels, int) else max_pixels
    if min(max_rows, max_cols) < 1:
        raise ValueError(f"max_pixels must be positive, got {max_pixels!r}")
    fr = max(1, -(-layout.q_len // max_rows))
    fc = max(1, -(-layout.kv_len // max_cols))
    n_rows, n_cols = -(-layout.q_len // fr), -(-layout.kv_len // fc)
    img = np.zeros((n_rows, n_cols), np.int16)
    if layout.grid is not None:
        base, stride, count = layout.grid.product_runs()
        for r in range(base.shape[1]):
            run = SimpleNamespace(base=base[:, r], stride=stride[:, r], count=count[:, r])
            img[_segment_cells(run, fr, fc, n_rows, n_cols)] = 1
    for k, seg in enumerate(layout.segments):
        img[_segment_cells(seg, fr, fc, n_rows, n_cols)] = k + 1
    if layout.residual is not None:
        rows, cols = layout.residual.nonzeros()
        keep = (rows < layout.q_len) & (cols < layout.kv_len)
        img[rows[keep] // fr, cols[keep] // fc] = len(layout.segments) + 1
    return img


def _segment_cells(seg, fr: int, fc: int, n_rows: int, n_cols: int) -> np.ndarray:
    """Bool ``[n_rows, n_cols]``: the ``fr x fc`` cells holding a column of the segment."""
    count = seg.count.astype(np.int64)
    rows = np.nonzero(count > 0)[0]
    base, stride, count = seg.base[rows].astype(np.int64), seg.stride[rows].astype(np.int64), count[rows]
    cells = np.zeros((n_rows, n_cols), bool)
    # Steps of at most fc columns leave no cell between the first and last column empty: mark
    # the run of cells [first // fc, last // fc] with +1/-1 at its ends and a running sum.
    run = (stride <= fc) | (count == 1)
    r, lo = rows[run] // fr, base[run] // fc
    hi = (base[run] + stride[run] * (count[run] - 1)) // fc
    edges = np.zeros((n_rows, n_cols + 1), np.int64)
    np.add.at(edges, (r, lo), 1)
    np.add.at(edges, (r, hi + 1), -1)
    cells |= np.cumsum(edges[:, :n_cols], axis=1) > 0
    # Longer steps put each column in a cell of its own, so a row has at most n_cols of them.
    rows, base, stride, count = rows[~run], base[~run], stride[~run], count[~run]
    start = 0
    while start < rows.size:
        stop = start + max(1, int(np.searchsorted(np.cumsum(count[start:]), _CHUNK)))
        c = count[start:stop]
        which = np.repeat(np.arange(c.size), c)
        t = np.arange(which.size) - np.repeat(np.cumsum(c) - c, c)
        cols = base[start:stop][which] + stride[start:stop][which] * t
        cells[rows[start:stop][which] // fr, cols // fc] = True
        start = stop
    return cells


def mask_figure(layout, title: str | None = None, max_pixels: int = 1024):
    """The matplotlib figure :func:`plot_mask` saves (for callers that want to adjust it).

    The picture gets at most one pixel per screen pixel of its axes (and at most
    ``max_pixels`` a side), pooled by :func:`segment_image`, so the renderer never
    drops a row or column of it: thin parts stay visible.
    """
    plt = _pyplot()
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    n_seg = max(len(layout.segments), layout.grid is not None)
    palette = ["#ffffff", "#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf"]
    colors = palette[: n_seg + 1] + ["#d62728"]  # residual in red
    fig, ax = plt.subplots(
        figsize=(6.4, 6.4 * min(2.0, max(0.3, layout.q_len / layout.kv_len))), dpi=_DPI, layout="constrained"
    )
    head = f"{title}\n" if title else ""
    ax.set_title(
        _wrap(f"{head}{layout.q_len}x{layout.kv_len}, nnz {layout.nnz}, density {layout.density():.4f}"),
        fontsize=9,
    )
    ax.set_xlabel("key j")
    ax.set_ylabel("query i")
    handles = []
    if layout.grid is not None:
        axes = " x ".join(
            f"{a.length}" + (f" (dilation {a.dilation})" if a.dilation > 1 else "") for a in layout.grid.axes
        )
        handles.append(Patch(color=colors[1], label=f"grid product over {axes} tokens"))
    for k, s in enumerate(layout.segments):
        st = s.uniform_stride
        law = "closed form" if s.closed_form is not None else "per-row arrays"
        handles.append(Patch(color=colors[k + 1], label=f"segment {k} (stride {st or 'varies'}, {law})"))
    if layout.residual is not None:
        handles.append(
            Patch(color=colors[-1], label=f"residual ({int(layout.residual.num_blocks.sum())} blocks)")
        )
    if handles:  # below the axes, where it hides no part of the mask
        fig.legend(handles=handles, loc="outside lower center", ncols=min(2, len(handles)), fontsize=8)
    fig.draw_without_rendering()  # lays the figure out: the axes' size in pixels is now known
    box = ax.get_window_extent()
    fit = tuple(max(1, int(n / (1 + 2 * _FRAME_PAD))) for n in (box.height, box.width))
    img = segment_image(layout, (min(max_pixels, fit[0]), min(max_pixels, fit[1])))
    ax.imshow(
        img,
        cmap=ListedColormap(colors),
        vmin=0,
        vmax=len(colors) - 1,
        interpolation="nearest",
        extent=(0, layout.kv_len, layout.q_len, 0),
        aspect="auto",
    )
    pad_r, pad_c = _FRAME_PAD * layout.q_len, _FRAME_PAD * layout.kv_len
    ax.set_xlim(-pad_c, layout.kv_len + pad_c)
    ax.set_ylim(layout.q_len + pad_r, -pad_r)
    fr, fc = -(-layout.q_len // img.shape[0]), -(-layout.kv_len // img.shape[1])
    if fr * fc > 1:
        ax.set_xlabel(f"key j    (a pixel is {fr}x{fc} entries, lit where any is)")
    return fig


def plot_mask(layout, path: str, title: str | None = None, max_pixels: int = 1024) -> None:
    """Writes a PNG of the mask, each ACSR segment (and the residual) in its own colour.

    Args:
      layout: an :class:`acsr.ACSR` (e.g. from ``splat.analyze``).
      path: where the PNG goes (folders are created).
      title: optional title (the mask expression, say); long titles wrap.
      max_pixels: larger masks are pooled down to at most this many pixels a
        side, and to no more than the plot's screen pixels (see :func:`segment_image`).
    """
    _save(mask_figure(layout, title, max_pixels), path)


def _grid_slices(pic: np.ndarray, query: tuple[int, ...], most: int) -> list[tuple[int, ...]]:
    """The slices (coordinates on the leading axes) drawn for one query: those holding a key and
    the query's own, at most ``most``, nearest the query's first."""
    lead, own = pic.shape[:-2], query[:-2]
    if not lead:  # a 2-D grid: one slice
        return [()]
    seen = {tuple(int(x) for x in c) for c in zip(*np.nonzero(pic.any(axis=(-2, -1))), strict=True)}
    seen.add(own)
    near = sorted(seen, key=lambda c: sum(abs(a - b) for a, b in zip(c, own, strict=True)))[:most]
    return sorted(near, key=lambda c: np.ravel_multi_index(c, lead))


def grid_figure(mask, title: str | None = None, max_slices: int = 6):
    """The matplotlib figure :func:`plot_grid` saves: per probe query, the keys it sees on the grid.

    Probe queries: centre, corner, edge (:func:`splat.tools.grid_view.probe_queries`).
    A panel pictures the last two grid axes (a 1-D grid: one strip): keys the
    query sees in blue, the query itself in red (ringed). On a 1-D or 2-D grid
    the probes stand side by side; on a 3-D grid each probe gets a row, with a
    panel for each slice of the leading axis that holds a key and for the
    query's own slice (at most ``max_slices``, nearest the query's first).

    Raises:
      ValueError: ``mask`` lives on no grid.
    """
    plt = _pyplot()
    from matplotlib.colors import ListedColormap

    from splat.tools import grid_view

    grid = grid_view.grid_of(mask)
    if grid is None:
        raise ValueError(f"mask {mask!r} lives on no token grid (it has no neighborhood part)")
    probes = grid_view.probe_queries(grid)
    pictures = {n: grid_view.key_picture(mask, grid, q) for n, q in probes.items()}
    flat = len(grid) <= 2
    shape = "x".join(map(str, grid))
    shown = dict(probes)  # the coordinates titles give
    if len(grid) == 1:  # a strip: one row of the last two axes
        grid = (1, *grid)
        probes = {n: (0, *q) for n, q in probes.items()}
        pictures = {n: p[None] for n, p in pictures.items()}
    # panels[row] = [(probe name, slice of the leading axes)]
    if flat:
        panels = [[(n, ()) for n in probes]]
    else:
        panels = [[(n, c) for c in _grid_slices(pictures[n], probes[n], max_slices)] for n in probes]
    cols = max(len(r) for r in panels)
    h, w = grid[-2:]
    side = 2.6
    fig, axes = plt.subplots(
        len(panels),
        cols,
        figsize=(side * cols, min(side, max(0.9, side * h / w)) * len(panels) + 0.8),
        squeeze=False,
        dpi=_DPI,
        layout="constrained",
    )
    cmap = ListedColormap(["#ffffff", "#1f77b4", "#d62728"])  # nothing, key, the query
    for r, row in enumerate(panels):
        for c in range(cols):
            ax = axes[r, c]
            if c >= len(row):
                ax.axis("off")
                continue
            name, where = row[c]
            query, pic = probes[name], pictures[name]
            plane = pic[where].astype(np.int8)
            own = where == query[:-2]
            if own:
                plane[query[-2:]] = 2
            ax.imshow(plane, cmap=cmap, vmin=0, vmax=2, interpolation="nearest", aspect="auto")
            if own:
                ax.scatter([query[-1]], [query[-2]], s=80, facecolors="none", edgecolors="#d62728")
            ax.set_xticks([])
            ax.set_yticks([])
            head = f"{name} {shown[name]}: {int(pic.sum())} keys"
            if where:  # 3-D: the probe's key count heads its row's first panel only
                head = f"{name} {shown[name]}, slice {', '.join(map(str, where))}" + (" (own)" if own else "")
                if c == 0:
                    ax.set_ylabel(f"{int(pic.sum())} keys", fontsize=7)
            ax.set_title(head, fontsize=7)
    top = f"{title}\n" if title else ""
    fig.suptitle(_wrap(f"{top}keys each query sees on the {shape} grid (query in red)"), fontsize=8)
    return fig


def plot_grid(mask, path: str, title: str | None = None) -> None:
    """Writes a PNG of a grid mask in grid form (:func:`grid_figure`).

    Args:
      mask: a mask on a token grid (a neighborhood, alone or combined with ``|`` / ``&``).
      path: where the PNG goes (folders are created).
      title: optional title.
    """
    _save(grid_figure(mask, title), path)


def plot_bench_grids(result: dict, path: str) -> list[str]:
    """Writes the grid form of each grid pattern of a ``splat bench`` result; returns the paths.

    The pictures go beside ``path`` as ``<stem>_<pattern>_grid.png``, one per
    ``result["grid_masks"]`` entry with an ``expression`` (the mask, rebuilt by
    :func:`splat.masks.parse`; combinations have none and are left out).
    """
    from splat import masks

    stem = os.path.splitext(path)[0]
    written = []
    for g in result.get("grid_masks", []):
        if g.get("expression") is None:
            continue
        safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in g["pattern"])
        out = f"{stem}_{safe}_grid.png"
        plot_grid(masks.parse(g["expression"]), out, title=f"{g['pattern']}: {g['expression']}")
        written.append(out)
    return written


def bench_ratios(result: dict) -> dict[str, dict[tuple[str, int, str], float]]:
    """Speed-up of splat over each peer: ``{peer: {(pattern, S, mode): peer ms / splat ms}}``.

    From a ``splat bench`` result's rows (``vs_splat``); peers with no ratio
    (splat itself, rows where splat did not run) are left out.
    """
    out: dict[str, dict] = {}
    for r in result["results"]:
        if r["impl"] != "splat" and r.get("vs_splat") is not None:
            out.setdefault(r["impl"], {})[(r["pattern"], r["S"], r["mode"])] = float(r["vs_splat"])
    return out


def bench_label(pattern: str, expression: str | None, width: int) -> str:
    """A benchmark group's tick label: what ran, wrapped to ``width`` characters a line.

    The mask expression, after the catalogue name where both fit in a few lines
    (``causal_window: sliding_window(1023, 0)``); a pattern typed as an expression is
    shown as typed; a row with no expression (a mask from an array) shows its pattern.
    """

    def wrap(text: str) -> list[str]:
        return textwrap.wrap(text, max(width, 8), break_long_words=False, break_on_hyphens=False)

    if not expression or "(" in pattern:  # no expression, or the pattern is one
        return "\n".join(wrap(pattern))
    both = wrap(f"{pattern}: {expression}")
    return "\n".join(both if len(both) <= _LABEL_LINES else wrap(expression))


def bench_figure(result: dict):
    """The matplotlib figure :func:`plot_bench` saves: per mode, TFLOP/s and the speed-up over each peer.

    The title says what ran (forward, forward+backward, or both) on which device and how
    FLOPs were counted (the result's ``flop_formula``); bars are grouped by mask, labelled
    with its expression (:func:`bench_label`) and S.
    """
    plt = _pyplot()
    rows = result["results"]
    if not rows:
        raise ValueError("the benchmark result has no timed rows to plot")
    modes = sorted({r["mode"] for r in rows}, key=list(_MODE_NAMES).index)
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    groups = list(dict.fromkeys((r["pattern"], r["S"]) for r in rows))
    expressions = {r["pattern"]: r.get("expression") for r in rows}
    ratios = bench_ratios(result)
    panels = 2 if ratios else 1
    per_group = max(1.6, len(impls) / 2.5)  # inches
    fig, axes = plt.subplots(
        len(modes) * panels,
        1,
        figsize=(max(6.4, len(groups) * per_group + 1.0), 3.6 * len(modes) * panels),
        squeeze=False,
        dpi=_DPI,
        layout="constrained",
    )
    x = np.arange(len(groups))
    label_chars = int(per_group * _LABEL_CHARS_PER_INCH)
    labels = [f"{bench_label(p, expressions[p], label_chars)}\nS={s}" for p, s in groups]
    device = result["environment"]["device"]
    ran = " and ".join(_MODE_NAMES[m] for m in modes)
    formula = result.get("flop_formula")
    fig.suptitle(_wrap(f"{ran} on {device}" + (f"\n{formula}" if formula else "")), fontsize=9)
    for m, mode in enumerate(modes):
        ax = axes[m * panels, 0]
        by = {(r["pattern"], r["S"], r["impl"]): r["tflops"] for r in rows if r["mode"] == mode}
        width = 0.8 / len(impls)
        for i, impl in enumerate(impls):
            vals = [by.get((p, s, impl), np.nan) for p, s in groups]
            ax.bar(x + (i - (len(impls) - 1) / 2) * width, vals, width, label=impl)
        ax.set_xticks(x, labels, fontsize=7)
        ax.set_ylabel("useful TFLOP/s")
        ax.set_title(f"{_MODE_NAMES[mode]}: useful TFLOP/s", fontsize=8)
        ax.legend(fontsize=7)
        if not ratios:
            continue
        ax = axes[m * panels + 1, 0]
        peers = list(ratios)
        width = 0.8 / len(peers)
        for i, peer in enumerate(peers):
            vals = [ratios[peer].get((p, s, mode), np.nan) for p, s in groups]
            bars = ax.bar(x + (i - (len(peers) - 1) / 2) * width, vals, width, label=f"vs {peer}")
            ax.bar_label(bars, fmt="%.2g", fontsize=6)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_yscale("log")
        ax.set_xticks(x, labels, fontsize=7)
        ax.set_ylabel("splat speed-up (x)")
        ax.set_title(f"{_MODE_NAMES[mode]}: peer ms / splat ms (above 1: splat is faster)", fontsize=8)
        ax.legend(fontsize=7)
    return fig


def plot_bench(result: dict, path: str) -> None:
    """Writes a PNG of a ``splat bench`` result.

    One panel per mode with the useful TFLOP/s of each implementation, and
    beneath it (when splat ran) the speed-up of splat over each peer per
    pattern, ``peer ms / splat ms`` on a log scale.

    Args:
      result: the dict returned by ``splat.tools.bench.run_bench`` (or loaded from its JSON).
      path: where the PNG goes (folders are created).
    """
    _save(bench_figure(result), path)


def _save(fig, path: str) -> None:
    import matplotlib.pyplot as plt

    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fig.savefig(path, dpi=_DPI)
    plt.close(fig)
