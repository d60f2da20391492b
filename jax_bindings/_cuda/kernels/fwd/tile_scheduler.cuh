// Which work tiles a forward CTA runs, in which order. A work tile is a row block of BM query
// rows (or a grid layout's query patch) of one (batch, head); tiles go longest walk first.
//   STRIDED      one CTA per SM taking every gridDim.x-th tile: with SECTION_BYTES = 0 every
//                (batch, head) interleaved, so that each CTA's static share mixes long and short
//                walks; else in sections, as the queue
//   QUEUE        one CTA per SM taking the next tile by ticket (common/work_tickets.cuh), so that
//                CTAs finishing early take more: in sections of the (batch, head)s whose K and V
//                SECTION_BYTES hold (at least one), a section after another, so the CTAs running
//                at once share the section's K/V in L2; within a section a row block of each head,
//                then the next row block
#pragma once
#include "common/types.cuh"
#include "common/work_tickets.cuh"
#include "fwd/params.cuh"

namespace fwd {

struct TileScheduler {
  int n_row_blocks;  // work tiles of a (batch, head): row blocks, or a grid's patches
  int H, B;
  int section;  // (batch, head)s a section takes
  int n_work;   // work tiles of the kernel

  __device__ __forceinline__ TileScheduler(int n_row_blocks, int H, int B, int Skv)
      : n_row_blocks(n_row_blocks), H(H), B(B),
        section(heads_per_section(SECTION_BYTES, 4LL * HEAD_DIM * max(Skv, 1), H * B)),
        n_work(n_row_blocks * H * B) {}

  // work tile w's place: its row block (returned), head h and batch row b
  __device__ __forceinline__ int place(int w, int& h, int& b) const {
    int mb;
    if (SCHEDULE == STRIDED && SECTION_BYTES == 0) {
      const int hb = w % (H * B);
      mb = n_row_blocks - 1 - w / (H * B);
      h = hb % H;
      b = hb / H;
    } else {
      const int2 at = in_section(w, section, n_row_blocks, H * B);
      mb = at.y;
      h = at.x % H;
      b = at.x / H;
    }
    return mb;
  }
  // STRIDED: the CTA's n-th work tile (-1: none left); the queue's come by ticket
  __device__ __forceinline__ int scheduled(int n) const {
    const int w = SCHEDULE == STRIDED ? (int)blockIdx.x + n * (int)gridDim.x : n;
    return w < n_work ? w : -1;
  }
};

}  // namespace fwd
