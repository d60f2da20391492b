// The forward kernel's arguments (fwd.cu's parameters, in one place for its parts) and the
// constants its parts derive from the generated "fwd_config.cuh".
#pragma once
#include "common/band.cuh"
#include "common/types.cuh"
#include "fwd_config.cuh"

namespace fwd {
using namespace cfg;

// SCHEDULE: how CTAs get work tiles (one CTA per SM at most, each looping over its tiles)
enum : int { STRIDED = 1, QUEUE = 2 };

constexpr int SN = BN / 2;  // scores a consumer thread holds: half a row of two rows
constexpr uint32_t TILE = BN * HD * 2, QBYTES = BM * HD * 2;
// a tile row's 64-column blocks (128-byte swizzled rows each); HD is the head dim HEAD_DIM padded
// to whole blocks (TMA fills the columns past HEAD_DIM with zeros)
constexpr int COL_BLOCKS = HD / 64;

static_assert(HD % 64 == 0 && HEAD_DIM <= HD && HD - HEAD_DIM < 64 && HEAD_DIM % 16 == 0,
              "tiles are whole 64-column blocks of the head dim");
static_assert(!SHIFTED || RT >= LENGTHS, "run-time positions come in rt_lens");
static_assert(!GRID || (QT0 * QT1 * QT2 == BM && KT0 * KT1 * KT2 == BN && KT2 % 8 == 0),
              "a query patch is a row block, a key tile BN keys with whole 8-column groups on the last axis");
static_assert(BAR_BYTES >= 8 * (4 * STAGES + 8) + 8, "the mbarriers and tickets overflow their space");
static_assert(SCHEDULE == STRIDED || SCHEDULE == QUEUE, "a schedule the tile scheduler knows");
static_assert(Q_STAGES == 1 || Q_STAGES == 2, "one or two Q tiles");
static_assert(!O_TMA || !GRID, "a TMA store of out needs a band kernel");

struct Params {
  const uint16_t* q;
  const uint16_t* k;
  const uint16_t* v;
  const uint8_t* tmap_templates;  // K's, V's, Q's (and with O_TMA out's) tensor maps, 128 bytes each
  const int* rt_lens;             // runtime mask (null where the variant takes none)
  const int* rt_q_ids;
  const int* rt_kv_ids;
  const int* rt_ranges;
  const int* grid_tables;  // grid layouts: grid_tiles' patch and window tables (else null)
  int Sq, Skv, H, Hkv, B;
  float scale_log2;
  uint16_t* out;
  float* lse;
  int* sem;             // the queue's ticket counter
  uint8_t* tmap_slots;  // each CTA's SLOT_BYTES of published tensor maps
};

// The thread's place in the CTA, and the CTA's global slot of tensor maps: K, V, Q, out (128 bytes
// each; gk: K's, go: out's)
struct Cta {
  int tid, warp, lane;
  uint8_t* gk;
  uint8_t* go;
};

// A work tile: rows m0 .. m0 + BM - 1 of head h of batch row b, walking key tiles t0 .. t0 + n_tiles - 1
// (none: its rows still get out = 0, lse = -inf). q_end, kv_end: the batch row's query and key
// lengths; keys [in_lo, in_hi) are seen by every row of the block as far as segment ids go (tiles
// inside them skip the id test); shift, q_first: queries at run-time positions (SHIFTED: row i is
// row i + shift of the band, rows before q_first see nothing). A grid's patch: its first query
// coordinate, its key box's first key and tiles, and the tiles [lo, hi) inside every window of the
// patch, per axis.
struct Work {
  int h, b, m0, t0, n_tiles, q_end, kv_end, in_lo, in_hi, shift, q_first;
  int gq[3], gfirst[3], gnt[3], glo[3], ghi[3];
};

}  // namespace fwd
