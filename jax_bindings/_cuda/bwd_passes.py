"""The passes around the backward kernel (:mod:`jax_bindings._cuda.bwd_source`), as CUDA kernels.

Before it, per row, ``delta = rowsum(dout * out)`` and ``lse2``, the forward's ``lse`` in base 2,
both ``[B, H, Sq_pad]`` fp32 (delta 0 and lse2 +inf on the padding; lse2 +inf where lse is -inf,
the rows that see no key);
after it, ``dq`` in rows (``[B, Sq, H, D]``, the input's type, times ``scale``) from the kernel's
``dq_acc`` (fp32, each query block in the consumers' fragment order: ``bwd_source``'s comment on
``fragment_axes``; ``bwd_source.dq_from_acc`` is the same in NumPy or JAX, the tests'
reference), 0 on the rows that see no key (``lse2 = +inf``), whatever ``dq_acc`` holds there.

Both are bandwidth-bound (at S = 8192, 16 heads: 67 MB read for delta, 67 MB read and 34 MB
written for dq). Here a half-warp takes a row of delta (16 B of ``out`` and of ``dout`` a
lane), and a CTA a query block of dq, each lane writing 16 B of a row from the 32 contiguous
bytes the fragment order holds them in. On H100 at S = 8192 they took 24.6 + 33.2 us where
XLA's fusions took 25.9 + 39.9, and delta no longer depends on the layouts XLA picks for an
einsum on the folded arrays of a band in phases. lse2 comes with delta (it was one more XLA
fusion and launch), and dq's CTAs take the last (batch, head)s first, whose sums the kernel
finished last: in block-local's chained forward+backward at S = 8192, 26.3 + 37.2 us where they
took 24.7 + 39.2 and the fusion 1.9. Each thread issues all its loads before using any (``lse``
with the row's values; dq's blocks with their rows' ``lse2``, masked after): 25.0 + 35.3 us.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jax_bindings._cuda import bwd_source, compiler, launch, source

THREADS = 256
ROWS_PER_CTA = THREADS // 16  # delta: a half-warp a row
# log2(e) as the float32 XLA multiplied lse by (lse2 bit for bit as before this pass made it)
LOG2E_F32 = repr(float(np.float32(math.log2(math.e))))

# to fp32 from the element type (source.HELPERS has pack2, the other way)
_CONVERT = r"""
__device__ __forceinline__ float to_f32(uint16_t x) {
  float f;
  asm("cvt.f32.__ELEM__ %0, %1;" : "=f"(f) : "h"(x));
  return f;
}
"""

_DELTA = r"""
constexpr int D = __D__;
// delta[b, h, s] = sum over the row's D values of dout * out (fp32), 0 where s >= Sq; lse2[b, h, s]
// = lse[b, h, s] log2(e), +inf where lse is -inf or s >= Sq. Rows are taken in [B, Sq_pad, H]
// order, a half-warp each, 8 values a lane at a time (D is a multiple of 16).
extern "C" __global__ void __launch_bounds__(__THREADS__) __NAME__(
    const uint16_t* __restrict__ out, const uint16_t* __restrict__ dout, const float* __restrict__ lse, int B,
    int Sq, int H, int sq_pad, float* __restrict__ delta, float* __restrict__ lse2) {
  const long long row = (long long)blockIdx.x * __ROWS__ + threadIdx.x / 16;
  const int part = threadIdx.x % 16, h = row % H, s = (row / H) % sq_pad, b = row / H / sq_pad;
  float acc = 0.f, l = -__int_as_float(0x7f800000);
  if (b < B && s < Sq) {
    l = lse[((size_t)b * H + h) * Sq + s];  // with the row's loads (one word for the half-warp)
#pragma unroll
    for (int c = part * 8; c < D; c += 128) {
      const size_t off = (((size_t)b * Sq + s) * H + h) * D + c;
      const uint4 o = *reinterpret_cast<const uint4*>(out + off);
      const uint4 d = *reinterpret_cast<const uint4*>(dout + off);
      const uint32_t ow[4] = {o.x, o.y, o.z, o.w}, dw[4] = {d.x, d.y, d.z, d.w};
#pragma unroll
      for (int x = 0; x < 4; ++x) {
        acc += to_f32(ow[x] & 0xffff) * to_f32(dw[x] & 0xffff);
        acc += to_f32(ow[x] >> 16) * to_f32(dw[x] >> 16);
      }
    }
  }
#pragma unroll
  for (int m = 8; m; m >>= 1) acc += __shfl_xor_sync(0xffffffff, acc, m);
  if (part == 0 && b < B) {
    delta[((size_t)b * H + h) * sq_pad + s] = acc;
    lse2[((size_t)b * H + h) * sq_pad + s] = l == -__int_as_float(0x7f800000) ? __int_as_float(0x7f800000)
                                                                               : l * __LOG2E__f;
  }
}
"""

_DQ_ROWS = r"""
constexpr int BM = __BM__, HD = __HD__, D = __D__, GROUPS = HD / 16;
// dq rows of query block i of (b, h), one CTA each: row r, columns 8k .. 8k + 7 are 8 contiguous
// floats of the block's fragment order (warpgroup k / GROUPS, column group k % GROUPS, row half
// (r / 8) % 2, warp r / 16, lane / 4 = r % 8), written as 16 bytes where they are columns of the D
// (HD: D padded to whole 64-column blocks); 0 on rows whose lse2 is +inf. The last
// (batch, head)s first: the backward kernel added to theirs last, so their sums may still be in L2.
extern "C" __global__ void __launch_bounds__(__THREADS__) __NAME__(
    const float* __restrict__ dq_acc, const float* __restrict__ lse2, int Sq, int H, int nq, float scale,
    uint16_t* __restrict__ dq) {
  const int blk = gridDim.x - 1 - blockIdx.x;
  const int i = blk % nq, h = (blk / nq) % H, b = blk / nq / H;
  const float* block = dq_acc + (size_t)blk * (BM * HD);
  // every load first (the block and lse2 hold the padding rows: in bounds), so that none waits on
  // another's result; what a row that sees no key (or none at all) holds is masked off after
  constexpr int PER_THREAD = BM * HD / 8 / __THREADS__;
  static_assert(PER_THREAD * __THREADS__ == BM * HD / 8, "every 16 bytes of the block to one thread");
  float4 x[PER_THREAD][2];
  float l2[PER_THREAD];
#pragma unroll
  for (int t = 0; t < PER_THREAD; ++t) {
    const int c = threadIdx.x + t * __THREADS__, r = c / (HD / 8), k = c % (HD / 8);
    const float4* p = reinterpret_cast<const float4*>(
        block + (k / GROUPS) * (BM * HD / 2) + (k % GROUPS) * 512 + ((r / 8) % 2) * 256 + (r / 16) * 64
        + (r % 8) * 8);
    x[t][0] = p[0];
    x[t][1] = p[1];
    l2[t] = lse2[((size_t)b * H + h) * nq * BM + i * BM + r];
  }
#pragma unroll
  for (int t = 0; t < PER_THREAD; ++t) {
    const int c = threadIdx.x + t * __THREADS__, r = c / (HD / 8), k = c % (HD / 8), s = i * BM + r;
    const uint32_t keep = l2[t] != __int_as_float(0x7f800000) ? 0xffffffffu : 0u;
    const float4 x0 = x[t][0], x1 = x[t][1];
    const uint4 y = make_uint4(
        pack2(x0.x * scale, x0.y * scale) & keep, pack2(x0.z * scale, x0.w * scale) & keep,
        pack2(x1.x * scale, x1.y * scale) & keep, pack2(x1.z * scale, x1.w * scale) & keep);
    if (s < Sq && (D == HD || 8 * k < D))
      *reinterpret_cast<uint4*>(dq + (((size_t)b * Sq + s) * H + h) * D + 8 * k) = y;
  }
}
"""


KERNELS = {"delta": _DELTA, "dq_rows": _DQ_ROWS}


def pass_source(kernel: str, dtype: str, head_dim: int = bwd_source.D) -> str:
    """The CUDA C++ of ``kernel`` (:data:`KERNELS`) for arrays of ``dtype`` (``source.ELEMENTS``) and
    ``head_dim``, named ``__NAME__``."""
    subs = {"__ELEM__": source.ELEMENTS[dtype], "__D__": head_dim, "__HD__": source.padded_head_dim(head_dim),
            "__BM__": bwd_source.BM,
            "__THREADS__": THREADS, "__ROWS__": ROWS_PER_CTA, "__LOG2E__": LOG2E_F32}
    text = source.HELPERS + _CONVERT + KERNELS[kernel]
    for key, val in subs.items():
        text = text.replace(key, str(val))
    return text


@functools.lru_cache(maxsize=32)
def compiled(kernel: str, dtype: str, head_dim: int = bwd_source.D) -> tuple[str, bytes]:
    """``(kernel name, cubin)`` of ``kernel`` (:data:`KERNELS`) for ``dtype`` and ``head_dim``."""
    text = pass_source(kernel, dtype, head_dim)
    name, text = source.with_unique_name(text, "__NAME__", f"splat_bwd_{kernel}")
    return name, compiler.cubin(text)


def delta_lse2(out: jax.Array, dout: jax.Array, lse: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(delta, lse2)``: ``rowsum(dout * out)`` of ``[B, Sq, H, D]`` arrays and ``lse`` (``[B, H,
    Sq]``, the forward's) times log2(e), each ``[B, H, Sq_pad]`` fp32 (``Sq_pad``: ``Sq`` in query
    blocks of ``bwd_source.BM``; on the padding delta 0, lse2 +inf; lse2 +inf where lse is -inf)."""
    B, Sq, H, D = out.shape
    sq_pad = bwd_source.num_q_blocks(Sq) * bwd_source.BM
    name, image = compiled("delta", jnp.dtype(out.dtype).name, D)
    spec = launch.Launch(
        name=name, image=image, grid=(-(-B * sq_pad * H // ROWS_PER_CTA), 1, 1), threads=THREADS, smem=0,
        scalars=(("i32", B), ("i32", Sq), ("i32", H), ("i32", sq_pad)),
        outs=(((B, H, sq_pad), "float32"), ((B, H, sq_pad), "float32")), cc=90)
    delta, lse2 = launch.run(spec, out, dout.astype(out.dtype), lse.astype(jnp.float32))
    return delta, lse2


def dq_rows(dq_acc: jax.Array, lse2: jax.Array, sq: int, scale: float, dtype, head_dim: int = bwd_source.D
            ) -> jax.Array:
    """``dq [B, Sq, H, head_dim]`` of ``dtype`` from the backward kernel's ``dq_acc`` (``[B, H, nq,
    BM * HD]``, ``bwd_source.dq_acc_shape``) times ``scale``, 0 where ``lse2`` (``[B, H, nq * BM]``,
    as the kernel took it) is +inf."""
    B, H, nq, _ = dq_acc.shape
    dt = jnp.dtype(dtype).name
    name, image = compiled("dq_rows", dt, head_dim)
    spec = launch.Launch(
        name=name, image=image, grid=(B * H * nq, 1, 1), threads=THREADS, smem=0,
        scalars=(("i32", sq), ("i32", H), ("i32", nq), ("fp32", float(scale))),
        outs=(((B, sq, H, head_dim), dt),), cc=90)
    (result,) = launch.run(spec, dq_acc, lse2)
    return result
