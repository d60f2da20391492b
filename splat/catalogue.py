"""Named mask patterns: the one catalogue that the benchmarks, the CLI and the tests draw from.

==============  ======================================================================
dict            what it holds
==============  ======================================================================
``BENCH``       the benchmark suite, at the sizes the issues and papers use (S in the
                thousands); ``splat bench`` and ``benchmarks/*.py`` run it
``BASELINES``   full and causal attention: the dense masks every attention kernel
                serves, timed where a benchmark compares kernels on their home ground
``SMALL``       the ``BENCH`` patterns (plus full, causal and a union of a strided and
                a window part) with parameters scaled for tiny test shapes
``ODD``         ``name -> Shaped(q_len, kv_len, mask)``: test masks at odd, sometimes
                rectangular sizes, including irregular ones (a random mask, a mask
                with empty rows) that need the block-sparse residual
``GRID``        neighborhood attention on token grids (images, video), NATTEN's
                na2d / na3d: each mask exists only at its grid's S = prod(grid)
                (16384 here), so ``splat bench`` runs it there, whatever ``--lengths``
``GRID_SMALL``  the ``GRID`` patterns on small grids, for tests
``DECODE``      the masks of decoding against a KV cache (taken at the newest token's
                position of a 32K cache); packed documents add segment ids to ``causal``
==============  ======================================================================

``named(name)`` looks a benchmark name up in ``BENCH``, ``GRID`` then
``BASELINES`` (the names ``splat bench --patterns`` accepts; ``suite()`` the
ones it runs by default); ``random_mask`` makes an irregular mask of any size.
Mask expressions (``masks.parse``) cover everything else.

Example:
  >>> from splat import catalogue
  >>> catalogue.named("causal_window")
  SlidingWindow(left=1023, right=0)
  >>> q_len, kv_len, mask = catalogue.ODD["rect_causal"]
  >>> mask.to_acsr(q_len, kv_len).shape
  (120, 70)
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from splat import masks
from splat.masks import Mask

__all__ = [
    "BASELINES",
    "BENCH",
    "DECODE",
    "GRID",
    "GRID_SMALL",
    "ODD",
    "SMALL",
    "Shaped",
    "named",
    "names",
    "random_mask",
    "suite",
]

BENCH: dict[str, Mask] = {
    "sliding_window": masks.sliding_window(256, 256),
    "causal_window": masks.sliding_window(1023, 0),
    "dilated_window": masks.dilated_window(512, 2),
    "block_local": masks.block_local(512, 1),
    "strided": masks.strided(64),
    "global_window": masks.global_tokens(4) | masks.sliding_window(256, 256),
    "sink_causal_window": masks.sink(4) | masks.sliding_window(1023, 0),
}

DECODE: dict[str, Mask] = {
    "causal": masks.causal(),
    "causal_window_4096": masks.sliding_window(4095, 0),
    "sink_window_4096": masks.sink(4) | masks.sliding_window(4095, 0),
    "dilated_causal": masks.dilated_window(2048, 2) & masks.causal(),
}

# Neighborhood attention on a 128 x 128 image grid and a 16 x 32 x 32 video grid (S = 16384 each).
# neighborhood_2d_k7 is the undilated twin of neighborhood_2d_dilated (same nnz, keys 2 apart).
GRID: dict[str, Mask] = {
    "neighborhood_2d": masks.neighborhood((128, 128), 15),
    "neighborhood_2d_k7": masks.neighborhood((128, 128), 7),
    "neighborhood_2d_dilated": masks.neighborhood((128, 128), 7, dilation=2),
    "neighborhood_2d_k63": masks.neighborhood((128, 128), 63),
    "neighborhood_3d": masks.neighborhood((16, 32, 32), (5, 9, 9), is_causal=(True, False, False)),
}

# The GRID patterns on grids of a hundred-odd tokens, for tests (the dilated one with an axis of
# odd length, so its two phases differ in length; the 3-D one causal in time only).
GRID_SMALL: dict[str, Mask] = {
    "neighborhood_2d": masks.neighborhood((12, 10), 5),
    "neighborhood_2d_k7": masks.neighborhood((12, 10), 3),
    "neighborhood_2d_dilated": masks.neighborhood((12, 11), 3, dilation=2),
    "neighborhood_2d_k63": masks.neighborhood((12, 10), 9),
    "neighborhood_3d": masks.neighborhood((5, 6, 7), (3, 3, 5), is_causal=(True, False, False)),
}

BASELINES: dict[str, Mask] = {
    "full": masks.full(),
    "causal": masks.causal(),
}

SMALL: dict[str, Mask] = {
    "full": masks.full(),
    "causal": masks.causal(),
    "sliding_window": masks.sliding_window(9, 9),
    "causal_window": masks.sliding_window(23, 0),
    "dilated_window": masks.dilated_window(20, 3),
    "block_local": masks.block_local(16, 1),
    "strided": masks.strided(8),
    "global_window": masks.global_tokens(3) | masks.sliding_window(9, 9),
    "sink_causal_window": masks.sink(2) | masks.sliding_window(23, 0),
    "strided_local": masks.strided(8) | masks.sliding_window(7, 0),
}


class Shaped(NamedTuple):
    """A mask with the test size it is meant for."""

    q_len: int
    kv_len: int
    mask: Mask


def random_mask(q_len: int, kv_len: int, density: float = 0.3, seed: int = 0, empty_rows: int = 0) -> Mask:
    """An irregular mask (needs the residual); the last ``empty_rows`` rows are fully masked."""
    rng = np.random.default_rng(seed)
    a = rng.random((q_len, kv_len)) < density
    if empty_rows:
        a[q_len - empty_rows :] = False
    return masks.from_array(a)


def _irregular(q_len: int, kv_len: int) -> Mask:
    """A random mask of density ~0.12 in which every row sees key 0."""
    a = np.random.default_rng(1234).random((q_len, kv_len)) < 0.12
    a[:, 0] = True
    return masks.from_array(a)


def _with_empty_rows(s: int) -> Mask:
    """A window of radius 10 with empty rows at the start, the end and inside, and a one-key row."""
    i, j = np.arange(s)[:, None], np.arange(s)[None, :]
    a = np.abs(i - j) <= 10
    a[[0, 1, 2, 3, 4, 50, s - 1]] = False
    a[60] = False
    a[60, 0] = True
    return masks.from_array(a)


ODD: dict[str, Shaped] = {
    "full": Shaped(97, 97, masks.full()),
    "causal": Shaped(160, 160, masks.causal()),
    "sliding_window": Shaped(200, 200, masks.sliding_window(16)),
    "causal_window": Shaped(190, 190, masks.sliding_window(31, 0)),
    "dilated_window": Shaped(180, 180, masks.dilated_window(24, 3)),
    "strided": Shaped(170, 170, masks.strided(7)),
    "block_local": Shaped(192, 192, masks.block_local(32, 1)),
    "global_window": Shaped(200, 200, masks.sliding_window(8) | masks.global_tokens(3)),
    # causal sinks: (sinks | causal window) & causal, the same whether sink(n) itself is causal or not
    "sink_causal_window": Shaped(180, 180, (masks.sink(4) | masks.sliding_window(16, 0)) & masks.causal()),
    "random": Shaped(150, 150, _irregular(150, 150)),
    "empty_rows": Shaped(130, 130, _with_empty_rows(130)),
    "rect_wide": Shaped(100, 230, masks.from_fn(lambda i, j: np.abs(j - 2 * i) <= 12)),
    "rect_causal": Shaped(120, 70, masks.from_fn(lambda i, j: j <= i - 50)),
    "odd_window": Shaped(277, 277, masks.sliding_window(20, 5)),
}


def named(name: str) -> Mask:
    """The benchmark mask called ``name`` (``BENCH``, ``GRID``, then ``BASELINES``).

    Raises:
      KeyError: naming the known names.
    """
    for table in (BENCH, GRID, BASELINES):
        if name in table:
            return table[name]
    raise KeyError(f"no catalogue mask named {name!r}; known: {', '.join(names())}")


def suite() -> list[str]:
    """The names ``splat bench`` runs by default: ``BENCH`` (at each ``--lengths`` S), then ``GRID``
    (each at its own S)."""
    return [*BENCH, *GRID]


def names() -> list[str]:
    """Every name :func:`named` knows, suite first."""
    return [*suite(), *BASELINES]
