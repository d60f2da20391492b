// Attention forward for Hopper (sm_90a), one kernel per mask form and schedule.
//
// A work tile is BM = 128 query rows of one (batch, head) (tile_scheduler.cuh: which CTA runs which,
// in which order); the CTA running it walks the key tiles of BN keys its rows can see (mask.cuh,
// mask_grid.cuh). Warps 0-7 are two consumer warpgroups of 64 rows each (mainloop.cuh, with the
// online softmax of softmax.cuh and the epilogue of epilogue.cuh); warps 8-11 are the producer
// warpgroup (producer.cuh), which loads K and V tiles into a ring of STAGES buffers. Tiles are
// stored in 64-column blocks of 128-byte rows, 128-byte swizzled (common/wgmma.cuh). The online
// softmax is in base 2, with scale * log2(e) applied in fp32; tiles inside every row's keys skip
// the mask; out-of-range keys are zero-filled and masked.
//
// Glossary (constants from the generated "fwd_config.cuh", namespace cfg; Elem: Bf16 or Fp16):
//   BM, BN         query rows of a work tile, keys of a key tile
//   HEAD_DIM, HD   the head dim, and the tiles' columns: it padded to whole 64-column blocks
//   SOFT_CAP       c in c tanh(s scale / c), applied to the scores before the mask (0: none)
//   STAGES         K/V tiles in flight; Q_STAGES: Q tiles (2: the next work tile's Q and first K/V
//                  tiles load while the consumers still walk the current one)
//   LEFT, RIGHT, BAND_BLOCK, UNBOUNDED   the band (common/band.cuh)
//   RT, SHIFTED    the runtime mask and queries at run-time positions (mask.cuh)
//   GRID, G*, QT*, KT*, GP*   a grid layout's tiles instead of the band (mask_grid.cuh)
//   SCHEDULE, SECTION_BYTES   how CTAs get work tiles (tile_scheduler.cuh)
//   O_TMA          out stored by TMA from the Q tile (epilogue.cuh)
//   THREADS, CONSUMER_WARPS, CONSUMER_REGS, PRODUCER_REGS   the CTA's threads, its consumer warps
//                  (the others are the producer's), and their registers (setmaxnreg: a CTA of
//                  12 warps starts at 168 a thread)
//   BAR_BYTES, MAP_STAGE_BYTES, SLOT_BYTES   shared memory of the mbarriers and tickets, of the
//                  tensor maps' staging buffers; global memory of a CTA's tensor maps
//
// Parameters, in jaxlib's order (the array inputs, the scalars, then the array outputs):
//   q [B, Sq, H, D], k, v [B, Skv, Hkv, D] (Elem; GQA by H / Hkv), tmap_templates (K's, V's, Q's
//   and, with O_TMA, out's tensor maps, encoded on the host), the runtime mask's arrays or the
//   grid's tables (SPLAT_FWD_TABLES), Sq, Skv, H, Hkv, B, scale * log2(e); out [B, Sq, H, D]
//   (Elem), lse [B, H, Sq] (fp32, natural log; -inf and out = 0 on a row with no key), sem (one
//   int32: the queue's ticket counter, zeroed before the launch; no other schedule reads it),
//   tmap_slots (SLOT_BYTES a CTA: the tensor maps it publishes).
#include "common/types.cuh"
#include "fwd_config.cuh"
#include "common/mbarrier.cuh"
#include "common/tma.cuh"
#include "fwd/mainloop.cuh"
#include "fwd/params.cuh"
#include "fwd/producer.cuh"
#include "fwd/shared.cuh"
#include "fwd/tile_scheduler.cuh"

using namespace cfg;
using namespace fwd;

extern "C" __global__ void __launch_bounds__(THREADS, 1) SPLAT_KERNEL_NAME(
    const uint16_t* __restrict__ q, const uint16_t* __restrict__ k,
    const uint16_t* __restrict__ v, const uint8_t* __restrict__ tmap_templates,
    SPLAT_FWD_TABLES int Sq, int Skv, int H, int Hkv, int B, float scale_log2,
    uint16_t* __restrict__ out, float* __restrict__ lse, int* __restrict__ sem,
    uint8_t* __restrict__ tmap_slots) {
  SPLAT_FWD_NO_TABLES
  const Params p = {q,  k,   v, tmap_templates, rt_lens,    rt_q_ids, rt_kv_ids, rt_ranges, grid_tables,
                    Sq, Skv, H, Hkv,            B,          scale_log2, out,   lse,       sem,       tmap_slots};
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  const Smem sm = Smem::at(smem_raw);
  const int kv_ids_stride = (Skv + BN - 1) / BN * BN;  // rt_kv_ids is [B, Skv] padded to whole tiles

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const TileScheduler sched(GRID ? GP0 * GP1 * GP2 : (Sq + BM - 1) / BM, H, B, Skv);

  // this CTA's tensor maps: K, V, Q, out (128 bytes each)
  const size_t cta_index = ((size_t)blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
  uint8_t* gk = tmap_slots + cta_index * SLOT_BYTES;
  uint8_t* go = gk + 384;
  // out's map, published before the CTA's first barrier by consumer warp 0 (the producer warp
  // publishes the others); the thread of each warpgroup that stores acquires it after the barrier
  if (O_TMA && warp == 0) publish_tmap(go, tmap_templates + 384, sm.tmap_stage + 384, out, lane);
  if (tid == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(sm.full_k(s), 1);
      mbar_init(sm.full_v(s), 1);
      mbar_init(sm.empty_k(s), CONSUMER_WARPS);
      mbar_init(sm.empty_v(s), CONSUMER_WARPS);
    }
    for (int slot = 0; slot < 2; ++slot) {
      mbar_init(sm.q_full(slot), 1);
      mbar_init(sm.q_empty(slot), O_TMA ? 2 : CONSUMER_WARPS);
      mbar_init(sm.item_full(slot), 1);
      mbar_init(sm.item_empty(slot), CONSUMER_WARPS);
    }
  }
  __syncthreads();

  const Cta cta = {tid, warp, lane, gk, go};
  if (warp >= CONSUMER_WARPS) {
    produce(p, sm, sched, cta, kv_ids_stride);
  } else {
    consume(p, sm, sched, cta);
  }
}
