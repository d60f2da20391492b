// Warpgroup tensor-core products (wgmma, sm_90a) and the shared-memory layout they read: tiles of
// 64-column blocks of 128-byte rows, 128-byte swizzled (16-byte chunk c of row r at chunk
// c ^ (r % 8)), which wgmma reads K-major and MN-major with no bank conflicts.
//
// The instructions themselves, m64nNk16 with fp32 accumulators for each N a kernel uses, are
// specialisations generated with the kernel's constants (an asm operand list per N):
//   wgmma_ss<E, N>(d, a, b, accumulate)    A and B from shared memory, both K-major
//   wgmma_ss_t<E, N>(d, a, b, accumulate)  A and B from shared memory, both MN-major
//   wgmma_ss_bmn<E, N>(d, a, b, accumulate)  A and B from shared memory, A K-major, B MN-major
//   wgmma_rs<E, N>(d, a, b)                A from registers (4 a thread), B MN-major
// d: the N / 2 fp32 accumulators of the thread; a, b: matrix descriptors (smem_desc); accumulate
// 0 overwrites d.
#pragma once
#include "common/types.cuh"

template <typename E, int N>
__device__ __forceinline__ void wgmma_ss(float* d, uint64_t a, uint64_t b, int accumulate);
template <typename E, int N>
__device__ __forceinline__ void wgmma_ss_t(float* d, uint64_t a, uint64_t b, int accumulate);
template <typename E, int N>
__device__ __forceinline__ void wgmma_ss_bmn(float* d, uint64_t a, uint64_t b, int accumulate);
template <typename E, int N>
__device__ __forceinline__ void wgmma_rs(float* d, const uint32_t* a, uint64_t b);

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
// until all but the newest N committed groups are complete
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" :: "n"(N) : "memory");
}
// N registers an asynchronous product writes: no read of them moves above the wait for it
template <int N>
__device__ __forceinline__ void fence_regs(float* r) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i]) :: "memory");
}
// A wgmma shared-memory matrix descriptor for the 128-byte swizzle (layout type 1).
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr, uint32_t lead, uint32_t stride) {
  return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)((lead & 0x3FFFF) >> 4) << 16)
       | ((uint64_t)((stride & 0x3FFFF) >> 4) << 32) | (1ull << 62);
}
// The descriptor `d` moved on by `bytes` (a multiple of 16): its start address (bits 0-13, in
// 16-byte units) plus bytes / 16, the rest unchanged. Shared addresses stay below 2^18 bytes, so
// the sum stays inside that 14-bit field; one add instead of rebuilding the descriptor.
__device__ __forceinline__ uint64_t desc_at(uint64_t d, uint32_t bytes) {
  return (d & 0xFFFFFFFF00000000ull) | (uint32_t)((uint32_t)d + (bytes >> 4));
}
// Byte offset of 16-byte chunk j (0..15: 8 elements each) of row r in a tile of `rows` rows,
// stored as two 64-column blocks of 128-byte rows, 128-byte swizzled.
__device__ __forceinline__ uint32_t swz(int r, int j, int rows) {
  return (uint32_t)((j >> 3) * rows * 128 + r * 128 + (((j & 7) ^ (r & 7)) << 4));
}
__device__ __forceinline__ void st_shared32(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.b32 [%0], %1;" :: "r"(addr), "r"(v) : "memory");
}
