// The backward's epilogue: an item's dK (times scale) and dV rows key0 and key0 + 8 of a consumer
// thread, stored at the end of the consumers' item loop (mainloop.cuh), where their accumulators
// live. A quad of lanes holds a row's columns in 4-byte pairs, 8 columns a column group;
// quad_transpose gives each lane 16 bytes of one of 4 column groups, so that a warp stores 64
// contiguous bytes of 8 rows at once (the quads' shuffles are the whole warp's: every lane takes
// part, and stores where key < Skv).
#pragma once
#include "common/types.cuh"

namespace bwd {

// A quad of lanes (lane % 4 = q) holding words a[c] of column groups c = 0..3, 4 bytes each (the
// quad's lane j has bytes 4 j .. 4 j + 3 of every group): lane q gets group q's 16 bytes, its word
// j from lane j. Two rounds of shuffles, across lane bit 1 then bit 0.
__device__ __forceinline__ uint4 quad_transpose(const uint32_t a[4], int lane) {
  const bool b0 = lane & 1, b1 = lane & 2;
  // round 1: the groups whose bit 1 is the lane's stay, the others go to lane ^ 2
  const uint32_t r0 = __shfl_xor_sync(0xffffffff, b1 ? a[0] : a[2], 2);
  const uint32_t r1 = __shfl_xor_sync(0xffffffff, b1 ? a[1] : a[3], 2);
  const uint32_t k0 = b1 ? a[2] : a[0], k1 = b1 ? a[3] : a[1];
  // round 2: group q's words from lanes q ^ 1 and q ^ 3
  const uint32_t t0 = __shfl_xor_sync(0xffffffff, b0 ? k0 : k1, 1);
  const uint32_t t1 = __shfl_xor_sync(0xffffffff, b0 ? r0 : r1, 1);
  // v[x]: group q's word from lane q ^ x; word j is v[j ^ q]
  const uint32_t v0 = b0 ? k1 : k0, v1 = t0, v2 = b0 ? r1 : r0, v3 = t1;
  const uint32_t u0 = b0 ? v1 : v0, u1 = b0 ? v0 : v1, u2 = b0 ? v3 : v2, u3 = b0 ? v2 : v3;
  return b1 ? make_uint4(u2, u3, u0, u1) : make_uint4(u0, u1, u2, u3);
}

}  // namespace bwd
