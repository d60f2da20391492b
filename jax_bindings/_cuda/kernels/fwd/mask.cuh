// The band and the runtime masks of the forward (common/band.cuh states the band): the key tiles a
// row block walks, and the scores of a tile masked where it is not inside every row's keys.
//   band     the walk: the key tiles any row of the block sees at its band rows; a tile is masked
//            where it reaches past the first row's last key or before the last row's first
//   lengths  (RT >= LENGTHS) a row block of padding walks nothing; keys at or past kv_len are
//            masked like keys past Skv (rows past q_len get out = 0 in the epilogue)
//   ids      (RT == IDS) a row block walks only the keys of its rows' segment ids (rt_ranges);
//            tiles outside the keys every row of the block sees compare ids, the keys' loaded
//            with the K tile (a stage's key ids, in shared memory)
//   shift    (SHIFTED) query row i is row i + shift of the band; rows outside [q_first, q_end)
//            see no key
#pragma once
#include "common/band.cuh"
#include "common/types.cuh"
#include "fwd/params.cuh"
#include "fwd/shared.cuh"

namespace fwd {

// work tile x (row block mb)'s lengths and walk
__device__ __forceinline__ void band_work(Work& x, int mb, int n_row_blocks, const Params& p) {
  if (SHIFTED) {
    const int4 len = shifted_lengths(p.rt_lens, x.b, p.Sq, p.Skv);
    x.q_end = len.x;
    x.kv_end = len.y;
    x.shift = len.z;
    x.q_first = len.w;
  } else {
    const int2 len = batch_lengths(p.rt_lens, x.b, p.Sq, p.Skv);
    x.q_end = len.x;
    x.kv_end = len.y;
    x.shift = x.q_first = 0;
  }
  // the key tiles any row of the block sees (at the block's band rows)
  const int a0 = x.m0 + x.shift;
  int lo = 0, hi = p.Skv;
  if (LEFT < UNBOUNDED) lo = max(0, anchor_of<BAND_BLOCK>(a0) - LEFT);
  if (RIGHT < UNBOUNDED) hi = min(p.Skv, anchor_of<BAND_BLOCK>(a0 + BM - 1) + RIGHT + 1);
  x.in_lo = 0;
  x.in_hi = p.Skv;
  // a block of rows that see nothing (padding, or outside the layout) walks nothing
  if (RT >= LENGTHS) hi = min(hi, x.m0 < x.q_end && x.m0 + BM > x.q_first ? x.kv_end : 0);
  if (RT == IDS) {
    const int4 t = reinterpret_cast<const int4*>(p.rt_ranges)[(size_t)x.b * n_row_blocks + mb];
    lo = max(lo, t.x);
    hi = min(hi, t.y);
    x.in_lo = t.z;
    x.in_hi = t.w;
  }
  x.t0 = lo / BN;
  x.n_tiles = hi > lo ? (hi + BN - 1) / BN - x.t0 : 0;
}

// The band mask of a consumer thread's current work tile, as a view of the main loop's registers:
// the tile's first row and key tile, the thread's two rows, the tile's key length and id-free keys
// (Work), the rows' segment ids and their shift (the band row of the tile's row 0 less m0, SHIFTED;
// else 0), and the scores it masks.
struct BandMask {
  const int& m0;
  const int& t0;
  const int (&rows)[2];
  int& kv_end;
  int& in_lo;
  int& in_hi;
  int (&row_id)[2];
  int& shift;
  float (&sc)[SN];
  const Smem& sm;
  const int& lane;

  // work tile x, whose rows this thread holds (rows: Sq for none)
  __device__ __forceinline__ void start(const Work& x, const Params& p) const {
    kv_end = x.kv_end;
    shift = x.shift;
    in_lo = x.in_lo;
    in_hi = x.in_hi;
    if (RT == IDS)
      for (int i = 0; i < 2; ++i) row_id[i] = rows[i] < p.Sq ? __ldg(p.rt_q_ids + (size_t)x.b * p.Sq + rows[i]) : 0;
  }

  // The scores of key tile t of the walk (in stage s: with segment ids, its keys' ids are in the
  // stage's slot), masked where the tile is not inside every row's keys.
  __device__ __forceinline__ void apply(int t, int s) const {
    const int n0 = (t0 + t) * BN;
    bool edge = n0 + BN > kv_end;
    const int a0 = m0 + (SHIFTED ? shift : 0);
    if (LEFT < UNBOUNDED) edge |= n0 < anchor_of<BAND_BLOCK>(a0 + BM - 1) - LEFT;
    if (RIGHT < UNBOUNDED) edge |= n0 + BN - 1 > anchor_of<BAND_BLOCK>(a0) + RIGHT;
    if (RT == IDS) edge |= n0 < in_lo || n0 + BN > in_hi;
    if (edge) {
      // col - row and kv_end - col as per-thread values plus constants: compares with immediates
      // (col - the rows' anchors where the band is measured from blocks of rows)
      const int sh = SHIFTED ? shift : 0;
      const int col0 = n0 + 2 * (lane % 4), d0 = col0 - rows[0] - sh, room = kv_end - col0;
      const int anchors[2] = {anchor_of<BAND_BLOCK>(rows[0] + sh), anchor_of<BAND_BLOCK>(rows[1] + sh)};
      const int* key_id = reinterpret_cast<const int*>(sm.base + Smem::IDS + s * BN * 4) + 2 * (lane % 4);
#pragma unroll
      for (int i = 0; i < SN; ++i) {
        const int dc = (i / 4) * 8 + (i % 2);
        const int d = BAND_BLOCK == 1 ? d0 + dc - 8 * ((i / 2) % 2) : col0 + dc - anchors[(i / 2) % 2];
        bool ok = dc < room;
        if (LEFT < UNBOUNDED) ok &= d >= -LEFT;
        if (RIGHT < UNBOUNDED) ok &= d <= RIGHT;
        if (RT == IDS) ok &= key_id[dc] == row_id[(i / 2) % 2];
        if (!ok) sc[i] = SPLAT_NEG_INF;
      }
    }
  }
};

}  // namespace fwd
