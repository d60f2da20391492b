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


def _encode(dims, strides, box, steps, what: str) -> bytes:
    """The 128-byte tensor map of 16-bit elements with global ``dims`` (innermost first), byte
    ``strides`` of the outer ones, ``box`` and traversal ``steps``: 128-byte swizzled, zero fill
    out of bounds, at the dummy base address the kernel replaces. ``what`` names the call in errors."""
    u64, u32 = ctypes.c_uint64, ctypes.c_uint32
    rank = len(dims)
    raw = ctypes.create_string_buffer(TEMPLATE_BYTES + 64)  # CUtensorMap is 64-byte aligned
    at = -ctypes.addressof(raw) % 64
    status = _driver().cuTensorMapEncodeTiled(
        ctypes.c_void_p(ctypes.addressof(raw) + at), _UINT16, u32(rank), ctypes.c_void_p(_DUMMY_BASE),
        (u64 * rank)(*dims), (u64 * (rank - 1))(*strides), (u32 * rank)(*box), (u32 * rank)(*steps),
        _INTERLEAVE_NONE, _SWIZZLE_128B, _L2_PROMOTION_256B, _OOB_FILL_NONE,
    )
    if status:
        raise RuntimeError(f"cuTensorMapEncodeTiled({what}) failed: CUresult {status}")
    return raw.raw[at : at + TEMPLATE_BYTES]


def _check_rows(D: int) -> None:
    if (D * 2) % 16:
        raise ValueError(f"head dim {D}: rows of {D * 2} bytes are not whole 16-byte chunks (TMA strides)")


@functools.lru_cache(maxsize=256)
def bshd_template(shape: tuple[int, int, int, int], box_rows: int) -> bytes:
    """The 128-byte tensor map of a contiguous 16-bit ``[B, S, H, D]`` array (``D * 2`` bytes a
    multiple of 16): boxes of 64 head-dim columns x one head x ``box_rows`` rows x one batch,
    128-byte swizzled, zero fill out of bounds (a box past ``D``, as the last of a head dim that
    is no multiple of 64, reads zeros there, and a store of one writes only the columns inside)."""
    B, S, H, D = shape
    _check_rows(D)
    return _encode((D, H, S, B), (D * 2, H * D * 2, S * H * D * 2), (64, 1, box_rows, 1), (1, 1, 1, 1),
                   f"{shape}, box_rows={box_rows}")


@functools.lru_cache(maxsize=256)
def grid_template(shape: tuple[int, int, int, int], grid: tuple[int, int, int], box: tuple[int, int, int],
                  dilation: tuple[int, int, int]) -> bytes:
    """The 128-byte tensor map of a contiguous 16-bit ``[B, S, H, D]`` array whose ``S`` tokens are
    the row-major grid ``grid`` (3 axes, outermost first): 5 dimensions ``(D, H, grid[2], grid[1],
    B * grid[0])`` (batch and outermost axis merged: one stride), boxes of 64 head-dim columns x
    one head x ``box[a]`` coordinates on each axis taken every ``dilation[a]``-th (the traversal
    stride, at most 8), 128-byte swizzled, zero fill out of bounds. A box lands in shared memory
    as ``prod(box)`` rows of 128 bytes, last axis fastest: the layout of :func:`bshd_template`'s."""
    B, S, H, D = shape
    g0, g1, g2 = grid
    if g0 * g1 * g2 != S:
        raise ValueError(f"grid {grid} does not hold the {S} tokens of shape {shape}")
    _check_rows(D)
    if not all(1 <= d <= 8 for d in dilation):
        raise ValueError(f"dilation {dilation}: TMA traversal strides are 1 to 8")
    if not all(1 <= b * d <= 256 for b, d in zip(box, dilation, strict=True)):
        raise ValueError(f"box {box} with dilation {dilation}: a box spans 1 to 256 coordinates an axis")
    row = H * D * 2  # bytes between consecutive tokens
    return _encode(
        (D, H, g2, g1, B * g0), (D * 2, row, g2 * row, g1 * g2 * row),
        (64, 1, box[2] * dilation[2], box[1] * dilation[1], box[0] * dilation[0]),
        (1, 1, dilation[2], dilation[1], dilation[0]),
        f"{shape}, grid={grid}, box={box}, dilation={dilation}",
    )
