"""CUDA C++ source of a Hopper (sm_90a) attention forward, written for a diagonal band baked in.

The generator of the ``cuda`` backend (:mod:`jax_bindings._cuda.backend`, which picks the
variant in :mod:`jax_bindings._cuda.plan`); ``benchmarks/spike_cuda_fwd.py`` builds and times
its schedules and feeds. One CTA owns ``BM = 128`` query rows of one (batch, head) and
walks the key tiles of ``block_n`` keys (128 or 176) that its rows can see:

* warps 0-7 are two consumer warpgroups of 64 rows each: ``S = Q K^T`` and ``O += P V`` with
  ``wgmma`` (``m64nNk16``, bf16 in, fp32 accumulators); Q and K from shared memory through
  matrix descriptors, P from registers (the fp32 accumulator fragment of ``S`` is, element for
  element, the bf16 A fragment of the next product), V from shared memory read transposed;
  ``overlap`` issues QK of tile t with PV of tile t-1 and runs the softmax of t under it;
  ``pingpong`` makes the two warpgroups take turns issuing (named barriers);
* warps 8-11 are the producer warpgroup (``setmaxnreg``: 24 registers, the consumers 240): K and
  V tiles into a ring of ``stages`` buffers, each completing on an mbarrier, by TMA (one lane
  issues ``cp.async.bulk.tensor`` through tensor maps it published for the CTA) or by ``cp.async``
  (16 bytes a thread); consumers release a buffer on a second mbarrier once their ``wgmma``
  reading it is done;
* tiles are stored in 64-column blocks of 128-byte rows with the 128-byte swizzle (16-byte
  chunk ``c`` of row ``r`` at chunk ``c ^ (r % 8)``): the layout ``wgmma`` reads K-major (Q, K)
  and, for V, MN-major, with no bank conflicts;
* no header is included (NVRTC compiles it with no include path; nvcc too);
* online softmax in base 2 with ``scale * log2(e)`` applied in fp32; tiles inside every row's
  window skip the mask; out-of-range keys are zero-filled and masked.

Mask: a query at row ``i`` sees keys ``j`` with ``i - left <= j <= i + right`` (``None``: no
bound; either may be negative), ``0 <= j < Skv``; a row block that sees no key skips its walk
(its rows give ``out = 0``, ``lse = -inf``). Dense is ``(None, None)``; causal ``(None, 0)``; a
causal window of ``W`` keys ``(W - 1, 0)``. Inputs ``[B, S, H, D]`` bf16 or fp16 (``dtype``)
with ``D = 128``, GQA by ``H // Hkv``; outputs ``out [B, Sq, H, D]`` in the input dtype and
``lse [B, H, Sq]`` fp32 (natural log; ``-inf`` and ``out = 0`` on a row with no key).
Parameters: the array inputs, the scalars, then the array outputs (the order jaxlib's kernel
call hands buffers in): ``q, k, v, tmap_templates, Sq, Skv, H, Hkv, scale_log2, out, lse, tmap_slots``.
"""

from __future__ import annotations

import hashlib

BM, D = 128, 128
BN = 128  # default key tile; source(block_n=) takes any multiple of 16 up to 256
CONSUMER_WARPS = 8
PRODUCER_WARPS = 4
# setmaxnreg: a CTA of 12 warps starts at 168 registers a thread (3 warps share a sub-partition's
# 16K); one warp of each warpgroup per sub-partition must stay within 3 x 168 = 504 after the move
PRODUCER_REGS, CONSUMER_REGS = 24, 240
THREADS = (CONSUMER_WARPS + PRODUCER_WARPS) * 32
KERNEL_NAME = "splat_fwd_wgmma"
_UNBOUNDED = 1 << 30
FEEDS = {"cp.async": 0, "tma": 1, "none": 2}


def smem_bytes(stages: int, block_n: int = BN) -> int:
    """Dynamic shared memory: Q, ``stages`` K and V tiles, the mbarriers (32 bytes a stage, padded
    to 128), two tensor-map staging buffers of 128 bytes, 1 KiB for alignment."""
    tile = block_n * D * 2
    return BM * D * 2 + 2 * stages * tile + -(-32 * stages // 128) * 128 + 256 + 1024


def _wgmma_ss(n: int) -> str:
    """``wgmma`` m64n{n}k16, A and B from shared memory (K-major), fp32 accumulators ``d``."""
    regs = n // 2
    outs = ", ".join(f"%{i}" for i in range(regs))
    operands = ", ".join(f'"+f"(d[{i}])' for i in range(regs))
    return f"""
__device__ __forceinline__ void wgmma_ss_{n}(float* d, uint64_t a, uint64_t b, int accumulate) {{
  asm volatile(
    "{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{regs + 2}, 0;\\n"
    "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.__ELEM__.__ELEM__ {{{outs}}}, "
    "%{regs}, %{regs + 1}, p, 1, 1, 0, 0;\\n}}\\n"
    : {operands}
    : "l"(a), "l"(b), "r"(accumulate));
}}
"""


def _wgmma_rs(n: int) -> str:
    """``wgmma`` m64n{n}k16, A from registers, B from shared memory MN-major (transposed)."""
    regs = n // 2
    outs = ", ".join(f"%{i}" for i in range(regs))
    operands = ", ".join(f'"+f"(d[{i}])' for i in range(regs))
    return f"""
__device__ __forceinline__ void wgmma_rs_{n}(float* d, const uint32_t* a, uint64_t b) {{
  asm volatile(
    "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.__ELEM__.__ELEM__ {{{outs}}}, "
    "{{%{regs}, %{regs + 1}, %{regs + 2}, %{regs + 3}}}, %{regs + 4}, 1, 1, 1, 1;\\n"
    : {operands}
    : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}}
"""


_HELPERS = r"""
#ifdef __CUDACC_RTC__
typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef unsigned long long uint64_t;
typedef unsigned long uintptr_t;
#else
#include <stdint.h>
#endif
#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(bar), "r"(count) : "memory");
}
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
__device__ __forceinline__ void cp_async_arrive(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" :: "r"(bar) : "memory");
}
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
               :: "r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(bytes) : "memory");
}
// one box of a 4-D tensor map (coordinates innermost first) into shared memory, completing on bar
__device__ __forceinline__ void tma_load_4d(uint32_t dst, const void* tmap, uint32_t bar, int c0, int c1,
                                            int c2, int c3) {
  asm volatile(
    "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
    " [%0], [%1, {%2, %3, %4, %5}], [%6];"
    :: "r"(dst), "l"(tmap), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar) : "memory");
}
// A warp publishes the template tensor map `tmpl` with its base address set to `base` in the global
// slot `slot` (128 bytes), through the shared-memory staging buffer `stage` (128-byte aligned).
__device__ __forceinline__ void publish_tmap(uint8_t* slot, const uint8_t* tmpl, uint8_t* stage,
                                             const void* base, int lane) {
  reinterpret_cast<uint32_t*>(stage)[lane] = reinterpret_cast<const uint32_t*>(tmpl)[lane];
  __syncwarp();
  if (lane == 0)
    asm volatile("tensormap.replace.tile.global_address.shared::cta.b1024.b64 [%0], %1;"
                 :: "r"(smem_addr(stage)), "l"(base) : "memory");
  __syncwarp();
  asm volatile(
    "tensormap.cp_fenceproxy.global.shared::cta.tensormap::generic.release.gpu.sync.aligned [%0], [%1], 128;"
    :: "l"(slot), "r"(smem_addr(stage)) : "memory");
  asm volatile("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;" :: "l"(slot) : "memory");
}
__device__ __forceinline__ void fence_async_smem_always() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" :: "n"(N) : "memory");
}
template <int N>
__device__ __forceinline__ void fence_regs(float* r) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i]) :: "memory");
}
__device__ __forceinline__ void named_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" :: "r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
// A wgmma shared-memory matrix descriptor for the 128-byte swizzle (layout type 1).
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr, uint32_t lead, uint32_t stride) {
  return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)((lead & 0x3FFFF) >> 4) << 16)
       | ((uint64_t)((stride & 0x3FFFF) >> 4) << 32) | (1ull << 62);
}
// Byte offset of 16-byte chunk j (0..15: 8 elements each) of row r in a tile of `rows` rows,
// stored as two 64-column blocks of 128-byte rows, 128-byte swizzled.
__device__ __forceinline__ uint32_t swz(int r, int j, int rows) {
  return (uint32_t)((j >> 3) * rows * 128 + r * 128 + (((j & 7) ^ (r & 7)) << 4));
}
// two fp32 values rounded to the element type (__ELEM__), `lo` in the low half
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  uint32_t v;
  asm("cvt.rn.__ELEM__x2.f32 %0, %2, %1;" : "=r"(v) : "f"(lo), "f"(hi));
  return v;
}
"""

_KERNEL = r"""
constexpr int BM = __BM__, BN = __BN__, HD = __D__, STAGES = __STAGES__, SN = BN / 2;
constexpr int LEFT = __LEFT__, RIGHT = __RIGHT__;  // key j seen by row i: i - LEFT <= j <= i + RIGHT
constexpr bool OVERLAP = __OVERLAP__, PINGPONG = __PINGPONG__;
constexpr int FEED = __FEED__;  // 0: cp.async, 1: TMA, 2: none (a timing experiment)
constexpr bool PROXY_FENCE = __PROXY_FENCE__;
constexpr uint32_t TILE = BN * HD * 2, QBYTES = BM * HD * 2;

extern "C" __global__ void __launch_bounds__(__THREADS__, 1) __NAME__(
    const uint16_t* __restrict__ q, const uint16_t* __restrict__ k,
    const uint16_t* __restrict__ v, const uint8_t* __restrict__ tmap_templates,
    int Sq, int Skv, int H, int Hkv, float scale_log2,
    uint16_t* __restrict__ out, float* __restrict__ lse, uint8_t* __restrict__ tmap_slots) {
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  uint8_t* smem = (uint8_t*)(((uintptr_t)smem_raw + 1023) & ~(uintptr_t)1023);
  const uint32_t s_q = smem_addr(smem);
  const uint32_t s_k = s_q + QBYTES;
  const uint32_t s_v = s_k + STAGES * TILE;
  const uint32_t s_bar = s_v + STAGES * TILE;  // full_k, full_v, empty_k, empty_v: STAGES each
  uint8_t* tmap_stage = smem + (s_bar - s_q) + (32 * STAGES + 127) / 128 * 128;  // 2 x 128 bytes
  auto full_k = [&](int s) { return s_bar + 8 * s; };
  auto full_v = [&](int s) { return s_bar + 8 * (STAGES + s); };
  auto empty_k = [&](int s) { return s_bar + 8 * (2 * STAGES + s); };
  auto empty_v = [&](int s) { return s_bar + 8 * (3 * STAGES + s); };

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int n_row_blocks = (Sq + BM - 1) / BM;
  const int mb = n_row_blocks - 1 - blockIdx.x;  // longest walks first
  const int h = blockIdx.y, b = blockIdx.z, hkv = h / (H / Hkv);
  const int m0 = mb * BM;

  // the keys any row of the block sees, and the tiles every row sees whole
  int lo = 0, hi = Skv;
  if (LEFT < __UNBOUNDED__) lo = max(0, m0 - LEFT);
  if (RIGHT < __UNBOUNDED__) hi = min(Skv, m0 + BM - 1 + RIGHT + 1);
  const int t0 = lo / BN, t1 = max(t0, (hi + BN - 1) / BN);
  const int n_tiles = t1 - t0;

  if (tid == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(full_k(s), FEED == 1 ? 1 : __PRODUCER_WARPS__ * 32);
      mbar_init(full_v(s), FEED == 1 ? 1 : __PRODUCER_WARPS__ * 32);
      mbar_init(empty_k(s), __CONSUMER_WARPS__);
      mbar_init(empty_v(s), __CONSUMER_WARPS__);
    }
  }
  __syncthreads();

  const size_t kv_row = (size_t)Hkv * HD;  // elements between consecutive keys
  if (warp >= __CONSUMER_WARPS__) {
    // ---- producer warpgroup: K and V tiles through cp.async, each completing on its mbarrier ----
    asm volatile("setmaxnreg.dec.sync.aligned.u32 __PRODUCER_REGS__;" ::: "memory");
    const uint16_t* kb = k + ((size_t)b * Skv * Hkv + hkv) * HD;
    const uint16_t* vb = v + ((size_t)b * Skv * Hkv + hkv) * HD;
    const int pt = tid - __CONSUMER_WARPS__ * 32, j = pt & 15, r_first = pt >> 4;
    if constexpr (FEED == 1) {
      // TMA: one warp publishes this CTA's K and V tensor maps; its lane 0 issues every copy
      if (pt >= 32) return;
      const size_t cta = ((size_t)blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
      uint8_t* gk = tmap_slots + cta * 256;
      uint8_t* gv = gk + 128;
      publish_tmap(gk, tmap_templates, tmap_stage, k, lane);
      publish_tmap(gv, tmap_templates + 128, tmap_stage + 128, v, lane);
      if (lane != 0) return;
      for (int t = 0; t < n_tiles; ++t) {
        const int s = t % STAGES, n0 = (t0 + t) * BN;
        if (t >= STAGES) mbar_wait(empty_k(s), ((t / STAGES) & 1) ^ 1);
        mbar_expect_tx(full_k(s), TILE);
        tma_load_4d(s_k + s * TILE, gk, full_k(s), 0, hkv, n0, b);
        tma_load_4d(s_k + s * TILE + BN * 128, gk, full_k(s), 64, hkv, n0, b);
        if (t >= STAGES) mbar_wait(empty_v(s), ((t / STAGES) & 1) ^ 1);
        mbar_expect_tx(full_v(s), TILE);
        tma_load_4d(s_v + s * TILE, gv, full_v(s), 0, hkv, n0, b);
        tma_load_4d(s_v + s * TILE + BN * 128, gv, full_v(s), 64, hkv, n0, b);
      }
    } else {
      // every producer thread copies 16 of the tile's rows (one 16-byte chunk each); a tile
      // completes on `full` once all 128 threads' copies land (or, with no feed, on arrival)
      auto fill = [&](uint32_t dst, const uint16_t* src, int n0, uint32_t full) {
        if (FEED == 0) {
#pragma unroll
          for (int r = r_first; r < BN; r += 8) {
            const int n = n0 + r;
            const bool ok = n < Skv;
            cp_async16(dst + swz(r, j, BN), src + (ok ? n : 0) * kv_row + j * 8, ok ? 16 : 0);
          }
          cp_async_arrive(full);
        } else {
          mbar_arrive(full);
        }
      };
      for (int t = 0; t < n_tiles; ++t) {
        const int s = t % STAGES, n0 = (t0 + t) * BN;
        if (t >= STAGES) mbar_wait(empty_k(s), ((t / STAGES) & 1) ^ 1);
        fill(s_k + s * TILE, kb, n0, full_k(s));
        if (t >= STAGES) mbar_wait(empty_v(s), ((t / STAGES) & 1) ^ 1);
        fill(s_v + s * TILE, vb, n0, full_v(s));
      }
      asm volatile("cp.async.wait_all;" ::: "memory");
    }
  } else {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 __CONSUMER_REGS__;" ::: "memory");
  // ---- consumers: warpgroup wg owns rows m0 + 64 wg .. + 63 ----
  const int wg = warp / 4, wt = tid % 128;
  {
    const uint16_t* qb = q + ((size_t)b * Sq * H + h) * HD;
    const size_t q_row = (size_t)H * HD;
    for (int c = wt; c < 64 * 16; c += 128) {
      const int r = 64 * wg + c / 16, j = c % 16, m = m0 + r;
      const bool ok = m < Sq;
      cp_async16(s_q + swz(r, j, BM), qb + (ok ? m : 0) * q_row + j * 8, ok ? 16 : 0);
    }
    asm volatile("cp.async.wait_all;" ::: "memory");
    fence_async_smem_always();
    named_sync(1 + wg, 128);
  }

  // this thread's two rows (fragment rows r and r + 8 of its warp's 16)
  const int row0 = m0 + 64 * wg + 16 * (warp % 4) + lane / 4;
  const int rows[2] = {row0, row0 + 8};
  float o[64], sc[SN];  // sc: this thread's BN / 2 scores of its two rows
  uint32_t p[SN / 2];
#pragma unroll
  for (int i = 0; i < 64; ++i) o[i] = 0.f;
  float mx[2] = {NEG_INF, NEG_INF}, sum[2] = {0.f, 0.f}, corr[2] = {1.f, 1.f};

  // ping-pong: a warpgroup issues its products only after the other one issued its own
  auto fence_async_smem = [&]() { if (PROXY_FENCE) fence_async_smem_always(); };
  auto turn_wait = [&]() { if (PINGPONG) named_sync(3 + wg, 256); };
  auto turn_pass = [&](bool last) {
    if (PINGPONG && !(last && wg == 1)) asm volatile("bar.arrive %0, 256;" :: "r"(3 + (wg ^ 1)) : "memory");
  };
  auto qk = [&](int s) {
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) {
      const uint64_t da = smem_desc(s_q + (kk >> 2) * BM * 128 + wg * 64 * 128 + (kk & 3) * 32, 16, 1024);
      const uint64_t db = smem_desc(s_k + s * TILE + (kk >> 2) * BN * 128 + (kk & 3) * 32, 16, 1024);
      wgmma_ss___BN__(sc, da, db, kk > 0);
    }
  };
  auto pv = [&](int s) {
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      const uint64_t dv = smem_desc(s_v + s * TILE + kk * 16 * 128, __V_LEAD__, __V_STRIDE__);
      wgmma_rs___D__(o, p + 4 * kk, dv);
    }
  };
  // mask, running max and sum; sc becomes exp2(s * scale_log2 - max), corr the rescale of o
  auto softmax = [&](int n0) {
    bool edge = n0 + BN > Skv;
    if (LEFT < __UNBOUNDED__) edge |= n0 < m0 + BM - 1 - LEFT;
    if (RIGHT < __UNBOUNDED__) edge |= n0 + BN - 1 > m0 + RIGHT;
    if (edge) {
#pragma unroll
      for (int i = 0; i < SN; ++i) {
        const int col = n0 + (i / 4) * 8 + 2 * (lane % 4) + (i % 2), row = rows[(i / 2) % 2];
        bool ok = col < Skv;
        if (LEFT < __UNBOUNDED__) ok &= col >= row - LEFT;
        if (RIGHT < __UNBOUNDED__) ok &= col <= row + RIGHT;
        if (!ok) sc[i] = NEG_INF;
      }
    }
    float tmax[2] = {NEG_INF, NEG_INF}, base[2];
#pragma unroll
    for (int i = 0; i < SN; ++i) tmax[(i / 2) % 2] = fmaxf(tmax[(i / 2) % 2], sc[i]);
#pragma unroll
    for (int x = 0; x < 2; ++x) {
      tmax[x] = fmaxf(tmax[x], __shfl_xor_sync(0xffffffff, tmax[x], 1));
      tmax[x] = fmaxf(tmax[x], __shfl_xor_sync(0xffffffff, tmax[x], 2));
      const float m_new = fmaxf(mx[x], tmax[x]);
      base[x] = m_new == NEG_INF ? 0.f : m_new * scale_log2;
      corr[x] = m_new == NEG_INF ? 1.f : fast_exp2(mx[x] * scale_log2 - base[x]);
      mx[x] = m_new;
      sum[x] *= corr[x];
    }
#pragma unroll
    for (int i = 0; i < SN; ++i) {
      sc[i] = fast_exp2(sc[i] * scale_log2 - base[(i / 2) % 2]);
      sum[(i / 2) % 2] += sc[i];
    }
  };
  auto to_p = [&]() {
#pragma unroll
    for (int i = 0; i < SN; i += 2) p[i / 2] = pack2(sc[i], sc[i + 1]);
  };
  auto rescale_o = [&]() {
#pragma unroll
    for (int i = 0; i < 64; ++i) o[i] *= corr[(i / 2) % 2];
  };

  // a row block that sees no key skips the walk (uniform over the CTA: no barrier is left waiting)
  if (n_tiles > 0 && PINGPONG && wg == 1) asm volatile("bar.arrive %0, 256;" :: "r"(3) : "memory");
  if (n_tiles == 0) {
  } else if (OVERLAP) {
    // products of tile t issued with P V of tile t - 1; softmax of t runs under P V of t - 1
    mbar_wait(full_k(0), 0);
    fence_async_smem();
    turn_wait();
    wgmma_fence();
    qk(0);
    wgmma_commit();
    turn_pass(false);
    wgmma_wait<0>();
    fence_regs<SN>(sc);
    if (lane == 0) mbar_arrive(empty_k(0));
    softmax(t0 * BN);
    to_p();
    for (int t = 1; t < n_tiles; ++t) {
      const int s = t % STAGES, sp = (t - 1) % STAGES;
      mbar_wait(full_k(s), (t / STAGES) & 1);
      mbar_wait(full_v(sp), ((t - 1) / STAGES) & 1);
      fence_async_smem();
      turn_wait();
      wgmma_fence();
      qk(s);
      wgmma_commit();
      pv(sp);
      wgmma_commit();
      turn_pass(false);
      wgmma_wait<1>();
      fence_regs<SN>(sc);
      if (lane == 0) mbar_arrive(empty_k(s));
      softmax((t0 + t) * BN);
      wgmma_wait<0>();
      fence_regs<64>(o);
      if (lane == 0) mbar_arrive(empty_v(sp));
      rescale_o();
      to_p();
    }
    const int sl = (n_tiles - 1) % STAGES;
    mbar_wait(full_v(sl), ((n_tiles - 1) / STAGES) & 1);
    fence_async_smem();
    turn_wait();
    wgmma_fence();
    pv(sl);
    wgmma_commit();
    turn_pass(true);
    wgmma_wait<0>();
    fence_regs<64>(o);
    if (lane == 0) mbar_arrive(empty_v(sl));
  } else {
    for (int t = 0; t < n_tiles; ++t) {
      const int s = t % STAGES, parity = (t / STAGES) & 1;
      mbar_wait(full_k(s), parity);
      fence_async_smem();
      turn_wait();
      wgmma_fence();
      qk(s);
      wgmma_commit();
      turn_pass(false);
      wgmma_wait<0>();
      fence_regs<SN>(sc);
      if (lane == 0) mbar_arrive(empty_k(s));
      softmax((t0 + t) * BN);
      rescale_o();
      to_p();
      mbar_wait(full_v(s), parity);
      fence_async_smem();
      turn_wait();
      wgmma_fence();
      pv(s);
      wgmma_commit();
      turn_pass(t == n_tiles - 1);
      wgmma_wait<0>();
      fence_regs<64>(o);
      if (lane == 0) mbar_arrive(empty_v(s));
    }
  }

  // ---- epilogue: out = o / sum (0 on a row with no key), lse = m * scale + log(sum) ----
#pragma unroll
  for (int x = 0; x < 2; ++x) {
    sum[x] += __shfl_xor_sync(0xffffffff, sum[x], 1);
    sum[x] += __shfl_xor_sync(0xffffffff, sum[x], 2);
  }
  const float ln2 = 0.6931471805599453f;
#pragma unroll
  for (int x = 0; x < 2; ++x) {
    const int row = rows[x];
    if (row >= Sq) continue;
    const float inv = sum[x] > 0.f ? 1.f / sum[x] : 0.f;
    uint16_t* orow = out + (((size_t)b * Sq + row) * H + h) * HD;
#pragma unroll
    for (int i = 2 * x; i < 64; i += 4) {
      const int col = (i / 4) * 8 + 2 * (lane % 4);
      *reinterpret_cast<uint32_t*>(orow + col) = pack2(o[i] * inv, o[i + 1] * inv);
    }
    if (lane % 4 == 0)
      lse[((size_t)b * H + h) * Sq + row] =
          sum[x] > 0.f ? mx[x] * scale_log2 * ln2 + logf(sum[x]) : NEG_INF;
  }
  }
}
"""


def bound(x: int | None) -> int:
    return _UNBOUNDED if x is None else int(x)


ELEMENTS = {"bfloat16": "bf16", "float16": "f16"}  # input dtype -> PTX element type


def source(left: int | None, right: int | None, *, stages: int = 2, overlap: bool = True,
           pingpong: bool = True, feed: str = "tma", proxy_fence: bool | None = None,
           block_n: int = BN, dtype: str = "bfloat16") -> str:
    """The kernel's CUDA C++ for the mask ``i - left <= j <= i + right`` (``None``: unbounded).

    ``feed``: how K/V reach shared memory: ``"tma"`` (tensor maps: ``tmap_templates`` holds K's and
    V's, encoded on the host for the call's shapes; each CTA publishes them with its base
    addresses in its 256-byte slot of ``tmap_slots``), ``"cp.async"``, or ``"none"`` (a timing
    experiment: no copies, the output is not attention). ``proxy_fence``: the consumers' generic ->
    async proxy fence after each wait (needed for cp.async; default on for it only). ``block_n``:
    keys per tile (the wgmma N of ``Q K^T``). V's MN-major descriptor has the 64-column block
    stride (``block_n * 128`` bytes) as its leading offset and 8 keys (1024 bytes) as its stride;
    the other order was built and fails the check.
    """
    if feed not in FEEDS:
        raise ValueError(f"feed must be one of {sorted(FEEDS)}, got {feed!r}")
    if block_n % 16 or not 16 <= block_n <= 256:
        raise ValueError(f"block_n must be a multiple of 16 in [16, 256], got {block_n}")
    if stages < 1:
        raise ValueError(f"stages must be >= 1, got {stages}")
    if dtype not in ELEMENTS:
        raise ValueError(f"dtype must be one of {sorted(ELEMENTS)}, got {dtype!r}")
    for name, x in (("left", left), ("right", right)):
        if x is not None and (isinstance(x, bool) or not isinstance(x, int) or abs(x) >= _UNBOUNDED):
            raise ValueError(f"{name} must be an int of magnitude < 2**30 or None, got {x!r}")
    subs = {
        "__BM__": BM, "__BN__": block_n, "__D__": D, "__STAGES__": stages, "__LEFT__": bound(left),
        "__RIGHT__": bound(right), "__THREADS__": THREADS, "__NAME__": KERNEL_NAME,
        "__UNBOUNDED__": _UNBOUNDED, "__CONSUMER_WARPS__": CONSUMER_WARPS, "__V_LEAD__": block_n * 128,
        "__V_STRIDE__": 1024, "__OVERLAP__": str(overlap).lower(),
        "__PINGPONG__": str(pingpong).lower(), "__PRODUCER_WARPS__": PRODUCER_WARPS,
        "__FEED__": FEEDS[feed], "__PROXY_FENCE__": str(feed == "cp.async" if proxy_fence is None
                                                        else proxy_fence).lower(),
        "__PRODUCER_REGS__": PRODUCER_REGS, "__CONSUMER_REGS__": CONSUMER_REGS, "__ELEM__": ELEMENTS[dtype],
    }
    text = _HELPERS + _wgmma_ss(block_n) + _wgmma_rs(D) + _KERNEL
    for key, val in subs.items():
        text = text.replace(key, str(val))
    return text


def with_unique_name(text: str) -> tuple[str, str]:
    """``(name, text)``: the kernel renamed ``splat_fwd_<digest of the source>``.

    jaxlib keeps the modules it loaded keyed by kernel name, shared memory and PTX; a kernel
    handed over as a cubin has no PTX, so two variants of one name and shared-memory size would
    share the first one loaded. A name derived from the source tells every variant apart.
    """
    name = f"splat_fwd_{hashlib.sha256(text.encode()).hexdigest()[:20]}"
    return name, text.replace(KERNEL_NAME, name)
