"""Launchers: run a :class:`~jax_bindings._triton.ops.Call` on numpy (Triton's interpreter) or torch.

Triton's interpreter reads tensors through ``data_ptr()`` and a few torch
storage methods; :class:`_HostArray` gives a numpy array exactly those, so
the generated kernels run on the CPU in CI with no torch installed. (The
interpreter's ``tl.dot`` mishandles bfloat16 operands, so interpreter tests
use float16 and float32; bfloat16 runs in the GPU tests.)
"""

from __future__ import annotations

import os

import numpy as np

from jax_bindings._triton.ops import Call


class _Storage:
    def __init__(self, a: np.ndarray):
        self._a = a

    def data_ptr(self) -> int:
        return self._a.ctypes.data

    def cpu(self):
        return self

    def copy_(self, other):  # host memory already holds the results
        return self


class _HostArray:
    """The slice of torch.Tensor's interface that Triton's interpreter touches."""

    def __init__(self, a: np.ndarray):
        if not a.flags.c_contiguous:
            raise ValueError("interpreter launches need C-contiguous arrays")
        self.a = a
        self.dtype = a.dtype
        self.shape = a.shape

    def data_ptr(self) -> int:
        return self.a.ctypes.data

    def untyped_storage(self):
        return _Storage(self.a)

    def storage_offset(self) -> int:
        return 0

    def size(self):
        return self.a.shape

    def stride(self):
        return tuple(s // self.a.itemsize for s in self.a.strides)

    def new_empty(self, *args, **kwargs):
        return _HostArray(self.a)

    def set_(self, *args):
        return self

    def copy_(self, other):
        return self


def _np_dtype(name: str):
    if name == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(name)


def run_numpy(call: Call, *data: np.ndarray, poison: bool = True) -> list[np.ndarray]:
    """Runs ``call`` under Triton's interpreter on numpy arrays; returns the outputs.

    The kernel module must have been loaded with ``interpret=True``. Outputs
    start poisoned (NaN, or -1 for integers) so unwritten elements show up, except those the call
    zeroes (``call.zeroed``).
    """
    outs = []
    for i, (shape, dt) in enumerate(call.out):
        a = np.empty(shape, _np_dtype(dt))
        poisoned = -1 if np.issubdtype(a.dtype, np.integer) else np.nan
        a[...] = 0 if (not poison or i in call.zeroed) else poisoned
        outs.append(a)
    args = [_HostArray(np.ascontiguousarray(x)) for x in (*data, *call.meta)] + [_HostArray(o) for o in outs]
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"  # the interpreter consults it while launching, too
    try:
        call.kernel[call.grid](*args, **call.constexprs)
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old
    return outs


_TORCH_META: dict = {}


def _torch_meta(call: Call, dev):
    """Metadata operands on ``dev``, copied once per plan (not on every launch)."""
    import torch

    key = (id(call.plan), str(dev))
    hit = _TORCH_META.get(key)
    if hit is None or hit[0] is not call.plan:
        hit = (call.plan, [torch.from_numpy(np.ascontiguousarray(m)).to(dev) for m in call.meta])
        _TORCH_META[key] = hit
    return hit[1]


def run_torch(call: Call, *data):
    """Runs ``call`` with torch tensors (CUDA: compiled; CPU + interpreter: interpreted)."""
    import torch

    dev = data[0].device
    dts = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
           "int32": torch.int32}
    meta = _torch_meta(call, dev)
    outs = [(torch.zeros if i in call.zeroed else torch.empty)(shape, dtype=dts[dt], device=dev)
            for i, (shape, dt) in enumerate(call.out)]
    call.kernel[call.grid](
        *data, *meta, *outs, num_warps=call.num_warps, num_stages=call.num_stages, **call.constexprs
    )
    return outs
