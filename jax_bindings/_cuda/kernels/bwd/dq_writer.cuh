// The backward's dQ writers (lane 0 of warps CONSUMER_WARPS + 1 .. + DQ_BUFS). dQ is a sum over
// key blocks, so CTAs add their part to an fp32 buffer in global memory: the consumers leave each
// step's dQ in one of DQ_BUFS shared-memory buffers (in fragment order; one where the head dim
// leaves no room for two), and the writer of that buffer adds the block with one bulk reduction
// while they go on; writer b takes the steps g with g % DQ_BUFS = b (steps counted over the CTA's
// items).
//
// With ORDERED the additions to one query block come in a fixed order, the key order, each waiting
// on a per-block counter (in sem) for its turn: the result is bit-identical from run to run. The
// first key block in that order stores its part instead of adding it, so that dq_acc needs no
// zeroing (query blocks that no key block reaches are never written). A writer passes the turn on
// once its addition is complete; with two writers, one step's addition completes while the next
// one's waits for its turn. An item waits only on items with a smaller ticket, each taken by a CTA
// already running, so the waits cannot deadlock. Without ORDERED, parts are added in any order
// (not reproducible bit for bit).
#pragma once
#include "common/mbarrier.cuh"
#include "common/tma.cuh"
#include "common/types.cuh"
#include "bwd/mask.cuh"
#include "bwd/params.cuh"
#include "bwd/shared.cuh"
#include "bwd/tile_scheduler.cuh"

namespace bwd {

__device__ __forceinline__ int ld_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void red_release_inc(int* p) {
  asm volatile("red.release.gpu.global.add.s32 [%0], 1;" :: "l"(p) : "memory");
}

__device__ __forceinline__ void write_dq(const Params& p, const Smem& sm, const ItemScheduler& items,
                                         const Cta& cta) {
  const int warp = cta.warp, lane = cta.lane;
  const int buf = warp - CONSUMER_WARPS - 1;
  static_assert(DQ_BUFS <= 2, "two writer warps");
  const int G = items.G, nq = items.nq, nkv = items.nkv;
  int g0 = 0;  // the CTA's steps before this item
  for (int n = 0;; ++n) {
    const int ticket = next_ticket(n, sm);
    if (ticket < 0) break;
    const Item w = items.item_of(ticket, p);
    if (lane == 0) {
      // step t of the item: query head hk G + hh, query block i_lo + ii
      int t = dq_buf(g0 + buf), hh = 0, ii = t;
      if (ii >= w.n_i) ii = 0, hh = 1;
      for (; t < w.n_steps; t += DQ_BUFS) {
        const int g = g0 + t, i = items.block_of(w, ii), m0 = i * BM, blk = (w.b * p.H + w.hk * G + hh) * nq + i;
        int* turn = p.sem + 1 + blk;
        ii += DQ_BUFS;
        while (ii >= w.n_i) ii -= w.n_i, ++hh;
        mbar_wait(sm.dq_full(buf), dq_round(g) & 1);
        bool first = false;  // ordered: the first part of the block's sum is stored, not added
        if (ORDERED) {
          const int lead = lead_block(w, i, m0, nkv, nq, p);
          first = lead == w.j;
          while (ld_acquire(turn) != (w.ff ? w.j - lead : lead - w.j)) {
          }
        }
        if (first) {
          bulk_store(p.dq_acc + (size_t)blk * (BM * HD), sm.dq(buf), DQTILE);
        } else {
          bulk_reduce_add(p.dq_acc + (size_t)blk * (BM * HD), sm.dq(buf), DQTILE);
        }
        bulk_commit();
        // the buffer is free once read; the turn passes once the addition is done
        bulk_wait_read<0>();
        mbar_arrive(sm.dq_empty(buf));
        if (ORDERED) {
          bulk_wait<0>();
          asm volatile("fence.acq_rel.gpu;" ::: "memory");
          red_release_inc(turn);
        }
      }
    }
    g0 += w.n_steps;
  }
  if (lane == 0) bulk_wait<0>();
}

}  // namespace bwd
