"""What a process's first Triton lowering pays for besides compiling, and how much of it splat avoids.

The first call of Triton's native argument specialization (``native_specialize_impl``, which
jax-triton calls for every kernel it lowers) imports ``torch`` where it is installed, to
recognise ``torch.Tensor`` by its type. jax-triton specializes no torch tensors (its arguments
are plain objects with ``data_ptr`` and ``dtype``), and an object with ``data_ptr`` gets the
same specialization through Triton's attribute check, so the import buys a JAX process
nothing and cost ~2 s of the first forward+backward from warm caches on the GPU machine.
"""

from __future__ import annotations

import logging
import sys

_log = logging.getLogger(__name__)
_DONE: list[bool] = []  # not empty once specialize_without_torch has run in this process


class _NoTorch:
    """A meta-path finder under which ``import torch`` fails (while Triton initialises)."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is hidden while Triton's specialization initialises")
        return None


def specialize_without_torch() -> None:
    """Initialises Triton's native argument specialization with ``torch`` hidden, once a process.

    Nothing changes where torch is imported already (Triton then finds it at no cost); where
    the initialisation fails, Triton does it at jax-triton's call as before.
    """
    if _DONE:
        return
    _DONE.append(True)
    if "torch" in sys.modules:
        return
    try:
        import triton._C.libtriton as libtriton

        sys.meta_path.insert(0, _NoTorch)  # `import torch` raises ImportError, which Triton clears
        try:
            libtriton.native_specialize_impl(None, 1, False, False, False)
        finally:
            sys.meta_path.remove(_NoTorch)
    except Exception as e:
        _log.debug("splat: Triton's specialization initialises itself (%s: %s)", type(e).__name__, e)
