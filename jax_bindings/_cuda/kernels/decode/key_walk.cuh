// The keys a decode CTA visits, read from the ACSR layout at its query tokens' positions.
//
// A batch row's tokens sit at run-time positions (q_pos); token t sees, in segment k, the
// progression base + stride * u (u < count) of layout row q_pos[t], cut at the row's key length.
// The CTA walks, per segment, the union of its tokens' progressions: from the smallest first key
// to the largest last one, with the tokens' common stride where they share one and their first
// keys agree modulo it (always, for one token), else key by key. The walk is cut into tiles of
// BLOCK_N keys, segment after segment; split s of S takes tiles [T s / S, T (s + 1) / S).
//
// seg_rows: int32 [SEGMENTS, 3, L]: per layout row, each segment's base, stride and count (the
// arrays of acsr.Segment).
#pragma once
#include "common/types.cuh"

// One token's progression in one segment: keys base + stride * u in [base, end); empty: base == end.
struct SegmentRow {
  int base, end, stride;
};

// One segment's walk: keys first + step * u, u < keys; `lattice`: every token's progression lies
// on it (no stride test per key).
struct SegmentWalk {
  int first, step, keys, tiles, lattice;
};

template <int SEGMENTS> struct KeyWalk {
  SegmentWalk seg[SEGMENTS];
  int tiles;  // all segments'
};

// Tile t of a walk: segment k, keys first + step * u for u < n; `lattice` as the segment's walk.
struct Tile {
  int k, first, step, n, lattice;
};

// Token at `pos`'s progression in segment k, cut to the keys [lo, hi) it may see (its key length;
// with sorted segment ids, its document), its first key moved onto the progression.
__device__ __forceinline__ SegmentRow segment_row(const int* seg_rows, int L, int k, int pos, int lo, int hi) {
  SegmentRow r = {0, 0, 1};
  if (pos < 0 || pos >= L) return r;
  const int* s = seg_rows + static_cast<int64_t>(k) * 3 * L;
  const int stride = max(s[L + pos], 1), count = s[2 * L + pos];
  int base = s[pos];
  const int end = min(count > 0 ? base + stride * (count - 1) + 1 : base, hi);
  if (lo > base) base += (lo - base + stride - 1) / stride * stride;
  if (end > base) r = {base, end, stride};
  return r;
}

__device__ __forceinline__ int warp_min(int x) {
#pragma unroll
  for (int o = 16; o; o >>= 1) x = min(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}
__device__ __forceinline__ int warp_max(int x) {
#pragma unroll
  for (int o = 16; o; o >>= 1) x = max(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

// Run by one whole warp: lane t < TOKENS is token t at position pos (-1: none), seeing keys in
// [lo, hi) at most. Writes each token's rows to rows[t * SEGMENTS + k] and returns the walk (the
// same in every lane).
template <int SEGMENTS, int TOKENS, int BLOCK_N>
__device__ KeyWalk<SEGMENTS> plan_walk(const int* seg_rows, int L, int pos, int lo, int hi, SegmentRow* rows) {
  const int lane = threadIdx.x & 31;
  KeyWalk<SEGMENTS> w;
  w.tiles = 0;
#pragma unroll
  for (int k = 0; k < SEGMENTS; ++k) {
    const SegmentRow r = lane < TOKENS ? segment_row(seg_rows, L, k, pos, lo, hi) : SegmentRow{0, 0, 1};
    if (lane < TOKENS) rows[lane * SEGMENTS + k] = r;
    const bool has = r.end > r.base;
    const int lo = warp_min(has ? r.base : 0x7fffffff);
    const int hi = warp_max(has ? r.end : 0);
    const int s0 = warp_min(has ? r.stride : 0x7fffffff), s1 = warp_max(has ? r.stride : 0);
    const bool congruent = __all_sync(0xffffffffu, !has || (r.base - lo) % s0 == 0);
    const bool lattice = hi > lo && s0 == s1 && congruent;
    SegmentWalk sw;
    sw.first = hi > lo ? lo : 0;
    sw.step = lattice ? s0 : 1;
    sw.keys = hi > lo ? (hi - lo + sw.step - 1) / sw.step : 0;
    sw.tiles = (sw.keys + BLOCK_N - 1) / BLOCK_N;
    sw.lattice = lattice;
    w.seg[k] = sw;
    w.tiles += sw.tiles;
  }
  return w;
}

template <int SEGMENTS, int BLOCK_N>
__device__ __forceinline__ Tile locate(const KeyWalk<SEGMENTS>& w, int t) {
  Tile out = {0, 0, 1, 0, 1};
  bool found = false;
#pragma unroll
  for (int k = 0; k < SEGMENTS; ++k) {
    const SegmentWalk& s = w.seg[k];
    if (!found && t < s.tiles) {
      found = true;
      out = {k, s.first + s.step * t * BLOCK_N, s.step, min(BLOCK_N, s.keys - t * BLOCK_N), s.lattice};
    }
    if (!found) t -= s.tiles;
  }
  return out;
}

// whether key j lies on row r's progression (j is on the walk's lattice, which is r's where `lattice`)
__device__ __forceinline__ bool on_row(const SegmentRow& r, int j, bool lattice) {
  return j >= r.base && j < r.end && (lattice || (j - r.base) % r.stride == 0);
}
