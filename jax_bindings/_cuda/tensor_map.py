"""Tensor-map templates for the TMA copies of the generated kernels, encoded through the driver.

jaxlib's kernel call passes buffers and scalars only, so a ``CUtensorMap`` (128 bytes, a kernel
parameter in CUDA's own launches) cannot reach the kernel directly. The host encodes one
*template* per tensor with ``cuTensorMapEncodeTiled`` (shape, strides, box, swizzle) for a
dummy base address; the kernel copies it to shared memory, sets its real base address with
``tensormap.replace`` and publishes it to global memory before its first bulk copy (see
:mod:`jax_bindings._cuda.source`). The templates travel as a constant ``uint8`` input.

The driver is reached with ctypes (``libcuda.so.1``), so no Python binding is needed.
"""

from __future__ import annotations

import ctypes
import functools

# CUtensorMap enums (cuda.h)
_UINT16 = 1  # element type: 16-bit bit patterns (bf16 and fp16 alike; out-of-bounds fill is 0 = +0.0)
_INTERLEAVE_NONE = 0
_SWIZZLE_128B = 3
_L2_PROMOTION_256B = 3
_OOB_FILL_NONE = 0
_DUMMY_BASE = 1024  # 16-byte aligned; the kernel replaces it
TEMPLATE_BYTES = 128


@functools.cache
def _driver() -> ctypes.CDLL:
    lib = ctypes.CDLL("libcuda.so.1")
    status = lib.cuInit(0)
    if status:
        raise OSError(f"cuInit failed with CUresult {status}")
    return lib


def available() -> str | None:
    """None when the driver's ``cuTensorMapEncodeTiled`` can be called here, else why not."""
    try:
        lib = _driver()
        lib.cuTensorMapEncodeTiled  # noqa: B018 -- only present on CUDA 12+ drivers
    except (OSError, AttributeError) as e:
        return f"no CUDA driver with cuTensorMapEncodeTiled ({e})"
    return None


@functools.lru_cache(maxsize=256)
def bshd_template(shape: tuple[int, int, int, int], box_rows: int) -> bytes:
    """The 128-byte tensor map of a contiguous 16-bit ``[B, S, H, D]`` array (``D * 2`` bytes a
    multiple of 128): boxes of 64 head-dim columns x one head x ``box_rows`` rows x one batch,
    128-byte swizzled, zero fill out of bounds."""
    B, S, H, D = shape
    if (D * 2) % 128:
        raise ValueError(f"head dim {D}: rows of {D * 2} bytes are not whole 128-byte swizzle rows")
    u64, u32 = ctypes.c_uint64, ctypes.c_uint32
    dims = (u64 * 4)(D, H, S, B)
    strides = (u64 * 3)(D * 2, H * D * 2, S * H * D * 2)
    box = (u32 * 4)(64, 1, box_rows, 1)
    ones = (u32 * 4)(1, 1, 1, 1)
    raw = ctypes.create_string_buffer(TEMPLATE_BYTES + 64)  # CUtensorMap is 64-byte aligned
    at = -ctypes.addressof(raw) % 64
    status = _driver().cuTensorMapEncodeTiled(
        ctypes.c_void_p(ctypes.addressof(raw) + at), _UINT16, u32(4), ctypes.c_void_p(_DUMMY_BASE),
        dims, strides, box, ones, _INTERLEAVE_NONE, _SWIZZLE_128B, _L2_PROMOTION_256B, _OOB_FILL_NONE,
    )
    if status:
        raise RuntimeError(f"cuTensorMapEncodeTiled({shape}, box_rows={box_rows}) failed: CUresult {status}")
    return raw.raw[at : at + TEMPLATE_BYTES]
