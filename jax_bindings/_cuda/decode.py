"""Decode on the CUDA target: a few query tokens per batch row against a KV cache.

The kernel (``kernels/decode/decode.cu``) reads, for each CTA's tokens, the ACSR row at their
run-time positions (:func:`segment_rows`: each segment's base, stride and count per layout row),
and walks only the keys those rows hold: a window reads the window, sinks + window two runs, a
dilated or strided mask its progression. All query heads of one KV head share a CTA (GQA reads
K/V once); the key walk is split across CTAs where ``B * Hk`` would leave the GPU idle
(:func:`choose_splits`), and the splits' partial rows are merged by their log-sum-exp in a fixed
order (:func:`jax_bindings._split_merge.merge_splits`): reruns are bit-identical.

Takes: layouts of 1 to 4 segments (no block-sparse residual, no grid); head dims that are
multiples of 16 up to 256; bfloat16/float16; up to :data:`MAX_TOKENS` query tokens a row; a
contiguous cache ``[B, L, Hk, D]`` or a page pool with a page table (page sizes a power of two);
key lengths, segment ids and a soft cap. Everything else is refused with NotImplementedError.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from acsr import ACSR
from jax_bindings import _id_runs as id_runs
from jax_bindings._cuda import compiler, launch, parts
from jax_bindings._split_merge import merge_splits

MAX_TOKENS = 32  # query tokens of a batch row: one lane of warp 0 plans each
ELEMENT_TYPES = {"bfloat16": "Bf16", "float16": "Fp16"}
LOG2E = math.log2(math.e)
SMEM_PER_SM = 228 * 1024  # an SM's shared memory (Hopper), 1 KiB of it reserved a CTA
SMEM_LIMIT = 227 * 1024


@dataclass(frozen=True)
class DecodeTile:
    """A decode CTA's shape: ``rows`` query rows (16 a warp along ``warps_m``), ``block_n`` keys a
    tile split among ``warps_n`` warps, ``stages`` tiles in flight (every warp loads by cp.async
    and computes, a CTA barrier a tile)."""

    rows: int
    block_n: int
    warps_m: int
    warps_n: int
    stages: int


def decode_tile(head_dim: int, rows: int) -> DecodeTile:
    """The tile for ``rows`` query rows (tokens x heads of one KV head) at ``head_dim``: up to 64
    rows a CTA, 64 keys a tile (32 above D = 128, so that a stage stays ~32 KiB), three stages,
    so that two CTAs share an SM; four warps where a warp can take 16 keys of each tile."""
    r = 16 if rows <= 16 else 32 if rows <= 32 else 64
    block_n = 64 if head_dim <= 128 else 32
    warps_m = r // 16
    return DecodeTile(
        rows=r, block_n=block_n, warps_m=warps_m, warps_n=min(4 // warps_m, block_n // 16), stages=3
    )


@dataclass(frozen=True)
class DecodeVariant:
    """One compiled decode kernel (hashed by value: :func:`compiled` caches on it)."""

    head_dim: int
    dtype: str
    tokens: int
    group: int
    segments: int
    page_size: int  # 0: a contiguous cache
    ids: bool
    soft_cap: float | None
    split: bool
    tile: DecodeTile

    def __post_init__(self):
        if self.dtype not in ELEMENT_TYPES:
            raise NotImplementedError(f"the cuda decode kernel takes bfloat16 or float16, not {self.dtype}")
        if self.head_dim % 16 or not 16 <= self.head_dim <= 256:
            raise NotImplementedError(
                f"the cuda decode kernel takes head dims 16-256 in steps of 16, not {self.head_dim}"
            )
        if not 1 <= self.tokens <= MAX_TOKENS:
            raise NotImplementedError(
                f"the cuda decode kernel takes 1-{MAX_TOKENS} query tokens a batch row, not {self.tokens}"
            )
        if not 1 <= self.segments <= 4:
            raise NotImplementedError(f"the cuda decode kernel takes 1-4 segments, not {self.segments}")
        t = self.tile
        if (
            t.rows != 16 * t.warps_m
            or t.block_n % (16 * t.warps_n)
            or -(-self.tokens * self.group // t.rows) > 65535
        ):
            raise ValueError(
                f"decode tile {t}: 16 rows a warp along warps_m, 16 keys or more a warp along warps_n"
            )
        if self.page_size and self.page_size & (self.page_size - 1):
            raise NotImplementedError(
                f"the cuda decode kernel takes page sizes that are powers of two, not {self.page_size}"
            )

    @property
    def threads(self) -> int:
        return 32 * self.tile.warps_m * self.tile.warps_n

    @property
    def smem(self) -> int:
        """Dynamic shared memory (the kernel's ``Shared``): Q, the K/V stages, key ids, each token's
        rows and ids, the walk, and 16 bytes of alignment slack."""
        t, d = self.tile, self.head_dim
        row = (d + 8) * 2
        ids = t.stages * t.block_n * 4 if self.ids else 4
        tokens = self.tokens * (self.segments * 12 + 4)
        walk = self.segments * 20 + 4
        return t.rows * row + 2 * t.stages * t.block_n * row + ids + tokens + walk + 64

    def program(self) -> parts.Program:
        t = self.tile
        config = {
            "HEAD_DIM": self.head_dim,
            "ROWS": t.rows,
            "BLOCK_N": t.block_n,
            "WARPS_M": t.warps_m,
            "WARPS_N": t.warps_n,
            "STAGES": t.stages,
            "TOKENS": self.tokens,
            "GROUP": self.group,
            "SEGMENTS": self.segments,
            "PAGED": bool(self.page_size),
            "PAGE_SHIFT": max(self.page_size, 1).bit_length() - 1,
            "IDS": self.ids,
            "SOFT_CAP": float(self.soft_cap or 0.0),
            "SPLIT": self.split,
            "SMEM_BYTES": self.smem,
        }
        header = parts.constants_header("cfg", config, types={"Elem": ELEMENT_TYPES[self.dtype]})
        return parts.program("decode/decode.cu", {"decode_config.cuh": header}, "splat_decode")


@functools.lru_cache(maxsize=64)
def compiled(variant: DecodeVariant) -> tuple[str, bytes]:
    """``(kernel name, cubin)`` of ``variant`` (once per process; disk-cached across them)."""
    prog = variant.program()
    return prog.name, compiler.cubin(prog.source, headers=prog.header_map())


def check_layout(layout: ACSR) -> None:
    """Refuses (NotImplementedError) the layouts the decode kernel cannot walk."""
    if layout.grid is not None:
        raise NotImplementedError("the cuda decode kernel walks segments, not grid layouts")
    if layout.residual is not None:
        raise NotImplementedError(
            "the cuda decode kernel walks segments; this layout has a block-sparse residual"
        )
    if not layout.segments:
        raise NotImplementedError("the cuda decode kernel needs a layout with at least one segment")
    if layout.q_len != layout.kv_len:
        raise NotImplementedError(
            f"the cuda decode kernel takes the square layout of a cache, not {layout.q_len} x {layout.kv_len}"
        )


@functools.lru_cache(maxsize=32)
def segment_rows(layout: ACSR) -> np.ndarray:
    """int32 ``[segments * 3 * L]``: per segment, its base, stride and count arrays (the kernel's
    ``seg_rows``)."""
    return (
        np.concatenate([np.stack([s.base, s.stride, s.count]) for s in layout.segments])
        .astype(np.int32)
        .reshape(-1)
    )


@functools.lru_cache(maxsize=32)
def max_keys(layout: ACSR) -> int:
    """The most keys a row of ``layout`` holds (what the split count is planned for)."""
    return int(layout.row_counts().max(initial=0))


def ctas_per_sm(smem: int) -> int:
    """CTAs of ``smem`` bytes of dynamic shared memory that one SM holds at once."""
    return max(1, SMEM_PER_SM // (smem + 1024))


def choose_splits(ctas: int, tiles: int, sms: int, per_sm: int = 2) -> int:
    """Splits of each row's key walk: the count that minimises the waves of CTAs times the tiles
    a CTA walks, with ~1.5 tiles of fixed cost a CTA (its first loads) and ~2 for the merge of
    more than one split. ``ctas``: CTAs of one split; ``tiles``: the walk's tiles (static bound);
    ``per_sm``: CTAs an SM holds (:func:`ctas_per_sm`)."""
    slots = max(1, sms * per_sm)
    best, best_cost = 1, math.inf
    for s in range(1, max(1, min(tiles, 256)) + 1):
        waves = -(-ctas * s // slots)
        cost = waves * (-(-tiles // s) + 1.5) + (2.0 if s > 1 else 0.0)
        if cost < best_cost - 1e-9:
            best, best_cost = s, cost
    return best


def launch_grid(splits: int, heads: int, row_blocks: int) -> tuple[int, int, int]:
    """CTAs: x the split, y the (batch, KV head), z the row block (the kernel's blockIdx reading)."""
    return splits, heads, row_blocks


def _placeholder() -> jax.Array:
    return jnp.zeros((1,), jnp.int32)


def plan(
    q_shape,
    kv_heads: int,
    dtype: str,
    layout: ACSR,
    page_size: int,
    ids: bool,
    soft_cap,
    sms: int,
    splits: int | None = None,
    tile: DecodeTile | None = None,
) -> tuple[DecodeVariant, int, int]:
    """``(variant, splits, row blocks)`` of a decode call with queries ``q_shape = [B, Sq, H, D]``
    against ``kv_heads`` KV heads: the tile of :func:`decode_tile` and the split count of
    :func:`choose_splits` (for the CTAs an SM holds at the tile's shared memory), or the given
    ``splits`` and ``tile``."""
    b, sq, h, d = q_shape
    group = h // kv_heads
    tile = tile or decode_tile(d, sq * group)
    row_blocks = -(-sq * group // tile.rows)
    variant = DecodeVariant(d, dtype, sq, group, len(layout.segments), page_size, ids, soft_cap, True, tile)
    if splits is None:  # shared memory does not depend on the split
        tiles = -(-max_keys(layout) // tile.block_n) + len(layout.segments)
        splits = choose_splits(b * kv_heads * row_blocks, tiles, sms, ctas_per_sm(variant.smem))
    return dataclasses.replace(variant, split=splits > 1), splits, row_blocks


def forward(
    q,
    k,
    v,
    runtime,
    layout: ACSR,
    scale: float,
    soft_cap,
    sms: int,
    page_table=None,
    splits: int | None = None,
    tile: DecodeTile | None = None,
):
    """``(out [B, Sq, H, D], lse [B, H, Sq])`` of the decode kernel.

    ``k, v``: a contiguous cache ``[B, L, Hk, D]`` (``page_table`` None), or a page pool
    ``[pages, page_size, Hk, D]`` with ``page_table`` int32 ``[B, max_pages]``; ``layout``: the
    mask at ``(L, L)``, ``L`` the cache's logical length; ``runtime``: a RuntimeMask with
    ``q_pos`` (``-1``: the token sees nothing); its ``q_len`` and ``kv_len`` are applied, and ids
    where present. ``sms``: the GPU's SM count (the split plan); ``splits``, ``tile``: the split
    count and the tile instead of the plan's (tests, spikes).
    """
    check_layout(layout)
    b, sq, h, d = q.shape
    hk = k.shape[2]
    paged = page_table is not None
    page_size = k.shape[1] if paged else 0
    L = layout.kv_len
    keys = page_table.shape[1] * page_size if paged else k.shape[1]
    if keys < L or (not paged and keys != L):  # a page table may map more keys than the layout has rows
        raise ValueError(f"the layout's {L} rows do not match the cache's {keys} keys")
    ids = runtime.q_ids is not None
    variant, splits, row_blocks = plan(
        q.shape, hk, jnp.dtype(q.dtype).name, layout, page_size, ids, soft_cap, sms, splits, tile
    )
    if variant.smem > SMEM_LIMIT:
        raise NotImplementedError(f"the decode tile needs {variant.smem} bytes of shared memory")
    name, image = compiled(variant)

    real = jnp.arange(sq, dtype=jnp.int32)[None, :] < runtime.q_len[:, None]
    q_pos = jnp.where(real, runtime.q_pos, -1).astype(jnp.int32)
    kv_len = runtime.kv_len.astype(jnp.int32)
    rows = jnp.asarray(segment_rows(layout))
    table = page_table.astype(jnp.int32) if paged else _placeholder()
    q_ids = runtime.q_ids.astype(jnp.int32) if ids else _placeholder()
    kv_ids = runtime.kv_ids.astype(jnp.int32) if ids else _placeholder()
    id_keys = id_runs.document_keys(runtime, L) if ids else _placeholder()
    dt = jnp.dtype(q.dtype).name
    if splits > 1:
        outs = (((b, sq, h, splits, d), "float32"), ((b, sq, h, splits), "float32"))
    else:
        outs = (((b, sq, h, d), dt), ((b, h, sq), "float32"))
    spec = launch.Launch(
        name=name,
        image=image,
        grid=launch_grid(splits, b * hk, row_blocks),
        threads=variant.threads,
        smem=variant.smem,
        scalars=(
            ("i32", L),
            ("i32", h),
            ("i32", hk),
            ("i32", page_table.shape[1] if paged else 0),
            ("i32", k.shape[0] if paged else 0),
            ("fp32", float(scale) * LOG2E),
            ("fp32", float(scale)),
        ),
        outs=outs,
        cc=90,
    )
    out, lse = launch.run(
        spec, q, k.astype(q.dtype), v.astype(q.dtype), q_pos, kv_len, rows, table, q_ids, kv_ids, id_keys
    )
    if splits > 1:
        return merge_splits(out, lse, q.dtype)
    return out, lse
