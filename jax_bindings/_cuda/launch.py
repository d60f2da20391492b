"""One JAX primitive that launches a compiled cubin through jaxlib's GPU kernel call.

jaxlib's ``triton_kernel_call`` custom call (the one jax-triton lowers to) launches any kernel
given its name, grid, warps, shared memory and parameter list; with the cubin attached as the
call's module image (:func:`jax_bindings._kernel_proto.with_module_image`) it loads that cubin
and never looks at PTX. So a CUDA C++ kernel compiled by :mod:`jax_bindings._cuda.compiler`
runs inside a jitted program like splat's Triton kernels: on XLA's stream, in its command
buffers, with no host round trip.

Parameters are passed in jaxlib's order: the array inputs, then the scalars, then the array
outputs; a kernel's signature must follow it.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import jax
import jax.extend as jex
import numpy as np
from jax.interpreters import mlir

from jax_bindings import _kernel_proto

_SCALAR_TYPES = ("i32", "fp32")


@dataclass(frozen=True)
class Launch:
    """A compiled kernel and how to launch it (static: a primitive parameter, hashed by value).

    Attributes:
      name: the kernel's ``extern "C"`` name in ``image``, unique to that cubin: jaxlib keeps
        loaded kernels keyed by name, shared memory and PTX, and a cubin comes with no PTX.
      image: the cubin.
      grid: CTAs along x, y, z.
      threads: threads per CTA (a multiple of 32).
      smem: dynamic shared memory bytes.
      scalars: ``(type, value)`` of the scalar parameters, type in ``("i32", "fp32")``.
      outs: ``(shape, dtype name)`` of the array outputs.
      cc: compute capability the cubin is for (e.g. 90).
      zeroed: indices (into ``outs``) of the outputs the kernel call zeroes before the launch.
    """

    name: str
    image: bytes
    grid: tuple[int, int, int]
    threads: int
    smem: int
    scalars: tuple[tuple[str, int | float], ...]
    outs: tuple[tuple[tuple[int, ...], str], ...]
    cc: int
    zeroed: tuple[int, ...] = ()

    def __post_init__(self):
        if self.threads % 32 or not 32 <= self.threads <= 1024:
            raise ValueError(f"threads must be a multiple of 32 in [32, 1024], got {self.threads}")
        if len(self.grid) != 3 or min(self.grid) < 1 or self.grid[1] > 65535 or self.grid[2] > 65535:
            raise ValueError(f"grid must be 3 positive extents (y, z < 65536), got {self.grid}")
        for t, _ in self.scalars:
            if t not in _SCALAR_TYPES:
                raise ValueError(f"scalar type must be one of {_SCALAR_TYPES}, got {t!r}")
        if any(not 0 <= i < len(self.outs) for i in self.zeroed):
            raise ValueError(f"zeroed must index outs (0..{len(self.outs) - 1}), got {self.zeroed}")


_p = jex.core.Primitive("splat_cuda_kernel")
_p.multiple_results = True


@_p.def_abstract_eval
def _abstract(*args, launch: Launch):
    return [jax.core.ShapedArray(shape, np.dtype(dt)) for shape, dt in launch.outs]


def _lowering(ctx, *args, launch: Launch):
    from jax._src.lib import gpu_triton as tk  # CUDA jaxlib only

    kernel = tk.TritonKernel(launch.name, launch.threads // 32, 1, launch.smem, "", "", launch.cc)
    arr = tk.create_array_parameter(0, 16)
    params = [arr] * len(args)
    params += [tk.create_scalar_parameter(int(v) if t == "i32" else float(v), t) for t, v in launch.scalars]
    for i, (shape, dt) in enumerate(launch.outs):
        nbytes = int(np.prod(shape)) * np.dtype(dt).itemsize if i in launch.zeroed else 0
        params.append(tk.create_array_parameter(nbytes, 16))
    call = tk.TritonKernelCall(kernel, *launch.grid, params)
    proto = _kernel_proto.with_module_image(call.to_proto(launch.name, b""), lambda _ptx, _cc: launch.image)
    rule = jax.ffi.ffi_lowering("triton_kernel_call", api_version=2, backend_config=zlib.compress(proto))
    return rule(ctx, *args)


mlir.register_lowering(_p, _lowering, platform="cuda")


def run(launch: Launch, *args: jax.Array) -> list[jax.Array]:
    """Launches ``launch`` on ``args`` (the kernel's array inputs, in order); returns its outputs."""
    return list(_p.bind(*args, launch=launch))
