// A work tile from its index: its place (the tile scheduler), then the rows it holds and the key
// tiles its walk takes, from the band and runtime masks or from the grid's patch.
#pragma once
#include "fwd/mask.cuh"
#include "fwd/mask_grid.cuh"
#include "fwd/params.cuh"
#include "fwd/tile_scheduler.cuh"

namespace fwd {

__device__ __forceinline__ Work work_of(int w, const TileScheduler& sched, const Params& p) {
  Work x;
  const int mb = sched.place(w, x.h, x.b);
  x.m0 = mb * BM;
  if (GRID) {
    grid_work(x, mb, p);
    return x;
  }
  band_work(x, mb, sched.n_row_blocks, p);
  return x;
}

}  // namespace fwd
