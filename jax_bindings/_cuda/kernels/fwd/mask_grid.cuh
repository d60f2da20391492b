// A grid layout's spatial tiles instead of the band (jax_bindings/_cuda/grid_tiles.py): a work tile
// is a query patch of BM queries (one 5-D TMA box of [B, S, H, D] seen as (D, H, n2, n1, B n0),
// stepping by the dilations), its walk the key tiles of the patch's key box (boxes of the same
// map), each masked from the per-axis windows of grid_tables unless it lies inside every window
// of the patch; rows past the grid are computed and not stored.
//
// Constants (fwd_config.cuh): the grid GN0 x GN1 x GN2 (3 axes, outermost first), its dilations
// GD*, the query patch QT*, the key tile KT*, patches per axis GP*, and the tables' strides GPMAX
// (patches) and GNMAX (coordinates).
//
// grid_tables (int32): per axis a, per patch p (GPMAX of them) 8 words: the patch's first query
// coordinate, its key box's first key and tiles, the tiles [lo, hi) inside every window of the
// patch, padding; then per axis, per coordinate (GNMAX), its window (first key, end).
#pragma once
#include "common/types.cuh"
#include "fwd/params.cuh"

namespace fwd {

// A thread's scores in a row are BN / 4 columns, bit 2 g + b standing for column 8 g + b (plus the
// lane's 2 (lane % 4)), in the narrowest word that holds them.
template <bool WIDE> struct MaskWord { typedef uint32_t T; };
template <> struct MaskWord<true> { typedef uint64_t T; };
constexpr int GW = BN / 4;
typedef typename MaskWord<(GW > 32)>::T GridBits;

// a word with bits [n, width) set, 0 <= n <= width (PTX's shift takes n = width)
__device__ __forceinline__ uint32_t bits_from(uint32_t, int n) {
  uint32_t y;
  asm("shl.b32 %0, %1, %2;" : "=r"(y) : "r"(~0u), "r"(n));
  return y;
}
__device__ __forceinline__ uint64_t bits_from(uint64_t, int n) {
  uint64_t y;
  asm("shl.b64 %0, %1, %2;" : "=l"(y) : "l"(~0ull), "r"(n));
  return y;
}
// the first bit of every period of P bits in a word of W: a pattern of one period times this
// is the pattern repeated
template <typename T, int P, int W> __device__ __forceinline__ T period_starts() {
  T starts = 0;
#pragma unroll
  for (int j = 0; j < W; j += P) starts |= T(1) << j;
  return starts;
}
// The bits of the columns whose coordinate l along an axis has 0 <= off + l < span, where l
// is constant over runs of RUN bits and takes KT values, repeating every KT RUN bits up to W.
// l's range is [lo, hi): two shifts, whatever the run.
template <typename T, int KT, int RUN, int W> __device__ __forceinline__ T run_bits(int off, int span) {
  const int lo = min(max(-off, 0), KT);
  const int hi = min(max(span - off, lo), KT);
  return (bits_from(T(0), lo * RUN) & ~bits_from(T(0), hi * RUN)) * period_starts<T, KT * RUN, W>();
}

// work tile x (patch mb, (p0, p1, p2) on the axes, last fastest): its box, tiles and walk
__device__ __forceinline__ void grid_work(Work& x, int mb, const Params& p) {
  const int4* grid_patches = reinterpret_cast<const int4*>(p.grid_tables);
  const int pa[3] = {mb / (GP1 * GP2), mb / GP2 % GP1, mb % GP2};
  x.n_tiles = 1;
#pragma unroll
  for (int a = 0; a < 3; ++a) {
    const int4 e = __ldg(grid_patches + 2 * (a * GPMAX + pa[a]));
    const int4 f = __ldg(grid_patches + 2 * (a * GPMAX + pa[a]) + 1);
    x.gq[a] = e.x;
    x.gfirst[a] = e.y;
    x.gnt[a] = e.z;
    x.glo[a] = e.w;
    x.ghi[a] = f.x;
    x.n_tiles *= e.z;
  }
  x.t0 = 0;
  x.q_end = p.Sq;
  x.kv_end = p.Skv;
  x.in_lo = 0;
  x.in_hi = p.Skv;
  x.shift = x.q_first = 0;
}

// key tile t of a patch with nt1 x nt2 tiles on the inner axes: its tile indices (last axis fastest)
__device__ __forceinline__ void tile_index(int t, int nt1, int nt2, int* i) {
  i[2] = t % nt2;
  i[1] = t / nt2 % nt1;
  i[0] = t / (nt2 * nt1);
}

// A consumer thread's grid mask over its current patch, as a view of the main loop's registers:
// the patch (Work's g* fields); this thread's rows' windows per axis (first key, end), as loaded:
// what derives from them is computed under the first tile's products, so that the load's latency
// is too; the bits of this thread's columns (GridBits) each axis lets through, per row, for the
// tile index along the axis in bits_at (-1: none yet this patch); the indices of the next key
// tile, and whether the current one is an edge tile.
struct GridMask {
  int (&first)[3];
  int (&nt)[3];
  int (&lo)[3];
  int (&hi)[3];
  int2 (&win)[2][3];
  GridBits (&bits)[3][2];
  int (&bits_at)[3];
  int (&tile)[3];
  bool& edge;
  float (&sc)[SN];
  const int& lane;

  // patch x, of this thread's rows (row i of the patch, last axis fastest): rows becomes their
  // tokens, Sq for a row past the grid
  __device__ __forceinline__ void start(const Work& x, const int& m0, int (&rows)[2], const Params& p) const {
    const int2* grid_windows = reinterpret_cast<const int2*>(p.grid_tables + 3 * GPMAX * 8);
#pragma unroll
    for (int a = 0; a < 3; ++a) {
      tile[a] = 0;
      first[a] = x.gfirst[a];
      nt[a] = x.gnt[a];
      lo[a] = x.glo[a];
      hi[a] = x.ghi[a];
      bits_at[a] = -1;
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int r = rows[i] - m0;  // the row's place in the patch, last axis fastest
      const int c[3] = {x.gq[0] + r / (QT1 * QT2) * GD0, x.gq[1] + r / QT2 % QT1 * GD1,
                        x.gq[2] + r % QT2 * GD2};
      const bool live = c[0] < GN0 && c[1] < GN1 && c[2] < GN2;
#pragma unroll
      for (int a = 0; a < 3; ++a) {
        win[i][a] = live ? __ldg(grid_windows + a * GNMAX + c[a]) : make_int2(0, 0);
      }
      rows[i] = live ? (c[0] * GN1 + c[1]) * GN2 + c[2] : p.Sq;
    }
  }

  // The next key tile of the walk: whether it is an edge tile, and then per axis and row the bits
  // of this thread's columns its queries see. Called before the tile's products are waited on,
  // so that this runs under them.
  __device__ __forceinline__ void next_tile() const {
    // the tile's indices; tiles are taken in order, so they advance by one (no division by
    // the patch's tile counts)
    const int i[3] = {tile[0], tile[1], tile[2]};
    if (++tile[2] == nt[2]) {
      tile[2] = 0;
      if (++tile[1] == nt[1]) {
        tile[1] = 0;
        ++tile[0];
      }
    }
    edge = false;
#pragma unroll
    for (int a = 0; a < 3; ++a) edge |= i[a] < lo[a] || i[a] >= hi[a];
    // row r's window along axis a in steps of its dilation d (the box and the window lie on the
    // row's phase, so their distance is a multiple of d): the tile's first key less the
    // window's first, and the window's length
    auto off = [&](int r, int a, int d, int kt) { return (first[a] - win[r][a].x) / d + i[a] * kt; };
    auto span = [&](int r, int a, int d) { return (win[r][a].y - win[r][a].x + d - 1) / d; };
    if (edge) {
      // key (column) c of the tile sits at the box's origin plus (c / (KT1 KT2), c / KT2 % KT1,
      // c % KT2) times the dilations; a thread's columns are 2 (lane % 4) plus 8 g + b
      // (bit 2 g + b of a row's GridBits), and with KT2 a multiple of 8 the lane's part stays
      // on the last axis. Along axes 0 and 1 a column's coordinate is constant over runs of
      // bits, so the axis lets a range of runs through; along axis 2 the KT2 / 4 bits of a
      // period are compared one by one. An axis's bits are recomputed only where the tile
      // moved along it.
      if (i[0] != bits_at[0]) {
        bits_at[0] = i[0];
#pragma unroll
        for (int r = 0; r < 2; ++r)
          bits[0][r] = run_bits<GridBits, KT0, KT1 * KT2 / 4, GW>(off(r, 0, GD0, KT0), span(r, 0, GD0));
      }
      if (i[1] != bits_at[1]) {
        bits_at[1] = i[1];
#pragma unroll
        for (int r = 0; r < 2; ++r)
          bits[1][r] = run_bits<GridBits, KT1, KT2 / 4, GW>(off(r, 1, GD1, KT1), span(r, 1, GD1));
      }
      if (i[2] != bits_at[2]) {
        bits_at[2] = i[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int o2 = off(r, 2, GD2, KT2) + 2 * (lane % 4), s2 = span(r, 2, GD2);
          GridBits period = 0;
#pragma unroll
          for (int k = 0; k < KT2 / 4; ++k)
            if ((uint32_t)(o2 + 8 * (k / 2) + k % 2) < (uint32_t)s2)
              period |= GridBits(1) << k;
          bits[2][r] = period * period_starts<GridBits, KT2 / 4, GW>();
        }
      }
    }
  }

  // the current tile's scores masked where its queries do not see its keys
  __device__ __forceinline__ void apply() const {
    if (edge) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const GridBits seen = bits[0][r] & bits[1][r] & bits[2][r];
#pragma unroll
        for (int k = 0; k < GW; ++k)
          if (!((seen >> k) & 1)) sc[4 * (k / 2) + 2 * r + k % 2] = SPLAT_NEG_INF;
      }
    }
  }
};

}  // namespace fwd
