"""The band layouts the cuda backend's GPU tests and its sanitizer run share (numpy only, no JAX)."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np
from runtime_masks import packed_ids

import acsr


class BandCase(NamedTuple):
    """A band layout of the cuda kernels' tests: ``a(i) - left <= j <= a(i) + right`` (None:
    unbounded), ``a(i) = i - i % block``, on ``heads`` query and ``kv_heads`` KV heads."""

    name: str
    q_len: int
    kv_len: int
    left: int | None
    right: int | None
    heads: int
    kv_heads: int
    block: int = 1

    def layout(self) -> acsr.ACSR:
        return band_layout(self.q_len, self.kv_len, self.left, self.right, self.block)


CASES = [
    BandCase("dense", 300, 300, None, None, 4, 2),
    BandCase("dense_rect", 200, 700, None, None, 2, 1),
    BandCase("causal", 385, 385, None, 0, 4, 4),
    BandCase("causal_bottom_right", 130, 300, None, 170, 2, 2),
    BandCase("causal_window", 600, 600, 255, 0, 4, 1),
    BandCase("narrow_window", 257, 257, 2, 0, 2, 2),
    BandCase("sliding_window", 515, 515, 100, 100, 2, 2),
    BandCase("off_diagonal", 300, 260, 40, -30, 2, 1),  # rows < 30 see no key
    BandCase("future_only", 200, 200, -1, 60, 2, 2),  # keys strictly after the query; the last row is empty
    BandCase("empty_row_block", 400, 300, 200, -150, 2, 1),  # rows < 150 see no key: the first block skips
    # bands measured from blocks of rows (block-local masks): blocks of whole row blocks, of
    # part of one (rows of a row block differ), block-causal, and a first block that sees nothing
    BandCase("block_local", 1100, 1100, 256, 255, 4, 2, block=256),
    BandCase("block_local_96", 700, 650, 192, 95, 2, 1, block=96),
    BandCase("block_causal", 530, 530, None, 199, 2, 2, block=200),
    BandCase("block_off_diagonal", 600, 700, 300, -50, 2, 2, block=128),
]


def band_layout(q_len: int, kv_len: int, left: int | None, right: int | None, block: int = 1) -> acsr.ACSR:
    """The layout of ``a(i) - left <= j <= a(i) + right`` (None: unbounded), ``a(i) = i - i %
    block``, from its dense mask."""
    i, j = np.arange(q_len)[:, None], np.arange(kv_len)[None, :]
    a = i - i % block
    keep = np.ones((q_len, kv_len), bool)
    if left is not None:
        keep &= j >= a - left
    if right is not None:
        keep &= j <= a + right
    return acsr.from_dense(keep)


def _gaps(b: int, sq: int, skv: int) -> dict:
    """Query ids 0, 2, 4, ... (60 rows each) against key ids 0, 1, 2, ... (200 keys each): the
    blocks of odd keys see no query."""
    return {"ids": np.tile(2 * (np.arange(sq) // 60), (b, 1)).astype(np.int32),
            "kv_ids": np.tile(np.arange(skv) // 200, (b, 1)).astype(np.int32)}


# Runtime masks on bands: (name, q_len, kv_len, left, right, H, Hkv, B, rng -> the runtime arguments
# as tests/runtime_masks.runtime_dense takes them: ids, kv_ids, qlen, kvlen)
RUNTIME_CASES = [
    ("document_causal", 700, 700, None, 0, 4, 2, 2, lambda rng: {"ids": packed_ids(rng, 2, 700, 300)}),
    ("tiny_documents_dense", 300, 300, None, None, 2, 2, 2, lambda rng: {"ids": packed_ids(rng, 2, 300, 5)}),
    ("document_window", 600, 600, 255, 0, 4, 1, 2, lambda rng: {"ids": packed_ids(rng, 2, 600, 200)}),
    # batch row 0 sorted (walks cut to its documents), row 1 not (every tile compares ids)
    ("mixed_sortedness_causal", 385, 385, None, 0, 2, 2, 2,
     lambda rng: {"ids": np.stack([packed_ids(rng, 1, 385, 90)[0],
                                   rng.integers(0, 4, size=385)]).astype(np.int32)}),
    ("rectangular_gaps", 300, 1100, None, None, 2, 1, 2, lambda rng: _gaps(2, 300, 1100)),
    ("padding_causal", 500, 500, None, 0, 2, 2, 3,
     lambda rng: {"qlen": np.array([450, 0, 130], np.int32), "kvlen": np.array([500, 200, 0], np.int32)}),
    ("lengths_clipped_dense", 300, 450, None, None, 2, 2, 2,
     lambda rng: {"qlen": np.array([-5, 1000], np.int32), "kvlen": np.array([1000, 12], np.int32)}),
    ("everything_window", 515, 515, 100, 100, 4, 2, 3,
     lambda rng: {"ids": packed_ids(rng, 3, 515, 150), "qlen": np.array([515, 300, 2], np.int32),
                  "kvlen": np.array([400, 515, 515], np.int32)}),
]

# (grid, kernel_size, keywords, heads, kv heads)
GRID_CASES = [  # the cuda grid forward's cases (N-D neighborhoods)
    ((16, 20), (7, 5), {}, 4, 2),
    ((20, 24), (17, 19), {}, 2, 2),  # tiles inside every window
    ((24, 24), 7, {"dilation": 2}, 2, 1),
    ((12, 11), (5, 3), {"dilation": (2, 3)}, 2, 2),  # 3 does not divide 11
    ((9, 11), (5, 3), {"stride": (2, 3)}, 2, 2),
    ((7, 9), (6, 4), {}, 2, 2),  # even kernels
    ((6, 12, 12), (3, 5, 5), {"is_causal": (True, False, False)}, 4, 1),
    ((3, 6, 6), (2, 3, 3), {"dilation": (1, 2, 1), "stride": (1, 1, 2)}, 2, 2),
    ((40, 48), 15, {}, 2, 2),
    ((32, 40), 31, {}, 2, 1),
]

# forced (q_tile, k_tile) shapes of the cuda grid forward (not the planner's): tiles of 2 to 64
# coordinates on the last axis, one coordinate on an outer one, patches split along another axis
GRID_SHAPE_CASES = [
    (((6, 12, 12), (3, 5, 5), {"is_causal": (True, False, False)}), ((2, 8, 8), (1, 8, 16))),
    (((40, 48), 15, {}), ((1, 16, 8), (1, 6, 24))),
    (((40, 48), 15, {}), ((1, 8, 16), (1, 4, 32))),
    (((20, 24), (17, 19), {}), ((1, 16, 8), (1, 2, 64))),
    (((24, 24), 7, {"dilation": 2}), ((1, 16, 8), (1, 1, 64))),
]


def other_key_orders(variant, q_shape, k_shape) -> list:
    """A backward variant (``plan.BwdVariant``) in each key order the planner did not pick, so that
    every order runs on every band; in sections of one KV head for ``q [B, Sq, H, D]`` and ``k
    [B, Skv, Hkv, D]`` (so that ``first_first_at_end`` takes both orders in one launch)."""
    from jax_bindings._cuda import bwd_source  # here: the cases themselves import no JAX

    one_head = bwd_source.section_bytes_of(1, q_shape[2] // k_shape[2], q_shape[1])
    return [dataclasses.replace(variant, key_order=o, section_bytes=one_head)
            for o in bwd_source.KEY_ORDERS if o != variant.key_order]
