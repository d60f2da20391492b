"""Runtime masks as data for the tests (numpy only): packed document ids and the per-batch dense
mask that splat.attention's runtime arguments define (its docstring's definitions)."""

from __future__ import annotations

import numpy as np


def packed_ids(rng, b: int, s: int, max_doc: int) -> np.ndarray:
    """Non-decreasing document ids ``[b, s]``, documents of 1..max_doc tokens."""
    out = np.zeros((b, s), np.int32)
    for r in range(b):
        cuts = np.cumsum(rng.integers(1, max_doc + 1, size=s))
        out[r] = np.searchsorted(cuts, np.arange(s), side="right")
    return out


def runtime_dense(static, b, sq, skv, *, ids=None, kv_ids=None, qlen=None, kvlen=None, offset=None):
    """The per-batch boolean mask ``[b, sq, skv]`` the runtime arguments define."""
    if offset is None:
        m = np.broadcast_to(static[:sq], (b, sq, skv)).copy()
    else:
        pos = np.asarray(offset).reshape(-1, 1) + np.arange(sq)
        inside = (pos >= 0) & (pos < static.shape[0])  # a position outside the layout sees no key
        m = np.broadcast_to(static[np.where(inside, pos, 0)] & inside[..., None], (b, sq, skv)).copy()
    if ids is not None:
        kv = ids if kv_ids is None else kv_ids
        m &= ids[:, :, None] == kv[:, None, :]
    if qlen is not None:
        m &= np.arange(sq)[None, :, None] < np.clip(qlen, 0, sq)[:, None, None]
    if kvlen is not None:
        m &= np.arange(skv)[None, None, :] < np.clip(kvlen, 0, skv)[:, None, None]
    return m


def build_arguments(rt: dict) -> dict:
    """The keyword arguments of ``jax_bindings._runtime.build`` for ``rt`` (as
    :func:`runtime_dense` takes them: ids, kv_ids, qlen, kvlen)."""
    names = {"ids": "segment_ids", "kv_ids": "kv_segment_ids", "qlen": "query_seq_lengths",
             "kvlen": "key_value_seq_lengths"}
    return {names[n]: x for n, x in rt.items()}
