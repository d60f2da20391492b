"""JAX bindings: the backend seam and the pure-JAX backend.

``jax_bindings._dispatch`` documents the backend contract and wraps every
backend in ``custom_vjp`` (outside) and ``custom_vmap`` (inside);
``jax_bindings._pure`` is the pure-JAX backend; ``jax_bindings._triton`` is the
Triton target (kernel specs, code generator, kernel cache, launchers; its
jax-triton backend module needs a GPU and is imported only when selected).
Imports run one way: ``splat -> jax_bindings -> acsr``; nothing here imports
``splat``. Users call ``splat.attention`` and friends.
"""

from jax_bindings._dispatch import (
    BACKENDS,
    BackendUnavailableError,
    attention,
    attention_with_lse,
    check_backend,
    resolve,
    sddmm,
    softmax,
    spmm,
)

__all__ = [
    "BACKENDS",
    "BackendUnavailableError",
    "attention",
    "attention_with_lse",
    "check_backend",
    "resolve",
    "sddmm",
    "softmax",
    "spmm",
]
