"""A Hopper (sm_90a) attention backward for a band baked in: its variants' programs and the host's
view of its buffers.

The backward of :mod:`jax_bindings._cuda.source`'s forward, from the same common parts. The kernel
is ``kernels/bwd/bwd.cu`` and its parts, one per concern: the work items taken by ticket in a key
order (``tile_scheduler.cuh``), their walks (``mask.cuh``), the producer, the consumers' main
loop and the dQ writers (``dq_writer.cuh``, the ordered sum of dQ). :func:`program` is a
variant's program with one generated header of its constants (``bwd_config.cuh``);
:func:`bwd_source` the same as one text that compiles alone. A work item is ``BN = 128`` keys of
one (batch, KV head) (64 where the head dim runs wide: :func:`block_n`): its walk is the query
blocks of ``BM = 64`` rows that see any of them, for every query head of its GQA group. One
CTA runs per SM (at most one per item) and takes items by ticket, until none is left.

dQ is a sum over key blocks: CTAs add their parts to ``dq_acc`` (fp32, each query block in the
consumers' fragment order: :func:`dq_from_acc`; ``bwd_passes.dq_rows`` puts it back in rows).
With ``ordered`` (the default) the additions to one query block come in a fixed order, the key
order: reruns are bit-identical; the first key block in that order stores its part instead of
adding it, so ``dq_acc`` needs no zeroing before the launch (query blocks that no key block
reaches are never written: ``bwd_passes.dq_rows`` zeroes rows that see no key). ``ordered=False``
adds in any order (not reproducible bit for bit) and exists to measure what the order costs.

The key order (``key_order``, :data:`KEY_ORDERS`), per head: ``"last_first"`` takes a head's
last key block first and walks each key block's query blocks from the first; ``"first_first"``
is its mirror (first key block first, query blocks from the last); ``"first_first_at_end"``
takes the last section's heads first-first and the others last-first. Where the first key
blocks walk the most query blocks (causal), last-first takes the longest walks last, so that
the CTAs run out of work on a few long walks, and first-first takes them first. But in
last-first a key block meets each query block two steps after the key block before it in the
order (its walk starts two query blocks earlier), which absorbs the time an addition takes to
complete, and in first-first on the same step: there a key block waits on the one before it
unless it started late enough. First-first on the last section only keeps most of both.

Mask: as the forward's, ``a(i) - left <= j <= a(i) + right``, ``0 <= j < Skv``, ``a(i) = i`` or
its block's first row (``band_block``); a key block's walk is the rows whose ``a(i)`` is in
``[n0 - right, n0 + BN - 1 + left]``, which never moves back from one key block to the next.
Inputs ``q, dout [B, Sq, H, D]``, ``k, v [B, Skv, Hkv, D]`` (bf16 or fp16; ``D`` padded to whole
64-column blocks: 64, 96, 128, 192, 256; the tiles are :func:`source.padded_head_dim` wide),
``lse2 [B, H, Sq_pad]`` (the forward's lse times log2(e); ``+inf`` on a row with no key and on
the padding to ``Sq_pad``, a multiple of 64), ``delta [B, H, Sq_pad]`` (rowsum(dout * out), 0 on
the padding). Outputs ``dk``, ``dv`` like k, v (dk times ``scale``), ``dq_acc`` fp32
(:func:`dq_acc_shape`; dQ without the scale once ``bwd_passes.dq_rows`` reorders it; zeroed
before the launch when not ``ordered``), ``sem`` (int32, zeroed before the launch: a ticket
counter, then a turn counter per (batch, head, query block)), and the CTAs' tensor-map slots.
Parameters, in jaxlib's order: ``q, k, v, dout, lse2, delta, tmap_templates, [runtime arrays,]
Sq, Skv, H, Hkv, B, scale_log2, scale, dk, dv, dq_acc, sem, tmap_slots``.

A runtime mask (``bwd_source(runtime=)``, arrays from :mod:`jax_bindings._cuda.runtime_tables`)
is ANDed with the band: padding rows need nothing (their ``lse2`` is ``+inf``), keys at or past
``kv_len`` are masked and walk nothing; with segment ids a key block walks only the query
blocks of its keys' ids, and the producer copies each step's query ids with its Q and dO into
the tensor-map staging buffers (free once the maps are published).
"""

from __future__ import annotations

from jax_bindings._cuda import parts, source

BM, D = 64, source.D
BN = 128  # keys an item up to 128 tile columns; past them, WIDE_BN
WIDE_BN = 64
THREADS = source.THREADS
KERNEL_NAME = "splat_bwd_wgmma"
SLOT_BYTES = 512  # K, V, Q and dO tensor maps of a CTA
STAT_BYTES = 2 * BM * 4  # one step's lse and delta


def is_wide(head_dim: int) -> bool:
    """Whether the kernel runs ``head_dim`` wide (``kernels/bwd/params.cuh``): past 128 tile
    columns, both consumer warpgroups share an item's keys and split its dK and dV by columns."""
    return source.padded_head_dim(head_dim) > 128


def block_n(head_dim: int = D) -> int:
    """Keys an item: 64 a consumer warpgroup, or 64 shared where the kernel runs wide."""
    return WIDE_BN if is_wide(head_dim) else BN


def dq_tile_bytes(head_dim: int = D) -> int:
    """One step's dQ, fp32, over the tiles' :func:`source.padded_head_dim` columns."""
    return BM * source.padded_head_dim(head_dim) * 4


def smem_bytes(stages: int, head_dim: int = D, dq_buffers: int = 2) -> int:
    """K and V, ``stages`` Q/dO buffers with their lse/delta, two dS^T buffers (and two P^T buffers
    where the kernel runs wide), ``dq_buffers`` dQ buffers, the mbarriers and the ticket (padded to
    128), four tensor-map staging buffers, 1 KiB for alignment; tiles
    :func:`source.padded_head_dim` columns wide."""
    hd, bn = source.padded_head_dim(head_dim), block_n(head_dim)
    kv, qdo, ds = 2 * bn * hd * 2, 2 * BM * hd * 2, bn * BM * 2
    bars = -(-(8 * (10 + 2 * stages) + 16) // 128) * 128
    ds_p = (4 if is_wide(head_dim) else 2) * ds
    dq = dq_buffers * dq_tile_bytes(head_dim)
    return kv + stages * (qdo + STAT_BYTES) + ds_p + dq + bars + 4 * 128 + 1024


def num_q_blocks(sq: int) -> int:
    return -(-sq // BM)


def fragment_axes(head_dim: int = D) -> tuple[int, ...]:
    """A query block's dQ in ``dq_acc`` is in the consumers' fragment order, so that a warp's stores
    to shared memory are 256 contiguous bytes and the block is one bulk reduction: the axes of a
    block, outermost first, are (warpgroup w, column group cg, row half rh, warp wq, lane / 4 l4,
    lane % 4 l2, pair), holding row 16 wq + 8 rh + l4 and column ``HD / 2`` w + 8 cg + 2 l2 + pair
    (``HD``: :func:`source.padded_head_dim`; each warpgroup computes half its columns)."""
    return 2, source.padded_head_dim(head_dim) // 16, 2, 4, 8, 4, 2


def dq_acc_shape(b: int, h: int, sq: int, head_dim: int = D) -> tuple[int, int, int, int]:
    """Shape of the kernel's fp32 ``dq_acc``: ``[B, H, query blocks, BM * HD]`` (``HD``:
    :func:`source.padded_head_dim`)."""
    return b, h, num_q_blocks(sq), BM * source.padded_head_dim(head_dim)


def dq_from_acc(acc, sq: int, lse=None, head_dim: int = D):
    """``dq_acc`` (NumPy or JAX array, :func:`dq_acc_shape`) as ``[B, Sq, H, head_dim]``; with ``lse``
    (the forward's, ``[B, H, Sq]``), 0 on the rows that see no key (``lse = -inf``), whatever
    ``dq_acc`` holds there: the ordered kernel never writes a query block no key block reaches.
    What ``bwd_passes.dq_rows`` does on the GPU (before the scale), written with array operations:
    the tests' reference for it and for the fragment order."""
    b, h, nq, _ = acc.shape
    hd = source.padded_head_dim(head_dim)
    blocks = acc.reshape(b, h, nq, *fragment_axes(head_dim))
    # to (B, nq, wq, rh, l4, H, w, cg, l2, pair)
    rows = blocks.transpose(0, 2, 6, 5, 7, 1, 3, 4, 8, 9).reshape(b, nq * BM, h, hd)[:, :sq, :, :head_dim]
    if lse is None:
        return rows
    xp = rows.__array_namespace__()
    seen = ~xp.isinf(xp.permute_dims(lse, (0, 2, 1)))[..., None]  # lse is -inf or finite
    return xp.where(seen, rows, xp.zeros((), dtype=rows.dtype))


def section_bytes_of(kv_heads: int, group: int, sq: int, head_dim: int = D) -> int:
    """``section_bytes`` that makes the backward's sections ``kv_heads`` (batch, KV head)s of
    ``group`` query heads each at ``sq`` queries: Q and dO counted as the kernel counts them
    (``4 * head_dim * group * Sq`` bytes a KV head)."""
    return kv_heads * 4 * head_dim * group * sq


def sem_words(b: int, h: int, sq: int) -> int:
    """int32 words of the ``sem`` output: the ticket, then a turn counter per query block and head."""
    return 1 + b * h * num_q_blocks(sq)


BWD_RUNTIME_ARRAYS = ("rt_lens", "rt_q_ids", "rt_kv_ids", "rt_ranges", "rt_leads")


KEY_ORDERS = ("last_first", "first_first_at_end", "first_first")


def program(left: int | None, right: int | None, *, stages: int = 2, dtype: str = "bfloat16",
            ordered: bool = True, runtime: str = "", section_bytes: int = 0,
            key_order: str = "last_first", band_block: int = 1, head_dim: int = D,
            soft_cap: float | None = None, dq_buffers: int = 2) -> parts.Program:
    """The backward kernel's program (``kernels/bwd/bwd.cu``, its parts and a generated header of
    its constants) for the mask ``a(i) - left <= j <= a(i) + right`` (``None``: unbounded),
    ``a(i) = i - i % band_block`` (as in :func:`source.source`).

    ``stages``: depth of the Q/dO ring; ``ordered``: dQ added in a fixed order (bit-identical
    reruns) rather than as it comes (see the module docstring). ``runtime``
    (:data:`source.RUNTIMES`): the runtime mask ANDed with the band, as in the forward; its
    arrays (:data:`BWD_RUNTIME_ARRAYS`, the ids' ranges from
    :func:`jax_bindings._cuda.runtime_tables.bwd_arrays`) follow ``tmap_templates``.
    ``section_bytes``: items are taken in sections of as many (batch, KV head)s as that many
    bytes of their Q and dO hold at the call's ``Sq`` (at least one; 0: one), a key block of
    each in turn. ``key_order`` (:data:`KEY_ORDERS`): the order of a head's key blocks in the
    tickets and in each query block's dQ sum (module docstring). ``head_dim`` and ``soft_cap``: as
    the forward's (:func:`source.program`); the cap's derivative ``1 - tanh^2`` scales dS; past
    128 tile columns the kernel runs wide (:func:`is_wide`, items of :func:`block_n` keys).
    ``dq_buffers``: shared-memory buffers a step's dQ leaves through (1 or 2; one where two do not
    fit).
    """
    source.check_arguments(left, right, stages, dtype, band_block)
    source.check_head_dim(head_dim)
    source.check_soft_cap(soft_cap)
    hd = source.padded_head_dim(head_dim)
    if dq_buffers not in (1, 2):
        raise ValueError(f"dq_buffers must be 1 or 2, got {dq_buffers}")
    if smem_bytes(stages, head_dim, dq_buffers) > source.SMEM_LIMIT:
        raise ValueError(f"stages={stages} and dq_buffers={dq_buffers} need "
                         f"{smem_bytes(stages, head_dim, dq_buffers)} bytes of shared memory at head_dim "
                         f"{head_dim}, over the {source.SMEM_LIMIT} a CTA may have")
    source.check_section_bytes(section_bytes)
    if key_order not in KEY_ORDERS:
        raise ValueError(f"key_order must be one of {KEY_ORDERS}, got {key_order!r}")
    rt_params, rt_locals = source.runtime_signature(runtime, BWD_RUNTIME_ARRAYS)
    constants = {
        "BM": BM, "BN": block_n(head_dim), "HD": hd, "HEAD_DIM": head_dim, "SOFT_CAP": float(soft_cap or 0.0),
        "STAGES": stages, "DQ_BUFS": dq_buffers,
        "LEFT": source.bound(left), "RIGHT": source.bound(right),
        "BAND_BLOCK": band_block, "UNBOUNDED": source.UNBOUNDED, "ORDERED": ordered,
        "FIRST_FIRST": KEY_ORDERS.index(key_order), "RT": source.RUNTIMES[runtime],
        "SECTION_BYTES": section_bytes, "STAT_BYTES": STAT_BYTES, "THREADS": THREADS,
        "CONSUMER_WARPS": source.CONSUMER_WARPS, "CONSUMER_REGS": source.CONSUMER_REGS,
        "PRODUCER_REGS": source.PRODUCER_REGS, "SLOT_BYTES": SLOT_BYTES,
    }
    # params.cuh: wide, S^T and dP^T over half the step's queries and dK and dV over half the
    # columns, from shared memory; narrow, over all of them, P^T and dS^T from registers (the
    # other form's products are named in the kernel's untaken branch, so both are defined)
    # (wide, a warpgroup's columns run as pieces inside 64-column blocks: 96 as 64 + 32)
    wide = is_wide(head_dim)
    kv_n = hd // 2 if wide else hd
    pieces = ({kv_n} if kv_n % 64 == 0 else {64, 32}) if wide else set()
    wgmma = (source.wgmma_ss(BM // 2 if wide else BM, dtype=dtype)
             + "".join(source.wgmma_ss(n, transposed=True, dtype=dtype) for n in sorted({hd // 2} | pieces))
             + source.wgmma_rs(kv_n, dtype=dtype)
             + "".join(source.wgmma_ss(n, dtype=dtype, layout="b_mn") for n in sorted({kv_n} | pieces)))
    header = parts.constants_header(
        "cfg", constants, types={"Elem": source.ELEMENT_TYPES[dtype]},
        includes=("common/types.cuh", "common/wgmma.cuh"),
        macros={"SPLAT_BWD_TABLES": rt_params, "SPLAT_BWD_NO_TABLES": rt_locals}, after=wgmma)
    return parts.program("bwd/bwd.cu", {"bwd_config.cuh": header}, "splat_bwd")


def bwd_source(left: int | None, right: int | None, **kwargs) -> str:
    """:func:`program`'s kernel as one text that compiles alone, named :data:`KERNEL_NAME` (as
    :func:`source.source`)."""
    prog = program(left, right, **kwargs)
    return prog.flat().replace(prog.name, KERNEL_NAME)


def with_unique_name(text: str) -> tuple[str, str]:
    """``(name, text)``: the kernel renamed ``splat_bwd_<digest>`` (see :func:`source.with_unique_name`)."""
    return source.with_unique_name(text, KERNEL_NAME, "splat_bwd")
