"""Named mask patterns: one catalogue feeds the tests and the benchmarks.

``BENCH`` holds the benchmark suite at the sizes the issues and papers use;
``SMALL`` the same patterns with parameters scaled for tiny test shapes
(S of a few hundred). ``random_mask`` makes an irregular mask that exercises
the block-sparse residual.
"""

from __future__ import annotations

import numpy as np

from splat import masks
from splat.masks import Mask

BENCH: dict[str, Mask] = {
    "sliding_window": masks.sliding_window(256, 256),
    "causal_window": masks.sliding_window(1023, 0),
    "dilated_window": masks.dilated_window(512, 2),
    "block_local": masks.block_local(512, 1),
    "strided": masks.strided(64),
    "global_window": masks.global_tokens(4) | masks.sliding_window(256, 256),
    "sink_causal_window": masks.sink(4) | masks.sliding_window(1023, 0),
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


def random_mask(q_len: int, kv_len: int, density: float = 0.3, seed: int = 0, empty_rows: int = 0) -> Mask:
    """An irregular mask (needs the residual); the last ``empty_rows`` rows are fully masked."""
    rng = np.random.default_rng(seed)
    a = rng.random((q_len, kv_len)) < density
    if empty_rows:
        a[q_len - empty_rows :] = False
    return masks.from_array(a)


def flops(layout, batch: int, heads: int, head_dim: int) -> int:
    """Useful forward FLOPs: ``4 * B * H * nnz * D`` (QK^T and PV, 2 FLOPs per multiply-add)."""
    return 4 * batch * heads * layout.nnz * head_dim
