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
==============  ======================================================================

``named(name)`` looks a benchmark name up in ``BENCH`` then ``BASELINES`` (the
names ``splat bench --patterns`` accepts); ``random_mask`` makes an irregular
mask of any size. Mask expressions (``masks.parse``) cover everything else.

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

__all__ = ["BASELINES", "BENCH", "ODD", "SMALL", "Shaped", "named", "names", "random_mask"]

BENCH: dict[str, Mask] = {
    "sliding_window": masks.sliding_window(256, 256),
    "causal_window": masks.sliding_window(1023, 0),
    "dilated_window": masks.dilated_window(512, 2),
    "block_local": masks.block_local(512, 1),
    "strided": masks.strided(64),
    "global_window": masks.global_tokens(4) | masks.sliding_window(256, 256),
    "sink_causal_window": masks.sink(4) | masks.sliding_window(1023, 0),
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
    """The benchmark mask called ``name`` (``BENCH``, then ``BASELINES``).

    Raises:
      KeyError: naming the known names.
    """
    for table in (BENCH, BASELINES):
        if name in table:
            return table[name]
    raise KeyError(f"no catalogue mask named {name!r}; known: {', '.join(names())}")


def names() -> list[str]:
    """Every name :func:`named` knows, suite first."""
    return [*BENCH, *BASELINES]
