"""CUDA C++ source of a Hopper (sm_90a) attention forward, written for a diagonal band baked in.

The generator of the ``cuda`` backend (:mod:`jax_bindings._cuda.backend`, which picks the
variant in :mod:`jax_bindings._cuda.plan`); ``benchmarks/spike_cuda_fwd.py`` builds and times
its consumer schedules and feeds, ``benchmarks/spike_cuda_persistent.py`` its CTA schedules. A
work tile is ``BM = 128`` query rows of one (batch, head); the CTA running it walks the key
tiles of ``block_n`` keys (128 or 176) that its rows can see. CTAs get work tiles by the
``schedule``: ``grid``, one CTA per tile; ``strided``, one CTA per SM taking every
``gridDim.x``-th tile; ``queue``, one CTA per SM taking the next tile by ticket from an atomic
counter (``sem``), so that CTAs finishing early take more. Tiles go longest walk first (the
grid's within a head, one (batch, head) after another; the queue's across a section of heads
whose K/V fit a byte budget, a section after another; the strided schedule's with heads
interleaved). In a CTA:

* warps 0-7 are two consumer warpgroups of 64 rows each: ``S = Q K^T`` and ``O += P V`` with
  ``wgmma`` (``m64nNk16``, bf16 in, fp32 accumulators); Q and K from shared memory through
  matrix descriptors, P from registers (the fp32 accumulator fragment of ``S`` is, element for
  element, the bf16 A fragment of the next product), V from shared memory read transposed;
  ``overlap`` issues QK of tile t with PV of tile t-1 and runs the softmax of t under it;
  ``pingpong`` makes the two warpgroups take turns issuing (named barriers);
* warps 8-11 are the producer warpgroup (``setmaxnreg``: 24 registers, the consumers 240): K and
  V tiles into a ring of ``stages`` buffers, each completing on an mbarrier, by TMA (one lane
  issues ``cp.async.bulk.tensor`` through tensor maps it published for the CTA) or by ``cp.async``
  (16 bytes a thread); consumers release a buffer on a second mbarrier once their ``wgmma``
  reading it is done. In the ``queue`` schedule that lane also takes the tickets: the next one
  once the current tile's loads are all issued (so the next tile's loads overlap the current
  one's end), published to the consumers in one of two shared-memory slots (``item_full`` /
  ``item_empty`` mbarriers), ``-1`` once the tickets reach the number of work tiles;
* tiles are stored in 64-column blocks of 128-byte rows with the 128-byte swizzle (16-byte
  chunk ``c`` of row ``r`` at chunk ``c ^ (r % 8)``): the layout ``wgmma`` reads K-major (Q, K)
  and, for V, MN-major, with no bank conflicts;
* no header is included (NVRTC compiles it with no include path; nvcc too);
* online softmax in base 2 with ``scale * log2(e)`` applied in fp32; tiles inside every row's
  window skip the mask; out-of-range keys are zero-filled and masked.

Mask: a query at row ``i`` sees keys ``j`` with ``i - left <= j <= i + right`` (``None``: no
bound; either may be negative), ``0 <= j < Skv``; a row block that sees no key skips its walk
(the producer loads nothing for it; the consumers still write its rows: ``out = 0``,
``lse = -inf``). Dense is ``(None, None)``; causal ``(None, 0)``; a causal window of ``W`` keys
``(W - 1, 0)``. With ``band_block > 1`` the band is measured from each row's block's first row
``a(i) = i - i % band_block`` instead of ``i`` (block-local masks: ``left = lookback * block``,
``right = block - 1``); where ``band_block`` is a multiple of the row block, every row of a
row block sees the same keys, and where they start and end on key tiles no tile is masked.
Inputs ``[B, S, H, D]`` bf16 or fp16 (``dtype``) with ``D = 128``, GQA by ``H // Hkv``; outputs
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
(:mod:`jax_bindings._cuda.grid_tiles`): a work tile is a query patch of 128 queries (one 5-D
TMA box of ``[B, S, H, D]`` seen as ``(D, H, n2, n1, B n0)``, stepping by the dilations), its
walk the key tiles of the patch's key box (boxes of the same map), each masked from the
per-axis windows of ``grid_tables`` unless it lies inside every window of the patch; rows
past the grid are computed and not stored.
"""

from __future__ import annotations

import hashlib

BM, D = 128, 128
BN = 128  # default key tile; source(block_n=) takes any multiple of 16 up to 256
CONSUMER_WARPS = 8
PRODUCER_WARPS = 4
# setmaxnreg: a CTA of 12 warps starts at 168 registers a thread (3 warps share a sub-partition's
# 16K); one warp of each warpgroup per sub-partition must stay within 3 x 168 = 504 after the move
PRODUCER_REGS, CONSUMER_REGS = 24, 240
THREADS = (CONSUMER_WARPS + PRODUCER_WARPS) * 32
KERNEL_NAME = "splat_fwd_wgmma"
UNBOUNDED = 1 << 30
FEEDS = {"cp.async": 0, "tma": 1, "none": 2}
SCHEDULES = {"grid": 0, "strided": 1, "queue": 2}  # how CTAs get their work tiles (see source())
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


def smem_bytes(stages: int, block_n: int = BN, runtime: str = "", q_stages: int = 1,
               o_store: str = "registers") -> int:
    """Dynamic shared memory, the same for every schedule: ``q_stages`` Q tiles, ``stages`` K
    and V tiles, the mbarriers and tickets (:func:`bar_bytes`), a tensor-map staging buffer of
    128 bytes for each map the kernel publishes (K, V, Q, and out with ``o_store="tma"``, whose
    rows are staged in the Q tile), with segment ids (``runtime="ids"``) the key tiles' ids (4
    bytes a key), 1 KiB for alignment."""
    tile = block_n * D * 2
    ids = stages * block_n * 4 if runtime == "ids" else 0
    maps = map_stage_bytes(o_store)
    return q_stages * BM * D * 2 + 2 * stages * tile + bar_bytes(stages) + maps + ids + 1024


def map_stage_bytes(o_store: str) -> int:
    """Shared memory of the tensor-map staging buffers: 128 bytes for each of K, V, Q (and out
    with ``o_store="tma"``)."""
    return 128 * (4 if o_store == "tma" else 3)


def wgmma_ss(n: int, transposed: bool = False) -> str:
    """``wgmma`` m64n{n}k16, A and B from shared memory, fp32 accumulators ``d``: both K-major
    (``wgmma_ss_{n}``), or, ``transposed``, both MN-major (``wgmma_ss_t_{n}``)."""
    regs = n // 2
    outs = ", ".join(f"%{i}" for i in range(regs))
    operands = ", ".join(f'"+f"(d[{i}])' for i in range(regs))
    name, tr = (f"wgmma_ss_t_{n}", "1, 1") if transposed else (f"wgmma_ss_{n}", "0, 0")
    return f"""
__device__ __forceinline__ void {name}(float* d, uint64_t a, uint64_t b, int accumulate) {{
  asm volatile(
    "{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{regs + 2}, 0;\\n"
    "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.__ELEM__.__ELEM__ {{{outs}}}, "
    "%{regs}, %{regs + 1}, p, 1, 1, {tr};\\n}}\\n"
    : {operands}
    : "l"(a), "l"(b), "r"(accumulate));
}}
"""


def wgmma_rs(n: int) -> str:
    """``wgmma`` m64n{n}k16, A from registers, B from shared memory MN-major (transposed)."""
    regs = n // 2
    outs = ", ".join(f"%{i}" for i in range(regs))
    operands = ", ".join(f'"+f"(d[{i}])' for i in range(regs))
    return f"""
__device__ __forceinline__ void wgmma_rs_{n}(float* d, const uint32_t* a, uint64_t b) {{
  asm volatile(
    "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.__ELEM__.__ELEM__ {{{outs}}}, "
    "{{%{regs}, %{regs + 1}, %{regs + 2}, %{regs + 3}}}, %{regs + 4}, 1, 1, 1, 1;\\n"
    : {operands}
    : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}}
"""


HELPERS = r"""
#ifdef __CUDACC_RTC__
typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef unsigned long long uint64_t;
typedef unsigned long uintptr_t;
#else
#include <stdint.h>
#endif
#define NEG_INF __int_as_float(0xff800000)

// the row a band is measured from: row i itself, or the first row of its block of BLOCK rows
template <int BLOCK>
__device__ __forceinline__ int anchor_of(int i) { return BLOCK == 1 ? i : i - i % BLOCK; }

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, int parity) {
  asm volatile(
    "{\n.reg .pred done;\nWAIT:\n"
    "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
    "@!done bra WAIT;\n}\n" :: "r"(bar), "r"(parity) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.shared::cta.b64 state, [%0];\n}\n"
               :: "r"(bar) : "memory");
}
// Work tickets: one producer lane hands each of the CTA's work items to the consumer warps through
// two shared-memory slots (``slots``: 2 x 4 bytes, the current item's and the next one's), slot i
// guarded by the mbarriers ``full + 8 i`` (count 1) and ``empty + 8 i`` (one arrival a reader warp).
// The producer's n-th ticket, taken from ``counter`` (-1 at or past ``limit``) once slot n % 2 is free:
__device__ __forceinline__ int publish_ticket(int n, int* counter, int limit, uint32_t slots, uint32_t full,
                                              uint32_t empty) {
  if (n >= 2) mbar_wait(empty + 8 * (n & 1), ((n >> 1) - 1) & 1);
  int ticket = atomicAdd(counter, 1);
  if (ticket >= limit) ticket = -1;
  asm volatile("st.shared.b32 [%0], %1;" :: "r"(slots + 4 * (n & 1)), "r"(ticket) : "memory");
  mbar_arrive(full + 8 * (n & 1));
  return ticket;
}
// A reader warp's n-th ticket (its lane 0 releases the slot):
__device__ __forceinline__ int read_ticket(int n, uint32_t slots, uint32_t full, uint32_t empty) {
  mbar_wait(full + 8 * (n & 1), (n >> 1) & 1);
  int ticket;
  asm volatile("ld.shared.b32 %0, [%1];" : "=r"(ticket) : "r"(slots + 4 * (n & 1)) : "memory");
  __syncwarp();
  if (threadIdx.x % 32 == 0) mbar_arrive(empty + 8 * (n & 1));
  return ticket;
}
__device__ __forceinline__ void cp_async_arrive(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" :: "r"(bar) : "memory");
}
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
               :: "r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
// A batch row's query and key lengths: rt_lens [B, 2] (a runtime mask's) clipped to (Sq, Skv), or
// (Sq, Skv) where there is none (rt_lens null)
__device__ __forceinline__ int2 batch_lengths(const int* rt_lens, int b, int Sq, int Skv) {
  if (rt_lens == nullptr) return make_int2(Sq, Skv);
  return make_int2(min(Sq, rt_lens[2 * b]), min(Skv, rt_lens[2 * b + 1]));
}
// A batch row of queries at run-time positions: rt_lens [B, 4] holds the end of its rows that
// see keys (within q_len and the layout), kv_len, the layout row of query 0 (its shift) and the
// first row that sees keys; as (q_end, kv_end, shift, q_first), clipped to (Sq, Skv)
__device__ __forceinline__ int4 shifted_lengths(const int* rt_lens, int b, int Sq, int Skv) {
  const int4 t = reinterpret_cast<const int4*>(rt_lens)[b];
  return make_int4(min(Sq, t.x), min(Skv, t.y), t.z, max(0, t.w));
}
// `bytes` (a multiple of 16, from a 16-byte aligned address) into shared memory, completing on bar
__device__ __forceinline__ void bulk_load(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               :: "r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(bytes) : "memory");
}
// one box of a 4-D tensor map (coordinates innermost first) into shared memory, completing on bar
__device__ __forceinline__ void tma_load_4d(uint32_t dst, const void* tmap, uint32_t bar, int c0, int c1,
                                            int c2, int c3) {
  asm volatile(
    "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
    " [%0], [%1, {%2, %3, %4, %5}], [%6];"
    :: "r"(dst), "l"(tmap), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar) : "memory");
}
// one box of a 5-D tensor map (coordinates innermost first) into shared memory, completing on bar
__device__ __forceinline__ void tma_load_5d(uint32_t dst, const void* tmap, uint32_t bar, int c0, int c1,
                                            int c2, int c3, int c4) {
  asm volatile(
    "cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
    " [%0], [%1, {%2, %3, %4, %5, %6}], [%7];"
    :: "r"(dst), "l"(tmap), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4), "r"(bar) : "memory");
}
// a thread that uses a tensor map another warp published (publish_tmap) acquires it first
__device__ __forceinline__ void tmap_acquire(const void* slot) {
  asm volatile("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;" :: "l"(slot) : "memory");
}
// A warp publishes the template tensor map `tmpl` with its base address set to `base` in the global
// slot `slot` (128 bytes), through the shared-memory staging buffer `stage` (128-byte aligned).
__device__ __forceinline__ void publish_tmap(uint8_t* slot, const uint8_t* tmpl, uint8_t* stage,
                                             const void* base, int lane) {
  reinterpret_cast<uint32_t*>(stage)[lane] = reinterpret_cast<const uint32_t*>(tmpl)[lane];
  __syncwarp();
  if (lane == 0)
    asm volatile("tensormap.replace.tile.global_address.shared::cta.b1024.b64 [%0], %1;"
                 :: "r"(smem_addr(stage)), "l"(base) : "memory");
  __syncwarp();
  asm volatile(
    "tensormap.cp_fenceproxy.global.shared::cta.tensormap::generic.release.gpu.sync.aligned [%0], [%1], 128;"
    :: "l"(slot), "r"(smem_addr(stage)) : "memory");
  tmap_acquire(slot);
}
// Sections of (batch, head)s: `heads` of them, each with `per_head` work items, are taken in
// sections of as many as `budget` bytes hold at `head_bytes` (> 0) a head (at least one), a section
// after another; within one, an item of each head in turn. heads_per_section: the section's
// size; in_section: work item w's head and its item counted from the head's last (x, y).
__device__ __forceinline__ int heads_per_section(long long budget, long long head_bytes, int heads) {
  return (int)max(1LL, min((long long)heads, budget / head_bytes));
}
__device__ __forceinline__ int2 in_section(int w, int section, int per_head, int heads) {
  const int first = w / (section * per_head) * section, size = min(section, heads - first);
  const int r = w - first * per_head;
  return make_int2(first + r % size, per_head - 1 - r / size);
}
// one box of a 4-D tensor map from shared memory (coordinates innermost first), in the thread's bulk group
__device__ __forceinline__ void tma_store_4d(const void* tmap, uint32_t src, int c0, int c1, int c2, int c3) {
  asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];"
               :: "l"(tmap), "r"(src), "r"(c0), "r"(c1), "r"(c2), "r"(c3) : "memory");
}
__device__ __forceinline__ void st_shared32(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.b32 [%0], %1;" :: "r"(addr), "r"(v) : "memory");
}
__device__ __forceinline__ void fence_async_smem_always() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" :: "n"(N) : "memory");
}
template <int N>
__device__ __forceinline__ void fence_regs(float* r) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i]) :: "memory");
}
__device__ __forceinline__ void named_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" :: "r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
// A wgmma shared-memory matrix descriptor for the 128-byte swizzle (layout type 1).
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr, uint32_t lead, uint32_t stride) {
  return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)((lead & 0x3FFFF) >> 4) << 16)
       | ((uint64_t)((stride & 0x3FFFF) >> 4) << 32) | (1ull << 62);
}
// The descriptor `d` moved on by `bytes` (a multiple of 16): its start address (bits 0-13, in
// 16-byte units) plus bytes / 16, the rest unchanged. Shared addresses stay below 2^18 bytes, so
// the sum stays inside that 14-bit field; one add instead of rebuilding the descriptor.
__device__ __forceinline__ uint64_t desc_at(uint64_t d, uint32_t bytes) {
  return (d & 0xFFFFFFFF00000000ull) | (uint32_t)((uint32_t)d + (bytes >> 4));
}
// Byte offset of 16-byte chunk j (0..15: 8 elements each) of row r in a tile of `rows` rows,
// stored as two 64-column blocks of 128-byte rows, 128-byte swizzled.
__device__ __forceinline__ uint32_t swz(int r, int j, int rows) {
  return (uint32_t)((j >> 3) * rows * 128 + r * 128 + (((j & 7) ^ (r & 7)) << 4));
}
// Column masks of the grid's edge tiles: a thread's scores in a row are BN / 4 columns, bit
// 2 g + b standing for column 8 g + b (plus the lane's 2 (lane % 4)), in the narrowest word.
template <bool WIDE> struct MaskWord { typedef uint32_t T; };
template <> struct MaskWord<true> { typedef uint64_t T; };
// a word with bits [n, width) set, 0 <= n <= width (PTX's shift takes n = width)
__device__ __forceinline__ uint32_t bits_from(uint32_t, int n) {
  uint32_t y;
  asm("shl.b32 %0, %1, %2;" : "=r"(y) : "r"(~0u), "r"(n));
  return y;
}
__device__ __forceinline__ uint64_t bits_from(uint64_t, int n) {
  uint64_t y;
  asm("shl.b64 %0, %1, %2;" : "=l"(y) : "l"(~0ull), "r"(n));
  return y;
}
// the first bit of every period of P bits in a word of W: a pattern of one period times this
// is the pattern repeated
template <typename T, int P, int W> __device__ __forceinline__ T period_starts() {
  T starts = 0;
#pragma unroll
  for (int j = 0; j < W; j += P) starts |= T(1) << j;
  return starts;
}
// The bits of the columns whose coordinate l along an axis has 0 <= off + l < span, where l
// is constant over runs of RUN bits and takes KT values, repeating every KT RUN bits up to W.
// l's range is [lo, hi): two shifts, whatever the run.
template <typename T, int KT, int RUN, int W> __device__ __forceinline__ T run_bits(int off, int span) {
  const int lo = min(max(-off, 0), KT);
  const int hi = min(max(span - off, lo), KT);
  return (bits_from(T(0), lo * RUN) & ~bits_from(T(0), hi * RUN)) * period_starts<T, KT * RUN, W>();
}
// two fp32 values rounded to the element type (__ELEM__), `lo` in the low half
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  uint32_t v;
  asm("cvt.rn.__ELEM__x2.f32 %0, %2, %1;" : "=r"(v) : "f"(lo), "f"(hi));
  return v;
}
"""

_KERNEL = r"""
constexpr int BM = __BM__, BN = __BN__, HD = __D__, STAGES = __STAGES__, SN = BN / 2;
constexpr int LEFT = __LEFT__, RIGHT = __RIGHT__;  // key j seen by row i: a - LEFT <= j <= a + RIGHT
constexpr int BAND_BLOCK = __BAND_BLOCK__;  // a = anchor_of<BAND_BLOCK>(i): i, or its block's first row
constexpr bool OVERLAP = __OVERLAP__, PINGPONG = __PINGPONG__;
constexpr int SCHEDULE = __SCHEDULE__;  // 0: grid, 1: strided, 2: queue
// Q tiles in shared memory: with 2 (persistent schedules), the next work tile's Q and its first
// K/V tiles are loaded while the consumers still walk the current one
constexpr int Q_STAGES = __Q_STAGES__;
constexpr int RT = __RT__;  // runtime mask: 0 none, 1 lengths, 2 lengths and segment ids
// queries at run-time positions (chunked prefill): query row i is row i + shift of the band, the
// shift per batch row in rt_lens (shifted_lengths); rows outside [q_first, q_end) see no key
constexpr bool SHIFTED = __SHIFTED__;
static_assert(!SHIFTED || RT >= 1, "run-time positions come in rt_lens");
// a grid layout's spatial tiles instead of the band (grid_tiles): the grid (3 axes, outermost
// first), its dilations, the query patch, the key tile, patches per axis, the tables' strides
constexpr bool GRID = __GRID__;
constexpr int GN0 = __GN0__, GN1 = __GN1__, GN2 = __GN2__, GD0 = __GD0__, GD1 = __GD1__, GD2 = __GD2__;
constexpr int QT0 = __QT0__, QT1 = __QT1__, QT2 = __QT2__, KT0 = __KT0__, KT1 = __KT1__, KT2 = __KT2__;
constexpr int GP0 = __GP0__, GP1 = __GP1__, GP2 = __GP2__, GPMAX = __GPMAX__, GNMAX = __GNMAX__;
static_assert(!GRID || (QT0 * QT1 * QT2 == BM && KT0 * KT1 * KT2 == BN && KT2 % 8 == 0),
              "a query patch is a row block, a key tile BN keys with whole 8-column groups on the last axis");
// grid: a thread's columns of a row as bits (MaskWord), BN / 4 of them
constexpr int GW = BN / 4;
typedef typename MaskWord<(GW > 32)>::T GridBits;
constexpr bool PERSISTENT = SCHEDULE != 0;  // one CTA per SM looping over work tiles, Q by TMA
constexpr int FEED = __FEED__;  // 0: cp.async, 1: TMA, 2: none (a timing experiment)
constexpr bool PROXY_FENCE = __PROXY_FENCE__;
constexpr uint32_t TILE = BN * HD * 2, QBYTES = BM * HD * 2;
// mbarriers (4 a stage, q_full, q_empty, item_full, item_empty x 2 each) and the two tickets
constexpr uint32_t BAR_BYTES = __BAR_BYTES__;
static_assert(BAR_BYTES >= 8 * (4 * STAGES + 8) + 8, "the mbarriers and tickets overflow their space");
static_assert(Q_STAGES == 1 || (Q_STAGES == 2 && SCHEDULE != 0), "two Q tiles need a persistent schedule");
// the epilogue's out: each warpgroup writes its rows into its half of the work tile's Q slot and
// stores them by TMA (then the slot is free once the store has read it); else from registers
constexpr bool O_TMA = __O_TMA__;
static_assert(!O_TMA || (PERSISTENT && FEED == 1 && !GRID),
              "a TMA store of out needs a persistent band kernel fed by TMA");

extern "C" __global__ void __launch_bounds__(__THREADS__, 1) __NAME__(
    const uint16_t* __restrict__ q, const uint16_t* __restrict__ k,
    const uint16_t* __restrict__ v, const uint8_t* __restrict__ tmap_templates,
    __GRID_PARAMS____RT_PARAMS__int Sq, int Skv, int H, int Hkv, int B, float scale_log2,
    uint16_t* __restrict__ out, float* __restrict__ lse, int* __restrict__ sem,
    uint8_t* __restrict__ tmap_slots) {
  __RT_LOCALS__
  __GRID_LOCALS__
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  uint8_t* smem = (uint8_t*)(((uintptr_t)smem_raw + 1023) & ~(uintptr_t)1023);
  const uint32_t s_q = smem_addr(smem);
  const uint32_t s_k = s_q + Q_STAGES * QBYTES;  // Q slot b at s_q + b QBYTES
  const uint32_t s_v = s_k + STAGES * TILE;
  // mbarriers: full_k, full_v, empty_k, empty_v (STAGES each), q_full, q_empty, item_full,
  // item_empty (2 each); then the two ticket slots
  const uint32_t s_bar = s_v + STAGES * TILE;
  uint8_t* tmap_stage = smem + (s_bar - s_q) + BAR_BYTES;  // K, V, Q (and with O_TMA, out): 128 bytes each
  // with segment ids: the ids of each stage's key tile (BN x 4 bytes), loaded with the K tile
  const uint32_t s_ids = s_bar + BAR_BYTES + __MAP_STAGE_BYTES__;
  const int kv_ids_stride = (Skv + BN - 1) / BN * BN;  // rt_kv_ids is [B, Skv] padded to whole tiles
  auto full_k = [&](int s) { return s_bar + 8 * s; };
  auto full_v = [&](int s) { return s_bar + 8 * (STAGES + s); };
  auto empty_k = [&](int s) { return s_bar + 8 * (2 * STAGES + s); };
  auto empty_v = [&](int s) { return s_bar + 8 * (3 * STAGES + s); };
  auto q_full = [&](int slot) { return s_bar + 8 * (4 * STAGES + slot); };
  auto q_empty = [&](int slot) { return s_bar + 8 * (4 * STAGES + 2 + slot); };
  auto item_full = [&](int slot) { return s_bar + 8 * (4 * STAGES + 4 + slot); };
  auto item_empty = [&](int slot) { return s_bar + 8 * (4 * STAGES + 6 + slot); };
  // queue: two slots (4 bytes each) for the tickets of the CTA's current and next work tile
  const uint32_t s_ticket = s_bar + 8 * (4 * STAGES + 8);

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  // work tiles of a (batch, head): row blocks, or a grid's patches
  const int n_row_blocks = GRID ? GP0 * GP1 * GP2 : (Sq + BM - 1) / BM;
  // Work tiles are (row block, head, batch), longest walks first. A CTA of the strided schedule
  // takes every gridDim.x-th one, of the queue the one its ticket names; otherwise a CTA owns the
  // one its block index names.
  // queue, strided with sections: (batch, head)s per section, as many as SECTION_BYTES of K and
  // V hold (at least one)
  const int section = heads_per_section(__SECTION_BYTES__LL, 4LL * HD * max(Skv, 1), H * B);
  // q_end, kv_end: the batch row's query and key lengths; keys [in_lo, in_hi) are seen by
  // every row of the block as far as segment ids go (tiles inside it skip the id test)
  // grid: the patch's first query coordinate, its key box's first key and tiles, and the tiles
  // [lo, hi) inside every window of the patch, per axis (grid_tiles' patch table)
  struct Work {
    int h, b, m0, t0, n_tiles, q_end, kv_end, in_lo, in_hi, shift, q_first;
    int gq[3], gfirst[3], gnt[3], glo[3], ghi[3];
  };
  const int4* grid_patches = reinterpret_cast<const int4*>(grid_tables);
  const int2* grid_windows = reinterpret_cast<const int2*>(grid_tables + 3 * GPMAX * 8);
  auto work = [&](int w) {
    Work x;
    int mb;
    if (SCHEDULE == 1 && __SECTION_BYTES__ == 0) {
      // strided: heads interleaved, so that each CTA's static share mixes long and short walks
      const int hb = w % (H * B);
      mb = n_row_blocks - 1 - w / (H * B);
      x.h = hb % H;
      x.b = hb / H;
    } else if (SCHEDULE != 0) {
      // queue (and strided with sections): sections of `section` (batch, head)s one after
      // another, so the CTAs running at once share the section's K/V in L2; within a section,
      // longest walks first across its heads (a row block of each head, then the next row block)
      const int2 at = in_section(w, section, n_row_blocks, H * B);
      mb = at.y;
      x.h = at.x % H;
      x.b = at.x / H;
    } else {
      mb = n_row_blocks - 1 - blockIdx.x;
      x.h = blockIdx.y;
      x.b = blockIdx.z;
    }
    x.m0 = mb * BM;
    if (GRID) {
      // mb is the patch, (p0, p1, p2) on the axes, last fastest
      const int pa[3] = {mb / (GP1 * GP2), mb / GP2 % GP1, mb % GP2};
      x.n_tiles = 1;
#pragma unroll
      for (int a = 0; a < 3; ++a) {
        const int4 e = __ldg(grid_patches + 2 * (a * GPMAX + pa[a]));
        const int4 f = __ldg(grid_patches + 2 * (a * GPMAX + pa[a]) + 1);
        x.gq[a] = e.x;
        x.gfirst[a] = e.y;
        x.gnt[a] = e.z;
        x.glo[a] = e.w;
        x.ghi[a] = f.x;
        x.n_tiles *= e.z;
      }
      x.t0 = 0;
      x.q_end = Sq;
      x.kv_end = Skv;
      x.in_lo = 0;
      x.in_hi = Skv;
      x.shift = x.q_first = 0;
      return x;
    }
    if (SHIFTED) {
      const int4 len = shifted_lengths(rt_lens, x.b, Sq, Skv);
      x.q_end = len.x;
      x.kv_end = len.y;
      x.shift = len.z;
      x.q_first = len.w;
    } else {
      const int2 len = batch_lengths(rt_lens, x.b, Sq, Skv);
      x.q_end = len.x;
      x.kv_end = len.y;
      x.shift = x.q_first = 0;
    }
    // the key tiles any row of the block sees (at the block's band rows)
    const int a0 = x.m0 + x.shift;
    int lo = 0, hi = Skv;
    if (LEFT < __UNBOUNDED__) lo = max(0, anchor_of<BAND_BLOCK>(a0) - LEFT);
    if (RIGHT < __UNBOUNDED__) hi = min(Skv, anchor_of<BAND_BLOCK>(a0 + BM - 1) + RIGHT + 1);
    x.in_lo = 0;
    x.in_hi = Skv;
    // a block of rows that see nothing (padding, or outside the layout) walks nothing
    if (RT >= 1) hi = min(hi, x.m0 < x.q_end && x.m0 + BM > x.q_first ? x.kv_end : 0);
    if (RT == 2) {
      const int4 t = reinterpret_cast<const int4*>(rt_ranges)[(size_t)x.b * n_row_blocks + mb];
      lo = max(lo, t.x);
      hi = min(hi, t.y);
      x.in_lo = t.z;
      x.in_hi = t.w;
    }
    x.t0 = lo / BN;
    x.n_tiles = hi > lo ? (hi + BN - 1) / BN - x.t0 : 0;
    return x;
  };
  const int n_work = PERSISTENT ? n_row_blocks * H * B : 1;
  // grid and strided: the CTA's n-th work tile (-1: none left); the queue's come by ticket
  auto scheduled = [&](int n) {
    const int w = SCHEDULE == 1 ? (int)blockIdx.x + n * (int)gridDim.x : n;
    return w < n_work ? w : -1;
  };
  // grid: the tile indices (last axis fastest) of key tile t of a patch with nt1 x nt2 tiles on
  // the inner axes
  auto tile_index = [&](int t, int nt1, int nt2, int* i) {
    i[2] = t % nt2;
    i[1] = t / nt2 % nt1;
    i[0] = t / (nt2 * nt1);
  };

  // this CTA's tensor maps: K, V, Q, out (128 bytes each)
  const size_t cta = ((size_t)blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
  uint8_t* gk = tmap_slots + cta * __SLOT_BYTES__;
  uint8_t* go = gk + 384;
  // out's map, published before the CTA's first barrier by consumer warp 0 (the producer warp
  // publishes the others); the thread of each warpgroup that stores acquires it after the barrier
  if (O_TMA && warp == 0) publish_tmap(go, tmap_templates + 384, tmap_stage + 384, out, lane);
  if (tid == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(full_k(s), FEED == 1 ? 1 : __PRODUCER_WARPS__ * 32);
      mbar_init(full_v(s), FEED == 1 ? 1 : __PRODUCER_WARPS__ * 32);
      mbar_init(empty_k(s), __CONSUMER_WARPS__);
      mbar_init(empty_v(s), __CONSUMER_WARPS__);
    }
    for (int slot = 0; slot < 2; ++slot) {
      mbar_init(q_full(slot), 1);
      mbar_init(q_empty(slot), O_TMA ? 2 : __CONSUMER_WARPS__);
      mbar_init(item_full(slot), 1);
      mbar_init(item_empty(slot), __CONSUMER_WARPS__);
    }
  }
  __syncthreads();

  const size_t kv_row = (size_t)Hkv * HD;  // elements between consecutive keys
  if (warp >= __CONSUMER_WARPS__) {
    // ---- producer warpgroup: K and V tiles (and, persistent, Q) into shared memory ----
    asm volatile("setmaxnreg.dec.sync.aligned.u32 __PRODUCER_REGS__;" ::: "memory");
    const int pt = tid - __CONSUMER_WARPS__ * 32, j = pt & 15, r_first = pt >> 4;
    int ring = 0, qn = 0;  // K/V tiles and Q tiles this CTA has loaded so far
    if constexpr (FEED == 1) {
      // TMA: one warp publishes this CTA's tensor maps; its lane 0 issues every copy
      if (pt >= 32) return;
      uint8_t* gv = gk + 128;
      uint8_t* gq = gk + 256;
      publish_tmap(gk, tmap_templates, tmap_stage, k, lane);
      publish_tmap(gv, tmap_templates + 128, tmap_stage + 128, v, lane);
      if (PERSISTENT) publish_tmap(gq, tmap_templates + 256, tmap_stage + 256, q, lane);
      if (lane != 0) return;
      for (int n = 0;; ++n) {
        int w;
        if (SCHEDULE == 2) {
          // the next ticket, taken once the last tile's loads are all issued
          w = publish_ticket(n, sem, n_work, s_ticket, item_full(0), item_empty(0));
        } else {
          w = scheduled(n);
        }
        if (w < 0) break;
        const Work x = work(w);
        if (x.n_tiles == 0) continue;  // the consumers write its rows without a walk
        const int hkv = x.h / (H / Hkv);
        if (PERSISTENT) {
          // Q slot qb, used qn / Q_STAGES times before: free once the consumers released it
          const int qb = qn % Q_STAGES, uses = qn / Q_STAGES;
          const uint32_t dst = s_q + qb * QBYTES;
          if (uses > 0) mbar_wait(q_empty(qb), (uses - 1) & 1);
          mbar_expect_tx(q_full(qb), QBYTES);
          if (GRID) {
            const int c4 = x.b * GN0 + x.gq[0];
            tma_load_5d(dst, gq, q_full(qb), 0, x.h, x.gq[2], x.gq[1], c4);
            tma_load_5d(dst + BM * 128, gq, q_full(qb), 64, x.h, x.gq[2], x.gq[1], c4);
          } else {
            tma_load_4d(dst, gq, q_full(qb), 0, x.h, x.m0, x.b);
            tma_load_4d(dst + BM * 128, gq, q_full(qb), 64, x.h, x.m0, x.b);
          }
          ++qn;
        }
        // ring counts the tiles as they are issued; the loop is not unrolled (with the queue's
        // state, an unrolled one spills: the lane has 24 registers)
        const int r_end = ring + x.n_tiles;
#pragma unroll 1
        for (int n0 = x.t0 * BN; ring < r_end; ++ring, n0 += BN) {
          const int s = ring % STAGES, parity = ((ring / STAGES) & 1) ^ 1;
          // a grid's key tile: its box's coordinates (c2, c1, c4: the merged batch and outer axis)
          int c2 = 0, c1 = 0, c4 = 0;
          if (GRID) {
            int i[3];
            tile_index(n0 / BN, x.gnt[1], x.gnt[2], i);
            c2 = x.gfirst[2] + i[2] * KT2 * GD2;
            c1 = x.gfirst[1] + i[1] * KT1 * GD1;
            c4 = x.b * GN0 + x.gfirst[0] + i[0] * KT0 * GD0;
          }
          auto load = [&](uint32_t dst, const void* map, uint32_t bar) {
            if (GRID) {
              tma_load_5d(dst, map, bar, 0, hkv, c2, c1, c4);
              tma_load_5d(dst + BN * 128, map, bar, 64, hkv, c2, c1, c4);
            } else {
              tma_load_4d(dst, map, bar, 0, hkv, n0, x.b);
              tma_load_4d(dst + BN * 128, map, bar, 64, hkv, n0, x.b);
            }
          };
          if (ring >= STAGES) mbar_wait(empty_k(s), parity);
          mbar_expect_tx(full_k(s), TILE + (RT == 2 ? BN * 4 : 0));
          load(s_k + s * TILE, gk, full_k(s));
          if (RT == 2)
            bulk_load(s_ids + s * BN * 4, rt_kv_ids + (size_t)x.b * kv_ids_stride + n0, BN * 4, full_k(s));
          if (ring >= STAGES) mbar_wait(empty_v(s), parity);
          mbar_expect_tx(full_v(s), TILE);
          load(s_v + s * TILE, gv, full_v(s));
        }
      }
    } else {
      // every producer thread copies 16 of the tile's rows (one 16-byte chunk each); a tile
      // completes on `full` once all 128 threads' copies land (or, with no feed, on arrival)
      auto fill = [&](uint32_t dst, const uint16_t* src, int n0, uint32_t full) {
        if (FEED == 0) {
#pragma unroll
          for (int r = r_first; r < BN; r += 8) {
            const int n = n0 + r;
            const bool ok = n < Skv;
            cp_async16(dst + swz(r, j, BN), src + (ok ? n : 0) * kv_row + j * 8, ok ? 16 : 0);
          }
          cp_async_arrive(full);
        } else {
          mbar_arrive(full);
        }
      };
      for (int n = 0;; ++n) {
        const int w = scheduled(n);
        if (w < 0) break;
        const Work x = work(w);
        const int hkv = x.h / (H / Hkv);
        const uint16_t* kb = k + ((size_t)x.b * Skv * Hkv + hkv) * HD;
        const uint16_t* vb = v + ((size_t)x.b * Skv * Hkv + hkv) * HD;
        for (int t = 0; t < x.n_tiles; ++t) {
          const int r = ring + t, s = r % STAGES, n0 = (x.t0 + t) * BN;
          if (r >= STAGES) mbar_wait(empty_k(s), ((r / STAGES) & 1) ^ 1);
          fill(s_k + s * TILE, kb, n0, full_k(s));
          if (r >= STAGES) mbar_wait(empty_v(s), ((r / STAGES) & 1) ^ 1);
          fill(s_v + s * TILE, vb, n0, full_v(s));
        }
        ring += x.n_tiles;
      }
      asm volatile("cp.async.wait_all;" ::: "memory");
    }
  } else {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 __CONSUMER_REGS__;" ::: "memory");
  // ---- consumers: warpgroup wg owns rows m0 + 64 wg .. + 63 of each work tile ----
  // warp-uniform (through a shuffle), so that what derives from it can live in uniform registers
  const int wg = __shfl_sync(0xffffffff, warp / 4, 0), wt = tid % 128;
  // O_TMA: the Q slot of the last work tile, which that tile's out is being stored from (-1:
  // none), released to the producer once the store has read it: by the warpgroup's thread 0,
  // after the next walk's first products are issued (the read is long done by then)
  int o_slot = -1;
  if (O_TMA && wt == 0) tmap_acquire(go);
  auto release_stored_q = [&]() {
    if (O_TMA && wt == 0 && o_slot >= 0) {
      asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
      mbar_arrive(q_empty(o_slot));
      o_slot = -1;
    }
  };
  // the current work tile's first row and key tile, this thread's two rows (grid: their tokens,
  // Sq for a patch's rows past the grid)
  int m0 = 0, t0 = 0, rows[2] = {0, 0};
  // the current work tile's key length and id-free keys (Work), this thread's rows' segment ids
  int kv_end = Skv, in_lo = 0, in_hi = Skv, row_id[2] = {0, 0};
  int shift = 0;  // the band row of the work tile's row 0 less m0 (SHIFTED; else 0)
  // grid: the work tile's patch (Work's g* fields); this thread's rows' windows per axis (first
  // key, end), as loaded: what derives from them is computed under the first tile's products,
  // so that the load's latency is too; the bits of this thread's columns (MaskWord) each axis
  // lets through, per row, for the tile index along the axis in gbits_at (-1: none yet this
  // patch)
  int gfirst[3] = {0, 0, 0}, gnt[3] = {1, 1, 1}, glo[3] = {0, 0, 0}, ghi[3] = {0, 0, 0};
  int2 win[2][3] = {};
  GridBits gbits[3][2];
  int gbits_at[3] = {-1, -1, -1};
  int gtile[3] = {0, 0, 0};  // grid: the indices of the next key tile the softmax takes
  float o[64], sc[SN];  // sc: this thread's BN / 2 scores of its two rows
  uint32_t p[SN / 2];
  float mx[2], sum[2], corr[2];

  // ping-pong: a warpgroup issues its products only after the other one issued its own. The
  // turns run on across work tiles: warpgroup 1 hands warpgroup 0 the first turn once, before
  // the CTA's first walk, and each warpgroup passes the turn after its last P V too, so that
  // warpgroup 0 issues the next tile's first products while warpgroup 1 finishes its epilogue;
  // warpgroup 0 takes the one turn left over when the CTA has no more work
  auto fence_async_smem = [&]() { if (PROXY_FENCE) fence_async_smem_always(); };
  auto turn_wait = [&]() { if (PINGPONG) named_sync(3 + wg, 256); };
  auto turn_pass = [&]() {
    if (PINGPONG) asm volatile("bar.arrive %0, 256;" :: "r"(3 + (wg ^ 1)) : "memory");
  };
  // the current work tile's Q slot (set per work tile)
  uint64_t q_desc = smem_desc(s_q + wg * 64 * 128, 16, 1024);
  auto qk = [&](int s) {
    const uint64_t k_desc = smem_desc(s_k + s * TILE, 16, 1024);
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) {
      const uint64_t da = desc_at(q_desc, (kk >> 2) * BM * 128 + (kk & 3) * 32);
      const uint64_t db = desc_at(k_desc, (kk >> 2) * BN * 128 + (kk & 3) * 32);
      wgmma_ss___BN__(sc, da, db, kk > 0);
    }
  };
  auto pv = [&](int s) {
    const uint64_t v_desc = smem_desc(s_v + s * TILE, __V_LEAD__, __V_STRIDE__);
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) wgmma_rs___D__(o, p + 4 * kk, desc_at(v_desc, kk * 16 * 128));
  };
  // grid: whether the next key tile of the walk is an edge tile, and then per axis and row the
  // bits of this thread's columns its queries see (gbits); called before the tile's products
  // are waited on, so that this runs under them
  bool gedge = false;
  auto grid_mask = [&]() {
    if (!GRID) return;
    // the tile's indices; tiles are taken in order, so they advance by one (no division by
    // the patch's tile counts)
    const int i[3] = {gtile[0], gtile[1], gtile[2]};
    if (++gtile[2] == gnt[2]) {
      gtile[2] = 0;
      if (++gtile[1] == gnt[1]) {
        gtile[1] = 0;
        ++gtile[0];
      }
    }
    gedge = false;
#pragma unroll
    for (int a = 0; a < 3; ++a) gedge |= i[a] < glo[a] || i[a] >= ghi[a];
    // row r's window along axis a in steps of its dilation d (the box and the window lie on the
    // row's phase, so their distance is a multiple of d): the tile's first key less the
    // window's first, and the window's length
    auto off = [&](int r, int a, int d, int kt) { return (gfirst[a] - win[r][a].x) / d + i[a] * kt; };
    auto span = [&](int r, int a, int d) { return (win[r][a].y - win[r][a].x + d - 1) / d; };
    if (gedge) {
      // key (column) c of the tile sits at the box's origin plus (c / (KT1 KT2), c / KT2 % KT1,
      // c % KT2) times the dilations; a thread's columns are 2 (lane % 4) plus 8 g + b
      // (bit 2 g + b of a row's GridBits), and with KT2 a multiple of 8 the lane's part stays
      // on the last axis. Along axes 0 and 1 a column's coordinate is constant over runs of
      // bits, so the axis lets a range of runs through; along axis 2 the KT2 / 4 bits of a
      // period are compared one by one. An axis's bits are recomputed only where the tile
      // moved along it.
      if (i[0] != gbits_at[0]) {
        gbits_at[0] = i[0];
#pragma unroll
        for (int r = 0; r < 2; ++r)
          gbits[0][r] = run_bits<GridBits, KT0, KT1 * KT2 / 4, GW>(off(r, 0, GD0, KT0), span(r, 0, GD0));
      }
      if (i[1] != gbits_at[1]) {
        gbits_at[1] = i[1];
#pragma unroll
        for (int r = 0; r < 2; ++r)
          gbits[1][r] = run_bits<GridBits, KT1, KT2 / 4, GW>(off(r, 1, GD1, KT1), span(r, 1, GD1));
      }
      if (i[2] != gbits_at[2]) {
        gbits_at[2] = i[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int o2 = off(r, 2, GD2, KT2) + 2 * (lane % 4), s2 = span(r, 2, GD2);
          GridBits period = 0;
#pragma unroll
          for (int k = 0; k < KT2 / 4; ++k)
            if ((uint32_t)(o2 + 8 * (k / 2) + k % 2) < (uint32_t)s2)
              period |= GridBits(1) << k;
          gbits[2][r] = period * period_starts<GridBits, KT2 / 4, GW>();
        }
      }
    }
  };
  // mask, running max and sum; sc becomes exp2(s * scale_log2 - max), corr the rescale of o
  // (tile n0 in stage s: with segment ids, its keys' ids are in the stage's slot)
  auto softmax = [&](int t, int s) {
    const int n0 = (t0 + t) * BN;
    bool edge = n0 + BN > kv_end;
    const int a0 = m0 + (SHIFTED ? shift : 0);
    if (LEFT < __UNBOUNDED__) edge |= n0 < anchor_of<BAND_BLOCK>(a0 + BM - 1) - LEFT;
    if (RIGHT < __UNBOUNDED__) edge |= n0 + BN - 1 > anchor_of<BAND_BLOCK>(a0) + RIGHT;
    if (RT == 2) edge |= n0 < in_lo || n0 + BN > in_hi;
    if (GRID) {
      edge = gedge;
      if (edge) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const GridBits seen = gbits[0][r] & gbits[1][r] & gbits[2][r];
#pragma unroll
          for (int k = 0; k < GW; ++k)
            if (!((seen >> k) & 1)) sc[4 * (k / 2) + 2 * r + k % 2] = NEG_INF;
        }
      }
    } else if (edge) {
      // col - row and kv_end - col as per-thread values plus constants: compares with immediates
      // (col - the rows' anchors where the band is measured from blocks of rows)
      const int sh = SHIFTED ? shift : 0;
      const int col0 = n0 + 2 * (lane % 4), d0 = col0 - rows[0] - sh, room = kv_end - col0;
      const int anchors[2] = {anchor_of<BAND_BLOCK>(rows[0] + sh), anchor_of<BAND_BLOCK>(rows[1] + sh)};
      const int* key_id = reinterpret_cast<const int*>(smem + (s_ids - s_q) + s * BN * 4) + 2 * (lane % 4);
#pragma unroll
      for (int i = 0; i < SN; ++i) {
        const int dc = (i / 4) * 8 + (i % 2);
        const int d = BAND_BLOCK == 1 ? d0 + dc - 8 * ((i / 2) % 2) : col0 + dc - anchors[(i / 2) % 2];
        bool ok = dc < room;
        if (LEFT < __UNBOUNDED__) ok &= d >= -LEFT;
        if (RIGHT < __UNBOUNDED__) ok &= d <= RIGHT;
        if (RT == 2) ok &= key_id[dc] == row_id[(i / 2) % 2];
        if (!ok) sc[i] = NEG_INF;
      }
    }
    float tmax[2] = {NEG_INF, NEG_INF}, base[2];
#pragma unroll
    for (int i = 0; i < SN; ++i) tmax[(i / 2) % 2] = fmaxf(tmax[(i / 2) % 2], sc[i]);
#pragma unroll
    for (int x = 0; x < 2; ++x) {
      tmax[x] = fmaxf(tmax[x], __shfl_xor_sync(0xffffffff, tmax[x], 1));
      tmax[x] = fmaxf(tmax[x], __shfl_xor_sync(0xffffffff, tmax[x], 2));
      const float m_new = fmaxf(mx[x], tmax[x]);
      base[x] = m_new == NEG_INF ? 0.f : m_new * scale_log2;
      corr[x] = m_new == NEG_INF ? 1.f : fast_exp2(mx[x] * scale_log2 - base[x]);
      mx[x] = m_new;
      sum[x] *= corr[x];
    }
#pragma unroll
    for (int i = 0; i < SN; ++i) {
      sc[i] = fast_exp2(sc[i] * scale_log2 - base[(i / 2) % 2]);
      sum[(i / 2) % 2] += sc[i];
    }
  };
  // a K stage is free once its product is complete (before the softmax); with segment ids, once
  // the softmax has read the stage's key ids too (after it)
  auto release_k = [&](int s, bool after_softmax) {
    if (after_softmax != (RT == 2)) return;
    if (RT == 2) __syncwarp();
    if (lane == 0) mbar_arrive(empty_k(s));
  };
  auto to_p = [&]() {
#pragma unroll
    for (int i = 0; i < SN; i += 2) p[i / 2] = pack2(sc[i], sc[i + 1]);
  };
  auto rescale_o = [&]() {
#pragma unroll
    for (int i = 0; i < 64; ++i) o[i] *= corr[(i / 2) % 2];
  };

  int ring = 0, qn = 0;  // K/V tiles and Q tiles this CTA has consumed so far
  auto stage = [&](int t) { return (ring + t) % STAGES; };
  auto phase = [&](int t) { return ((ring + t) / STAGES) & 1; };
  for (int n = 0;; ++n) {
  const int w = SCHEDULE == 2 ? read_ticket(n, s_ticket, item_full(0), item_empty(0)) : scheduled(n);
  if (w < 0) break;
  const Work x = work(w);
  m0 = x.m0;
  t0 = x.t0;
  rows[0] = m0 + 64 * wg + 16 * (warp % 4) + lane / 4;  // fragment rows r and r + 8 of the warp's 16
  rows[1] = rows[0] + 8;
  if (GRID) {
#pragma unroll
    for (int a = 0; a < 3; ++a) {
      gtile[a] = 0;
      gfirst[a] = x.gfirst[a];
      gnt[a] = x.gnt[a];
      glo[a] = x.glo[a];
      ghi[a] = x.ghi[a];
      gbits_at[a] = -1;
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int r = rows[i] - m0;  // the row's place in the patch, last axis fastest
      const int c[3] = {x.gq[0] + r / (QT1 * QT2) * GD0, x.gq[1] + r / QT2 % QT1 * GD1,
                        x.gq[2] + r % QT2 * GD2};
      const bool live = c[0] < GN0 && c[1] < GN1 && c[2] < GN2;
#pragma unroll
      for (int a = 0; a < 3; ++a) {
        win[i][a] = live ? __ldg(grid_windows + a * GNMAX + c[a]) : make_int2(0, 0);
      }
      rows[i] = live ? (c[0] * GN1 + c[1]) * GN2 + c[2] : Sq;
    }
  }
  kv_end = x.kv_end;
  shift = x.shift;
  in_lo = x.in_lo;
  in_hi = x.in_hi;
  if (RT == 2)
    for (int i = 0; i < 2; ++i) row_id[i] = rows[i] < Sq ? __ldg(rt_q_ids + (size_t)x.b * Sq + rows[i]) : 0;
#pragma unroll
  for (int i = 0; i < 64; ++i) o[i] = 0.f;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    mx[i] = NEG_INF;
    sum[i] = 0.f;
    corr[i] = 1.f;
  }
  // a row block that sees no key skips the walk (the same in every warp: no barrier is left
  // waiting); its rows still get out = 0 and lse = -inf below
  const int n_tiles = x.n_tiles;
  if (n_tiles > 0) {
  if (PERSISTENT) {
    const int qb = qn % Q_STAGES;
    q_desc = smem_desc(s_q + qb * QBYTES + wg * 64 * 128, 16, 1024);
    mbar_wait(q_full(qb), (qn / Q_STAGES) & 1);
  } else {
    const uint16_t* qb = q + ((size_t)x.b * Sq * H + x.h) * HD;
    const size_t q_row = (size_t)H * HD;
    for (int c = wt; c < 64 * 16; c += 128) {
      const int r = 64 * wg + c / 16, j = c % 16, m = m0 + r;
      const bool ok = m < Sq;
      cp_async16(s_q + swz(r, j, BM), qb + (ok ? m : 0) * q_row + j * 8, ok ? 16 : 0);
    }
    asm volatile("cp.async.wait_all;" ::: "memory");
    fence_async_smem_always();
    named_sync(1 + wg, 128);
  }
  if (PINGPONG && wg == 1 && qn == 0) asm volatile("bar.arrive %0, 256;" :: "r"(3) : "memory");
  if (OVERLAP) {
    // products of tile t issued with P V of tile t - 1; softmax of t runs under P V of t - 1
    mbar_wait(full_k(stage(0)), phase(0));
    fence_async_smem();
    turn_wait();
    wgmma_fence();
    qk(stage(0));
    wgmma_commit();
    turn_pass();
    release_stored_q();
    grid_mask();
    wgmma_wait<0>();
    fence_regs<SN>(sc);
    release_k(stage(0), false);
    softmax(0, stage(0));
    release_k(stage(0), true);
    to_p();
    for (int t = 1; t < n_tiles; ++t) {
      const int s = stage(t), sp = stage(t - 1);
      mbar_wait(full_k(s), phase(t));
      mbar_wait(full_v(sp), phase(t - 1));
      fence_async_smem();
      turn_wait();
      wgmma_fence();
      qk(s);
      wgmma_commit();
      pv(sp);
      wgmma_commit();
      turn_pass();
      grid_mask();
      wgmma_wait<1>();
      fence_regs<SN>(sc);
      release_k(s, false);
      softmax(t, s);
      release_k(s, true);
      wgmma_wait<0>();
      fence_regs<64>(o);
      if (lane == 0) mbar_arrive(empty_v(sp));
      rescale_o();
      to_p();
    }
    // every product reading Q is complete: the producer may load the next work tile's (with
    // O_TMA, once out is stored from the slot)
    if (PERSISTENT && !O_TMA && lane == 0) mbar_arrive(q_empty(qn % Q_STAGES));
    const int sl = stage(n_tiles - 1);
    mbar_wait(full_v(sl), phase(n_tiles - 1));
    fence_async_smem();
    turn_wait();
    wgmma_fence();
    pv(sl);
    wgmma_commit();
    turn_pass();
    wgmma_wait<0>();
    fence_regs<64>(o);
    if (lane == 0) mbar_arrive(empty_v(sl));
  } else {
    for (int t = 0; t < n_tiles; ++t) {
      const int s = stage(t), parity = phase(t);
      mbar_wait(full_k(s), parity);
      fence_async_smem();
      turn_wait();
      wgmma_fence();
      qk(s);
      wgmma_commit();
      turn_pass();
      if (t == 0) release_stored_q();
      grid_mask();
      wgmma_wait<0>();
      fence_regs<SN>(sc);
      release_k(s, false);
      softmax(t, s);
      release_k(s, true);
      rescale_o();
      to_p();
      mbar_wait(full_v(s), parity);
      fence_async_smem();
      turn_wait();
      wgmma_fence();
      pv(s);
      wgmma_commit();
      turn_pass();
      wgmma_wait<0>();
      fence_regs<64>(o);
      if (lane == 0) mbar_arrive(empty_v(s));
    }
    if (PERSISTENT && !O_TMA && lane == 0) mbar_arrive(q_empty(qn % Q_STAGES));
  }
  ring += n_tiles;
  ++qn;
  }

  // ---- epilogue: out = o / sum (0 on a row with no key), lse = m * scale + log(sum) ----
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    sum[i] += __shfl_xor_sync(0xffffffff, sum[i], 1);
    sum[i] += __shfl_xor_sync(0xffffffff, sum[i], 2);
  }
  const float ln2 = 0.6931471805599453f;
  // O_TMA, after a walk: out into the warpgroup's rows of the tile's Q slot (in the layout Q
  // came in: the stores of a warp hit every bank once), then one TMA store of those 64 rows a
  // 64-column block (rows past Sq are clipped). Else (and for a tile that walked nothing, which
  // holds no Q slot), from registers.
  const bool staged = O_TMA && n_tiles > 0;
  const uint32_t s_o = s_q + ((qn + Q_STAGES - 1) % Q_STAGES) * QBYTES;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int row = rows[i];
    if (row >= Sq && !staged) continue;
    if (row >= x.q_end || row < x.q_first) sum[i] = 0.f;  // padding or no position: out = 0, lse = -inf
    const float inv = sum[i] > 0.f ? 1.f / sum[i] : 0.f;
    if (staged) {
      const int r = 64 * wg + 16 * (warp % 4) + lane / 4 + 8 * i;  // the row in the tile
#pragma unroll
      for (int e = 2 * i; e < 64; e += 4)
        st_shared32(s_o + swz(r, e / 4, BM) + 4 * (lane % 4), pack2(o[e] * inv, o[e + 1] * inv));
    } else {
      uint16_t* orow = out + (((size_t)x.b * Sq + row) * H + x.h) * HD;
#pragma unroll
      for (int e = 2 * i; e < 64; e += 4) {
        const int col = (e / 4) * 8 + 2 * (lane % 4);
        *reinterpret_cast<uint32_t*>(orow + col) = pack2(o[e] * inv, o[e + 1] * inv);
      }
    }
    if (lane % 4 == 0 && row < Sq)
      lse[((size_t)x.b * H + x.h) * Sq + row] =
          sum[i] > 0.f ? mx[i] * scale_log2 * ln2 + logf(sum[i]) : NEG_INF;
  }
  if (staged) {
    fence_async_smem_always();
    named_sync(1 + wg, 128);
    if (wt == 0) {
      const int m = x.m0 + 64 * wg;
      tma_store_4d(go, s_o + 64 * wg * 128, 0, x.h, m, x.b);
      tma_store_4d(go, s_o + BM * 128 + 64 * wg * 128, 64, x.h, m, x.b);
      asm volatile("cp.async.bulk.commit_group;" ::: "memory");
      o_slot = (qn + Q_STAGES - 1) % Q_STAGES;
    }
    // with one Q slot the next tile's Q waits for it: released now
    if (Q_STAGES == 1) release_stored_q();
  }
  }
  // the last stores are complete before the CTA's shared memory goes
  if (O_TMA && wt == 0) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
  if (PINGPONG && wg == 0 && qn > 0) named_sync(3, 256);  // warpgroup 1's last pass
  }
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


def section_bytes_of(heads: int, kv_len: int) -> int:
    """``section_bytes`` that makes the queue's sections ``heads`` (batch, head)s at ``kv_len``
    keys: K and V of a head counted as the kernel counts them (``4 * D * Skv`` bytes)."""
    return heads * 4 * D * kv_len


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


def runtime_subs(runtime: str, names: tuple[str, ...]) -> dict[str, str]:
    """``__RT__``, ``__RT_PARAMS__`` (the arrays ``runtime`` passes) and ``__RT_LOCALS__`` (the
    others as null pointers, so that code behind ``if (RT ...)`` compiles in every variant)."""
    given = runtime_arrays(runtime, names)
    return {
        "__RT__": str(RUNTIMES[runtime]),
        "__RT_PARAMS__": "".join(f"const int* __restrict__ {n}, " for n in given),
        "__RT_LOCALS__": " ".join(f"const int* {n} = nullptr;" for n in names if n not in given),
    }


def grid_subs(grid) -> dict[str, str]:
    """The grid geometry's placeholders: ``GridTiles`` baked in and the ``grid_tables`` parameter,
    or, with no grid, ``GRID = false`` (unit axes, the tables a null pointer)."""
    on = grid is not None
    g = grid.grid if on else (1, 1, 1)
    d = grid.dilation if on else (1, 1, 1)
    q = grid.q_tile if on else (1, 1, BM)
    k = grid.k_tile if on else (1, 1, BN)
    p = grid.patches if on else (1, 1, 1)
    subs = {"__GRID__": str(on).lower(), "__GPMAX__": str(grid.pmax if on else 1),
            "__GNMAX__": str(grid.nmax if on else 1),
            "__GRID_PARAMS__": "const int* __restrict__ grid_tables, " if on else "",
            "__GRID_LOCALS__": "" if on else "const int* grid_tables = nullptr;"}
    for name, vals in (("GN", g), ("GD", d), ("QT", q), ("KT", k), ("GP", p)):
        subs.update({f"__{name}{a}__": str(v) for a, v in enumerate(vals)})
    return subs


def source(left: int | None, right: int | None, *, stages: int = 2, overlap: bool = True,
           pingpong: bool = True, feed: str = "tma", proxy_fence: bool | None = None,
           block_n: int = BN, dtype: str = "bfloat16", schedule: str = "grid", section_bytes: int = 0,
           runtime: str = "", grid=None, q_stages: int = 1, o_store: str = "registers",
           band_block: int = 1, shifted: bool = False) -> str:
    """The kernel's CUDA C++ for the mask ``a(i) - left <= j <= a(i) + right`` (``None``: unbounded),
    ``a(i) = i - i % band_block`` (row ``i`` itself by default; :class:`acsr.BandForm`'s ``block``).

    ``feed``: how K/V reach shared memory: ``"tma"`` (tensor maps: ``tmap_templates`` holds K's,
    V's and Q's, encoded on the host for the call's shapes; each CTA publishes them with its base
    addresses in its :data:`SLOT_BYTES` slot of ``tmap_slots``), ``"cp.async"``, or ``"none"`` (a
    timing experiment: no copies, the output is not attention). ``schedule`` (:data:`SCHEDULES`):
    ``"grid"`` launches ``grid = (row blocks, H, B)``, a CTA per work tile, and the consumers load
    Q with cp.async; ``"strided"`` and ``"queue"`` launch at most one CTA per SM (``grid = (CTAs,
    1, 1)``) looping over work tiles (row block, head, batch; longest walks first): with
    ``"strided"`` each takes every ``gridDim.x``-th one, with ``"queue"`` the next one by ticket
    from the counter ``sem`` (zeroed before the launch). Those two need ``feed="tma"``: the
    producer loads Q by TMA too, the next tile's Q and K/V while the consumers finish the last
    one, and the maps are published once a CTA. ``section_bytes``: the queue takes
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
    (:func:`jax_bindings._cuda.tensor_map.grid_template`), and needs a persistent ``schedule``,
    ``block_n = prod(grid.k_tile)`` and no runtime mask.
    ``q_stages``: Q tiles in shared memory, 1 or 2 (2 needs a persistent ``schedule``): with 2
    the producer loads the next work tile's Q, then its first K and V tiles, while the consumers
    still walk the current one; with 1 it waits until the current tile's last ``Q K^T`` is done.
    ``o_store``: how the epilogue writes ``out``: ``"registers"``, each thread its values; ``"tma"``
    (a persistent band kernel fed by TMA), each warpgroup its rows into its half of the tile's Q
    slot, then two TMA stores (``tmap_templates`` then holds out's map, boxes of 64 rows, fourth);
    the slot goes back to the producer once the stores have read it: after the next walk's first
    products with two Q tiles, at once with one.
    ``proxy_fence``: the consumers' generic -> async proxy fence after each wait (needed for
    cp.async; default on for it only). ``block_n``:
    keys per tile (the wgmma N of ``Q K^T``). V's MN-major descriptor has the 64-column block
    stride (``block_n * 128`` bytes) as its leading offset and 8 keys (1024 bytes) as its stride;
    the other order was built and fails the check.
    ``shifted``: queries at run-time positions (a chunk of queries at an offset into a KV cache):
    query row ``i`` of batch row ``b`` is row ``i + shift[b]`` of the band, and only rows in
    ``[q_first[b], q_end[b])`` see keys (the others get ``out = 0``, ``lse = -inf``); ``rt_lens``
    is then ``[B, 4]``: ``(q_end, kv_len, shift, q_first)``
    (:func:`jax_bindings._cuda.runtime_tables.shifted_lens`). Needs a runtime mask and a plain
    band (``band_block = 1``, no grid).
    """
    if feed not in FEEDS:
        raise ValueError(f"feed must be one of {sorted(FEEDS)}, got {feed!r}")
    check_schedule(schedule)
    if schedule != "grid" and feed != "tma":
        raise ValueError(f"schedule={schedule!r} needs feed='tma' (Q comes by TMA), got feed={feed!r}")
    if block_n % 16 or not 16 <= block_n <= 256:
        raise ValueError(f"block_n must be a multiple of 16 in [16, 256], got {block_n}")
    check_arguments(left, right, stages, dtype, band_block)
    if runtime == "ids" and feed != "tma":
        raise ValueError(f"runtime='ids' needs feed='tma' (key ids come with K by bulk copy), got {feed!r}")
    check_section_bytes(section_bytes)
    if q_stages not in (1, 2) or (q_stages == 2 and schedule == "grid"):
        raise ValueError(f"q_stages must be 1, or 2 with a persistent schedule, got q_stages={q_stages!r} "
                         f"with schedule={schedule!r}")
    if o_store not in O_STORES:
        raise ValueError(f"o_store must be one of {O_STORES}, got {o_store!r}")
    if o_store == "tma" and (schedule == "grid" or feed != "tma" or grid is not None):
        raise ValueError(f"o_store='tma' needs a persistent schedule, feed='tma' and no grid tiles, got "
                         f"schedule={schedule!r}, feed={feed!r}, grid={grid!r}")
    if shifted and (not runtime or band_block != 1 or grid is not None):
        raise ValueError(f"shifted needs a runtime mask and a plain band, got runtime={runtime!r}, "
                         f"band_block={band_block!r}, grid={grid!r}")
    if grid is not None:
        if schedule == "grid" or runtime or left is not None or right is not None or band_block != 1:
            raise ValueError(f"grid tiles need a persistent schedule, no runtime mask and no band, got "
                             f"schedule={schedule!r}, runtime={runtime!r}, left={left!r}, right={right!r}, "
                             f"band_block={band_block!r}")
        if block_n != grid.block_n:
            raise ValueError(f"block_n must be the key tile's {grid.block_n} keys with grid tiles, "
                             f"got {block_n}")
    subs = {
        "__BM__": BM, "__BN__": block_n, "__D__": D, "__STAGES__": stages, "__LEFT__": bound(left),
        "__RIGHT__": bound(right), "__BAND_BLOCK__": band_block, "__THREADS__": THREADS,
        "__NAME__": KERNEL_NAME,
        "__UNBOUNDED__": UNBOUNDED, "__CONSUMER_WARPS__": CONSUMER_WARPS, "__V_LEAD__": block_n * 128,
        "__V_STRIDE__": 1024, "__OVERLAP__": str(overlap).lower(),
        "__PINGPONG__": str(pingpong).lower(), "__PRODUCER_WARPS__": PRODUCER_WARPS,
        "__FEED__": FEEDS[feed], "__PROXY_FENCE__": str(feed == "cp.async" if proxy_fence is None
                                                        else proxy_fence).lower(),
        "__SCHEDULE__": SCHEDULES[schedule], "__SLOT_BYTES__": SLOT_BYTES, "__BAR_BYTES__": bar_bytes(stages),
        "__PRODUCER_REGS__": PRODUCER_REGS, "__CONSUMER_REGS__": CONSUMER_REGS, "__ELEM__": ELEMENTS[dtype],
        "__SECTION_BYTES__": section_bytes, "__Q_STAGES__": q_stages,
        "__O_TMA__": str(o_store == "tma").lower(), "__MAP_STAGE_BYTES__": map_stage_bytes(o_store),
        "__SHIFTED__": str(shifted).lower(), **runtime_subs(runtime, FWD_RUNTIME_ARRAYS), **grid_subs(grid),
    }
    text = HELPERS + wgmma_ss(block_n) + wgmma_rs(D) + _KERNEL
    for key, val in subs.items():
        text = text.replace(key, str(val))
    return text


def with_unique_name(text: str, kernel: str = KERNEL_NAME, prefix: str = "splat_fwd") -> tuple[str, str]:
    """``(name, text)``: the kernel ``kernel`` renamed ``<prefix>_<digest of the source>``.

    jaxlib keeps the modules it loaded keyed by kernel name, shared memory and PTX; a kernel
    handed over as a cubin has no PTX, so two variants of one name and shared-memory size would
    share the first one loaded. A name derived from the source tells every variant apart.
    """
    name = f"{prefix}_{hashlib.sha256(text.encode()).hexdigest()[:20]}"
    return name, text.replace(kernel, name)
