// The backward kernel's arguments (bwd.cu's parameters, in one place for its parts), its work item
// and the constants its parts derive from the generated "bwd_config.cuh".
#pragma once
#include "common/band.cuh"
#include "common/types.cuh"
#include "bwd_config.cuh"

namespace bwd {
using namespace cfg;

constexpr uint32_t KVTILE = BN * HD * 2, QTILE = BM * HD * 2, DSTILE = BN * BM * 2, STAT = STAT_BYTES;
constexpr uint32_t DQTILE = BM * HD * 4;  // one step's dQ, fp32
// a tile row's 64-column blocks (HD is the head dim HEAD_DIM padded to whole blocks, TMA filling
// the columns past it with zeros); the head-dim columns of dQ each consumer warpgroup computes
constexpr int COL_BLOCKS = HD / 64, DQ_N = HD / 2;
static_assert(HD % 64 == 0 && HEAD_DIM <= HD && HD - HEAD_DIM < 64 && HEAD_DIM % 16 == 0,
              "tiles are whole 64-column blocks of the head dim");
// How the two consumer warpgroups share a step. Up to 128 columns (narrow), each owns 64 of the
// item's BN = 128 keys: its S^T and dP^T cover all BM queries, and its dK and dV accumulators all
// HD columns (HD values a thread). Wider, those accumulators would not fit in registers: both
// warpgroups take the same BN = 64 keys, each computing S^T and dP^T for half the step's queries
// (QN) and dK and dV for half the columns (KV_N), so P^T goes through shared memory as dS^T does.
constexpr bool WIDE = HD > 128;
constexpr int KEYS_WG = 64, QN = WIDE ? BM / 2 : BM, KV_N = WIDE ? HD / 2 : HD;
static_assert(BN == (WIDE ? KEYS_WG : 2 * KEYS_WG), "an item is 64 keys a warpgroup, or 64 shared");
static_assert(!WIDE || KV_N % 32 == 0, "wide: each warpgroup's columns are whole 32-column halves of blocks");
static_assert(DQ_BUFS == 1 || DQ_BUFS == 2, "dQ leaves through one or two buffers");
// step g's dQ buffer, and how many times the buffers were used before it
__device__ __forceinline__ int dq_buf(int g) { return g & (DQ_BUFS - 1); }
__device__ __forceinline__ int dq_round(int g) { return g >> (DQ_BUFS - 1); }

struct Params {
  const uint16_t* q;
  const uint16_t* k;
  const uint16_t* v;
  const uint16_t* dout;
  const float* lse2;
  const float* delta;
  const uint8_t* tmap_templates;  // K's, V's, Q's and dO's tensor maps, 128 bytes each
  const int* rt_lens;             // runtime mask (null where the variant takes none)
  const int* rt_q_ids;
  const int* rt_kv_ids;
  const int* rt_ranges;
  const int* rt_leads;
  int Sq, Skv, H, Hkv, B;
  float scale_log2, scale;
  uint16_t* dk;
  uint16_t* dv;
  float* dq_acc;
  int* sem;             // the ticket counter, then a turn counter per (batch, head, query block)
  uint8_t* tmap_slots;  // each CTA's SLOT_BYTES of published tensor maps
};

// The thread's place in the CTA
struct Cta {
  int tid, warp, lane;
};

// A work item: key block j (keys n0 .. n0 + BN - 1) of KV head hk of batch row b, taken in its
// head's key order (ff: the first key block first); its walk: n_i query blocks from i_lo (in the
// opposite order: block_of), for each of the group's query heads (n_steps in all). kv_end: the
// batch row's key length; rows [in_lo, in_hi) see every key of the block as far as segment ids go
// (their blocks skip the id test).
struct Item {
  int j, hk, b, n0, i_lo, n_i, n_steps, kv_end, in_lo, in_hi;
  bool ff;
};

}  // namespace bwd
