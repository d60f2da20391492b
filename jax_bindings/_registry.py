"""The backend registry: which backends exist, which can run here, and the order ``"auto"`` tries.

A backend is one module implementing the contract of :mod:`jax_bindings._dispatch`
plus one :class:`Backend` entry in :data:`ENTRIES`. The entries are ordered: that
order is ``"auto"``'s preference where the tuning store has nothing to say, and
:data:`FALLBACK` (``"jax"``, which takes every call on every platform) is always
tried last.

``"auto"`` tries, in :func:`auto_order`, every backend that can run here; the
dispatcher moves to the next one only when a backend raises
``NotImplementedError`` for a call. For the fused attention ops the order comes
from :func:`jax_bindings._tuning.rank_backends` (measured times for this device
kind, else a documented heuristic); for the unfused ops it is the order of
:data:`ENTRIES`.

Example:
  >>> from jax_bindings import _registry
  >>> _registry.names()
  ('cuda', 'triton', 'cudnn', 'jax')
  >>> _registry.available_backends()["jax"] is None   # the pure-JAX backend runs anywhere
  True
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from types import ModuleType

import jax
import jax.numpy as jnp

import acsr
from acsr import ACSR
from jax_bindings import _tuning

# The functions every backend module defines (their meaning: the contract in jax_bindings._dispatch).
CONTRACT_OPS = (
    "attention_fwd",
    "attention_bwd",
    "sddmm",
    "sddmm_bwd",
    "softmax",
    "softmax_bwd",
    "spmm",
    "spmm_bwd",
    "attention_paged",
)
# Optional: a fused attention that JAX differentiates and batches itself (see the contract).
DIFFERENTIABLE_ATTENTION = "attention"
# The fused attention ops, whose backends "auto" ranks by the tuning store (-> the pass timed); the
# unfused ops keep the registry order.
RANKED_OPS = {"attention": "fwd_bwd", "attention_with_lse": "fwd"}


@dataclass(frozen=True)
class Backend:
    """One registered backend.

    Attributes:
      name: the ``backend=`` value that selects it (not ``"auto"``).
      module: import path of the module implementing the contract; imported on
        first use, and only where ``platforms`` allows.
      description: one line: what it runs and what it takes.
      platforms: the ``jax.default_backend()`` values it can run on; None for
        every platform.
    """

    name: str
    module: str
    description: str
    platforms: tuple[str, ...] | None

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name.isidentifier() or self.name == "auto":
            raise ValueError(f"Backend.name must be an identifier other than 'auto', got {self.name!r}")
        if not isinstance(self.module, str) or not self.module:
            raise ValueError(f"Backend.module must be a module path, got {self.module!r}")
        if not isinstance(self.description, str) or "\n" in self.description:
            raise ValueError(f"Backend.description must be one line of text, got {self.description!r}")
        if self.platforms is not None and (
            not isinstance(self.platforms, tuple)
            or not self.platforms
            or not all(isinstance(p, str) and p for p in self.platforms)
        ):
            raise ValueError(
                f"Backend.platforms must be None or a tuple of platform names, got {self.platforms!r}"
            )


ENTRIES: tuple[Backend, ...] = (
    Backend(
        "cuda",
        "jax_bindings._cuda.backend",
        "generated CUDA C++ for Hopper (sm_90a): the fused forward on one-band masks (dense, causal, "
        "windows, block-local, dilated, strided) and N-D neighborhoods, the backward on wide bands, "
        "head dim 128, bfloat16/float16",
        ("gpu",),
    ),
    Backend(
        "triton",
        "jax_bindings._triton.backend",
        "generated Triton kernels: every mask, fused forward and backward, and the unfused ops",
        ("gpu",),
    ),
    Backend(
        "cudnn",
        "jax_bindings._cudnn",
        "cuDNN flash attention (jax.nn.dot_product_attention): full, causal and causal-window masks, "
        "bfloat16/float16",
        ("gpu",),
    ),
    Backend(
        "jax",
        "jax_bindings._pure",
        "pure JAX: every mask and op on every platform (the last resort, and the CPU backend)",
        None,
    ),
)

# Takes every call; "auto" tries it last whatever the ranking says.
FALLBACK = "jax"


class BackendUnavailableError(RuntimeError):
    """A backend was asked for by name but cannot run here (platform, failed import)."""


def names() -> tuple[str, ...]:
    """The registered backend names, in registry order."""
    return tuple(e.name for e in ENTRIES)


# The backend= values at import time: "auto" and every registered name.
BACKENDS: tuple[str, ...] = ("auto", *names())


def entry(name: str) -> Backend:
    """The registry entry called ``name`` (KeyError if none)."""
    for e in ENTRIES:
        if e.name == name:
            return e
    raise KeyError(f"no backend named {name!r}; registered: {names()}")


def check_backend(backend) -> str:
    """Validates a ``backend=`` argument (``"auto"`` or a registered name); returns it.

    Example:
      >>> import jax_bindings
      >>> jax_bindings.check_backend("cudnn")
      'cudnn'
    """
    allowed = ("auto", *names())
    if not isinstance(backend, str) or backend not in allowed:
        raise ValueError(f"backend must be one of {allowed}, got {backend!r}")
    return backend


@functools.cache
def _load(path: str) -> ModuleType | Exception:
    """The module at ``path`` checked against the contract, or why it cannot be used (kept)."""
    try:
        mod = importlib.import_module(path)
    except ImportError as e:  # a backend whose requirements are missing here says so on import
        return e
    missing = [op for op in CONTRACT_OPS if not callable(getattr(mod, op, None))]
    if missing:
        return NotImplementedError(f"backend module {path} lacks {', '.join(missing)}")
    extra = getattr(mod, DIFFERENTIABLE_ATTENTION, None)
    if extra is not None and not callable(extra):
        return NotImplementedError(f"backend module {path}: {DIFFERENTIABLE_ATTENTION} is not callable")
    return mod


def module(name: str) -> ModuleType:
    """The imported module of backend ``name``; raises what its import raised."""
    got = _load(entry(name).module)
    if isinstance(got, Exception):
        raise got
    return got


def unavailable(name: str) -> str | None:
    """Why backend ``name`` cannot run here, or None when it can."""
    e = entry(name)
    platform = jax.default_backend()
    if e.platforms is not None and platform not in e.platforms:
        return f"runs on {' or '.join(e.platforms)} only; jax.default_backend() is {platform!r}"
    got = _load(e.module)
    if isinstance(got, Exception):
        return f"{type(got).__name__}: {got}"
    return None


def available_backends() -> dict[str, str | None]:
    """Every registered backend -> why it cannot be used here, or None when it can.

    Example:
      >>> import jax_bindings
      >>> sorted(jax_bindings.available_backends())
      ['cuda', 'cudnn', 'jax', 'triton']
    """
    return {e.name: unavailable(e.name) for e in ENTRIES}


def unavailable_here() -> dict[str, str]:
    """Backends meant for this platform that cannot run (e.g. the Triton one failing to import on a GPU)."""
    platform = jax.default_backend()
    out = {}
    for e in ENTRIES:
        if e.name != FALLBACK and (e.platforms is None or platform in e.platforms):
            why = unavailable(e.name)
            if why is not None:
                out[e.name] = why
    return out


@functools.lru_cache(maxsize=256)
def family(layout: ACSR) -> str:
    """The pattern family of ``layout`` as the tuning store names it ("other" until acsr can tell)."""
    classify = getattr(acsr, "pattern_family", None)  # acsr._plan adds it; absent in older trees
    return classify(layout) if classify is not None else _family(layout)


def _family(layout: ACSR) -> str:
    return "other"


def auto_order(op: str, layout: ACSR, head_dim: int | None, dtype) -> tuple[str, ...]:
    """The backends ``"auto"`` tries for ``op``, in order: those available here, :data:`FALLBACK` last.

    Args:
      op: a dispatcher op ("attention", "attention_with_lse", "attention_paged", "sddmm", "softmax",
        "spmm").
      layout: the call's mask layout.
      head_dim: ``D`` of the fused attention ops (None for the unfused ones).
      dtype: the inputs' dtype.
    """
    here = [e.name for e in ENTRIES if e.name != FALLBACK and unavailable(e.name) is None]
    if op in RANKED_OPS and head_dim is not None:
        here = _tuning.rank_backends(
            family(layout), layout.q_len, head_dim, jnp.dtype(dtype).name, here, mode=RANKED_OPS[op]
        )
    if FALLBACK in names():
        here.append(FALLBACK)
    return tuple(here)
