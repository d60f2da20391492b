"""Decode cases shared by the CUDA decode kernel's GPU tests and its compute-sanitizer run (numpy only).

A cache of :data:`L` keys (no multiple of a tile or a page); per case a mask, head dim, query tokens
a row, heads and KV heads, a page size (0: contiguous) and a split count (None: the planner's).
:func:`inputs` draws one case's arrays with odd rows (a token outside the cache, a padded token),
:func:`paged` moves a cache into a shuffled page pool with NaN pages nobody maps, :func:`reference`
is the float64 result over what each token sees.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

import splat
from splat import masks

L = 1000

MASKS = {
    "causal": masks.causal(),
    "window": masks.sliding_window(63, 0),
    "sinks+window": masks.sink(4) | masks.sliding_window(127, 0),
    "dilated": masks.dilated_window(96, 2) & masks.causal(),
    "strided": masks.causal() & masks.strided(8),
}

# (mask, head dim, tokens, heads, kv heads, page size, splits): a spread over the variant space
CASES = [
    ("causal", 128, 1, 8, 2, 0, None),
    ("causal", 128, 1, 8, 2, 0, 1),
    ("causal", 128, 1, 8, 2, 0, 7),
    ("window", 128, 1, 32, 8, 0, None),
    ("window", 128, 4, 8, 2, 16, None),
    ("sinks+window", 128, 1, 8, 2, 0, 5),
    ("sinks+window", 64, 4, 8, 8, 64, None),
    ("dilated", 128, 1, 4, 4, 0, 3),
    ("dilated", 96, 3, 8, 1, 0, None),
    ("strided", 256, 1, 8, 2, 16, None),
    ("strided", 128, 16, 8, 2, 0, 2),
    ("causal", 256, 16, 8, 2, 64, None),
    ("causal", 64, 1, 32, 1, 0, None),
    ("window", 128, 16, 32, 8, 16, 4),
]


class Inputs(NamedTuple):
    q: np.ndarray  # [B, T, H, D] float32 (cast by the caller)
    k: np.ndarray  # [B, L, Hk, D]
    v: np.ndarray
    q_len: np.ndarray  # [B] int32
    kv_len: np.ndarray  # [B] int32
    q_pos: np.ndarray  # [B, T] int32, -1: outside the cache
    q_ids: np.ndarray | None  # [B, T] int32
    kv_ids: np.ndarray | None  # [B, L] int32
    visible: np.ndarray  # [B, T, L] bool: what each token sees


def inputs(rng, b, t, h, hk, d, mask, *, ids=None, odd_rows=True) -> Inputs:
    """One case's arrays: the tokens at each row's newest positions, row 0 full, row 1 (with
    ``odd_rows``) with token 0 outside the cache and its last token padding. ``ids``:
    ``"documents"`` (sorted ids, packed documents) or ``"any"`` (random ids in 0..2)."""
    q = rng.standard_normal((b, t, h, d)).astype(np.float32)
    k, v = (rng.standard_normal((b, L, hk, d)).astype(np.float32) for _ in range(2))
    kv_len = rng.integers(t + 1, L + 1, size=b).astype(np.int32)
    kv_len[0] = L
    q_pos = (kv_len[:, None] - t + np.arange(t)[None, :]).astype(np.int32)
    q_len = np.full(b, t, np.int32)
    if odd_rows and b > 1:
        q_pos[1, 0] = -1
        q_len[1] = t - 1 if t > 1 else t
    dense = splat.analyze(mask, L, L).to_dense()
    j = np.arange(L)
    vis = np.zeros((b, t, L), bool)
    for bi in range(b):
        for ti in range(t):
            p = q_pos[bi, ti]
            if p >= 0 and ti < q_len[bi]:
                vis[bi, ti] = dense[p] & (j < kv_len[bi])
    q_ids = kv_ids = None
    if ids == "documents":
        bounds = np.sort(rng.integers(0, L, size=(b, 3)), axis=1)
        kv_ids = (j[None, :, None] >= bounds[:, None, :]).sum(-1).astype(np.int32)
        q_ids = np.take_along_axis(kv_ids, np.maximum(q_pos, 0), axis=1)
    elif ids == "any":
        kv_ids = rng.integers(0, 3, size=(b, L)).astype(np.int32)
        q_ids = rng.integers(0, 3, size=(b, t)).astype(np.int32)
    if ids is not None:
        vis &= q_ids[:, :, None] == kv_ids[:, None, :]
    return Inputs(q, k, v, q_len, kv_len, q_pos, q_ids, kv_ids, vis)


def paged(rng, k, v, page_size):
    """``(k_pool, v_pool, page_table)``: the caches in a shuffled pool of pages (float32), with
    three pages of NaN that no row maps."""
    b, _, hk, d = k.shape
    per = -(-L // page_size)
    pages = b * per + 3
    order = rng.permutation(pages)[: b * per].reshape(b, per).astype(np.int32)
    pools = []
    for x in (k, v):
        pool = np.full((pages, page_size, hk, d), np.nan, np.float32)
        xp = np.pad(np.asarray(x, np.float32), ((0, 0), (0, per * page_size - L), (0, 0), (0, 0)))
        for bi in range(b):
            pool[order[bi]] = xp[bi].reshape(per, page_size, hk, d)
        pools.append(pool)
    return pools[0], pools[1], order


def reference(q, k, v, visible, scale, soft_cap=None):
    """float64 ``(out [B, T, H, D], lse [B, H, T])`` of the tokens over the keys they see."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    g = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
    s = np.einsum("bthd,bjhd->bhtj", q, k) * scale
    if soft_cap is not None:
        s = soft_cap * np.tanh(s / soft_cap)
    m = visible[:, None]
    s = np.where(m, s, -np.inf)
    mx = s.max(-1, keepdims=True)
    mx = np.where(np.isfinite(mx), mx, 0.0)
    e = np.where(m, np.exp(s - mx), 0.0)
    tot = e.sum(-1, keepdims=True)
    with np.errstate(divide="ignore"):
        lse = np.where(tot > 0, mx + np.log(tot), -np.inf)[..., 0]
    return np.einsum("bhtj,bjhd->bthd", e / np.where(tot > 0, tot, 1.0), v), lse
