// The Tensor Memory Accelerator and bulk copies: boxes of tensor maps and flat byte ranges between
// global and shared memory, completing on an mbarrier (loads) or in the thread's bulk group
// (stores, reductions); and the tensor maps a CTA publishes for itself.
#pragma once
#include "common/cp_async.cuh"
#include "common/types.cuh"

// `bytes` (a multiple of 16, from a 16-byte aligned address) into shared memory, completing on bar
__device__ __forceinline__ void bulk_load(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               :: "r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}
// copies `bytes` from shared memory to global memory (an async bulk copy)
__device__ __forceinline__ void bulk_store(float* dst, uint32_t src, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
               :: "l"(dst), "r"(src), "r"(bytes) : "memory");
}
// adds `bytes` of fp32 from shared memory to global memory (an async bulk reduction)
__device__ __forceinline__ void bulk_reduce_add(float* dst, uint32_t src, uint32_t bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;"
               :: "l"(dst), "r"(src), "r"(bytes) : "memory");
}
// one box of a 4-D tensor map (coordinates innermost first) into shared memory, completing on bar
__device__ __forceinline__ void tma_load_4d(uint32_t dst, const void* tmap, uint32_t bar, int c0, int c1,
                                            int c2, int c3) {
  asm volatile(
    "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
    " [%0], [%1, {%2, %3, %4, %5}], [%6];"
    :: "r"(dst), "l"(tmap), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar) : "memory");
}
// one box of a 5-D tensor map (coordinates innermost first) into shared memory, completing on bar
__device__ __forceinline__ void tma_load_5d(uint32_t dst, const void* tmap, uint32_t bar, int c0, int c1,
                                            int c2, int c3, int c4) {
  asm volatile(
    "cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
    " [%0], [%1, {%2, %3, %4, %5, %6}], [%7];"
    :: "r"(dst), "l"(tmap), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4), "r"(bar) : "memory");
}
// one box of a 4-D tensor map from shared memory (coordinates innermost first), in the thread's bulk group
__device__ __forceinline__ void tma_store_4d(const void* tmap, uint32_t src, int c0, int c1, int c2, int c3) {
  asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];"
               :: "l"(tmap), "r"(src), "r"(c0), "r"(c1), "r"(c2), "r"(c3) : "memory");
}
// the thread's bulk group: close it; wait until all but the newest N have been read from shared
// memory, or have completed
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
template <int N> __device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" :: "n"(N) : "memory");
}
template <int N> __device__ __forceinline__ void bulk_wait() {
  asm volatile("cp.async.bulk.wait_group %0;" :: "n"(N) : "memory");
}
// shared memory written through the generic proxy, then read by bulk copies or wgmma (the async
// proxy): the writes are made visible to it
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// a thread that uses a tensor map another warp published (publish_tmap) acquires it first
__device__ __forceinline__ void tmap_acquire(const void* slot) {
  asm volatile("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;" :: "l"(slot) : "memory");
}
// A warp publishes the template tensor map `tmpl` with its base address set to `base` in the global
// slot `slot` (128 bytes), through the shared-memory staging buffer `stage` (128-byte aligned).
__device__ __forceinline__ void publish_tmap(uint8_t* slot, const uint8_t* tmpl, uint8_t* stage,
                                             const void* base, int lane) {
  reinterpret_cast<uint32_t*>(stage)[lane] = reinterpret_cast<const uint32_t*>(tmpl)[lane];
  __syncwarp();
  if (lane == 0)
    asm volatile("tensormap.replace.tile.global_address.shared::cta.b1024.b64 [%0], %1;"
                 :: "r"(smem_u32(stage)), "l"(base) : "memory");
  __syncwarp();
  asm volatile(
    "tensormap.cp_fenceproxy.global.shared::cta.tensormap::generic.release.gpu.sync.aligned [%0], [%1], 128;"
    :: "l"(slot), "r"(smem_u32(stage)) : "memory");
  tmap_acquire(slot);
}
