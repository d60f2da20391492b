// The forward's consumer warpgroups (warps 0 .. CONSUMER_WARPS - 1, on CONSUMER_REGS registers a
// thread): warpgroup wg owns rows m0 + 64 wg .. + 63 of each work tile.
//
// S = Q K^T and O += P V with wgmma (m64nNk16, fp32 accumulators): Q and K from shared memory
// through matrix descriptors, P from registers (the fp32 accumulator fragment of S is, element for
// element, the A fragment of the next product once rounded), V from shared memory read MN-major:
// its descriptor has the 64-column block stride (BN * 128 bytes) as its leading offset and 8 keys
// (1024 bytes) as its stride.
// Each warpgroup issues Q K^T of tile t with P V of tile t - 1 and runs the softmax of t under
// P V of t - 1. The two warpgroups take turns issuing (ping-pong; named barriers 3 and 4): the
// turns run on across work tiles; warpgroup 1 hands warpgroup 0 the first turn once, before the
// CTA's first walk, and each warpgroup passes the turn after its last P V too, so that warpgroup 0
// issues the next tile's first products while warpgroup 1 finishes its epilogue; warpgroup 0
// takes the one turn left over when the CTA has no more work. Q comes by TMA from the producer.
// A K stage is released once its product is complete (before the softmax); with segment ids,
// once the softmax has read the stage's key ids too (after it).
#pragma once
#include "common/convert.cuh"
#include "common/cp_async.cuh"
#include "common/mbarrier.cuh"
#include "common/tma.cuh"
#include "common/types.cuh"
#include "common/wgmma.cuh"
#include "common/work_tickets.cuh"
#include "fwd/epilogue.cuh"
#include "fwd/mask.cuh"
#include "fwd/mask_grid.cuh"
#include "fwd/params.cuh"
#include "fwd/shared.cuh"
#include "fwd/softmax.cuh"
#include "fwd/tile_scheduler.cuh"
#include "fwd/work.cuh"

namespace fwd {

__device__ __forceinline__ void consume(const Params& p, const Smem& sm, const TileScheduler& sched,
                                        const Cta& cta) {
  regs_alloc<CONSUMER_REGS>();
  const int tid = cta.tid, warp = cta.warp, lane = cta.lane;
  // warp-uniform (through a shuffle), so that what derives from it can live in uniform registers
  const int wg = __shfl_sync(0xffffffff, warp / 4, 0), wt = tid % 128;
  int o_slot = -1;  // O_TMA: the Q slot out is being stored from (epilogue.cuh)
  if (O_TMA && wt == 0) tmap_acquire(cta.go);
  const Epilogue epilogue = {o_slot, wg, wt, cta.go, sm};
  // the current work tile's first row and key tile, this thread's two rows (grid: their tokens,
  // Sq for a patch's rows past the grid); its band mask's registers (mask.cuh)
  int m0 = 0, t0 = 0, rows[2] = {0, 0};
  int kv_end = p.Skv, in_lo = 0, in_hi = p.Skv, row_id[2] = {0, 0};
  int shift = 0;
  // its grid mask's registers (mask_grid.cuh)
  int gfirst[3] = {0, 0, 0}, gnt[3] = {1, 1, 1}, glo[3] = {0, 0, 0}, ghi[3] = {0, 0, 0};
  int2 win[2][3] = {};
  GridBits gbits[3][2];
  int gbits_at[3] = {-1, -1, -1};
  int gtile[3] = {0, 0, 0};
  float o[HD / 2], sc[SN];  // o: the thread's HD / 2 outputs of its two rows; sc: its BN / 2 scores
  uint32_t pk[SN / 2];  // P: sc rounded to the element type, the A fragment of P V
  float mx[2], sum[2], corr[2];
  const BandMask band = {m0, t0, rows, kv_end, in_lo, in_hi, row_id, shift, sc, sm, lane};
  const OnlineSoftmax<SN> smx = {sc, mx, sum, corr, p.scale_log2};
  const SoftCap<SN> cap = SoftCap<SN>::of(sc, p.scale_log2);

  auto turn_wait = [&]() { named_sync(3 + wg, 256); };
  auto turn_pass = [&]() { named_arrive<256>(3 + (wg ^ 1)); };
  // the current work tile's Q slot (set per work tile)
  uint64_t q_desc = smem_desc(sm.q + wg * 64 * 128, 16, 1024);
  bool gedge = false;
  const GridMask grid = {gfirst, gnt, glo, ghi, win, gbits, gbits_at, gtile, gedge, sc, lane};
  auto qk = [&](int s) {
    const uint64_t k_desc = smem_desc(sm.k + s * TILE, 16, 1024);
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) {
      const uint64_t da = desc_at(q_desc, (kk >> 2) * BM * 128 + (kk & 3) * 32);
      const uint64_t db = desc_at(k_desc, (kk >> 2) * BN * 128 + (kk & 3) * 32);
      wgmma_ss<Elem, BN>(sc, da, db, kk > 0);
    }
  };
  auto pv = [&](int s) {
    const uint64_t v_desc = smem_desc(sm.v + s * TILE, BN * 128, 1024);
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) wgmma_rs<Elem, HD>(o, pk + 4 * kk, desc_at(v_desc, kk * 16 * 128));
  };
  auto grid_mask = [&]() {
    if (GRID) grid.next_tile();
  };
  // mask, running max and sum; sc becomes exp2(s * scale_log2 - max), corr the rescale of o
  // (tile t in stage s)
  auto softmax = [&](int t, int s) {
    cap.apply();
    if (GRID) {
      grid.apply();
    } else {
      band.apply(t, s);
    }
    smx.update();
  };
  auto release_k = [&](int s, bool after_softmax) {
    if (after_softmax != (RT == IDS)) return;
    if (RT == IDS) __syncwarp();
    if (lane == 0) mbar_arrive(sm.empty_k(s));
  };
  auto to_p = [&]() {
#pragma unroll
    for (int i = 0; i < SN; i += 2) pk[i / 2] = pack2<Elem>(sc[i], sc[i + 1]);
  };

  int n = 0;              // work tiles this CTA has taken so far
  int ring = 0, qn = 0;  // K/V tiles and Q tiles this CTA has consumed so far
  auto stage = [&](int t) { return (ring + t) % STAGES; };
  auto phase = [&](int t) { return ((ring + t) / STAGES) & 1; };
  for (;; ++n) {
    const int w = SCHEDULE == QUEUE ? read_ticket(n, sm.ticket(), sm.item_full(0), sm.item_empty(0))
                                    : sched.scheduled(n);
    if (w < 0) break;
    const Work x = work_of(w, sched, p);
    m0 = x.m0;
    t0 = x.t0;
    rows[0] = m0 + 64 * wg + 16 * (warp % 4) + lane / 4;  // fragment rows r and r + 8 of the warp's 16
    rows[1] = rows[0] + 8;
    if (GRID) grid.start(x, m0, rows, p);
    band.start(x, p);
#pragma unroll
    for (int i = 0; i < HD / 2; ++i) o[i] = 0.f;
    smx.reset();
    // a row block that sees no key skips the walk (the same in every warp: no barrier is left
    // waiting); its rows still get out = 0 and lse = -inf
    const int n_tiles = x.n_tiles;
    if (n_tiles > 0) {
      const int qb = qn % Q_STAGES;
      q_desc = smem_desc(sm.q + qb * QBYTES + wg * 64 * 128, 16, 1024);
      mbar_wait(sm.q_full(qb), (qn / Q_STAGES) & 1);
      if (wg == 1 && qn == 0) named_arrive<256>(3);
      // products of tile t issued with P V of tile t - 1; softmax of t runs under P V of t - 1
      mbar_wait(sm.full_k(stage(0)), phase(0));
      turn_wait();
      wgmma_fence();
      qk(stage(0));
      wgmma_commit();
      turn_pass();
      epilogue.release_stored_q();
      grid_mask();
      wgmma_wait<0>();
      fence_regs<SN>(sc);
      release_k(stage(0), false);
      softmax(0, stage(0));
      release_k(stage(0), true);
      to_p();
      for (int t = 1; t < n_tiles; ++t) {
        const int s = stage(t), sp = stage(t - 1);
        mbar_wait(sm.full_k(s), phase(t));
        mbar_wait(sm.full_v(sp), phase(t - 1));
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
        fence_regs<HD / 2>(o);
        if (lane == 0) mbar_arrive(sm.empty_v(sp));
        smx.rescale(o);
        to_p();
      }
      // every product reading Q is complete: the producer may load the next work tile's (with
      // O_TMA, once out is stored from the slot)
      if (!O_TMA && lane == 0) mbar_arrive(sm.q_empty(qn % Q_STAGES));
      const int sl = stage(n_tiles - 1);
      mbar_wait(sm.full_v(sl), phase(n_tiles - 1));
      turn_wait();
      wgmma_fence();
      pv(sl);
      wgmma_commit();
      turn_pass();
      wgmma_wait<0>();
      fence_regs<HD / 2>(o);
      if (lane == 0) mbar_arrive(sm.empty_v(sl));
      ring += n_tiles;
      ++qn;
    }
    // ---- epilogue: out = o / sum (0 on a row with no key), lse = m * scale + log(sum) ----
    smx.reduce_sums();
    const float ln2 = SPLAT_LN2;
    const bool staged = O_TMA && n_tiles > 0;
    const uint32_t s_o = epilogue.out_slot(qn);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int row = rows[i];
      if (row >= p.Sq && !staged) continue;
      if (row >= x.q_end || row < x.q_first) sum[i] = 0.f;  // padding or no position: out = 0, lse = -inf
      const float inv = sum[i] > 0.f ? 1.f / sum[i] : 0.f;
      if (staged) {
        const int r = 64 * wg + 16 * (warp % 4) + lane / 4 + 8 * i;  // the row in the tile
#pragma unroll
        for (int e = 2 * i; e < HD / 2; e += 4)
          st_shared32(s_o + swz(r, e / 4, BM) + 4 * (lane % 4), pack2<Elem>(o[e] * inv, o[e + 1] * inv));
      } else {
        uint16_t* orow = p.out + (((size_t)x.b * p.Sq + row) * p.H + x.h) * HEAD_DIM;
#pragma unroll
        for (int e = 2 * i; e < HD / 2; e += 4) {
          const int col = (e / 4) * 8 + 2 * (lane % 4);
          if (HEAD_DIM < HD && col >= HEAD_DIM) continue;  // a padding column
          *reinterpret_cast<uint32_t*>(orow + col) = pack2<Elem>(o[e] * inv, o[e + 1] * inv);
        }
      }
      if (lane % 4 == 0 && row < p.Sq)
        p.lse[((size_t)x.b * p.H + x.h) * p.Sq + row] =
            sum[i] > 0.f ? mx[i] * p.scale_log2 * ln2 + logf(sum[i]) : SPLAT_NEG_INF;
    }
    if (staged) epilogue.store_staged(x, qn);
  }
  epilogue.finish();
  if (wg == 0 && qn > 0) named_sync(3, 256);  // warpgroup 1's last pass
}

}  // namespace fwd
