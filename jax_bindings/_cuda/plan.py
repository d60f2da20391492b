"""Which generated kernel runs a call, and everything it needs besides the arrays (no JAX here).

:func:`fwd_variant` picks the :class:`FwdVariant` for a layout, head dim and dtype (or refuses
with ``NotImplementedError`` naming why); :func:`compiled` gives its kernel name and cubin;
:func:`grid` and :func:`tensor_maps` the launch geometry and the TMA templates. The JAX backend
(:mod:`jax_bindings._cuda.backend`) and the sanitizer's direct launches
(``benchmarks/sanitize_cuda.py``) both start here.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import acsr
from acsr import ACSR
from jax_bindings._cuda import compiler, source, tensor_map

HEAD_DIMS = (source.D,)
DTYPES = tuple(source.ELEMENTS)


@dataclass(frozen=True)
class FwdVariant:
    """One generated forward kernel: the band baked in and the schedule.

    ``block_n``: keys per tile (176 on the dense mask, whose long rows amortise the wider tile's
    edge; 128 elsewhere: measured on H100, see ``benchmarks/NOTES.md``); ``stages``: K/V ring
    depth; consumer overlap and ping-pong always on (the spike's best on every mask);
    ``persistent``: one CTA per SM taking work tiles in turn (on bands bounded on the left, whose
    row blocks all walk about as far: 1.06-1.24x the grid launch on H100), else one CTA per row
    block (dense and causal, where the hardware's dynamic block scheduling balances the unequal
    walks better than the persistent CTAs' static turns: 0.84x on causal at S=16384).
    """

    band: acsr.Band
    dtype: str
    block_n: int = source.BN
    stages: int = 2
    persistent: bool = False

    def named_source(self) -> tuple[str, str]:
        """``(kernel name, CUDA C++)``, the name unique to the source (:func:`source.with_unique_name`)."""
        return source.with_unique_name(source.source(
            self.band.left, self.band.right, stages=self.stages, block_n=self.block_n, dtype=self.dtype,
            persistent=self.persistent))

    @property
    def smem(self) -> int:
        return source.smem_bytes(self.stages, self.block_n)


def fwd_variant(layout: ACSR, head_dim: int, dtype: str) -> FwdVariant:
    """The forward kernel for this call, or NotImplementedError saying why none is generated."""
    if head_dim not in HEAD_DIMS:
        raise NotImplementedError(f"the cuda kernels take head dim {HEAD_DIMS}, got {head_dim}")
    if dtype not in DTYPES:
        raise NotImplementedError(f"the cuda kernels take dtypes {DTYPES}, got {dtype}")
    band = acsr.band(layout)
    if band is None:
        family = acsr.pattern_family(layout)
        raise NotImplementedError(f"the cuda kernels take one-band masks; this one is {family}")
    dense = band.left is None and band.right is None
    return FwdVariant(band, dtype, block_n=176 if dense else source.BN, persistent=band.left is not None)


@functools.lru_cache(maxsize=64)
def compiled(variant: FwdVariant) -> tuple[str, bytes]:
    """``(kernel name, cubin)`` of ``variant`` (compiled once per process; disk-cached across them)."""
    name, text = variant.named_source()
    return name, compiler.cubin(text)


def grid(q_shape: tuple[int, ...], persistent: bool, sm_count: int) -> tuple[int, int, int]:
    """CTAs of the forward over ``q [B, Sq, H, D]``: (row blocks, heads, batch), or, persistent,
    one per SM (``sm_count``) up to the number of work tiles."""
    B, Sq, H, _ = q_shape
    row_blocks = -(-Sq // source.BM)
    if persistent:
        return min(sm_count, row_blocks * H * B), 1, 1
    return row_blocks, H, B


def tensor_maps(block_n: int, q_shape, k_shape, v_shape) -> bytes:
    """The K, V and Q tensor-map templates the kernel takes, 128 bytes each (K/V boxes of
    ``block_n`` rows, Q boxes of a row block)."""
    return b"".join(
        tensor_map.bshd_template(tuple(shape), rows)
        for shape, rows in ((k_shape, block_n), (v_shape, block_n), (q_shape, source.BM))
    )
