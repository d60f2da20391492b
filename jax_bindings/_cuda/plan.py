"""Which generated kernel runs a call, and everything it needs besides the arrays (no JAX here).

:func:`fwd_variant` picks the :class:`FwdVariant` for a layout, head dim and dtype (or refuses
with ``NotImplementedError`` naming why), :func:`offered_bwd_variant` the :class:`BwdVariant`;
each variant's ``program()`` is its kernel's parts and constants (:mod:`jax_bindings._cuda.parts`),
and :func:`compiled` gives its kernel name and cubin; :func:`grid`, :func:`tensor_maps` and
their ``bwd_`` twins the launch geometry and the TMA templates. The JAX backend
(:mod:`jax_bindings._cuda.backend`) and the sanitizer's direct launches
(``benchmarks/sanitize_cuda.py``) both start here.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import acsr
from acsr import ACSR
from jax_bindings._cuda import bwd_source, compiler, grid_tiles, parts, source, tensor_map, tile_shapes


@dataclass(frozen=True)
class FwdVariant:
    """One generated forward kernel: the band baked in and the schedule.

    ``block_n``: keys per tile (176 on the dense mask, whose long rows amortise the wider tile's
    edge: 1.00-1.03x 128 keys on H100; 128 elsewhere: 176 ran a causal window at 0.87-0.90x);
    ``stages``: K/V ring depth; the consumers always overlap a tile's products with the last
    one's and take turns issuing (ping-pong: +5-10% on a window, within run-to-run noise on
    dense);
    ``schedule`` (:data:`source.SCHEDULES`) and ``section_bytes``: how CTAs get work tiles, as
    measured on H100.
    ``"queue"``, one CTA per SM taking tiles by ticket: on dense a head after another
    (``section_bytes=0``; 1.02-1.04x a launch of one CTA per row block); on causal in sections of
    the heads whose K/V fit :data:`QUEUE_SECTION_BYTES`, longest walks first across a section
    (1.19x / 1.02x one CTA per row block at S = 8192 / 16384, where a head at a time was 1.06x /
    1.00x). ``"strided"``, one CTA per SM taking every ``gridDim.x``-th tile, on bands bounded on
    the left, whose row blocks all walk about as far (1.05-1.24x one CTA per row block; the queue
    within noise of it).
    ``runtime`` (:data:`source.RUNTIMES`): the runtime mask it takes (lengths, segment ids).
    ``q_stages``: Q tiles in shared memory, 2 where they fit (:func:`with_two_q_tiles`).
    ``o_store`` (:data:`source.O_STORES`): how the epilogue writes ``out``; the planner's
    variants store it by TMA from the Q tile (1.03-1.05x on the windows and dense at S = 16384
    against stores from registers).
    ``band_block``: rows measure the band from their block's first row (:class:`acsr.BandForm`).
    ``shifted``: queries at run-time positions, a chunk at an offset into the keys (chunked
    prefill; :func:`source.source`'s ``shifted``).
    """

    band: acsr.Band
    dtype: str
    block_n: int = source.BN
    stages: int = 2
    schedule: str = "strided"
    section_bytes: int = 0
    runtime: str = ""
    q_stages: int = 1
    o_store: str = "registers"
    band_block: int = 1
    shifted: bool = False
    head_dim: int = source.D
    soft_cap: float | None = None

    def __post_init__(self):
        source.check_schedule(self.schedule)

    def program(self) -> parts.Program:
        """The kernel's program (:func:`source.program`), its name unique to its text."""
        return source.program(
            self.band.left, self.band.right, stages=self.stages, block_n=self.block_n, dtype=self.dtype,
            schedule=self.schedule, section_bytes=self.section_bytes, runtime=self.runtime,
            q_stages=self.q_stages, o_store=self.o_store, band_block=self.band_block, shifted=self.shifted,
            head_dim=self.head_dim, soft_cap=self.soft_cap)

    def named_source(self) -> tuple[str, str]:
        """``(kernel name, CUDA C++)``: the program as one text (:meth:`parts.Program.flat`)."""
        prog = self.program()
        return prog.name, prog.flat()

    @property
    def smem(self) -> int:
        return source.smem_bytes(self.stages, self.block_n, self.runtime, self.q_stages, self.o_store,
                                 self.head_dim)

    @property
    def threads(self) -> int:
        return source.THREADS


@dataclass(frozen=True)
class GridFwdVariant:
    """The forward kernel on a grid layout's spatial tiles (:mod:`jax_bindings._cuda.grid_tiles`):
    the tiles baked in, the K/V ring depth and the schedule (``"strided"``: every patch walks
    about as far; ``section_bytes`` > 0: a few heads at a time, :data:`GRID_SECTION_BYTES`)."""

    tiles: grid_tiles.GridTiles
    dtype: str
    stages: int = 2
    schedule: str = "strided"
    section_bytes: int = 0
    q_stages: int = 1
    head_dim: int = source.D
    soft_cap: float | None = None

    def program(self) -> parts.Program:
        """The kernel's program (:func:`source.program` with ``grid=``)."""
        return source.program(
            None, None, stages=self.stages, block_n=self.tiles.block_n, dtype=self.dtype,
            schedule=self.schedule, section_bytes=self.section_bytes, grid=self.tiles,
            q_stages=self.q_stages, head_dim=self.head_dim, soft_cap=self.soft_cap)

    def named_source(self) -> tuple[str, str]:
        """``(kernel name, CUDA C++)``: the program as one text (:meth:`parts.Program.flat`)."""
        prog = self.program()
        return prog.name, prog.flat()

    @property
    def smem(self) -> int:
        return source.smem_bytes(self.stages, self.tiles.block_n, q_stages=self.q_stages,
                                 head_dim=self.head_dim)

    @property
    def threads(self) -> int:
        return source.THREADS


@dataclass(frozen=True)
class BwdVariant:
    """One generated backward kernel (:mod:`jax_bindings._cuda.bwd_source`): the band baked in,
    the Q/dO ring depth, whether dQ is added in a fixed order (bit-identical reruns), the
    runtime mask it takes (:data:`source.RUNTIMES`), the heads' sections (``section_bytes``,
    :data:`BWD_SECTION_BYTES` from the planner), the key order (:data:`bwd_source.KEY_ORDERS`,
    :func:`key_order` from the planner) and the band's row blocks (``band_block``, as in
    :class:`FwdVariant`)."""

    band: acsr.Band
    dtype: str
    stages: int = 2
    ordered: bool = True
    runtime: str = ""
    section_bytes: int = 0
    key_order: str = "last_first"
    band_block: int = 1
    head_dim: int = source.D
    soft_cap: float | None = None
    dq_buffers: int = 2

    def program(self) -> parts.Program:
        """The kernel's program (:func:`bwd_source.program`)."""
        return bwd_source.program(
            self.band.left, self.band.right, stages=self.stages, dtype=self.dtype, ordered=self.ordered,
            runtime=self.runtime, section_bytes=self.section_bytes, key_order=self.key_order,
            band_block=self.band_block, head_dim=self.head_dim, soft_cap=self.soft_cap,
            dq_buffers=self.dq_buffers)

    def named_source(self) -> tuple[str, str]:
        """``(kernel name, CUDA C++)``: the program as one text (:meth:`parts.Program.flat`)."""
        prog = self.program()
        return prog.name, prog.flat()

    @property
    def smem(self) -> int:
        return bwd_source.smem_bytes(self.stages, self.head_dim, self.dq_buffers)

    @property
    def block_n(self) -> int:
        return bwd_source.block_n(self.head_dim)

    @property
    def threads(self) -> int:
        return bwd_source.THREADS


@functools.lru_cache(maxsize=256)
def band_form(layout: ACSR, head_dim: int, dtype: str, runtime: str = "") -> acsr.BandForm:
    """The layout's band form (:func:`acsr.band_form`), or NotImplementedError saying why no
    kernel is generated for the call (cached: the backend reads a call's phases and its variant
    from the same form). A band in ``d > 1`` phases runs as a band over ``S / d`` rows
    and ``d`` times the heads (the backend folds the arrays, :mod:`jax_bindings._cuda.phases`). A
    runtime mask is taken on plain bands only (on the other forms the kernels were not tested
    with one)."""
    tile_shapes.check_call(head_dim, dtype)
    if layout.grid is not None:
        raise NotImplementedError("the cuda backward takes no grid layout (the spatial-tile forward only)")
    form = acsr.band_form(layout)
    if form is None:
        family = acsr.pattern_family(layout)
        raise NotImplementedError(
            f"the cuda kernels take one-band masks (acsr.band_form); this one is {family}")
    if runtime and (form.phases > 1 or form.block > 1):
        raise NotImplementedError(
            "the cuda kernels take a runtime mask on plain bands only, not on a band in phases (dilated, "
            "strided) or measured from blocks of rows (block-local)")
    return form


# Q and dO bytes of the (batch, KV head)s whose items the backward takes in turn (a section): 4
# heads at S = 8192, 2 at 16384, 1 from 32768. Against one head at a time, two runs: dense 1.04-
# 1.05x, causal 1.01-1.04x, the windows 1.00-1.04x at 8192; 0.98-1.02x at 16384; 24 MiB and more
# lose 7-43% on causal.
BWD_SECTION_BYTES = 16 << 20


def key_order(band: acsr.Band) -> str:
    """The backward's key order (:data:`bwd_source.KEY_ORDERS`) for ``band``:
    ``"first_first_at_end"`` where rows see every key behind them and not all ahead (causal: the
    first key blocks walk the most query blocks, and taken last they leave a tail; 1.09x the
    backward at S = 8192, 1.03x at 16384), else ``"last_first"`` (dense, windows: walks of about
    one length; 0.98-0.99x on a causal window of 1024), measured on H100. Its gradients' bits
    depend on the heads' sections (which heads take which order)."""
    return "first_first_at_end" if band.left is None and band.right is not None else "last_first"


def bwd_variant(layout: ACSR, head_dim: int, dtype: str, runtime: str = "",
                soft_cap: float | None = None) -> BwdVariant:
    """The backward kernel for this call, or NotImplementedError saying why none is generated."""
    tile = tile_shapes.bwd_tile(head_dim, dtype)
    form = band_form(layout, head_dim, dtype, runtime)
    return BwdVariant(form.band, dtype, stages=tile.stages, runtime=runtime, section_bytes=BWD_SECTION_BYTES,
                      key_order=key_order(form.band), band_block=form.block, head_dim=head_dim,
                      soft_cap=soft_cap, dq_buffers=tile.dq_buffers)


# Query rows a key block's walk covers (``left + right + block_n``) from which the backend offers
# its backward: a walk of 10 query blocks or more (see offered_bwd_variant), 9 where the head
# dim runs wide (its items of 64 keys).
MIN_BWD_BAND_ROWS = 640
MIN_WIDE_BWD_BAND_ROWS = 576


def offered_bwd_variant(layout: ACSR, head_dim: int, dtype: str, runtime: str = "",
                        soft_cap: float | None = None) -> BwdVariant:
    """The backward kernel the backend runs for this call, or NotImplementedError saying why not.

    Offered where each key block walks at least 10 query blocks (a band of
    :data:`MIN_BWD_BAND_ROWS` rows with the key block: dense, causal, sliding windows (256, 256)
    and causal windows of ~500 and more). On H100 it is 1.42-1.52x the Triton backward on dense
    and causal, 1.24x on a causal window of 1024 (18 steps) and 1.02-1.04x on a sliding window
    (256, 256) (11 steps) at S = 8192 and 16384; narrower windows, not measured, go to the next
    backend. Where the head dim runs wide (:func:`bwd_source.is_wide`: 192 and 256, 64-key items),
    from 9 query blocks (:data:`MIN_WIDE_BWD_BAND_ROWS`): the sliding window (256, 256) at D = 256,
    forward+backward 1.51x the Triton route at S = 8192 on H100 (232 against 154 useful TFLOP/s,
    session 29's run for the latter); narrower, not measured.
    """
    variant = bwd_variant(layout, head_dim, dtype, runtime, soft_cap)
    band = variant.band
    if band.left is not None and band.right is not None:
        rows = band.left + band.right + variant.band_block - 1 + variant.block_n
        least = MIN_WIDE_BWD_BAND_ROWS if bwd_source.is_wide(head_dim) else MIN_BWD_BAND_ROWS
        if rows < least:
            raise NotImplementedError(
                f"the cuda backward is offered on bands of {least} rows or more with a key "
                f"block (this one: {rows}) at head dim {head_dim}; narrower windows were not measured "
                "faster than the Triton backward on H100")
    return variant


# K/V bytes of the heads a causal forward's queue interleaves (a section): 4 heads at S = 8192,
# 2 at 16384; on causal (H100) 1.02x sections of 32 MiB and 1.02-1.06x sections of 64 MiB.
QUEUE_SECTION_BYTES = 16 << 20


# K/V bytes of the heads the grid forward's strided schedule takes at a time (a section), where a
# patch walks more than GRID_SECTION_MIN_KEYS keys: there the patches of every head running at
# once do not share L2 (63x63 on 128x128, 4860 keys a patch: 1.15x with sections of 4 heads at
# S = 16384, against 1, 2, 8 and all 16 interleaved); with shorter walks (3-D (5, 9, 9), 1176;
# 15x15, 660) all heads interleaved measured as fast or 3% faster.
GRID_SECTION_BYTES = 32 << 20
GRID_SECTION_MIN_KEYS = 4096


def grid_fwd_variant(layout: ACSR, head_dim: int, dtype: str, runtime: str = "",
                     soft_cap: float | None = None) -> GridFwdVariant:
    """The forward kernel on the grid layout ``layout``, or NotImplementedError saying why none
    is generated (a runtime mask, geometry :func:`grid_tiles.supported` refuses, or a key tile
    too wide for the head dim's shared memory)."""
    tile_shapes.check_call(head_dim, dtype)
    if runtime:
        raise NotImplementedError("the cuda grid forward takes no runtime mask")
    p = grid_tiles.grid_plan(layout.grid)
    section = GRID_SECTION_BYTES if p.keys_per_patch > GRID_SECTION_MIN_KEYS else 0
    variant = GridFwdVariant(p.tiles, dtype, section_bytes=section, head_dim=head_dim, soft_cap=soft_cap)
    if variant.smem > source.SMEM_LIMIT:
        raise NotImplementedError(
            f"the grid's key tile of {p.tiles.block_n} keys at head dim {head_dim} needs {variant.smem} "
            f"bytes of shared memory, over the {source.SMEM_LIMIT} a CTA takes")
    return variant


def fwd_variant(layout: ACSR, head_dim: int, dtype: str, runtime: str = "", shifted: bool = False,
                soft_cap: float | None = None) -> FwdVariant | GridFwdVariant:
    """The forward kernel for this call (``runtime``: the runtime mask's kind; ``shifted``: queries
    at run-time positions), or NotImplementedError saying why none is generated.

    A shifted chunk on a band unbounded on the left (causal, dense) takes dense's tiles of 176 keys,
    one head after another: its rows are ``offset`` keys longer than the band's own rows, the
    wide tile amortises their edge (2048 causal queries at offsets 0, 14336 and 30720 of 32768
    keys: 1.08x, 1.08x and 1.06x causal's plan; 1.01-1.03x FA3 on H200).
    Other shifted bands take their band's plan: their walks are the window's. Key tiles by head
    dim: :func:`tile_shapes.fwd_tile`."""
    if layout.grid is not None:
        if shifted:
            raise NotImplementedError("the cuda grid forward takes no query positions (q_offset)")
        return grid_fwd_variant(layout, head_dim, dtype, runtime, soft_cap)
    form = band_form(layout, head_dim, dtype, runtime)
    if shifted and (form.phases > 1 or form.block > 1 or not runtime):
        raise NotImplementedError("the cuda forward takes query positions (q_offset) on plain bands")
    band, block = form.band, form.block
    at = dict(runtime=runtime, o_store="tma", shifted=shifted, head_dim=head_dim, soft_cap=soft_cap)
    if band.left is None and (band.right is None or shifted):
        tile = tile_shapes.fwd_tile(head_dim, dtype, "long", runtime)
        return FwdVariant(band, dtype, block_n=tile.block_n, stages=tile.stages, schedule="queue", **at)
    tile = tile_shapes.fwd_tile(head_dim, dtype, "band", runtime)
    if band.left is None:
        variant = FwdVariant(band, dtype, block_n=tile.block_n, stages=tile.stages, schedule="queue",
                             section_bytes=QUEUE_SECTION_BYTES, band_block=block, **at)
    else:
        variant = FwdVariant(band, dtype, block_n=tile.block_n, stages=tile.stages, schedule="strided",
                             band_block=block, **at)
    return with_two_q_tiles(variant)


def with_two_q_tiles(variant: FwdVariant) -> FwdVariant:
    """``variant`` with a second Q tile where shared memory holds one (128-key tiles, 2 stages):
    the next work tile's Q and first K/V tiles then load during the current walk (1.01-1.035x on
    the windows; dense's 176-key tiles leave no room)."""
    two = dataclasses.replace(variant, q_stages=2)
    return two if two.smem <= source.SMEM_LIMIT else variant


def rescheduled(variant: FwdVariant, schedule: str, section_bytes: int = 0, q_stages: int | None = None,
                o_store: str | None = None) -> FwdVariant:
    """``variant`` in another CTA ``schedule`` (for spikes, tests and the sanitizer) with
    ``q_stages`` Q tiles (2 where they fit, :func:`with_two_q_tiles`; None: the variant's) and
    ``o_store`` (None: the variant's)."""
    q_stages = variant.q_stages if q_stages is None else q_stages
    o_store = variant.o_store if o_store is None else o_store
    moved = dataclasses.replace(variant, schedule=schedule, section_bytes=section_bytes, q_stages=1,
                                o_store=o_store)
    return with_two_q_tiles(moved) if q_stages == 2 else moved


@functools.lru_cache(maxsize=64)
def compiled(variant: FwdVariant | GridFwdVariant | BwdVariant) -> tuple[str, bytes]:
    """``(kernel name, cubin)`` of ``variant`` (compiled once per process; disk-cached across them)."""
    prog = variant.program()
    return prog.name, compiler.cubin(prog.source, headers=prog.header_map())


def grid(q_shape: tuple[int, ...], schedule: str, sm_count: int, row_blocks: int | None = None
         ) -> tuple[int, int, int]:
    """CTAs of the forward over ``q [B, Sq, H, D]`` in ``schedule`` (:data:`source.SCHEDULES`):
    one per SM (``sm_count``) up to the number of work tiles. ``row_blocks``: work tiles of a
    (batch, head) (a grid layout's patches), by default ``Sq`` in row blocks."""
    source.check_schedule(schedule)
    B, Sq, H, _ = q_shape
    if row_blocks is None:
        row_blocks = -(-Sq // source.BM)
    return min(sm_count, row_blocks * H * B), 1, 1


def tensor_maps(block_n: int, q_shape, k_shape, v_shape) -> bytes:
    """The K, V, Q and out tensor-map templates the kernel takes, 128 bytes each (K/V boxes of
    ``block_n`` rows, Q boxes of a row block, out's of a warpgroup's 64 rows; a kernel whose
    ``o_store`` is ``"registers"`` reads no out map)."""
    return b"".join(
        tensor_map.bshd_template(tuple(shape), rows)
        for shape, rows in ((k_shape, block_n), (v_shape, block_n), (q_shape, source.BM),
                            (q_shape, source.BM // 2))
    )


def grid_tensor_maps(tiles: grid_tiles.GridTiles, q_shape, k_shape, v_shape) -> bytes:
    """The K, V and Q tensor-map templates of the grid forward: boxes of a key tile and of a
    query patch, stepping by the dilations (:func:`tensor_map.grid_template`)."""
    return b"".join(
        tensor_map.grid_template(tuple(shape), tiles.grid, box, tiles.dilation)
        for shape, box in ((k_shape, tiles.k_tile), (v_shape, tiles.k_tile), (q_shape, tiles.q_tile))
    )


def bwd_grid(k_shape: tuple[int, ...], sm_count: int) -> tuple[int, int, int]:
    """CTAs of the backward over ``k [B, Skv, Hkv, D]``: one per SM (``sm_count``), up to the
    number of work items (key blocks of a batch and KV head: :func:`bwd_source.block_n` keys at the
    head dim), which they take by ticket."""
    B, Skv, Hkv, D = k_shape
    return min(sm_count, -(-Skv // bwd_source.block_n(D)) * Hkv * B), 1, 1


def bwd_tensor_maps(q_shape, k_shape) -> bytes:
    """The K, V, Q and dO tensor-map templates of the backward, 128 bytes each."""
    kv = tensor_map.bshd_template(tuple(k_shape), bwd_source.block_n(k_shape[-1]))
    qdo = tensor_map.bshd_template(tuple(q_shape), bwd_source.BM)
    return kv + kv + qdo + qdo
