"""Chunked-prefill cases shared by the cuda prefill GPU tests and the compute-sanitizer run (numpy only).

A chunk of :data:`SQ` queries (more than the decode kernel's tokens) at offsets into :data:`L`
keys (no tile multiple); per case a mask, offsets per batch row (some putting rows before or
past the layout), key and query lengths, packed documents or none, heads and KV heads.
:func:`inputs` draws one case's arrays and its per-batch dense mask.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from runtime_masks import packed_ids, runtime_dense

from splat import masks

L, SQ = 1000, 200

MASKS = {
    "causal": masks.causal(),
    "causal_window": masks.sliding_window(127, 0),
    "ahead": masks.sliding_window(100, 60),
    "dense": masks.full(),
    "sinks+window": masks.sink(4) | masks.sliding_window(127, 0),  # runs of keys, not one band
    "dilated": masks.dilated_window(96, 2) & masks.causal(),  # progressions, not one band
}

# (mask, offsets per batch row, kv lengths (None: L), q lengths (None: SQ), documents, heads, kv heads)
CASES = [
    ("causal", [0, 437, 800], [200, 637, 1000], None, False, 8, 2),
    ("causal", [300, 300], None, None, False, 4, 4),
    ("causal", [-50, 900], None, None, False, 8, 2),  # rows before and past the layout
    ("causal_window", [13, 799], [700, 999], [150, 200], False, 8, 1),
    ("ahead", [0, 500, 870], None, None, False, 8, 2),
    ("dense", [100, 0], [1000, 333], None, False, 8, 2),
    ("causal", [256, 600], None, None, True, 8, 2),
    ("causal_window", [-7, 830], [900, 1000], [190, 200], True, 4, 2),
]

# runtime_dense's argument names -> jax_bindings._runtime.build's
BUILD_NAMES = {"ids": "segment_ids", "kv_ids": "kv_segment_ids", "qlen": "query_seq_lengths",
               "kvlen": "key_value_seq_lengths"}


class Inputs(NamedTuple):
    q: np.ndarray  # [B, SQ, H, D] float32 (cast by the caller; D = 128 unless asked)
    k: np.ndarray  # [B, L, Hk, D]
    v: np.ndarray
    offsets: np.ndarray  # [B] int32
    runtime: dict  # runtime_dense's keyword arguments (numpy int32)
    dense: np.ndarray  # [B, SQ, L] bool: what each query sees


def case_id(case) -> str:
    return f"{case[0]}-{case[1]}{'-docs' if case[4] else ''}"


def inputs(case, seed: int = 0, head_dim: int = 128) -> Inputs:
    name, offsets, kv_len, q_len, docs, h, hk = case
    rng = np.random.default_rng(seed)
    b = len(offsets)
    q = rng.standard_normal((b, SQ, h, head_dim)).astype(np.float32)
    k, v = (rng.standard_normal((b, L, hk, head_dim)).astype(np.float32) for _ in range(2))
    rt = {}
    if kv_len is not None:
        rt["kvlen"] = np.asarray(kv_len, np.int32)
    if q_len is not None:
        rt["qlen"] = np.asarray(q_len, np.int32)
    if docs:
        kv_ids = packed_ids(rng, b, L, 300)
        pos = np.clip(np.asarray(offsets)[:, None] + np.arange(SQ), 0, L - 1)
        rt["ids"] = np.take_along_axis(kv_ids, pos, axis=1)  # a query's id is its position's
        rt["kv_ids"] = kv_ids
    dense = runtime_dense(MASKS[name].to_acsr(L).to_dense(), b, SQ, L, offset=offsets, **rt)
    return Inputs(q, k, v, np.asarray(offsets, np.int32), rt, dense)
