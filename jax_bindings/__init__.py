"""JAX bindings: the backend seam and the pure-JAX backend.

``jax_bindings._dispatch`` documents the backend contract and wraps every
backend in ``custom_vjp`` (outside) and ``custom_vmap`` (inside);
``jax_bindings._pure`` is the pure-JAX backend; ``jax_bindings._triton`` (GPU)
is imported only when selected. Users call ``splat.attention`` and friends.
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
