// The forward's online softmax, in base 2: a consumer thread's running max and sum of its two rows
// (fragment rows r and r + 8 of its warp's 16), with the scale (scale * log2(e)) applied in fp32.
// A thread holds N scores, half a row of each of its rows: score i is in row (i / 2) % 2; a row's
// other values are in the 3 other lanes of its quad (lane % 4), whose maxima and sums it gathers
// by shuffles.
#pragma once
#include "common/convert.cuh"
#include "common/types.cuh"
#include "fwd/params.cuh"

namespace fwd {

// A view of the main loop's registers: the tile's N scores sc, the rows' running max mx and sum,
// and corr, the rescale of the output accumulators for the last tile.
template <int N> struct OnlineSoftmax {
  float (&sc)[N];
  float (&mx)[2];
  float (&sum)[2];
  float (&corr)[2];
  const float& scale_log2;

  __device__ __forceinline__ void reset() const {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      mx[i] = SPLAT_NEG_INF;
      sum[i] = 0.f;
      corr[i] = 1.f;
    }
  }

  // a tile's (masked) scores become exp2(s * scale_log2 - max); the running max and sum move on
  __device__ __forceinline__ void update() const {
    float tmax[2] = {SPLAT_NEG_INF, SPLAT_NEG_INF}, base[2];
#pragma unroll
    for (int i = 0; i < N; ++i) tmax[(i / 2) % 2] = fmaxf(tmax[(i / 2) % 2], sc[i]);
#pragma unroll
    for (int x = 0; x < 2; ++x) {
      tmax[x] = fmaxf(tmax[x], __shfl_xor_sync(0xffffffff, tmax[x], 1));
      tmax[x] = fmaxf(tmax[x], __shfl_xor_sync(0xffffffff, tmax[x], 2));
      const float m_new = fmaxf(mx[x], tmax[x]);
      base[x] = m_new == SPLAT_NEG_INF ? 0.f : m_new * scale_log2;
      corr[x] = m_new == SPLAT_NEG_INF ? 1.f : fast_exp2(mx[x] * scale_log2 - base[x]);
      mx[x] = m_new;
      sum[x] *= corr[x];
    }
#pragma unroll
    for (int i = 0; i < N; ++i) {
      sc[i] = fast_exp2(sc[i] * scale_log2 - base[(i / 2) % 2]);
      sum[(i / 2) % 2] += sc[i];
    }
  }

  // the output accumulators (in the scores' row order) rescaled to the new max
  template <int O> __device__ __forceinline__ void rescale(float (&o)[O]) const {
#pragma unroll
    for (int i = 0; i < O; ++i) o[i] *= corr[(i / 2) % 2];
  }

  // at the end of a walk: each row's sum over its quad
  __device__ __forceinline__ void reduce_sums() const {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      sum[i] += __shfl_xor_sync(0xffffffff, sum[i], 1);
      sum[i] += __shfl_xor_sync(0xffffffff, sum[i], 2);
    }
  }
};

// The soft cap (SOFT_CAP = c > 0): each of a tile's N raw scores s becomes c tanh(s scale / c) / scale,
// so that the softmax's scale (scale log2(e)) gives c tanh(s scale / c) log2(e); before the mask,
// which sets the scores it hides to -inf. With no cap, nothing.
template <int N> struct SoftCap {
  float (&sc)[N];
  float in, out;  // scale / c and c / scale

  __device__ __forceinline__ static SoftCap of(float (&sc)[N], const float& scale_log2) {
    const float scale = scale_log2 * SPLAT_LN2;
    return {sc, SOFT_CAP > 0.f ? scale / SOFT_CAP : 0.f, SOFT_CAP > 0.f ? SOFT_CAP / scale : 0.f};
  }

  __device__ __forceinline__ void apply() const {
    if constexpr (SOFT_CAP > 0.f) {
#pragma unroll
      for (int i = 0; i < N; ++i) sc[i] = out * fast_tanh(sc[i] * in);
    }
  }
};

}  // namespace fwd
