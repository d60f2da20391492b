// mbarriers in shared memory (by their 32-bit shared address) and named barriers: how a kernel's
// producer and consumer warps hand each other buffers.
#pragma once
#include "common/types.cuh"

__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(bar), "r"(count) : "memory");
}
// until the phase of parity `parity` has completed
__device__ __forceinline__ void mbar_wait(uint32_t bar, int parity) {
  asm volatile(
    "{\n.reg .pred done;\nWAIT:\n"
    "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
    "@!done bra WAIT;\n}\n" :: "r"(bar), "r"(parity) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.shared::cta.b64 state, [%0];\n}\n"
               :: "r"(bar) : "memory");
}
// an arrival that also announces `bytes` more to come by bulk copies (complete_tx)
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(bytes) : "memory");
}

// named barrier `id`: wait for `threads` threads (these included), or only arrive at it
__device__ __forceinline__ void named_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" :: "r"(id), "r"(threads) : "memory");
}
template <int THREADS> __device__ __forceinline__ void named_arrive(int id) {
  asm volatile("bar.arrive %0, %1;" :: "r"(id), "n"(THREADS) : "memory");
}

// a warpgroup's register budget, moved between warpgroups (setmaxnreg)
template <int REGS> __device__ __forceinline__ void regs_dealloc() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" :: "n"(REGS) : "memory");
}
template <int REGS> __device__ __forceinline__ void regs_alloc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" :: "n"(REGS) : "memory");
}
