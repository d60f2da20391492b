// The backward kernel's shared memory, from its 1 KiB aligned base: K and V of the item, STAGES
// buffers of a step's Q and dO, two dS^T buffers (and, WIDE, two P^T buffers), DQ_BUFS buffers of
// a step's dQ (fp32, in fragment order: jax_bindings/_cuda/bwd_source.py's dq_from_acc), STAGES
// of a step's lse and delta, the
// mbarriers and the ticket slots, then four tensor-map staging buffers of 128 bytes (K, V, Q, dO),
// which with segment ids then hold each stage's query ids (BM x 4 bytes a stage).
#pragma once
#include "common/cp_async.cuh"
#include "common/types.cuh"
#include "bwd/params.cuh"

namespace bwd {

struct Smem {
  uint8_t* base;
  uint32_t k, v, ds0, stat0, bar;
  uint8_t* tmap_stage;
  uint32_t qid0;

  __device__ __forceinline__ static Smem at(uint8_t* raw) {
    Smem m;
    // offset from the raw pointer (not cast through an integer) so that the compiler still knows
    // the pointer is shared memory and reads lse/delta with ld.shared
    m.base = raw + ((1024 - (smem_u32(raw) & 1023)) & 1023);
    m.k = smem_u32(m.base);
    m.v = m.k + KVTILE;
    m.ds0 = m.k + 2 * KVTILE + STAGES * 2 * QTILE;
    m.stat0 = m.dq(DQ_BUFS);
    m.bar = m.stat0 + STAGES * STAT;
    m.tmap_stage = m.base + (m.bar - m.k) + (8 * (10 + 2 * STAGES) + 16 + 127) / 128 * 128;  // 4 x 128
    m.qid0 = smem_u32(m.tmap_stage);
    return m;
  }
  __device__ __forceinline__ uint32_t q(int s) const { return k + 2 * KVTILE + s * 2 * QTILE; }
  __device__ __forceinline__ uint32_t dout(int s) const { return q(s) + QTILE; }
  __device__ __forceinline__ uint32_t ds(int buf) const { return ds0 + buf * DSTILE; }
  __device__ __forceinline__ uint32_t p(int buf) const { return ds0 + (2 + buf) * DSTILE; }  // WIDE only
  __device__ __forceinline__ uint32_t dq(int buf) const {
    return ds0 + (WIDE ? 4 : 2) * DSTILE + buf * DQTILE;
  }
  __device__ __forceinline__ uint32_t stat(int s) const { return stat0 + s * STAT; }
  // mbarriers: kv_full, kv_empty, dq_full, dq_empty (2 each), item_full, item_empty (2 each),
  // full, empty (STAGES each); then two slots for the tickets of the CTA's current and next item
  __device__ __forceinline__ uint32_t kv_full() const { return bar; }
  __device__ __forceinline__ uint32_t kv_empty() const { return bar + 8; }
  __device__ __forceinline__ uint32_t dq_full(int buf) const { return bar + 8 * (2 + buf); }
  __device__ __forceinline__ uint32_t dq_empty(int buf) const { return bar + 8 * (4 + buf); }
  __device__ __forceinline__ uint32_t item_full(int slot) const { return bar + 8 * (6 + slot); }
  __device__ __forceinline__ uint32_t item_empty(int slot) const { return bar + 8 * (8 + slot); }
  __device__ __forceinline__ uint32_t full(int s) const { return bar + 8 * (10 + s); }
  __device__ __forceinline__ uint32_t empty(int s) const { return bar + 8 * (10 + STAGES + s); }
  __device__ __forceinline__ uint32_t ticket() const { return bar + 8 * (10 + 2 * STAGES); }
};
static_assert(RT != IDS || STAGES * BM * 4 <= 4 * 128, "the query ids need the staging buffers' room");

}  // namespace bwd
