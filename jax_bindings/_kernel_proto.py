"""jaxlib's Triton kernel-call proto, read and written at the wire level (no protobuf dependency).

jax-triton's custom call carries a zlib-compressed ``TritonAnyKernelCall``
(``jaxlib/gpu/triton.proto``): ``kernel_call`` (1) -> ``TritonKernelCall.kernel``
(1) -> ``TritonKernel`` {``kernel_name`` 1, ``shared_mem_bytes`` 3, ``ptx`` 4,
``compute_capability`` 6, ``module_image`` 11}. :func:`with_module_image` fills
``module_image`` (``ModuleImageProto`` {``object_file`` 1, ``kernel_name`` 2,
``shared_mem_bytes`` 3}) so jaxlib loads that cubin instead of assembling the PTX.
Every other field passes through byte for byte.
"""

from __future__ import annotations

from collections.abc import Callable

_ANY_KERNEL_CALL, _KERNEL_CALL, _KERNEL = 1, 1, 1  # TritonAnyKernelCall / TritonKernelCall fields
_K_NAME, _K_SHARED, _K_PTX, _K_CC, _K_IMAGE = 1, 3, 4, 6, 11  # TritonKernel fields


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    v = shift = 0
    while True:
        b = buf[i]
        i += 1
        v |= (b & 0x7F) << shift
        shift += 7
        if b < 0x80:
            return v, i


def _put_varint(v: int) -> bytes:
    out = bytearray()
    while True:
        b = v & 0x7F
        v >>= 7
        out.append(b | (0x80 if v else 0))
        if not v:
            return bytes(out)


def pb_fields(buf: bytes) -> list[tuple[int, int, int | bytes]]:
    """A protobuf message as ``(field, wire type, value)``: ints for varints, bytes otherwise."""
    out, i = [], 0
    while i < len(buf):
        tag, i = _varint(buf, i)
        num, wt = tag >> 3, tag & 7
        if wt == 0:
            v, i = _varint(buf, i)
        elif wt == 2:
            n, i = _varint(buf, i)
            v, i = buf[i : i + n], i + n
        elif wt in (1, 5):
            n = 8 if wt == 1 else 4
            v, i = buf[i : i + n], i + n
        else:
            raise ValueError(f"unsupported protobuf wire type {wt} (field {num})")
        if i > len(buf):
            raise ValueError("truncated protobuf message")
        out.append((num, wt, v))
    return out


def pb_bytes(fields: list[tuple[int, int, int | bytes]]) -> bytes:
    """Inverse of :func:`pb_fields`."""
    out = bytearray()
    for num, wt, v in fields:
        out += _put_varint(num << 3 | wt)
        if wt == 0:
            out += _put_varint(v)
        elif wt == 2:
            out += _put_varint(len(v)) + v
        else:
            out += v
    return bytes(out)


def _replace(fields, num: int, fn) -> tuple[list, bool]:
    """``fields`` with the (length-delimited) field ``num`` mapped through ``fn``; whether it was there."""
    out, seen = [], False
    for f, wt, v in fields:
        if f == num and wt == 2:
            v, seen = fn(v), True
        out.append((f, wt, v))
    return out, seen


def with_module_image(call_proto: bytes, image: Callable[[str, int], bytes | None]) -> bytes:
    """``call_proto`` (a serialized ``TritonAnyKernelCall``) with the kernel's cubin attached.

    ``image(ptx, compute_capability)`` returns the cubin, or None to leave the
    kernel as it is (``ptx`` is "" for a kernel given no PTX: one compiled from CUDA
    C++). Calls that are not a single kernel call (autotuned) and kernels that
    already carry an image come back unchanged.
    """

    def kernel(buf: bytes) -> bytes:
        fields = pb_fields(buf)
        by = {f: v for f, _, v in fields}
        if _K_IMAGE in by:
            return buf
        img = image(by.get(_K_PTX, b"").decode(), int(by.get(_K_CC, 0)))
        if img is None:
            return buf
        name = by.get(_K_NAME, b"")
        shared = int(by.get(_K_SHARED, 0))
        module = pb_bytes([(1, 2, img), (2, 2, name), (3, 0, shared)])
        return pb_bytes([*fields, (_K_IMAGE, 2, module)])

    def kernel_call(buf: bytes) -> bytes:
        return pb_bytes(_replace(pb_fields(buf), _KERNEL, kernel)[0])

    fields, seen = _replace(pb_fields(call_proto), _ANY_KERNEL_CALL, kernel_call)
    return pb_bytes(fields) if seen else call_proto
