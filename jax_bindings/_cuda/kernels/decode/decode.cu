// Decode: a few query tokens per batch row against a KV cache, reading only the keys the mask
// allows at the tokens' positions (split-KV, flash-decoding). Every warp loads (cp.async) and
// computes; a barrier a tile.
//
// Glossary (constants from the generated "decode_config.cuh", namespace cfg):
//   HEAD_DIM  D, the head dim (a multiple of 16)
//   TOKENS    query tokens per batch row (Sq); GROUP: query heads per KV head (G = H / Hk)
//   ROWS      query rows of a CTA: (token, head) pairs of one KV head, token-major, padded to 16s
//   BLOCK_N   keys a tile; STAGES: tiles in flight
//   WARPS_M x WARPS_N warps: warp (wm, wn) takes rows [16 wm, 16 wm + 16) and the tile's keys
//             [KPW wn, KPW wn + KPW), KPW = BLOCK_N / WARPS_N, each with its own online softmax;
//             the WARPS_N partial results of a row are merged at the end (warp_step.cuh)
//   SEGMENTS  the layout's segments (key_walk.cuh); PAGED / PAGE_SHIFT: kv_rows.cuh
//   IDS       segment ids (a query sees keys of its own id); SOFT_CAP: c in c tanh(z / c), 0: none
//   SPLIT     partial results per split (out_part, lse_part), merged by their log-sum-exp outside;
//             else the output itself
//
// Grid: (splits, B * Hk, row blocks). Parameters, in jaxlib's order (inputs, scalars, outputs):
//   q [B, TOKENS, H, D], k, v (kv_rows.cuh), q_pos [B, TOKENS] (-1: the token sees nothing),
//   kv_len [B], seg_rows [SEGMENTS, 3, L], page_table [B, max_pages], q_ids [B, TOKENS],
//   kv_ids [B, L], id_keys [B, TOKENS, 2] (the keys [lo, hi) a token's id may see: its document
//   where the ids are sorted, else [0, L)) (unused ones are 1-element placeholders);
//   L (layout rows = logical cache length), H, Hk, max_pages, pages, scale * log2(e), scale;
//   SPLIT: out_part f32 [B, TOKENS, H, splits, D], lse_part f32 [B, TOKENS, H, splits];
//   else:  out [B, TOKENS, H, D] (the element type), lse f32 [B, H, TOKENS].
// lse is natural-log, -inf for a row that sees no key (its output is 0).
#include "common/types.cuh"
#include "decode_config.cuh"
#include "common/mma_sm80.cuh"
#include "decode/key_walk.cuh"
#include "decode/kv_rows.cuh"
#include "decode/warp_step.cuh"

using namespace cfg;
using namespace decode;

constexpr int THREADS = 32 * CONSUMERS;
constexpr int CHUNKS = HEAD_DIM / 8;               // 16-byte chunks a row
constexpr int LOADS = BLOCK_N * CHUNKS / THREADS;  // chunks a thread loads a tile, each of K and V
static_assert(BLOCK_N * CHUNKS % THREADS == 0, "a tile's chunks divide among the threads");

struct Shared {
  uint16_t q[ROWS * SROW];
  uint16_t k[STAGES][BLOCK_N * SROW];
  uint16_t v[STAGES][BLOCK_N * SROW];
  int ids[IDS ? STAGES * BLOCK_N : 1];
  SegmentRow rows[TOKENS * SEGMENTS];
  int q_ids[TOKENS];
  KeyWalk<SEGMENTS> walk;
};
static_assert(sizeof(Merge) <= 2 * sizeof(uint16_t) * STAGES * BLOCK_N * SROW, "the merge fits the K/V stages");
static_assert(sizeof(Shared) <= SMEM_BYTES, "the launch's dynamic shared memory holds Shared");

extern "C" __global__ void __launch_bounds__(THREADS) SPLAT_KERNEL_NAME(
    const uint16_t* __restrict__ q, const uint16_t* __restrict__ k, const uint16_t* __restrict__ v,
    const int* __restrict__ q_pos, const int* __restrict__ kv_len, const int* __restrict__ seg_rows,
    const int* __restrict__ page_table, const int* __restrict__ q_ids, const int* __restrict__ kv_ids,
    const int* __restrict__ id_keys, int L, int H, int Hk, int max_pages, int pages, float scale_log2, float scale,
    void* __restrict__ out, float* __restrict__ lse) {
  extern __shared__ __align__(16) uint8_t smem_raw[];
  Shared& sh = *reinterpret_cast<Shared*>(smem_raw);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm = warp / WARPS_N, wn = warp % WARPS_N;
  const int split = blockIdx.x, splits = gridDim.x;
  const int b = blockIdx.y / Hk, hk = blockIdx.y % Hk, row0 = blockIdx.z * ROWS;
  const KvRows<PAGED, PAGE_SHIFT> kv = {page_table, L, Hk, HEAD_DIM, max_pages, pages};

  // Q rows: (token, head) = ((row0 + r) / GROUP, hk * GROUP + (row0 + r) % GROUP); padding rows 0
  for (int c = tid; c < ROWS * CHUNKS; c += THREADS) {
    const int r = c / CHUNKS, gr = row0 + r, t = gr / GROUP;
    const bool real = t < TOKENS;
    const int64_t at = ((static_cast<int64_t>(b) * TOKENS + (real ? t : 0)) * H + hk * GROUP + gr % GROUP)
                       * HEAD_DIM + (c % CHUNKS) * 8;
    cp_async16(smem_u32(sh.q + r * SROW + (c % CHUNKS) * 8), q + at, real ? 16 : 0);
  }
  cp_async_commit();

  if (warp == 0) {
    const int t = min(lane, TOKENS - 1);
    const int pos = lane < TOKENS ? q_pos[b * TOKENS + t] : -1;
    int lo = 0, hi = min(max(kv_len[b], 0), L);
    if constexpr (IDS) {
      lo = max(lo, id_keys[2 * (b * TOKENS + t)]);
      hi = min(hi, id_keys[2 * (b * TOKENS + t) + 1]);
    }
    const KeyWalk<SEGMENTS> w = plan_walk<SEGMENTS, TOKENS, BLOCK_N>(seg_rows, L, pos, lo, hi, sh.rows);
    if (IDS && lane < TOKENS) sh.q_ids[lane] = q_ids[b * TOKENS + lane];
    if (lane == 0) sh.walk = w;
  }
  __syncthreads();
  const KeyWalk<SEGMENTS> walk = sh.walk;
  const int t_begin = static_cast<int>(static_cast<int64_t>(walk.tiles) * split / splits);
  const int t_end = static_cast<int>(static_cast<int64_t>(walk.tiles) * (split + 1) / splits);

  // A thread's row offsets of tile t (a paged cache's are loads, taken an iteration before their
  // copies are issued, so that the page table's latency hides behind a tile's work); -1: no row
  auto offsets = [&](int t, int64_t (&at)[LOADS]) {
    const Tile tile = locate<SEGMENTS, BLOCK_N>(walk, t);
#pragma unroll
    for (int i = 0; i < LOADS; ++i) {
      const int u = (tid + i * THREADS) / CHUNKS;
      at[i] = t < t_end && u < tile.n ? kv.offset(b, tile.first + tile.step * u, hk) : -1;
    }
  };
  // K, V (and key ids) of tile t into stage `slot`; keys past the tile's end and in pages outside
  // the pool are zero-filled (and masked in the step)
  auto issue = [&](int t, int slot, const int64_t (&at)[LOADS]) {
    const Tile tile = locate<SEGMENTS, BLOCK_N>(walk, t);
#pragma unroll
    for (int i = 0; i < LOADS; ++i) {
      const int c = tid + i * THREADS, u = c / CHUNKS, x = (c % CHUNKS) * 8;
      const int n = at[i] >= 0 ? 16 : 0;
      const int64_t src = at[i] >= 0 ? at[i] + x : 0;
      cp_async16(smem_u32(sh.k[slot] + u * SROW + x), k + src, n);
      cp_async16(smem_u32(sh.v[slot] + u * SROW + x), v + src, n);
    }
    if constexpr (IDS) {
      for (int u = tid; u < BLOCK_N; u += THREADS) {
        const int64_t j = u < tile.n ? tile.first + tile.step * u : 0;
        cp_async4(smem_u32(sh.ids + slot * BLOCK_N + u), kv_ids + static_cast<int64_t>(b) * L + j,
                  u < tile.n ? 4 : 0);
      }
    }
  };

  const RowTokens rt = row_tokens(row0, wm, lane);
  WarpAccum acc;
  acc.init();
  int64_t next[LOADS];  // the offsets of the next tile to issue
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    offsets(t_begin + s, next);
    if (t_begin + s < t_end) issue(t_begin + s, s, next);
    cp_async_commit();
  }
  offsets(t_begin + STAGES - 1, next);
  const uint32_t q_addr = smem_u32(sh.q) + q_lane_offset(wm, lane);
  for (int t = t_begin; t < t_end; ++t) {
    const int slot = (t - t_begin) % STAGES;
    cp_async_wait<STAGES - 2>();
    __syncthreads();  // tile t has landed for every thread, and every warp is done with tile t - 1
    if (t + STAGES - 1 < t_end) {
      issue(t + STAGES - 1, (t - t_begin + STAGES - 1) % STAGES, next);
      offsets(t + STAGES, next);
    }
    cp_async_commit();
    const Tile tile = locate<SEGMENTS, BLOCK_N>(walk, t);
    SegmentRow rr[2];
    int qid[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      rr[h] = rt.tok[h] < TOKENS ? sh.rows[rt.tok[h] * SEGMENTS + tile.k] : SegmentRow{0, 0, 1};
      qid[h] = IDS && rt.tok[h] < TOKENS ? sh.q_ids[rt.tok[h]] : 0;
    }
    acc.step(q_addr, smem_u32(sh.k[slot]) + k_lane_offset(wn, lane), smem_u32(sh.v[slot]) + v_lane_offset(wn, lane),
             tile, rr, sh.ids + slot * BLOCK_N, qid, lane, wn, scale_log2, scale);
  }
  cp_async_wait<0>();
  __syncthreads();  // the stages are free: the merge reuses them
  Merge& mg = *reinterpret_cast<Merge*>(sh.k[0]);
  acc.publish(mg, warp, lane);
  __syncthreads();
  store_rows(mg, tid, THREADS, b, hk, row0, H, split, splits, out, lse);
}
