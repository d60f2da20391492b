// fp32 arithmetic the kernels share: rounding to the element type, fast exp2 and tanh.
#pragma once
#include "common/types.cuh"

// two fp32 values rounded to the element type, `lo` in the low half
template <typename E> __device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <> __device__ __forceinline__ uint32_t pack2<Bf16>(float lo, float hi) {
  uint32_t v;
  asm("cvt.rn.bf16x2.f32 %0, %2, %1;" : "=r"(v) : "f"(lo), "f"(hi));
  return v;
}
template <> __device__ __forceinline__ uint32_t pack2<Fp16>(float lo, float hi) {
  uint32_t v;
  asm("cvt.rn.f16x2.f32 %0, %2, %1;" : "=r"(v) : "f"(lo), "f"(hi));
  return v;
}
// one fp32 value rounded to the element type, as its 16 bits
template <typename E> __device__ __forceinline__ uint16_t to_elem(float x) {
  return static_cast<uint16_t>(pack2<E>(x, 0.0f) & 0xFFFFu);
}

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float fast_tanh(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
