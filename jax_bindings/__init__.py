"""JAX bindings: the backend seam, the backend registry and the backends.

``jax_bindings._dispatch`` documents the backend contract and is its one call
point: ``custom_vjp`` outside, ``custom_vmap`` inside, and ``backend="auto"``
trying the backends of ``jax_bindings._registry`` (for the fused attention in the
order the tuning store ranks them, else the registry's), moving on only when
one raises ``NotImplementedError``. Backends: ``jax_bindings._pure`` (pure JAX,
every platform), and on GPU ``jax_bindings._cuda`` (generated CUDA C++, Hopper),
``jax_bindings._triton`` and ``jax_bindings._cudnn`` (their backend modules
imported only there). ``jax_bindings._disk_cache`` is the kernel cache on disk;
``jax_bindings._tuning`` reads the per-device tuning store; ``jax_bindings._runtime``
builds runtime masks (lengths, segment ids, query positions) and
``jax_bindings._split_merge`` merges a key walk cut into splits (every backend's decode).
Users call ``splat.attention`` and friends.
``jax_bindings._triton`` is the Triton target (kernel specs, code generator, kernel
cache, launchers; its jax-triton backend module needs a GPU). Imports run one way:
``splat -> jax_bindings -> acsr``; nothing here imports ``splat``.
"""

from jax_bindings._dispatch import (
    BACKENDS,
    BackendUnavailableError,
    attention,
    attention_paged,
    attention_with_lse,
    available_backends,
    check_backend,
    sddmm,
    selected_backend,
    softmax,
    spmm,
)

__all__ = [
    "BACKENDS",
    "BackendUnavailableError",
    "attention",
    "attention_paged",
    "attention_with_lse",
    "available_backends",
    "check_backend",
    "sddmm",
    "selected_backend",
    "softmax",
    "spmm",
]
