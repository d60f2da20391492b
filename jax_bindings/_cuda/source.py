"""A Hopper (sm_90a) attention forward for a band baked in: its variants' programs and their checks.

The kernel is ``kernels/fwd/fwd.cu`` and its parts (:mod:`jax_bindings._cuda.parts`), one per
concern: the tile scheduler (``strided``, ``queue``), the work tiles' walks and masks (band,
runtime lengths and ids, shifted queries; a grid layout's spatial tiles), the TMA producer, the
consumers' main loop with the online softmax, and the epilogue; the
parts any kernel may use are in ``kernels/common/``. :func:`program` is a variant's program: the
parts and one generated header of its constants (``fwd_config.cuh``: tile sizes, the band, the
schedule, the flags; the ``wgmma`` instructions for its tile width). :func:`source` is the same
as one text that compiles alone, for tests and tools that read or edit it. The generator of the
``cuda`` backend (:mod:`jax_bindings._cuda.backend`, which picks the variant in
:mod:`jax_bindings._cuda.plan`).

Mask: a query at row ``i`` sees keys ``j`` with ``i - left <= j <= i + right`` (``None``: no
bound; either may be negative), ``0 <= j < Skv``; a row block that sees no key skips its walk
(the producer loads nothing for it; the consumers still write its rows: ``out = 0``,
``lse = -inf``). Dense is ``(None, None)``; causal ``(None, 0)``; a causal window of ``W`` keys
``(W - 1, 0)``. With ``band_block > 1`` the band is measured from each row's block's first row
``a(i) = i - i % band_block`` instead of ``i`` (block-local masks: ``left = lookback * block``,
``right = block - 1``); where ``band_block`` is a multiple of the row block, every row of a
row block sees the same keys, and where they start and end on key tiles no tile is masked.
Inputs ``[B, S, H, D]`` bf16 or fp16 (``dtype``), ``D`` a multiple of 16 up to 256 (``head_dim``;
the tiles are :func:`padded_head_dim` columns wide), GQA by ``H // Hkv``; outputs
``out [B, Sq, H, D]`` in the input dtype and ``lse [B, H, Sq]`` fp32 (natural log; ``-inf`` and
``out = 0`` on a row with no key). ``sem`` is one int32: the queue's ticket counter, zeroed
before the launch (:func:`takes_tickets`); the other schedules never read it, and it is not.
Parameters: the array inputs, the scalars, then the array outputs (the order jaxlib's kernel
call hands buffers in): ``q, k, v, tmap_templates, [runtime arrays,] Sq, Skv, H, Hkv, B,
scale_log2, out, lse, sem, tmap_slots``.

A runtime mask (``source(runtime=)``, arrays from :mod:`jax_bindings._cuda.runtime_tables`) is
ANDed with the band: with lengths, a row block of padding walks nothing and padding rows get
``out = 0``, ``lse = -inf``, keys at or past ``kv_len`` are masked like keys past ``Skv``; with
segment ids, a row block walks only the keys of its rows' ids (its run in ``rt_ranges``), the
producer copies each key tile's ids with its K tile (a stage's K is released after the softmax
that reads them), and tiles outside the keys every row of the block sees compare ids.

With ``source(grid=)`` a grid layout's spatial tiles replace the band
(:mod:`jax_bindings._cuda.grid_tiles`, ``kernels/fwd/mask_grid.cuh``).
"""

from __future__ import annotations

import hashlib

from jax_bindings._cuda import parts

BM = 128
D = 128  # the default head dim; program(head_dim=) takes any multiple of 16 up to 256
BN = 128  # default key tile; source(block_n=) takes any multiple of 16 up to 256
CONSUMER_WARPS = 8
PRODUCER_WARPS = 4
# setmaxnreg: a CTA of 12 warps starts at 168 registers a thread (3 warps share a sub-partition's
# 16K); one warp of each warpgroup per sub-partition must stay within 3 x 168 = 504 after the move
PRODUCER_REGS, CONSUMER_REGS = 24, 240
THREADS = (CONSUMER_WARPS + PRODUCER_WARPS) * 32
KERNEL_NAME = "splat_fwd_wgmma"
UNBOUNDED = 1 << 30
SCHEDULES = {"strided": 1, "queue": 2}  # how CTAs get their work tiles (see program())
O_STORES = ("registers", "tma")  # how the epilogue writes out (see source())


def takes_tickets(schedule: str) -> bool:
    """Whether a kernel in ``schedule`` takes its work tiles from the ticket counter ``sem`` (which
    must then be zeroed before each launch; the other schedules never read it)."""
    return schedule == "queue"


SLOT_BYTES = 512  # global memory a CTA publishes its K, V, Q and out tensor maps in
SMEM_LIMIT = 232448  # bytes of shared memory a CTA may opt into on sm_90


def bar_bytes(stages: int) -> int:
    """Shared memory of the mbarriers (32 bytes a K/V stage, 32 for two Q slots, 32 for the two
    ticket slots) and the two tickets (8 bytes), padded to 128: 256 bytes with 2 or 3 stages."""
    return -(-(32 * stages + 72) // 128) * 128


def padded_head_dim(head_dim: int) -> int:
    """The columns of the kernel's tiles for ``head_dim``: whole 64-column blocks of 128-byte
    rows (the 128-byte swizzle's unit); TMA fills the columns past ``head_dim`` with zeros, which
    add nothing to ``Q K^T``, and ``out``'s are never stored."""
    return -(-head_dim // 64) * 64


def check_head_dim(head_dim) -> None:
    """ValueError naming ``head_dim`` unless the kernels' tiles take it (a multiple of 16, rows
    of whole 16-byte chunks as TMA copies them, up to 256: a wgmma's widest N)."""
    ok = isinstance(head_dim, int) and not isinstance(head_dim, bool) and head_dim % 16 == 0
    if not ok or not 16 <= head_dim <= 256:
        raise ValueError(f"head_dim must be a multiple of 16 in [16, 256], got {head_dim!r}")


def smem_bytes(stages: int, block_n: int = BN, runtime: str = "", q_stages: int = 1,
               o_store: str = "registers", head_dim: int = D) -> int:
    """Dynamic shared memory, the same for every schedule: ``q_stages`` Q tiles, ``stages`` K
    and V tiles, the mbarriers and tickets (:func:`bar_bytes`), a tensor-map staging buffer of
    128 bytes for each map the kernel publishes (K, V, Q, and out with ``o_store="tma"``, whose
    rows are staged in the Q tile), with segment ids (``runtime="ids"``) the key tiles' ids (4
    bytes a key), 1 KiB for alignment. Tiles are :func:`padded_head_dim` columns wide."""
    hd = padded_head_dim(head_dim)
    tile = block_n * hd * 2
    ids = stages * block_n * 4 if runtime == "ids" else 0
    maps = map_stage_bytes(o_store)
    return q_stages * BM * hd * 2 + 2 * stages * tile + bar_bytes(stages) + maps + ids + 1024


def map_stage_bytes(o_store: str) -> int:
    """Shared memory of the tensor-map staging buffers: 128 bytes for each of K, V, Q (and out
    with ``o_store="tma"``)."""
    return 128 * (4 if o_store == "tma" else 3)


# wgmma_ss's operand layouts: the specialisation's name and its PTX transpose flags of A and B
SS_LAYOUTS = {"k": ("wgmma_ss", "0, 0"), "mn": ("wgmma_ss_t", "1, 1"), "b_mn": ("wgmma_ss_bmn", "0, 1")}


def wgmma_ss(n: int, transposed: bool = False, dtype: str = "bfloat16", layout: str | None = None) -> str:
    """``wgmma`` m64n{n}k16 on ``dtype``, A and B from shared memory, fp32 accumulators ``d``: both
    K-major (``wgmma_ss<E, n>``), or, ``transposed``, both MN-major (``wgmma_ss_t<E, n>``), or
    ``layout="b_mn"``, A K-major and B MN-major (``wgmma_ss_bmn<E, n>``), as a specialisation of
    ``kernels/common/wgmma.cuh``'s declaration."""
    regs = n // 2
    outs = ", ".join(f"%{i}" for i in range(regs))
    operands = ", ".join(f'"+f"(d[{i}])' for i in range(regs))
    name, tr = SS_LAYOUTS[layout or ("mn" if transposed else "k")]
    elem, tag = ELEMENTS[dtype], ELEMENT_TYPES[dtype]
    return f"""
template <>
__device__ __forceinline__ void {name}<{tag}, {n}>(float* d, uint64_t a, uint64_t b, int accumulate) {{
  asm volatile(
    "{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{regs + 2}, 0;\\n"
    "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{elem}.{elem} {{{outs}}}, "
    "%{regs}, %{regs + 1}, p, 1, 1, {tr};\\n}}\\n"
    : {operands}
    : "l"(a), "l"(b), "r"(accumulate));
}}
"""


def wgmma_rs(n: int, dtype: str = "bfloat16") -> str:
    """``wgmma`` m64n{n}k16 on ``dtype``, A from registers, B from shared memory MN-major
    (transposed): ``wgmma_rs<E, n>``."""
    regs = n // 2
    outs = ", ".join(f"%{i}" for i in range(regs))
    operands = ", ".join(f'"+f"(d[{i}])' for i in range(regs))
    elem, tag = ELEMENTS[dtype], ELEMENT_TYPES[dtype]
    return f"""
template <>
__device__ __forceinline__ void wgmma_rs<{tag}, {n}>(float* d, const uint32_t* a, uint64_t b) {{
  asm volatile(
    "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{elem}.{elem} {{{outs}}}, "
    "{{%{regs}, %{regs + 1}, %{regs + 2}, %{regs + 3}}}, %{regs + 4}, 1, 1, 1, 1;\\n"
    : {operands}
    : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}}
"""


# What the passes around the backward (bwd_passes) put before their kernels: the fixed-width types
# and ``pack2`` (two fp32 values rounded to the element type ``__ELEM__``, which they substitute).
HELPERS = parts.read("common/types.cuh").replace("#pragma once\n", "") + r"""
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  uint32_t v;
  asm("cvt.rn.__ELEM__x2.f32 %0, %2, %1;" : "=r"(v) : "f"(lo), "f"(hi));
  return v;
}
"""


def check_arguments(left, right, stages: int, dtype: str, band_block: int = 1) -> None:
    """ValueError naming the argument of a generator (this one's or the backward's) that is bad."""
    if isinstance(band_block, bool) or not isinstance(band_block, int) or not 1 <= band_block < UNBOUNDED:
        raise ValueError(f"band_block must be an int in [1, 2**30), got {band_block!r}")
    if stages < 1:
        raise ValueError(f"stages must be >= 1, got {stages}")
    if dtype not in ELEMENTS:
        raise ValueError(f"dtype must be one of {sorted(ELEMENTS)}, got {dtype!r}")
    for name, x in (("left", left), ("right", right)):
        if x is not None and (isinstance(x, bool) or not isinstance(x, int) or abs(x) >= UNBOUNDED):
            raise ValueError(f"{name} must be an int of magnitude < 2**30 or None, got {x!r}")


def section_bytes_of(heads: int, kv_len: int, head_dim: int = D) -> int:
    """``section_bytes`` that makes the queue's sections ``heads`` (batch, head)s at ``kv_len``
    keys: K and V of a head counted as the kernel counts them (``4 * head_dim * Skv`` bytes)."""
    return heads * 4 * head_dim * kv_len


def check_soft_cap(soft_cap) -> None:
    """ValueError naming ``soft_cap`` unless it is None or a finite float > 0."""
    if soft_cap is not None and (isinstance(soft_cap, bool) or not isinstance(soft_cap, (int, float))
                                 or not 0 < soft_cap < float("inf")):
        raise ValueError(f"soft_cap must be None or a finite number > 0, got {soft_cap!r}")


def check_schedule(schedule: str) -> None:
    """ValueError naming ``schedule`` unless it is one of :data:`SCHEDULES`."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {sorted(SCHEDULES)}, got {schedule!r}")


def check_section_bytes(section_bytes) -> None:
    if type(section_bytes) is not int or not 0 <= section_bytes < 2**40:
        raise ValueError(f"section_bytes must be an int in [0, 2**40), got {section_bytes!r}")


def bound(x: int | None) -> int:
    return UNBOUNDED if x is None else int(x)


ELEMENTS = {"bfloat16": "bf16", "float16": "f16"}  # input dtype -> PTX element type
ELEMENT_TYPES = {"bfloat16": "Bf16", "float16": "Fp16"}  # input dtype -> the kernels' element tag

# Runtime masks (:mod:`jax_bindings._runtime`) a kernel is generated for, and the int32 arrays
# each kind adds to its inputs (after ``tmap_templates``), in order (their meaning:
# :mod:`jax_bindings._cuda.runtime_tables`): ``rt_lens`` with lengths; with ids also the ids and
# per-block ranges.
RUNTIMES = {"": 0, "lengths": 1, "ids": 2}
FWD_RUNTIME_ARRAYS = ("rt_lens", "rt_q_ids", "rt_kv_ids", "rt_ranges")


def runtime_arrays(runtime: str, names: tuple[str, ...]) -> tuple[str, ...]:
    """The runtime-mask arrays among ``names`` (a kernel's, in order) that ``runtime`` passes."""
    if runtime not in RUNTIMES:
        raise ValueError(f"runtime must be one of {sorted(RUNTIMES)}, got {runtime!r}")
    return names[: {0: 0, 1: 1, 2: len(names)}[RUNTIMES[runtime]]]


def runtime_signature(runtime: str, names: tuple[str, ...]) -> tuple[str, str]:
    """``(parameters, locals)``: the arrays among ``names`` that ``runtime`` passes, as kernel
    parameters, and the others as null pointers (so that code behind ``if (RT ...)`` compiles in
    every variant)."""
    given = runtime_arrays(runtime, names)
    return ("".join(f"const int* __restrict__ {n}, " for n in given),
            " ".join(f"const int* {n} = nullptr;" for n in names if n not in given))


def grid_constants(grid) -> dict[str, int | bool]:
    """The grid geometry's constants: ``GridTiles`` baked in, or, with no grid, ``GRID = false``
    (unit axes)."""
    on = grid is not None
    g = grid.grid if on else (1, 1, 1)
    d = grid.dilation if on else (1, 1, 1)
    q = grid.q_tile if on else (1, 1, BM)
    k = grid.k_tile if on else (1, 1, BN)
    p = grid.patches if on else (1, 1, 1)
    out: dict[str, int | bool] = {"GRID": on}
    for name, vals in (("GN", g), ("GD", d), ("QT", q), ("KT", k), ("GP", p)):
        out.update({f"{name}{a}": int(v) for a, v in enumerate(vals)})
    out.update(GPMAX=grid.pmax if on else 1, GNMAX=grid.nmax if on else 1)
    return out


def program(left: int | None, right: int | None, *, stages: int = 2,
           block_n: int = BN, dtype: str = "bfloat16", schedule: str = "strided", section_bytes: int = 0,
           runtime: str = "", grid=None, q_stages: int = 1, o_store: str = "registers",
           band_block: int = 1, shifted: bool = False, head_dim: int = D,
           soft_cap: float | None = None) -> parts.Program:
    """The kernel's program (``kernels/fwd/fwd.cu``, its parts and a generated header of its
    constants) for the mask ``a(i) - left <= j <= a(i) + right`` (``None``: unbounded),
    ``a(i) = i - i % band_block`` (row ``i`` itself by default; :class:`acsr.BandForm`'s ``block``).

    Q, K and V reach shared memory by TMA: ``tmap_templates`` holds K's, V's and Q's tensor maps,
    encoded on the host for the call's shapes; each CTA publishes them with its base addresses in
    its :data:`SLOT_BYTES` slot of ``tmap_slots``. Two consumer warpgroups take turns issuing
    (ping-pong), each overlapping a tile's ``Q K^T`` with the last tile's ``P V``.
    ``schedule`` (:data:`SCHEDULES`): at most one CTA per SM (``grid = (CTAs, 1, 1)``) looping over
    work tiles (row block, head, batch; longest walks first): with ``"strided"`` each takes every
    ``gridDim.x``-th one, with ``"queue"`` the next one by ticket from the counter ``sem`` (zeroed
    before the launch); the producer loads the next tile's Q and K/V while the consumers finish
    the last one. ``section_bytes``: the queue takes
    (batch, head)s in sections of as many as ``section_bytes`` of K and V hold at the call's
    ``Skv`` (at least one), a section after another; within one, longest walks first across its
    heads. 0 (the default): one (batch, head) after another. The strided schedule takes work
    tiles in the same order when ``section_bytes`` > 0; with 0, every (batch, head) interleaved.
    ``runtime`` (:data:`RUNTIMES`): the runtime mask the kernel ANDs with the band:
    ``"lengths"``, padding (queries at or past ``q_len`` get ``out = 0``, ``lse = -inf``; keys
    at or past ``kv_len`` are never seen);
    ``"ids"``, padding and segment ids (a query sees a key of its own id), with the key range of
    each row block from ``rt_ranges`` (:func:`jax_bindings._cuda.runtime_tables.fwd_arrays`).
    ``grid`` (a :class:`jax_bindings._cuda.grid_tiles.GridTiles`, with ``left = right = None``):
    a grid layout's spatial tiles replace the band: a work tile is a query patch, its walk the
    key tiles of its key box, each masked from the per-axis windows unless inside all of them;
    the kernel then takes ``grid_tables`` (:func:`jax_bindings._cuda.grid_tiles.grid_plan`)
    after ``tmap_templates`` and 5-D tensor maps
    (:func:`jax_bindings._cuda.tensor_map.grid_template`), and needs
    ``block_n = prod(grid.k_tile)`` and no runtime mask.
    ``q_stages``: Q tiles in shared memory, 1 or 2: with 2
    the producer loads the next work tile's Q, then its first K and V tiles, while the consumers
    still walk the current one; with 1 it waits until the current tile's last ``Q K^T`` is done.
    ``o_store``: how the epilogue writes ``out``: ``"registers"``, each thread its values; ``"tma"``
    (a band kernel), each warpgroup its rows into its half of the tile's Q
    slot, then two TMA stores (``tmap_templates`` then holds out's map, boxes of 64 rows, fourth);
    the slot goes back to the producer once the stores have read it: after the next walk's first
    products with two Q tiles, at once with one.
    ``block_n``: keys per tile (the wgmma N of ``Q K^T``). V's MN-major descriptor has the 64-column block
    stride (``block_n * 128`` bytes) as its leading offset and 8 keys (1024 bytes) as its stride;
    the other order was built and fails the check.
    ``shifted``: queries at run-time positions (a chunk of queries at an offset into a KV cache):
    query row ``i`` of batch row ``b`` is row ``i + shift[b]`` of the band, and only rows in
    ``[q_first[b], q_end[b])`` see keys (the others get ``out = 0``, ``lse = -inf``); ``rt_lens``
    is then ``[B, 4]``: ``(q_end, kv_len, shift, q_first)``
    (:func:`jax_bindings._cuda.runtime_tables.shifted_lens`). Needs a runtime mask and a plain
    band (``band_block = 1``, no grid).
    ``head_dim``: of q, k, v and out (:func:`check_head_dim`); the tiles are
    :func:`padded_head_dim` columns wide. ``soft_cap``: ``c`` in ``c * tanh(s * scale / c)``,
    applied to each score before the mask (None: none).
    """
    check_schedule(schedule)
    if block_n % 16 or not 16 <= block_n <= 256:
        raise ValueError(f"block_n must be a multiple of 16 in [16, 256], got {block_n}")
    check_arguments(left, right, stages, dtype, band_block)
    check_head_dim(head_dim)
    check_soft_cap(soft_cap)
    check_section_bytes(section_bytes)
    if q_stages not in (1, 2):
        raise ValueError(f"q_stages must be 1 or 2, got {q_stages!r}")
    if o_store not in O_STORES:
        raise ValueError(f"o_store must be one of {O_STORES}, got {o_store!r}")
    if o_store == "tma" and grid is not None:
        raise ValueError(f"o_store='tma' needs a band kernel (no grid tiles), got grid={grid!r}")
    if shifted and (not runtime or band_block != 1 or grid is not None):
        raise ValueError(f"shifted needs a runtime mask and a plain band, got runtime={runtime!r}, "
                         f"band_block={band_block!r}, grid={grid!r}")
    if grid is not None:
        if runtime or left is not None or right is not None or band_block != 1:
            raise ValueError(f"grid tiles need no runtime mask and no band, got runtime={runtime!r}, "
                             f"left={left!r}, right={right!r}, band_block={band_block!r}")
        if block_n != grid.block_n:
            raise ValueError(f"block_n must be the key tile's {grid.block_n} keys with grid tiles, "
                             f"got {block_n}")
    rt_params, rt_locals = runtime_signature(runtime, FWD_RUNTIME_ARRAYS)
    constants = {
        "BM": BM, "BN": block_n, "HD": padded_head_dim(head_dim), "HEAD_DIM": head_dim,
        "SOFT_CAP": float(soft_cap or 0.0), "STAGES": stages, "LEFT": bound(left), "RIGHT": bound(right),
        "BAND_BLOCK": band_block, "UNBOUNDED": UNBOUNDED, "SCHEDULE": SCHEDULES[schedule],
        "SECTION_BYTES": section_bytes, "Q_STAGES": q_stages,
        "RT": RUNTIMES[runtime], "SHIFTED": shifted, **grid_constants(grid),
        "BAR_BYTES": bar_bytes(stages), "MAP_STAGE_BYTES": map_stage_bytes(o_store),
        "O_TMA": o_store == "tma",
        "THREADS": THREADS, "CONSUMER_WARPS": CONSUMER_WARPS,
        "CONSUMER_REGS": CONSUMER_REGS, "PRODUCER_REGS": PRODUCER_REGS, "SLOT_BYTES": SLOT_BYTES,
    }
    on = grid is not None
    macros = {  # the parameters a variant takes between tmap_templates and Sq; the others null
        "SPLAT_FWD_TABLES": "const int* __restrict__ grid_tables, " if on else rt_params,
        "SPLAT_FWD_NO_TABLES": rt_locals + ("" if on else " const int* grid_tables = nullptr;"),
    }
    header = parts.constants_header(
        "cfg", constants, types={"Elem": ELEMENT_TYPES[dtype]},
        includes=("common/types.cuh", "common/wgmma.cuh"), macros=macros,
        after=wgmma_ss(block_n, dtype=dtype) + wgmma_rs(padded_head_dim(head_dim), dtype=dtype))
    return parts.program("fwd/fwd.cu", {"fwd_config.cuh": header}, "splat_fwd")


def source(left: int | None, right: int | None, **kwargs) -> str:
    """:func:`program`'s kernel as one text that compiles alone (:meth:`parts.Program.flat`), its
    kernel named :data:`KERNEL_NAME` (:func:`with_unique_name` names it after the text)."""
    prog = program(left, right, **kwargs)
    return prog.flat().replace(prog.name, KERNEL_NAME)


def with_unique_name(text: str, kernel: str = KERNEL_NAME, prefix: str = "splat_fwd") -> tuple[str, str]:
    """``(name, text)``: the kernel ``kernel`` renamed ``<prefix>_<digest of the source>``.

    jaxlib keeps the modules it loaded keyed by kernel name, shared memory and PTX; a kernel
    handed over as a cubin has no PTX, so two variants of one name and shared-memory size would
    share the first one loaded. A name derived from the source tells every variant apart.
    """
    name = f"{prefix}_{hashlib.sha256(text.encode()).hexdigest()[:20]}"
    return name, text.replace(kernel, name)
