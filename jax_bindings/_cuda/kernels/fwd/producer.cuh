// The forward's producer warpgroup (the warps after the CONSUMER_WARPS, on PRODUCER_REGS registers
// a thread): Q, K and V tiles into shared memory by TMA. One warp publishes this CTA's
// tensor maps (K, V, Q) in its global slot; its lane 0 issues every copy: K and V into a ring of
// STAGES buffers, each completing on its full mbarrier, reused once the consumers release it
// (empty); the Q of each work tile into one of Q_STAGES slots (q_full / q_empty); with segment
// ids, each key tile's ids with its K tile. In the queue schedule the same lane takes the tickets:
// the next one once the current tile's loads are all issued, so that the next tile's loads overlap
// the current one's end.
#pragma once
#include "common/mbarrier.cuh"
#include "common/tma.cuh"
#include "common/types.cuh"
#include "common/wgmma.cuh"
#include "common/work_tickets.cuh"
#include "fwd/mask_grid.cuh"
#include "fwd/params.cuh"
#include "fwd/shared.cuh"
#include "fwd/work.cuh"

namespace fwd {

// kv_ids_stride: elements between rt_kv_ids's rows ([B, Skv] padded to whole tiles)
__device__ __forceinline__ void produce(const Params& p, const Smem& sm, const TileScheduler& sched,
                                        const Cta& cta, const int& kv_ids_stride) {
  const int tid = cta.tid, lane = cta.lane;
  uint8_t* gk = cta.gk;
  regs_dealloc<PRODUCER_REGS>();
  int ring = 0, qn = 0;  // K/V tiles and Q tiles this CTA has loaded so far
  if (tid - CONSUMER_WARPS * 32 >= 32) return;
  uint8_t* gv = gk + 128;
  uint8_t* gq = gk + 256;
  publish_tmap(gk, p.tmap_templates, sm.tmap_stage, p.k, lane);
  publish_tmap(gv, p.tmap_templates + 128, sm.tmap_stage + 128, p.v, lane);
  publish_tmap(gq, p.tmap_templates + 256, sm.tmap_stage + 256, p.q, lane);
  if (lane != 0) return;
  for (int n = 0;; ++n) {
    int w;
    if (SCHEDULE == QUEUE) {
      // the next ticket, taken once the last tile's loads are all issued
      w = publish_ticket(n, p.sem, sched.n_work, sm.ticket(), sm.item_full(0), sm.item_empty(0));
    } else {
      w = sched.scheduled(n);
    }
    if (w < 0) break;
    const Work x = work_of(w, sched, p);
    if (x.n_tiles == 0) continue;  // the consumers write its rows without a walk
    const int hkv = x.h / (p.H / p.Hkv);
    // Q slot qb, used qn / Q_STAGES times before: free once the consumers released it
    const int qb = qn % Q_STAGES, uses = qn / Q_STAGES;
    const uint32_t dst = sm.q + qb * QBYTES;
    if (uses > 0) mbar_wait(sm.q_empty(qb), (uses - 1) & 1);
    mbar_expect_tx(sm.q_full(qb), QBYTES);
#pragma unroll
    for (int c = 0; c < COL_BLOCKS; ++c) {
      if (GRID) {
        tma_load_5d(dst + c * BM * 128, gq, sm.q_full(qb), 64 * c, x.h, x.gq[2], x.gq[1],
                    x.b * GN0 + x.gq[0]);
      } else {
        tma_load_4d(dst + c * BM * 128, gq, sm.q_full(qb), 64 * c, x.h, x.m0, x.b);
      }
    }
    ++qn;
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
#pragma unroll
        for (int c = 0; c < COL_BLOCKS; ++c) {
          if (GRID) {
            tma_load_5d(dst + c * BN * 128, map, bar, 64 * c, hkv, c2, c1, c4);
          } else {
            tma_load_4d(dst + c * BN * 128, map, bar, 64 * c, hkv, n0, x.b);
          }
        }
      };
      if (ring >= STAGES) mbar_wait(sm.empty_k(s), parity);
      mbar_expect_tx(sm.full_k(s), TILE + (RT == IDS ? BN * 4 : 0));
      load(sm.k + s * TILE, gk, sm.full_k(s));
      if (RT == IDS)
        bulk_load(sm.ids + s * BN * 4, p.rt_kv_ids + (size_t)x.b * kv_ids_stride + n0, BN * 4, sm.full_k(s));
      if (ring >= STAGES) mbar_wait(sm.empty_v(s), parity);
      mbar_expect_tx(sm.full_v(s), TILE);
      load(sm.v + s * TILE, gv, sm.full_v(s));
    }
  }
}

}  // namespace fwd
