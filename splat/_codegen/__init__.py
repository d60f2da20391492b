"""Code generator: ACSR layouts -> specialised Triton kernels (internal).

* :mod:`._spec`   -- :class:`KernelSpec` / :class:`Plan` derived from a layout;
* :mod:`._render` -- renders Triton source text from a spec;
* :mod:`._cache`  -- writes it to ``$SPLAT_CACHE_DIR`` (``~/.cache/splat/kernels``),
  imports it, caches by spec; ``SPLAT_DUMP_KERNELS=1`` dumps the source;
* :mod:`._ops`    -- launch descriptions (:class:`Call`) per op;
* :mod:`._launch` -- numpy (Triton interpreter) and torch launchers.
"""

from splat._codegen._cache import cache_dir, load, source
from splat._codegen._ops import Call, bwd_calls, fwd_call, sddmm_call, softmax_call, spmm_call
from splat._codegen._spec import KernelSpec, Plan, ResSpec, SegSpec, Tiles, plan, transpose_slots, transposed

__all__ = [
    "Call",
    "KernelSpec",
    "Plan",
    "ResSpec",
    "SegSpec",
    "Tiles",
    "bwd_calls",
    "cache_dir",
    "fwd_call",
    "load",
    "plan",
    "sddmm_call",
    "softmax_call",
    "source",
    "spmm_call",
    "transpose_slots",
    "transposed",
]
