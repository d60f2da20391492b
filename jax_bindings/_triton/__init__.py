"""The Triton backend: ACSR layouts -> specialised Triton kernels -> JAX custom calls (internal).

Modules, by concern (each imports only those above it, plus :mod:`acsr`):

* :mod:`.spec`    -- :class:`~.spec.KernelSpec` / :class:`~.spec.Plan` of one kernel, built from
  the backend-neutral walk plan (:mod:`acsr._plan`), and the tile configuration
  (:class:`~.spec.Tiles`, :func:`~.spec.tiles_for`);
* :mod:`.render`  -- Triton source text of a spec, one renderer per kernel op;
* :mod:`.cache`   -- writes it to ``$SPLAT_CACHE_DIR`` (``~/.cache/splat/kernels``),
  imports it, caches by spec; ``SPLAT_DUMP_KERNELS=1`` dumps the source; disk caches of
  compiled PTX and cubins (``SPLAT_NO_DISK_CACHE=1`` turns them off);
* :mod:`.ops`     -- launch descriptions (:class:`~.ops.Call`) per op;
* :mod:`.launch`  -- numpy (Triton interpreter) and torch launchers;
* :mod:`.backend` -- the backend contract of :mod:`jax_bindings._dispatch` through
  jax-triton (needs ``triton``, ``jax_triton`` and a CUDA JAX).

Everything but :mod:`.backend` runs on any machine (tests drive the generated
kernels through Triton's interpreter). The backend functions are attributes of
this package too, so the dispatcher can name ``"jax_bindings._triton"``; they
are loaded on first access, which raises ``ImportError`` where the backend
cannot run.
"""

from __future__ import annotations

import importlib

# The backend contract (jax_bindings._dispatch) and the flags the backend sets at import.
_BACKEND_NAMES = (
    "attention_fwd",
    "attention_bwd",
    "sddmm",
    "sddmm_bwd",
    "softmax",
    "softmax_bwd",
    "spmm",
    "spmm_bwd",
    "COMPILE_CACHE_INSTALLED",
    "MODULE_IMAGES_INSTALLED",
)


def __getattr__(name: str):
    if name in _BACKEND_NAMES:
        backend = importlib.import_module("jax_bindings._triton.backend")  # ImportError without jax-triton
        return getattr(backend, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_BACKEND_NAMES})
