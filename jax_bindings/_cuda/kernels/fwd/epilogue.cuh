// The forward's epilogue: a work tile's out = o / sum (0 on a row with no key) in the element type,
// and lse = max * scale + log(sum) (natural log; -inf on a row with no key), per consumer thread's
// two rows.
//   registers  each thread stores its values (two 4-byte pairs a column group)
//   O_TMA      after a walk, each warpgroup writes its 64 rows into its half of the work tile's Q
//              slot (in the layout Q came in: the stores of a warp hit every bank once), then one
//              TMA store of those rows a 64-column block (rows past Sq and columns past the
//              head dim are clipped); the slot goes back to the producer once the stores have
//              read it: after the next walk's first products with two Q slots, at once with one.
//              A tile that walked nothing holds no Q slot: its rows are stored from registers.
// The rows' writes close the consumers' work-tile loop (mainloop.cuh), next to the accumulators
// they read; here is the Q slot's bookkeeping and the TMA store.
#pragma once
#include "common/mbarrier.cuh"
#include "common/tma.cuh"
#include "common/types.cuh"
#include "common/wgmma.cuh"
#include "fwd/params.cuh"
#include "fwd/shared.cuh"

namespace fwd {

// A view of the main loop's registers: the Q slot of the last work tile, which that tile's out is
// being stored from (O_TMA; -1: none), released to the producer once the store has read it: by the
// warpgroup's thread 0, after the next walk's first products are issued (the read is long done by
// then); the thread's warpgroup and its thread in it.
struct Epilogue {
  int& o_slot;
  const int& wg;
  const int& wt;
  uint8_t* const& go;  // out's tensor map
  const Smem& sm;

  __device__ __forceinline__ void release_stored_q() const {
    if (O_TMA && wt == 0 && o_slot >= 0) {
      bulk_wait_read<0>();
      mbar_arrive(sm.q_empty(o_slot));
      o_slot = -1;
    }
  }

  // the Q slot the out of the CTA's qn-th work tile is staged in (O_TMA)
  __device__ __forceinline__ uint32_t out_slot(const int& qn) const {
    return sm.q + ((qn + Q_STAGES - 1) % Q_STAGES) * QBYTES;
  }

  // O_TMA, after a walk: the warpgroup's rows of work tile x, written into its half of the tile's Q
  // slot, go out by TMA (a box of 64 columns each); qn: the Q tiles the CTA has taken so far (this
  // tile's the last)
  __device__ __forceinline__ void store_staged(const Work& x, const int& qn) const {
    const uint32_t s_o = out_slot(qn);
    fence_proxy_async();
    named_sync(1 + wg, 128);
    if (wt == 0) {
      const int m = x.m0 + 64 * wg;
#pragma unroll
      for (int c = 0; c < COL_BLOCKS; ++c)
        tma_store_4d(go, s_o + c * BM * 128 + 64 * wg * 128, 64 * c, x.h, m, x.b);
      bulk_commit();
      o_slot = (qn + Q_STAGES - 1) % Q_STAGES;
    }
    // with one Q slot the next tile's Q waits for it: released now
    if (Q_STAGES == 1) release_stored_q();
  }

  // the last stores are complete before the CTA's shared memory goes
  __device__ __forceinline__ void finish() const {
    if (O_TMA && wt == 0) bulk_wait<0>();
  }
};

}  // namespace fwd
