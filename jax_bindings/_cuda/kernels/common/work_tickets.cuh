// How the persistent kernels' CTAs take work items: by ticket from a global counter, handed from
// one producer lane to the CTA's other warps through shared memory; and in sections of
// (batch, head)s, so that the CTAs running at once share the section's K/V (or Q/dO) in L2.
#pragma once
#include "common/mbarrier.cuh"
#include "common/types.cuh"

// One producer lane hands each of the CTA's work items to the consumer warps through two
// shared-memory slots (``slots``: 2 x 4 bytes, the current item's and the next one's), slot i
// guarded by the mbarriers ``full + 8 i`` (count 1) and ``empty + 8 i`` (one arrival a reader warp).
// The producer's n-th ticket, taken from ``counter`` (-1 at or past ``limit``) once slot n % 2 is free:
__device__ __forceinline__ int publish_ticket(int n, int* counter, int limit, uint32_t slots, uint32_t full,
                                              uint32_t empty) {
  if (n >= 2) mbar_wait(empty + 8 * (n & 1), ((n >> 1) - 1) & 1);
  int ticket = atomicAdd(counter, 1);
  if (ticket >= limit) ticket = -1;
  asm volatile("st.shared.b32 [%0], %1;" :: "r"(slots + 4 * (n & 1)), "r"(ticket) : "memory");
  mbar_arrive(full + 8 * (n & 1));
  return ticket;
}
// A reader warp's n-th ticket (its lane 0 releases the slot):
__device__ __forceinline__ int read_ticket(int n, uint32_t slots, uint32_t full, uint32_t empty) {
  mbar_wait(full + 8 * (n & 1), (n >> 1) & 1);
  int ticket;
  asm volatile("ld.shared.b32 %0, [%1];" : "=r"(ticket) : "r"(slots + 4 * (n & 1)) : "memory");
  __syncwarp();
  if (threadIdx.x % 32 == 0) mbar_arrive(empty + 8 * (n & 1));
  return ticket;
}

// Sections of (batch, head)s: `heads` of them, each with `per_head` work items, are taken in
// sections of as many as `budget` bytes hold at `head_bytes` (> 0) a head (at least one), a section
// after another; within one, an item of each head in turn. heads_per_section: the section's
// size; in_section: work item w's head and its item counted from the head's last (x, y).
__device__ __forceinline__ int heads_per_section(long long budget, long long head_bytes, int heads) {
  return (int)max(1LL, min((long long)heads, budget / head_bytes));
}
__device__ __forceinline__ int2 in_section(int w, int section, int per_head, int heads) {
  const int first = w / (section * per_head) * section, size = min(section, heads - first);
  const int r = w - first * per_head;
  return make_int2(first + r % size, per_head - 1 - r / size);
}
