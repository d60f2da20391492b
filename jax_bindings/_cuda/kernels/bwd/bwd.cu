// Attention backward for Hopper (sm_90a): the gradients of fwd.cu's forward, one kernel per mask
// form.
//
// A work item is BN = 128 keys of one (batch, KV head) (64 where the head dim runs wide:
// params.cuh) (tile_scheduler.cuh: taken by ticket, one CTA per SM); its walk is the query blocks
// of BM = 64 rows that see any of them (mask.cuh), for every query head of its GQA group. Warps 0-7 are two consumer warpgroups (mainloop.cuh, with the
// epilogue of epilogue.cuh); warp 8 is the producer (producer.cuh): K and V once per item, Q, dO,
// lse2 and delta per step into a ring of STAGES buffers; warps 9 (and 10) write dQ (dq_writer.cuh).
//
// Glossary (constants from the generated "bwd_config.cuh", namespace cfg; Elem: Bf16 or Fp16):
//   BM, BN         query rows of a step, keys of an item
//   HEAD_DIM, HD   the head dim, and the tiles' columns: it padded to whole 64-column blocks
//   SOFT_CAP       c in c tanh(s scale / c) (0: none); dS is scaled by its derivative
//   STAGES         Q/dO buffers in flight; DQ_BUFS: dQ buffers (dq_writer.cuh)
//   LEFT, RIGHT, BAND_BLOCK, UNBOUNDED   the band (common/band.cuh); RT: the runtime mask
//   ORDERED        dQ added in a fixed order: bit-identical reruns (dq_writer.cuh)
//   FIRST_FIRST, SECTION_BYTES   the key order and the heads' sections (tile_scheduler.cuh)
//   STAT_BYTES     shared memory of one step's lse2 and delta
//   THREADS, CONSUMER_WARPS, CONSUMER_REGS, PRODUCER_REGS, SLOT_BYTES   the CTA's warps, their
//                  registers, and the global memory of a CTA's tensor maps
//
// Parameters, in jaxlib's order: q, dout [B, Sq, H, D], k, v [B, Skv, Hkv, D] (Elem), lse2
// [B, H, Sq_pad] (the forward's lse times log2(e); +inf on a row with no key and on the padding to
// Sq_pad, a multiple of BM), delta [B, H, Sq_pad] (rowsum(dout * out), 0 on the padding),
// tmap_templates (K's, V's, Q's and dO's tensor maps), the runtime mask's arrays
// (SPLAT_BWD_TABLES), Sq, Skv, H, Hkv, B, scale * log2(e), scale; dk, dv like k, v (dk times scale),
// dq_acc (fp32, [B, H, query blocks, BM * D], each block in the consumers' fragment order), sem
// (int32, zeroed before the launch: a ticket counter, then a turn counter per (batch, head, query
// block)), tmap_slots (SLOT_BYTES a CTA).
#include "common/types.cuh"
#include "bwd_config.cuh"
#include "common/mbarrier.cuh"
#include "bwd/dq_writer.cuh"
#include "bwd/mainloop.cuh"
#include "bwd/params.cuh"
#include "bwd/producer.cuh"
#include "bwd/shared.cuh"
#include "bwd/tile_scheduler.cuh"

using namespace cfg;
using namespace bwd;

extern "C" __global__ void __launch_bounds__(THREADS, 1) SPLAT_KERNEL_NAME(
    const uint16_t* __restrict__ q, const uint16_t* __restrict__ k, const uint16_t* __restrict__ v,
    const uint16_t* __restrict__ dout, const float* __restrict__ lse2, const float* __restrict__ delta,
    const uint8_t* __restrict__ tmap_templates, SPLAT_BWD_TABLES int Sq, int Skv, int H, int Hkv, int B,
    float scale_log2, float scale, uint16_t* __restrict__ dk, uint16_t* __restrict__ dv,
    float* __restrict__ dq_acc, int* __restrict__ sem, uint8_t* __restrict__ tmap_slots) {
  SPLAT_BWD_NO_TABLES
  const Params p = {q,  k,   v, dout, lse2, delta,      tmap_templates, rt_lens, rt_q_ids, rt_kv_ids, rt_ranges,
                    rt_leads,   Sq,  Skv, H, Hkv,  B,    scale_log2, scale, dk,      dv,       dq_acc,    sem,
                    tmap_slots};
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  const Smem sm = Smem::at(smem_raw);

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  if (tid == 0) {
    mbar_init(sm.kv_full(), 1);
    mbar_init(sm.kv_empty(), CONSUMER_WARPS);
    for (int buf = 0; buf < 2; ++buf) {
      mbar_init(sm.dq_full(buf), CONSUMER_WARPS);
      mbar_init(sm.dq_empty(buf), 1);
      mbar_init(sm.item_full(buf), 1);
      mbar_init(sm.item_empty(buf), CONSUMER_WARPS + DQ_BUFS);  // consumer warps and the dQ writers
    }
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(sm.full(s), 1);
      mbar_init(sm.empty(s), CONSUMER_WARPS);
    }
  }
  __syncthreads();
  const ItemScheduler items(p);
  const Cta cta = {tid, warp, lane};

  if (warp >= CONSUMER_WARPS) {
    regs_dealloc<PRODUCER_REGS>();
    if (warp > CONSUMER_WARPS + DQ_BUFS) return;
    if (warp > CONSUMER_WARPS) {
      write_dq(p, sm, items, cta);
      return;
    }
    produce(p, sm, items, cta);
    return;
  }
  consume(p, sm, items, cta);
}
