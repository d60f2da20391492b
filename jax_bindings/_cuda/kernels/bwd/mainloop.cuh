// The backward's consumer warpgroups (warps 0 .. CONSUMER_WARPS - 1): per item, warpgroup wg owns
// keys n0 + 64 wg .. + 63 (narrow: params.cuh), and per step (a query block of BM rows of one query
// head):
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
// WIDE (head dims past 128): both warpgroups take the item's 64 keys, warpgroup wg the step's
// queries QN wg .. + QN - 1 in S^T and dP^T, and head-dim columns KV_N wg .. + KV_N - 1 in dK and
// dV; P^T is stored to shared memory beside dS^T, and dV and dK read both from there (both
// warpgroups' halves, after a barrier). dK goes before dQ there, so that the step's Q and dO are
// released while dQ runs: the head dim leaves room for one Q/dO buffer only.
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

template <int N>
struct Cols {
  static constexpr int value = N;
};
// A warpgroup's NW columns of an MN-major operand, from column wg NW, as wgmma products that each
// stay inside one 64-column block where they start inside it (an MN-major operand's start may sit
// inside a block, but a product does not cross into the next block from there): f(Cols<n>, first
// column from the warpgroup's, first accumulator) for each piece. The accumulators keep the
// column order, so a thread's value e is column (e / 4) 8 + 2 (lane % 4) + e % 2 for every piece.
template <int NW, typename F>
__device__ __forceinline__ void column_pieces(int wg, F&& f) {
  if constexpr (NW % 64 == 0 || NW < 64) {
    f(Cols<NW>{}, 0, 0);
  } else {
    static_assert(NW == 96, "warpgroups of 96 columns (head dim 192): 64 + 32 and 32 + 64");
    if (wg == 0) {
      f(Cols<64>{}, 0, 0);
      f(Cols<32>{}, 64, 32);
    } else {
      f(Cols<32>{}, 0, 0);
      f(Cols<64>{}, 32, 16);
    }
  }
}
// The descriptor of column col of a tile of `rows` rows (MN-major: 64-column blocks of rows x 128
// bytes, the column's offset inside its block in the start address)
__device__ __forceinline__ uint64_t mn_desc_at_col(uint32_t tile, int col, int rows) {
  return smem_desc(tile + (col / 64) * rows * 128 + (col % 64) * 2, rows * 128, 1024);
}

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
  // the warpgroup's first key of the item, first query column of a step, first dK/dV column
  const int kw0 = WIDE ? 0 : KEYS_WG * wg, qc0 = WIDE ? QN * wg : 0, kv_col0 = WIDE ? KV_N * wg : 0;
  const uint64_t k_desc = smem_desc(sm.k + kw0 * 128, 16, 1024);
  const uint64_t v_desc = smem_desc(sm.v + kw0 * 128, 16, 1024);
  const uint64_t k_mn = mn_desc_at_col(sm.k, wg * DQ_N, BN);  // narrow (wide: by column pieces)
  // n: the CTA's items so far; g0: its steps before this item
  for (int n = 0, g0 = 0;; ++n) {
    const int ticket = next_ticket(n, sm);
    if (ticket < 0) break;
    const Item w = items.item_of(ticket, p);
    const int n0 = w.n0;
    const int key0 = n0 + kw0 + 16 * (warp % 4) + lane / 4;  // fragment rows: key0 and key0 + 8
    float dvac[KV_N / 2], dkac[KV_N / 2];
#pragma unroll
    for (int e = 0; e < KV_N / 2; ++e) dvac[e] = dkac[e] = 0.f;
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
        float st[QN / 2], dpt[QN / 2], dq[DQ_N / 2], dcap[SOFT_CAP > 0.f ? QN / 2 : 1];
        uint32_t pk[QN / 4], ds[QN / 4];
        // the step's operands as wgmma descriptors, each product's k-slices offsets from them: Q and
        // dO rows of the warpgroup's queries (K-major), and (narrow) all their columns (MN-major)
        const uint64_t q_desc = smem_desc(sm.q(s) + qc0 * 128, 16, 1024);
        const uint64_t do_desc = smem_desc(sm.dout(s) + qc0 * 128, 16, 1024);
        const uint64_t q_mn = smem_desc(sm.q(s), BM * 128, 1024), do_mn = smem_desc(sm.dout(s), BM * 128, 1024);
        const uint64_t ds_mn = smem_desc(sm.ds(buf), BN * 128, 1024);
        mbar_wait(sm.full(s), (g / STAGES) & 1);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < HD / 16; ++kk) {
          const uint32_t a = (kk >> 2) * BN * 128 + (kk & 3) * 32, bq = (kk >> 2) * BM * 128 + (kk & 3) * 32;
          wgmma_ss<Elem, QN>(st, desc_at(k_desc, a), desc_at(q_desc, bq), kk > 0);
        }
        wgmma_commit();
#pragma unroll
        for (int kk = 0; kk < HD / 16; ++kk) {
          const uint32_t a = (kk >> 2) * BN * 128 + (kk & 3) * 32, bq = (kk >> 2) * BM * 128 + (kk & 3) * 32;
          wgmma_ss<Elem, QN>(dpt, desc_at(v_desc, a), desc_at(do_desc, bq), kk > 0);
        }
        wgmma_commit();
        // the step's lse and delta, from the warpgroup's first query
        const float* lse_s = reinterpret_cast<const float*>(sm.base + (sm.stat(s) - sm.k)) + qc0;
        const float* delta_s = lse_s + BM;
        // P^T: rows are keys key0 (+8), columns queries m0 + qc0 + c
        // the thread's keys key0, key0 + 8 inside Skv, and key0 - its first query column
        const bool in_kv[2] = {key0 < w.kv_end, key0 + 8 < w.kv_end};
        const int d0 = key0 - m0 - qc0 - 2 * (lane % 4), a0 = anchor_of<BAND_BLOCK>(m0);
        // the step's query ids, from the warpgroup's first query
        const int* q_id_s = reinterpret_cast<const int*>(sm.tmap_stage) + s * BM + qc0;
        const int kb = n0 + kw0;  // the warpgroup's first key
        bool edge = kb + KEYS_WG - 1 >= w.kv_end;
        if (LEFT < UNBOUNDED) edge |= kb < anchor_of<BAND_BLOCK>(m0 + BM - 1) - LEFT;
        if (RIGHT < UNBOUNDED) edge |= kb + KEYS_WG - 1 > anchor_of<BAND_BLOCK>(m0) + RIGHT;
        if (RT == IDS) edge |= m0 < w.in_lo || m0 + BM > w.in_hi;
        // dV += P^T dO and dK += dS^T Q: narrow, P^T and dS^T from registers; wide, from shared
        // memory (K-major, the item's 64 keys by the step's BM queries)
        const uint64_t p_k = smem_desc(sm.p(buf), 16, 1024), ds_k = smem_desc(sm.ds(buf), 16, 1024);
        // wide: acc += A B over the warpgroup's columns of the step's Q or dO tile (B, MN-major)
        auto wide_product = [&](float* acc, uint64_t a, uint32_t b_tile) {
          column_pieces<KV_N>(wg, [&](auto n, int c, int e0) {
            const uint64_t b = mn_desc_at_col(b_tile, kv_col0 + c, BM);
#pragma unroll
            for (int kk = 0; kk < BM / 16; ++kk)
              wgmma_ss_bmn<Elem, decltype(n)::value>(acc + e0, desc_at(a, kk * 32), desc_at(b, kk * 16 * 128), 1);
          });
        };
        auto dv_product = [&]() {
          if constexpr (WIDE) {
            wide_product(dvac, p_k, sm.dout(s));
          } else {
#pragma unroll
            for (int kk = 0; kk < BM / 16; ++kk) wgmma_rs<Elem, KV_N>(dvac, pk + 4 * kk, desc_at(do_mn, kk * 16 * 128));
          }
        };
        auto dk_product = [&]() {
          if constexpr (WIDE) {
            wide_product(dkac, ds_k, sm.q(s));
          } else {
#pragma unroll
            for (int kk = 0; kk < BM / 16; ++kk) wgmma_rs<Elem, KV_N>(dkac, ds + 4 * kk, desc_at(q_mn, kk * 16 * 128));
          }
        };
        auto dq_product = [&]() {
          if constexpr (WIDE) {
            column_pieces<DQ_N>(wg, [&](auto n, int c, int e0) {
              const uint64_t b = mn_desc_at_col(sm.k, wg * DQ_N + c, BN);
#pragma unroll
              for (int kk = 0; kk < BN / 16; ++kk)
                wgmma_ss_t<Elem, decltype(n)::value>(dq + e0, desc_at(ds_mn, kk * 16 * 128), desc_at(b, kk * 16 * 128),
                                                     kk > 0);
            });
          } else {
#pragma unroll
            for (int kk = 0; kk < BN / 16; ++kk)
              wgmma_ss_t<Elem, DQ_N>(dq, desc_at(ds_mn, kk * 16 * 128), desc_at(k_mn, kk * 16 * 128), kk > 0);
          }
        };
        // dQ to shared memory for the writer (once it took the buffer's last), in fragment order:
        // warpgroup, then pair of values e / 2, then thread (bwd_source.py's dq_from_acc)
        auto store_dq = [&]() {
          const int qb = dq_buf(g);
          if (g >= DQ_BUFS) mbar_wait(sm.dq_empty(qb), (dq_round(g) - 1) & 1);
#pragma unroll
          for (int e = 0; e < DQ_N / 2; e += 2) {
            const uint32_t addr = sm.dq(qb) + wg * (DQTILE / 2) + ((e / 2) * 128 + tid % 128) * 8;
            asm volatile("st.shared.v2.f32 [%0], {%1, %2};" :: "r"(addr), "f"(dq[e]), "f"(dq[e + 1]) : "memory");
          }
          fence_proxy_async();
          __syncwarp();
          if (lane == 0) mbar_arrive(sm.dq_full(qb));
        };
        // P^T or dS^T (packed in v) to shared memory: row = key (BN of them), 64 query columns = one
        // 128-byte swizzled row, the warpgroup's rows kw0 .. and columns qc0 .. A warp's part is 8 x 8
        // blocks in the layout stmatrix takes (block (cg, x): its rows 8 x .. + 7, columns
        // 8 cg .. + 7, in v[2 cg + x]): four blocks an instruction, lane l giving the address of row
        // l % 8 of block l / 8
        auto store_t = [&](uint32_t tile, const uint32_t* v) {
#pragma unroll
          for (int i = 0; i < QN / 16; ++i) {
            const int cg = qc0 / 8 + 2 * i + lane / 16, r = kw0 + 16 * (warp % 4) + 8 * ((lane / 8) % 2) + lane % 8;
            const uint32_t addr = tile + r * 128 + ((cg ^ (r & 7)) << 4);
            asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};"
                         :: "r"(addr), "r"(v[4 * i]), "r"(v[4 * i + 1]), "r"(v[4 * i + 2]), "r"(v[4 * i + 3])
                         : "memory");
          }
        };
        wgmma_wait<1>();
        fence_regs<QN / 2>(st);
#pragma unroll
        for (int e = 0; e < QN / 2; ++e) {
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
                                                 : key0 + 8 * ((e / 2) % 2) - anchor_of<BAND_BLOCK>(m0 + qc0 + c);
            bool ok = (e / 2) % 2 ? in_kv[1] : in_kv[0];
            if (LEFT < UNBOUNDED) ok &= d >= -LEFT;
            if (RIGHT < UNBOUNDED) ok &= d <= RIGHT;
            if (RT == IDS) ok &= q_id_s[c] == key_id[(e / 2) % 2];
            if (!ok) x = 0.f;
          }
          st[e] = x;
        }
#pragma unroll
        for (int e = 0; e < QN / 2; e += 2) pk[e / 2] = pack2<Elem>(st[e], st[e + 1]);
        if constexpr (WIDE) {
          // dV reads both warpgroups' P^T
          store_t(sm.p(buf), pk);
          fence_proxy_async();
          named_sync(1, 256);
        }
        // dV is issued before the wait for dP^T: the exponentials it reads then run under dP^T's
        // product (ptxas would hoist a bare wait above them), and dV runs under dS's arithmetic
        wgmma_fence();
        dv_product();
        wgmma_commit();
        wgmma_wait<1>();
        fence_regs<QN / 2>(dpt);
#pragma unroll
        for (int e = 0; e < QN / 2; ++e) {
          const int c = (e / 4) * 8 + 2 * (lane % 4) + (e % 2);
          dpt[e] = st[e] * (dpt[e] - delta_s[c]);
          if constexpr (SOFT_CAP > 0.f) dpt[e] *= dcap[e];
        }
#pragma unroll
        for (int e = 0; e < QN / 2; e += 2) ds[e / 2] = pack2<Elem>(dpt[e], dpt[e + 1]);
        store_t(sm.ds(buf), ds);
        fence_proxy_async();
        named_sync(1, 256);  // both warpgroups' dS^T are stored
        if constexpr (WIDE) {
          // dK, then dQ: once dV and dK are complete, the step's Q and dO are free for the next
          // step's, which then load under dQ
          wgmma_fence();
          dk_product();
          wgmma_commit();
          dq_product();
          wgmma_commit();
          wgmma_wait<1>();
          fence_regs<KV_N / 2>(dvac);
          fence_regs<KV_N / 2>(dkac);
          if (lane == 0) mbar_arrive(sm.empty(s));
          wgmma_wait<0>();
          fence_regs<DQ_N / 2>(dq);
          store_dq();
        } else {
          // dQ, then dK: dK runs under dQ's store to shared memory
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
      }
    // every product reading K and V is complete: the producer may load the next item's
    __syncwarp();
    if (lane == 0) mbar_arrive(sm.kv_empty());
    g0 = g;

    // ---- the item's epilogue: dK (times scale) and dV rows key0, key0 + 8 (epilogue.cuh) ----
#pragma unroll
    for (int x = 0; x < 2; ++x) {
      const int key = key0 + 8 * x;
      const size_t off = (((size_t)w.b * p.Skv + key) * p.Hkv + w.hk) * HEAD_DIM + kv_col0 + 8 * (lane % 4);
#pragma unroll
      for (int t = 0; t < KV_N / 32; ++t) {
        uint32_t kw[4], vw[4];  // column groups 4 t .. 4 t + 3
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const int e = 4 * (4 * t + c) + 2 * x;
          kw[c] = pack2<Elem>(dkac[e] * p.scale, dkac[e + 1] * p.scale);
          vw[c] = pack2<Elem>(dvac[e], dvac[e + 1]);
        }
        const uint4 ko = quad_transpose(kw, lane), vo = quad_transpose(vw, lane);
        if (key < p.Skv && (HEAD_DIM == HD || kv_col0 + 32 * t + 8 * (lane % 4) < HEAD_DIM)) {
          *reinterpret_cast<uint4*>(p.dk + off + 32 * t) = ko;
          *reinterpret_cast<uint4*>(p.dv + off + 32 * t) = vo;
        }
      }
    }
  }
}

}  // namespace bwd
