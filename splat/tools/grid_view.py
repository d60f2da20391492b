"""Masks on a token grid, as the tools show them: the one S a grid mask exists at, and what a query sees.

A neighborhood mask (:func:`splat.masks.neighborhood`) lives on the row-major
tokens of a grid ``(n_0, ..., n_{m-1})``: it exists only at ``S = prod(grid)``
(:func:`fixed_length`), so ``splat bench`` runs it there. Its flattened
``S x S`` picture hides the geometry; the grid form shows, for a few *probe*
queries (centre, corner, edge: :func:`probe_queries`), the keys each sees as a
picture on the grid (:func:`key_picture`), in text (:func:`grid_text`) and as
JSON (:func:`grid_section`). :mod:`splat.tools.plot` draws the same pictures.

The pictures come from the mask's own predicate, one query row at a time
(``O(S)`` each), so they work for any mask over the grid, combinations with
``|`` and ``&`` included.

Example:
  >>> from splat import masks
  >>> from splat.tools import grid_view
  >>> m = masks.neighborhood((6, 8), 3)
  >>> grid_view.fixed_length(m), grid_view.probe_queries(m.grid)["corner"]
  (48, (0, 0))
  >>> print(grid_view.grid_text(m, probes={"centre": (3, 4)}))
  centre query (3, 4) = token 28: 9 keys; axis 0: 2..4, axis 1: 3..5
    ........
    ........
    ...###..
    ...#Q#..
    ...###..
    ........
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

__all__ = [
    "expression",
    "fixed_length",
    "grid_of",
    "grid_section",
    "grid_text",
    "key_picture",
    "probe_queries",
]

# A text picture has at most this many characters a side; larger grids are pooled.
TEXT_SIDE = 32
# Tokens shown around a query's keys in a cropped text picture.
_MARGIN = 2


def grid_of(mask) -> tuple[int, ...] | None:
    """The grid ``mask`` lives on: that of its neighborhood parts (through ``|`` and ``&``), or None.

    Raises:
      ValueError: the mask combines neighborhoods on grids of different sizes (it
        exists at no S).
    """
    from splat import masks
    from splat._neighborhood import Neighborhood

    if isinstance(mask, Neighborhood):
        return mask.grid
    if isinstance(mask, masks.Union | masks.Intersection):
        a, b = grid_of(mask.a), grid_of(mask.b)
        if a is not None and b is not None and math.prod(a) != math.prod(b):
            raise ValueError(
                f"mask {mask!r} combines neighborhoods on grids {a} ({math.prod(a)} tokens) and "
                f"{b} ({math.prod(b)} tokens): it exists at no sequence length"
            )
        return a if a is not None else b
    return None


def fixed_length(mask) -> int | None:
    """The one sequence length ``S`` (``q_len == kv_len``) the mask exists at; None for size-free masks."""
    grid = grid_of(mask)
    return None if grid is None else math.prod(grid)


def probe_queries(grid: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    """The queries the grid form shows: ``centre`` (``n // 2`` on every axis), ``corner``
    (0 on every axis) and ``edge`` (centre, but at the last coordinate of the last axis)."""
    centre = tuple(n // 2 for n in grid)
    return {"centre": centre, "corner": (0,) * len(grid), "edge": (*centre[:-1], grid[-1] - 1)}


def key_picture(mask, grid: tuple[int, ...], query: tuple[int, ...]) -> np.ndarray:
    """Boolean ``[*grid]``: the keys query ``query`` (grid coordinates) sees, from ``mask``'s predicate."""
    q = int(np.ravel_multi_index(query, grid))
    size = math.prod(grid)
    row = np.asarray(mask(np.array([[q]]), np.arange(size)[None, :]), bool)
    return np.broadcast_to(row, (1, size)).reshape(grid)


def _coords(seen: np.ndarray) -> str:
    """``lo..hi``, ``lo..hi step d``, or ``n of lo..hi`` for sorted coordinates."""
    if seen.size == 0:
        return "none"
    lo, hi = int(seen[0]), int(seen[-1])
    if seen.size == 1:
        return str(lo)
    steps = np.unique(np.diff(seen))
    if steps.size == 1:
        return f"{lo}..{hi}" if steps[0] == 1 else f"{lo}..{hi} step {int(steps[0])}"
    return f"{seen.size} of {lo}..{hi}"


def _probe(mask, grid: tuple[int, ...], name: str, query: tuple[int, ...]) -> dict:
    pic = key_picture(mask, grid, query)
    axes = [np.nonzero(pic.any(axis=tuple(b for b in range(pic.ndim) if b != a)))[0] for a in range(pic.ndim)]
    return {
        "name": name,
        "query": [int(x) for x in query],
        "token": int(np.ravel_multi_index(query, grid)),
        "keys": int(pic.sum()),
        "axes": [_coords(c) for c in axes],
        "picture": pic,
    }


def _slice_text(plane: np.ndarray, query: tuple[int, int], side: int) -> list[str]:
    """A 2-D boolean plane as text rows: a full-resolution crop around the keys where it fits in
    ``side`` characters a side, else the whole plane pooled to at most ``side`` a side."""
    h, w = plane.shape
    rows, cols = np.nonzero(plane)
    r0, r1 = (min(rows.min(), query[0]), max(rows.max(), query[0])) if rows.size else (query[0],) * 2
    c0, c1 = (min(cols.min(), query[1]), max(cols.max(), query[1])) if cols.size else (query[1],) * 2
    r0, c0 = max(r0 - _MARGIN, 0), max(c0 - _MARGIN, 0)
    r1, c1 = min(r1 + _MARGIN, h - 1), min(c1 + _MARGIN, w - 1)
    if (h, w) != (r1 - r0 + 1, c1 - c0 + 1) and max(r1 - r0, c1 - c0) < side:
        head = f"rows {r0}..{r1}, columns {c0}..{c1} of {h}x{w}:"
        cells, fr, fc = plane[r0 : r1 + 1, c0 : c1 + 1], 1, 1
        query = (query[0] - r0, query[1] - c0)
    else:
        fr, fc = -(-h // side), -(-w // side)
        padded = np.zeros((-(-h // fr) * fr, -(-w // fc) * fc), bool)
        padded[:h, :w] = plane
        cells = padded.reshape(padded.shape[0] // fr, fr, padded.shape[1] // fc, fc).any(axis=(1, 3))
        pooled = f", a character for {fr}x{fc} tokens, # where any is seen" if fr * fc > 1 else ""
        head = f"the whole {h}x{w}{pooled}:"
    chars = np.where(cells, "#", ".")
    chars[query[0] // fr, query[1] // fc] = "Q"
    return [head, *("".join(r) for r in chars)]


def _probe_text(probe: dict, grid: tuple[int, ...], side: int) -> list[str]:
    query, pic = tuple(probe["query"]), probe["picture"]
    axes = ", ".join(f"axis {a}: {c}" for a, c in enumerate(probe["axes"]))
    lines = [f"{probe['name']} query {query} = token {probe['token']}: {probe['keys']} keys; {axes}"]
    if len(grid) == 1:
        plane, at = pic[None], (0, query[0])
    else:
        lead = pic.reshape(-1, *grid[-2:])  # the slices over the leading axes, row-major
        if lead.shape[0] > 1:
            seen = {lead[i].tobytes() for i in np.nonzero(lead.any(axis=(1, 2)))[0]}
            same = "the same keys in every slice it sees" if len(seen) <= 1 else "slices differ"
            own = ", ".join(f"axis {a} = {x}" for a, x in enumerate(query[:-2]))
            lines.append(f"  ({same}; shown: its own, {own})")
        plane, at = pic[query[:-2]], query[-2:]
    return lines + ["  " + r for r in _slice_text(plane, at, side)]


def grid_text(mask, probes: Mapping[str, tuple[int, ...]] | None = None, *, side: int = TEXT_SIDE) -> str:
    """The grid form of ``mask`` in text: per probe query, a summary line and the picture of its keys.

    Pictures are of the last two grid axes (a 1-D grid: one row), in the query's
    own slice of the leading axes (a 3-D grid: its time slice; the slices it sees
    are listed); ``#`` a key seen, ``Q`` the query, ``.`` nothing. A grid larger
    than ``side`` tokens a side is pooled: a character stands for a cell of tokens
    and shows ``#`` where any of them is seen.

    Args:
      mask: a mask on a grid (:func:`grid_of` is not None).
      probes: name -> query coordinates; default :func:`probe_queries`.
      side: the largest picture side in characters.

    Raises:
      ValueError: ``mask`` lives on no grid.
    """
    grid = grid_of(mask)
    if grid is None:
        raise ValueError(f"mask {mask!r} lives on no token grid (it has no neighborhood part)")
    probes = probe_queries(grid) if probes is None else probes
    lines = []
    for name, query in probes.items():
        lines += _probe_text(_probe(mask, grid, name, tuple(query)), grid, side)
    return "\n".join(lines)


def expression(mask) -> str | None:
    """A :func:`splat.masks.parse` expression that rebuilds a neighborhood mask, or None for other masks."""
    from splat._neighborhood import Neighborhood

    if not isinstance(mask, Neighborhood):
        return None
    return (
        f"neighborhood({mask.grid}, {mask.kernel_size}, stride={mask.stride}, "
        f"dilation={mask.dilation}, is_causal={mask.is_causal})"
    )


def grid_section(mask) -> dict:
    """The JSON-ready grid form of ``mask`` (what ``splat bench`` records per grid pattern).

    Returns:
      ``{"grid", "S", "expression" (or None: see :func:`expression`), "probes":
      [{"name", "query", "token", "keys", "axes"}], "text"}``; ``text`` is :func:`grid_text`.
    """
    grid = grid_of(mask)
    if grid is None:
        raise ValueError(f"mask {mask!r} lives on no token grid (it has no neighborhood part)")
    probes = [_probe(mask, grid, n, q) for n, q in probe_queries(grid).items()]
    text = []
    for p in probes:
        text += _probe_text(p, grid, TEXT_SIDE)
    return {
        "grid": list(grid),
        "S": math.prod(grid),
        "expression": expression(mask),
        "probes": [{k: v for k, v in p.items() if k != "picture"} for p in probes],
        "text": "\n".join(text),
    }
