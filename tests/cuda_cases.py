"""The band layouts the cuda backend's GPU tests and its sanitizer run share (numpy only, no JAX)."""

from __future__ import annotations

import numpy as np

import acsr

CASES = [  # (name, q_len, kv_len, left, right, H, Hkv)
    ("dense", 300, 300, None, None, 4, 2),
    ("dense_rect", 200, 700, None, None, 2, 1),
    ("causal", 385, 385, None, 0, 4, 4),
    ("causal_bottom_right", 130, 300, None, 170, 2, 2),
    ("causal_window", 600, 600, 255, 0, 4, 1),
    ("narrow_window", 257, 257, 2, 0, 2, 2),
    ("sliding_window", 515, 515, 100, 100, 2, 2),
    ("off_diagonal", 300, 260, 40, -30, 2, 1),  # rows < 30 see no key
    ("future_only", 200, 200, -1, 60, 2, 2),  # keys strictly after the query; the last row is empty
    ("empty_row_block", 400, 300, 200, -150, 2, 1),  # rows < 150 see no key: the first row block skips
]


def band_layout(q_len: int, kv_len: int, left: int | None, right: int | None) -> acsr.ACSR:
    """The layout of ``i - left <= j <= i + right`` (None: unbounded), from its dense mask."""
    i, j = np.arange(q_len)[:, None], np.arange(kv_len)[None, :]
    keep = np.ones((q_len, kv_len), bool)
    if left is not None:
        keep &= j >= i - left
    if right is not None:
        keep &= j <= i + right
    return acsr.from_dense(keep)
