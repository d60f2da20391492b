// The band and the runtime masks of the backward (common/band.cuh states the band), per key block:
// the query blocks of BM rows its walk takes and the first key block that adds to a query block's
// dQ (the ordered sum's lead). The elements of a step's P^T are masked in the consumers' loop
// (mainloop.cuh), next to the exponentials they zero, where a step is not inside every key's rows.
//   band     a key block's walk is the rows whose anchor is in [n0 - RIGHT, n0 + BN - 1 + LEFT],
//            which never moves back from one key block to the next
//   lengths  (RT >= LENGTHS) keys at or past kv_len are masked and walk nothing; padding rows need
//            nothing (their lse2 is +inf)
//   ids      (RT == IDS) a key block walks only the query blocks of its keys' ids (rt_ranges), and
//            each step's query ids come with its Q and dO
// With a runtime mask the walk is the intersection of three runs of query blocks, each a run that
// consecutive key blocks' walks cover (so that the key blocks adding to a query block's dQ are
// consecutive, as the ordered addition's turns need).
#pragma once
#include "common/band.cuh"
#include "common/types.cuh"
#include "bwd/params.cuh"

namespace bwd {

// item it's walk: query blocks i_lo .. i_lo + n_i - 1 (keys past Skv included: masked), its key
// length and the rows that see all its keys as far as ids go
__device__ __forceinline__ void band_walk(Item& it, int nkv, const Params& p) {
  int lo = 0, hi = p.Sq - 1;
  if (RIGHT < UNBOUNDED) lo = max(lo, first_anchored_from<BAND_BLOCK>(it.n0 - RIGHT));
  if (LEFT < UNBOUNDED) hi = min(hi, last_anchored_to<BAND_BLOCK>(it.n0 + BN - 1 + LEFT));
  int i_lo = lo / BM, i_hi = lo <= hi ? hi / BM : -1;
  const int2 len = batch_lengths(p.rt_lens, it.b, p.Sq, p.Skv);  // (q_end, kv_end)
  it.kv_end = len.y;
  it.in_lo = 0;
  it.in_hi = p.Sq;
  if (RT >= LENGTHS) i_hi = it.n0 < it.kv_end && len.x > 0 ? min(i_hi, (len.x - 1) / BM) : -1;
  if (RT == IDS) {
    // rows [x, y) see a key of the block; blocks x / BM .. max(x, y - 1) / BM (never none)
    const int4 t = reinterpret_cast<const int4*>(p.rt_ranges)[(size_t)it.b * nkv + it.j];
    i_lo = max(i_lo, t.x / BM);
    i_hi = min(i_hi, max(t.x, t.y - 1) / BM);
    it.in_lo = t.z;
    it.in_hi = t.w;
  }
  it.i_lo = i_lo;
  it.n_i = max(0, i_hi - i_lo + 1);
}

// The key block that adds to query block i (rows m0 ..) first in the ordered dQ sum: the first
// (first-first) or the last (last-first) that sees it; with ids, their first and last key block
// covering it (rt_leads)
__device__ __forceinline__ int lead_block(const Item& w, int i, int m0, int nkv, int nq, const Params& p) {
  int lead;
  const int2* leads = reinterpret_cast<const int2*>(p.rt_leads);
  const int2 ids_lead = RT == IDS ? __ldg(leads + (size_t)w.b * nq + i) : make_int2(0, 0);
  if (w.ff) {
    lead = LEFT < UNBOUNDED ? max(0, floor_div(anchor_of<BAND_BLOCK>(m0) - LEFT, BN)) : 0;
    if (RT == IDS) lead = max(lead, ids_lead.x);
  } else {
    lead = nkv - 1;
    if (RIGHT < UNBOUNDED)
      lead = min(lead, floor_div(RIGHT + anchor_of<BAND_BLOCK>(min(m0 + BM - 1, p.Sq - 1)), BN));
    if (RT >= LENGTHS) lead = min(lead, (w.kv_end - 1) / BN);
    if (RT == IDS) lead = min(lead, ids_lead.y);
  }
  return lead;
}

}  // namespace bwd
