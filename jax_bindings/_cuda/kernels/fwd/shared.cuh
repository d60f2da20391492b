// The forward kernel's shared memory, from its 1 KiB aligned base: Q_STAGES Q tiles, STAGES K and
// V tiles, BAR_BYTES of mbarriers and tickets, the tensor maps' staging buffers (128 bytes each:
// K, V, Q and, with O_TMA, out), then with segment ids each stage's key ids (BN x 4 bytes).
#pragma once
#include "common/cp_async.cuh"
#include "common/types.cuh"
#include "fwd/params.cuh"

namespace fwd {

struct Smem {
  // the key ids' offset from the base (ids - q), a constant the masks address them by
  static constexpr uint32_t IDS = Q_STAGES * QBYTES + 2 * STAGES * TILE + BAR_BYTES + MAP_STAGE_BYTES;
  uint8_t* base;
  uint32_t q, k, v, bar;  // Q slot b at q + b QBYTES; stage s of K, V at k, v + s TILE
  uint8_t* tmap_stage;
  uint32_t ids;

  __device__ __forceinline__ static Smem at(uint8_t* raw) {
    Smem m;
    m.base = (uint8_t*)(((uintptr_t)raw + 1023) & ~(uintptr_t)1023);
    m.q = smem_u32(m.base);
    m.k = m.q + Q_STAGES * QBYTES;
    m.v = m.k + STAGES * TILE;
    m.bar = m.v + STAGES * TILE;
    m.tmap_stage = m.base + (m.bar - m.q) + BAR_BYTES;
    m.ids = m.bar + BAR_BYTES + MAP_STAGE_BYTES;
    return m;
  }
  // mbarriers: full_k, full_v, empty_k, empty_v (STAGES each), q_full, q_empty, item_full,
  // item_empty (2 each); then the two ticket slots
  __device__ __forceinline__ uint32_t full_k(int s) const { return bar + 8 * s; }
  __device__ __forceinline__ uint32_t full_v(int s) const { return bar + 8 * (STAGES + s); }
  __device__ __forceinline__ uint32_t empty_k(int s) const { return bar + 8 * (2 * STAGES + s); }
  __device__ __forceinline__ uint32_t empty_v(int s) const { return bar + 8 * (3 * STAGES + s); }
  __device__ __forceinline__ uint32_t q_full(int slot) const { return bar + 8 * (4 * STAGES + slot); }
  __device__ __forceinline__ uint32_t q_empty(int slot) const { return bar + 8 * (4 * STAGES + 2 + slot); }
  __device__ __forceinline__ uint32_t item_full(int slot) const { return bar + 8 * (4 * STAGES + 4 + slot); }
  __device__ __forceinline__ uint32_t item_empty(int slot) const { return bar + 8 * (4 * STAGES + 6 + slot); }
  // the queue: two slots (4 bytes each) for the tickets of the CTA's current and next work tile
  __device__ __forceinline__ uint32_t ticket() const { return bar + 8 * (4 * STAGES + 8); }
};

}  // namespace fwd
