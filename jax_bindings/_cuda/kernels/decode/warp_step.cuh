// One consumer warp of the decode kernel: its 16 query rows against its KPW keys of each tile,
// with its own online softmax (base 2); at the end the warps of a row group merge.
//
// Shapes from the generated "decode_config.cuh" (namespace cfg; see decode.cu's glossary). Q, K and
// V tiles sit in shared memory as rows of SROW elements (the head dim + 16 bytes, so that the 8
// row addresses of an ldmatrix fall in 8 different bank groups).
#pragma once
#include "decode_config.cuh"
#include "common/mma_sm80.cuh"
#include "common/types.cuh"
#include "decode/key_walk.cuh"

namespace decode {

using namespace cfg;

constexpr int KPW = BLOCK_N / WARPS_N;  // keys a warp takes from a tile
constexpr int SROW = HEAD_DIM + 8;
constexpr int NT = KPW / 8;             // n8 score tiles a warp
constexpr int DT = HEAD_DIM / 8;        // n8 output tiles
constexpr int CONSUMERS = WARPS_M * WARPS_N;
constexpr float INV_CAP = SOFT_CAP > 0.0f ? 1.0f / SOFT_CAP : 0.0f;
static_assert(HEAD_DIM % 16 == 0 && HEAD_DIM <= 256, "head dim: a multiple of 16, at most 256");
static_assert(ROWS == 16 * WARPS_M && KPW % 16 == 0, "each warp: 16 rows, a multiple of 16 keys");
static_assert(TOKENS >= 1 && TOKENS <= 32, "one lane of warp 0 plans each token");

// what a warp's two rows (lane / 4 and lane / 4 + 8 of its 16) are: tokens (TOKENS: padding)
struct RowTokens {
  int tok[2];
};

__device__ __forceinline__ RowTokens row_tokens(int row0, int wm, int lane) {
  const int r = row0 + 16 * wm + lane / 4;
  return {{min(r / GROUP, TOKENS), min((r + 8) / GROUP, TOKENS)}};
}

// the warps' partial rows, merged at the end (in the K/V stages' memory)
struct Merge {
  float o[CONSUMERS][16 * HEAD_DIM];
  float m[CONSUMERS][16], l[CONSUMERS][16];
};

struct WarpAccum {
  float o[DT][4];
  float m[2], l[2];

  __device__ __forceinline__ void init() {
#pragma unroll
    for (int i = 0; i < DT; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
    m[0] = m[1] = SPLAT_NEG_INF;
    l[0] = l[1] = 0.0f;
  }

  // One tile. q_addr, k_addr, v_addr: this lane's ldmatrix addresses (lane_addresses); rows:
  // the tokens' progressions in the tile's segment; ids: the tile's key ids (IDS), qid: the rows'.
  __device__ __forceinline__ void step(uint32_t q_addr, uint32_t k_addr, uint32_t v_addr, const Tile& tile,
                                       const SegmentRow (&rr)[2], const int* ids, const int (&qid)[2], int lane,
                                       int wn, float scale_log2, float scale) {
    // S = Q K^T over the warp's keys
    float s[NT][4];
#pragma unroll
    for (int i = 0; i < NT; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < HEAD_DIM / 16; ++kk) {
      uint32_t a[4];
      ldmatrix_x4(a, q_addr + kk * 32);
#pragma unroll
      for (int np = 0; np < NT / 2; ++np) {
        uint32_t bk[4];
        ldmatrix_x4(bk, k_addr + (np * 16 * SROW + kk * 16) * 2);
        mma16816<Elem>(s[2 * np], a, bk[0], bk[1]);
        mma16816<Elem>(s[2 * np + 1], a, bk[2], bk[3]);
      }
    }
    // mask (the key on the row's progression, its id the row's), scale, soft cap
    float mx[2] = {SPLAT_NEG_INF, SPLAT_NEG_INF};
#pragma unroll
    for (int i = 0; i < NT; ++i) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int u = KPW * wn + 8 * i + 2 * (lane & 3) + (e & 1), h = e >> 1;
        const int j = tile.first + tile.step * u;
        bool keep = u < tile.n && on_row(rr[h], j, tile.lattice);
        if constexpr (IDS) keep = keep && ids[u] == qid[h];
        float z = s[i][e];
        if constexpr (SOFT_CAP > 0.0f) z = SOFT_CAP * fast_tanh(z * scale * INV_CAP) * (scale_log2 / scale);
        else z *= scale_log2;
        s[i][e] = keep ? z : SPLAT_NEG_INF;
        mx[h] = fmaxf(mx[h], s[i][e]);
      }
    }
    // online softmax, per row: the quad's four lanes hold its columns
    float alpha[2], m_use[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
      const float m_new = fmaxf(m[h], mx[h]);
      m_use[h] = m_new == SPLAT_NEG_INF ? 0.0f : m_new;
      alpha[h] = fast_exp2(m[h] - m_use[h]);
      m[h] = m_new;
      l[h] *= alpha[h];
    }
#pragma unroll
    for (int i = 0; i < NT; ++i) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[i][e] = fast_exp2(s[i][e] - m_use[e >> 1]);
        l[e >> 1] += s[i][e];
      }
    }
#pragma unroll
    for (int i = 0; i < DT; ++i) {
      o[i][0] *= alpha[0], o[i][1] *= alpha[0], o[i][2] *= alpha[1], o[i][3] *= alpha[1];
    }
    // O += P V: the scores' accumulators are the A operand of the next product, 16 keys a step
#pragma unroll
    for (int ks = 0; ks < KPW / 16; ++ks) {
      const uint32_t a[4] = {pack2<Elem>(s[2 * ks][0], s[2 * ks][1]), pack2<Elem>(s[2 * ks][2], s[2 * ks][3]),
                             pack2<Elem>(s[2 * ks + 1][0], s[2 * ks + 1][1]),
                             pack2<Elem>(s[2 * ks + 1][2], s[2 * ks + 1][3])};
#pragma unroll
      for (int dp = 0; dp < HEAD_DIM / 16; ++dp) {
        uint32_t bv[4];
        ldmatrix_x4_trans(bv, v_addr + (ks * 16 * SROW + dp * 16) * 2);
        mma16816<Elem>(o[2 * dp], a, bv[0], bv[1]);
        mma16816<Elem>(o[2 * dp + 1], a, bv[2], bv[3]);
      }
    }
  }

  // the warp's rows into the merge buffer (after the last tile)
  __device__ __forceinline__ void publish(Merge& mg, int warp, int lane) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
      l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
    }
    if ((lane & 3) == 0) {
      mg.m[warp][lane / 4] = m[0], mg.m[warp][lane / 4 + 8] = m[1];
      mg.l[warp][lane / 4] = l[0], mg.l[warp][lane / 4 + 8] = l[1];
    }
#pragma unroll
    for (int i = 0; i < DT; ++i) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        mg.o[warp][(lane / 4 + 8 * (e >> 1)) * HEAD_DIM + 8 * i + 2 * (lane & 3) + (e & 1)] = o[i][e];
      }
    }
  }
};

// ldmatrix lane addresses (bytes) in a tile: A (Q) rows 8 (l / 8 % 2) + l % 8, column 8 (l / 16); B (K)
// keys 8 (l / 16) + l % 8, column 8 (l / 8 % 2); B^T (V) keys 8 (l / 8 % 2) + l % 8, column 8 (l / 16)
__device__ __forceinline__ int q_lane_offset(int wm, int lane) {
  const int mi = lane >> 3, li = lane & 7;
  return ((16 * wm + 8 * (mi & 1) + li) * SROW + 8 * (mi >> 1)) * 2;
}
__device__ __forceinline__ int k_lane_offset(int wn, int lane) {
  const int mi = lane >> 3, li = lane & 7;
  return ((KPW * wn + 8 * (mi >> 1) + li) * SROW + 8 * (mi & 1)) * 2;
}
__device__ __forceinline__ int v_lane_offset(int wn, int lane) {
  const int mi = lane >> 3, li = lane & 7;
  return ((KPW * wn + 8 * (mi & 1) + li) * SROW + 8 * (mi >> 1)) * 2;
}

// The merged rows written out by `threads` threads (index `tid`): per row m = max over its row
// group's warps, l and o summed with weights 2^(m_w - m). SPLIT: the split's row (normalised by
// its own sum) and lse; else the output in the element type and lse [B, H, TOKENS].
__device__ __forceinline__ void store_rows(const Merge& mg, int tid, int threads, int b, int hk, int row0, int H,
                                           int split, int splits, void* out, float* lse) {
  for (int c = tid; c < ROWS * HEAD_DIM; c += threads) {
    const int r = c / HEAD_DIM, d = c % HEAD_DIM, gr = row0 + r, t = gr / GROUP;
    if (t >= TOKENS) continue;
    const int g = r / 16, rr = r % 16, hq = hk * GROUP + gr % GROUP;
    float mm = SPLAT_NEG_INF;
#pragma unroll
    for (int w = 0; w < WARPS_N; ++w) mm = fmaxf(mm, mg.m[g * WARPS_N + w][rr]);
    const float mu = mm == SPLAT_NEG_INF ? 0.0f : mm;
    float ll = 0.0f, acc = 0.0f;
#pragma unroll
    for (int w = 0; w < WARPS_N; ++w) {
      const float f = fast_exp2(mg.m[g * WARPS_N + w][rr] - mu);
      ll += mg.l[g * WARPS_N + w][rr] * f;
      acc += mg.o[g * WARPS_N + w][rr * HEAD_DIM + d] * f;
    }
    const float val = ll > 0.0f ? acc / ll : 0.0f;
    const float row_lse = ll > 0.0f ? (mm + __log2f(ll)) * SPLAT_LN2 : SPLAT_NEG_INF;
    const int64_t bth = (static_cast<int64_t>(b) * TOKENS + t) * H + hq;
    if constexpr (SPLIT) {
      static_cast<float*>(out)[(bth * splits + split) * HEAD_DIM + d] = val;
      if (d == 0) lse[bth * splits + split] = row_lse;
    } else {
      static_cast<uint16_t*>(out)[bth * HEAD_DIM + d] = to_elem<Elem>(val);
      if (d == 0) lse[(static_cast<int64_t>(b) * H + hq) * TOKENS + t] = row_lse;
    }
  }
}

}  // namespace decode
