// Which work items a backward CTA runs, in which order. One CTA runs per SM (at most one per item)
// and takes items by ticket (common/work_tickets.cuh) until none is left; the loads of its next
// item overlap the end of the current one.
//
// A work item is a key block of BN keys of one (batch, KV head). (batch, KV head)s are taken in
// sections (as many as SECTION_BYTES of their groups' Q and dO hold at Sq, at least one), a key
// block of each in turn, so that fewer CTAs at once add to one head's query blocks in the same
// order. The key order of a head (FIRST_FIRST): 0, last-first for every head (its last key block
// first, each walking its query blocks from the first); 2, first-first for every head (the mirror:
// the first key block first, query blocks from the last); 1, first-first on the last section's
// heads, last-first on the others. Where the first key blocks walk the most query blocks (causal),
// last-first leaves the longest walks for last, but meets each query block two steps after the
// key block before it in the order, which absorbs the time a dQ addition takes to complete;
// first-first on the last section only keeps most of both.
#pragma once
#include "common/types.cuh"
#include "common/work_tickets.cuh"
#include "bwd/mask.cuh"
#include "bwd/params.cuh"
#include "bwd/shared.cuh"

namespace bwd {

struct ItemScheduler {
  int nkv, G, nq, sq_pad;  // key blocks of a head, query heads of a KV head, query blocks (BM rows)
  int n_items;
  int section;  // (batch, KV head)s a section takes
  int Hkv, B;

  __device__ __forceinline__ ItemScheduler(const Params& p)
      : nkv((p.Skv + BN - 1) / BN), G(p.H / p.Hkv), nq((p.Sq + BM - 1) / BM), sq_pad(nq * BM),
        n_items(nkv * p.Hkv * p.B),
        section(heads_per_section(SECTION_BYTES, 4LL * HEAD_DIM * G * max(p.Sq, 1), p.Hkv * p.B)),
        Hkv(p.Hkv), B(p.B) {}

  // the item of `ticket`, and its walk (mask.cuh)
  __device__ __forceinline__ Item item_of(int ticket, const Params& p) const {
    Item it;
    const int2 at = in_section(ticket, section, nkv, Hkv * B);
    const bool last_section = (ticket / (section * nkv) + 1) * section >= Hkv * B;
    it.ff = FIRST_FIRST == 2 || (FIRST_FIRST == 1 && last_section);
    it.j = it.ff ? nkv - 1 - at.y : at.y;
    it.hk = at.x % Hkv;
    it.b = at.x / Hkv;
    it.n0 = it.j * BN;
    band_walk(it, nkv, p);
    it.n_steps = it.n_i * G;
    return it;
  }
  // the query block of step ii of an item's walk over one query head's blocks
  __device__ __forceinline__ int block_of(const Item& it, int ii) const {
    return it.ff ? it.i_lo + it.n_i - 1 - ii : it.i_lo + ii;
  }
};

// the ticket of the CTA's item number `n` (-1: none left), for consumers and writers
__device__ __forceinline__ int next_ticket(int n, const Smem& sm) {
  return read_ticket(n, sm.ticket(), sm.item_full(0), sm.item_empty(0));
}

}  // namespace bwd
