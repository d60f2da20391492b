"""CUDA C++ source of a Hopper (sm_90a) attention backward, written for a diagonal band baked in.

The backward of :mod:`jax_bindings._cuda.source`'s forward, from the same helpers. A work item
is ``BN = 128`` keys of one (batch, KV head): its walk is the query blocks of ``BM = 64`` rows
that see any of them, for every query head of its GQA group. One CTA runs per SM (at most one
per item) and takes items by ticket from a counter, in the key order (below), until none is
left; the K/V and Q/dO loads of its next item overlap the end of the current one, and the
tensor maps are published once per CTA. In a CTA:

* warps 0-7 are two consumer warpgroups, warpgroup ``w`` owning keys ``64 w .. 64 w + 63``:
  ``S^T = K Q^T`` and ``dP^T = V dO^T`` (``wgmma`` m64n64k16 from shared memory),
  ``P^T = exp2(S^T * scale log2(e) - lse log2(e))`` masked to the band,
  ``dS^T = P^T (dP^T - delta)``; then ``dV += P^T dO`` and ``dK += dS^T Q`` with P and dS from
  registers (m64n128k16; the accumulators stay in registers for the whole walk, so dK and dV
  are summed over the group's heads in a fixed order), and ``dQ = dS K`` over all 128 keys from
  dS stored to shared memory (both operands MN-major), warpgroup ``w`` taking head-dim columns
  ``64 w .. 64 w + 63``. Each product is issued as soon as its operands are: dV before dS is
  computed (so P's exponentials run under dP^T's product, and dV under dS's arithmetic), dK
  after dQ (so it runs under dQ's store to shared memory);
* warps 8-11 are the producer warpgroup: warp 8 takes the tickets and loads, per item, K and V
  once (TMA) and per step Q and dO (TMA) and the step's 64 ``lse`` and ``delta`` values (bulk
  copies) into a ring of ``stages`` buffers; warps 9 and 10 write dQ (below);
* dQ is a sum over key blocks, so CTAs add their part to an fp32 buffer in global memory: the
  consumers leave each step's dQ in one of two shared-memory buffers, in the order their
  fragments hold it (``bwd_passes.dq_rows`` puts it back in rows), and a dQ writer per buffer (a
  lane of warps 9 and 10) adds the block's 32 KiB with one bulk reduction while they go on. With
  ``ordered`` (the default) the additions to one query block come in a fixed order, the key
  order, each waiting on a per-block counter for its turn: the result is
  bit-identical from run to run. The first key block in that order stores its part instead of
  adding it, so ``dq_acc`` needs no zeroing before the launch (query blocks that no key block
  reaches are never written: ``bwd_passes.dq_rows`` zeroes rows that see no key). A writer passes the
  turn on once its addition is complete; with two writers, one step's addition completes while the
  next one's waits for its turn. An item waits only on items with a smaller ticket, each taken by
  a CTA already running, so the waits cannot deadlock. ``ordered=False`` adds in any order (not
  reproducible bit for bit) and exists to measure what the order costs.

The key order (``key_order``, :data:`KEY_ORDERS`), per head: ``"last_first"`` takes a head's
last key block first and walks each key block's query blocks from the first; ``"first_first"``
is its mirror (first key block first, query blocks from the last); ``"first_first_at_end"``
takes the last section's heads first-first and the others last-first. Where the first key
blocks walk the most query blocks (causal), last-first takes the longest walks last, so that
the CTAs run out of work on a few long walks, and first-first takes them first (with dQ added
in arrival order, 1.10x last-first on causal at S = 8192). But in last-first a key block meets
each query block two steps after the key block before it in the order (its walk starts two
query blocks earlier), which absorbs the time an addition takes to complete, and in
first-first on the same step: there a key block waits on the one before it unless it started
late enough, and where CTAs take the heads' items in bursts it does not. First-first on the
last section only keeps most of both (``benchmarks/NOTES.md``, session 19).

Mask: as the forward's, ``a(i) - left <= j <= a(i) + right``, ``0 <= j < Skv``, ``a(i) = i`` or
its block's first row (``band_block``); a key block's walk is the rows whose ``a(i)`` is in
``[n0 - right, n0 + BN - 1 + left]``, which never moves back from one key block to the next. Inputs ``q, dout
[B, Sq, H, D]``, ``k, v [B, Skv, Hkv, D]`` (bf16 or fp16, ``D = 128``), ``lse2 [B, H, Sq_pad]``
(the forward's lse times log2(e); ``+inf`` on a row with no key and on the padding to
``Sq_pad``, a multiple of 64), ``delta [B, H, Sq_pad]`` (rowsum(dout * out), 0 on the padding).
Outputs ``dk``, ``dv`` like k, v (dk times ``scale``), ``dq_acc`` fp32 (:func:`dq_acc_shape`; dQ
without the scale once ``bwd_passes.dq_rows`` reorders it; zeroed before the launch when not
``ordered``), ``sem`` (int32, zeroed before the launch: a ticket counter, then a turn counter per
(batch, head, query block)), and the CTAs' tensor-map slots. Parameters, in jaxlib's order:
``q, k, v, dout, lse2, delta, tmap_templates, [runtime arrays,] Sq, Skv, H, Hkv, B, scale_log2,
scale, dk, dv, dq_acc, sem, tmap_slots``.

A runtime mask (``bwd_source(runtime=)``, arrays from :mod:`jax_bindings._cuda.runtime_tables`)
is ANDed with the band: padding rows need nothing (their ``lse2`` is ``+inf``), keys at or past
``kv_len`` are masked and walk nothing; with segment ids a key block walks only the query
blocks of its keys' ids, and the producer copies each step's query ids with its Q and dO into
the tensor-map staging buffers (free once the maps are published).
"""

from __future__ import annotations

from jax_bindings._cuda import source

BM, BN, D = 64, 128, source.D
THREADS = source.THREADS
KERNEL_NAME = "splat_bwd_wgmma"
SLOT_BYTES = 512  # K, V, Q and dO tensor maps of a CTA
STAT_BYTES = 2 * BM * 4  # one step's lse and delta


DQ_TILE = BM * D * 4  # one step's dQ, fp32



def smem_bytes(stages: int) -> int:
    """K and V, ``stages`` Q/dO buffers with their lse/delta, two dS^T buffers, two dQ buffers, the
    mbarriers and the ticket (padded to 128), four tensor-map staging buffers, 1 KiB for alignment."""
    kv, qdo, ds = 2 * BN * D * 2, 2 * BM * D * 2, BN * BM * 2
    bars = -(-(8 * (5 + 2 * stages) + 16) // 128) * 128
    return kv + stages * (qdo + STAT_BYTES) + 2 * ds + 2 * DQ_TILE + bars + 4 * 128 + 1024


def num_q_blocks(sq: int) -> int:
    return -(-sq // BM)


# A query block's dQ in ``dq_acc`` is in the consumers' fragment order, so that a warp's stores
# to shared memory are 256 contiguous bytes and the block is one bulk reduction: the axes of a
# block, outermost first, are (warpgroup w, column group cg, row half rh, warp wq, lane / 4 l4,
# lane % 4 l2, pair), holding row 16 wq + 8 rh + l4 and column 64 w + 8 cg + 2 l2 + pair.
_FRAGMENT_AXES = (2, 8, 2, 4, 8, 4, 2)


def dq_acc_shape(b: int, h: int, sq: int) -> tuple[int, int, int, int]:
    """Shape of the kernel's fp32 ``dq_acc``: ``[B, H, query blocks, BM * D]``."""
    return b, h, num_q_blocks(sq), BM * D


def dq_from_acc(acc, sq: int, lse=None):
    """``dq_acc`` (NumPy or JAX array, :func:`dq_acc_shape`) as ``[B, Sq, H, D]``; with ``lse``
    (the forward's, ``[B, H, Sq]``), 0 on the rows that see no key (``lse = -inf``), whatever
    ``dq_acc`` holds there: the ordered kernel never writes a query block no key block reaches.
    What ``bwd_passes.dq_rows`` does on the GPU (before the scale), written with array operations:
    the tests' reference for it and for the fragment order."""
    b, h, nq, _ = acc.shape
    blocks = acc.reshape(b, h, nq, *_FRAGMENT_AXES)
    # to (B, nq, wq, rh, l4, H, w, cg, l2, pair)
    rows = blocks.transpose(0, 2, 6, 5, 7, 1, 3, 4, 8, 9).reshape(b, nq * BM, h, D)[:, :sq]
    if lse is None:
        return rows
    xp = rows.__array_namespace__()
    seen = ~xp.isinf(xp.permute_dims(lse, (0, 2, 1)))[..., None]  # lse is -inf or finite
    return xp.where(seen, rows, xp.zeros((), dtype=rows.dtype))


def section_bytes_of(kv_heads: int, group: int, sq: int) -> int:
    """``section_bytes`` that makes the backward's sections ``kv_heads`` (batch, KV head)s of
    ``group`` query heads each at ``sq`` queries: Q and dO counted as the kernel counts them
    (``4 * D * group * Sq`` bytes a KV head)."""
    return kv_heads * 4 * D * group * sq


def sem_words(b: int, h: int, sq: int) -> int:
    """int32 words of the ``sem`` output: the ticket, then a turn counter per query block and head."""
    return 1 + b * h * num_q_blocks(sq)


_HELPERS = r"""
// copies `bytes` from shared memory to global memory (an async bulk copy)
__device__ __forceinline__ void bulk_store(float* dst, uint32_t src, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
               :: "l"(dst), "r"(src), "r"(bytes) : "memory");
}
// adds `bytes` of fp32 from shared memory to global memory (an async bulk reduction)
__device__ __forceinline__ void bulk_reduce_add(float* dst, uint32_t src, uint32_t bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;"
               :: "l"(dst), "r"(src), "r"(bytes) : "memory");
}
__device__ __forceinline__ int ld_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void red_release_inc(int* p) {
  asm volatile("red.release.gpu.global.add.s32 [%0], 1;" :: "l"(p) : "memory");
}
// A quad of lanes (lane % 4 = q) holding words a[c] of column groups c = 0..3, 4 bytes each (the
// quad's lane j has bytes 4 j .. 4 j + 3 of every group): lane q gets group q's 16 bytes, its word
// j from lane j. Two rounds of shuffles, across lane bit 1 then bit 0.
__device__ __forceinline__ uint4 quad_transpose(const uint32_t a[4], int lane) {
  const bool b0 = lane & 1, b1 = lane & 2;
  // round 1: the groups whose bit 1 is the lane's stay, the others go to lane ^ 2
  const uint32_t r0 = __shfl_xor_sync(0xffffffff, b1 ? a[0] : a[2], 2);
  const uint32_t r1 = __shfl_xor_sync(0xffffffff, b1 ? a[1] : a[3], 2);
  const uint32_t k0 = b1 ? a[2] : a[0], k1 = b1 ? a[3] : a[1];
  // round 2: group q's words from lanes q ^ 1 and q ^ 3
  const uint32_t t0 = __shfl_xor_sync(0xffffffff, b0 ? k0 : k1, 1);
  const uint32_t t1 = __shfl_xor_sync(0xffffffff, b0 ? r0 : r1, 1);
  // v[x]: group q's word from lane q ^ x; word j is v[j ^ q]
  const uint32_t v0 = b0 ? k1 : k0, v1 = t0, v2 = b0 ? r1 : r0, v3 = t1;
  const uint32_t u0 = b0 ? v1 : v0, u1 = b0 ? v0 : v1, u2 = b0 ? v3 : v2, u3 = b0 ? v2 : v3;
  return b1 ? make_uint4(u2, u3, u0, u1) : make_uint4(u0, u1, u2, u3);
}
__device__ __forceinline__ int floor_div(int x, int d) { return x >= 0 ? x / d : -((-x + d - 1) / d); }
// the first row whose anchor (source.HELPERS' anchor_of) is >= x, and the last whose anchor is <= y
template <int BLOCK>
__device__ __forceinline__ int first_anchored_from(int x) {
  return BLOCK == 1 ? x : -floor_div(-x, BLOCK) * BLOCK;
}
template <int BLOCK>
__device__ __forceinline__ int last_anchored_to(int y) {
  return BLOCK == 1 ? y : floor_div(y, BLOCK) * BLOCK + BLOCK - 1;
}
"""

_KERNEL = r"""
constexpr int BM = __BM__, BN = __BN__, HD = __D__, STAGES = __STAGES__;
constexpr int LEFT = __LEFT__, RIGHT = __RIGHT__;  // key j seen by row i: a - LEFT <= j <= a + RIGHT
constexpr int BAND_BLOCK = __BAND_BLOCK__;  // a = anchor_of<BAND_BLOCK>(i): i, or its block's first row
constexpr bool ORDERED = __ORDERED__;
// the heads whose key blocks go first to last (tickets, dQ additions), each walking its query
// blocks from the last: 0 none, 1 the last section's, 2 all; the others' go last to first, each
// walking its query blocks from the first
constexpr int FIRST_FIRST = __FIRST_FIRST__;
constexpr int RT = __RT__;  // runtime mask: 0 none, 1 lengths, 2 lengths and segment ids
constexpr uint32_t KVTILE = BN * HD * 2, QTILE = BM * HD * 2, DSTILE = BN * BM * 2, STAT = __STAT_BYTES__;
constexpr uint32_t DQTILE = BM * HD * 4;

extern "C" __global__ void __launch_bounds__(__THREADS__, 1) __NAME__(
    const uint16_t* __restrict__ q, const uint16_t* __restrict__ k, const uint16_t* __restrict__ v,
    const uint16_t* __restrict__ dout, const float* __restrict__ lse2, const float* __restrict__ delta,
    const uint8_t* __restrict__ tmap_templates, __RT_PARAMS__int Sq, int Skv, int H, int Hkv, int B,
    float scale_log2, float scale, uint16_t* __restrict__ dk, uint16_t* __restrict__ dv,
    float* __restrict__ dq_acc, int* __restrict__ sem, uint8_t* __restrict__ tmap_slots) {
  __RT_LOCALS__
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  // 1 KiB aligned; offset from smem_raw (not cast through an integer) so that the compiler
  // still knows the pointer is shared memory and reads lse/delta with ld.shared
  uint8_t* smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
  const uint32_t s_k = smem_addr(smem), s_v = s_k + KVTILE;
  auto s_q = [&](int s) { return s_k + 2 * KVTILE + s * 2 * QTILE; };
  auto s_do = [&](int s) { return s_q(s) + QTILE; };
  const uint32_t s_ds0 = s_k + 2 * KVTILE + STAGES * 2 * QTILE;
  auto s_ds = [&](int buf) { return s_ds0 + buf * DSTILE; };
  // two buffers of a step's dQ, fp32, in fragment order (see dq_from_acc)
  auto s_dq = [&](int buf) { return s_ds0 + 2 * DSTILE + buf * DQTILE; };
  const uint32_t s_stat0 = s_dq(2);
  auto s_stat = [&](int s) { return s_stat0 + s * STAT; };
  const uint32_t s_bar = s_stat0 + STAGES * STAT;
  const uint32_t kv_full = s_bar, kv_empty = s_bar + 8;
  auto dq_full = [&](int buf) { return s_bar + 8 * (2 + buf); };
  auto dq_empty = [&](int buf) { return s_bar + 8 * (4 + buf); };
  auto item_full = [&](int slot) { return s_bar + 8 * (6 + slot); };
  auto item_empty = [&](int slot) { return s_bar + 8 * (8 + slot); };
  auto full = [&](int s) { return s_bar + 8 * (10 + s); };
  auto empty = [&](int s) { return s_bar + 8 * (10 + STAGES + s); };
  // two slots for the tickets of the CTA's current and next work item
  const uint32_t s_ticket = s_bar + 8 * (10 + 2 * STAGES);
  uint8_t* tmap_stage = smem + (s_bar - s_k) + (8 * (10 + 2 * STAGES) + 16 + 127) / 128 * 128;  // 4 x 128
  // with segment ids, each step's query ids (BM x 4 bytes a stage), loaded with its Q and dO into
  // the tensor-map staging buffers, free once the maps are published
  static_assert(RT != 2 || STAGES * BM * 4 <= 4 * 128, "the query ids need the staging buffers' room");
  const uint32_t s_qid0 = smem_addr(tmap_stage);

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  if (tid == 0) {
    mbar_init(kv_full, 1);
    mbar_init(kv_empty, __CONSUMER_WARPS__);
    for (int buf = 0; buf < 2; ++buf) {
      mbar_init(dq_full(buf), __CONSUMER_WARPS__);
      mbar_init(dq_empty(buf), 1);
      mbar_init(item_full(buf), 1);
      mbar_init(item_empty(buf), __CONSUMER_WARPS__ + 2);  // consumer warps and the two dQ writers
    }
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(full(s), 1);
      mbar_init(empty(s), __CONSUMER_WARPS__);
    }
  }
  __syncthreads();
  const int nkv = (Skv + BN - 1) / BN, G = H / Hkv, nq = (Sq + BM - 1) / BM, sq_pad = nq * BM;
  const int n_items = nkv * Hkv * B;
  // A work item is a key block of a (batch, KV head), taken by ticket in its head's key order
  // (ff: the first key block first). Its walk: the query blocks of BM rows that see a key of the
  // block (keys past Skv included: masked), in the opposite order, for every query head of the
  // group. With a runtime mask it is the intersection of three runs of query blocks, each a run
  // of consecutive key blocks' walks covers (so that the key blocks adding to a query block's dQ
  // are consecutive, as the ordered addition's turns need): the band's, the lengths' (none past
  // kv_end, none at or past q_end) and the segment ids' (rt_ranges, in rows).
  // kv_end: the batch row's key length; rows [in_lo, in_hi) see every key of the block as far
  // as segment ids go (their blocks skip the id test).
  struct Item {
    int j, hk, b, n0, i_lo, n_i, n_steps, kv_end, in_lo, in_hi;
    bool ff;
  };
  // (batch, KV head)s are taken in sections (as many as SECTION_BYTES of their groups' Q and dO
  // hold), a key block of each in turn, so that fewer CTAs at once add to one head's query blocks
  // in the same order
  const int section = heads_per_section(__SECTION_BYTES__LL, 4LL * HD * G * max(Sq, 1), Hkv * B);
  auto item_of = [&](int ticket) {
    Item it;
    const int2 at = in_section(ticket, section, nkv, Hkv * B);
    const bool last_section = (ticket / (section * nkv) + 1) * section >= Hkv * B;
    it.ff = FIRST_FIRST == 2 || (FIRST_FIRST == 1 && last_section);
    it.j = it.ff ? nkv - 1 - at.y : at.y;
    it.hk = at.x % Hkv;
    it.b = at.x / Hkv;
    it.n0 = it.j * BN;
    int lo = 0, hi = Sq - 1;
    if (RIGHT < __UNBOUNDED__) lo = max(lo, first_anchored_from<BAND_BLOCK>(it.n0 - RIGHT));
    if (LEFT < __UNBOUNDED__) hi = min(hi, last_anchored_to<BAND_BLOCK>(it.n0 + BN - 1 + LEFT));
    int i_lo = lo / BM, i_hi = lo <= hi ? hi / BM : -1;
    const int2 len = batch_lengths(rt_lens, it.b, Sq, Skv);  // (q_end, kv_end)
    it.kv_end = len.y;
    it.in_lo = 0;
    it.in_hi = Sq;
    if (RT >= 1) i_hi = it.n0 < it.kv_end && len.x > 0 ? min(i_hi, (len.x - 1) / BM) : -1;
    if (RT == 2) {
      // rows [x, y) see a key of the block; blocks x / BM .. max(x, y - 1) / BM (never none)
      const int4 t = reinterpret_cast<const int4*>(rt_ranges)[(size_t)it.b * nkv + it.j];
      i_lo = max(i_lo, t.x / BM);
      i_hi = min(i_hi, max(t.x, t.y - 1) / BM);
      it.in_lo = t.z;
      it.in_hi = t.w;
    }
    it.i_lo = i_lo;
    it.n_i = max(0, i_hi - i_lo + 1);
    it.n_steps = it.n_i * G;
    return it;
  };
  // the query block of step ii of an item's walk over one query head's blocks
  auto block_of = [&](const Item& it, int ii) {
    return it.ff ? it.i_lo + it.n_i - 1 - ii : it.i_lo + ii;
  };
  // the ticket of the CTA's item number `n` (-1: none left), for consumers and writers
  auto next_ticket = [&](int n) { return read_ticket(n, s_ticket, item_full(0), item_empty(0)); };

  if (warp >= __CONSUMER_WARPS__) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 __PRODUCER_REGS__;" ::: "memory");
    if (warp > __CONSUMER_WARPS__ + 2) return;
    if (warp > __CONSUMER_WARPS__) {
      // ---- dQ writers: lane 0 of warp 9 takes the even steps (dQ buffer 0), of warp 10 the odd
      // ones (steps counted over the CTA's items): each step's dQ from shared memory into
      // dq_acc, in the key blocks' order; each passes its turn on as soon as its addition is
      // complete, while the other one goes on ----
      const int buf = warp - __CONSUMER_WARPS__ - 1;
      int g0 = 0;  // the CTA's steps before this item
      for (int n = 0;; ++n) {
        const int ticket = next_ticket(n);
        if (ticket < 0) break;
        const Item w = item_of(ticket);
        if (lane == 0) {
          // step t of the item: query head hk G + hh, query block i_lo + ii
          int t = (g0 + buf) & 1, hh = 0, ii = t;
          if (ii >= w.n_i) ii = 0, hh = 1;
          for (; t < w.n_steps; t += 2) {
            const int g = g0 + t, i = block_of(w, ii), m0 = i * BM, blk = (w.b * H + w.hk * G + hh) * nq + i;
            int* turn = sem + 1 + blk;
            ii += 2;
            while (ii >= w.n_i) ii -= w.n_i, ++hh;
            mbar_wait(dq_full(buf), (g >> 1) & 1);
            bool first = false;  // ordered: the first part of the block's sum is stored, not added
            if (ORDERED) {
              // the key block that adds to query block i first: the first or the last that sees it
              int lead;
              // (the ids' first and last key block covering it: rt_leads)
              const int2* leads = reinterpret_cast<const int2*>(rt_leads);
              const int2 ids_lead = RT == 2 ? __ldg(leads + (size_t)w.b * nq + i) : make_int2(0, 0);
              if (w.ff) {
                lead = LEFT < __UNBOUNDED__ ? max(0, floor_div(anchor_of<BAND_BLOCK>(m0) - LEFT, BN)) : 0;
                if (RT == 2) lead = max(lead, ids_lead.x);
              } else {
                lead = nkv - 1;
                if (RIGHT < __UNBOUNDED__)
                  lead = min(lead, floor_div(RIGHT + anchor_of<BAND_BLOCK>(min(m0 + BM - 1, Sq - 1)), BN));
                if (RT >= 1) lead = min(lead, (w.kv_end - 1) / BN);
                if (RT == 2) lead = min(lead, ids_lead.y);
              }
              first = lead == w.j;
              while (ld_acquire(turn) != (w.ff ? w.j - lead : lead - w.j)) {
              }
            }
            if (first) {
              bulk_store(dq_acc + (size_t)blk * (BM * HD), s_dq(buf), DQTILE);
            } else {
              bulk_reduce_add(dq_acc + (size_t)blk * (BM * HD), s_dq(buf), DQTILE);
            }
            asm volatile("cp.async.bulk.commit_group;" ::: "memory");
            // the buffer is free once read; the turn passes once the addition is done
            asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
            mbar_arrive(dq_empty(buf));
            if (ORDERED) {
              asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
              asm volatile("fence.acq_rel.gpu;" ::: "memory");
              red_release_inc(turn);
            }
          }
        }
        g0 += w.n_steps;
      }
      if (lane == 0) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
      return;
    }
    // ---- producer: per item, a ticket; Q, dO, lse, delta per step, K and V once ----
    uint8_t* gk = tmap_slots + (size_t)blockIdx.x * __SLOT_BYTES__;
    uint8_t *gv = gk + 128, *gq = gk + 256, *gdo = gk + 384;
    publish_tmap(gk, tmap_templates, tmap_stage, k, lane);
    publish_tmap(gv, tmap_templates + 128, tmap_stage + 128, v, lane);
    publish_tmap(gq, tmap_templates + 256, tmap_stage + 256, q, lane);
    publish_tmap(gdo, tmap_templates + 384, tmap_stage + 384, dout, lane);
    // the staging buffers, written through the generic proxy, are then written by bulk copies
    if (RT == 2) fence_async_smem_always();
    if (lane != 0) return;
    int g0 = 0;
    for (int n = 0;; ++n) {
      // Taken once the last item's loads are all issued. A CTA waits only on items with a smaller
      // ticket, each already taken by a running CTA: the waits cannot deadlock.
      const int ticket = publish_ticket(n, sem, n_items, s_ticket, item_full(0), item_empty(0));
      if (ticket < 0) break;
      const Item w = item_of(ticket);
      auto load_kv = [&]() {
        if (n >= 1) mbar_wait(kv_empty, (n - 1) & 1);
        mbar_expect_tx(kv_full, 2 * KVTILE);
        tma_load_4d(s_k, gk, kv_full, 0, w.hk, w.n0, w.b);
        tma_load_4d(s_k + BN * 128, gk, kv_full, 64, w.hk, w.n0, w.b);
        tma_load_4d(s_v, gv, kv_full, 0, w.hk, w.n0, w.b);
        tma_load_4d(s_v + BN * 128, gv, kv_full, 64, w.hk, w.n0, w.b);
      };
      // the first steps' Q and dO while the consumers finish the last item, then K and V once
      // they are done with the last item's
      const int first = g0 + min(STAGES, w.n_steps);
      for (int h = w.hk * G; h < (w.hk + 1) * G; ++h)
        for (int ii = 0; ii < w.n_i; ++ii, ++g0) {
          const int s = g0 % STAGES, m0 = block_of(w, ii) * BM;
          if (g0 == first) load_kv();
          if (g0 >= STAGES) mbar_wait(empty(s), ((g0 / STAGES) & 1) ^ 1);
          mbar_expect_tx(full(s), 2 * QTILE + STAT + (RT == 2 ? BM * 4 : 0));
          tma_load_4d(s_q(s), gq, full(s), 0, h, m0, w.b);
          tma_load_4d(s_q(s) + BM * 128, gq, full(s), 64, h, m0, w.b);
          tma_load_4d(s_do(s), gdo, full(s), 0, h, m0, w.b);
          tma_load_4d(s_do(s) + BM * 128, gdo, full(s), 64, h, m0, w.b);
          const size_t row = ((size_t)w.b * H + h) * sq_pad + m0;
          bulk_load(s_stat(s), lse2 + row, BM * 4, full(s));
          bulk_load(s_stat(s) + BM * 4, delta + row, BM * 4, full(s));
          if (RT == 2) bulk_load(s_qid0 + s * BM * 4, rt_q_ids + (size_t)w.b * sq_pad + m0, BM * 4, full(s));
        }
      if (g0 == first) load_kv();  // a walk of STAGES steps or fewer
    }
    return;
  }

  asm volatile("setmaxnreg.inc.sync.aligned.u32 __CONSUMER_REGS__;" ::: "memory");
  // ---- consumers: per item, warpgroup wg owns keys n0 + 64 wg .. + 63 ----
  // warp-uniform (through a shuffle), so that the descriptors can live in uniform registers
  const int wg = __shfl_sync(0xffffffff, warp / 4, 0);
  // K and V as wgmma descriptors: warpgroup wg's 64 keys (K-major), and its 64 head-dim
  // columns of K for dQ (MN-major)
  const uint64_t k_desc = smem_desc(s_k + wg * 64 * 128, 16, 1024);
  const uint64_t v_desc = smem_desc(s_v + wg * 64 * 128, 16, 1024);
  const uint64_t k_mn = smem_desc(s_k + wg * BN * 128, BN * 128, 1024);
  int g0 = 0;  // the CTA's steps before this item
  for (int n = 0;; ++n) {
  const int ticket = next_ticket(n);
  if (ticket < 0) break;
  const Item w = item_of(ticket);
  const int n0 = w.n0;
  const int key0 = n0 + 64 * wg + 16 * (warp % 4) + lane / 4;  // fragment rows: key0 and key0 + 8
  float dvac[64], dkac[64];
#pragma unroll
  for (int e = 0; e < 64; ++e) dvac[e] = dkac[e] = 0.f;
  // segment ids of this thread's two keys
  int key_id[2] = {0, 0};
  if (RT == 2)
    for (int x = 0; x < 2; ++x)
      key_id[x] = key0 + 8 * x < Skv ? __ldg(rt_kv_ids + (size_t)w.b * Skv + key0 + 8 * x) : 0;

  mbar_wait(kv_full, n & 1);
  int g = g0;  // the CTA's step
  for (int hh = 0; hh < G; ++hh)
  for (int ii = 0; ii < w.n_i; ++ii, ++g) {
    const int s = g % STAGES, buf = g & 1, m0 = block_of(w, ii) * BM;
    float st[32], dpt[32], dq[32];
    uint32_t p[16], ds[16];
    // the step's operands as wgmma descriptors, each product's k-slices offsets from them
    const uint64_t q_desc = smem_desc(s_q(s), 16, 1024), do_desc = smem_desc(s_do(s), 16, 1024);
    const uint64_t q_mn = smem_desc(s_q(s), BM * 128, 1024), do_mn = smem_desc(s_do(s), BM * 128, 1024);
    const uint64_t ds_mn = smem_desc(s_ds(buf), BN * 128, 1024);
    mbar_wait(full(s), (g / STAGES) & 1);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) {
      const uint32_t a = (kk >> 2) * BN * 128 + (kk & 3) * 32, bq = (kk >> 2) * BM * 128 + (kk & 3) * 32;
      wgmma_ss_64(st, desc_at(k_desc, a), desc_at(q_desc, bq), kk > 0);
    }
    wgmma_commit();
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) {
      const uint32_t a = (kk >> 2) * BN * 128 + (kk & 3) * 32, bq = (kk >> 2) * BM * 128 + (kk & 3) * 32;
      wgmma_ss_64(dpt, desc_at(v_desc, a), desc_at(do_desc, bq), kk > 0);
    }
    wgmma_commit();
    const float* lse_s = reinterpret_cast<const float*>(smem + (s_stat(s) - s_k));
    const float* delta_s = lse_s + BM;
    // P^T: rows are keys key0 (+8), columns queries m0 + c
    // the thread's keys key0, key0 + 8 inside Skv, and key0 - its first query column
    const bool in_kv[2] = {key0 < w.kv_end, key0 + 8 < w.kv_end};
    const int d0 = key0 - m0 - 2 * (lane % 4), a0 = anchor_of<BAND_BLOCK>(m0);
    const int* q_id_s = reinterpret_cast<const int*>(tmap_stage) + s * BM;  // the step's query ids
    bool edge = n0 + 64 * wg + 63 >= w.kv_end;
    if (LEFT < __UNBOUNDED__) edge |= n0 + 64 * wg < anchor_of<BAND_BLOCK>(m0 + BM - 1) - LEFT;
    if (RIGHT < __UNBOUNDED__) edge |= n0 + 64 * wg + 63 > anchor_of<BAND_BLOCK>(m0) + RIGHT;
    if (RT == 2) edge |= m0 < w.in_lo || m0 + BM > w.in_hi;
    auto dv_product = [&]() {
#pragma unroll
      for (int kk = 0; kk < BM / 16; ++kk) wgmma_rs_128(dvac, p + 4 * kk, desc_at(do_mn, kk * 16 * 128));
    };
    auto dk_product = [&]() {
#pragma unroll
      for (int kk = 0; kk < BM / 16; ++kk) wgmma_rs_128(dkac, ds + 4 * kk, desc_at(q_mn, kk * 16 * 128));
    };
    auto dq_product = [&]() {
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk)
        wgmma_ss_t_64(dq, desc_at(ds_mn, kk * 16 * 128), desc_at(k_mn, kk * 16 * 128), kk > 0);
    };
    // dQ to shared memory for the writer (once it took the buffer's last), in fragment order:
    // warpgroup, then pair of values e / 2, then thread (see dq_from_acc)
    auto store_dq = [&]() {
      if (g >= 2) mbar_wait(dq_empty(buf), ((g >> 1) - 1) & 1);
#pragma unroll
      for (int e = 0; e < 32; e += 2) {
        const uint32_t addr = s_dq(buf) + wg * (DQTILE / 2) + ((e / 2) * 128 + tid % 128) * 8;
        asm volatile("st.shared.v2.f32 [%0], {%1, %2};" :: "r"(addr), "f"(dq[e]), "f"(dq[e + 1]) : "memory");
      }
      fence_async_smem_always();
      __syncwarp();
      if (lane == 0) mbar_arrive(dq_full(buf));
    };
    wgmma_wait<1>();
    fence_regs<32>(st);
#pragma unroll
    for (int e = 0; e < 32; ++e) {
      const int c = (e / 4) * 8 + 2 * (lane % 4) + (e % 2);
      float x = fast_exp2(st[e] * scale_log2 - lse_s[c]);
      if (edge) {
        // key - row as the thread's d0 plus a constant: two compares with immediates (key - the
        // row's anchor where the band is measured from blocks of rows: the step's one anchor a0
        // where the blocks are whole query blocks, else each row's, which ptxas compiles to a
        // branch an element)
        const int d = BAND_BLOCK == 1           ? d0 + 8 * ((e / 2) % 2) - (e / 4) * 8 - (e % 2)
                      : BAND_BLOCK % BM == 0 ? key0 - a0 + 8 * ((e / 2) % 2)
                                             : key0 + 8 * ((e / 2) % 2) - anchor_of<BAND_BLOCK>(m0 + c);
        bool ok = (e / 2) % 2 ? in_kv[1] : in_kv[0];
        if (LEFT < __UNBOUNDED__) ok &= d >= -LEFT;
        if (RIGHT < __UNBOUNDED__) ok &= d <= RIGHT;
        if (RT == 2) ok &= q_id_s[c] == key_id[(e / 2) % 2];
        if (!ok) x = 0.f;
      }
      st[e] = x;
    }
#pragma unroll
    for (int e = 0; e < 32; e += 2) p[e / 2] = pack2(st[e], st[e + 1]);
    // dV is issued before the wait for dP^T: the exponentials it reads then run under dP^T's
    // product (ptxas would hoist a bare wait above them), and dV runs under dS's arithmetic
    wgmma_fence();
    dv_product();
    wgmma_commit();
    wgmma_wait<1>();
    fence_regs<32>(dpt);
#pragma unroll
    for (int e = 0; e < 32; ++e) {
      const int c = (e / 4) * 8 + 2 * (lane % 4) + (e % 2);
      dpt[e] = st[e] * (dpt[e] - delta_s[c]);
    }
#pragma unroll
    for (int e = 0; e < 32; e += 2) ds[e / 2] = pack2(dpt[e], dpt[e + 1]);
    // dS^T to shared memory: row = key (128 of them), 64 query columns = one 128-byte swizzled row.
    // A warp's dS^T is 8 x 8 blocks in the layout stmatrix takes (block (cg, x): its rows 8 x .. + 7,
    // columns 8 cg .. + 7, in ds[2 cg + x]): four blocks an instruction, lane l giving the address
    // of row l % 8 of block l / 8
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int cg = 2 * i + lane / 16, r = 64 * wg + 16 * (warp % 4) + 8 * ((lane / 8) % 2) + lane % 8;
      const uint32_t addr = s_ds(buf) + r * 128 + ((cg ^ (r & 7)) << 4);
      asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};"
                   :: "r"(addr), "r"(ds[4 * i]), "r"(ds[4 * i + 1]), "r"(ds[4 * i + 2]), "r"(ds[4 * i + 3])
                   : "memory");
    }
    fence_async_smem_always();
    // dQ, then dK: dK runs under dQ's store to shared memory
    named_sync(1, 256);  // both warpgroups' dS^T are stored
    wgmma_fence();
    dq_product();
    wgmma_commit();
    dk_product();
    wgmma_commit();
    wgmma_wait<1>();
    fence_regs<64>(dvac);
    fence_regs<32>(dq);
    store_dq();
    wgmma_wait<0>();
    fence_regs<64>(dkac);
    if (lane == 0) mbar_arrive(empty(s));
  }
  // every product reading K and V is complete: the producer may load the next item's
  __syncwarp();
  if (lane == 0) mbar_arrive(kv_empty);
  g0 = g;

  // ---- the item's epilogue: dK (times scale) and dV rows key0, key0 + 8. A quad of lanes holds
  // a row's columns in 4-byte pairs, 8 columns a column group; quad_transpose gives each lane 16
  // bytes of one of 4 column groups, so that a warp stores 64 contiguous bytes of 8 rows at once
  // (the quads' shuffles are the whole warp's: every lane takes part, and stores where key < Skv) ----
#pragma unroll
  for (int x = 0; x < 2; ++x) {
    const int key = key0 + 8 * x;
    const size_t off = (((size_t)w.b * Skv + key) * Hkv + w.hk) * HD + 8 * (lane % 4);
#pragma unroll
    for (int t = 0; t < 4; ++t) {
      uint32_t kw[4], vw[4];  // column groups 4 t .. 4 t + 3
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int e = 4 * (4 * t + c) + 2 * x;
        kw[c] = pack2(dkac[e] * scale, dkac[e + 1] * scale);
        vw[c] = pack2(dvac[e], dvac[e + 1]);
      }
      const uint4 ko = quad_transpose(kw, lane), vo = quad_transpose(vw, lane);
      if (key < Skv) {
        *reinterpret_cast<uint4*>(dk + off + 32 * t) = ko;
        *reinterpret_cast<uint4*>(dv + off + 32 * t) = vo;
      }
    }
  }
  }
}
"""


BWD_RUNTIME_ARRAYS = ("rt_lens", "rt_q_ids", "rt_kv_ids", "rt_ranges", "rt_leads")


KEY_ORDERS = ("last_first", "first_first_at_end", "first_first")


def bwd_source(left: int | None, right: int | None, *, stages: int = 2, dtype: str = "bfloat16",
               ordered: bool = True, runtime: str = "", section_bytes: int = 0,
               key_order: str = "last_first", band_block: int = 1) -> str:
    """The backward kernel's CUDA C++ for the mask ``a(i) - left <= j <= a(i) + right`` (``None``:
    unbounded), ``a(i) = i - i % band_block`` (as in :func:`source.source`).

    ``stages``: depth of the Q/dO ring; ``ordered``: dQ added in a fixed order (bit-identical
    reruns) rather than as it comes (see the module docstring). ``runtime``
    (:data:`source.RUNTIMES`): the runtime mask ANDed with the band, as in the forward; its
    arrays (:data:`BWD_RUNTIME_ARRAYS`, the ids' ranges from
    :func:`jax_bindings._cuda.runtime_tables.bwd_arrays`) follow ``tmap_templates``.
    ``section_bytes``: items are taken in sections of as many (batch, KV head)s as that many
    bytes of their Q and dO hold at the call's ``Sq`` (at least one; 0: one), a key block of
    each in turn. ``key_order`` (:data:`KEY_ORDERS`): the order of a head's key blocks in the
    tickets and in each query block's dQ sum (module docstring).
    """
    source.check_arguments(left, right, stages, dtype, band_block)
    source.check_section_bytes(section_bytes)
    if key_order not in KEY_ORDERS:
        raise ValueError(f"key_order must be one of {KEY_ORDERS}, got {key_order!r}")
    subs = {
        "__BM__": BM, "__BN__": BN, "__D__": D, "__STAGES__": stages, "__LEFT__": source.bound(left),
        "__RIGHT__": source.bound(right), "__BAND_BLOCK__": band_block, "__ORDERED__": str(ordered).lower(),
        "__THREADS__": THREADS,
        "__NAME__": KERNEL_NAME, "__UNBOUNDED__": source.UNBOUNDED,
        "__CONSUMER_WARPS__": source.CONSUMER_WARPS, "__SLOT_BYTES__": SLOT_BYTES,
        "__PRODUCER_REGS__": source.PRODUCER_REGS, "__CONSUMER_REGS__": source.CONSUMER_REGS,
        "__ELEM__": source.ELEMENTS[dtype], "__STAT_BYTES__": STAT_BYTES,
        "__SECTION_BYTES__": section_bytes, "__FIRST_FIRST__": KEY_ORDERS.index(key_order),
        **source.runtime_subs(runtime, BWD_RUNTIME_ARRAYS),
    }
    text = (source.HELPERS + _HELPERS + source.wgmma_ss(64) + source.wgmma_ss(64, transposed=True)
            + source.wgmma_rs(D) + _KERNEL)
    for key, val in subs.items():
        text = text.replace(key, str(val))
    return text


def with_unique_name(text: str) -> tuple[str, str]:
    """``(name, text)``: the kernel renamed ``splat_bwd_<digest>`` (see :func:`source.with_unique_name`)."""
    return source.with_unique_name(text, KERNEL_NAME, "splat_bwd")
