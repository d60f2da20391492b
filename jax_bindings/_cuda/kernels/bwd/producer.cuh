// The backward's producer (lane 0 of warp CONSUMER_WARPS): per item a ticket (the queue of
// tile_scheduler.cuh), K and V once (TMA), and per step Q and dO (TMA) and the step's BM lse2 and
// delta values (bulk copies) into a ring of STAGES buffers; with segment ids, the step's query ids
// too, into the tensor maps' staging buffers (free once the maps are published). The first steps'
// Q and dO load while the consumers finish the last item, then K and V once they are done with the
// last item's.
#pragma once
#include "common/mbarrier.cuh"
#include "common/tma.cuh"
#include "common/types.cuh"
#include "common/work_tickets.cuh"
#include "bwd/params.cuh"
#include "bwd/shared.cuh"
#include "bwd/tile_scheduler.cuh"

namespace bwd {

__device__ __forceinline__ void produce(const Params& p, const Smem& sm, const ItemScheduler& items,
                                        const Cta& cta) {
  const int lane = cta.lane;
  const int G = items.G, sq_pad = items.sq_pad;
  // the CTA's tensor maps: K, V, Q, dO
  uint8_t* gk = p.tmap_slots + (size_t)blockIdx.x * SLOT_BYTES;
  uint8_t *gv = gk + 128, *gq = gk + 256, *gdo = gk + 384;
  publish_tmap(gk, p.tmap_templates, sm.tmap_stage, p.k, lane);
  publish_tmap(gv, p.tmap_templates + 128, sm.tmap_stage + 128, p.v, lane);
  publish_tmap(gq, p.tmap_templates + 256, sm.tmap_stage + 256, p.q, lane);
  publish_tmap(gdo, p.tmap_templates + 384, sm.tmap_stage + 384, p.dout, lane);
  // the staging buffers, written through the generic proxy, are then written by bulk copies
  if (RT == IDS) fence_proxy_async();
  if (lane != 0) return;
  int g0 = 0;
  for (int n = 0;; ++n) {
    // Taken once the last item's loads are all issued. A CTA waits only on items with a smaller
    // ticket, each already taken by a running CTA: the waits cannot deadlock.
    const int ticket = publish_ticket(n, p.sem, items.n_items, sm.ticket(), sm.item_full(0), sm.item_empty(0));
    if (ticket < 0) break;
    const Item w = items.item_of(ticket, p);
    auto load_kv = [&]() {
      if (n >= 1) mbar_wait(sm.kv_empty(), (n - 1) & 1);
      mbar_expect_tx(sm.kv_full(), 2 * KVTILE);
#pragma unroll
      for (int c = 0; c < COL_BLOCKS; ++c)
        tma_load_4d(sm.k + c * BN * 128, gk, sm.kv_full(), 64 * c, w.hk, w.n0, w.b);
#pragma unroll
      for (int c = 0; c < COL_BLOCKS; ++c)
        tma_load_4d(sm.v + c * BN * 128, gv, sm.kv_full(), 64 * c, w.hk, w.n0, w.b);
    };
    const int first = g0 + min(STAGES, w.n_steps);
    for (int h = w.hk * G; h < (w.hk + 1) * G; ++h)
      for (int ii = 0; ii < w.n_i; ++ii, ++g0) {
        const int s = g0 % STAGES, m0 = items.block_of(w, ii) * BM;
        if (g0 == first) load_kv();
        if (g0 >= STAGES) mbar_wait(sm.empty(s), ((g0 / STAGES) & 1) ^ 1);
        mbar_expect_tx(sm.full(s), 2 * QTILE + STAT + (RT == IDS ? BM * 4 : 0));
#pragma unroll
        for (int c = 0; c < COL_BLOCKS; ++c) tma_load_4d(sm.q(s) + c * BM * 128, gq, sm.full(s), 64 * c, h, m0, w.b);
#pragma unroll
        for (int c = 0; c < COL_BLOCKS; ++c)
          tma_load_4d(sm.dout(s) + c * BM * 128, gdo, sm.full(s), 64 * c, h, m0, w.b);
        const size_t row = ((size_t)w.b * p.H + h) * sq_pad + m0;
        bulk_load(sm.stat(s), p.lse2 + row, BM * 4, sm.full(s));
        bulk_load(sm.stat(s) + BM * 4, p.delta + row, BM * 4, sm.full(s));
        if (RT == IDS) bulk_load(sm.qid0 + s * BM * 4, p.rt_q_ids + (size_t)w.b * sq_pad + m0, BM * 4, sm.full(s));
      }
    if (g0 == first) load_kv();  // a walk of STAGES steps or fewer
  }
}

}  // namespace bwd
