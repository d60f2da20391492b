"""Decode (KV-cache) benchmark: ``splat.attention_with_kvcache`` against its peers, in one process.

Every speed claim about splat's decode comes from this script. Each case builds one set of
inputs (a query of ``Sq`` tokens per row against a cache of ``Lmax`` keys, ``cache_seqlens``
valid), runs every peer on them, checks every output against splat's, then samples all peers
in interleaved rounds (:data:`splat.tools.timing.INTERLEAVING`) and reports ms per call, GB/s,
the fraction of the HBM peak, useful TFLOP/s and the ratio to splat.

Cases (full profile: bf16, Hq = 32, Hk = 8, D = 128, Sq = 1, ``cache_seqlens`` = the cache
length in every row; ``--quick`` shrinks them, on a CPU to B = 2, cache 256, H = 4, Hk = 2,
D = 32, float32):

================  ==========================================================================
case              what
================  ==========================================================================
causal            ``causal()``, B = 8, cache 32768
causal_long       ``causal()``, B = 1, cache 131072
causal_wide       ``causal()``, B = 64, cache 8192
window            ``sliding_window(4095, 0)`` (a causal window of 4096 keys), B = 8, cache 32768
sink_window       ``sink(4) | sliding_window(4095, 0)`` (catalogue ``sink_causal_window``, longer)
dilated           ``dilated_window(2048, 2) & causal()``
documents         ``causal()`` + segment ids: documents of 4K..32K tokens packed into the cache,
                  the query in the last one
paged16, paged64  the ``causal`` case from a paged cache (page size 16, 64; shuffled page table)
spec4, spec16     speculative decoding: Sq = 4, 16 at the ``causal`` case's sizes
chunk             chunked prefill: a 2048-token chunk at offset 30720 of a 32768 cache, causal
                  (B = 1: one request's chunk)
chunk_sink_window the same chunk with ``sink(4) | sliding_window(4095, 0)`` (runs of keys that
                  are no one band: the Triton kernel's blocks of rows)
================  ==========================================================================

Peers (each skipped with its reason where it cannot run or cannot express the case):

================  ==========================================================================
peer              what
================  ==========================================================================
splat             ``splat.attention_with_kvcache(q, k_cache, v_cache, mask, cache_seqlens=,
                  [page_table=, segment_ids=, kv_segment_ids=], backend=)``
splat_contiguous  paged cases: the same call on the contiguous cache (the rate paged must keep)
splat_attention   ``splat.attention(q, k_cache, v_cache, mask, q_offset=cache_seqlens - Sq,
                  key_value_seq_lengths=cache_seqlens)``: the same work through the prefill API
splat_prefill     chunk only: ``splat.attention`` on the chunk's own 2048 x 2048 causal square:
                  NOT the same work; compared by useful TFLOP/s, never by ms
flash_attn3       ``flash_attn3_jax.flash_mha_with_kvcache`` (keywords detected with
                  ``inspect``), once per ``num_splits`` (its default, then 1, 4, 16, 32); the
                  best agreeing one is the row targets compare with. Causal, causal window
                  (``window_size=(4095, 0)``), documents (``cache_leftpad`` = the query's
                  document start) and paged (``page_table``)
cudnn             ``jax.nn.dot_product_attention(..., key_value_seq_lengths=cache_seqlens,
                  implementation="cudnn")`` at Sq = 1 without the causal flag (the last position
                  sees every valid key); its causal mask and window are aligned top-left, so
                  windows and Sq > 1 are skipped (measured: their outputs differ)
dense_xla         ``jax.nn.dot_product_attention(..., mask=[B, 1, Sq, Lmax] bool,
                  implementation="xla")``: every score of the cache
flex              torch ``flex_attention`` (``torch.compile``d; FlexDecoding for small Sq) with a
                  ``create_block_mask`` of the case's mask at the query positions, GQA
triton_spike      ``decode(q, k_cache, v_cache, cache_seqlens, window=)`` of
                  ``benchmarks/spikes/spike_decode_triton.py`` where that file exists (recorded as
                  absent otherwise): contiguous causal and causal-window caches, Sq <= 16
================  ==========================================================================

Targets (``--assert`` exits 1 on a miss, naming it; a target that cannot be judged, a peer or
the HBM peak missing, is a miss too): causal cases >= 1.0x the faster of FA3 (best
``num_splits``) and cuDNN and >= 85% of HBM; window >= 1.3x FA3 and >= 80% of HBM;
sink_window, dilated, documents >= 75% of HBM; chunk >= 1.0x FA3; paged >= 0.95x contiguous.

Run on the GPU machine (H200)::

    python3 benchmarks/bench_decode.py --out benchmarks/results/decode-<device>.json \
        --plot benchmarks/results/decode-<device>.png
    python3 benchmarks/bench_decode.py --quick            # small sizes, a set-up check
    python3 benchmarks/bench_decode.py --cases 'causal*' window --assert
"""

from __future__ import annotations

import argparse
import datetime as _dt
import fnmatch
import functools
import gc
import importlib
import importlib.util
import inspect
import os
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

SCHEMA = "splat-bench-decode/1"

# HBM peak by device name (TB/s), first match wins; None: not known, pass --hbm-tbps.
# GH200 ships with HBM3 (4.0) or HBM3e (4.9): the name does not say which.
HBM_TBPS: tuple[tuple[str, float | None], ...] = (
    ("GH200", None),
    ("H200", 4.8),
    ("H100 PCIe", 2.0),
    ("H100", 3.35),
)

# Output check: max |peer out - reference out| above this flags a disagreement (per input dtype).
ABS_TOL = {"bfloat16": 2e-2, "float16": 1e-2, "float32": 1e-4}
FA3_SPLITS = (1, 4, 16, 32)
# dense_xla materialises B * H * Sq * Lmax float32 scores (and a few temporaries of that size)
_MAX_DENSE_SCORES = 1 << 31

BYTES_DEFINITION = (
    "kv_bytes = sum over batch rows of (keys visible to at least one query of the row) * Hk * D * "
    "itemsize * 2 (K and V); GB/s = kv_bytes / median ms; hbm_fraction = GB/s / the HBM peak"
)
FLOP_FORMULA = (
    "useful FLOPs = 4 * H * D * (visible (query, key) pairs over all rows); for the chunk: "
    "4 * B * H * D * sum over the chunk's rows of visible keys"
)
RATIO_DEFINITION = (
    "vs_splat = peer median ms / splat median ms (> 1: splat is faster), only for rows doing the "
    "case's work (same_work); other rows compare by TFLOP/s"
)
# ... and above this fraction of max|reference| (splat.tools.check's tolerance): decode outputs are
# averages over thousands of keys, |out| ~ 0.02 at 32K, where an absolute bound alone sees nothing.
REL_TOL = {"bfloat16": 3e-2, "float16": 5e-3, "float32": 5e-3}
CHECK_RULE = (
    "each peer's output against the reference (splat's; dense_xla's where splat did not run), "
    "both as float32 on the same inputs: agrees iff max|peer - reference| <= "
    + ", ".join(f"{v:g} ({k})" for k, v in ABS_TOL.items())
    + " and <= "
    + ", ".join(f"{v:g} ({k})" for k, v in REL_TOL.items())
    + " x max|reference|"
)

__all__ = [
    "ABS_TOL",
    "DECODE_PEERS",
    "FULL",
    "QUICK",
    "SCHEMA",
    "TINY",
    "Case",
    "DecodeBenchConfig",
    "Profile",
    "Target",
    "evaluate_targets",
    "format_table",
    "hbm_peak",
    "main",
    "make_cases",
    "pack_documents",
    "paged_cache",
    "run_decode_bench",
]


# --- sizes ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Profile:
    """The sizes of one run's cases.

    Attributes:
      name: "full", "quick" or "tiny".
      heads, kv_heads, head_dim, dtype: Hq, Hk, D and the inputs' dtype.
      batch, cache_len: the base case (``causal`` and every case built on it).
      long, wide: ``(B, Lmax)`` of ``causal_long`` and ``causal_wide``.
      window: keys of the causal window (the query's own included): ``sliding_window(window - 1, 0)``.
      sinks: sink tokens of ``sink_window``.
      dilated: ``(radius, dilation)`` of ``dilated``.
      docs: ``(min, max)`` document lengths of ``documents``.
      spec: query lengths of the speculative cases.
      chunk, chunk_batch: the chunked prefill's query length and B.
      pages: page sizes of the paged cases.
      warmup, repeats: untimed samples, and timed rounds.
    """

    name: str
    heads: int
    kv_heads: int
    head_dim: int
    dtype: str
    batch: int
    cache_len: int
    long: tuple[int, int]
    wide: tuple[int, int]
    window: int
    sinks: int
    dilated: tuple[int, int]
    docs: tuple[int, int]
    spec: tuple[int, ...]
    chunk: int
    chunk_batch: int
    pages: tuple[int, ...]
    warmup: int
    repeats: int


FULL = Profile(
    name="full", heads=32, kv_heads=8, head_dim=128, dtype="bfloat16", batch=8, cache_len=32768,
    long=(1, 131072), wide=(64, 8192), window=4096, sinks=4, dilated=(2048, 2), docs=(4096, 32768),
    spec=(4, 16), chunk=2048, chunk_batch=1, pages=(16, 64), warmup=3, repeats=10,
)  # fmt: skip
# --quick on a GPU: the peers' shapes (bf16, D = 128) at small sizes, a set-up check
QUICK = Profile(
    name="quick", heads=32, kv_heads=8, head_dim=128, dtype="bfloat16", batch=2, cache_len=4096,
    long=(1, 16384), wide=(8, 2048), window=1024, sinks=4, dilated=(512, 2), docs=(512, 4096),
    spec=(4, 16), chunk=512, chunk_batch=1, pages=(16, 64), warmup=1, repeats=3,
)  # fmt: skip
# --quick on a CPU: a smoke test with the peers that run there
TINY = Profile(
    name="tiny", heads=4, kv_heads=2, head_dim=32, dtype="float32", batch=2, cache_len=256,
    long=(1, 512), wide=(4, 128), window=64, sinks=4, dilated=(32, 2), docs=(32, 256),
    spec=(4, 16), chunk=64, chunk_batch=1, pages=(16, 64), warmup=0, repeats=2,
)  # fmt: skip
PROFILES = {p.name: p for p in (FULL, QUICK, TINY)}


def hbm_peak(device_kind: str, override: float | None = None) -> tuple[float | None, str]:
    """``(TB/s, where it came from)``: ``override`` if given, else :data:`HBM_TBPS` by device name."""
    if override is not None:
        return float(override), "--hbm-tbps"
    for key, tbps in HBM_TBPS:
        if key.lower() in device_kind.lower():
            if tbps is None:
                return None, f"{device_kind!r} matches {key!r}, whose peak varies: pass --hbm-tbps"
            return tbps, f"table: {key}"
    return None, f"no HBM peak known for {device_kind!r}: pass --hbm-tbps"


# --- cases -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """One claim a case must meet under ``--assert``.

    ``metric``: ``"vs_peers"`` (splat's speed-up over the fastest agreeing row of ``peers``, FA3
    at its best ``num_splits``), ``"hbm"`` (splat's fraction of the HBM peak) or
    ``"vs_contiguous"`` (splat_contiguous ms / splat ms: the paged rate against the contiguous).
    """

    metric: str
    threshold: float
    peers: tuple[str, ...] = ()

    def describe(self) -> str:
        if self.metric == "vs_peers":
            return f"splat >= {self.threshold:g}x the faster of {' and '.join(self.peers)}"
        if self.metric == "hbm":
            return f"splat >= {self.threshold:.0%} of HBM"
        return f"paged splat >= {self.threshold:g}x contiguous splat's speed"


@dataclass(frozen=True, eq=False)
class Case:
    """One decode problem: the same inputs for every peer.

    Query row ``i`` of batch row ``b`` sits at position ``cache_seqlens[b] - Sq + i``; it sees key
    ``j`` iff ``j < cache_seqlens[b]``, the static ``mask`` holds at ``(position, j)`` and, with
    ``segments``, the two are in the same document.

    Attributes:
      name, what: the case's name (``--cases``) and a line saying what it is.
      mask_expr: the static mask as a :func:`splat.masks.parse` expression.
      batch, cache_len, sq: B, Lmax, Sq.
      heads, kv_heads, head_dim, dtype: Hq, Hk, D and the dtype of q and the cache.
      seqlens: int32 ``[B]``, the valid keys of each row (``cache_seqlens``).
      window: the causal window's keys behind the query (FA3's ``window_size[0]``); None: none.
      band: the mask is causal or a causal window (what FA3 and cuDNN express).
      segments: int32 ``[B, Lmax]`` document ids of the cache, non-decreasing; None: no documents.
      page_size: tokens a page (paged cases); None: a contiguous cache.
      targets: what ``--assert`` checks.
    """

    name: str
    what: str
    mask_expr: str
    batch: int
    cache_len: int
    sq: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype: str
    seqlens: np.ndarray
    window: int | None = None
    band: bool = True
    segments: np.ndarray | None = None
    page_size: int | None = None
    targets: tuple[Target, ...] = ()

    @functools.cached_property
    def mask(self):
        from splat import masks

        return masks.parse(self.mask_expr)

    @property
    def positions(self) -> np.ndarray:
        """int64 ``[B, Sq]``: each query row's position in its cache row."""
        return self.seqlens[:, None].astype(np.int64) - self.sq + np.arange(self.sq)

    @functools.cached_property
    def visible(self) -> np.ndarray:
        """bool ``[B, Sq, Lmax]``: query ``i`` of row ``b`` sees key ``j``."""
        out = np.zeros((self.batch, self.sq, self.cache_len), bool)
        j = np.arange(self.cache_len)
        for b in range(self.batch):
            for r0 in range(0, self.sq, 256):
                pos = self.positions[b, r0 : r0 + 256, None]
                seen = np.asarray(self.mask(pos, j[None]), bool) & (j[None] < self.seqlens[b])
                if self.segments is not None:
                    seen &= self.segments[b][None] == self.segments[b, pos]
                out[b, r0 : r0 + 256] = seen
        return out

    @functools.cached_property
    def keys_needed(self) -> np.ndarray:
        """int64 ``[B]``: keys of each row visible to at least one of its queries."""
        return self.visible.any(axis=1).sum(axis=-1)

    @property
    def itemsize(self) -> int:
        return {"float32": 4, "bfloat16": 2, "float16": 2}[self.dtype]

    @property
    def kv_bytes(self) -> int:
        """Bytes of K and V the mask needs (:data:`BYTES_DEFINITION`)."""
        return int(self.keys_needed.sum()) * self.kv_heads * self.head_dim * self.itemsize * 2

    @functools.cached_property
    def pairs(self) -> int:
        """Visible (query, key) pairs over all rows."""
        return int(self.visible.sum())

    @property
    def flops(self) -> float:
        """Useful FLOPs of one call (:data:`FLOP_FORMULA`)."""
        return 4.0 * self.heads * self.head_dim * self.pairs

    @property
    def doc_starts(self) -> np.ndarray:
        """int32 ``[B]``: where the last query's document starts (FA3's ``cache_leftpad``)."""
        last = self.seqlens.astype(np.int64) - 1
        ids = self.segments[np.arange(self.batch), last]
        return np.array([np.argmax(self.segments[b] == ids[b]) for b in range(self.batch)], np.int32)

    def describe(self) -> dict:
        """The case as JSON: sizes, mask, the bytes and FLOPs behind its rates."""
        d = {
            "what": self.what,
            "mask": self.mask_expr,
            "B": self.batch,
            "cache_len": self.cache_len,
            "Sq": self.sq,
            "heads": self.heads,
            "kv_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "dtype": self.dtype,
            "cache_seqlens": self.seqlens.tolist(),
            "keys_needed": self.keys_needed.tolist(),
            "kv_bytes": self.kv_bytes,
            "pairs": self.pairs,
            "flops": self.flops,
            "page_size": self.page_size,
            "targets": [t.describe() for t in self.targets],
        }
        if self.segments is not None:
            d["query_document_start"] = self.doc_starts.tolist()
        return d


def pack_documents(rng: np.random.Generator, batch: int, length: int, lo: int, hi: int) -> np.ndarray:
    """int32 ``[batch, length]`` document ids (0, 1, ... per row) of documents of ``lo..hi`` tokens.

    Lengths are drawn uniformly until they fill the row; a row whose last document would come out
    shorter than ``lo`` is drawn again (up to 1000 times, then kept as cut), so that the query's
    document, the last, is no shorter than the others.
    """
    if not 0 < lo <= hi:
        raise ValueError(f"document lengths need 0 < lo <= hi, got {lo}, {hi}")
    ids = np.empty((batch, length), np.int32)
    for b in range(batch):
        for _ in range(1000):
            lens, total = [], 0
            while total < length:
                lens.append(int(rng.integers(lo, hi + 1)))
                total += lens[-1]
            lens[-1] -= total - length
            if lens[-1] >= min(lo, length):
                break
        ids[b] = np.repeat(np.arange(len(lens)), lens)
    return ids


def make_cases(profile: Profile, seed: int = 0) -> list[Case]:
    """Every case of the module docstring at ``profile``'s sizes (documents drawn from ``seed``)."""
    p = profile
    common = dict(heads=p.heads, kv_heads=p.kv_heads, head_dim=p.head_dim, dtype=p.dtype)

    def case(name, what, expr, b, length, sq=1, **kw) -> Case:
        lens = np.full(b, length, np.int32)
        return Case(name, what, expr, b, length, sq, seqlens=lens, **common, **kw)

    vs_fast = (Target("vs_peers", 1.0, ("flash_attn3", "cudnn")), Target("hbm", 0.85))
    b, length, w = p.batch, p.cache_len, p.window
    win = f"sliding_window({w - 1}, 0)"
    cases = [
        case("causal", f"causal decode, B={b}, cache {length}", "causal()", b, length, targets=vs_fast),
        case(
            "causal_long",
            f"causal decode, B={p.long[0]}, cache {p.long[1]}",
            "causal()",
            *p.long,
            targets=vs_fast,
        ),
        case(
            "causal_wide",
            f"causal decode, B={p.wide[0]}, cache {p.wide[1]}",
            "causal()",
            *p.wide,
            targets=vs_fast,
        ),
        case(
            "window",
            f"causal window of {w} keys, B={b}, cache {length}",
            win,
            b,
            length,
            window=w - 1,
            targets=(Target("vs_peers", 1.3, ("flash_attn3",)), Target("hbm", 0.80)),
        ),
        case(
            "sink_window",
            f"{p.sinks} sinks + causal window of {w}, B={b}, cache {length}",
            f"sink({p.sinks}) | {win}",
            b,
            length,
            band=False,
            targets=(Target("hbm", 0.75),),
        ),
        case(
            "dilated",
            f"dilated window (radius {p.dilated[0]}, dilation {p.dilated[1]}), causal, B={b}, cache {length}",
            f"dilated_window({p.dilated[0]}, {p.dilated[1]}) & causal()",
            b,
            length,
            band=False,
            targets=(Target("hbm", 0.75),),
        ),
        case(
            "documents",
            f"packed documents of {p.docs[0]}..{p.docs[1]} tokens, causal, the query in the "
            f"last, B={b}, cache {length}",
            "causal()",
            b,
            length,
            segments=pack_documents(np.random.default_rng(seed), b, length, *p.docs),
            targets=(Target("hbm", 0.75),),
        ),
    ]
    for ps in p.pages:
        cases.append(
            case(
                f"paged{ps}",
                f"causal decode from pages of {ps} tokens (shuffled page table), B={b}, cache {length}",
                "causal()",
                b,
                length,
                page_size=ps,
                targets=(Target("vs_contiguous", 0.95),),
            )
        )
    for sq in p.spec:
        cases.append(
            case(
                f"spec{sq}",
                f"speculative decode, Sq={sq}, causal, B={b}, cache {length}",
                "causal()",
                b,
                length,
                sq=sq,
            )
        )
    cb = p.chunk_batch
    cases.append(
        case(
            "chunk",
            f"chunked prefill: {p.chunk} tokens at offset {length - p.chunk} of a "
            f"{length} cache, causal, B={cb}",
            "causal()",
            cb,
            length,
            sq=p.chunk,
            targets=(Target("vs_peers", 1.0, ("flash_attn3",)),),
        )
    )
    cases.append(
        case(
            "chunk_sink_window",
            f"chunked prefill: {p.chunk} tokens at offset {length - p.chunk} of a "
            f"{length} cache, sink(4) | sliding_window({w - 1}, 0) (no one band), B={cb}",
            f"sink(4) | sliding_window({w - 1}, 0)",
            cb,
            length,
            sq=p.chunk,
        )
    )
    return cases


def select_cases(cases: list[Case], patterns: Sequence[str] | None) -> list[Case]:
    """The cases whose name matches one of ``patterns`` (shell globs), in their own order."""
    if not patterns:
        return cases
    names = [c.name for c in cases]
    bad = [p for p in patterns if not fnmatch.filter(names, p)]
    if bad:
        raise ValueError(f"no case matches {bad}; cases: {', '.join(names)}")
    return [c for c in cases if any(fnmatch.fnmatchcase(c.name, p) for p in patterns)]


# --- inputs ------------------------------------------------------------------------------------


def paged_cache(cache, page_size: int, rng: np.random.Generator):
    """``(pool, page_table)`` holding ``cache [B, Lmax, Hk, D]`` in shuffled pages.

    ``pool``: ``[B * Lmax / page_size, page_size, Hk, D]``; ``page_table``: int32
    ``[B, Lmax / page_size]``, page ``p`` of row ``b`` at ``pool[page_table[b, p]]``, the pages of
    all rows in one random order.
    """
    import jax.numpy as jnp

    b, length, hk, d = cache.shape
    if length % page_size:
        raise ValueError(f"cache length {length} is not a multiple of the page size {page_size}")
    n = b * length // page_size
    perm = rng.permutation(n)
    pool = cache.reshape(n, page_size, hk, d)[jnp.asarray(np.argsort(perm))]
    return pool, jnp.asarray(perm.reshape(b, -1).astype(np.int32))


@dataclass(frozen=True, eq=False)
class Inputs:
    """A case's inputs on the device (jax arrays). ``q [B, Sq, H, D]``, ``k, v [B, Lmax, Hk, D]``,
    ``lens [B]`` int32; ``seg_q [B, Sq]``, ``seg_kv [B, Lmax]`` int32 with documents; ``pool_k,
    pool_v, page_table`` in paged cases (:func:`paged_cache`)."""

    q: object
    k: object
    v: object
    lens: object
    seg_q: object = None
    seg_kv: object = None
    pool_k: object = None
    pool_v: object = None
    page_table: object = None


def make_inputs(case: Case, seed: int) -> Inputs:
    import jax
    import jax.numpy as jnp

    from splat.tools.peers import jax_dtype

    dt = jax_dtype(case.dtype)
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(kq, (case.batch, case.sq, case.heads, case.head_dim), dt)
    shape = (case.batch, case.cache_len, case.kv_heads, case.head_dim)
    k, v = jax.random.normal(kk, shape, dt), jax.random.normal(kv, shape, dt)
    kw = {}
    if case.segments is not None:
        rows = np.arange(case.batch)[:, None]
        kw["seg_q"] = jnp.asarray(case.segments[rows, case.positions])
        kw["seg_kv"] = jnp.asarray(case.segments)
    if case.page_size is not None:
        rng = np.random.default_rng(seed)
        kw["pool_k"], kw["page_table"] = paged_cache(k, case.page_size, rng)
        kw["pool_v"] = paged_cache(v, case.page_size, np.random.default_rng(seed))[0]  # same pages
    return Inputs(q, k, v, jnp.asarray(case.seqlens), **kw)


# --- runs ------------------------------------------------------------------------------------


class PeerUnavailable(Exception):
    """This peer cannot run this case here; ``str(e)`` says why."""


@dataclass(frozen=True)
class Context:
    """What every peer's ``prepare`` needs beyond the case: calls a JAX launch chains, splat's backend,
    FA3's ``num_splits`` sweep."""

    per_sample: int
    backend: str = "auto"
    fa3_splits: tuple[int, ...] = FA3_SPLITS
    seed: int = 0


@dataclass(frozen=True)
class Run:
    """One prepared peer: ``launch()`` enqueues ``calls_per_launch`` calls, ``sync()`` waits;
    ``outputs()`` is one call's output as float32 numpy ``[B, Sq, H, D]``.

    ``same_work``: it computes the case itself (else ``flops``/``kv_bytes`` are its own work and
    its output is not checked). ``extra``: fields for its row (``num_splits``, ``kernels``).
    """

    impl: str
    label: str
    launch: Callable[[], None]
    sync: Callable[[], None]
    calls_per_launch: int
    outputs: Callable[[], np.ndarray]
    note: str = ""
    same_work: bool = True
    flops: float | None = None
    kv_bytes: float | None = None
    extra: dict = field(default_factory=dict)


def _custom_calls(compiled) -> list[str]:
    """The custom-call targets of a compiled JAX program (which kernels it launches)."""
    try:
        return sorted(set(re.findall(r'custom_call_target="([^"]+)"', compiled.as_text())))
    except Exception:  # a record of what ran must not stop the run
        return []


def _jax_run(
    impl: str,
    fn: Callable,
    args: tuple,
    ctx: Context,
    *,
    label: str | None = None,
    note: str = "",
    kernels: bool = False,
    **kw,
) -> Run:
    """``fn(*args)`` compiled, and ``ctx.per_sample`` calls chained in one executable for timing
    (:func:`splat.tools.timing.compile_timed`; ``out`` is the next call's ``q``, argument 0)."""
    import jax
    import jax.numpy as jnp

    from splat.tools.timing import compile_timed

    compiled, launch, sync = compile_timed(fn, args, ctx.per_sample, {0: 0})
    extra = dict(kw.pop("extra", {}))
    if kernels:
        extra["kernels"] = _custom_calls(compiled)

    def outputs():
        return np.asarray(jax.block_until_ready(compiled(*args)).astype(jnp.float32))

    return Run(impl, label or impl, launch, sync, ctx.per_sample, outputs, note, extra=extra, **kw)


def _require_gpu_dtype(case: Case, who: str) -> None:
    if case.dtype == "float32":
        raise PeerUnavailable(f"{who} takes float16/bfloat16 only")


# --- splat -------------------------------------------------------------------------------------


def _kvcache_fn():
    import splat

    fn = getattr(splat, "attention_with_kvcache", None)
    if fn is None:
        raise PeerUnavailable("splat.attention_with_kvcache is not in this build")
    return fn


def _splat_call(case: Case, x: Inputs, ctx: Context, paged: bool) -> tuple[Callable, tuple, str]:
    attend, mask, backend = _kvcache_fn(), case.mask, ctx.backend
    if paged:

        def fn(q, kp, vp, lens, table):
            return attend(q, kp, vp, mask, cache_seqlens=lens, page_table=table, backend=backend)

        note = f"pool {list(x.pool_k.shape)}, page table {list(x.page_table.shape)} (shuffled)"
        return fn, (x.q, x.pool_k, x.pool_v, x.lens, x.page_table), note
    if case.segments is not None:

        def fn(q, k, v, lens, ids_q, ids_kv):
            return attend(
                q, k, v, mask, cache_seqlens=lens, segment_ids=ids_q, kv_segment_ids=ids_kv, backend=backend
            )

        return fn, (x.q, x.k, x.v, x.lens, x.seg_q, x.seg_kv), "segment_ids, kv_segment_ids"

    def fn(q, k, v, lens):
        return attend(q, k, v, mask, cache_seqlens=lens, backend=backend)

    return fn, (x.q, x.k, x.v, x.lens), ""


def _selected_backend(case: Case, x: Inputs, ctx: Context, paged: bool) -> str:
    """``jax_bindings.selected_backend`` for the op ``attention_with_kvcache`` dispatches to
    (``"unknown (why)"`` where it cannot say: it reads jax_bindings' private runtime builder)."""
    import jax

    from splat.tools.check import short_error

    try:
        import jax_bindings
        import splat
        from jax_bindings import _runtime

        b, sq, length = case.batch, case.sq, case.cache_len
        ids = (x.seg_q, x.seg_kv) if case.segments is not None else ()

        def build(lens, *ids):
            kw = dict(zip(("segment_ids", "kv_segment_ids")[: len(ids)], ids, strict=True))
            return _runtime.build(
                b, sq, length, key_value_seq_lengths=lens, q_offset=lens - sq, layout_rows=length, **kw
            )

        runtime = jax.eval_shape(build, x.lens, *ids)
        layout = splat.analyze(case.mask, q_len=length, kv_len=length)
        arrays = (x.q, x.pool_k, x.pool_v, x.page_table) if paged else (x.q, x.k, x.v)
        spec = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays]
        op = "attention_paged" if paged else "attention"
        scale = case.head_dim**-0.5
        return str(
            jax_bindings.selected_backend(op, *spec, layout, scale, backend=ctx.backend, runtime=runtime)
        )
    except Exception as e:  # a record of what ran must not stop the run
        return f"unknown ({short_error(e)})"


def _prep_splat(case: Case, x: Inputs, ctx: Context) -> list[Run]:
    paged = case.page_size is not None
    fn, args, note = _splat_call(case, x, ctx, paged=paged)
    extra = {"splat_backend": _selected_backend(case, x, ctx, paged)}
    return [_jax_run("splat", fn, args, ctx, note=note, kernels=True, extra=extra)]


def _prep_splat_contiguous(case: Case, x: Inputs, ctx: Context) -> list[Run]:
    if case.page_size is None:
        raise PeerUnavailable("paged cases only (splat itself runs the contiguous cache here)")
    fn, args, _ = _splat_call(case, x, ctx, paged=False)
    extra = {"splat_backend": _selected_backend(case, x, ctx, False)}
    note = "the same cache, contiguous"
    return [_jax_run("splat_contiguous", fn, args, ctx, note=note, kernels=True, extra=extra)]


def _prep_splat_attention(case: Case, x: Inputs, ctx: Context) -> list[Run]:
    import splat

    if case.page_size is not None:
        raise PeerUnavailable("splat.attention takes a contiguous cache (see splat_contiguous)")
    mask, backend = case.mask, ctx.backend
    if case.segments is not None:

        def fn(q, k, v, lens, ids_q, ids_kv):
            return splat.attention(
                q,
                k,
                v,
                mask,
                q_offset=lens - q.shape[1],
                key_value_seq_lengths=lens,
                segment_ids=ids_q,
                kv_segment_ids=ids_kv,
                backend=backend,
            )

        args = (x.q, x.k, x.v, x.lens, x.seg_q, x.seg_kv)
    else:

        def fn(q, k, v, lens):
            return splat.attention(
                q, k, v, mask, q_offset=lens - q.shape[1], key_value_seq_lengths=lens, backend=backend
            )

        args = (x.q, x.k, x.v, x.lens)
    note = "q_offset = cache_seqlens - Sq, key_value_seq_lengths = cache_seqlens"
    return [_jax_run("splat_attention", fn, args, ctx, note=note, kernels=True)]


def _prep_splat_prefill(case: Case, x: Inputs, ctx: Context) -> list[Run]:
    import splat

    if case.name != "chunk":
        raise PeerUnavailable("the chunk case only")
    if len(set(case.seqlens.tolist())) != 1:
        raise PeerUnavailable("needs one cache length for all rows")
    end = int(case.seqlens[0])
    k, v = (a[:, end - case.sq : end] for a in (x.k, x.v))
    mask, backend = case.mask, ctx.backend

    def fn(q, k, v):
        return splat.attention(q, k, v, mask, backend=backend)

    square = case.mask.to_acsr(case.sq, case.sq)
    flops = 4.0 * case.batch * case.heads * case.head_dim * int(square.nnz)
    kv_bytes = case.batch * case.sq * case.kv_heads * case.head_dim * case.itemsize * 2
    note = f"splat.attention on the chunk's own {case.sq} x {case.sq} square: other work, compare TFLOP/s"
    return [
        _jax_run(
            "splat_prefill", fn, (x.q, k, v), ctx, note=note, same_work=False, flops=flops, kv_bytes=kv_bytes
        )
    ]


# --- FlashAttention-3 ---------------------------------------------------------------------------


def _keyword_default(fn: Callable, name: str):
    try:
        p = inspect.signature(fn).parameters.get(name)
    except (TypeError, ValueError):
        return None
    return None if p is None or p.default is inspect.Parameter.empty else p.default


def fa3_function():
    """``flash_attn3_jax.flash_mha_with_kvcache``, or PeerUnavailable with the reason."""
    try:
        fa3 = importlib.import_module("flash_attn3_jax")
    except ImportError as e:
        raise PeerUnavailable(f"flash_attn3_jax is not installed ({e})") from None
    fn = getattr(fa3, "flash_mha_with_kvcache", None)
    if fn is None:
        raise PeerUnavailable("this flash_attn3_jax has no flash_mha_with_kvcache")
    return fn


def fa3_splits(fn: Callable, wanted: Sequence[int]) -> list[tuple[int | None, bool]]:
    """``[(num_splits, is_default)]`` to call: the wrapper's default first, then ``wanted``.

    The default is read from the signature (0.2.3: 1, and it rejects 0); a default of 0 or None
    (FA3's own heuristic) is called as such. Without a ``num_splits`` keyword: the default alone.
    """
    from splat.tools.peers import takes_keyword

    if not takes_keyword(fn, "num_splits"):
        return [(None, True)]
    default = _keyword_default(fn, "num_splits")
    out = [(default, True)]
    out += [(n, False) for n in wanted if n != default]
    return out


def _prep_flash_attn3(case: Case, x: Inputs, ctx: Context) -> list[Run]:
    from splat.tools import peers as _peers

    fn = fa3_function()
    if not _peers._hopper():
        raise PeerUnavailable("FlashAttention-3 needs an NVIDIA Hopper GPU (compute capability 9.x)")
    _require_gpu_dtype(case, "FlashAttention-3")
    if case.head_dim not in _peers.FLASH_ATTN3_HEAD_DIMS:
        raise PeerUnavailable(f"FlashAttention-3 runs head dim {_peers.FLASH_ATTN3_HEAD_DIMS} only")
    if not case.band:
        raise PeerUnavailable(f"FlashAttention-3 takes causal and causal-window masks, not {case.mask_expr}")
    if not _peers.takes_keyword(fn, "cache_seqlens"):
        raise PeerUnavailable("this flash_mha_with_kvcache takes no cache_seqlens")
    kw: dict = {"is_causal": True}
    if case.window is not None:
        if not _peers.takes_keyword(fn, "window_size"):
            raise PeerUnavailable("this flash_mha_with_kvcache takes no window_size")
        kw["window_size"] = (case.window, 0)
    if _peers.takes_keyword(fn, "softmax_scale"):
        kw["softmax_scale"] = case.head_dim**-0.5
    # arrays after (q, k_cache, v_cache, cache_seqlens), passed as arguments of the chained program
    extra_names: tuple[str, ...] = ()
    args = (x.q, x.k, x.v, x.lens)
    if case.page_size is not None:
        if not _peers.takes_keyword(fn, "page_table"):
            raise PeerUnavailable("this flash_mha_with_kvcache takes no page_table")
        extra_names, args = ("page_table",), (x.q, x.pool_k, x.pool_v, x.lens, x.page_table)
    if case.segments is not None:
        if not _peers.takes_keyword(fn, "cache_leftpad"):
            raise PeerUnavailable("documents need cache_leftpad (the query's document start); none here")
        import jax.numpy as jnp

        extra_names, args = ("cache_leftpad",), (*args, jnp.asarray(case.doc_starts))
    runs, failed = [], []
    for splits, is_default in fa3_splits(fn, ctx.fa3_splits):
        call_kw = dict(kw) if splits is None else {**kw, "num_splits": splits}

        def attn(q, k, v, lens, *rest, call_kw=call_kw):
            return fn(q, k, v, cache_seqlens=lens, **dict(zip(extra_names, rest, strict=True)), **call_kw)

        shown = ", ".join(
            [f"{n}=" for n in ("cache_seqlens", *extra_names)]
            + [f"{a}={b!r}" for a, b in call_kw.items() if a != "softmax_scale"]
        )
        label = "flash_attn3" if splits is None else f"flash_attn3[splits={splits}]"
        note = f"flash_mha_with_kvcache({shown})" + (" (its default num_splits)" if is_default else "")
        try:
            runs.append(
                _jax_run(
                    "flash_attn3",
                    attn,
                    args,
                    ctx,
                    label=label,
                    note=note,
                    extra={"num_splits": splits, "num_splits_default": is_default},
                )
            )
        except Exception as e:  # one num_splits failing leaves the others
            failed.append(_failed_run("flash_attn3", label, e))
    if not runs:
        raise PeerUnavailable(f"every num_splits failed; first: {failed[0].note}")
    return runs + failed


def _failed_run(impl: str, label: str, e: Exception) -> Run:
    """A placeholder for one variant of a peer that failed: recorded as skipped, never timed."""
    from splat.tools.check import short_error

    def fail():
        raise RuntimeError(short_error(e))

    return Run(impl, label, fail, fail, 1, fail, note=f"error: {short_error(e)}", extra={"failed": True})


# --- cuDNN, dense XLA -------------------------------------------------------------------------


def _prep_cudnn(case: Case, x: Inputs, ctx: Context) -> list[Run]:
    import jax

    from splat.tools import peers as _peers

    if not _peers._on_cuda():
        raise PeerUnavailable("cuDNN attention needs a CUDA GPU")
    _require_gpu_dtype(case, "cuDNN flash attention")
    if case.page_size is not None:
        raise PeerUnavailable("jax.nn.dot_product_attention takes no page table")
    if case.segments is not None:
        raise PeerUnavailable(
            "jax.nn.dot_product_attention takes lengths, not segment ids (documents would need a dense mask)"
        )
    if not case.band:
        raise PeerUnavailable(f"cuDNN takes causal and causal-window masks only, not {case.mask_expr}")
    # jax's cuDNN path aligns the causal diagonal and the window at the top left (query i at key
    # position i); decode needs them at the bottom right. Measured (H200, jax 0.11.2, 2026-11-28):
    # is_causal=True at Sq = 4, 16, 512 and local_window_size at Sq = 1 give other outputs.
    if case.sq > 1:
        raise PeerUnavailable(
            "jax's cuDNN causal mask is aligned top-left (query i sees keys j <= i); Sq > 1 queries at "
            "the end of the cache need it bottom-right (its output differs)"
        )
    if case.window is not None:
        raise PeerUnavailable(
            "jax's cuDNN window is aligned top-left (query 0 sees key 0 only); the last position's window "
            "needs it bottom-right (its output differs)"
        )
    note = "Sq = 1: no causal flag; key_value_seq_lengths = cache_seqlens (the last position sees them all)"

    def attn(q, k, v, lens):
        return jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=lens, implementation="cudnn")

    return [_jax_run("cudnn", attn, (x.q, x.k, x.v, x.lens), ctx, note=note)]


def _prep_dense_xla(case: Case, x: Inputs, ctx: Context) -> list[Run]:
    import jax
    import jax.numpy as jnp

    scores = case.batch * case.heads * case.sq * case.cache_len
    if scores > _MAX_DENSE_SCORES:
        raise PeerUnavailable(f"{scores} dense scores (over {_MAX_DENSE_SCORES})")
    mask = jnp.asarray(case.visible[:, None])  # [B, 1, Sq, Lmax]
    b, length = case.batch, case.cache_len

    def dense(q, k, v, m):
        return jax.nn.dot_product_attention(q, k, v, mask=m, implementation="xla")

    if case.page_size is None:
        return [_jax_run("dense_xla", dense, (x.q, x.k, x.v, mask), ctx, note="mask [B, 1, Sq, Lmax]")]

    def paged(q, kp, vp, table, m):
        k, v = (p[table].reshape(b, length, *p.shape[2:]) for p in (kp, vp))
        return dense(q, k, v, m)

    note = "gathers the pages into a contiguous cache, then a dense mask"
    return [_jax_run("dense_xla", paged, (x.q, x.pool_k, x.pool_v, x.page_table, mask), ctx, note=note)]


# --- torch FlexAttention -------------------------------------------------------------------------


def _to_torch(torch, a):
    """A jax array as a torch CUDA tensor of the same dtype (dlpack, else through the host)."""
    try:
        return torch.from_dlpack(a)
    except Exception:  # no dlpack for this dtype/build: copy through float32
        import jax.numpy as jnp

        dt = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(str(a.dtype), None)
        t = torch.from_numpy(np.asarray(a.astype(jnp.float32) if dt else a)).to("cuda")
        return t.to(dt) if dt else t


def _prep_flex(case: Case, x: Inputs, ctx: Context) -> list[Run]:
    from splat.tools import peers as _peers
    from splat.tools.mask_forms import mask_expression

    torch = _peers._torch_cuda()
    try:
        fa = importlib.import_module("torch.nn.attention.flex_attention")
    except ImportError as e:
        raise PeerUnavailable(f"this torch has no FlexAttention ({e})") from None
    if case.page_size is not None:
        raise PeerUnavailable("paged: FlexAttention needs its block mask converted to pages; not wired here")
    expr = mask_expression(case.mask)
    if expr is None:
        raise PeerUnavailable(f"{case.mask_expr} has no operator form for a mask_mod")
    # torch layout [B, H, S, D], contiguous (Flex's own layout)
    q, k, v = (_to_torch(torch, a).transpose(1, 2).contiguous() for a in (x.q, x.k, x.v))
    lens = _to_torch(torch, x.lens).to(torch.int64)
    sq, length = case.sq, case.cache_len
    seg = None
    if case.segments is not None:  # padded: FlexDecoding may call mask_mod on padded query rows
        pad = np.full((case.batch, 256), -1, np.int64)
        seg = torch.from_numpy(np.concatenate([case.segments.astype(np.int64), pad], 1)).to("cuda")

    def mask_mod(b, h, q_idx, kv_idx):
        pos = lens[b] - sq + q_idx
        keep = (kv_idx < lens[b]) & expr(pos, kv_idx)
        if seg is not None:
            keep = keep & (seg[b, pos] == seg[b, kv_idx])
        return keep

    block_mask = fa.create_block_mask(mask_mod, case.batch, None, sq, length, device="cuda")
    flex = _peers.compiled_flex(torch, fa)
    gqa = case.heads != case.kv_heads
    last = []

    def launch():
        with torch.no_grad():
            last[:] = [flex(q, k, v, block_mask=block_mask, enable_gqa=gqa)]

    def outputs():
        launch()
        torch.cuda.synchronize()
        return last[0].transpose(1, 2).float().cpu().numpy()

    try:
        outputs()
    except Exception as e:  # unsupported shape/dtype in this torch build
        from splat.tools.check import short_error

        raise PeerUnavailable(f"error: {short_error(e)}") from None
    note = f"block mask B={case.batch}, Q_LEN={sq}, KV_LEN={length}; enable_gqa={gqa}; one call a launch"
    return [Run("flex", "flex", launch, torch.cuda.synchronize, 1, outputs, note)]


# --- the Triton decode spike ----------------------------------------------------------------------


@functools.cache
def triton_spike() -> tuple[Callable | None, str]:
    """``(decode, status)`` of ``benchmarks/spikes/spike_decode_triton.py``; ``decode`` None where absent."""
    path = Path(__file__).resolve().parent / "spikes" / "spike_decode_triton.py"
    if not path.exists():
        return None, "absent (benchmarks/spikes/spike_decode_triton.py does not exist)"
    try:
        spec = importlib.util.spec_from_file_location("spike_decode_triton", path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod  # its dataclasses look their module up while it executes
        spec.loader.exec_module(mod)
    except Exception as e:
        sys.modules.pop("spike_decode_triton", None)
        from splat.tools.check import short_error

        return None, f"present but does not import: {short_error(e)}"
    fn = getattr(mod, "decode", None)
    if fn is None:
        return None, "present but has no decode()"
    return fn, "present"


def _prep_triton_spike(case: Case, x: Inputs, ctx: Context) -> list[Run]:
    from splat.tools.timing import on_gpu

    decode, status = triton_spike()
    if decode is None:
        raise PeerUnavailable(status)
    if not on_gpu():
        raise PeerUnavailable("the spike's decode() runs its kernels through jax_triton on a GPU")
    if case.sq > 16 or case.page_size is not None or case.segments is not None or not case.band:
        raise PeerUnavailable(
            "the spike's decode() takes Sq <= 16, a contiguous cache and a causal or causal-window mask"
        )
    window = case.window

    def fn(q, k, v, lens):
        return decode(q, k, v, lens, window=window)

    note = f"decode(q, k_cache, v_cache, cache_seqlens, window={window}), its num_splits heuristic"
    return [_jax_run("triton_spike", fn, (x.q, x.k, x.v, x.lens), ctx, note=note)]


@dataclass(frozen=True)
class DecodePeer:
    name: str
    description: str
    prepare: Callable[[Case, Inputs, Context], list[Run]]


DECODE_PEERS: dict[str, DecodePeer] = {
    p.name: p
    for p in (
        DecodePeer("splat", "splat.attention_with_kvcache", _prep_splat),
        DecodePeer("splat_contiguous", "paged cases: splat on the contiguous cache", _prep_splat_contiguous),
        DecodePeer(
            "splat_attention",
            "splat.attention with q_offset and key_value_seq_lengths",
            _prep_splat_attention,
        ),
        DecodePeer(
            "splat_prefill",
            "chunk: splat.attention on the chunk's own square (other work)",
            _prep_splat_prefill,
        ),
        DecodePeer(
            "flash_attn3", "flash_attn3_jax.flash_mha_with_kvcache, num_splits swept", _prep_flash_attn3
        ),
        DecodePeer(
            "cudnn", "jax.nn.dot_product_attention(implementation='cudnn') with kv lengths", _prep_cudnn
        ),
        DecodePeer(
            "dense_xla",
            "jax.nn.dot_product_attention(implementation='xla') with a dense mask",
            _prep_dense_xla,
        ),
        DecodePeer("flex", "torch.compile(flex_attention) + create_block_mask", _prep_flex),
        DecodePeer("triton_spike", "benchmarks/spikes/spike_decode_triton.py decode()", _prep_triton_spike),
    )
}


# --- the run ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DecodeBenchConfig:
    """Settings of one run (every field lands in the JSON).

    Attributes:
      profile: the sizes (:data:`FULL`, :data:`QUICK`, :data:`TINY`).
      cases: shell globs of case names; None: all.
      peers: names in :data:`DECODE_PEERS` (splat always runs); None: all.
      backend: splat's backend.
      warmup, repeats: None: the profile's.
      seed: inputs, documents and page tables.
      hbm_tbps: the HBM peak; None: by device name (:func:`hbm_peak`).
      fa3_splits: FA3's ``num_splits`` besides its default.
    """

    profile: Profile = FULL
    cases: tuple[str, ...] | None = None
    peers: tuple[str, ...] | None = None
    backend: str = "auto"
    warmup: int | None = None
    repeats: int | None = None
    seed: int = 0
    hbm_tbps: float | None = None
    fa3_splits: tuple[int, ...] = FA3_SPLITS

    def __post_init__(self):
        unknown = [p for p in self.peers or () if p not in DECODE_PEERS]
        if unknown:
            raise ValueError(f"unknown peer(s) {unknown}; known: {', '.join(DECODE_PEERS)}")
        if self.repeats is not None and self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")


def _environment() -> dict:
    from splat.tools.bench import _version, environment

    env = environment()
    env["versions"]["flash-attn3-jax"] = _version("flash-attn3-jax")
    try:
        fn = fa3_function()
        env["flash_attn3"] = {
            "function": "flash_attn3_jax.flash_mha_with_kvcache",
            "signature": str(inspect.signature(fn)),
            "version": getattr(importlib.import_module("flash_attn3_jax"), "__version__", None),
            "num_splits_called": [n for n, _ in fa3_splits(fn, FA3_SPLITS)],
        }
    except PeerUnavailable as e:
        env["flash_attn3"] = {"unavailable": str(e)}
    except Exception as e:  # an unreadable signature must not stop the run
        env["flash_attn3"] = {"unavailable": f"{type(e).__name__}: {e}"}
    env["triton_spike"] = triton_spike()[1]
    return env


def _verdict(out: np.ndarray, ref: np.ndarray | None, ref_name: str, dtype: str) -> dict:
    if ref is None:
        return {"max_abs_diff": None, "rel_diff": None, "agrees": None, "check": "no reference ran"}
    if out.shape != ref.shape:
        return {
            "max_abs_diff": None,
            "rel_diff": None,
            "agrees": False,
            "check": f"output shape {out.shape} != {ref_name}'s {ref.shape}",
        }
    if not np.isfinite(out).all():
        return {"max_abs_diff": None, "rel_diff": None, "agrees": False, "check": "non-finite output"}
    err = float(np.max(np.abs(out - ref))) if ref.size else 0.0
    scale = float(np.max(np.abs(ref))) if ref.size else 0.0
    return {
        "max_abs_diff": err,
        "rel_diff": err / scale if scale > 0 else None,
        "agrees": bool(err <= ABS_TOL[dtype] and err <= REL_TOL[dtype] * scale),
        "check": f"vs {ref_name}",
    }


def _prepare_all(case: Case, x: Inputs, names: list[str], ctx: Context, log) -> tuple[list[Run], list]:
    from splat.tools.check import short_error

    runs, skipped = [], []
    for name in names:
        try:
            got = DECODE_PEERS[name].prepare(case, x, ctx)
        except Exception as e:  # unavailable, or crashed: record why and go on
            why = str(e) if isinstance(e, PeerUnavailable) else f"error: {short_error(e)}"
            skipped.append({"case": case.name, "impl": name, "label": name, "reason": why})
            log(f"  skip {name}: {why}")
            continue
        for run in got:
            if run.extra.get("failed"):
                skipped.append({"case": case.name, "impl": run.impl, "label": run.label, "reason": run.note})
                log(f"  skip {run.label}: {run.note}")
            else:
                runs.append(run)
    return runs, skipped


def run_case(
    case: Case,
    names: list[str],
    ctx: Context,
    warmup: int,
    repeats: int,
    min_sample_ms: float,
    peak_tbps: float | None,
    log: Callable[[str], None],
) -> tuple[list[dict], list[dict], list[dict]]:
    """One case: prepare every peer, check every output, time all in interleaved rounds.

    Returns ``(rows, skipped, disagreements)``.
    """
    from splat.tools.check import short_error
    from splat.tools.timing import Sampler, time_interleaved

    x = make_inputs(case, ctx.seed)
    runs, skipped = _prepare_all(case, x, names, ctx, log)
    outs: dict[str, np.ndarray] = {}
    for run in list(runs):
        try:
            outs[run.label] = run.outputs()
        except Exception as e:
            skipped.append(
                {
                    "case": case.name,
                    "impl": run.impl,
                    "label": run.label,
                    "reason": f"error: {short_error(e)}",
                }
            )
            runs.remove(run)
    checked = [r for r in runs if r.same_work]
    ref_name = next((r.label for r in checked if r.impl == "splat"), None)
    ref_name = ref_name or next((r.label for r in checked if r.impl == "dense_xla"), None)
    ref = outs.get(ref_name) if ref_name else None
    verdicts = {}
    for run in runs:
        if not run.same_work:
            verdicts[run.label] = {
                "max_abs_diff": None,
                "rel_diff": None,
                "agrees": None,
                "check": "other work: not compared",
            }
        else:
            verdicts[run.label] = _verdict(outs[run.label], ref, ref_name, case.dtype)
    del outs
    samplers = {
        r.label: Sampler(
            None,
            launch=r.launch,
            sync=r.sync,
            per_sample=ctx.per_sample,
            calls_per_launch=r.calls_per_launch,
            min_sample_ms=min_sample_ms,
        )
        for r in runs
    }
    times, errors = time_interleaved(samplers, warmup, repeats)
    for label, e in errors.items():
        impl = next(r.impl for r in runs if r.label == label)
        skipped.append(
            {
                "case": case.name,
                "impl": impl,
                "label": label,
                "reason": f"error while timing: {short_error(e)}",
            }
        )
    splat_ms = times["splat"]["ms"] if "splat" in times else None
    base = {
        "case": case.name,
        "B": case.batch,
        "cache_len": case.cache_len,
        "Sq": case.sq,
        "mask": case.mask_expr,
        "page_size": case.page_size,
    }
    rows, disagreements = [], []
    for run in runs:
        if run.label not in times:
            continue
        t = times[run.label]
        kv_bytes = case.kv_bytes if run.kv_bytes is None else run.kv_bytes
        flops = case.flops if run.flops is None else run.flops
        gbps = kv_bytes / (t["ms"] * 1e-3) / 1e9
        row = {
            **base,
            "impl": run.impl,
            "label": run.label,
            **t,
            "kv_bytes": kv_bytes,
            "flops": flops,
            "gbps": gbps,
            "gbps_best": kv_bytes / (t["ms_min"] * 1e-3) / 1e9,
            "hbm_fraction": gbps / (peak_tbps * 1e3) if peak_tbps else None,
            "tflops": flops / (t["ms"] * 1e-3) / 1e12,
            "same_work": run.same_work,
            "vs_splat": t["ms"] / splat_ms if splat_ms and run.same_work else None,
            "note": run.note,
            **verdicts[run.label],
            **run.extra,
        }
        if row["agrees"] is False:
            disagreements.append({k: row[k] for k in ("case", "impl", "label", "max_abs_diff", "check")})
            err = row["max_abs_diff"]
            log(f"  !!! {run.label} DISAGREES on {case.name}: max abs diff {err} ({row['check']})")
        rows.append(row)
    fa3 = [r for r in rows if r["impl"] == "flash_attn3" and r["agrees"] is not False]
    best = min(fa3, key=lambda r: r["ms"]) if fa3 else None
    for r in rows:
        if r["impl"] == "flash_attn3":
            r["fa3_best"] = r is best
    for r in rows:
        log(f"  {r['label']:24s} {r['ms']:9.4f} ms  {r['gbps']:8.1f} GB/s  {r['tflops']:8.2f} TFLOP/s")
    del runs, samplers, x
    gc.collect()
    return rows, skipped, disagreements


def _row(rows: list[dict], case: str, impl: str) -> dict | None:
    """The case's row of ``impl`` (FA3: its best ``num_splits``), agreeing or unchecked."""
    for r in rows:
        if r["case"] == case and r["impl"] == impl and r.get("agrees") is not False:
            if impl != "flash_attn3" or r.get("fa3_best"):
                return r
    return None


def evaluate_targets(cases: list[Case], rows: list[dict]) -> list[dict]:
    """Every case's :class:`Target` against the rows: ``{"case", "target", "value", "met", "detail"}``;
    ``met`` None where it cannot be judged (a row or the HBM peak missing)."""
    out = []
    for case in cases:
        splat = _row(rows, case.name, "splat")
        for t in case.targets:
            value, detail = None, ""
            if splat is None:
                detail = "splat did not run (or disagreed)"
            elif t.metric == "hbm":
                value = splat["hbm_fraction"]
                detail = f"{splat['gbps']:.0f} GB/s" if value is not None else "HBM peak unknown"
            elif t.metric == "vs_contiguous":
                cont = _row(rows, case.name, "splat_contiguous")
                if cont is None:
                    detail = "splat_contiguous did not run"
                else:
                    value = cont["ms"] / splat["ms"]
                    detail = f"paged {splat['ms']:.4f} ms, contiguous {cont['ms']:.4f} ms"
            else:
                peers = [r for r in (_row(rows, case.name, p) for p in t.peers) if r is not None]
                if not peers:
                    detail = f"no agreeing row of {', '.join(t.peers)}"
                else:
                    fastest = min(peers, key=lambda r: r["ms"])
                    value = fastest["ms"] / splat["ms"]
                    missing = [p for p in t.peers if _row(rows, case.name, p) is None]
                    detail = f"{fastest['label']} {fastest['ms']:.4f} ms vs splat {splat['ms']:.4f} ms"
                    if missing:
                        detail += f" ({', '.join(missing)} missing)"
            met = None if value is None else bool(value >= t.threshold)
            out.append(
                {
                    "case": case.name,
                    "target": t.describe(),
                    "metric": t.metric,
                    "threshold": t.threshold,
                    "value": value,
                    "met": met,
                    "detail": detail,
                }
            )
    return out


def run_decode_bench(
    config: DecodeBenchConfig,
    log: Callable[[str], None] = print,
    checkpoint: Callable[[dict], None] | None = None,
) -> dict:
    """Runs the benchmark; returns the JSON-ready result.

    Args:
      config: the settings.
      log: where progress goes.
      checkpoint: called with the result so far (``"complete": False``) after every case, so a run
        cut short still leaves its finished cases (``main`` writes them to ``--out``).

    Returns:
      ``{"schema", "created", "complete", "environment", "settings", "hbm", "cases",
      "bytes_definition", "flop_formula", "ratio_definition", "timing_method", "interleaving",
      "check_rule", "results", "skipped", "disagreements", "targets"}``; every row carries
      ``case``, ``impl``, ``label`` (``flash_attn3[splits=N]``), the timing (``ms``, ``ms_min``,
      ``samples_ms`` ...), ``gbps``, ``hbm_fraction``, ``tflops``, ``vs_splat`` and its output check.
    """
    import jax

    from splat.tools.timing import INTERLEAVING, TIMING_METHOD, sampling

    env = _environment()
    peak, peak_source = hbm_peak(env["device"], config.hbm_tbps)
    per_sample, min_sample_ms = sampling()
    prof = config.profile
    warmup = prof.warmup if config.warmup is None else config.warmup
    repeats = prof.repeats if config.repeats is None else config.repeats
    cases = select_cases(make_cases(prof, config.seed), config.cases)
    names = ["splat"] + [p for p in (config.peers or DECODE_PEERS) if p != "splat"]
    ctx = Context(per_sample, config.backend, tuple(config.fa3_splits), config.seed)
    log(
        f"bench_decode on {env['device']} ({jax.default_backend()}), profile {prof.name}; "
        f"HBM peak {peak} TB/s ({peak_source})"
    )
    rows, skipped, disagreements, done = [], [], [], []

    def result(complete: bool) -> dict:
        return {
            "schema": SCHEMA,
            "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
            "complete": complete,
            "environment": env,
            "settings": {
                **asdict(config),
                "warmup": warmup,
                "repeats": repeats,
                "peers": names,
                "per_sample": per_sample,
                "min_sample_ms": min_sample_ms,
            },
            "hbm": {"peak_tbps": peak, "source": peak_source},
            "cases": {c.name: c.describe() for c in done},
            "bytes_definition": BYTES_DEFINITION,
            "flop_formula": FLOP_FORMULA,
            "ratio_definition": RATIO_DEFINITION,
            "timing_method": TIMING_METHOD,
            "interleaving": INTERLEAVING,
            "check_rule": CHECK_RULE,
            "results": rows,
            "skipped": skipped,
            "disagreements": disagreements,
            "targets": evaluate_targets(done, rows),
        }

    for case in cases:
        log(f"{case.name}: {case.what}")
        r, s, d = run_case(case, names, ctx, warmup, repeats, min_sample_ms, peak, log)
        rows += r
        skipped += s
        disagreements += d
        done.append(case)
        if checkpoint is not None:
            checkpoint(result(complete=False))
    return result(complete=True)


# --- reporting --------------------------------------------------------------------------------


def format_table(result: dict) -> str:
    """The rows as a short table (FA3 at its best ``num_splits``, the sweep on one line), then the
    targets."""
    hdr = (
        f"{'case':12s} {'impl':26s} {'ms':>9s} {'GB/s':>8s} {'%HBM':>6s} {'TFLOP/s':>8s} "
        f"{'x splat':>7s} {'check':>5s}"
    )
    lines = [result["bytes_definition"], result["ratio_definition"], "", hdr, "-" * len(hdr)]
    by_case: dict[str, list[dict]] = {}
    for r in result["results"]:
        by_case.setdefault(r["case"], []).append(r)
    for case, rows in by_case.items():
        for r in rows:
            if r["impl"] == "flash_attn3" and not r.get("fa3_best"):
                continue
            hbm = "-" if r["hbm_fraction"] is None else f"{r['hbm_fraction']:.0%}"
            ratio = "-" if r["vs_splat"] is None else f"{r['vs_splat']:.2f}"
            chk = {True: "ok", False: "DIFF"}.get(r["agrees"], "-")
            label = r["label"] + (" *" if r.get("fa3_best") else "")
            lines.append(
                f"{case:12s} {label:26s} {r['ms']:9.4f} {r['gbps']:8.0f} {hbm:>6s} "
                f"{r['tflops']:8.2f} {ratio:>7s} {chk:>5s}"
            )
        sweep = [r for r in rows if r["impl"] == "flash_attn3"]
        if len(sweep) > 1:
            lines.append(
                f"{'':12s}   FA3 ms by num_splits: "
                + ", ".join(f"{r['num_splits']}: {r['ms']:.4f}" for r in sweep)
                + " (* best)"
            )
    if result["skipped"]:
        why: dict[tuple[str, str], list[str]] = {}
        for s in result["skipped"]:
            why.setdefault((s["label"], s["reason"]), []).append(s["case"])
        n_cases = len(result["cases"])
        lines += ["", "skipped:"]
        for (label, reason), cases in why.items():
            where = "all cases" if len(cases) >= n_cases else ", ".join(cases)
            lines.append(f"  {label} ({where}): {reason[:120]}")
    if result["disagreements"]:
        lines += [
            "",
            "DISAGREEMENTS: " + ", ".join(f"{d['case']}/{d['label']}" for d in result["disagreements"]),
        ]
    lines += ["", "targets:"]
    for t in result["targets"]:
        mark = {True: "met   ", False: "MISSED", None: "n/a   "}[t["met"]]
        val = "-" if t["value"] is None else f"{t['value']:.3f}"
        lines.append(f"  {mark} {t['case']:12s} {t['target']:55s} {val:>7s}  {t['detail']}")
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    """GB/s per case per peer (FA3 at its best ``num_splits``), a line at the HBM peak."""
    from splat.tools.plot import _pyplot

    plt = _pyplot()
    rows = [r for r in result["results"] if r["impl"] != "flash_attn3" or r.get("fa3_best")]
    cases = list(dict.fromkeys(r["case"] for r in rows))
    order = list(DECODE_PEERS)
    impls = sorted({r["impl"] for r in rows}, key=lambda i: order.index(i) if i in order else len(order))
    width = 0.8 / max(len(impls), 1)
    fig, ax = plt.subplots(figsize=(max(8, 1.1 * len(cases) + 3), 5), layout="constrained")
    for i, impl in enumerate(impls):
        xs, ys = [], []
        for c, case in enumerate(cases):
            r = next((r for r in rows if r["case"] == case and r["impl"] == impl), None)
            if r is not None:
                xs.append(c + (i - (len(impls) - 1) / 2) * width)
                ys.append(r["gbps"])
        label = "flash_attn3 (best num_splits)" if impl == "flash_attn3" else impl
        ax.bar(xs, ys, width, label=label)
    peak = result["hbm"]["peak_tbps"]
    if peak:
        ax.axhline(peak * 1e3, color="k", linestyle="--", linewidth=1, label=f"HBM peak {peak} TB/s")
    ax.set_xticks(range(len(cases)), cases, rotation=30, ha="right")
    ax.set_ylabel("GB/s (K and V bytes the mask needs / median time)")
    env = result["environment"]
    ax.set_title(f"decode on {env['device']}, profile {result['settings']['profile']['name']}")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- CLI -----------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--cases", nargs="+", help="case names or shell globs (default: all)")
    p.add_argument(
        "--quick",
        action="store_true",
        help="small sizes (GPU: B=2, cache 4096, bf16; CPU: B=2, cache 256, H=4, Hk=2, D=32, fp32)",
    )
    p.add_argument("--profile", choices=sorted(PROFILES), help="sizes by name (overrides --quick)")
    p.add_argument("--peers", nargs="+", choices=list(DECODE_PEERS), help="peers to run (splat always)")
    p.add_argument("--backend", default="auto", help="splat's backend")
    p.add_argument("--warmup", type=int)
    p.add_argument("--repeats", type=int)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hbm-tbps", type=float, help="HBM peak in TB/s (default: by device name)")
    p.add_argument(
        "--fa3-splits",
        default=",".join(map(str, FA3_SPLITS)),
        help="FA3 num_splits besides its default, comma-separated",
    )
    p.add_argument("--out", help="write the JSON here")
    p.add_argument("--plot", help="write a PNG of GB/s per case per peer here")
    p.add_argument(
        "--assert",
        dest="check_targets",
        action="store_true",
        help="exit 1 when a target is missed or cannot be judged",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU
    from splat.tools.bench import write_json
    from splat.tools.timing import on_gpu

    gpu = on_gpu()
    if args.profile:
        profile = PROFILES[args.profile]
    else:
        profile = (QUICK if gpu else TINY) if args.quick else FULL
    if profile is not TINY and not gpu:
        print(
            f"bench_decode: the {profile.name} sizes need a GPU (JAX sees none); use --quick", file=sys.stderr
        )
        return 2
    try:
        config = DecodeBenchConfig(
            profile=profile,
            cases=tuple(args.cases) if args.cases else None,
            peers=tuple(args.peers) if args.peers else None,
            backend=args.backend,
            warmup=args.warmup,
            repeats=args.repeats,
            seed=args.seed,
            hbm_tbps=args.hbm_tbps,
            fa3_splits=tuple(int(s) for s in args.fa3_splits.split(",") if s.strip()),
        )
        select_cases(make_cases(profile, args.seed), config.cases)  # fail early on a bad --cases
    except ValueError as e:
        print(f"bench_decode: {e}", file=sys.stderr)
        return 2
    checkpoint = (lambda r: write_json(r, args.out)) if args.out else None
    result = run_decode_bench(config, checkpoint=checkpoint)
    if args.out:
        write_json(result, args.out)
        print(f"wrote {args.out}")
    if args.plot:
        plot(result, args.plot)
        print(f"wrote {args.plot}")
    print(format_table(result))
    if args.check_targets:
        misses = [t for t in result["targets"] if t["met"] is not True]
        for t in misses:
            why = "cannot judge" if t["met"] is None else "MISSED"
            print(f"target {why}: {t['case']}: {t['target']} ({t['detail']})", file=sys.stderr)
        if misses:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
