// The backward's consumer warpgroups (warps 0 .. CONSUMER_WARPS - 1): per item, warpgroup wg owns
// keys n0 + 64 wg .. + 63, and per step (a query block of BM rows of one query head):
//   S^T = K Q^T and dP^T = V dO^T (wgmma m64n64k16 from shared memory);
//   P^T = exp2(S^T * scale log2(e) - lse log2(e)), masked where the step is not inside every
//   key's rows (here, next to the exponentials; the walks are mask.cuh's); dS^T = P^T (dP^T - delta);
//   dV += P^T dO and dK += dS^T Q with P and dS from registers (m64nHDk16; the accumulators stay
//   in registers for the whole walk, so dK and dV are summed over the group's heads in a fixed
//   order); dQ = dS K over all BN keys from dS^T stored to shared memory (both operands MN-major),
//   warpgroup wg taking head-dim columns DQ_N wg .. + DQ_N - 1 (DQ_N = HD / 2), left for the dQ
//   writers (dq_writer.cuh). With a soft cap, P comes from the capped scores and dS is scaled by
//   the cap's derivative.
// Each product is issued as soon as its operands are: dV before dS is computed (so P's
// exponentials run under dP^T's product, and dV under dS's arithmetic), dK after dQ (so it runs
// under dQ's store to shared memory).
#pragma once
#include "common/convert.cuh"
#include "common/mbarrier.cuh"
#include "common/tma.cuh"
#include "common/types.cuh"
#include "common/wgmma.cuh"
#include "bwd/epilogue.cuh"
#include "bwd/mask.cuh"
#include "bwd/params.cuh"
#include "bwd/shared.cuh"
#include "bwd/tile_scheduler.cuh"

namespace bwd {

__device__ __forceinline__ void consume(const Params& p, const Smem& sm, const ItemScheduler& items,
                                        const Cta& cta) {
  regs_alloc<CONSUMER_REGS>();
  const int tid = cta.tid, warp = cta.warp, lane = cta.lane;
  const int G = items.G;
  // the soft cap's factors (SOFT_CAP = c): scale / c and c / scale
  const float scale_c = p.scale_log2 * SPLAT_LN2;
  const float cap_in = SOFT_CAP > 0.f ? scale_c / SOFT_CAP : 0.f;
  const float cap_out = SOFT_CAP > 0.f ? SOFT_CAP / scale_c : 0.f;
  // warp-uniform (through a shuffle), so that the descriptors can live in uniform registers
  const int wg = __shfl_sync(0xffffffff, warp / 4, 0);
  // K and V as wgmma descriptors: warpgroup wg's 64 keys (K-major), and its 64 head-dim
  // columns of K for dQ (MN-major)
  const uint64_t k_desc = smem_desc(sm.k + wg * 64 * 128, 16, 1024);
  const uint64_t v_desc = smem_desc(sm.v + wg * 64 * 128, 16, 1024);
  constexpr int DQ_COL = DQ_N % 64;  // DQ_N < 64: a warpgroup's columns start inside a 64-column block
  const uint64_t k_mn = smem_desc(sm.k + (wg * DQ_N / 64) * BN * 128 + wg * DQ_COL * 2, BN * 128, 1024);
  // n: the CTA's items so far; g0: its steps before this item
  for (int n = 0, g0 = 0;; ++n) {
    const int ticket = next_ticket(n, sm);
    if (ticket < 0) break;
    const Item w = items.item_of(ticket, p);
    const int n0 = w.n0;
    const int key0 = n0 + 64 * wg + 16 * (warp % 4) + lane / 4;  // fragment rows: key0 and key0 + 8
    float dvac[HD / 2], dkac[HD / 2];
#pragma unroll
    for (int e = 0; e < HD / 2; ++e) dvac[e] = dkac[e] = 0.f;
    // segment ids of this thread's two keys
    int key_id[2] = {0, 0};
    if (RT == IDS)
      for (int x = 0; x < 2; ++x)
        key_id[x] = key0 + 8 * x < p.Skv ? __ldg(p.rt_kv_ids + (size_t)w.b * p.Skv + key0 + 8 * x) : 0;

    mbar_wait(sm.kv_full(), n & 1);
    int g = g0;  // the CTA's step
    for (int hh = 0; hh < G; ++hh)
      for (int ii = 0; ii < w.n_i; ++ii, ++g) {
        const int s = g % STAGES, buf = g & 1, m0 = items.block_of(w, ii) * BM;
        float st[32], dpt[32], dq[DQ_N / 2], dcap[SOFT_CAP > 0.f ? 32 : 1];
        uint32_t pk[16], ds[16];
        // the step's operands as wgmma descriptors, each product's k-slices offsets from them
        const uint64_t q_desc = smem_desc(sm.q(s), 16, 1024), do_desc = smem_desc(sm.dout(s), 16, 1024);
        const uint64_t q_mn = smem_desc(sm.q(s), BM * 128, 1024), do_mn = smem_desc(sm.dout(s), BM * 128, 1024);
        const uint64_t ds_mn = smem_desc(sm.ds(buf), BN * 128, 1024);
        mbar_wait(sm.full(s), (g / STAGES) & 1);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < HD / 16; ++kk) {
          const uint32_t a = (kk >> 2) * BN * 128 + (kk & 3) * 32, bq = (kk >> 2) * BM * 128 + (kk & 3) * 32;
          wgmma_ss<Elem, 64>(st, desc_at(k_desc, a), desc_at(q_desc, bq), kk > 0);
        }
        wgmma_commit();
#pragma unroll
        for (int kk = 0; kk < HD / 16; ++kk) {
          const uint32_t a = (kk >> 2) * BN * 128 + (kk & 3) * 32, bq = (kk >> 2) * BM * 128 + (kk & 3) * 32;
          wgmma_ss<Elem, 64>(dpt, desc_at(v_desc, a), desc_at(do_desc, bq), kk > 0);
        }
        wgmma_commit();
        const float* lse_s = reinterpret_cast<const float*>(sm.base + (sm.stat(s) - sm.k));
        const float* delta_s = lse_s + BM;
        // P^T: rows are keys key0 (+8), columns queries m0 + c
        // the thread's keys key0, key0 + 8 inside Skv, and key0 - its first query column
        const bool in_kv[2] = {key0 < w.kv_end, key0 + 8 < w.kv_end};
        const int d0 = key0 - m0 - 2 * (lane % 4), a0 = anchor_of<BAND_BLOCK>(m0);
        const int* q_id_s = reinterpret_cast<const int*>(sm.tmap_stage) + s * BM;  // the step's query ids
        bool edge = n0 + 64 * wg + 63 >= w.kv_end;
        if (LEFT < UNBOUNDED) edge |= n0 + 64 * wg < anchor_of<BAND_BLOCK>(m0 + BM - 1) - LEFT;
        if (RIGHT < UNBOUNDED) edge |= n0 + 64 * wg + 63 > anchor_of<BAND_BLOCK>(m0) + RIGHT;
        if (RT == IDS) edge |= m0 < w.in_lo || m0 + BM > w.in_hi;
        auto dv_product = [&]() {
#pragma unroll
          for (int kk = 0; kk < BM / 16; ++kk) wgmma_rs<Elem, HD>(dvac, pk + 4 * kk, desc_at(do_mn, kk * 16 * 128));
        };
        auto dk_product = [&]() {
#pragma unroll
          for (int kk = 0; kk < BM / 16; ++kk) wgmma_rs<Elem, HD>(dkac, ds + 4 * kk, desc_at(q_mn, kk * 16 * 128));
        };
        auto dq_product = [&]() {
#pragma unroll
          for (int kk = 0; kk < BN / 16; ++kk)
            wgmma_ss_t<Elem, DQ_N>(dq, desc_at(ds_mn, kk * 16 * 128), desc_at(k_mn, kk * 16 * 128), kk > 0);
        };
        // dQ to shared memory for the writer (once it took the buffer's last), in fragment order:
        // warpgroup, then pair of values e / 2, then thread (bwd_source.py's dq_from_acc)
        auto store_dq = [&]() {
          if (g >= 2) mbar_wait(sm.dq_empty(buf), ((g >> 1) - 1) & 1);
#pragma unroll
          for (int e = 0; e < DQ_N / 2; e += 2) {
            const uint32_t addr = sm.dq(buf) + wg * (DQTILE / 2) + ((e / 2) * 128 + tid % 128) * 8;
            asm volatile("st.shared.v2.f32 [%0], {%1, %2};" :: "r"(addr), "f"(dq[e]), "f"(dq[e + 1]) : "memory");
          }
          fence_proxy_async();
          __syncwarp();
          if (lane == 0) mbar_arrive(sm.dq_full(buf));
        };
        wgmma_wait<1>();
        fence_regs<32>(st);
#pragma unroll
        for (int e = 0; e < 32; ++e) {
          const int c = (e / 4) * 8 + 2 * (lane % 4) + (e % 2);
          float z = st[e];
          if constexpr (SOFT_CAP > 0.f) {
            // z = c tanh(s scale / c) / scale: scale log2(e) below makes it the capped score in base 2;
            // d(capped score) / d(s scale) = 1 - tanh^2 goes into dS
            const float t = fast_tanh(z * cap_in);
            dcap[e] = 1.f - t * t;
            z = cap_out * t;
          }
          float x = fast_exp2(z * p.scale_log2 - lse_s[c]);
          if (edge) {
            // key - row as the thread's d0 plus a constant: two compares with immediates (key - the
            // row's anchor where the band is measured from blocks of rows: the step's one anchor a0
            // where the blocks are whole query blocks, else each row's, which ptxas compiles to a
            // branch an element)
            const int d = BAND_BLOCK == 1           ? d0 + 8 * ((e / 2) % 2) - (e / 4) * 8 - (e % 2)
                          : BAND_BLOCK % BM == 0 ? key0 - a0 + 8 * ((e / 2) % 2)
                                                 : key0 + 8 * ((e / 2) % 2) - anchor_of<BAND_BLOCK>(m0 + c);
            bool ok = (e / 2) % 2 ? in_kv[1] : in_kv[0];
            if (LEFT < UNBOUNDED) ok &= d >= -LEFT;
            if (RIGHT < UNBOUNDED) ok &= d <= RIGHT;
            if (RT == IDS) ok &= q_id_s[c] == key_id[(e / 2) % 2];
            if (!ok) x = 0.f;
          }
          st[e] = x;
        }
#pragma unroll
        for (int e = 0; e < 32; e += 2) pk[e / 2] = pack2<Elem>(st[e], st[e + 1]);
        // dV is issued before the wait for dP^T: the exponentials it reads then run under dP^T's
        // product (ptxas would hoist a bare wait above them), and dV runs under dS's arithmetic
        wgmma_fence();
        dv_product();
        wgmma_commit();
        wgmma_wait<1>();
        fence_regs<32>(dpt);
#pragma unroll
        for (int e = 0; e < 32; ++e) {
          const int c = (e / 4) * 8 + 2 * (lane % 4) + (e % 2);
          dpt[e] = st[e] * (dpt[e] - delta_s[c]);
          if constexpr (SOFT_CAP > 0.f) dpt[e] *= dcap[e];
        }
#pragma unroll
        for (int e = 0; e < 32; e += 2) ds[e / 2] = pack2<Elem>(dpt[e], dpt[e + 1]);
        // dS^T to shared memory: row = key (128 of them), 64 query columns = one 128-byte swizzled
        // row. A warp's dS^T is 8 x 8 blocks in the layout stmatrix takes (block (cg, x): its rows
        // 8 x .. + 7, columns 8 cg .. + 7, in ds[2 cg + x]): four blocks an instruction, lane l
        // giving the address of row l % 8 of block l / 8
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int cg = 2 * i + lane / 16, r = 64 * wg + 16 * (warp % 4) + 8 * ((lane / 8) % 2) + lane % 8;
          const uint32_t addr = sm.ds(buf) + r * 128 + ((cg ^ (r & 7)) << 4);
          asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};"
                       :: "r"(addr), "r"(ds[4 * i]), "r"(ds[4 * i + 1]), "r"(ds[4 * i + 2]), "r"(ds[4 * i + 3])
                       : "memory");
        }
        fence_proxy_async();
        // dQ, then dK: dK runs under dQ's store to shared memory
        named_sync(1, 256);  // both warpgroups' dS^T are stored
        wgmma_fence();
        dq_product();
        wgmma_commit();
        dk_product();
        wgmma_commit();
        wgmma_wait<1>();
        fence_regs<HD / 2>(dvac);
        fence_regs<DQ_N / 2>(dq);
        store_dq();
        wgmma_wait<0>();
        fence_regs<HD / 2>(dkac);
        if (lane == 0) mbar_arrive(sm.empty(s));
      }
    // every product reading K and V is complete: the producer may load the next item's
    __syncwarp();
    if (lane == 0) mbar_arrive(sm.kv_empty());
    g0 = g;

    // ---- the item's epilogue: dK (times scale) and dV rows key0, key0 + 8 (epilogue.cuh) ----
#pragma unroll
    for (int x = 0; x < 2; ++x) {
      const int key = key0 + 8 * x;
      const size_t off = (((size_t)w.b * p.Skv + key) * p.Hkv + w.hk) * HEAD_DIM + 8 * (lane % 4);
#pragma unroll
      for (int t = 0; t < HD / 32; ++t) {
        uint32_t kw[4], vw[4];  // column groups 4 t .. 4 t + 3
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const int e = 4 * (4 * t + c) + 2 * x;
          kw[c] = pack2<Elem>(dkac[e] * p.scale, dkac[e + 1] * p.scale);
          vw[c] = pack2<Elem>(dvac[e], dvac[e + 1]);
        }
        const uint4 ko = quad_transpose(kw, lane), vo = quad_transpose(vw, lane);
        if (key < p.Skv && (HEAD_DIM == HD || 32 * t + 8 * (lane % 4) < HEAD_DIM)) {
          *reinterpret_cast<uint4*>(p.dk + off + 32 * t) = ko;
          *reinterpret_cast<uint4*>(p.dv + off + 32 * t) = vo;
        }
      }
    }
  }
}

}  // namespace bwd
