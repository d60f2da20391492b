// A band mask, as both kernels take it: key j is seen by query row i where
// a(i) - LEFT <= j <= a(i) + RIGHT, a(i) the row a band is measured from (the row itself, or the
// first row of its block of BAND_BLOCK rows); a bound of UNBOUNDED or more is none. With a runtime
// mask (rt_lens), each batch row's query and key lengths bound it too.
#pragma once
#include "common/types.cuh"

// RT, a kernel's runtime mask: none, the batch rows' lengths (rt_lens), lengths and segment ids
enum : int { NO_RUNTIME = 0, LENGTHS = 1, IDS = 2 };

// the row a band is measured from: row i itself, or the first row of its block of BLOCK rows
template <int BLOCK>
__device__ __forceinline__ int anchor_of(int i) { return BLOCK == 1 ? i : i - i % BLOCK; }

__device__ __forceinline__ int floor_div(int x, int d) { return x >= 0 ? x / d : -((-x + d - 1) / d); }
// the first row whose anchor is >= x, and the last whose anchor is <= y
template <int BLOCK>
__device__ __forceinline__ int first_anchored_from(int x) {
  return BLOCK == 1 ? x : -floor_div(-x, BLOCK) * BLOCK;
}
template <int BLOCK>
__device__ __forceinline__ int last_anchored_to(int y) {
  return BLOCK == 1 ? y : floor_div(y, BLOCK) * BLOCK + BLOCK - 1;
}

// A batch row's query and key lengths: rt_lens [B, 2] (a runtime mask's) clipped to (Sq, Skv), or
// (Sq, Skv) where there is none (rt_lens null)
__device__ __forceinline__ int2 batch_lengths(const int* rt_lens, int b, int Sq, int Skv) {
  if (rt_lens == nullptr) return make_int2(Sq, Skv);
  return make_int2(min(Sq, rt_lens[2 * b]), min(Skv, rt_lens[2 * b + 1]));
}
// A batch row of queries at run-time positions: rt_lens [B, 4] holds the end of its rows that
// see keys (within q_len and the layout), kv_len, the layout row of query 0 (its shift) and the
// first row that sees keys; as (q_end, kv_end, shift, q_first), clipped to (Sq, Skv)
__device__ __forceinline__ int4 shifted_lengths(const int* rt_lens, int b, int Sq, int Skv) {
  const int4 t = reinterpret_cast<const int4*>(rt_lens)[b];
  return make_int4(min(Sq, t.x), min(Skv, t.y), t.z, max(0, t.w));
}
