"""Which tile shapes the generated forward and backward kernels take, for a head dim and dtype.

One place for every choice of tile: the planner (:mod:`jax_bindings._cuda.plan`), the tuner and
the sanitizer read it. A tile is bounded by two budgets:

* **registers**: a forward consumer thread holds ``HD / 2`` output accumulators (``HD``: the head
  dim padded to whole 64-column blocks, :func:`source.padded_head_dim`), ``BN / 2`` scores and
  ``BN / 4`` packed probabilities of its two rows, within the 240 registers ``setmaxnreg`` gives
  it. :data:`FWD_BLOCK_N` holds, per padded head dim, the key tiles measured fastest among those
  that fit (``benchmarks/bench_head_dims.py --tiles``): at 256, 80 keys spill a few bytes (8; 56
  with the soft cap) and still run 1.05-1.15x 64 keys on H100;
* **shared memory**: a Q tile and ``stages`` K and V tiles (:func:`source.smem_bytes`) within the
  227 KiB a CTA may opt into on sm_90 (:data:`source.SMEM_LIMIT`).

The backward holds ``dK`` and ``dV`` accumulators of 64 keys x ``HD`` per warpgroup (``HD``
values a thread) up to 128 columns; at 256 it runs wide (:func:`bwd_source.is_wide`: 64 keys
shared by both warpgroups, each holding half the columns), where shared memory holds one Q/dO
buffer and one dQ buffer (:func:`bwd_tile`). 192 runs wide too: each warpgroup's 96 columns as
products of 64 and 32 inside 64-column blocks, with two Q/dO buffers and one dQ buffer.
"""

from __future__ import annotations

from dataclasses import dataclass

from jax_bindings._cuda import bwd_source, source

# Head dims the generated kernels take (q, k, v and out alike). 96 runs on tiles of 128 columns
# whose last 32 are zeros (TMA fills them): a quarter of its products are wasted.
HEAD_DIMS = (64, 96, 128, 192, 256)
BWD_HEAD_DIMS = (64, 96, 128, 192, 256)
BWD_STAGES = 2
DTYPES = tuple(source.ELEMENTS)

# Per padded head dim: the forward's key tile on bands (walks of a few tiles, where a narrower
# tile masks less at each edge) and on long rows (dense and causal chunks: the widest tile that
# fits, amortising the per-tile softmax and barriers over more keys).
FWD_BLOCK_N = {
    64: {"band": 128, "long": 176},
    128: {"band": 128, "long": 176},
    192: {"band": 112, "long": 112},
    256: {"band": 80, "long": 80},
}
FWD_STAGES = 2


@dataclass(frozen=True)
class FwdTile:
    """A forward tile: ``block_n`` keys a K/V tile, ``stages`` K/V tiles in flight, over 128 query
    rows and :attr:`padded` columns."""

    head_dim: int
    block_n: int
    stages: int = FWD_STAGES

    @property
    def padded(self) -> int:
        return source.padded_head_dim(self.head_dim)

    def smem(self, runtime: str = "", q_stages: int = 1, o_store: str = "registers") -> int:
        """Dynamic shared memory of a kernel on this tile (:func:`source.smem_bytes`)."""
        return source.smem_bytes(self.stages, self.block_n, runtime, q_stages, o_store, self.head_dim)

    def fits(self, runtime: str = "", q_stages: int = 1, o_store: str = "registers") -> bool:
        return self.smem(runtime, q_stages, o_store) <= source.SMEM_LIMIT


def check_call(head_dim: int, dtype: str, head_dims: tuple[int, ...] = HEAD_DIMS) -> None:
    """NotImplementedError naming the head dim or dtype the kernels do not take."""
    if head_dim not in head_dims:
        raise NotImplementedError(f"the cuda kernels take head dims {head_dims}, got {head_dim}")
    if dtype not in DTYPES:
        raise NotImplementedError(f"the cuda kernels take dtypes {DTYPES}, got {dtype}")


def fwd_tile(head_dim: int, dtype: str, rows: str = "band", runtime: str = "") -> FwdTile:
    """The forward's tile for ``head_dim`` and ``dtype``; ``rows``: ``"band"`` (rows that walk a
    band of keys) or ``"long"`` (rows that walk most keys: dense, causal chunks at an offset);
    ``runtime``: the runtime mask's kind (:data:`source.RUNTIMES`; every kind takes the same
    tile: with segment ids at 256, 80-key tiles spill 168 bytes where 64-key ones spill 76, not
    yet timed against each other)."""
    check_call(head_dim, dtype)
    if rows not in ("band", "long"):
        raise ValueError(f"rows must be 'band' or 'long', got {rows!r}")
    if runtime not in source.RUNTIMES:
        raise ValueError(f"runtime must be one of {sorted(source.RUNTIMES)}, got {runtime!r}")
    return FwdTile(head_dim, FWD_BLOCK_N[source.padded_head_dim(head_dim)][rows])


@dataclass(frozen=True)
class BwdTile:
    """A backward tile: ``block_m`` query rows a step, ``block_n`` keys an item, ``stages`` Q/dO
    buffers and ``dq_buffers`` dQ buffers in shared memory."""

    head_dim: int
    block_m: int
    block_n: int
    stages: int
    dq_buffers: int

    def smem(self) -> int:
        return bwd_source.smem_bytes(self.stages, self.head_dim, self.dq_buffers)


def bwd_tile(head_dim: int, dtype: str) -> BwdTile:
    """The backward's tile for ``head_dim`` and ``dtype``: two Q/dO buffers and two dQ buffers
    where they fit, else two Q/dO buffers and one dQ buffer (192), else one of each (256)."""
    check_call(head_dim, dtype, BWD_HEAD_DIMS)
    for stages, dq_buffers in ((BWD_STAGES, 2), (BWD_STAGES, 1), (1, 1)):
        tile = BwdTile(head_dim, bwd_source.BM, bwd_source.block_n(head_dim), stages, dq_buffers)
        if tile.smem() <= source.SMEM_LIMIT:
            return tile
    raise AssertionError(f"no backward tile fits head_dim {head_dim}")  # BWD_HEAD_DIMS all fit
