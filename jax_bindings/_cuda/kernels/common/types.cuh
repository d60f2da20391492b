// Fixed-width integers without a system header: NVRTC gets no include path, so the kernels carry
// their own (nvcc, which has one, takes the standard header).
#pragma once
#ifdef __CUDACC_RTC__
typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef unsigned long long uint64_t;
typedef long long int64_t;
typedef unsigned long uintptr_t;
#else
#include <stdint.h>
#endif

#define SPLAT_NEG_INF __int_as_float(0xff800000)
#define SPLAT_LN2 0.6931471805599453f

// The element types of q, k, v: tags that pick the tensor-core instruction and the rounding.
struct Bf16 {};
struct Fp16 {};
